"""The structure options of the functional cores, in both frameworks, on every path.

``dot_product_attention`` takes grouped-query key/value heads (k and v with fewer heads
than q), ``window=(left, right)``, ``alignment="top_left" | "bottom_right"``,
``q_offset=`` (an int or a per-example (B,) array: the key position of query 0) and
``segment_ids=`` / ``kv_segment_ids=`` (packed sequences).

(a) Every option, and combinations, against the float64 loop oracle
    (``reference.attention``) in float32: the output, and the gradients w.r.t. q, k and v
    against the oracle's own weights differentiated by hand (independent of both
    frameworks' autograd), and twin against twin.
(b) Grouped heads on the fused path reach the kernel grouped: SDPA gets k with Hkv heads
    and ``enable_gqa=True``; ``jax.nn.dot_product_attention`` gets k with Hkv heads.
(c) Bad structure arguments: the same exception type and the same text in both
    frameworks, on every path, raised before any attention math.
(d) The blockwise path skips the key blocks outside a window: no score product is wider
    than a block's reach, and a NaN in a key/value that only an earlier block can see
    never reaches a later block's rows (the reference path, which multiplies every
    weight, 0 included, by every value, turns those rows into NaN).  Keys and values
    that no query can see get zero gradients on every path, a NaN stored there included.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from attention_spec.masks import kv_segment_ids_message, rank_message
from parity_tests import reference
from parity_tests.harness import compare, full_precision
from parity_tests.tolerances import GRAD_ORACLE, GRAD_PARITY, ORACLE, PARITY
from tests.support import needs_both, needs_jax, needs_torch

PATHS = ("reference", "fused", "blockwise", "auto")
FRAMEWORKS = [pytest.param("torch", marks=needs_torch, id="torch"),
              pytest.param("jax", marks=needs_jax, id="jax")]


# --------------------------------------------------------------------------- running both frameworks


def _to(fw: str, value: Any, dtype: Any = None) -> Any:
    """A NumPy value as a framework array (None and Python values pass through)."""
    if not isinstance(value, np.ndarray):
        return value
    if fw == "torch":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(value))
        return t if dtype is None else t.to(dtype)
    import jax.numpy as jnp

    return jnp.asarray(value) if dtype is None else jnp.asarray(value, dtype)


def run(fw: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, cot: np.ndarray | None = None, *,
        eager: bool = False, **options: Any) -> dict[str, np.ndarray]:
    """``dot_product_attention`` of one framework in float32 on q, k, v; ``options`` hold
    NumPy arrays (mask, kv_lengths, q_offset, segment_ids...) or Python values.  Returns
    the output and, with a cotangent, the gradients of ``sum(out * cot)`` w.r.t. q, k, v.
    JAX computes them as one jitted program, or, with ``eager``, op by op (as a caller
    without jit: XLA then runs each operation as written, where under jit it may fuse a
    transposition into a product and round otherwise)."""
    arrays = {name: _to(fw, value) for name, value in options.items()}
    result: dict[str, np.ndarray] = {}
    with full_precision():
        if fw == "torch":
            import torch

            from torch_attention.functional import dot_product_attention

            tensors = [torch.tensor(a, dtype=torch.float32, requires_grad=cot is not None) for a in (q, k, v)]
            out: Any = dot_product_attention(*tensors, **arrays)
            result["output"] = out.detach().double().numpy()
            if cot is not None:
                (out.double() * torch.from_numpy(cot)).sum().backward()
                for name, t in zip("qkv", tensors, strict=True):
                    assert t.grad is not None
                    result[f"grad {name}"] = t.grad.double().numpy()
            return result
        import jax
        import jax.numpy as jnp

        from jax_attention.functional import dot_product_attention as jax_attention

        # The option arrays are the program's arguments; the other options, and
        # ``small_tiles``' settings, are read as it traces.
        traced = {name: value for name, value in arrays.items() if isinstance(value, jax.Array)}
        fixed = {name: value for name, value in arrays.items() if name not in traced}

        def forward_backward(qkv: list[Any], traced_: dict[str, Any], cot_: Any) -> Any:
            def call(*qkv_: Any) -> Any:
                return jax_attention(*qkv_, **traced_, **fixed)

            if cot_ is None:
                return call(*qkv), None
            out, pullback = jax.vjp(call, *qkv)
            return out, pullback(cot_.astype(out.dtype))

        program = forward_backward if eager else jax.jit(forward_backward)  # op by op, or one program
        inputs = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
        out, grads = program(inputs, traced, None if cot is None else jnp.asarray(cot))
        result["output"] = np.asarray(out, np.float64)
        if grads is not None:
            result.update({f"grad {name}": np.asarray(g, np.float64) for name, g in zip("qkv", grads, strict=True)})
        return result


def oracle_gradients(q: np.ndarray, k: np.ndarray, v: np.ndarray, weights: np.ndarray, cot: np.ndarray,
                     scale: float) -> dict[str, np.ndarray]:
    """Gradients of ``sum(out * cot)`` w.r.t. q, k, v from the oracle's float64 weights
    (B, H, T, S), by hand: dW = cot v^T, dS = W (dW - rowsum(W dW)), dq = scale dS k,
    dk = scale dS^T q, dv = W^T cot; a key/value head sums over its group of query heads.
    A blocked weight is 0, so it passes no gradient."""
    groups = q.shape[1] // k.shape[1]
    k_rep, v_rep = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    d_weights = cot @ np.swapaxes(v_rep, -1, -2)
    d_scores = weights * (d_weights - (weights * d_weights).sum(-1, keepdims=True))
    d_k = scale * np.swapaxes(d_scores, -1, -2) @ q
    d_v = np.swapaxes(weights, -1, -2) @ cot
    b, h, s, d = d_k.shape
    return {"grad q": scale * d_scores @ k_rep,
            "grad k": d_k.reshape(b, h // groups, groups, s, d).sum(2),
            "grad v": d_v.reshape(b, h // groups, groups, s, v.shape[-1]).sum(2)}


# --------------------------------------------------------------------------- (a) against the oracle


@dataclass(frozen=True)
class Scenario:
    """q (B, H, T, D), k and v (B, Hkv, S, D); ``call`` the keywords of the call (NumPy
    arrays or Python values), ``oracle`` those of ``reference.attention`` (mask and
    lengths folded into one bool mask there)."""

    id: str
    q_len: int
    kv_len: int
    heads: int = 4
    kv_heads: int = 4
    batch: int = 2
    call: dict[str, Any] = field(default_factory=dict)
    oracle: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(q, k, v, cot) float64, q, k and v rounded to float32 (what the twins see)."""
        rng = np.random.default_rng(self.seed)
        shapes = [(self.batch, self.heads, self.q_len, 8), (self.batch, self.kv_heads, self.kv_len, 8),
                  (self.batch, self.kv_heads, self.kv_len, 8)]
        q, k, v = (rng.standard_normal(s).astype(np.float32).astype(np.float64) for s in shapes)
        cot = rng.uniform(0.5, 1.5, (self.batch, self.heads, self.q_len, 8))
        return q, k, v, cot


def _lengths_mask(lengths: np.ndarray, kv_len: int) -> np.ndarray:
    return (np.arange(kv_len)[None, :] < lengths[:, None])[:, None, None, :]


def _segments(rng: np.random.Generator, batch: int, length: int, counts: tuple[int, ...]) -> np.ndarray:
    rows = []
    for count in counts:
        cuts = np.sort(rng.choice(np.arange(1, length), size=count - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(length), side="right"))
    return np.stack(rows[:batch]).astype(np.int64)


def _scenarios() -> list[Scenario]:
    rng = np.random.default_rng(2024)
    out: list[Scenario] = []
    # grouped heads: H 4 over Hkv 2 (h // 2, not h % 2: a swapped mapping shows) and over 1
    out.append(Scenario("gqa-4of2", 5, 9, kv_heads=2))
    out.append(Scenario("gqa-4of1-causal", 9, 5, kv_heads=1, call={"causal": True}, oracle={"causal": True}))
    # windows, without and with causal, more and fewer queries than keys
    for window in ((2, None), (1, 1), (None, 0), (0, 0), (3, 2)):
        name = "win" + "_".join("inf" if w is None else str(w) for w in window)
        out.append(Scenario(f"{name}-T5S9", 5, 9, call={"window": window}, oracle={"window": window}))
        out.append(Scenario(f"{name}-causal-T9S5", 9, 5, call={"window": window, "causal": True},
                            oracle={"window": window, "causal": True}))
    # alignment
    for t, s in ((4, 9), (9, 4), (7, 7)):
        out.append(Scenario(f"bottomright-causal-T{t}S{s}", t, s,
                            call={"causal": True, "alignment": "bottom_right"},
                            oracle={"causal": True, "offset": s - t}))
    out.append(Scenario("bottomright-win2_1-T3S9", 3, 9, call={"window": (2, 1), "alignment": "bottom_right"},
                        oracle={"window": (2, 1), "offset": 6}))
    # q_offset: a static int, and per-example arrays (negative and past the keys included)
    out.append(Scenario("qoffset-int-causal-win3", 4, 10, call={"causal": True, "window": (3, None), "q_offset": 4},
                        oracle={"causal": True, "window": (3, None), "offset": 4}))
    offsets = np.array([5, -2])
    out.append(Scenario("qoffset-array-causal", 4, 9, call={"causal": True, "q_offset": offsets},
                        oracle={"causal": True, "offset": offsets}))
    offsets = np.array([0, 7])
    out.append(Scenario("qoffset-array-win1_1-gqa", 6, 9, kv_heads=2, call={"window": (1, 1), "q_offset": offsets},
                        oracle={"window": (1, 1), "offset": offsets}))
    # segments: self-attention (kv ids default to the query ids) and cross-attention
    seg = _segments(rng, 2, 8, (3, 2))
    out.append(Scenario("segments", 8, 8, call={"segment_ids": seg}, oracle={"segment_ids": seg}))
    seg_q, seg_k = np.array([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]]), np.array([[0] * 3 + [1] * 3 + [2] * 3,
                                                                          [0, 0, 1, 1, 1, 1, 1, 3, 3]])
    out.append(Scenario("segments-cross", 5, 9, call={"segment_ids": seg_q, "kv_segment_ids": seg_k},
                        oracle={"segment_ids": seg_q, "kv_segment_ids": seg_k}))
    # the combination: segments + causal + window + kv_lengths, grouped heads
    seg = _segments(rng, 2, 10, (3, 2))
    lengths = np.array([8, 10])
    out.append(Scenario("combo-segments-causal-win-lengths-gqa", 10, 10, kv_heads=2,
                        call={"segment_ids": seg, "causal": True, "window": (2, None), "kv_lengths": lengths},
                        oracle={"segment_ids": seg, "causal": True, "window": (2, None),
                                "mask": _lengths_mask(lengths, 10)}))
    # grouped heads with a per-head mask (B, H, T, S) and a fully masked row
    mask = rng.random((2, 4, 6, 7)) < 0.6
    mask[1, 2, 3] = False
    mask[0, 0, 0] = False
    out.append(Scenario("gqa-perhead-mask-fullymasked", 6, 7, kv_heads=2, call={"mask": mask},
                        oracle={"mask": mask}))
    out.append(Scenario("gqa1-perhead-mask-causal-bottomright-lengths", 6, 7, kv_heads=1,
                        call={"mask": mask, "causal": True, "alignment": "bottom_right",
                              "kv_lengths": np.array([7, 0])},
                        oracle={"mask": mask & _lengths_mask(np.array([7, 0]), 7), "causal": True, "offset": 1}))
    # several query blocks on the blockwise path (128 rows each): block edges and windows
    out.append(Scenario("long-win20_5-qoffset-int", 300, 290, heads=2, kv_heads=1, batch=1,
                        call={"window": (20, 5), "q_offset": -7}, oracle={"window": (20, 5), "offset": -7}))
    out.append(Scenario("long-causal-win40-bottomright", 260, 300, heads=1, kv_heads=1, batch=1,
                        call={"window": (40, None), "causal": True, "alignment": "bottom_right"},
                        oracle={"window": (40, None), "causal": True, "offset": 40}))
    return out


SCENARIOS = {s.id: s for s in _scenarios()}
# By default each scenario runs on one path, the paths in turn, so that every path meets
# every kind of scenario (6 or 7 scenarios each); the other three paths of each scenario
# with --exhaustive.
SCENARIO_PATHS = [
    pytest.param(name, path, id=f"{name}-{path}",
                 marks=(() if i % 3 == 0 and path == PATHS[i % len(PATHS)]
                        else (pytest.mark.slow,) if path == PATHS[i % len(PATHS)]
                        else (pytest.mark.slow, pytest.mark.exhaustive)))
    for i, name in enumerate(SCENARIOS) for path in PATHS
]


@functools.cache
def _expected(name: str) -> dict[str, np.ndarray]:
    s = SCENARIOS[name]
    q, k, v, cot = s.inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, weights = reference.attention(q, k, v, scale=scale, **s.oracle)
    return {"output": out, **oracle_gradients(q, k, v, weights, cot, scale)}


@contextlib.contextmanager
def small_tiles(tile: tuple[int, int] = (4, 8), backward_tile: tuple[int, int] = (8, 4)) -> Iterator[None]:
    """JAX's blockwise path in its long-sequence form (key tiles in loops, online
    softmax) at any length, with tiles of (rows, keys) = ``tile`` forward and
    ``backward_tile`` backward: small enough that the scenarios here span many tiles,
    edges and interiors, and different in the two directions, as at full size."""
    from jax_attention import _paths

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_paths, "LONG_SEQUENCE", 1)
        mp.setattr(_paths, "LONG_TILE", tile)
        mp.setattr(_paths, "LONG_BACKWARD_TILE", backward_tile)
        yield


def run_path(fw: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, cot: np.ndarray | None, path: str,
             **options: Any) -> dict[str, np.ndarray]:
    """``run`` on a path; ``"blockwise-tiles"`` is JAX's blockwise path in ``small_tiles``."""
    if path == "blockwise-tiles":
        with small_tiles():
            return run(fw, q, k, v, cot, implementation="blockwise", **options)
    return run(fw, q, k, v, cot, implementation=path, **options)


@functools.cache
def _got(fw: str, name: str, path: str) -> dict[str, np.ndarray]:
    s = SCENARIOS[name]
    q, k, v, cot = s.inputs()
    return run_path(fw, q, k, v, cot, path, **s.call)


def test_the_oracle_gradients_match_finite_differences():
    """The hand-written gradients of the oracle, on a grouped, windowed, offset case,
    against central differences of the loop oracle itself."""
    s = Scenario("fd", 3, 5, heads=2, kv_heads=1, batch=2, oracle={"window": (1, 1), "causal": True,
                                                                   "offset": np.array([1, 3])})
    q, k, v, cot = s.inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])

    def loss(q_: np.ndarray, k_: np.ndarray, v_: np.ndarray) -> float:
        return float((reference.attention(q_, k_, v_, scale=scale, **s.oracle)[0] * cot).sum())

    _, weights = reference.attention(q, k, v, scale=scale, **s.oracle)
    grads = oracle_gradients(q, k, v, weights, cot, scale)
    eps = 1e-6
    rng = np.random.default_rng(0)
    for which, name in enumerate(("grad q", "grad k", "grad v")):
        for _ in range(6):
            arrays = [q.copy(), k.copy(), v.copy()]
            index = tuple(int(rng.integers(0, n)) for n in arrays[which].shape)
            arrays[which][index] += eps
            up = loss(*arrays)
            arrays[which][index] -= 2 * eps
            down = loss(*arrays)
            assert abs((up - down) / (2 * eps) - grads[name][index]) < 1e-6, (name, index)


@pytest.mark.parametrize(("name", "path"), SCENARIO_PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_against_the_oracle(fw: str, name: str, path: str):
    got, want = _got(fw, name, path), _expected(name)
    findings = [compare(f"{fw} output", got["output"], want["output"], ORACLE["float32"], (fw, "oracle"))]
    findings += [compare(f"{fw} {g}", got[g], want[g], GRAD_ORACLE["float32"], (fw, "oracle"))
                 for g in ("grad q", "grad k", "grad v")]
    assert all(f.ok for f in findings), "\n".join(f.describe() for f in findings if not f.ok)


@needs_jax
# every other scenario (the rest with --exhaustive)
@pytest.mark.parametrize("name", [n if i % 8 == 0 else pytest.param(n, marks=pytest.mark.slow) if i % 2 == 0
                                  else pytest.param(n, marks=(pytest.mark.slow, pytest.mark.exhaustive))
                                  for i, n in enumerate(SCENARIOS)])
def test_blockwise_tiles_against_the_oracle(name: str):
    """The long-sequence form of JAX's blockwise path (loops over key tiles), which
    ``auto`` takes from 4096 keys on, in tiles of 4 x 8 so that every scenario crosses
    tile edges: output and gradients against the oracle."""
    test_against_the_oracle("jax", name, "blockwise-tiles")


@needs_both
@pytest.mark.parametrize(("name", "path"), SCENARIO_PATHS)
def test_twin_against_twin(name: str, path: str):
    t, f = _got("torch", name, path), _got("jax", name, path)
    findings = [compare(key, t[key], f[key], (GRAD_PARITY if key.startswith("grad") else PARITY)["float32"])
                for key in t]
    assert all(x.ok for x in findings), "\n".join(x.describe() for x in findings if not x.ok)


def test_the_scenarios_would_catch_a_swapped_head_mapping():
    """Query head h reads key/value head h // (H // Hkv): reading h % Hkv instead changes
    the oracle's output of the 4-over-2 case far beyond its tolerance."""
    s = SCENARIOS["gqa-4of2"]
    q, k, v, _ = s.inputs()
    swapped = k[:, [0, 1, 0, 1]], v[:, [0, 1, 0, 1]]
    wrong, _ = reference.attention(q, *swapped, scale=1 / math.sqrt(8), **s.oracle)
    assert np.abs(wrong - _expected(s.id)["output"]).max() > 100 * ORACLE["float32"].atol


# --------------------------------------------------------------------------- (b) fused GQA, not repeated


GQA_CALLS = {
    "plain": {},
    "causal": {"causal": True},
    "mask-lengths": {"mask": np.tril(np.ones((5, 7), bool)), "kv_lengths": np.array([7, 3])},
    "window-bottomright": {"window": (2, 0), "alignment": "bottom_right"},
}


@needs_torch
@pytest.mark.parametrize("call", list(GQA_CALLS))
def test_torch_fused_hands_sdpa_the_grouped_heads(monkeypatch, call):
    import torch.nn.functional as F

    seen: list[tuple[tuple[int, ...], Any]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((tuple(k.shape), kwargs.get("enable_gqa")))
        assert tuple(v.shape)[:-1] == tuple(k.shape)[:-1]
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    s = Scenario("gqa", 5, 7, heads=4, kv_heads=1, call=GQA_CALLS[call])
    q, k, v, _ = s.inputs()
    got = run("torch", q, k, v, implementation="fused", **s.call)
    assert seen == [((2, 1, 7, 8), True)], seen
    _check_gqa_output(s, got["output"])


@needs_jax
@pytest.mark.parametrize("call", list(GQA_CALLS))
def test_jax_fused_hands_the_kernel_the_grouped_heads(monkeypatch, call):
    """Whichever kernel the fused path runs (``jax.nn.dot_product_attention``, or the
    library's CPU kernel where it takes the call: for these 5 query rows its forward for
    few rows, on the heads-first layout as given), it gets k and v with their Hkv heads,
    (B, S, Hkv, D) or (B, Hkv, S, D), never repeated."""
    import jax

    from jax_attention import _cpu_kernel

    seen: list[tuple[int, ...]] = []

    def spying(real):  # type: ignore[no-untyped-def]
        def spy(query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
            shape = tuple(key.shape)
            seen.append((shape[0], shape[2], shape[1], shape[3]) if kwargs.get("heads_first") else shape)
            assert tuple(value.shape)[:-1] == tuple(key.shape)[:-1]
            return real(query, key, value, *args, **kwargs)
        return spy

    monkeypatch.setattr(jax.nn, "dot_product_attention", spying(jax.nn.dot_product_attention))
    monkeypatch.setattr(_cpu_kernel, "forward", spying(_cpu_kernel.forward))
    monkeypatch.setattr(_cpu_kernel, "decode_forward", spying(_cpu_kernel.decode_forward))
    s = Scenario("gqa", 5, 7, heads=4, kv_heads=1, call=GQA_CALLS[call])
    q, k, v, _ = s.inputs()
    got = run("jax", q, k, v, implementation="fused", **s.call)
    assert seen == [(2, 7, 1, 8)], seen  # (B, S, Hkv, D), in the order of the tokens-first layout
    _check_gqa_output(s, got["output"])


def _check_gqa_output(s: Scenario, output: np.ndarray) -> None:
    q, k, v, _ = s.inputs()
    options = dict(s.call)
    mask = options.pop("mask", None)
    lengths = options.pop("kv_lengths", None)
    if lengths is not None:
        mask = _lengths_mask(lengths, s.kv_len) if mask is None else mask & _lengths_mask(lengths, s.kv_len)
    if options.pop("alignment", "top_left") == "bottom_right":
        options["offset"] = s.kv_len - s.q_len
    want, _ = reference.attention(q, k, v, scale=1 / math.sqrt(8), mask=mask, **options)
    finding = compare("fused output", output, want, ORACLE["float32"], ("fused", "oracle"))
    assert finding.ok, finding.describe()


# --------------------------------------------------------------------------- (c) bad input, one text


@contextlib.contextmanager
def record_math(fw: str) -> Iterator[list[str]]:
    """Records every call of the attention math of ``fw``'s functional core: the matrix
    products, the fused kernels, the reference weights and the blockwise and fused paths."""
    work: list[str] = []

    def counting(owner: Any, name: str) -> Callable[..., Any]:
        real = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            work.append(name)
            return real(*args, **kwargs)

        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        if fw == "torch":
            import torch
            import torch.nn.functional as F

            targets: list[tuple[Any, str]] = [(torch, "matmul"), (F, "scaled_dot_product_attention")]
            from torch_attention import _blockwise as torch_blockwise
            from torch_attention import _fused as torch_fused
            from torch_attention import _reference as torch_reference
            targets += [(torch_reference, "attention_weights"), (torch_blockwise, "blockwise"),
                        (torch_fused, "_fused")]
        else:
            import jax
            import jax.numpy as jnp

            targets = [(jnp, "matmul"), (jax.nn, "dot_product_attention")]
            from jax_attention import _blockwise, _fused, _reference
            targets += [(_reference, "attention_weights"), (_blockwise, "blockwise"), (_fused, "attend")]
        for owner, name in targets:
            mp.setattr(owner, name, counting(owner, name))
        yield work


@dataclass(frozen=True)
class BadCall:
    """q (2, 4, T, 8), k and v (2, kv_heads, S, 8) (or ``rank3``: no batch axis) and
    ``call(fw)``: the keywords; ``exc`` the type, ``text`` the exact message."""

    id: str
    exc: type[Exception]
    text: str
    call: Callable[[str], dict[str, Any]]
    q_len: int = 5
    kv_len: int = 5
    heads: int = 4
    kv_heads: int = 2
    v_heads: int | None = None
    rank3: bool = False


def _ints(fw: str, value: Any, dtype: Any = np.int32) -> Any:
    return _to(fw, np.asarray(value, dtype=dtype))


WINDOW_TYPE = "window must be None or a pair (left, right) of ints >= 0 or None; got {}"
BAD_CALLS = [
    BadCall("window-int", TypeError, WINDOW_TYPE.format(3), lambda fw: {"window": 3}),
    BadCall("window-str", TypeError, WINDOW_TYPE.format("'left'"), lambda fw: {"window": "left"}),
    BadCall("window-one-side", TypeError, WINDOW_TYPE.format("(2,)"), lambda fw: {"window": (2,)}),
    BadCall("window-float", TypeError, WINDOW_TYPE.format("(1.5, None)"), lambda fw: {"window": (1.5, None)}),
    BadCall("window-bool", TypeError, WINDOW_TYPE.format("(True, 1)"), lambda fw: {"window": (True, 1)}),
    BadCall("window-negative-left", ValueError, "window left must be >= 0 or None; got -1",
            lambda fw: {"window": (-1, None)}),
    BadCall("window-negative-right", ValueError, "window right must be >= 0 or None; got -2",
            lambda fw: {"window": (0, -2), "causal": True}),
    BadCall("alignment-unknown", ValueError,
            "alignment must be one of 'top_left', 'bottom_right'; got 'center'", lambda fw: {"alignment": "center"}),
    BadCall("alignment-none", ValueError,
            "alignment must be one of 'top_left', 'bottom_right'; got None", lambda fw: {"alignment": None}),
    BadCall("segment-ids-shape", ValueError,
            "segment_ids must have shape (batch, length) = (2, 5); got shape (2, 4)",
            lambda fw: {"segment_ids": _ints(fw, np.zeros((2, 4)))}),
    BadCall("segment-ids-1d", ValueError,
            "segment_ids must have shape (batch, length) = (2, 5); got shape (5,)",
            lambda fw: {"segment_ids": _ints(fw, np.zeros(5))}),
    BadCall("segment-ids-float", TypeError,
            "segment_ids must hold integers (one segment id per token); got dtype float32",
            lambda fw: {"segment_ids": _ints(fw, np.zeros((2, 5)), np.float32)}),
    BadCall("segment-ids-bool", TypeError,
            "segment_ids must hold integers (one segment id per token); got dtype bool",
            lambda fw: {"segment_ids": _ints(fw, np.zeros((2, 5)), bool)}),
    BadCall("kv-segment-ids-missing", ValueError, kv_segment_ids_message(5, 7),
            lambda fw: {"segment_ids": _ints(fw, np.zeros((2, 5)))}, kv_len=7),
    BadCall("kv-segment-ids-shape", ValueError,
            "kv_segment_ids must have shape (batch, length) = (2, 7); got shape (2, 5)",
            lambda fw: {"segment_ids": _ints(fw, np.zeros((2, 5))), "kv_segment_ids": _ints(fw, np.zeros((2, 5)))},
            kv_len=7),
    BadCall("kv-segment-ids-float", TypeError,
            "kv_segment_ids must hold integers (one segment id per token); got dtype float32",
            lambda fw: {"segment_ids": _ints(fw, np.zeros((2, 5))),
                        "kv_segment_ids": _ints(fw, np.zeros((2, 7)), np.float32)}, kv_len=7),
    BadCall("kv-segment-ids-alone", ValueError, "kv_segment_ids needs segment_ids for the queries",
            lambda fw: {"kv_segment_ids": _ints(fw, np.zeros((2, 5)))}),
    BadCall("segment-ids-rank3", ValueError, rank_message("segment_ids", (4, 5, 8)),
            lambda fw: {"segment_ids": _ints(fw, np.zeros((2, 5)))}, rank3=True, kv_heads=4),
    BadCall("q-offset-float", TypeError, "q_offset must hold integers (the key position of query 0); got 1.5",
            lambda fw: {"q_offset": 1.5, "causal": True}),
    BadCall("q-offset-bool", TypeError, "q_offset must hold integers (the key position of query 0); got True",
            lambda fw: {"q_offset": True, "causal": True}),
    BadCall("q-offset-float-array", TypeError,
            "q_offset must hold integers (the key position of query 0); got dtype float32",
            lambda fw: {"q_offset": _ints(fw, [1, 2], np.float32), "causal": True}),
    BadCall("q-offset-shape", ValueError, "q_offset must be an int or have shape (batch,) = (2,); got shape (3,)",
            lambda fw: {"q_offset": _ints(fw, [1, 2, 3]), "causal": True}),
    BadCall("q-offset-2d", ValueError, "q_offset must be an int or have shape (batch,) = (2,); got shape (2, 1)",
            lambda fw: {"q_offset": _ints(fw, [[1], [2]]), "window": (1, 1)}),
    BadCall("q-offset-rank3", ValueError, rank_message("q_offset", (4, 5, 8)),
            lambda fw: {"q_offset": _ints(fw, [1, 2]), "causal": True}, rank3=True, kv_heads=4),
    BadCall("q-offset-and-bottom-right", ValueError, "give q_offset or alignment='bottom_right', not both",
            lambda fw: {"q_offset": 2, "alignment": "bottom_right", "causal": True}),
    BadCall("q-offset-array-and-bottom-right", ValueError, "give q_offset or alignment='bottom_right', not both",
            lambda fw: {"q_offset": _ints(fw, [0, 1]), "alignment": "bottom_right"}),
    BadCall("heads-not-multiple", ValueError,
            "q, k and v must have the same leading (batch, heads) dimensions, or k and v fewer heads that "
            "divide q's (grouped-query attention); got q (2, 4, 5, 8), k (2, 3, 5, 8), v (2, 3, 5, 8)",
            lambda fw: {}, kv_heads=3),
    BadCall("kv-more-heads-than-q", ValueError,
            "q, k and v must have the same leading (batch, heads) dimensions, or k and v fewer heads that "
            "divide q's (grouped-query attention); got q (2, 4, 5, 8), k (2, 8, 5, 8), v (2, 8, 5, 8)",
            lambda fw: {}, kv_heads=8),
    BadCall("k-v-heads-differ", ValueError,
            "k and v must have the same leading (batch, heads) dimensions; got q (2, 4, 5, 8), k (2, 2, 5, 8), "
            "v (2, 1, 5, 8)", lambda fw: {}, v_heads=1),
]


def _raise(fw: str, bad: BadCall, path: str) -> Exception:
    rng = np.random.default_rng(0)
    lead = () if bad.rank3 else (2,)
    q = rng.standard_normal((*lead, bad.heads, bad.q_len, 8)).astype(np.float32)
    k = rng.standard_normal((*lead, bad.kv_heads, bad.kv_len, 8)).astype(np.float32)
    v = rng.standard_normal((*lead, bad.v_heads or bad.kv_heads, bad.kv_len, 8)).astype(np.float32)
    attend: Callable[..., Any]
    if fw == "torch":
        from torch_attention.functional import dot_product_attention as attend
    else:
        from jax_attention.functional import dot_product_attention as attend
    arrays = [_to(fw, a) for a in (q, k, v)]
    options = bad.call(fw)
    with record_math(fw) as work, pytest.raises(bad.exc) as info:
        attend(*arrays, implementation=path, **options)
    assert not work, f"{fw} {bad.id} ({path}): raised only after the math started: {work}"
    assert type(info.value) is bad.exc
    assert str(info.value) == bad.text, f"{fw} {bad.id}: {str(info.value)!r}"
    return info.value


@pytest.mark.parametrize("bad", BAD_CALLS, ids=[b.id for b in BAD_CALLS])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bad_structure_argument(fw: str, bad: BadCall):
    for path in PATHS:
        _raise(fw, bad, path)


@needs_both
@pytest.mark.parametrize("bad", BAD_CALLS, ids=[b.id for b in BAD_CALLS])
def test_bad_structure_argument_same_text(bad: BadCall):
    for path in PATHS:
        t, f = _raise("torch", bad, path), _raise("jax", bad, path)
        assert type(t) is type(f) and str(t) == str(f)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_record_math_sees_the_math(fw: str):
    """The recorder of (c) is not blind: a valid call on each path records work."""
    q = np.random.default_rng(0).standard_normal((2, 4, 5, 8)).astype(np.float32)
    k = q[:, :2]
    for path in PATHS:
        with record_math(fw) as work:
            run(fw, q, k, k, implementation=path, window=(1, 1), segment_ids=np.zeros((2, 5), np.int32))
        assert work, path


# --------------------------------------------------------------------------- (d) blockwise skips blocks


def _score_widths(fw: str, q: np.ndarray, k: np.ndarray, **options: Any) -> list[tuple[int, int]]:
    """(rows, keys) of every q @ k^T product of a blockwise call (shapes of the first
    operand's rows and the second operand's columns)."""
    shapes: list[tuple[int, int]] = []
    with pytest.MonkeyPatch.context() as mp:
        if fw == "torch":
            import torch

            real_torch = torch.matmul

            def spy_torch(a, b, *args, **kwargs):
                if a.shape[-1] == q.shape[-1]:  # scores: (.., r, D) @ (.., D, s)
                    shapes.append((int(a.shape[-2]), int(b.shape[-1])))
                return real_torch(a, b, *args, **kwargs)

            mp.setattr(torch, "matmul", spy_torch)
        else:
            import jax.numpy as jnp

            real = jnp.matmul

            def spy(a, b, *args, **kwargs):  # traced once per slice function under lax.map
                if a.shape[-1] == q.shape[-1] and b.shape[-2] == q.shape[-1]:
                    shapes.append((int(a.shape[-2]), int(b.shape[-1])))
                return real(a, b, *args, **kwargs)

            mp.setattr(jnp, "matmul", spy)
        run(fw, q, k, k, implementation="blockwise", **options)
    return shapes


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_blockwise_computes_only_the_keys_within_reach(fw: str):
    """T = S = 512 in blocks of 128, window (32, 0): block r0..r1 computes the keys
    r0 - 32 .. r1 only (never all 512); with q_offset=-200 and causal the first block
    sees no key at all and computes nothing."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 512, 8)).astype(np.float32)
    shapes = _score_widths(fw, q, q, window=(32, 0))
    assert shapes == [(128, 128), (128, 160), (128, 160), (128, 160)], shapes
    shapes = _score_widths(fw, q, q, causal=True, q_offset=-200)
    # block 0: positions -200..-73 see nothing; block 1: -72..55 see keys 0..55, ...
    assert shapes == [(128, 56), (128, 184), (128, 312)], shapes
    assert sum(r * s for r, s in shapes) < 512 * 512 / 2


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_blockwise_never_touches_a_value_outside_a_blocks_reach(fw: str):
    """A NaN in the key and value at position 0, which only the first block of queries can
    see (window (32, 0)): the rows of every later block stay finite on the blockwise
    path.  The reference path multiplies every weight (0 included) by every value, so
    there those rows are NaN: the check tells skipping from masking."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 384, 8)).astype(np.float32)
    k, v = q[:, :1].copy(), rng.standard_normal((1, 1, 384, 8)).astype(np.float32)
    k[..., 0, :] = np.nan
    v[..., 0, :] = np.nan
    blockwise = run(fw, q, k, v, implementation="blockwise", window=(32, 0))["output"]
    assert np.isnan(blockwise[..., 0, :]).all()  # query 0 attends to the NaN
    assert np.isfinite(blockwise[..., 128:, :]).all()
    if fw == "jax":  # the long-sequence form, in tiles of 64 rows x 128 keys: the NaN stays in its tile
        cot = np.ones((1, 2, 384, 8))
        with small_tiles((64, 128), (64, 128)):
            tiles = run(fw, q, k, v, cot, implementation="blockwise", window=(32, 0))
        assert np.isnan(tiles["output"][..., 0, :]).all()
        assert np.isfinite(tiles["output"][..., 64:, :]).all() and np.isfinite(tiles["grad q"][..., 64:, :]).all()
        assert np.isfinite(tiles["grad k"][..., 128:, :]).all() and np.isfinite(tiles["grad v"][..., 128:, :]).all()
    reference_path = run(fw, q, k, v, implementation="reference", window=(32, 0))["output"]
    assert np.isnan(reference_path[..., 128:, :]).any()


def _dead_keys_case() -> tuple[np.ndarray, ...]:
    """q (2, 4, 140, 8) at key positions 20..159, window (10, 3): keys 0..9 and 163..299
    are out of every query's reach and hold NaN (k and v (2, 2, 300, 8))."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 140, 8)).astype(np.float32).astype(np.float64)
    k, v = (rng.standard_normal((2, 2, 300, 8)).astype(np.float32).astype(np.float64) for _ in range(2))
    dead = np.zeros(300, bool)
    dead[:10] = True  # before query 0's window (q_offset 20, left 10)
    dead[20 + 139 + 3 + 1:] = True  # after the last query's window (right 3)
    k[..., dead, :] = np.nan
    v[..., dead, :] = np.nan
    cot = rng.uniform(0.5, 1.5, (2, 4, 140, 8))
    return q, k, v, cot, dead


@functools.cache
def _dead_keys_expected() -> np.ndarray:
    q, k, v, _, _ = _dead_keys_case()
    return reference.attention(q, np.nan_to_num(k), np.nan_to_num(v), scale=1 / math.sqrt(8), window=(10, 3),
                               offset=20)[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_keys_outside_every_window_get_no_gradient(fw: str, path: str):
    """Keys and values that no query can see (before the first query's window, after the
    last one's) hold NaN: the output and every gradient stay finite, and their own
    gradients are exactly zero."""
    q, k, v, cot, dead = _dead_keys_case()
    got = run_path(fw, q, k, v, cot, path, window=(10, 3), q_offset=20)
    for name, value in got.items():
        assert np.isfinite(value).all(), name
    assert (got["grad k"][..., dead, :] == 0).all() and (got["grad v"][..., dead, :] == 0).all()
    want = _dead_keys_expected()
    finding = compare("output", got["output"], want, ORACLE["float32"], (fw, "oracle"))
    assert finding.ok, finding.describe()


@needs_jax
def test_blockwise_tiles_give_keys_outside_every_window_no_gradient():
    """As above, on the long-sequence form of JAX's blockwise path (tiles of 4 x 8)."""
    test_keys_outside_every_window_get_no_gradient("jax", "blockwise-tiles")
