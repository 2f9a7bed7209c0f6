"""Property-based tests (hypothesis): random shapes, masks (fully masked rows included),
scales, mask strategies and inputs.

1. The functional core of each framework against the float64 loop oracle
   (``reference.attention``), outputs and weights, within ``ORACLE["float32"]``; every
   output finite; a query row with nothing to attend to exactly zero.
2. Module level: a random variant of ``cases.VARIANTS``, converted with ``to_flax``,
   passes ``check_parity`` forward and backward.

Deterministic (``derandomize=True``, no example database) so that CI sees the same
examples every run; 100 + 100 examples.  JAX compiles once per new shape and option set,
so the module-level dimensions come from small sets (three (batch, seq) shapes, heads
{1, 2}) and a mask is always passed at its full (B, H, T, T) shape.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from parity_tests.cases import MASKS, VARIANTS
from parity_tests.conftest import HAS_JAX, HAS_TORCH, needs_both

if HAS_JAX and HAS_TORCH:
    # Imported at collection, not inside a test: the first import of flax.nnx raises the
    # recursion limit (jedi, via treescope), which hypothesis reports as a warning (an
    # error here) when it happens during an example.
    import flax.nnx  # noqa: F401
    import torch  # noqa: F401

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = needs_both

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None)
# (batch, seq) of the module-level test: batch 1 and 2, seq 1, 4 and 6 all occur, but
# each module compiles for at most three shapes (x2 heads for the multi-head variants):
# a compilation costs ~0.4 s, a cached example ~0.04 s.
MODULE_SHAPES = ((2, 1), (1, 4), (2, 6))
MASK_LAYOUTS = ("none", "full", "query-key", "keys-per-batch", "shared-heads")


# --------------------------------------------------------------------------- functional core


@st.composite
def attention_problems(draw: Any) -> dict[str, Any]:
    batch, heads = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    q_len, kv_len = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    return {
        "batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len,
        "head_dim": draw(st.sampled_from([2, 4])),
        "value_dim": draw(st.sampled_from([3, 4])),
        "mask_layout": draw(st.sampled_from(MASK_LAYOUTS)),
        "density": draw(st.sampled_from([0.3, 0.7, 1.0])),
        "dead_rows": draw(st.integers(0, 2)),  # query rows that may attend to nothing
        "scale": draw(st.none() | st.floats(0.05, 2.0)),
        "mask_strategy": draw(st.sampled_from(["fill", "renormalize"])),
        "causal": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _make_problem(p: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(p["seed"])
    b, h, t, s = p["batch"], p["heads"], p["q_len"], p["kv_len"]
    q = rng.standard_normal((b, h, t, p["head_dim"])).astype(np.float32)
    k = rng.standard_normal((b, h, s, p["head_dim"])).astype(np.float32)
    v = rng.standard_normal((b, h, s, p["value_dim"])).astype(np.float32)
    shape = {
        "none": None, "full": (b, h, t, s), "query-key": (t, s), "keys-per-batch": (b, 1, 1, s),
        "shared-heads": (b, 1, t, s),
    }[p["mask_layout"]]
    if shape is None:
        return q, k, v, None
    mask = rng.random(shape) < p["density"]
    if p["dead_rows"]:
        if shape[-2] == t:
            for i in rng.choice(t, size=min(p["dead_rows"], t), replace=False):
                mask[..., i, :] = False
        else:  # (B, 1, 1, S): the first example may attend to nothing at all
            mask[0] = False
    return q, k, v, mask


@functools.cache
def _jax_attention(causal: bool, scale: float | None, mask_strategy: str) -> Any:
    import jax

    from jax_attention import functional

    # Compiled per example (shapes and scale differ every time); XLA's optimisation level 0
    # compiles ~40% faster and computes the same operations (no fast-math either way).
    return jax.jit(
        functools.partial(
            functional.dot_product_attention, causal=causal, scale=scale, mask_strategy=mask_strategy,
            return_weights=True,
        ),
        compiler_options={"xla_backend_optimization_level": 0},
    )


@SETTINGS
@given(problem=attention_problems())
def test_functional_cores_match_the_float64_oracle(problem: dict[str, Any]) -> None:
    import jax.numpy as jnp
    import torch

    from parity_tests.harness import compare
    from parity_tests.reference import attention
    from parity_tests.tolerances import ORACLE
    from torch_attention import functional as torch_functional

    q, k, v, mask = _make_problem(problem)
    causal, scale, strategy = problem["causal"], problem["scale"], problem["mask_strategy"]
    resolved = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    want_out, want_w = attention(q, k, v, scale=resolved, mask=mask, causal=causal)

    t_out, t_w = torch_functional.dot_product_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
        mask=None if mask is None else torch.from_numpy(mask),
        causal=causal, scale=scale, mask_strategy=strategy, return_weights=True,
    )
    j_out, j_w = _jax_attention(causal, scale, strategy)(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=None if mask is None else jnp.asarray(mask)
    )

    b, h, t, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    allowed = np.ones((b, h, t, s), bool) if mask is None else np.broadcast_to(mask, (b, h, t, s))
    if causal:
        allowed = allowed & np.tril(np.ones((t, s), bool))
    dead = ~allowed.any(-1)  # (B, H, T): rows with nothing to attend to

    for label, out, weights in (("torch", t_out, t_w), ("jax", j_out, j_w)):
        out, weights = np.asarray(out), np.asarray(weights)
        assert out.shape == (b, h, t, v.shape[-1]) and weights.shape == (b, h, t, s)
        assert out.dtype == weights.dtype == np.float32
        assert np.isfinite(out).all() and np.isfinite(weights).all(), label
        for name, got, want in (("output", out, want_out), ("weights", weights, want_w)):
            finding = compare(f"{label} {name}", got, want, ORACLE["float32"], labels=(label, "oracle"))
            assert finding.ok, finding.describe()
        assert np.all(out[dead] == 0.0) and np.all(weights[dead] == 0.0), label
        assert np.all(weights[~allowed] == 0.0), label  # blocked keys get no weight at all


# --------------------------------------------------------------------------- module level


@SETTINGS
@given(
    variant=st.sampled_from(sorted(VARIANTS)),
    shape=st.sampled_from(MODULE_SHAPES),
    heads=st.sampled_from([1, 2]),
    mask_kind=st.sampled_from(MASKS),
    seed=st.integers(0, 2**31 - 1),
)
def test_modules_convert_and_agree(
    variant: str, shape: tuple[int, int], heads: int, mask_kind: str, seed: int
) -> None:
    import torch

    import torch_attention
    from parity_tests import check_parity, to_flax
    from parity_tests.cases import D_IN, make_mask

    spec = VARIANTS[variant]
    batch, seq = shape
    heads = heads if spec.multihead else 1
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        tm = getattr(torch_attention, spec.cls)(**spec.config(heads))
    fm = to_flax(tm)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((batch, seq, D_IN)) * spec.input_scale).astype(np.float32)
    # Every kind at the one full shape (B, H, T, T), "none" as all True: one compilation
    # per variant and shape instead of one per mask layout.
    mask = make_mask(mask_kind, batch, heads, seq, rng)
    mask = np.broadcast_to(True if mask is None else mask, (batch, heads, seq, seq)).copy()
    report = check_parity(tm, fm, x, mask=mask, grads=True)
    assert report.ok, report.message()
    names = {f.name for f in report.findings}
    assert {"output", "attention weights", "grad input[0]"} <= names
    assert {f"grad {n}" for n, _ in tm.named_parameters()} <= names
    assert np.isfinite(report.torch_results["output"]).all()
