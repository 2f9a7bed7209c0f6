"""Attention sinks (gpt-oss) in the JAX twin's functional API, on every path.

``sinks`` (H,) is one logit per query head that joins each softmax's denominator as a
key with no value (``parity_tests.reference.attention(..., sinks=...)`` is the float64
oracle).  Every implementation runs here: ``"reference"``, ``"blockwise"`` (its unrolled
query blocks, and its long-sequence loops forced onto tiny tiles with
``small_tiles``), ``"fused"`` (on CPU the library's kernel, which has sinks; on a GPU
cuDNN, which has none, so there the tests check that it refuses them by name) and
``"auto"``; against the oracle at ``parity_tests.tolerances``' bars, with causal, windows,
lengths, grouped heads, a dense mask with a fully masked row, soft-capping with a bias,
sinks of +-30 and logits of 1e4, and float64.  Gradients (q, k, v and the sinks) are
compared with the float64 autodiff of the reference path, which is itself checked
against the oracle: its outputs and weights, its q/k/v gradients against the oracle's
by-hand gradients, its sink gradient against central differences of the loop oracle.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from attention_spec.arrays import check_sinks
from attention_spec.planning import SINKS_FUSED_BLOCKER
from parity_tests import reference
from parity_tests.harness import compare
from parity_tests.tolerances import GRAD_ORACLE, ORACLE
from tests.functional.test_structure_options import oracle_gradients, small_tiles
from tests.support import needs_jax, options_key, quick_only, shared_program, tiered

pytestmark = needs_jax

B, H, T, S, D = 2, 4, 9, 13, 8
# +30 outweighs every key of its head (outputs ~1e-13), -30 vanishes beside them
SINKS = np.array([30.0, -30.0, 0.75, -1.5])


def _lengths_mask(lengths: list[int]) -> np.ndarray:
    return (np.arange(S)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]


def _dense_mask() -> np.ndarray:
    mask = np.random.default_rng(7).random((B, 1, T, S)) < 0.6
    mask[1, 0, 4] = False  # a fully masked row
    return mask


def _bias() -> np.ndarray:
    return np.random.default_rng(8).standard_normal((1, H, T, S)).astype(np.float32).astype(np.float64)


@dataclass(frozen=True)
class Case:
    """``call``: the keywords of ``dot_product_attention``; ``oracle``: those of
    ``reference.attention`` (lengths folded into its mask); ``kernel``: the library's CPU
    kernel takes the call (no dense mask, bias or soft-cap), so ``"fused"`` runs."""

    id: str
    kv_heads: int
    call: dict[str, Any] = field(default_factory=dict)
    oracle: dict[str, Any] = field(default_factory=dict)
    kernel: bool = True

    def inputs(self, seed: int = 0, q_len: int = T) -> tuple[np.ndarray, ...]:
        """q, k, v, the cotangent: float64 holding float32 values."""
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal(shape).astype(np.float32).astype(np.float64)
                   for shape in ((B, H, q_len, D), (B, self.kv_heads, S, D), (B, self.kv_heads, S, D)))
        return q, k, v, rng.uniform(0.5, 1.5, (B, H, q_len, D))


CASES = [
    Case("plain", 4),
    Case("gqa-causal", 2, {"causal": True}, {"causal": True}),
    Case("gqa1-window-bottomright", 1, {"window": (3, 1), "alignment": "bottom_right"},
         {"window": (3, 1), "offset": S - T}),
    Case("lengths-causal-empty-example", 2, {"kv_lengths": np.array([6, 0]), "causal": True},
         {"mask": _lengths_mask([6, 0]), "causal": True}),
    Case("mask-fully-masked-row", 2, {"mask": _dense_mask()}, {"mask": _dense_mask()}, kernel=False),
    Case("softcap-bias", 4, {"softcap": 2.0, "bias": _bias()}, {"softcap": 2.0, "bias": _bias()}, kernel=False),
]
BY_ID = {c.id: c for c in CASES}
PATHS = ("reference", "blockwise", "blockwise-tiles", "fused", "auto")
# Each case on two paths, every path on several cases;
# every case on every path with --exhaustive.
CASE_PATHS = tiered("case_id,path", [c.id for c in CASES], PATHS, strength=1,
                    valid=lambda row: "path" not in row or row["path"] != "fused" or BY_ID[row["case_id"]].kernel
                    if "case_id" in row else True)


# One compiled program per call (path, dtype, jit, shapes, options), shared by every test
# that makes the call on other data: the output and the gradients of ``sum(out * cot)``
# together.  Op by op (jax.vjp called eagerly) a new call compiled each of its operations
# on its own, seconds a case; the float64 reference path of ``_expected`` is one program
# per case for the whole file.  Inside jax.vjp the library sees q, k, v and the sinks
# traced either way, and the options concrete (closed over, as they were).  Half
# precision still runs op by op, as an eager caller's call: under jit XLA may keep excess
# precision between operations, which would hide one that the library leaves in half.
_HALF = ("bfloat16", "float16")


def _program(path: str, jit: bool, grads: bool, eager: bool, options: dict[str, Any]) -> Any:
    """The call of ``_run``, jitted unless ``eager`` (its arrays made JAX's here, under the
    caller's x64 flag)."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    arrays: dict[str, Any] = {name: jnp.asarray(a) if isinstance(a, np.ndarray) else a for name, a in options.items()}
    implementation = "blockwise" if path == "blockwise-tiles" else path

    def attend(q_: Any, k_: Any, v_: Any, s_: Any) -> Any:
        return dot_product_attention(q_, k_, v_, sinks=s_, implementation=implementation, **arrays)

    function = jax.jit(attend) if jit else attend

    def output_and_grads(q_: Any, k_: Any, v_: Any, s_: Any, cot_: Any) -> Any:
        out, pullback = jax.vjp(function, q_, k_, v_, s_)
        return out, pullback(cot_.astype(out.dtype))

    call = output_and_grads if grads else function
    return call if eager else jax.jit(call)


def _run(path: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks: np.ndarray, cot: np.ndarray | None,
         dtype: str, *, jit: bool = False, **options: Any) -> dict[str, np.ndarray]:
    """The output of ``dot_product_attention`` on ``path`` in ``dtype`` (``"blockwise-tiles"``:
    the blockwise path's loops on tiny tiles) and, with a cotangent, the gradients of
    ``sum(out * cot)`` w.r.t. q, k, v and the sinks, as float64 NumPy arrays; ``jit``: the
    call jitted on its own, its gradients those of the jitted function."""
    import jax
    import jax.numpy as jnp

    inputs = [jnp.asarray(a, dtype) for a in (q, k, v, sinks)]
    key = ("sinks", path, dtype, jit, cot is None, bool(jax.config.jax_enable_x64), tuple(a.shape for a in inputs),
           options_key(options))
    program = shared_program(key, lambda: _program(path, jit, cot is not None, dtype in _HALF, options))
    with small_tiles() if path == "blockwise-tiles" else contextlib.nullcontext():  # traced on the first call
        if cot is None:
            return {"output": np.asarray(program(*inputs), np.float64)}
        out, grads = program(*inputs, jnp.asarray(cot, dtype))
    result = {"output": np.asarray(out, np.float64)}
    result.update({f"grad {n}": np.asarray(g, np.float64) for n, g in zip(("q", "k", "v", "sinks"), grads, strict=True)})
    return result


def _refuses_sinks_here(path: str) -> bool:
    """Where the fused path has no sinks (cuDNN on a GPU; XLA's kernel where the library's
    CPU kernel is missing), ``"fused"`` refuses them by name: checked here, and True
    tells the caller that there is nothing to compare."""
    if path != "fused":
        return False
    try:
        return _route(implementation="fused").kernel not in ("cpu-kernel", "cpu-decode")
    except ValueError as error:
        assert SINKS_FUSED_BLOCKER in str(error), error
        return True


def _expected(case: Case, q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks: np.ndarray,
              cot: np.ndarray) -> dict[str, np.ndarray]:
    """The oracle's output, and the gradients of the float64 reference path's autodiff
    (``test_the_float64_reference_path_is_the_oracle`` checks them)."""
    import jax

    groups = H // case.kv_heads
    out, _ = reference.attention(q, np.repeat(k, groups, 1), np.repeat(v, groups, 1), scale=1 / math.sqrt(D),
                                 sinks=sinks, **case.oracle)
    with jax.enable_x64(True):
        want = _run("reference", q, k, v, sinks, cot, "float64", **case.call)
    return {**want, "output": out}


def _check(got: dict[str, np.ndarray], want: dict[str, np.ndarray], dtype: str) -> list[float]:
    """Asserts every entry within its tolerance; returns the max errors (``needed``)."""
    findings = [compare(name, got[name], want[name], ORACLE[dtype] if name == "output" else GRAD_ORACLE[dtype],
                        ("jax", "oracle")) for name in want if name in got]
    assert all(f.ok for f in findings), "\n".join(f.describe() for f in findings if not f.ok)
    return [f.needed for f in findings]


@pytest.mark.parametrize(("case_id", "path"), CASE_PATHS)
def test_every_path_against_the_oracle_float32(case_id: str, path: str):
    if _refuses_sinks_here(path):
        return
    case = BY_ID[case_id]
    q, k, v, cot = case.inputs()
    want = _expected(case, q, k, v, SINKS, cot)
    got = _run(path, q, k, v, SINKS, cot, "float32", **case.call)
    _check(got, want, "float32")


# Each case once and each path once by default (strength=0): what the rest would show
# runs by default elsewhere: the cases on every path in float32 above, the float64
# reference path on every case (test_the_float64_reference_path_is_the_oracle, and its
# gradients are those every case here is compared with), causal grouped heads on the
# blockwise path with the lengths case (which has both), the tiny tiles on the lengths
# case under jit.  Every case on every path with --exhaustive.
@pytest.mark.parametrize("case_id,path", tiered(
    "case_id,path", ["gqa-causal", "lengths-causal-empty-example", "softcap-bias"],
    ["reference", "blockwise", "blockwise-tiles", "auto"], strength=0))
def test_float64_against_the_oracle(case_id: str, path: str):
    """float64 stays float64 on every path that takes it (the fused path refuses it)."""
    import jax

    case = BY_ID[case_id]
    q, k, v, cot = case.inputs(seed=1)
    want = _expected(case, q, k, v, SINKS, cot)
    with jax.enable_x64(True):
        got = _run(path, q, k, v, SINKS, cot, "float64", **case.call)
    _check(got, want, "float64")


@pytest.mark.parametrize("path,dtype", tiered("path,dtype", ["reference", "blockwise", "fused"],
                                             ["bfloat16", "float16"], strength=1))
def test_half_precision_computes_in_float32(dtype: str, path: str):
    """Half-precision q, k, v and sinks: the oracle on the rounded inputs, at the dtype's bar."""
    if _refuses_sinks_here(path):
        return
    import jax.numpy as jnp

    case = BY_ID["gqa-causal"]
    q, k, v, cot = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in case.inputs(seed=2))
    sinks = np.asarray(jnp.asarray(SINKS, dtype), np.float64)
    want = _expected(case, q, k, v, sinks, cot)
    got = _run(path, q, k, v, sinks, cot, dtype, **case.call)
    _check(got, want, dtype)


def _large_logits() -> tuple[np.ndarray, ...]:
    """Integer q and k of width 4 (exact logits of up to 1e4 at scale 1) and sinks at the
    median of each head's row maxima plus 0.5: some rows' keys outweigh their sink, some
    the other way round, some by a few units only."""
    rng = np.random.default_rng(3)
    q = rng.integers(-50, 51, (B, H, T, 4)).astype(np.float64)
    k = rng.integers(-50, 51, (B, H, S, 4)).astype(np.float64)
    v = rng.standard_normal((B, H, S, 4)).astype(np.float32).astype(np.float64)
    row_max = (q @ np.swapaxes(k, -1, -2)).max(-1)  # (B, H, T)
    sinks = np.median(row_max.transpose(1, 0, 2).reshape(H, -1), axis=1) + 0.5
    return q, k, v, sinks, rng.uniform(0.5, 1.5, (B, H, T, 4))


@pytest.mark.parametrize("path", ["reference", "blockwise", "blockwise-tiles", "fused"])
def test_logits_of_1e4_against_the_oracle(path: str):
    if _refuses_sinks_here(path):
        return
    q, k, v, sinks, cot = _large_logits()
    assert np.abs(sinks).max() > 1000
    out, weights = reference.attention(q, k, v, scale=1.0, causal=True, sinks=sinks)
    grads = oracle_gradients(q, k, v, weights, cot, 1.0)
    got = _run(path, q, k, v, sinks, cot, "float32", scale=1.0, causal=True)
    _check(got, {"output": out, **grads}, "float32")


def _sink_gradient(weights: np.ndarray, v: np.ndarray, cot: np.ndarray) -> np.ndarray:
    """d sum(out * cot) / d sink_h = -sum_{b,t} p_sink * rowsum(W * dW), p_sink = 1 - rowsum(W)."""
    d_weights = cot @ np.swapaxes(v, -1, -2)
    delta = (weights * d_weights).sum(-1)
    return -((1.0 - weights.sum(-1)) * delta).sum(axis=(0, 2))


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_the_float64_reference_path_is_the_oracle(case_id: str):
    """The float64 reference path (whose autodiff gives the other tests' gradients):
    output and returned weights (the keys' only, summing to less than 1) equal the
    oracle's; without soft-cap and bias its gradients equal the oracle's by hand."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    case = BY_ID[case_id]
    q, k, v, cot = case.inputs(seed=4)
    groups = H // case.kv_heads
    k_rep, v_rep = np.repeat(k, groups, 1), np.repeat(v, groups, 1)
    out, weights = reference.attention(q, k_rep, v_rep, scale=1 / math.sqrt(D), sinks=SINKS, **case.oracle)
    with jax.enable_x64(True):
        arrays: dict[str, Any] = {n: jnp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in case.call.items()}

        @jax.jit  # one program: op by op, each operation compiled on its own cost more
        def with_weights(q_: Any, k_: Any, v_: Any, s_: Any) -> Any:
            return dot_product_attention(q_, k_, v_, sinks=s_, implementation="reference", return_weights=True,
                                         **arrays)

        got_out, got_weights = with_weights(*(jnp.asarray(a) for a in (q, k, v, SINKS)))
        got = _run("reference", q, k, v, SINKS, cot, "float64", **case.call)
    assert np.all(weights.sum(-1) < 1.0)
    findings = [compare("output", got_out, out, ORACLE["float64"]),
                compare("weights", got_weights, weights, ORACLE["float64"])]
    if "softcap" not in case.oracle:
        want = oracle_gradients(q, k, v, weights, cot, 1 / math.sqrt(D))
        want["grad sinks"] = _sink_gradient(weights, v_rep, cot)
        findings += [compare(name, got[name], want[name], GRAD_ORACLE["float64"]) for name in want]
    assert all(f.ok for f in findings), "\n".join(f.describe() for f in findings if not f.ok)


@pytest.mark.parametrize("case_id", ["softcap-bias", "mask-fully-masked-row"])
def test_the_sink_gradient_against_finite_differences_of_the_oracle(case_id: str):
    """The float64 reference path's sink gradient against central differences of the
    loop oracle (step 1e-6): the soft-capped, biased case included, which the by-hand
    gradients do not cover."""
    import jax

    case = BY_ID[case_id]
    q, k, v, cot = case.inputs(seed=5)
    groups = H // case.kv_heads
    k_rep, v_rep = np.repeat(k, groups, 1), np.repeat(v, groups, 1)

    def loss(sinks: np.ndarray) -> float:
        out, _ = reference.attention(q, k_rep, v_rep, scale=1 / math.sqrt(D), sinks=sinks, **case.oracle)
        return float((out * cot).sum())

    step = 1e-6
    numeric = np.array([(loss(SINKS + step * e) - loss(SINKS - step * e)) / (2 * step) for e in np.eye(H)])
    with jax.enable_x64(True):
        got = _run("reference", q, k, v, SINKS, cot, "float64", **case.call)
    np.testing.assert_allclose(got["grad sinks"], numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("path", quick_only(["reference", "blockwise", "blockwise-tiles", "fused", "auto"], 4))
def test_under_jit(path: str):
    """Jitted, with the sinks traced: the oracle's output and the same gradients."""
    if _refuses_sinks_here(path):
        return
    case = BY_ID["lengths-causal-empty-example"]
    q, k, v, cot = case.inputs(seed=6)
    want = _expected(case, q, k, v, SINKS, cot)
    got = _run(path, q, k, v, SINKS, cot, "float32", jit=True, **case.call)
    _check(got, want, "float32")


def test_dropout_acts_on_the_key_weights():
    """A given dropout mask drops key weights after the softmax with the sink: the
    returned weights and output equal the oracle's with the same keep mask."""
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    q, k, v, _ = BY_ID["plain"].inputs(seed=7)
    keep = np.random.default_rng(9).random((B, H, T, S)) > 0.3
    out, weights = reference.attention(q, k, v, scale=1 / math.sqrt(D), sinks=SINKS, keep=keep, rate=0.3)
    got_out, got_weights = dot_product_attention(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v)), sinks=jnp.asarray(SINKS, jnp.float32), dropout_rate=0.3,
        deterministic=False, dropout_mask=jnp.asarray(keep), return_weights=True)
    findings = [compare("output", got_out, out, ORACLE["float32"]),
                compare("weights", got_weights, weights, ORACLE["float32"])]
    assert all(f.ok for f in findings), "\n".join(f.describe() for f in findings if not f.ok)


def test_without_sinks_nothing_changes():
    """``sinks=None`` is the call without the keyword, bit for bit, on every path."""
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    q, k, v, _ = (jnp.asarray(a, jnp.float32) for a in BY_ID["plain"].inputs(seed=8))
    for implementation in ("reference", "blockwise", "fused"):
        np.testing.assert_array_equal(
            dot_product_attention(q, k, v, causal=True, implementation=implementation, sinks=None),
            dot_product_attention(q, k, v, causal=True, implementation=implementation))


# --------------------------------------------------------------------------- routes and errors


def _route(dtype: str = "float32", **options: Any) -> Any:
    import jax.numpy as jnp

    from jax_attention.functional import route

    q, k, v, _ = (jnp.asarray(a, dtype) for a in BY_ID["plain"].inputs())
    return route(q, k, v, sinks=jnp.asarray(SINKS, dtype), **options)


def test_the_cpu_kernel_takes_sinks():
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the library's kernel is on XLA's CPU backend")
    assert _route(implementation="fused").kernel == "cpu-decode"  # T = 9: the forward for few rows
    assert SINKS_FUSED_BLOCKER not in " ".join(_route(implementation="auto").reasons)


@pytest.mark.parametrize("case_id", ["plain", "gqa-causal", "lengths-causal-empty-example"])
def test_the_kernels_blocks_of_rows_take_sinks(case_id: str):
    """The cases above have T = 9 query rows, which the CPU kernel's forward for few rows
    computes (``"cpu-decode"``); with 40 rows its blocks of query rows do
    (``"cpu-kernel"``): against the oracle too, with the same gradients."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import route

    if jax.default_backend() != "cpu":
        pytest.skip("the library's kernel is on XLA's CPU backend")
    case = BY_ID[case_id]
    q, k, v, cot = case.inputs(q_len=40)
    assert route(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), sinks=jnp.asarray(SINKS, jnp.float32),
                 implementation="fused").kernel == "cpu-kernel"
    _check(_run("fused", q, k, v, SINKS, cot, "float32", **case.call), _expected(case, q, k, v, SINKS, cot),
           "float32")


@pytest.mark.parametrize("case", ["float64", "dropout", "mask"])
def test_route_says_why_fused_refuses_sinks(case: str):
    """Where the CPU kernel does not take the call (float64; a dense mask), or off the
    CPU, an explicit ``"fused"`` refuses the sinks by name; ``"auto"`` passes the fused
    path by and says why (on CPU the kernel's own reason; elsewhere the sinks among
    them).  With dropout, which no fused kernel draws, that is the reason even where the
    CPU kernel would take the sinks."""
    import jax

    options: dict[str, Any] = {"dropout_rate": 0.1, "deterministic": False} if case == "dropout" else {}
    if case == "mask":
        options = {"mask": _dense_mask()}
    dtype = "float64" if case == "float64" else "float32"
    on_cpu = jax.default_backend() == "cpu"
    with jax.enable_x64(case == "float64"):
        chosen = _route(dtype, implementation="auto", **options)
        reasons = " ".join(chosen.reasons)
        assert chosen.path != "fused" and "fused" in reasons, chosen.explain()
        if case == "dropout":
            assert "dropout" in reasons, chosen.explain()
        elif not on_cpu:
            assert SINKS_FUSED_BLOCKER in reasons, chosen.explain()
        if not (on_cpu and case == "dropout"):  # the CPU kernel has sinks: it refuses the dropout instead
            with pytest.raises(ValueError, match=re.escape(SINKS_FUSED_BLOCKER)):
                _route(dtype, implementation="fused", **options)


def _check_sinks_message(shape: tuple[int, ...], dtype: str, q_shape: tuple[int, ...],
                         normalization: str) -> tuple[type[Exception], str]:
    try:
        check_sinks(shape, dtype, q_shape, normalization)
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    raise AssertionError("check_sinks accepted bad sinks")


@pytest.mark.parametrize(("sinks", "q_shape", "normalization"), [
    (np.zeros(H + 1, np.float32), (B, H, T, D), "softmax"),
    (np.zeros((1, H), np.float32), (B, H, T, D), "softmax"),
    (np.zeros(H, np.int32), (B, H, T, D), "softmax"),
    (np.zeros(H, np.float32), (B, H, T, D), "sum"),
    (np.zeros(T, np.float32), (T, D), "softmax"),
], ids=["too-many", "2-d", "integer", "sum", "no-heads-axis"])
def test_bad_sinks_raise_check_sinks_errors_before_any_work(monkeypatch, sinks: np.ndarray,
                                                            q_shape: tuple[int, ...], normalization: str):
    import jax.numpy as jnp

    from jax_attention import functional

    def no_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("work started before the sinks were checked")

    monkeypatch.setattr(functional, "_walk", no_work)
    kind, message = _check_sinks_message(sinks.shape, sinks.dtype.name, q_shape, normalization)
    q = jnp.zeros(q_shape, jnp.float32)
    for function in (functional.dot_product_attention, functional.route):
        with pytest.raises(kind) as raised:
            function(q, q, q, sinks=jnp.asarray(sinks), normalization=normalization)
        assert str(raised.value) == message
