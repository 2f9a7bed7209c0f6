"""Oracle-free properties of the functional cores, on every implementation path of both
frameworks (hypothesis draws the shapes and the values, so a failure shrinks to a
minimal example):

1. Causal prefix invariance: the outputs of the first t queries do not change when the
   later tokens (queries, keys and values) change, or when they are cut off (the
   query and key lengths may differ: causal masks are top-left aligned).
2. Key permutation invariance (no causal mask): permuting the keys and values together,
   and a key mask with them, leaves the output unchanged.
3. Invariance to the values at masked keys: keys blocked for every query (past
   ``kv_lengths`` or blocked by a padding mask (B, 1, 1, S)) holding large numbers, NaN
   or Inf change neither the outputs nor the gradients w.r.t. the queries and the real
   keys and values; in clean inputs the blocked keys get exactly zero gradient.

Properties 2 and 3 draw the mask strategy too ("fill" or "renormalize": a hidden key far
above the visible ones must not underflow a renormalized row).

Comparisons are the same framework against itself: ``PARITY["float32"]`` for outputs,
``GRAD_PARITY["float32"]`` for gradients (a reordered sum rounds differently).  The value
width equals the key width throughout (the properties are about keys, not widths).

JAX runs under ``jax.jit`` (one compiled function per path and option set, cached at
module level, so the examples of one shape share a compilation); hypothesis is
deterministic (``derandomize=True``): the same examples every run, the same examples for
every path, framework and poison of one test.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import GRAD_PARITY, PARITY, Tolerance
from tests.support import HAS_JAX, HAS_TORCH, needs_jax, needs_torch

if HAS_JAX:
    # Imported at collection, not inside an example: the first import of flax.nnx raises
    # the recursion limit (jedi, via treescope), which hypothesis reports as a warning
    # (an error here) when it happens during an example.
    import flax.nnx  # noqa: F401
    import jax
if HAS_TORCH:
    import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra.numpy import arrays  # noqa: E402

SETTINGS = settings(
    deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow],
)
# Examples per test: a new shape costs JAX a compilation (~0.2 s forward, ~0.6 s with
# gradients on the 2-core CPU), PyTorch ~1 ms.
EXAMPLES = {"torch": 25, "jax": 5}
PATHS = ("reference", "fused", "blockwise", "auto")
FRAMEWORKS = [pytest.param("torch", marks=needs_torch), pytest.param("jax", marks=needs_jax)]
OUT_TOL, GRAD_TOL = PARITY["float32"], GRAD_PARITY["float32"]

VALUES = st.floats(-3.0, 3.0, width=32, allow_subnormal=False)
STRATEGIES = st.sampled_from(["fill", "renormalize"])


def tensors(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    return arrays(np.float32, shape, elements=VALUES)


# --------------------------------------------------------------------------- running a path


@functools.cache
def _jax_attend(path: str, causal: bool, mask_strategy: str, grads: bool) -> Callable[..., Any]:
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    def attend(q: Any, k: Any, v: Any, mask: Any, kv_lengths: Any, cotangent: Any) -> Any:
        def loss(q: Any, k: Any, v: Any) -> Any:
            out = dot_product_attention(
                q, k, v, mask=mask, kv_lengths=kv_lengths, causal=causal, mask_strategy=mask_strategy,
                implementation=path,
            )
            return jnp.sum(out * cotangent), out

        if not grads:  # compiles in about half the time
            return loss(q, k, v)[1], ()
        (_, out), gradients = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, gradients

    # XLA's optimisation level 0 compiles ~25% faster and computes the same operations.
    return jax.jit(attend, compiler_options={"xla_backend_optimization_level": 0})


def attend(
    fw: str, path: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool = False,
    mask: np.ndarray | None = None, kv_lengths: np.ndarray | None = None, mask_strategy: str = "fill",
    cotangent: np.ndarray | None = None,
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Output (..., T, Dv) and, given a cotangent, the gradients of sum(output * cotangent)
    w.r.t. q, k, v (else no gradients)."""
    grads = cotangent is not None
    if cotangent is None:
        cotangent = np.ones((*q.shape[:-1], v.shape[-1]), np.float32)
    if fw == "jax":
        import jax.numpy as jnp

        def to_jax(a: np.ndarray | None) -> Any:
            return None if a is None else jnp.asarray(a)

        out, gradients = _jax_attend(path, causal, mask_strategy, grads)(
            *(to_jax(a) for a in (q, k, v, mask, kv_lengths, cotangent))
        )
        return np.asarray(out), tuple(np.asarray(g) for g in gradients)

    from torch_attention.functional import dot_product_attention

    leaves = [torch.from_numpy(a).requires_grad_(grads) for a in (q, k, v)]
    out = dot_product_attention(
        *leaves, causal=causal, mask_strategy=mask_strategy, implementation=path,
        mask=None if mask is None else torch.from_numpy(mask),
        kv_lengths=None if kv_lengths is None else torch.from_numpy(kv_lengths),
    )
    if not grads:
        return out.detach().numpy(), ()
    (out * torch.from_numpy(cotangent)).sum().backward()
    return out.detach().numpy(), tuple(t.grad.numpy() for t in leaves)  # type: ignore[union-attr]


@functools.cache
def refuses(fw: str, path: str, mask_strategy: str) -> bool:
    """Whether a path refuses a mask strategy (a path may, naming the option); the
    properties then hold vacuously."""
    q = np.zeros((1, 1, 1, 1), np.float32)
    try:
        attend(fw, path, q, q, q, mask=np.ones((1, 1, 1, 1), bool), mask_strategy=mask_strategy)
    except ValueError as refusal:
        assert mask_strategy in str(refusal), refusal
        return True
    return False


def assert_close(got: np.ndarray, want: np.ndarray, tol: Tolerance, what: str) -> None:
    """|got - want| <= atol + rtol * |want| (normwise: rtol * max|want|), NaN never close."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(want).all(), f"{what}: the unperturbed result is not finite"
    if got.size == 0:
        return
    scale = np.abs(want).max() if tol.normwise else np.abs(want)
    excess = np.abs(got.astype(np.float64) - want) - (tol.atol + tol.rtol * scale)
    bad = ~(excess <= 0)  # NaN counts as bad
    if bad.any():
        ranked = np.where(bad, np.nan_to_num(excess, nan=np.inf), -np.inf)
        worst = np.unravel_index(int(np.argmax(ranked)), got.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.size} elements differ; "
            f"worst at {tuple(int(i) for i in worst)}: "
            f"got {got[worst]!r}, want {want[worst]!r}"
        )


# --------------------------------------------------------------------------- 1. causal prefix


@st.composite
def prefix_problems(draw: Any) -> dict[str, Any]:
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    q_len, kv_len, width = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    # q_len != kv_len too: top-left alignment (query t sees keys 0..t) is what makes the
    # prefix of both a problem of its own; a bottom-right alignment would fail here.
    shapes = [(batch, heads, n, width) for n in (q_len, kv_len, kv_len)]
    return {
        "qkv": [draw(tensors(shape)) for shape in shapes],
        "later": [draw(tensors(shape)) for shape in shapes],  # replaces tokens t0 and after
        "t0": draw(st.integers(1, min(q_len, kv_len))),
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_causal_prefix_invariance(fw: str, path: str) -> None:
    @settings(SETTINGS, max_examples=EXAMPLES[fw])
    @given(problem=prefix_problems())
    def check(problem: dict[str, Any]) -> None:
        t0 = problem["t0"]
        q, k, v = problem["qkv"]
        changed = [np.concatenate([a[..., :t0, :], b[..., t0:, :]], axis=-2)
                   for a, b in zip(problem["qkv"], problem["later"], strict=True)]
        out, _ = attend(fw, path, q, k, v, causal=True)
        prefix = out[..., :t0, :]
        assert np.isfinite(out).all()
        changed_out, _ = attend(fw, path, *changed, causal=True)
        assert_close(changed_out[..., :t0, :], prefix, OUT_TOL, "later tokens changed")
        cut_out, _ = attend(fw, path, *(a[..., :t0, :] for a in (q, k, v)), causal=True)
        assert_close(cut_out, prefix, OUT_TOL, "later tokens cut off")

    check()


# --------------------------------------------------------------------------- 2. key permutation


@st.composite
def permutation_problems(draw: Any) -> dict[str, Any]:
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    q_len, kv_len, width = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    mask_shape = draw(st.sampled_from([None, (batch, 1, 1, kv_len), (batch, heads, q_len, kv_len)]))
    return {
        "q": draw(tensors((batch, heads, q_len, width))),
        "k": draw(tensors((batch, heads, kv_len, width))),
        "v": draw(tensors((batch, heads, kv_len, width))),
        "mask": None if mask_shape is None else draw(arrays(np.bool_, mask_shape)),
        "mask_strategy": draw(STRATEGIES),
        "order": np.asarray(draw(st.permutations(range(kv_len))), dtype=np.intp),
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_key_permutation_invariance(fw: str, path: str) -> None:
    @settings(SETTINGS, max_examples=EXAMPLES[fw])
    @given(problem=permutation_problems())
    def check(problem: dict[str, Any]) -> None:
        q, k, v, mask, order = (problem[n] for n in ("q", "k", "v", "mask", "order"))
        strategy = problem["mask_strategy"]
        if refuses(fw, path, strategy):
            return
        out, _ = attend(fw, path, q, k, v, mask=mask, mask_strategy=strategy)
        assert np.isfinite(out).all()
        permuted_out, _ = attend(
            fw, path, q, k[..., order, :], v[..., order, :], mask_strategy=strategy,
            mask=None if mask is None else np.ascontiguousarray(mask[..., order]),
        )
        assert_close(permuted_out, out, OUT_TOL, f"keys permuted by {order.tolist()}")

    check()


# --------------------------------------------------------------------------- 3. masked keys

POISONS = {
    "large": (1e4, -1e4),  # (keys, values): a logit ~1e4 above the real ones if not masked
    "nan": (np.nan, np.nan),
    "inf": (np.inf, -np.inf),
}


@st.composite
def padded_problems(draw: Any) -> dict[str, Any]:
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    q_len, kv_len, width = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    if draw(st.booleans()):
        lengths = np.asarray(draw(st.lists(st.integers(0, kv_len), min_size=batch, max_size=batch)), np.int32)
        mask, valid = None, np.arange(kv_len)[None, :] < lengths[:, None]  # (B, S)
    else:
        lengths, mask = None, draw(arrays(np.bool_, (batch, 1, 1, kv_len)))
        valid = mask[:, 0, 0, :]
    return {
        "q": draw(tensors((batch, heads, q_len, width))),
        "k": draw(tensors((batch, heads, kv_len, width))),
        "v": draw(tensors((batch, heads, kv_len, width))),
        "cotangent": draw(tensors((batch, heads, q_len, width))),
        "mask": mask, "kv_lengths": lengths, "valid": valid, "causal": draw(st.booleans()),
        "mask_strategy": draw(STRATEGIES),
    }


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_values_at_masked_keys_never_matter(fw: str, path: str, poison: str) -> None:
    key_fill, value_fill = POISONS[poison]

    @settings(SETTINGS, max_examples=EXAMPLES[fw])
    @given(problem=padded_problems())
    def check(problem: dict[str, Any]) -> None:
        q, k, v, valid = (problem[n] for n in ("q", "k", "v", "valid"))
        options = {n: problem[n] for n in ("mask", "kv_lengths", "causal", "cotangent", "mask_strategy")}
        if refuses(fw, path, problem["mask_strategy"]):
            return
        blocked = ~valid[:, None, :, None]  # (B, 1, S, 1): blocked for every query
        out, (gq, gk, gv) = attend(fw, path, q, k, v, **options)
        assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in (gq, gk, gv))
        # Clean inputs: a blocked key gets no gradient at all.
        assert (np.where(blocked, gk, 0) == 0).all() and (np.where(blocked, gv, 0) == 0).all()
        poisoned_k = np.where(blocked, np.float32(key_fill), k)
        poisoned_v = np.where(blocked, np.float32(value_fill), v)
        p_out, (p_gq, p_gk, p_gv) = attend(fw, path, q, poisoned_k, poisoned_v, **options)
        assert_close(p_out, out, OUT_TOL, f"output, {poison} at blocked keys")
        assert_close(p_gq, gq, GRAD_TOL, f"grad q, {poison} at blocked keys")
        real = np.broadcast_to(~blocked, gk.shape)
        assert_close(p_gk[real], gk[real], GRAD_TOL, f"grad k at real keys, {poison} at blocked keys")
        assert_close(p_gv[real], gv[real], GRAD_TOL, f"grad v at real keys, {poison} at blocked keys")

    check()
