"""The JAX fused path on CPU: the library's FlashAttention kernel (``jax_attention/csrc``,
built on first use).  Against the float64 oracle at sizes that cross its query blocks
(96 rows forward, 64 backward) and key tiles (512 keys forward, 128 backward), with
widths that are not whole vectors, grouped heads, windows, offsets and lengths, forward
and backward; the forward for few query rows (a decode step: ``decode.h``, keys read in
place in either layout); keys past a length that hold NaN; rows with nothing to attend
to; half precision; ``auto``'s choice (the kernel where its decision says so: the suite
forces it, ``tests/conftest.py``; ``test_cpu_auto`` measures); the fallback where it
cannot be built; jit and vmap.
(The structure scenarios of ``test_structure_options`` run it too, through ``fused``
and ``auto``.)"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from parity_tests import reference
from parity_tests.harness import compare
from parity_tests.tolerances import GRAD_ORACLE, ORACLE
from tests.functional.test_structure_options import oracle_gradients
from tests.support import needs_jax, options_key, shared_program

pytestmark = needs_jax


@pytest.fixture(autouse=True, scope="module")
def _kernel_built() -> None:
    import jax

    from jax_attention import _cpu_kernel

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernel runs on XLA's CPU backend")
    assert _cpu_kernel.available(), _cpu_kernel.build_error()


def _inputs(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, width: int, v_width: int,
            seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, q_len, width)).astype(np.float32).astype(np.float64)
    k = rng.standard_normal((batch, kv_heads, kv_len, width)).astype(np.float32).astype(np.float64)
    v = rng.standard_normal((batch, kv_heads, kv_len, v_width)).astype(np.float32).astype(np.float64)
    cot = rng.uniform(0.5, 1.5, (batch, heads, q_len, v_width))
    return q, k, v, cot


def _fused(q: np.ndarray, k: np.ndarray, v: np.ndarray, cot: np.ndarray, **options: Any) -> dict[str, np.ndarray]:
    """``dot_product_attention(..., implementation="fused")`` in float32 on q, k, v (options:
    NumPy arrays or Python values): the output and the gradients of ``sum(out * cot)``
    w.r.t. q, k, v, as float64.  Jitted: every case has shapes of its own, and called op by
    op (jax.vjp eagerly) each operation around the kernel compiled apart, twice the time
    (``test_jit_and_vmap``: jitted, the kernel gives eager's numbers)."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    arrays = {name: jnp.asarray(a) if isinstance(a, np.ndarray) else a for name, a in options.items()}

    def output_and_grads(q_: Any, k_: Any, v_: Any, cot_: Any) -> Any:
        out, pullback = jax.vjp(lambda *a: dot_product_attention(*a, implementation="fused", **arrays), q_, k_, v_)
        return out, pullback(cot_)

    program = shared_program(("cpu-kernel", q.shape, k.shape, v.shape, options_key(options)),
                             lambda: jax.jit(output_and_grads))
    out, grads = program(*(jnp.asarray(a, jnp.float32) for a in (q, k, v, cot)))
    return {"output": np.asarray(out, np.float64),
            **{f"grad {n}": np.asarray(g, np.float64) for n, g in zip("qkv", grads, strict=True)}}


def _lengths_mask(lengths: np.ndarray, kv_len: int) -> np.ndarray:
    return (np.arange(kv_len)[None, :] < lengths[:, None])[:, None, None, :]


# (id, batch, heads, kv_heads, T, S, D, Dv, call options, oracle options).  The float64
# loop oracle costs B * H * T * S steps of Python (about 5 us each): the sizes that a case
# is about (blocks and tiles crossed, a span of memory) stay, its batch and heads are as
# few as show it, with at least two (batch, kv head) units where the case is not about
# the backward's split of one unit between threads.
CASES = [
    ("causal-multi-block", 1, 2, 2, 300, 300, 64, 64, {"causal": True}, {"causal": True}),
    ("full-cross-odd", 1, 2, 2, 97, 1100, 40, 24, {}, {}),
    # past 512 keys: two forward key tiles, backward tiles of 128 keys (530: not whole
    # vectors, so V is copied)
    ("causal-gqa-tiles", 1, 4, 2, 530, 530, 64, 80, {"causal": True}, {"causal": True}),
    ("lengths-gqa1", 3, 2, 1, 130, 257, 32, 32, {"kv_lengths": np.array([257, 0, 100])},
     {"mask": _lengths_mask(np.array([257, 0, 100]), 257)}),
    ("window-offset", 1, 2, 2, 260, 600, 64, 64, {"window": (100, 30), "q_offset": 200},
     {"window": (100, 30), "offset": 200}),
    ("bottomright-causal-window-lengths", 2, 2, 2, 150, 640, 16, 16,
     {"causal": True, "window": (300, None), "alignment": "bottom_right", "kv_lengths": np.array([640, 333])},
     {"causal": True, "window": (300, None), "offset": 490, "mask": _lengths_mask(np.array([640, 333]), 640)}),
    ("one-head-split-backward", 1, 1, 1, 520, 520, 64, 64, {"causal": True}, {"causal": True}),
    # up to 512 keys the backward takes tiles of 64 keys: a window, an offset, grouped
    # heads and one (batch, kv head) unit, so its key tiles are split between threads
    ("short-tiles-window-gqa-split", 1, 2, 1, 190, 450, 64, 48, {"window": (70, 20), "q_offset": 100},
     {"window": (70, 20), "offset": 100}),
    ("negative-offset-empty-rows", 1, 2, 2, 40, 30, 8, 8, {"causal": True, "q_offset": -10},
     {"causal": True, "offset": -10}),
    # every example at full length and S, Dv whole vectors: the forward reads V in place
    # (two key tiles of 512 and 128 here, Dv != D, grouped heads; two blocks of rows)
    ("v-in-place-causal-gqa", 2, 4, 2, 112, 640, 64, 48, {"causal": True}, {"causal": True}),
    ("v-in-place-full-lengths-window", 1, 2, 2, 100, 128, 32, 32,
     {"window": (20, 5), "kv_lengths": np.array([128])}, {"window": (20, 5)}),
    # full lengths and whole vectors, but a head's values spread over more than 8 MiB
    # (S * Hkv * Dv floats; wide values rather than many heads, for the oracle's sake):
    # the forward copies them
    ("v-copied-wide-span", 1, 4, 2, 40, 2048, 32, 528, {"causal": True, "alignment": "bottom_right"},
     {"causal": True, "offset": 2008}),
    # at most FEW_QUERY_ROWS query rows: the forward for few rows (decode.h), keys read in
    # place over several 256-key tiles, a tile cut short by a length, an empty example
    ("few-rows-one-token-gqa-lengths", 3, 8, 2, 1, 777, 64, 64, {"kv_lengths": np.array([777, 0, 300])},
     {"mask": _lengths_mask(np.array([777, 0, 300]), 777)}),
    ("few-rows-window-offset-odd-widths", 2, 4, 2, 16, 600, 40, 24,
     {"window": (100, 0), "q_offset": 500, "kv_lengths": np.array([600, 520])},
     {"window": (100, 0), "offset": 500, "mask": _lengths_mask(np.array([600, 520]), 600)}),
    ("few-rows-causal-bottom-right", 1, 3, 3, 5, 1030, 32, 48, {"causal": True, "alignment": "bottom_right"},
     {"causal": True, "offset": 1025}),
]


# left out of the quick tier (``-m "not slow"``): large shapes whose features (grouped heads over
# several tiles, values read in place) other cases cover too
SLOW_CASES = {"causal-gqa-tiles", "v-in-place-causal-gqa"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c[0], marks=pytest.mark.slow if c[0] in SLOW_CASES else ()) for c in CASES]
)
def test_against_the_oracle(case: tuple[Any, ...]):
    _, batch, heads, kv_heads, q_len, kv_len, width, v_width, call, oracle = case
    q, k, v, cot = _inputs(batch, heads, kv_heads, q_len, kv_len, width, v_width)
    scale = 1.0 / math.sqrt(width)
    out, weights = reference.attention(q, k, v, scale=scale, **oracle)
    want = {"output": out, **oracle_gradients(q, k, v, weights, cot, scale)}
    got = _fused(q, k, v, cot, **call)
    findings = [compare("output", got["output"], want["output"], ORACLE["float32"], ("kernel", "oracle"))]
    findings += [compare(g, got[g], want[g], GRAD_ORACLE["float32"], ("kernel", "oracle"))
                 for g in ("grad q", "grad k", "grad v")]
    assert all(f.ok for f in findings), "\n".join(f.describe() for f in findings if not f.ok)


def test_rows_with_nothing_to_attend_to_are_zero():
    """A query before every key (negative offset, causal) and an example of length 0:
    zero output rows, and no gradient flows through them."""
    q, k, v, cot = _inputs(2, 2, 2, 20, 30, 16, 16)
    got = _fused(q, k, v, cot, causal=True, q_offset=-5, kv_lengths=np.array([30, 0]))
    assert np.all(got["output"][:, :, :5] == 0) and np.all(got["output"][1] == 0)
    assert np.all(got["grad q"][:, :, :5] == 0) and np.all(got["grad q"][1] == 0)
    assert np.all(got["grad k"][1] == 0) and np.all(got["grad v"][1] == 0)
    assert all(np.isfinite(a).all() for a in got.values())


def test_keys_past_a_length_never_reach_an_output():
    """NaN and Inf stored past each example's length: the same outputs and gradients as
    with zeros there, and zero gradients for those keys."""
    q, k, v, cot = _inputs(2, 4, 2, 150, 700, 64, 64, seed=3)
    lengths = np.array([700, 333])
    clean = _fused(q, k, v, cot, causal=True, kv_lengths=lengths)
    k[1, :, 333:] = np.nan
    v[1, :, 333:] = np.inf
    dirty = _fused(q, k, v, cot, causal=True, kv_lengths=lengths)
    for name, value in clean.items():
        np.testing.assert_array_equal(dirty[name], value, err_msg=name)
    assert np.all(dirty["grad k"][1, :, 333:] == 0) and np.all(dirty["grad v"][1, :, 333:] == 0)


def test_the_kernel_itself_never_reads_past_a_length():
    """The kernel's own contract, without ``dot_product_attention`` (which hands it keys
    past a length as they are, and zeroes them for the other paths): Inf and NaN in the rows between a length and the
    end of its 16-key vector (333 .. 335) change nothing, forward or backward."""
    import jax.numpy as jnp

    from jax_attention import _cpu_kernel
    from jax_attention._canonical import Operands

    q, k, v, cot = (np.swapaxes(a, 1, 2).astype(np.float32) for a in _inputs(2, 4, 2, 40, 700, 64, 64, seed=5))
    ops = Operands(lengths=jnp.asarray([700, 333], jnp.int32))
    attrs = dict(scale=0.125, offset=0, left=None, right=None)

    def both(k: np.ndarray, v: np.ndarray) -> list[np.ndarray]:
        q_, k_, v_, cot_ = map(jnp.asarray, (q, k, v, cot))
        out, row_max, row_sum = _cpu_kernel.forward(q_, k_, v_, ops, **attrs)
        grads = _cpu_kernel.backward(q_, k_, v_, ops, out, cot_, row_max, row_sum, **attrs)
        return [np.asarray(a) for a in (out, row_max, row_sum, *grads)]

    clean = both(k, v)
    k[1, 333:], v[1, 333:] = np.nan, np.inf
    dirty = both(k, v)
    for got, want in zip(dirty, clean, strict=True):
        np.testing.assert_array_equal(got, want)
    dk, dv = dirty[-3:-1]  # (..., dq, dk, dv, dsinks)
    assert np.all(dk[1, 333:] == 0) and np.all(dv[1, 333:] == 0)


@pytest.mark.parametrize("heads_first", [False, True])
def test_the_forward_for_few_rows_reads_in_place_and_never_past_a_length(heads_first: bool):
    """The forward for few rows (``decode_forward``) on either layout, keys and values
    read where they lie: NaN and Inf past each length change nothing; it equals the
    forward of blocks of rows (whose tiles are larger, so within rounding), grouped
    heads, a window and sinks included."""
    import jax.numpy as jnp

    from jax_attention import _cpu_kernel
    from jax_attention._canonical import Operands

    q, k, v, _ = (np.swapaxes(a, 1, 2).astype(np.float32) for a in _inputs(2, 6, 2, 3, 700, 64, 48, seed=7))
    ops = Operands(lengths=jnp.asarray([700, 333], jnp.int32), sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0, 1.0, -3.0]))
    attrs = dict(scale=0.125, offset=690, left=400, right=0)
    blocks = _cpu_kernel.forward(*map(jnp.asarray, (q, k, v)), ops, **attrs)

    def few(k: np.ndarray, v: np.ndarray) -> list[np.ndarray]:
        swap = (lambda t: np.swapaxes(t, 1, 2)) if heads_first else (lambda t: t)
        out, row_max, row_sum = _cpu_kernel.decode_forward(*(jnp.asarray(swap(t)) for t in (q, k, v)), ops,
                                                           heads_first=heads_first, **attrs)
        return [swap(np.asarray(out)), np.asarray(row_max), np.asarray(row_sum)]

    clean = few(k, v)
    k[1, 333:], v[1, 333:] = np.nan, np.inf
    for got, want in zip(few(k, v), clean, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(clean, blocks, strict=True):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_few_rows_in_either_layout_against_the_oracle(layout: str):
    """``dot_product_attention`` on few rows (``"cpu-decode"``) in either layout, as the
    module's cached steps and a caller holding (B, S, H, D) call it: output and gradients
    against the oracle."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention, route

    q, k, v, cot = _inputs(2, 8, 2, 4, 300, 64, 64, seed=9)
    lengths = np.array([300, 129])
    scale = 1.0 / math.sqrt(64)
    out, weights = reference.attention(q, k, v, scale=scale, mask=_lengths_mask(lengths, 300))
    want = {"output": out, **oracle_gradients(q, k, v, weights, cot, scale)}
    swap = (lambda t: jnp.swapaxes(t, 1, 2)) if layout == "bshd" else (lambda t: t)
    q32, k32, v32 = (swap(jnp.asarray(t, jnp.float32)) for t in (q, k, v))
    assert route(q32, k32, v32, kv_lengths=lengths, layout=layout).kernel == "cpu-decode"

    def attend(q_: Any, k_: Any, v_: Any) -> Any:
        return dot_product_attention(q_, k_, v_, kv_lengths=jnp.asarray(lengths), layout=layout)

    o, pullback = jax.vjp(attend, q32, k32, v32)
    grads = pullback(swap(jnp.asarray(cot, jnp.float32)))
    got = {"output": swap(o), **{f"grad {n}": swap(g) for n, g in zip("qkv", grads, strict=True)}}
    findings = [compare(n, np.asarray(got[n], np.float64), want[n],
                        (ORACLE if n == "output" else GRAD_ORACLE)["float32"], ("kernel", "oracle")) for n in want]
    assert all(f.ok for f in findings), "\n".join(f.describe() for f in findings if not f.ok)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_computes_in_float32(dtype: str):
    """Half-precision inputs are upcast and the output rounded once: equal to the
    float32 kernel on the same (rounded) inputs, rounded to the dtype."""
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    q, k, v, _ = _inputs(2, 4, 2, 200, 200, 64, 64)
    half = [jnp.asarray(a, dtype) for a in (q, k, v)]
    got = dot_product_attention(*half, causal=True, implementation="fused")
    want = dot_product_attention(*(a.astype(jnp.float32) for a in half), causal=True, implementation="fused")
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.astype(dtype), np.float32))


def test_auto_takes_the_kernel_where_it_applies():
    """On CPU, ``auto`` is the kernel for causal / window / lengths calls, bit for bit
    (where its decision takes the kernel, ``_cpu_kernel.auto_declines``; elsewhere the
    blockwise path, see the tests of the decision below), and the blockwise path where
    the kernel does not apply (a dense mask)."""
    import jax.numpy as jnp

    from jax_attention import _cpu_kernel
    from jax_attention.functional import dot_product_attention

    q, k, v, _ = (jnp.asarray(a, jnp.float32) for a in _inputs(2, 4, 4, 130, 130, 64, 64))
    twin = "blockwise" if _cpu_kernel.auto_declines() else "fused"
    for options in ({"causal": True}, {"kv_lengths": jnp.array([130, 7])}, {"window": (5, 5)}):
        auto = dot_product_attention(q, k, v, implementation="auto", **options)
        want = dot_product_attention(q, k, v, implementation=twin, **options)
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(want))
    mask = np.random.default_rng(0).random((2, 4, 130, 130)) < 0.5
    auto = dot_product_attention(q, k, v, implementation="auto", mask=jnp.asarray(mask))
    blockwise = dot_product_attention(q, k, v, implementation="blockwise", mask=jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(blockwise))


def test_without_the_kernel_fused_is_xla_and_auto_blockwise(monkeypatch):
    """Where the kernel cannot be built, the fused path is XLA's kernel and ``auto`` the
    blockwise path, with the same numbers as the kernel within float32 rounding."""
    import jax.numpy as jnp

    from jax_attention import _cpu_kernel
    from jax_attention.functional import dot_product_attention

    q, k, v, _ = (jnp.asarray(a, jnp.float32) for a in _inputs(1, 2, 2, 70, 70, 32, 32))
    kernel = dot_product_attention(q, k, v, causal=True, implementation="fused")
    monkeypatch.setattr(_cpu_kernel, "available", lambda: False)
    monkeypatch.setattr(_cpu_kernel, "_state", {"ok": False, "error": "a stand-in failure", "mode": "auto"})
    for path, twin in (("fused", None), ("auto", "blockwise")):
        if path == "fused":  # an explicit "fused" that falls back says so; "auto" chooses silently
            with pytest.warns(RuntimeWarning, match=r"runs XLA's kernel: .* not available \(a stand-in failure\)"):
                got = dot_product_attention(q, k, v, causal=True, implementation=path)
        else:
            got = dot_product_attention(q, k, v, causal=True, implementation=path)
        np.testing.assert_allclose(np.asarray(got), np.asarray(kernel), rtol=1e-5, atol=1e-5)
        if twin is not None:
            want = dot_product_attention(q, k, v, causal=True, implementation=twin)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_failed_build_is_reported(monkeypatch, tmp_path):
    """A compiler that fails leaves the kernel unavailable, with the compiler's words
    in ``build_error``, and nothing half-written in the cache."""
    from jax_attention import _cpu_kernel

    monkeypatch.setenv("TWIN_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(_cpu_kernel, "_state", {})
    assert not _cpu_kernel.available()
    assert "failed" in (_cpu_kernel.build_error() or "")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # builds the kernel anew (about 25 s); the quick tier runs this machine's build
def test_a_build_for_an_instruction_set_this_cpu_lacks_is_refused(monkeypatch):
    """A library built for an instruction set (AVX-512 here, $TWIN_ATTENTION_MARCH for
    another machine) on a CPU whose flags lack it (avx512f) is refused before its first call (which would die of SIGILL):
    the kernel is unavailable, ``build_error`` names the instruction set, and the fused
    path runs XLA's kernel instead, with the same numbers as the reference."""
    import jax.numpy as jnp

    from jax_attention import _cpu_kernel
    from jax_attention.functional import dot_product_attention

    isa = _cpu_kernel.instruction_set()
    needed = _cpu_kernel._NEEDS_FLAG.get(str(isa))
    if needed is None:
        pytest.skip(f"this machine's build is {isa}: no x86 flag to take away")
    name, _, listed = _cpu_kernel._cpu_flags_line().partition(":")
    lacking = f"{name}: " + " ".join(flag for flag in listed.split() if flag != needed)
    monkeypatch.setattr(_cpu_kernel, "_cpu_flags_line", lambda: lacking)
    monkeypatch.setattr(_cpu_kernel, "_state", {})
    assert not _cpu_kernel.available()
    assert f"built for {isa}" in (_cpu_kernel.build_error() or "")
    assert f"no {needed} among its flags" in (_cpu_kernel.build_error() or "")
    assert _cpu_kernel.auto_declines() == f"the CPU kernel is not available: {_cpu_kernel.build_error()}"
    q, k, v, _ = (jnp.asarray(a, jnp.float32) for a in _inputs(3, 2, 2, 20, 20, 8, 8))
    with pytest.warns(RuntimeWarning, match="not available"):
        fused = dot_product_attention(q, k, v, causal=True, implementation="fused")
    np.testing.assert_allclose(np.asarray(fused),
                               np.asarray(dot_product_attention(q, k, v, causal=True, implementation="reference")),
                               rtol=1e-5, atol=1e-6)


def test_the_kernel_can_be_turned_off_or_required(monkeypatch, tmp_path):
    """$TWIN_ATTENTION_CPU_KERNEL: ``off`` builds and loads nothing (the fused path runs
    XLA's kernel, without a warning, with the reference's numbers); ``require`` turns a
    failed build into a RuntimeError at every ask instead of a fallback; another value is
    a ValueError."""
    import jax.numpy as jnp

    from jax_attention import _cpu_kernel
    from jax_attention.functional import dot_product_attention

    monkeypatch.setenv("TWIN_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.setenv("TWIN_ATTENTION_CPU_KERNEL", "off")
    monkeypatch.setattr(_cpu_kernel, "_state", {})
    assert not _cpu_kernel.available()
    assert _cpu_kernel.build_error() == "turned off ($TWIN_ATTENTION_CPU_KERNEL=off)"
    assert list(tmp_path.iterdir()) == []  # nothing built
    q, k, v, _ = (jnp.asarray(a, jnp.float32) for a in _inputs(3, 2, 2, 20, 20, 8, 8))
    np.testing.assert_allclose(np.asarray(dot_product_attention(q, k, v, causal=True, implementation="fused")),
                               np.asarray(dot_product_attention(q, k, v, causal=True, implementation="reference")),
                               rtol=1e-5, atol=1e-6)
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setenv("TWIN_ATTENTION_CPU_KERNEL", "require")
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(_cpu_kernel, "_state", {})
    for _ in range(2):  # the same refusal at every ask, not only the first
        with pytest.raises(RuntimeError, match=r"TWIN_ATTENTION_CPU_KERNEL=require, and the CPU kernel is not "
                                               r"available: .*failed"):
            _cpu_kernel.available()
    with pytest.raises(RuntimeError, match="=require"):
        dot_product_attention(q, k, v, causal=True, implementation="fused")

    monkeypatch.setenv("TWIN_ATTENTION_CPU_KERNEL", "sometimes")
    monkeypatch.setattr(_cpu_kernel, "_state", {})
    with pytest.raises(ValueError, match=r"must be one of auto, off, require; got 'sometimes'"):
        _cpu_kernel.available()


def test_jit_and_vmap():
    """Under jit, the same numbers as eager; under vmap, those of each slice."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    q, k, v, _ = (jnp.asarray(a, jnp.float32) for a in _inputs(3, 2, 2, 50, 50, 16, 16))

    def attend(q_: Any, k_: Any, v_: Any) -> Any:
        return dot_product_attention(q_, k_, v_, causal=True, implementation="fused")

    eager = attend(q, k, v)
    np.testing.assert_array_equal(np.asarray(jax.jit(attend)(q, k, v)), np.asarray(eager))
    mapped = jax.vmap(attend)(q[:, None], k[:, None], v[:, None])[:, 0]
    np.testing.assert_array_equal(np.asarray(mapped), np.asarray(eager))


def test_only_a_fused_or_auto_call_asks_for_the_kernel(monkeypatch):
    """The reference and blockwise paths never build (or look for) the kernel; an explicit
    fused call does, and so does auto where its decision takes the kernel."""
    import jax.numpy as jnp

    from jax_attention import _cpu_kernel
    from jax_attention.functional import dot_product_attention

    def refuse() -> bool:
        raise AssertionError("the kernel was asked for")

    auto_takes_it = _cpu_kernel.auto_would_decline() is None  # asked before "available" refuses
    monkeypatch.setattr(_cpu_kernel, "available", refuse)
    q = jnp.ones((1, 2, 5, 8), jnp.float32)
    for path in ("reference", "blockwise"):
        dot_product_attention(q, q, q, causal=True, implementation=path)
    with pytest.raises(AssertionError, match="asked for"):
        dot_product_attention(q, q, q, causal=True, implementation="fused")
    if auto_takes_it:  # auto takes the kernel where its decision says so
        with pytest.raises(AssertionError, match="asked for"):
            dot_product_attention(q, q, q, causal=True, implementation="auto")


_PORTABLE_CHECK = """
import numpy as np, jax.numpy as jnp
from jax_attention import _cpu_kernel
from jax_attention.functional import dot_product_attention
assert _cpu_kernel.available(), _cpu_kernel.build_error()
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((2, 2, 300, 40)), jnp.float32) for _ in range(3))
options = dict(causal=True, kv_lengths=jnp.array([300, 90]))
got = np.asarray(dot_product_attention(q, k, v, implementation="fused", **options))
want = np.asarray(dot_product_attention(q, k, v, implementation="reference", **options))
np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)  # NaN fails it
import jax
from jax_attention.functional import linear
x = jnp.asarray(rng.standard_normal((300, 257)), jnp.float32)
w = jnp.asarray(rng.standard_normal((257, 70)) / 16, jnp.float32)
def grads(path):  # x w, dy w^T and x^T dy on the kernel (fused) and on XLA (reference)
    return jax.grad(lambda x_, w_: (linear(x_, w_, implementation=path) ** 2).sum(), (0, 1))(x, w)
for got, want in zip(grads("fused"), grads("reference")):  # normwise, as gradients are compared
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.abs(got - want).max() <= GATOL + GRTOL * np.abs(want).max()
print("ok")
"""


@pytest.fixture(scope="module")
def portable_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a process that builds (once, for the tests below together) and
    runs the kernel for x86-64-v3: AVX2, no AVX-512."""
    import os
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86-64 target")
    return {**os.environ, "TWIN_ATTENTION_CACHE": str(tmp_path_factory.mktemp("avx2-cache")),
            "TWIN_ATTENTION_MARCH": "x86-64-v3", "JAX_PLATFORMS": "cpu"}


def _run_script(script: str, env: dict[str, str]) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow  # builds the kernel anew (about 25 s); the quick tier runs this machine's build
def test_the_portable_build_avx2(portable_cache: dict[str, str]):
    """The kernel built for x86-64-v3 (AVX2, no AVX-512: the vector code's other
    branch, exp and the matrix product's 6 x 16 tile included) in a process of its
    own: the reference path's numbers."""
    from pathlib import Path

    tolerance = ORACLE["float32"]
    gradients = GRAD_ORACLE["float32"]
    script = (_PORTABLE_CHECK.replace("GRTOL", repr(gradients.rtol)).replace("GATOL", repr(gradients.atol))
              .replace("RTOL", repr(tolerance.rtol)).replace("ATOL", repr(tolerance.atol)))
    assert _run_script(script, portable_cache) == "ok"
    assert len(list(Path(portable_cache["TWIN_ATTENTION_CACHE"]).glob("*.so"))) == 1


# Which paths call the kernel (attention forward, matrix product), counted by spies;
# auto's decision made (measured, where the environment leaves it to the measurement)
# before they count.
_SPIES = """
import numpy as np, jax, jax.numpy as jnp
from jax_attention import _cpu_kernel
from jax_attention import functional as F
reason = _cpu_kernel.auto_declines()
calls = []
for name in ("forward", "matmul"):
    real = getattr(_cpu_kernel, name)
    setattr(_cpu_kernel, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
def called(fn):
    del calls[:]
    out = fn()
    return sorted(set(calls)), out
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((2, 2, 130, 32)), jnp.float32) for _ in range(3))
x = jnp.asarray(rng.standard_normal((50, 32)), jnp.float32)
w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
ran = {path: called(lambda path=path: F.dot_product_attention(q, k, v, causal=True, implementation=path))
       for path in ("auto", "fused", "blockwise")}
linear = {path: called(lambda path=path: F.linear(x, w, implementation=path))[0] for path in ("auto", "fused")}
"""

# Whichever auto's decision is, the calls follow it, and route says what ran.
_FOLLOWS = """
assert reason == _cpu_kernel.auto_would_decline(), (reason, _cpu_kernel.auto_would_decline())
assert ran["fused"][0] == ["forward"], ran["fused"][0]
if reason is not None:
    assert ran["auto"][0] == [], ran["auto"][0]
    np.testing.assert_array_equal(np.asarray(ran["auto"][1]), np.asarray(ran["blockwise"][1]))
    assert linear == {"auto": [], "fused": ["matmul"]}, linear
    assert F.cpu_kernel_supports(q, implementation="fused") and not F.cpu_kernel_supports(q, implementation="auto")
    assert F.route(q, k, v, causal=True).reasons == (f"fused: {reason}",)
else:
    assert ran["auto"][0] == ["forward"], ran["auto"][0]
    np.testing.assert_array_equal(np.asarray(ran["auto"][1]), np.asarray(ran["fused"][1]))
    assert linear == {"auto": ["matmul"], "fused": ["matmul"]}, linear
    assert F.route(q, k, v, causal=True).kernel == "cpu-kernel"
"""


def test_auto_and_an_avx2_build(portable_cache: dict[str, str]):
    """Built for x86-64-v3 (AVX2), the kernel runs with 8-float vectors and a 6 x 16 tile.
    ``auto`` takes it or the blockwise path as this build measures on this machine (on
    an AVX-512 CPU XLA's GEMMs use the wider vectors, and the two are close), cached
    beside the build: attention and projections alike follow the decision, and say why;
    an explicit ``"fused"`` runs the kernel either way."""
    env = {name: value for name, value in portable_cache.items() if name != "TWIN_ATTENTION_CPU_AUTO"}
    script = _SPIES + """
assert _cpu_kernel.instruction_set() == "AVX2", _cpu_kernel.instruction_set()
assert reason is None or reason.startswith("the CPU kernel measured slower than blockwise on this machine ("), reason
""" + _FOLLOWS + """
assert _cpu_kernel.auto_record().exists()
print("ok")
"""
    assert _run_script(script, env) == "ok"


@pytest.mark.parametrize("decision", ["kernel", "blockwise"])
def test_auto_follows_its_decision(monkeypatch, decision: str):
    """This machine's build, with ``auto``'s decision forced (``$TWIN_ATTENTION_CPU_AUTO``):
    ``auto`` runs the kernel for attention and projections alike, or neither (the
    blockwise path, bit for bit, and XLA's dot) and says why; ``"fused"`` runs it."""
    import jax.numpy as jnp

    from jax_attention import _cpu_kernel
    from jax_attention import functional as F

    monkeypatch.setenv("TWIN_ATTENTION_CPU_AUTO", decision)
    reason = _cpu_kernel.auto_declines()
    assert reason == _cpu_kernel.auto_would_decline()
    assert reason == (None if decision == "kernel" else "$TWIN_ATTENTION_CPU_AUTO=blockwise passes the CPU kernel by")
    assert _cpu_kernel.auto_basis() == f"forced by $TWIN_ATTENTION_CPU_AUTO={decision}"
    calls: list[str] = []
    for name in ("forward", "matmul"):
        real = getattr(_cpu_kernel, name)
        monkeypatch.setattr(_cpu_kernel, name,
                            lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 40, 16)), jnp.float32)
    ran = {}
    for path in ("auto", "fused", "blockwise"):
        del calls[:]
        out = F.dot_product_attention(q, q, q, causal=True, implementation=path)
        F.linear(q[0, 0], jnp.ones((16, 8), jnp.float32), implementation=path)
        ran[path] = (list(calls), np.asarray(out))
    assert ran["fused"][0] == ["forward", "matmul"] and ran["blockwise"][0] == []
    twin = "fused" if decision == "kernel" else "blockwise"
    assert ran["auto"][0] == ran[twin][0], ran["auto"][0]
    np.testing.assert_array_equal(ran["auto"][1], ran[twin][1])
    chosen = F.route(q, q, q, causal=True)
    assert chosen.kernel == ("cpu-kernel" if decision == "kernel" else "blockwise"), chosen.explain()
    assert chosen.reasons == (() if reason is None else (f"fused: {reason}",))
