"""The modules with what training stacks use: cross-attention (``context=``,
``kdim``/``vdim``), grouped-query heads (``num_kv_heads``), windows and bottom-right
alignment as module options, packed sequences (``segment_ids``) and KV-cache decoding.

Each configuration runs on every path in both frameworks with the same weights: outputs
and gradients (w.r.t. x, the context and every parameter) twin against twin through the
harness, and outputs against a float64 NumPy forward built here from the state dict and
the loop oracle ``reference.attention`` (k/v heads repeated for their groups, the
window, alignment and segments written out as an explicit bool mask).

Decoding: a padded prompt, then 64 single tokens, then a chunk, with grouped heads,
equals one causal forward over each example's whole sequence, in both frameworks and
across them; the Flax single-token step compiles once under ``nnx.jit``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from parity_tests import reference
from parity_tests.tolerances import ORACLE, PARITY
from tests.support import needs_both, tiered

PATHS = ("reference", "fused", "blockwise", "auto")
D_IN, D_OUT, HEADS = 12, 16, 4


def _allowed(q_len: int, kv_len: int, *, causal: bool, window: Any, alignment: str,
             offsets: np.ndarray, seg_q: np.ndarray | None, seg_k: np.ndarray | None) -> np.ndarray:
    """(B, 1, T, S) bool: the visibility rule written out (independent of the library)."""
    batch = len(offsets)
    allowed = np.ones((batch, 1, q_len, kv_len), dtype=bool)
    left, right = window if window is not None else (None, None)
    for b in range(batch):
        for i in range(q_len):
            p = i + offsets[b]
            for j in range(kv_len):
                ok = True
                if causal and j > p:
                    ok = False
                if left is not None and j < p - left:
                    ok = False
                if right is not None and j > p + right:
                    ok = False
                if seg_q is not None and seg_k is not None and seg_q[b, i] != seg_k[b, j]:
                    ok = False
                allowed[b, 0, i, j] = ok
    return allowed


def oracle_forward(state: dict[str, np.ndarray], x: np.ndarray, keys: np.ndarray, values: np.ndarray, *,
                   num_heads: int, kv_heads: int, allowed: np.ndarray,
                   kv_lengths: np.ndarray | None = None) -> np.ndarray:
    """MultiHeadAttention in float64 from PyTorch's state dict: projections, grouped
    heads repeated, the loop oracle, merge, out_proj."""
    def linear(name: str, t: np.ndarray) -> np.ndarray:
        y = t.astype(np.float64) @ state[f"{name}.weight"].astype(np.float64).T
        return y + state[f"{name}.bias"] if f"{name}.bias" in state else y

    def heads(t: np.ndarray, n: int) -> np.ndarray:
        b, length, width = t.shape
        return t.reshape(b, length, n, width // n).transpose(0, 2, 1, 3)

    q = heads(linear("W_query", x), num_heads)
    k = np.repeat(heads(linear("W_key", keys), kv_heads), num_heads // kv_heads, axis=1)
    v = np.repeat(heads(linear("W_value", values), kv_heads), num_heads // kv_heads, axis=1)
    mask = allowed
    if kv_lengths is not None:
        mask = mask & (np.arange(k.shape[2])[None, :] < kv_lengths[:, None])[:, None, None, :]
    out, _ = reference.attention(q, k, v, scale=1.0 / np.sqrt(q.shape[-1]), mask=mask)
    b, _, t, _ = out.shape
    merged = out.transpose(0, 2, 1, 3).reshape(b, t, -1)
    return linear("out_proj", merged)


# (name, constructor options, T, S or None for self-attention, kdim, vdim, segments)
CONFIGS = [
    ("cross", dict(causal=False), 6, 9, 12, 12, False),
    ("cross-kdim-vdim-gqa", dict(causal=False, num_kv_heads=2, kdim=5, vdim=7), 6, 9, 5, 7, False),
    ("cross-causal-bottom-right", dict(causal=True, alignment="bottom_right", kdim=5, vdim=7), 5, 9, 5, 7, False),
    ("mqa-causal", dict(causal=True, num_kv_heads=1), 9, None, None, None, False),
    ("gqa-window", dict(causal=True, num_kv_heads=2, window=(2, None)), 9, None, None, None, False),
    ("window-two-sided", dict(causal=False, window=(1, 2)), 9, None, None, None, False),
    ("packed-causal-window", dict(causal=True, window=(3, None), num_kv_heads=2), 10, None, None, None, True),
]


def _inputs(name: str, t_len: int, s_len: int | None, kdim: int | None, vdim: int | None,
            segments: bool) -> dict[str, Any]:
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    out: dict[str, Any] = {"x": rng.standard_normal((2, t_len, D_IN)).astype(np.float32)}
    if s_len is not None:
        out["keys"] = rng.standard_normal((2, s_len, kdim)).astype(np.float32)
        out["values"] = rng.standard_normal((2, s_len, vdim)).astype(np.float32)
    if segments:
        out["segment_ids"] = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [5] * 6 + [7] * 4], dtype=np.int32)
    return out


def _torch_module(options: dict[str, Any]) -> Any:
    import torch

    import torch_attention

    torch.manual_seed(0)
    return torch_attention.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, True, **options).eval()


# Each option set on two paths, every path several times; every option set on every path
# with --exhaustive.
@needs_both
@pytest.mark.parametrize(("config", "path"), tiered(
    "config,path", [pytest.param(c, id=c[0]) for c in CONFIGS], PATHS, strength=1))
def test_module_options(config: tuple[Any, ...], path: str) -> None:
    import torch

    from parity_tests.harness import assert_parity, to_flax

    name, options, t_len, s_len, kdim, vdim, segments = config
    tm = _torch_module(options)
    fm = to_flax(tm)
    data = _inputs(name, t_len, s_len, kdim, vdim, segments)
    seg = data.get("segment_ids")
    cross = s_len is not None
    inputs = (data["x"], data["keys"], data["values"]) if cross else (data["x"],)

    def torch_call(m: Any, x: Any, *ctx: Any, **kw: Any) -> Any:
        extra = {"segment_ids": torch.from_numpy(seg)} if seg is not None else {}
        return m(x, context=tuple(ctx) if ctx else None, **extra, **kw)

    def flax_call(m: Any, x: Any, *ctx: Any, **kw: Any) -> Any:
        extra = {"segment_ids": seg} if seg is not None else {}
        return m(x, context=tuple(ctx) if ctx else None, **extra, **kw)

    # twin against twin, outputs and gradients (x, context, every parameter)
    report = assert_parity(tm, fm, *inputs, implementation=path, torch_call=torch_call, flax_call=flax_call)

    # each twin against the float64 oracle
    s = s_len if cross else t_len
    offsets = np.full(2, s - t_len if options.get("alignment") == "bottom_right" else 0)
    allowed = _allowed(t_len, s, causal=options.get("causal", True), window=options.get("window"),
                       alignment=options.get("alignment", "top_left"), offsets=offsets, seg_q=seg, seg_k=seg)
    state = {k: v.numpy() for k, v in tm.state_dict().items()}
    keys = data["keys"] if cross else data["x"]
    values = data["values"] if cross else data["x"]
    want = oracle_forward(state, data["x"], keys, values, num_heads=HEADS,
                          kv_heads=options.get("num_kv_heads") or HEADS, allowed=allowed)
    tol = ORACLE["float32"]
    # the outputs the harness computed on ``path`` (the Flax one under jit): calling the
    # modules again, Flax eagerly, cost as much as the whole parity check
    got_t, got_f = report.torch_results["output"], report.flax_results["output"]
    np.testing.assert_allclose(got_t, want, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(got_f, want, rtol=tol.rtol, atol=tol.atol)


# --------------------------------------------------------------------------- KV-cache decoding

PROMPT, STEPS, CHUNK, MAX_LEN = 7, 64, 5, 80
PROMPT_LENGTHS = np.array([7, 4], dtype=np.int32)  # example 1's prompt is padded


def _decode_inputs(seed: int = 0) -> np.ndarray:
    """(2, PROMPT + STEPS + CHUNK, D_IN): example 1's prompt positions 4..6 are padding
    (large values, which must not matter); its real tokens are positions 0..3 and 7..."""
    x = np.random.default_rng(seed).standard_normal((2, PROMPT + STEPS + CHUNK, D_IN)).astype(np.float32)
    x[1, 4:PROMPT] = 50.0
    return x


def _own_sequence(x: np.ndarray, b: int) -> np.ndarray:
    """Example b's tokens without its prompt padding."""
    return np.concatenate([x[b, : PROMPT_LENGTHS[b]], x[b, PROMPT:]])


def _decode_torch(module: Any, x: np.ndarray, dtype: Any) -> list[np.ndarray]:
    import torch

    xt = torch.from_numpy(x).to(dtype)
    cache = module.init_cache(2, MAX_LEN)
    with torch.no_grad():
        outs = [module(xt[:, :PROMPT], cache=cache, kv_lengths=torch.from_numpy(PROMPT_LENGTHS))[0]]
        for i in range(PROMPT, PROMPT + STEPS):
            out, cache = module(xt[:, i : i + 1], cache=cache)
            outs.append(out)
        out, cache = module(xt[:, PROMPT + STEPS :], cache=cache)
        outs.append(out)
    assert cache.lengths.tolist() == [int(n) + STEPS + CHUNK for n in PROMPT_LENGTHS]
    return [o.float().numpy() for o in outs]


def _decode_flax(module: Any, x: np.ndarray, dtype: Any) -> tuple[list[np.ndarray], int]:
    import jax.numpy as jnp
    from flax import nnx

    traces = []

    @nnx.jit
    def step(m: Any, token: Any, cache: Any, kv_lengths: Any = None) -> Any:
        traces.append(token.shape)
        return m(token, cache=cache, kv_lengths=kv_lengths)

    xj = jnp.asarray(x, dtype)
    cache = module.init_cache(2, MAX_LEN)
    # the prompt jitted too: eagerly, its every operation compiles on its own (3x the time)
    out, cache = step(module, xj[:, :PROMPT], cache, jnp.asarray(PROMPT_LENGTHS))
    outs = [out]
    for i in range(PROMPT, PROMPT + STEPS):
        out, cache = step(module, xj[:, i : i + 1], cache)
        outs.append(out)
    out, cache = step(module, xj[:, PROMPT + STEPS :], cache)
    outs.append(out)
    assert np.asarray(cache.lengths).tolist() == [int(n) + STEPS + CHUNK for n in PROMPT_LENGTHS]
    single = [s for s in traces if s[1] == 1]
    return [np.asarray(o.astype(jnp.float32)) for o in outs], len(single)


def _valid_rows(outs: list[np.ndarray], b: int) -> np.ndarray:
    """Example b's decoded outputs, in order, without its prompt padding."""
    prompt = outs[0][b, : PROMPT_LENGTHS[b]]
    return np.concatenate([prompt] + [o[b] for o in outs[1:]])


@needs_both
@pytest.mark.parametrize("path,dtype", tiered("path,dtype", PATHS[::-1], ["float32", "bfloat16"], strength=1))
def test_decode_equals_full_forward(path: str, dtype: str) -> None:
    """Padded prompt + 64 tokens + a chunk, GQA (4 query heads, 2 kv heads), a window:
    both frameworks equal their own full causal forward, and each other."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from parity_tests.harness import to_flax

    options = dict(causal=True, num_kv_heads=2, implementation=path)
    tdt, jdt = getattr(torch, dtype), getattr(jnp, dtype)
    tm = _torch_module(options).to(tdt)
    fm = to_flax(tm)  # parameters in the same dtype
    x = _decode_inputs()
    t_outs = _decode_torch(tm, x, tdt)
    f_outs, single_compiles = _decode_flax(fm, x, jdt)
    assert single_compiles == 1, f"the single-token step compiled {single_compiles} times"
    tol = ORACLE[dtype] if dtype == "float32" else PARITY[dtype]
    full = nnx.jit(lambda m, seq: m(seq))  # one program, not one per operation as eagerly
    for b in range(2):
        seq = _own_sequence(x, b)[None]
        with torch.no_grad():
            t_full = tm(torch.from_numpy(seq).to(tdt)).float().numpy()[0]
        f_full = np.asarray(full(fm, jnp.asarray(seq, jdt)).astype(jnp.float32))[0]
        np.testing.assert_allclose(_valid_rows(t_outs, b), t_full, rtol=tol.rtol, atol=tol.atol)
        np.testing.assert_allclose(_valid_rows(f_outs, b), f_full, rtol=tol.rtol, atol=tol.atol)
        np.testing.assert_allclose(_valid_rows(t_outs, b), _valid_rows(f_outs, b), rtol=tol.rtol, atol=tol.atol)


@needs_both
def test_decode_with_window_and_bottom_right_oracle() -> None:
    """A cached decode with a window equals the float64 oracle of the whole sequence."""
    import torch

    tm = _torch_module(dict(causal=True, num_kv_heads=1, window=(4, None)))
    x = _decode_inputs(1)[:, :20]
    x[1, 4:PROMPT] = x[1, 4:PROMPT]  # keep the padding rows
    cache = tm.init_cache(2, 24)
    with torch.no_grad():
        first, cache = tm(torch.from_numpy(x[:, :PROMPT]), cache=cache, kv_lengths=torch.from_numpy(PROMPT_LENGTHS))
        rest, cache = tm(torch.from_numpy(x[:, PROMPT:]), cache=cache)
    state = {k: v.numpy() for k, v in tm.state_dict().items()}
    for b in range(2):
        seq = np.concatenate([x[b, : PROMPT_LENGTHS[b]], x[b, PROMPT:]])[None]
        n = seq.shape[1]
        allowed = _allowed(n, n, causal=True, window=(4, None), alignment="top_left", offsets=np.zeros(1, int),
                           seg_q=None, seg_k=None)
        want = oracle_forward(state, seq, seq, seq, num_heads=HEADS, kv_heads=1, allowed=allowed)[0]
        got = np.concatenate([first[b, : PROMPT_LENGTHS[b]].numpy(), rest[b].numpy()])
        np.testing.assert_allclose(got, want, rtol=ORACLE["float32"].rtol, atol=ORACLE["float32"].atol)


@needs_both
def test_refused_decode_leaves_the_cache_as_it_was() -> None:
    import jax.numpy as jnp
    import torch

    from parity_tests.harness import to_flax

    tm = _torch_module(dict(causal=True, num_kv_heads=2))
    fm = to_flax(tm)
    x = np.random.default_rng(3).standard_normal((2, 6, D_IN)).astype(np.float32)
    cache = tm.init_cache(2, 8)
    _, cache = tm(torch.from_numpy(x), cache=cache)
    before = [t.clone() for t in cache]
    with pytest.raises(ValueError, match="holds 6 of max_len=8 positions and cannot take 3 more"):
        tm(torch.from_numpy(x[:, :3]), cache=cache)
    for a, b in zip(before, cache, strict=True):
        assert torch.equal(a, b)
    fcache = fm.init_cache(2, 8)
    _, fcache = fm(jnp.asarray(x), cache=fcache)
    with pytest.raises(ValueError, match="holds 6 of max_len=8 positions and cannot take 3 more"):
        fm(jnp.asarray(x[:, :3]), cache=fcache)
    assert np.asarray(fcache.lengths).tolist() == [6, 6]


@needs_both
def test_gqa_projections_are_sized_for_kv_heads_and_convert() -> None:
    """num_kv_heads=2 of 4: key/value projections (d_in -> 2 * head_dim), in both
    frameworks, and the conversion both ways keeps them (a round trip is exact)."""
    import torch

    from parity_tests.harness import to_flax, to_torch

    tm = _torch_module(dict(num_kv_heads=2, kdim=5, vdim=7))
    assert tuple(tm.W_key.weight.shape) == (8, 5) and tuple(tm.W_value.weight.shape) == (8, 7)
    assert tuple(tm.W_query.weight.shape) == (16, D_IN)
    fm = to_flax(tm)
    assert fm.W_key.kernel[...].shape == (5, 8) and fm.W_value.kernel[...].shape == (7, 8)
    back = to_torch(fm)
    for name, p in tm.state_dict().items():
        assert torch.equal(p, back.state_dict()[name]), name


@needs_both
@pytest.mark.parametrize(
    "path", [p if p in ("blockwise", "auto") else pytest.param(p, marks=pytest.mark.slow) for p in PATHS]
)
def test_cached_step_with_mask_bias_and_weights_matches_the_twin(path: str) -> None:
    """A decode step with a mask and a bias over the cache's positions and
    return_weights: the same output and (B, H, T, max_len) weights in both frameworks
    (PyTorch attends over the filled prefix, Flax over max_len: zeros beyond)."""
    import jax.numpy as jnp
    import torch

    from parity_tests.harness import to_flax

    tm = _torch_module(dict(causal=True, num_kv_heads=2))
    fm = to_flax(tm)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, D_IN)).astype(np.float32)
    token = rng.standard_normal((2, 1, D_IN)).astype(np.float32)
    mask = rng.random((2, 1, 1, 10)) < 0.8
    mask[:, :, :, 6] = True  # the new token sees itself
    bias = rng.standard_normal((1, HEADS, 1, 10)).astype(np.float32)
    impl = "reference" if path in ("fused", "blockwise") else path  # weights need a path that has them
    with torch.no_grad():
        cache = tm.init_cache(2, 10)
        _, cache = tm(torch.from_numpy(x), cache=cache)
        t_out, t_w, cache = tm(torch.from_numpy(token), torch.from_numpy(mask), cache=cache,
                               bias=torch.from_numpy(bias), return_weights=True, implementation=impl)
        t_plain, _ = tm(torch.from_numpy(token), torch.from_numpy(mask), cache=tm.init_cache(2, 10),
                        implementation=path)
    fcache = fm.init_cache(2, 10)
    _, fcache = fm(jnp.asarray(x), cache=fcache)
    f_out, f_w, fcache = fm(jnp.asarray(token), jnp.asarray(mask), cache=fcache, bias=jnp.asarray(bias),
                            return_weights=True, implementation=impl)
    f_plain, _ = fm(jnp.asarray(token), jnp.asarray(mask), cache=fm.init_cache(2, 10), implementation=path)
    tol = PARITY["float32"]
    assert t_w.shape == f_w.shape == (2, HEADS, 1, 10)
    np.testing.assert_allclose(t_out.numpy(), np.asarray(f_out), rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(t_w.numpy(), np.asarray(f_w), rtol=tol.rtol, atol=tol.atol)
    assert np.all(t_w.numpy()[..., 7:] == 0)
    np.testing.assert_allclose(t_plain.numpy(), np.asarray(f_plain), rtol=tol.rtol, atol=tol.atol)
