"""Chunked local attention (``chunk=C``, Llama 4's ``attention_chunk_size``): the query at
key position p sees key j only where ``(j - o) // C == (p - o) // C``, o the example's
chunk origin (``chunk_origin=``, 0 by default; a module's from its ``positions=``), on
top of causal, a window, lengths, masks and segments (``attention_spec.geometry``).

(a) The geometry: ``key_range`` / ``key_range_traced`` of every block of rows against
    brute force (the blocks the blockwise paths compute, and those every row sees whole).
(b) Every path of both twins (reference, fused, blockwise, the tiled loops in small tiles,
    auto) against the float64 loop oracle, output and gradients, and twin against twin:
    chunks that do and do not divide the lengths, with and without a window, fewer
    queries than keys aligned bottom-right, per-example offsets, grouped heads, lengths
    and segments; a left-padded batch, each row's chunks from its first real token
    (``chunk_origin`` per example: the chunks a dense mask), on every path, and a static
    origin beside a window.  The route: ``auto`` passes the CPU kernel by naming the chunk.
(c) Modules: ``MultiHeadAttention(chunk=)`` with a score mod (the flex path) in both
    twins against the oracle; cached decoding (a prompt, then one-token steps across
    chunk boundaries) equal to the whole sequence in both twins; a left-padded batch at
    ``generate``'s positions (chunks counted from each row's first real token), whole,
    on the flex path and decoded, in both twins against the oracle.
(d) Rings in this process (a group of one, a mesh of one device; zigzag: two pieces in
    different chunks; from 0 and from a chunk origin) equal ``dot_product_attention``,
    output and gradients, in both twins
    (the rings over 2..8 devices run in ``tests/distributed``, on the same geometry).
(e) Bad input and refusals (a bad chunk, a bad chunk origin): one text in both twins;
    exporters refuse the chunk by name.
(f) transformers' own Llama 4: its chunked causal mask (``masking_utils``) is our
    geometry's, and ``Llama4TextAttention`` (a chunked rope layer, tiny) equals ours at
    positions 0..447, output and input gradients, in both twins.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attention_spec.geometry import Reach, key_range, key_range_traced, reach, visible
from parity_tests import reference
from parity_tests.harness import compare, full_precision
from parity_tests.tolerances import GRAD_ORACLE, GRAD_PARITY, ORACLE, PARITY
from tests.functional.test_structure_options import oracle_gradients, run, small_tiles
from tests.support import needs_both, needs_jax, needs_torch

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- (a) the geometry


def _seen(rows: range, kv_len: int, offset: int, band: Reach) -> np.ndarray:
    """(rows, keys) bool by brute force, from the rule the geometry states."""
    p = np.array(rows)[:, None] + offset
    j = np.arange(kv_len)[None, :]
    seen = np.ones((len(rows), kv_len), bool)
    if band.causal:
        seen &= j <= p
    if band.window is not None:
        left, right = band.window
        seen &= True if left is None else (j - p >= -left)
        seen &= True if right is None else (j - p <= right)
    if band.chunk is not None:
        seen &= j // band.chunk == p // band.chunk
    return seen


@pytest.mark.parametrize("band, kv_len, offset", [
    (Reach(causal=True, chunk=4), 13, 0),
    (Reach(causal=False, window=(3, 1), chunk=5), 17, 4),
    (Reach(causal=False, chunk=3), 11, -2),
])
def test_key_ranges_are_the_chunks_seen(band: Reach, kv_len: int, offset: int) -> None:
    """For every block of rows [r0, r1): ``key_range`` is the span of the keys some row
    sees (empty where none), and ``every`` the keys every row sees (the tiled loops'
    interior, which takes no band), both exact for a contiguous visible set."""
    q_len = 12
    for r0 in range(q_len):
        for r1 in range(r0 + 1, q_len + 1):
            seen = _seen(range(r0, r1), kv_len, offset, band)
            some, every = np.flatnonzero(seen.any(0)), np.flatnonzero(seen.all(0))
            lo, hi = key_range(r0, r1, kv_len, offset, band)
            assert (lo, hi) == ((some[0], some[-1] + 1) if some.size else (lo, lo)), (r0, r1)
            assert some.size == hi - lo  # one run: nothing hidden inside the range
            lo, hi = key_range_traced(r0, r1, kv_len, offset, band, every=True)
            assert hi - lo == every.size and (not every.size or lo == every[0]), (r0, r1)


def test_visible_reads_positions_not_lags() -> None:
    """The band depends on the lag, the chunk on both positions: the same lag is seen in
    one chunk and hidden across a boundary."""
    keys, queries = np.array([6, 10]), np.array([8, 12])  # both lags -2
    np.testing.assert_array_equal(visible(keys, queries, 3, 0), [True, True])
    np.testing.assert_array_equal(visible(keys, queries, 3, 0, 16), [True, True])
    np.testing.assert_array_equal(visible(keys, queries, 3, 0, 8), [False, True])
    np.testing.assert_array_equal(visible(keys, queries, None, None, 4), [False, False])
    assert visible(keys, queries, None, None) is None


def test_chunk_origins_are_read_at_each_rows_last_furthest_position() -> None:
    """``chunk_origin``: the key slot of a row's position 0, read where its positions are
    largest (the last such slot: ``generate`` gives pads 1, a row of two real tokens ends
    at 1 too), the queries at ``start`` (a cache's fill) onward."""
    from attention_spec.geometry import chunk_origin

    def furthest(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return p.max(-1), p.shape[-1] - 1 - p[:, ::-1].argmax(-1)

    positions = np.array([[0, 1, 2, 3, 4], [1, 1, 1, 0, 1], [1, 0, 1, 2, 3], [-2, -1, 0, 1, 2]])
    np.testing.assert_array_equal(chunk_origin(positions, 0, furthest), [0, 3, 1, 2])
    np.testing.assert_array_equal(chunk_origin(np.array([[9], [5]]), np.array([12, 7]), furthest), [3, 2])


# --------------------------------------------------------------------------- (b) the paths

# name: (T, S, H, Hkv, the call's options, the oracle's, lengths)
SCENARIOS: dict[str, tuple[int, int, int, int, dict[str, Any], dict[str, Any], list[int] | None]] = {
    # a chunk that divides the length, causal
    "self-causal-C4": (12, 12, 2, 2, {"causal": True, "chunk": 4}, {"causal": True, "chunk": 4}, None),
    # one that does not, fewer queries than keys aligned bottom-right, a window, grouped heads
    "cross-bottom-right-window-C5": (7, 13, 2, 1, {"causal": True, "chunk": 5, "window": (3, None),
                                                   "alignment": "bottom_right"},
                                     {"causal": True, "chunk": 5, "window": (3, None), "offset": 6}, None),
    # per-example offsets (the band a dense mask on every path), a two-sided window, lengths
    "offsets-window-lengths-C6": (9, 14, 2, 2, {"chunk": 6, "window": (4, 2), "q_offset": np.array([0, 5])},
                                  {"chunk": 6, "window": (4, 2), "offset": np.array([0, 5])}, [14, 9]),
    # segments and lengths, no causal: chunks of 3 across packed sequences
    "segments-C3": (10, 10, 2, 1, {"chunk": 3, "segment_ids": np.array([[0] * 6 + [1] * 4, [0] * 10])},
                    {"chunk": 3, "segment_ids": np.array([[0] * 6 + [1] * 4, [0] * 10])}, [10, 8]),
}
_ROTATED = list(SCENARIOS)
_LEFT_PADDED = (np.arange(14)[None, :] >= np.array([0, 3])[:, None])[:, None, None, :]  # row 1: 3 pads
SCENARIOS.update({
    # a left-padded batch, causal: row 1's chunks from its first real token (slot 3), as
    # transformers counts Llama 4's; grouped heads
    "left-padded-origins-C4": (14, 14, 2, 1, {"causal": True, "chunk": 4, "chunk_origin": np.array([0, 3]),
                                              "mask": _LEFT_PADDED},
                               {"causal": True, "chunk": 4, "chunk_origin": np.array([0, 3]), "mask": _LEFT_PADDED},
                               None),
    # a static origin (7: chunks start at 2, 7, 12, ...), not causal, a window narrower on
    # the right than the chunk, per-example offsets, lengths
    "origin-7-window-offsets-C5": (9, 16, 2, 2, {"chunk": 5, "chunk_origin": 7, "window": (6, 2),
                                                 "q_offset": np.array([0, 6])},
                                   {"chunk": 5, "chunk_origin": 7, "window": (6, 2), "offset": np.array([0, 6])},
                                   [16, 13]),
})
TORCH_PATHS = ("reference", "fused", "blockwise", "auto")
JAX_PATHS = ("reference", "fused", "blockwise", "blockwise-tiles", "auto")
# JAX compiles a program per (scenario, path): each path once, the scenarios in rotation;
# the left-padded batch on every path, the static origin on the blockwise path
JAX_RUNS = ([(_ROTATED[i % len(_ROTATED)], path) for i, path in enumerate(JAX_PATHS)]
            + [("left-padded-origins-C4", path) for path in JAX_PATHS]
            + [("origin-7-window-offsets-C5", "blockwise")])


@functools.cache
def _inputs(name: str) -> tuple[np.ndarray, ...]:
    t, s, h, hkv, _, _, _ = SCENARIOS[name]
    rng = np.random.default_rng(len(name))
    return (rng.standard_normal((2, h, t, 4)), rng.standard_normal((2, hkv, s, 4)),
            rng.standard_normal((2, hkv, s, 4)), rng.standard_normal((2, h, t, 4)))


def _call(name: str) -> dict[str, Any]:
    options, lengths = SCENARIOS[name][4], SCENARIOS[name][6]
    return {**options, **({} if lengths is None else {"kv_lengths": np.array(lengths)})}


@functools.cache
def _expected(name: str) -> dict[str, np.ndarray]:
    t, s, _, _, _, oracle, lengths = SCENARIOS[name]
    q, k, v, cot = _inputs(name)
    oracle = dict(oracle)
    mask = oracle.pop("mask", None)
    if lengths is not None:
        valid = (np.arange(s)[None, :] < np.array(lengths)[:, None])[:, None, None, :]
        mask = valid if mask is None else mask & valid
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, weights = reference.attention(q, k, v, scale=scale, mask=mask, **oracle)
    return {"output": out, **oracle_gradients(q, k, v, weights, cot, scale)}


@functools.cache
def _got(fw: str, name: str, path: str) -> dict[str, np.ndarray]:
    q, k, v, cot = _inputs(name)
    if path == "blockwise-tiles":
        with small_tiles():
            return run(fw, q, k, v, cot, implementation="blockwise", **_call(name))
    return run(fw, q, k, v, cot, implementation=path, **_call(name))


def _ok(finding: Any) -> None:
    assert finding.ok, finding.describe()


def _assert_oracle(got: dict[str, np.ndarray], name: str) -> None:
    expected = _expected(name)
    for key, value in expected.items():
        tol = ORACLE["float32"] if key == "output" else GRAD_ORACLE["float32"]
        _ok(compare(key, got[key], value, tol, ("ours", "oracle")))


@needs_torch
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_torch_paths_against_the_oracle(name: str) -> None:
    for path in TORCH_PATHS:
        _assert_oracle(_got("torch", name, path), name)


@needs_jax
@pytest.mark.parametrize("name, path", JAX_RUNS, ids=[f"{n}-{p}" for n, p in JAX_RUNS])
def test_jax_paths_against_the_oracle(name: str, path: str) -> None:
    _assert_oracle(_got("jax", name, path), name)


@needs_both
@pytest.mark.parametrize("name, path", JAX_RUNS, ids=[f"{n}-{p}" for n, p in JAX_RUNS])
def test_twins_agree(name: str, path: str) -> None:
    torch_path = "blockwise" if path == "blockwise-tiles" else path
    for key, value in _got("jax", name, path).items():
        tol = PARITY["float32"] if key == "output" else GRAD_PARITY["float32"]
        _ok(compare(key, _got("torch", name, torch_path)[key], value, tol))


@needs_torch
def test_blockwise_skips_the_keys_outside_the_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 128 rows, chunks of 128, causal: the second block computes its 128 keys,
    not the 256 that causal alone leaves it (and chunks of 64 the same: one block spans
    two of them).  Chunks of 64 from an origin per example (a dense band): the keys
    within 63 of the block's rows, 65..255 for the second."""
    import torch

    from torch_attention import _blockwise
    from torch_attention.functional import dot_product_attention

    widths: list[int] = []
    block = _blockwise._query_block

    def spy(q: Any, k: Any, *args: Any) -> Any:
        widths.append(k.shape[-2])
        return block(q, k, *args)

    monkeypatch.setattr(_blockwise, "_query_block", spy)
    q = torch.randn(1, 1, 256, 4)
    for chunk, expected in ((None, [128, 256]), (128, [128, 128]), (64, [128, 128])):
        widths.clear()
        dot_product_attention(q, q, q, causal=True, chunk=chunk, implementation="blockwise")
        assert widths == expected, chunk
    widths.clear()
    q2 = torch.randn(2, 1, 256, 4)
    dot_product_attention(q2, q2, q2, causal=True, chunk=64, chunk_origin=torch.tensor([0, 5]), implementation="blockwise")
    assert widths == [128, 191]


@needs_jax
def test_jax_routes_around_the_cpu_kernel_naming_the_chunk() -> None:
    """The library's CPU kernel has no chunks: ``auto`` passes it by saying so (no
    measurement decides it), and an explicit ``"fused"`` runs on XLA's kernel."""
    import jax

    from jax_attention.functional import route

    q = jax.ShapeDtypeStruct((1, 2, 64, 8), np.float32)
    r = route(q, q, q, causal=True, chunk=16)
    assert r.path == "blockwise" and r.reasons[0] == "fused: chunk=16: the library's CPU kernel has no chunked attention"
    assert r.basis == ""
    assert route(q, q, q, causal=True, chunk=16, implementation="fused").kernel == "xla"
    assert route(q, q, q, causal=True).path == "fused"  # without the chunk: the kernel


# --------------------------------------------------------------------------- (c) modules

D_IN, HEADS = 8, 2


@functools.cache
def _torch_module(chunk: int, **extra: Any) -> Any:
    import torch

    import torch_attention as ta

    torch.manual_seed(chunk)
    return ta.MultiHeadAttention(D_IN, D_IN, 32, 0.0, HEADS, num_kv_heads=1, chunk=chunk, **extra).eval()


def _oracle_forward(module: Any, x: np.ndarray) -> np.ndarray:
    params = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    return reference.forward("MultiHeadAttention", module.spec.options(), params, x)[0]


def _x(seq: int) -> np.ndarray:
    return np.random.default_rng(seq).standard_normal((2, seq, D_IN))


@needs_both
def test_module_on_the_flex_path_in_both_twins() -> None:
    """A module's score mod that stands for no option (ALiBi) runs on the flex path
    under ``auto``, the chunk a part of the call's mask mod, in both twins."""
    import jax.numpy as jnp
    import torch

    from attention_spec import mods
    from parity_tests.harness import to_flax

    module = _torch_module(5, score_mod=mods.alibi(np.array([0.5, 0.25], np.float32)), window=(7, None))
    x = _x(13)
    expected = _oracle_forward(module, x)
    with full_precision():
        got = module(torch.tensor(x, dtype=torch.float32)).detach().double().numpy()
        twin = np.asarray(to_flax(module)(jnp.asarray(x, jnp.float32)), np.float64)
    _ok(compare("torch flex", got, expected, ORACLE["float32"], ("ours", "oracle")))
    _ok(compare("jax flex", twin, expected, ORACLE["float32"], ("ours", "oracle")))


def _decode(module: Any, x: np.ndarray, prompt: int, fw: str, *, mask: np.ndarray | None = None,
            positions: np.ndarray | None = None) -> np.ndarray:
    """A prompt of ``prompt`` tokens, then one token a step, from an empty cache (Flax:
    jitted steps, two programs: the prompt's and a step's); with ``mask``, the key mask
    (B, 1, 1, 12) of the whole cache at every step (a left-padded prompt's pads False),
    and each step's ``positions`` cut from (B, T)."""
    cache = module.init_cache(x.shape[0], 12)
    keys = None if mask is None else np.pad(mask, [(0, 0)] * 3 + [(0, 12 - mask.shape[-1])], constant_values=True)
    outs = []
    if fw == "jax":
        from flax import nnx

        step = nnx.jit(lambda m, part, c, k, p: m(part, k, cache=c, **({} if p is None else {"positions": p})))
    for start, stop in [(0, prompt), *((i, i + 1) for i in range(prompt, x.shape[1]))]:
        at = None if positions is None else positions[:, start:stop]
        if fw == "torch":
            import torch

            out, cache = module(torch.tensor(x[:, start:stop], dtype=torch.float32),
                                None if keys is None else torch.from_numpy(keys), cache=cache,
                                **({} if at is None else {"positions": torch.from_numpy(at)}))
            outs.append(out.detach().double().numpy())
        else:
            import jax.numpy as jnp

            out, cache = step(module, jnp.asarray(x[:, start:stop], jnp.float32), cache,
                              None if keys is None else jnp.asarray(keys), None if at is None else jnp.asarray(at))
            outs.append(np.asarray(out, np.float64))
    return np.concatenate(outs, axis=1)


@needs_both
def test_decoding_across_chunk_boundaries_equals_the_whole_sequence() -> None:
    """Chunks of 4, a prompt of 6 (inside chunk 1), steps to 11: the steps at 8.. cross
    into chunk 2 and must forget chunk 1; both twins equal the whole sequence and the
    oracle (the cache keeps every key from position 0: the current chunk's included)."""
    import torch

    from parity_tests.harness import to_flax

    module = _torch_module(4)
    x = _x(11)
    expected = _oracle_forward(module, x)
    with full_precision():
        whole = module(torch.tensor(x, dtype=torch.float32)).detach().double().numpy()
        torch_steps = _decode(module, x, 6, "torch")
        jax_steps = _decode(to_flax(module), x, 6, "jax")
    _ok(compare("whole", whole, expected, ORACLE["float32"], ("ours", "oracle")))
    _ok(compare("torch decode", torch_steps, whole, PARITY["float32"], ("steps", "whole")))
    _ok(compare("jax decode", jax_steps, expected, ORACLE["float32"], ("steps", "oracle")))


PADDED_LEN, PADS = 11, 3  # the second row left-padded by 3: its tokens 0.. at slots 3..


@functools.cache
def _rotating_module(**extra: Any) -> Any:
    """Chunks of 4 with rope (a module that takes ``positions=``), grouped heads."""
    import torch

    import torch_attention as ta
    from attention_spec.rope import RopeConfig

    torch.manual_seed(11)
    return ta.MultiHeadAttention(D_IN, D_IN, 32, 0.0, HEADS, num_kv_heads=1, chunk=4, rope=RopeConfig(),
                                 **extra).eval()


def _left_padded() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (2, 11, 8), the key mask (2, 1, 1, 11) and ``generate``'s positions (real tokens
    counted from 0, pads at 1)."""
    from parity_tests.causal_lm import generate_positions

    real = np.ones((2, PADDED_LEN), np.int64)
    real[1, :PADS] = 0
    return _x(PADDED_LEN), real.astype(bool)[:, None, None, :], generate_positions(real)


def _padded_oracle(module: Any) -> np.ndarray:
    x, mask, positions = _left_padded()
    params = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    return reference.forward("MultiHeadAttention", module.spec.options(), params, x, mask, positions=positions)[0]


@needs_both
def test_a_left_padded_module_counts_chunks_from_each_rows_first_token() -> None:
    """At ``generate``'s positions, row 1's chunks are its tokens 0..3, 4..7 (slots 3..6,
    7..10), not slots 0..3, 4..7 (positions 0..10 count the pads: another function, the
    check that the positions matter).  Both twins equal the oracle, whole (PyTorch) and on
    the flex path (an ALiBi score mod: the chunk a part of the call's mask mod, its origin
    per example; Flax under ``nnx.jit``, the origin traced), and a left-padded prompt of 6
    decoded a token at a time (the cache's keys at slots, each step's origin from its
    position; Flax jitted) equals the oracle in both."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from attention_spec import mods
    from parity_tests.harness import to_flax

    x, mask, positions = _left_padded()
    plain, flex = _rotating_module(), _rotating_module(score_mod=mods.alibi(np.array([0.5, 0.25], np.float32)))
    expected = {"plain": _padded_oracle(plain), "flex": _padded_oracle(flex)}
    at_slots = reference.forward("MultiHeadAttention", plain.spec.options(),
                                 {k: v.detach().numpy() for k, v in plain.state_dict().items()}, x, mask,
                                 positions=np.broadcast_to(np.arange(PADDED_LEN), (2, PADDED_LEN)) - np.array([[0], [3]]))[0]
    assert np.abs(at_slots[1, PADS:] - expected["plain"][1, PADS:]).max() < 1e-12  # rope and chunks: the same
    counted = reference.forward("MultiHeadAttention", plain.spec.options(),
                                {k: v.detach().numpy() for k, v in plain.state_dict().items()}, x, mask,
                                positions=np.broadcast_to(np.arange(PADDED_LEN), (2, PADDED_LEN)))[0]
    assert np.abs(counted[1, 4:] - expected["plain"][1, 4:]).max() > 0.05  # pads counted: slots' chunks
    call = nnx.jit(lambda m, x_, mask_, p_: m(x_, mask_, positions=p_))
    with full_precision():
        for name, module in (("plain", plain), ("flex", flex)):
            got = module(torch.tensor(x, dtype=torch.float32), torch.from_numpy(mask),
                         positions=torch.from_numpy(positions)).detach().double().numpy()
            _ok(compare(f"torch {name}", got, expected[name], ORACLE["float32"], ("ours", "oracle")))
        twin = np.asarray(call(to_flax(flex), jnp.asarray(x, jnp.float32), jnp.asarray(mask), jnp.asarray(positions)),
                          np.float64)  # (the plain path's whole call: the decoded prompt's, below)
        _ok(compare("jax flex", twin, expected["flex"], ORACLE["float32"], ("ours", "oracle")))
        for fw, module in (("torch", plain), ("jax", to_flax(plain))):
            steps = _decode(module, x, 6, fw, mask=mask, positions=positions)
            _ok(compare(f"{fw} decode", steps, expected["plain"], ORACLE["float32"], ("steps", "oracle")))


# --------------------------------------------------------------------------- (d) rings

def _ring_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"q": rng.standard_normal((1, 2, 16, 4)).astype(np.float32),
            "k": rng.standard_normal((1, 1, 16, 4)).astype(np.float32),
            "v": rng.standard_normal((1, 1, 16, 4)).astype(np.float32),
            "c": rng.standard_normal((1, 2, 16, 4)).astype(np.float32)}


@needs_torch
def test_torch_ring_over_chunks_equals_one_process(tmp_path: Path) -> None:
    """The PyTorch ring in this process (a group of one), zigzag: its two pieces
    (positions 0..7 and 8..15) meet across chunks of 5, causal and not, and causal from
    an origin of 3 (``chunk_origin``, a left-padded row's): output and gradients equal
    ``dot_product_attention``'s."""
    import torch
    import torch.distributed as dist

    from torch_attention.functional import dot_product_attention
    from torch_attention.parallel import ring_attention

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    group = dist.new_group([dist.get_rank()])
    try:
        inputs = _ring_inputs()
        for causal, origin in ((True, None), (False, None), (True, torch.tensor([3]))):
            mine = [torch.tensor(inputs[n], requires_grad=True) for n in "qkv"]
            whole = [torch.tensor(inputs[n], requires_grad=True) for n in "qkv"]
            out = ring_attention(*mine, group=group, causal=causal, chunk=5, layout="zigzag", chunk_origin=origin)
            want = dot_product_attention(*whole, causal=causal, chunk=5, implementation="reference", chunk_origin=origin)
            for o in (out, want):
                (o * torch.from_numpy(inputs["c"])).sum().backward()
            for name, a, b in zip(("out", "dq", "dk", "dv"), [out, *(t.grad for t in mine)],
                                  [want, *(t.grad for t in whole)], strict=True):
                np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), atol=1e-5, rtol=0,
                                           err_msg=f"{name} causal={causal} origin={origin}")
    finally:
        dist.destroy_process_group(group)
        if started:
            dist.destroy_process_group()


@needs_jax
def test_jax_ring_over_chunks_equals_one_device() -> None:
    """The JAX ring in this process (one device: JAX's device count is fixed at import;
    the eight-device rings run in ``tests/distributed``), zigzag: its two pieces
    (positions 0..7 and 8..15) meet across chunks of 5, causal, from 0 and from an
    origin of 3 (``chunk_origin``): the output equals ``dot_product_attention``'s.  (Its backward reads the same ``_allowed`` as its
    forward; the ring's gradients over chunks are checked on PyTorch's, above: the
    backward's compile would cost this file seconds more.)"""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from jax_attention.functional import dot_product_attention
    from jax_attention.parallel import ring_attention, to_zigzag

    q, k, v, _ = (jnp.asarray(a) for a in _ring_inputs().values())
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))

    def ring(q_: Any, k_: Any, v_: Any, origin: Any) -> Any:
        z = functools.partial(to_zigzag, ring_size=1)
        return ring_attention(z(q_), z(k_), z(v_), mesh=mesh, axis_name="seq", causal=True, chunk=5, layout="zigzag",
                              chunk_origin=origin)

    def one(q_: Any, k_: Any, v_: Any, origin: Any) -> Any:
        return to_zigzag(dot_product_attention(q_, k_, v_, causal=True, chunk=5, implementation="reference",
                                               chunk_origin=origin), 1)

    for origin in (None, jnp.array([3])):
        with full_precision():
            got, want = jax.jit(ring)(q, k, v, origin), one(q, k, v, origin)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0, err_msg=str(origin))
        if origin is None:
            at_zero = got
    assert np.abs(np.asarray(got) - np.asarray(at_zero)).max() > 0.1  # the origin moves the chunks
    got = at_zero
    unchunked = dot_product_attention(q, k, v, causal=True, implementation="reference")
    assert np.abs(np.asarray(got) - np.asarray(unchunked)).max() > 0.1  # the chunks bite


# --------------------------------------------------------------------------- (e) errors and refusals


def _errors(fw: str, **options: Any) -> tuple[type, str]:
    if fw == "torch":
        import torch

        from torch_attention.functional import dot_product_attention
        q: Any = torch.zeros(1, 1, 3, 4)
    else:
        import jax.numpy as jnp

        from jax_attention.functional import dot_product_attention
        q = jnp.zeros((1, 1, 3, 4))
    with pytest.raises((TypeError, ValueError)) as info:
        dot_product_attention(q, q, q, **options)
    return info.type, str(info.value)


@needs_both
@pytest.mark.parametrize("chunk, kind", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                         ("4", TypeError)])
def test_bad_chunks_raise_one_text_in_both_twins(chunk: Any, kind: type) -> None:
    from flax import nnx

    import jax_attention as ja
    import torch_attention as ta

    text = (f"chunk must be None or an int >= 1; got {chunk!r}" if kind is ValueError
            else f"chunk must be None or an int >= 1; got {type(chunk).__name__} {chunk!r}")
    assert {_errors(fw, chunk=chunk) for fw in ("torch", "jax")} == {(kind, text)}
    for make in (lambda: ta.MultiHeadAttention(8, 8, 8, 0.0, 2, chunk=chunk),
                 lambda: ja.MultiHeadAttention(8, 8, 8, 0.0, 2, chunk=chunk, rngs=nnx.Rngs(0))):
        with pytest.raises(kind, match="^chunk must be None or an int >= 1"):
            make()


@needs_both
@pytest.mark.parametrize("options, kind, text", [
    ({"chunk_origin": 2}, ValueError, "chunk_origin is where chunk='s chunks start; it needs chunk"),
    ({"chunk": 2, "chunk_origin": 1.5}, TypeError,
     "chunk_origin must hold integers (the key position of each example's token 0); got float"),
    ({"chunk": 2, "chunk_origin": np.array([0.0])}, TypeError,
     "chunk_origin must hold integers (the key position of each example's token 0); got dtype float64"),
    ({"chunk": 2, "chunk_origin": np.array([1, 2])}, ValueError,
     "chunk_origin must be an int or have shape (batch,) = (1,); got shape (2,)"),
])
def test_bad_chunk_origins_raise_one_text_in_both_twins(options: dict[str, Any], kind: type, text: str) -> None:
    assert {_errors(fw, **options) for fw in ("torch", "jax")} == {(kind, text)}


@needs_both
def test_variants_without_chunks_and_exporters_refuse_it_by_name() -> None:
    """Only ``MultiHeadAttention`` takes ``chunk``; the native exporters of both twins
    refuse it by name (nothing native has chunks)."""
    from attention_spec.registry import AttentionConfig
    from jax_attention.interop import to_nnx_multihead
    from parity_tests.harness import to_flax
    from torch_attention.interop import to_nn_multihead

    with pytest.raises(ValueError, match="^CausalAttention has no option 'chunk'$"):
        AttentionConfig("CausalAttention", d_in=4, d_out=4, context_length=4, dropout=0.0, chunk=2)
    module = _torch_module(4)
    with pytest.raises(ValueError, match=r"chunk=4 \(nn.MultiheadAttention cannot express it; only chunk=None"):
        to_nn_multihead(module)
    with pytest.raises(ValueError, match=r"chunk=4 \(nnx.MultiHeadAttention cannot express it; only chunk=None"):
        to_nnx_multihead(to_flax(module))


# --------------------------------------------------------------------------- (f) transformers' Llama 4

LLAMA4_LEN, LLAMA4_CHUNK = 448, 16


@functools.cache
def _llama4(rope: int = 1) -> tuple[Any, Any, Any]:
    """A tiny ``Llama4TextAttention`` (a rope layer: chunked; ``rope=0``: a NoPE layer,
    global), its rotary embedding and its config."""
    import torch
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

    config = Llama4TextConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                              num_hidden_layers=1, no_rope_layers=[rope], attention_chunk_size=LLAMA4_CHUNK,
                              use_qk_norm=False, attn_temperature_tuning=False, intermediate_size=32,
                              intermediate_size_mlp=32, vocab_size=32, max_position_embeddings=1024)
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    return Llama4TextAttention(config, 0).eval(), Llama4TextRotaryEmbedding(config), config


def _llama4_mask(config: Any, x: Any) -> Any:
    """transformers' own chunked causal mask for the layer, additive (B, 1, T, S)."""
    import torch
    from transformers.masking_utils import create_chunked_causal_mask

    positions = torch.arange(x.shape[1])[None]
    return create_chunked_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                                      position_ids=positions)


@needs_torch
def test_transformers_chunked_mask_is_our_geometry() -> None:
    import torch

    _, _, config = _llama4()
    mask = _llama4_mask(config, torch.zeros(1, LLAMA4_LEN, 16))
    p, j = np.arange(LLAMA4_LEN)[:, None], np.arange(LLAMA4_LEN)[None, :]
    ours = visible(j, p, *reach(Reach(causal=True)), LLAMA4_CHUNK)
    np.testing.assert_array_equal(mask[0, 0].numpy() == 0, ours)


@needs_torch
def test_llama4_text_attention_at_positions_past_400() -> None:
    """Ours (``MultiHeadAttention(chunk=16)``, interleaved rope at Llama 4's theta, bias-free
    projections, grouped heads) against the layer with its mask, at positions 0..447:
    outputs (those past 400 included) and the input's gradient.  (The twins agree on the
    chunks above; the JAX twin's rope and projections are the matrix's.)"""
    import torch

    import torch_attention as ta
    from attention_spec.rope import RopeConfig

    layer, rotary, config = _llama4()
    ours = ta.MultiHeadAttention(16, 16, LLAMA4_LEN, 0.0, 2, num_kv_heads=1, head_dim=8, out_bias=False,
                                 rope=RopeConfig(theta=config.rope_parameters["rope_theta"], layout="interleaved"),
                                 chunk=LLAMA4_CHUNK).eval()
    ours.load_state_dict({"W_query.weight": layer.q_proj.weight, "W_key.weight": layer.k_proj.weight,
                          "W_value.weight": layer.v_proj.weight, "out_proj.weight": layer.o_proj.weight})
    x_np = np.random.default_rng(4).standard_normal((1, LLAMA4_LEN, 16)).astype(np.float32)
    cot = np.random.default_rng(5).standard_normal((1, LLAMA4_LEN, 16)).astype(np.float32)
    with full_precision():
        x = torch.tensor(x_np, requires_grad=True)
        theirs, _ = layer(x, rotary(x, torch.arange(LLAMA4_LEN)[None]), _llama4_mask(config, x))
        (theirs * torch.from_numpy(cot)).sum().backward()
        their_grad, x.grad = x.grad, None
        mine = ours(x)
        (mine * torch.from_numpy(cot)).sum().backward()
    expected = theirs.detach().double().numpy()
    _ok(compare("output", mine.detach().double().numpy(), expected, ORACLE["float32"], ("ours", "llama4")))
    _ok(compare("past 400", mine.detach().double().numpy()[:, 400:], expected[:, 400:], ORACLE["float32"]))
    _ok(compare("grad x", x.grad.double().numpy(), their_grad.double().numpy(), GRAD_ORACLE["float32"]))
    # the chunks are what makes them equal: without them ours is another function
    unchunked = ta.MultiHeadAttention(16, 16, LLAMA4_LEN, 0.0, 2, num_kv_heads=1, head_dim=8, out_bias=False,
                                      rope=ours.spec.rope).eval()
    unchunked.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert np.abs(unchunked(x).double().numpy() - expected).max() > 0.1


@needs_torch
def test_from_hf_maps_llama4_chunks_onto_its_rope_layers() -> None:
    """``from_hf`` reads ``attention_chunk_size`` onto the layers the model masks in chunks
    (``layer_types``: Llama 4's rope layers), not onto its NoPE layers (global); the port
    equals the layer under its model's mask at positions 0..447 (past 400 included)."""
    import torch

    from torch_attention.interop import from_hf

    layer, rotary, config = _llama4()
    ours = from_hf(layer)
    assert ours.spec.chunk == LLAMA4_CHUNK and ours.spec.rope is not None and ours.spec.causal
    nope = from_hf(_llama4(rope=0)[0])
    assert nope.spec.chunk is None and nope.spec.rope is None
    x = torch.tensor(np.random.default_rng(6).standard_normal((1, LLAMA4_LEN, 16)), dtype=torch.float32)
    with full_precision(), torch.no_grad():
        theirs, _ = layer(x, rotary(x, torch.arange(LLAMA4_LEN)[None]), _llama4_mask(config, x))
        mine = ours(x)
    _ok(compare("from_hf", mine.double().numpy(), theirs.double().numpy(), ORACLE["float32"], ("ours", "llama4")))
