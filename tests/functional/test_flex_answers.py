"""Regressions of issue 55, flex attention in both twins: what a mask mod may answer, and
the PyTorch twin's memory at long sequences.

- A mask mod's bool answer need not span the key axis: a 0-d one (PyTorch's own
  ``noop_mask``, the default of ``BlockMask.from_kv_blocks``; ``True``), one of the query
  alone (``q_idx < 30``) or of the key alone is broadcast, on full, partial and ragged
  blocks (decoding: one query; lengths not a multiple of the block).  The PyTorch twin
  crashed on each (``IndexError`` in ``_mask`` on any partial block, a size mismatch).
- A non-bool answer (0/1 integers, floats) is refused with one text in both twins
  (``attention_spec.flex_answers``), as PyTorch's own flex refuses it; the JAX twin took
  it, the PyTorch twin crashed with framework errors.
- The PyTorch twin's widest tensor is one chunk of a query block's keys
  (``_flex.KEY_CHUNK``), whatever the sequence, and it keeps no autograd node per block:
  per-block checkpoints made glibc's heap grow with the square of the sequence (peak
  resident memory 1.3 GB at S=8192, B1 H2, causal; no (L, S) tensor was ever alive).  Its
  own backward (FlashAttention's) is checked against autograd of the whole-tensor math.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from attention_spec import mods
from parity_tests import reference
from parity_tests.tolerances import FLEX_ORACLE
from tests.support import needs_both

pytestmark = needs_both

B, H, E = 2, 2, 8
BLOCK = 16


def _inputs(q_len: int, kv_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(np.float32)  # type: ignore[return-value]
                 for s in ((B, H, q_len, E), (B, H, kv_len, E), (B, H, kv_len, E)))


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    tol = FLEX_ORACLE["float32"]
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: -inf where the oracle has none, or the converse"
    assert np.all(np.abs(got[finite] - want[finite]) <= tol.atol + tol.rtol * np.abs(want[finite])), what


def _zero_d(framework: str) -> Any:
    """Each framework's 0-d ``True`` mask mod: PyTorch's own ``noop_mask``; its JAX image."""
    if framework == "torch":
        from torch.nn.attention.flex_attention import noop_mask
        return noop_mask
    import jax.numpy as jnp
    return lambda b, h, q_idx, kv_idx: jnp.ones((), bool)


def _query_alone(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx < 30  # rows 30.. see no key: zeros, lse -inf


def _key_alone(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx < 25


def _python_true(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return True


# id -> (mask mod (None: the framework's 0-d noop), the oracle's mask mod, q_len, kv_len).
# Lengths not multiples of the block (ragged partial blocks), one query (decoding), L != S.
ANSWERS: dict[str, tuple[Any, Any, int, int]] = {
    "noop-0d-ragged": (None, None, 40, 40),
    "noop-0d-decoding": (None, None, 1, 37),
    "python-true": (_python_true, None, 40, 24),
    "query-alone": (_query_alone, _query_alone, 40, 40),
    "key-alone-L-ne-S": (_key_alone, _key_alone, 21, 40),
}


def _run(framework: str, mask_mod: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray,
         block_mask_of: Any = None) -> tuple[np.ndarray, np.ndarray]:
    q_len, kv_len = q.shape[2], k.shape[2]
    if framework == "torch":
        import torch

        import torch_attention.functional as tf
        bm = tf.create_block_mask(mask_mod, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=BLOCK)
        out, lse = tf.flex_attention(*(torch.tensor(a) for a in (q, k, v)), block_mask=bm, return_lse=True)
        return out.numpy(), lse.numpy()
    import jax.numpy as jnp

    import jax_attention.functional as jf
    bm = jf.create_block_mask(mask_mod, B, H, q_len, kv_len, BLOCK_SIZE=BLOCK)
    out, lse = jf.flex_attention(*(jnp.asarray(a) for a in (q, k, v)), block_mask=bm, return_lse=True)
    return np.asarray(out), np.asarray(lse)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", list(ANSWERS))
def test_a_bool_answer_that_does_not_span_the_keys_is_broadcast(case: str, framework: str) -> None:
    mask_mod, oracle_mod, q_len, kv_len = ANSWERS[case]
    mask_mod = _zero_d(framework) if mask_mod is None else mask_mod
    q, k, v = _inputs(q_len, kv_len)
    want_out, want_lse = reference.flex_attention(q, k, v, mask_mod=oracle_mod, scale=1 / math.sqrt(E))
    out, lse = _run(framework, mask_mod, q, k, v)
    _close(out, want_out, f"{framework} {case} out")
    _close(lse, want_lse, f"{framework} {case} lse")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_tables_of_kv_blocks_with_a_0d_mask_mod(framework: str) -> None:
    """PyTorch's ``BlockMask.from_kv_blocks`` (default ``noop_mask``) and the JAX twin's
    ``BlockMask`` of the same tables: key block 1 of query block 0 and key blocks 0 and 2
    (ragged) of query block 1 partial, the 0-d mod letting each key through; the rest
    skipped."""
    q, k, v = _inputs(24, 40)
    num = np.array([[[1, 2]]], np.int32)
    indices = np.array([[[[1, 0, 2], [0, 2, 1]]]], np.int32)
    visible = np.zeros((24, 40), bool)
    visible[:16, 16:32] = True
    visible[16:, :16] = visible[16:, 32:] = True

    def oracle_mod(b: Any, h: Any, i: Any, j: Any) -> bool:
        return bool(visible[i, j])

    want_out, want_lse = reference.flex_attention(q, k, v, mask_mod=oracle_mod, scale=1 / math.sqrt(E))
    if framework == "torch":
        import torch
        from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

        import torch_attention.functional as tf
        bm = TorchBlockMask.from_kv_blocks(torch.tensor(num), torch.tensor(indices), BLOCK_SIZE=BLOCK,
                                           seq_lengths=(24, 40))
        out, lse = tf.flex_attention(*(torch.tensor(a) for a in (q, k, v)), block_mask=bm, return_lse=True)
        got = out.numpy(), lse.numpy()
    else:
        import jax.numpy as jnp

        import jax_attention.functional as jf
        jbm = jf.BlockMask(jnp.asarray(num), jnp.asarray(indices), None, None, BLOCK_SIZE=(BLOCK, BLOCK),
                           mask_mod=_zero_d("jax"), seq_lengths=(24, 40))
        out, lse = jf.flex_attention(*(jnp.asarray(a) for a in (q, k, v)), block_mask=jbm, return_lse=True)
        got = np.asarray(out), np.asarray(lse)
    _close(got[0], want_out, f"{framework} out")
    _close(got[1], want_lse, f"{framework} lse")


def _int_answer(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) * 1  # 0/1 integers


def _float_answer(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) * 1.0


def _wrong_shape(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return np.ones((3,), bool)


def _error(fn: Any) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    return info.type, str(info.value)


@pytest.mark.parametrize("mod", [_int_answer, _float_answer, _wrong_shape])
def test_a_non_bool_or_unbroadcastable_answer_gives_one_error_in_both_twins(mod: Any) -> None:
    """Refused by ``create_block_mask`` and by ``flex_attention`` (a block mask of a bool
    mod given the bad one), with the same type and text in both twins: non-bool a
    TypeError that names the dtype (PyTorch's own flex asserts ``mask.dtype must be
    torch.bool``), a shape that does not broadcast a ValueError."""
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    q, k, v = _inputs(40, 40)
    t = [torch.tensor(a) for a in (q, k, v)]
    j = [jnp.asarray(a) for a in (q, k, v)]
    made_t = _error(lambda: tf.create_block_mask(mod, B, H, 40, 40, device="cpu", BLOCK_SIZE=BLOCK))
    made_j = _error(lambda: jf.create_block_mask(mod, B, H, 40, 40, BLOCK_SIZE=BLOCK))
    assert made_t == made_j
    assert made_t[1].startswith("create_block_mask: mask_mod")
    tbm = dataclasses.replace(tf.create_block_mask(mods.causal, B, H, 40, 40, device="cpu", BLOCK_SIZE=BLOCK),
                              mask_mod=mod)
    jbm = dataclasses.replace(jf.create_block_mask(mods.causal, B, H, 40, 40, BLOCK_SIZE=BLOCK), mask_mod=mod)
    called_t = _error(lambda: tf.flex_attention(*t, block_mask=tbm))
    called_j = _error(lambda: jf.flex_attention(*j, block_mask=jbm))
    assert called_t == called_j
    assert called_t[1].startswith("flex_attention: mask_mod")
    kind = ValueError if mod is _wrong_shape else TypeError
    assert made_t[0] is kind and called_t[0] is kind
    if kind is TypeError:
        assert ("got integers" if mod is _int_answer else "got floating-point numbers") in made_t[1]


# --------------------------------------------------------------------------- the PyTorch twin's memory


def test_torch_twin_widest_tensor_is_one_key_chunk() -> None:
    """Forward and backward of a causal call at S = 2.25 KEY_CHUNK: no tensor wider than a
    query block by ``KEY_CHUNK`` keys is made (every op's output, seen by a dispatch mode),
    so the allocator reuses one width's freed memory; before, the last query block's
    scores spanned every key.  Outputs and gradients as PyTorch's SDPA's."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import torch_attention.functional as tf
    from torch_attention import _flex

    seq = _flex.KEY_CHUNK * 9 // 4
    widest = [0]

    class Widest(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() == 4:
                    widest[0] = max(widest[0], t.shape[-1] * t.shape[-2])
            return out

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, seq, 4, generator=g, requires_grad=True) for _ in range(3))
    bm = tf.create_block_mask(mods.causal, None, None, seq, seq, device="cpu")
    with Widest():
        out = _flex.flex_attention(q, k, v, block_mask=bm)
        out.square().sum().backward()
    assert widest[0] <= 128 * _flex.KEY_CHUNK, widest[0]
    grads = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    want.square().sum().backward()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, (q2.grad, k2.grad, v2.grad), strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def _sink_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """The first 8 keys and a causal window of 8: a query block's key blocks not adjacent."""
    return (kv_idx < 8) | ((q_idx >= kv_idx) & (q_idx - kv_idx < 8))


def _dense(q: Any, k: Any, v: Any, score_mod: Any, mask_mod: Any, groups: int) -> tuple[Any, Any]:
    """The flex semantics as whole tensors (float64, autograd): out, lse."""
    import torch
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    b, h, i, j = (torch.arange(n).reshape([n if d == a else 1 for d in range(4)])
                  for a, n in enumerate((q.shape[0], q.shape[1], q.shape[2], k.shape[2])))
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    visible = scores != -math.inf
    if mask_mod is not None:
        visible = visible & mask_mod(b, h, i, j)
    scores = scores.masked_fill(~visible, -math.inf)
    top = scores.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(scores - top)
    total = e.sum(-1, keepdim=True)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    lse = torch.where(total > 0, top + torch.log(safe), torch.full_like(total, -math.inf))[..., 0]
    return (e / safe) @ v, lse


# id -> (mask mod, score mod, kv heads): several key chunks per query block (KEY_CHUNK 16,
# blocks of 8), grouped heads, keys gathered from blocks that are not adjacent, rows that
# see no key, and the lse's own gradient.
LEAN_CASES: dict[str, tuple[Any, Any, int]] = {
    "causal-alibi-gqa": (mods.causal, mods.alibi(np.array([0.5, 0.25, 0.125, 0.0625])), 2),
    "sink-window-softcap": (_sink_window, mods.softcap(2.0), 4),
    "query-alone-no-score-mod": (lambda b, h, q_idx, kv_idx: (q_idx < 30) & (q_idx % 7 != 3), None, 4),
}


@pytest.mark.parametrize("case", list(LEAN_CASES))
def test_torch_twin_chunked_backward_matches_dense_autograd(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The PyTorch twin's own backward (FlashAttention's, a chunk of keys at a time) in
    float64: out, lse and the gradients of q, k and v (through out and lse) as autograd's
    of the whole-tensor formulation."""
    import torch

    import torch_attention.functional as tf
    from torch_attention import _flex

    monkeypatch.setattr(_flex, "KEY_CHUNK", 16)
    mask_mod, score_mod, kv_heads = LEAN_CASES[case]
    heads, seq = 4, 40
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    q = torch.randn(2, heads, seq, E, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, seq, E, generator=g, dtype=torch.float64) for _ in range(2))
    cot, cot_lse = torch.randn(2, heads, seq, E, generator=g, dtype=torch.float64), torch.randn(2, heads, seq,
                                                                                                 generator=g,
                                                                                                 dtype=torch.float64)

    def loss(out: Any, lse: Any) -> Any:
        return (out * cot).sum() + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * cot_lse).sum()

    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    bm = tf.create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=8)
    out, lse = _flex.flex_attention(*ours, score_mod=score_mod, block_mask=bm, enable_gqa=kv_heads != heads,
                                    return_lse=True)
    loss(out, lse).backward()
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _dense(*theirs, score_mod, mask_mod, heads // kv_heads)
    loss(want_out, want_lse).backward()
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("qkv", ours, theirs, strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10, msg=f"d{name}")
