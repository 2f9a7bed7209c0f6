"""``flex_attention`` for PyTorch, on CPU with a backward: PyTorch's flex_attention (score
and mask mods, block-sparse block masks) on the library's math.  ``jax_attention/_flex.py``
is its twin; the mods are ``attention_spec.mods``'s, the checks and the block plan
``attention_spec.flex``'s.

PyTorch's own ``flex_attention`` has no backward on CPU and, eager, makes the whole
(L, S) scores.  Here, per query block of ``BLOCK_SIZE`` rows, only the key blocks that the
block mask marks non-empty are computed: their scores in the compute dtype (float32 for
half precision; float64 stays), ``score_mod`` applied with index tensors, the mask mod on
partial blocks only (its bool answer broadcast to the block's keys:
``attention_spec.flex_answers``), the library's stable softmax (``_reference._softmax``), then
weights @ v.  Each query block runs under ``torch.utils.checkpoint`` (non-reentrant):
the backward recomputes its scores, so no (L, S) tensor is kept for it, and gradients
reach q, k, v and the tensors the mods capture.  The block plan is read from the block
mask's tables on the host (they are small).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attention_spec import flex as spec
from attention_spec.arrays import dtype_name
from attention_spec.flex import DEFAULT_BLOCK, BlockMask
from attention_spec.flex_answers import check_mask_answer
from torch_attention._reference import _compute_dtype, _softmax, resolve_scale


def create_block_mask(mask_mod: Callable[..., Any], B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,  # noqa: N803
                      device: Any = None, BLOCK_SIZE: int | tuple[int, int] = 128) -> BlockMask:  # noqa: N803
    """The block mask of ``mask_mod`` (b, h, q_idx, kv_idx) -> bool (True = may attend) for
    B x H x Q_LEN x KV_LEN (B or H None: 1, broadcast over the call's), in blocks of
    ``BLOCK_SIZE`` (an int, or (query block, key block)): which key blocks of each query
    block are partial, full or empty; its tables on ``device`` (None: the current
    accelerator, else the CPU, as PyTorch's).  PyTorch's ``create_block_mask`` (its
    tables exactly).

    ``mask_mod`` runs on index tensors, one query block at a time (no (L, S) mask is
    made whole).  Raises TypeError / ValueError (bad sizes)."""
    b_, h_, q_len, kv_len, (bq, bkv) = spec.check_block_mask_args(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE)
    if device is None:
        device = torch.accelerator.current_accelerator() or "cpu"
    n_kv = -(-kv_len // bkv)
    b = torch.arange(b_, device=device).reshape(b_, 1, 1, 1)
    h = torch.arange(h_, device=device).reshape(1, h_, 1, 1)
    kv = torch.arange(kv_len, device=device).reshape(1, 1, 1, kv_len)
    sums = []
    with torch.no_grad():
        for start in range(0, q_len, bq):
            rows = torch.arange(start, min(start + bq, q_len), device=device).reshape(1, 1, -1, 1)
            want = (b_, h_, rows.shape[2], kv_len)
            m = _answer("create_block_mask", mask_mod(b, h, rows, kv), want, device).expand(want)
            # padded to whole blocks with False, as PyTorch pads: a ragged block is never full
            m = torch.nn.functional.pad(m, (0, n_kv * bkv - kv_len, 0, bq - m.shape[2]))
            sums.append(m.reshape(b_, h_, bq, n_kv, bkv).sum(dim=(2, 4)))
    counts = torch.stack(sums, dim=2).cpu().numpy()  # (B', H', n_q, n_kv): visible keys per block
    full = counts == bq * bkv
    partial = (counts > 0) & ~full
    (num, indices), (full_num, full_indices) = spec.ordered_blocks(partial), spec.ordered_blocks(full)
    num_t, indices_t, full_num_t, full_indices_t = (torch.as_tensor(t, device=device)
                                                    for t in (num, indices, full_num, full_indices))
    return BlockMask(num_t, indices_t, full_num_t, full_indices_t, BLOCK_SIZE=(bq, bkv), mask_mod=mask_mod,
                     seq_lengths=(q_len, kv_len))


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Callable[..., Any] | None = None,
                   block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with a score mod and a block-sparse mask: query (B, Hq, L, E), key
    (B, Hkv, S, E), value (B, Hkv, S, Ev) -> (B, Hq, L, Ev) in the inputs' dtype, with
    ``return_lse`` also lse (B, Hq, L) in the compute dtype (float32, float64 for
    float64): the natural log of each row's sum of exp(modded scores), -inf for a row
    that sees no key (its output row is zeros).  PyTorch's ``flex_attention``, with a
    backward on every device.

    Args:
      score_mod: ``(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled scores
        ``scale * q.k`` (``attention_spec.mods``: vectorised, elementwise).  A score it
        makes -inf blocks its key.  ``h`` is the query head.
      block_mask: ``create_block_mask``'s (or PyTorch's); None: every key visible.  Its
        ``mask_mod`` (True = may attend) decides the keys of partial blocks; empty blocks
        are skipped.
      scale: None = 1/sqrt(E); a float as given.
      enable_gqa: k and v may have Hkv heads dividing Hq; query head h reads kv head
        h // (Hq // Hkv).  Without it Hq must equal Hkv.

    Differentiable in q, k, v and the tensors the mods capture, one query block
    recomputed at a time.

    Raises:
      ValueError / TypeError: shapes, dtypes, scale, mods or a block mask that do not fit
        (``attention_spec.flex``'s texts, the JAX twin's), before any computation.
    """
    groups, scale = spec.check_flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa)
    plan, mask_mod = _plan(query, key, block_mask)
    batch, heads, q_len, dim = query.shape
    kv_heads, v_dim = key.shape[1], value.shape[3]
    scale = resolve_scale(scale, dim)
    qg = query.reshape(batch, kv_heads, groups, q_len, dim)  # (B, Hkv, G, L, E): query head h = kvh * G + g
    kg, vg = key[:, :, None], value[:, :, None]  # (B, Hkv, 1, S, E|Ev)
    ct = _compute_dtype(query.dtype)
    recompute = torch.is_grad_enabled()
    outs, lses = [], []
    for qb in plan:
        rows = qb.stop - qb.start
        if not qb.runs:  # every key blocked: zeros, lse -inf
            outs.append(query.new_zeros((batch, heads, rows, v_dim), dtype=value.dtype))
            lses.append(query.new_full((batch, heads, rows), -math.inf, dtype=ct))
            continue
        block = _query_block(qb, score_mod, mask_mod, scale, ct, heads, return_lse)
        q_rows = qg[:, :, :, qb.start:qb.stop]
        out, lse = checkpoint(block, q_rows, kg, vg, use_reentrant=False) if recompute else block(q_rows, kg, vg)
        outs.append(out.to(value.dtype))
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, Hq, L, Ev)
    if not return_lse:
        return out
    return out, lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)


def run_call(q: Tensor, k: Tensor, v: Tensor, call: Any, *, scale: float) -> Tensor:
    """The flex path of a module's call whose mods stand for no named option (a row of
    ``_paths``): the call's options and tensors and the module's mods as one score mod
    and one mask mod (``attention_spec.flex.call_mods``), the mask mod's block mask (for
    the examples and heads it reads, ``attention_spec.flex.mask_reads``; (1, 1) where it
    reads neither), then
    ``flex_attention``.  q (B, H, T, D), k and v (B, Hkv, S, D)."""
    score_mod, mask_mod = spec.call_mods(call.options, offset=call.offset, mask=call.mask, bias=call.bias,
                                         lengths=call.kv_lengths, segments=call.segments)
    block_mask = None
    if mask_mod is not None:
        reads_b, reads_h = spec.mask_reads(mask_mod)
        batch, heads = (q.shape[0] if reads_b else 1), (q.shape[1] if reads_h else 1)
        block_mask = create_block_mask(mask_mod, batch, heads, q.shape[2], k.shape[2], device=q.device,
                                       BLOCK_SIZE=DEFAULT_BLOCK)
    out = flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa=q.shape[1] != k.shape[1])
    assert isinstance(out, Tensor)
    return out


def index_arrays(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, T, 1), kv_idx (1, 1, 1, S)): the
    indices a mod takes for every score of q (B, H, T, D) against k (..., S, D)."""
    batch, heads, q_len = q.shape[:3]
    kv_len, device = k.shape[-2], q.device
    return (torch.arange(batch, device=device).reshape(batch, 1, 1, 1),
            torch.arange(heads, device=device).reshape(1, heads, 1, 1),
            torch.arange(q_len, device=device).reshape(1, 1, q_len, 1),
            torch.arange(kv_len, device=device).reshape(1, 1, 1, kv_len))


def _host(block_mask: Any) -> tuple[Any, Any, Any, Any]:
    """A block mask's tables as NumPy arrays (None kept)."""
    tables = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices)
    a, b, c, d = (None if t is None else t.detach().cpu().numpy() for t in tables)
    return a, b, c, d


def _plan(query: Tensor, key: Tensor, block_mask: Any) -> tuple[tuple[spec.QueryBlock, ...], Any]:
    """(the query blocks and their key runs, the mask mod)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if block_mask is None:
        return spec.plan_without_mask(q_len, kv_len, DEFAULT_BLOCK), None
    tables = _host(block_mask)
    block_size = tuple(int(s) for s in block_mask.BLOCK_SIZE)
    return spec.plan_blocks(*tables, (block_size[0], block_size[1]), (q_len, kv_len)), block_mask.mask_mod


def _query_block(qb: spec.QueryBlock, score_mod: Callable[..., Any] | None, mask_mod: Callable[..., Any] | None,
                 scale: float, ct: torch.dtype, heads: int, with_lse: bool) -> Callable[..., tuple[Tensor, Tensor]]:
    """The function of one query block, (q (B, Hkv, G, rows, E), k, v (B, Hkv, 1, S, .)) ->
    (out (B, Hq, rows, Ev) in the compute dtype, lse (B, Hq, rows); ``with_lse`` False: an
    empty tensor in its place, the log-sum-exp not computed)."""
    span, positions = qb.span, qb.key_positions

    def block(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        batch, kv_heads, groups, rows, _ = q.shape
        device = q.device
        if span is not None:
            k, v = k[..., span[0]:span[1], :], v[..., span[0]:span[1], :]
        else:
            index = torch.as_tensor(positions, device=device)
            k, v = k.index_select(-2, index), v.index_select(-2, index)
        n = k.shape[-2]
        scores = torch.matmul(q.to(ct), k.to(ct).transpose(-2, -1))
        scores = scores.reshape(batch, heads, rows, n) * scale  # (B, Hq, rows, n)
        b = torch.arange(batch, device=device).reshape(batch, 1, 1, 1)
        h = torch.arange(heads, device=device).reshape(1, heads, 1, 1)
        q_idx = torch.arange(qb.start, qb.stop, device=device).reshape(1, 1, rows, 1)
        mask = _mask(qb, mask_mod, b, h, q_idx, tuple(scores.shape))
        if score_mod is not None:
            kv_idx = torch.as_tensor(positions, device=device).reshape(1, 1, 1, n)
            scores = torch.as_tensor(score_mod(scores, b, h, q_idx, kv_idx)).expand(scores.shape).to(ct)
            finite = scores != -math.inf  # a score the mod makes -inf blocks its key
            mask = finite if mask is None else mask & finite
        weights = _softmax(scores, mask)
        out = torch.matmul(weights.reshape(batch, kv_heads, groups, rows, n), v.to(ct))
        return out.reshape(batch, heads, rows, -1), _lse(scores, mask) if with_lse else scores.new_empty(0)

    return block


def _mask(qb: spec.QueryBlock, mask_mod: Callable[..., Any] | None, b: Tensor, h: Tensor, q_idx: Tensor,
          shape: tuple[int, ...]) -> Tensor | None:
    """The block's mask (True = may attend), broadcastable to ``shape`` (B, Hq, rows, n):
    None where every key computed is in a full block.  Its first two sizes are those the
    mask mod's answers need (a causal mod's: (1, 1, rows, n), not a copy per example and
    head: the softmax broadcasts it); an answer of lower rank or smaller sizes (PyTorch's
    ``noop_mask``: 0-d; ``q_idx < 30``: (1, 1, rows, 1)) is broadcast to its run's keys."""
    if all(r.kind == "full" for r in qb.runs):
        return None
    device = b.device
    rows = shape[2]
    pieces = []
    for run in qb.runs:
        width = run.stop - run.start
        if run.kind == "full":
            pieces.append(torch.ones((1, 1, rows, width), dtype=torch.bool, device=device))
            continue
        kv_idx = torch.arange(run.start, run.stop, device=device).reshape(1, 1, 1, -1)
        want = (*shape[:2], rows, width)
        if run.kind == "partial":
            assert mask_mod is not None
            piece = _answer("flex_attention", mask_mod(b, h, q_idx, kv_idx), want, device)
        else:  # mixed: the kinds differ by (b, h)
            assert run.full is not None
            piece = torch.as_tensor(run.full, device=device)
            if run.partial is not None:
                assert mask_mod is not None
                answer = _answer("flex_attention", mask_mod(b, h, q_idx, kv_idx), want, device)
                piece = piece | (torch.as_tensor(run.partial, device=device) & answer)
        pieces.append(piece.reshape((1,) * (4 - piece.dim()) + tuple(piece.shape)))  # rank 4
    lead = torch.broadcast_shapes(*(tuple(p.shape[:2]) + (1, 1) for p in pieces))[:2]
    pieces = [p.expand(*lead, rows, run.stop - run.start) for p, run in zip(pieces, qb.runs, strict=True)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def _answer(where: str, answer: Any, want: tuple[int, ...], device: Any) -> Tensor:
    """A mask mod's answer as a tensor on ``device``, checked
    (``attention_spec.flex_answers``: bool, broadcasting to ``want`` (B', H', rows, keys);
    the text the JAX twin gives).  ``True`` (a Python bool) is a 0-d bool tensor."""
    answer = torch.as_tensor(answer, device=device)
    check_mask_answer(where, dtype_name(answer.dtype), answer.shape, want)
    return answer


def _lse(scores: Tensor, mask: Tensor | None) -> Tensor:
    """log(sum(exp(scores))) over the keys ``mask`` lets through (B, Hq, rows); -inf for a
    row that sees none (with zero gradients)."""
    if mask is None:
        return torch.logsumexp(scores, dim=-1)
    live = mask.expand(scores.shape).any(dim=-1)
    kept = scores.masked_fill(~mask, -math.inf)
    safe = torch.where(live[..., None], kept, torch.zeros_like(kept))
    return torch.where(live, torch.logsumexp(safe, dim=-1), torch.full_like(live, -math.inf, dtype=scores.dtype))


def blocks_computed(block_mask: Any, q_len: int, kv_len: int) -> int:
    """How many (query block, key block) pairs a call over this block mask computes (for
    the tests: block skipping is real).  Without a block mask every pair, in blocks of
    ``DEFAULT_BLOCK``."""
    if block_mask is None:
        return -(-q_len // DEFAULT_BLOCK) * -(-kv_len // DEFAULT_BLOCK)
    size = tuple(int(s) for s in block_mask.BLOCK_SIZE)
    plan = spec.plan_blocks(*_host(block_mask), (size[0], size[1]), (q_len, kv_len))
    return spec.blocks_computed(plan, (size[0], size[1]))

