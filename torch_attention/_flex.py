"""``flex_attention`` for PyTorch, on CPU with a backward: PyTorch's flex_attention (score
and mask mods, block-sparse block masks) on the library's math.  ``jax_attention/_flex.py``
is its twin; the mods are ``attention_spec.mods``'s, the checks and the block plan
``attention_spec.flex``'s, what a mask mod may answer ``attention_spec.flex_answers``'s.

PyTorch's own ``flex_attention`` has no backward on CPU and, eager, makes the whole
(L, S) scores.  Here, per query block of ``BLOCK_SIZE`` rows, only the key blocks that the
block mask marks non-empty are computed, ``KEY_CHUNK`` keys at a time: their scores in
the compute dtype (float32 for half precision; float64 stays), ``score_mod`` applied with
index tensors, the mask mod on partial blocks only (its bool answer broadcast to the
block's keys), then FlashAttention's recurrences (``_Run``): an online softmax forward
that keeps each row's log-sum-exp, and a backward (``_Flex``, one autograd node) that
recomputes each chunk's weights from it, the score mod's derivative taken by autograd on
the chunk alone.  Only q, k, v, the output and the log-sum-exp are kept for the backward,
and nothing made for one block outlives it.

Beyond PyTorch's: attention sinks (a key with no value that each row has seen before its
first chunk, so the recurrences are the library's softmax with sinks and the lse holds the
sink's term) and dropout on the weights (an explicit keep-mask, or one drawn per query
block and chunk from a seed drawn once per call: ``_Dropout``, which the backward asks
again for the same blocks), the JAX twin's numbers and error texts.

Why not a ``torch.utils.checkpoint`` per query block (as before): it kept no (L, S) tensor,
but it kept every block's autograd nodes, small allocations that glibc places in the
freed scores of the block before, so that each wider block (a causal mask: block i has
i + 1 key blocks) took new heap; the peak resident memory grew with the square of the
sequence (B1 H2 D32, causal, ALiBi, forward + backward: 0.55 / 1.3 / 4.2 GB at S = 4096 /
8192 / 16384, where the live tensors stayed near 0.1 GB).  The checkpointed blocks
remain for a score mod that reaches tensors needing gradients of their own (a learnt
bias it captures; ``_NeedsCheckpoint``), which ``_Flex`` cannot reach.  The block plan is
read from the block mask's tables on the host (they are small).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from attention_spec import flex as spec
from attention_spec.arrays import dtype_name, host_array
from attention_spec.flex import DEFAULT_BLOCK, BlockMask
from attention_spec.flex_answers import check_mask_answer
from torch_attention._reference import _compute_dtype, _softmax, dropout_weights, resolve_scale

# A query block's keys are computed this many at a time (the last chunk fewer): the widest
# scores a call makes are (B, Hq, BLOCK_SIZE, KEY_CHUNK), whatever the sequence.
KEY_CHUNK = 1024


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
                     seq_lengths=(q_len, kv_len), made_for=mask_mod)


def extras(query: Tensor, key: Tensor, *, sinks: Any, dropout_rate: Any, training: Any, dropout_mask: Any,
           generator: Any) -> spec.FlexExtras:
    """``flex_attention``'s sinks and dropout checked (``attention_spec.flex.check_flex_extras``,
    the JAX twin's texts), sinks and keep-mask as tensors on q's device (a keep-mask given
    as a list or NumPy array is checked as given).  Raises TypeError / ValueError."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"flex_attention: generator must be a torch.Generator or None; got {type(generator).__name__}")
    if sinks is not None and not isinstance(sinks, Tensor):
        sinks = torch.as_tensor(host_array("sinks", sinks))
    if dropout_mask is not None and not isinstance(dropout_mask, Tensor):
        dropout_mask = host_array("dropout_mask", dropout_mask)
    # torch always has a random stream: ``generator``, else its global one (as nn.Dropout)
    found = spec.check_flex_extras(query, key, sinks=sinks, dropout_rate=dropout_rate, mode=("training", training),
                                   dropout_mask=dropout_mask, rng=("a generator", True))
    keep = None if found.keep is None else torch.as_tensor(found.keep, device=query.device)
    return found._replace(sinks=None if sinks is None else sinks.to(query.device), keep=keep)


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Callable[..., Any] | None = None,
                   block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, *, sinks: Tensor | None = None, dropout_rate: float = 0.0,
                   training: bool = False, dropout_mask: Any = None,
                   generator: torch.Generator | None = None) -> Tensor | tuple[Tensor, Tensor]:
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
      sinks: None or a float tensor (Hq,): attention sinks (gpt-oss), one logit per query
        head in every softmax's denominator, in the units of the modded scores: a row's
        weights are exp(s_j - lse) with lse = log(sum_j exp(s_j) + exp(sink)), so they sum
        to less than 1, and ``return_lse`` returns that lse (the sink's term included: a
        row that sees no key has output zeros and lse = its sink).  Differentiable.
      dropout_rate, training, dropout_mask, generator: dropout on the weights (training
        only, survivors scaled by 1/(1 - rate)); ``dropout_mask`` (bool, True = keep,
        broadcastable to (B, Hq, L, S)) replaces the draw, as in
        ``dot_product_attention``; without it the keep-mask is drawn block by block from a
        seed drawn once from ``generator`` (None: torch's global generator), and the
        backward redraws the same blocks.  The lse is the softmax's, before dropout.

    Differentiable in q, k, v and sinks (once: FlashAttention's backward, a chunk of keys
    recomputed at a time) and the tensors the mods capture (then each query block is a
    ``torch.utils.checkpoint``).

    Raises:
      ValueError / TypeError: shapes, dtypes, scale, mods, a block mask, sinks or dropout
        that do not fit (``attention_spec.flex``'s texts, the JAX twin's), before any
        computation.
    """
    groups, scale = spec.check_flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa)
    found = extras(query, key, sinks=sinks, dropout_rate=dropout_rate, training=training,
                   dropout_mask=dropout_mask, generator=generator)
    plan, mask_mod = _plan(query, key, block_mask)
    batch, heads, q_len, dim = query.shape
    kv_heads, v_dim = key.shape[1], value.shape[3]
    scale = resolve_scale(scale, dim)
    qg = query.reshape(batch, kv_heads, groups, q_len, dim)  # (B, Hkv, G, L, E): query head h = kvh * G + g
    kg, vg = key[:, :, None], value[:, :, None]  # (B, Hkv, 1, S, E|Ev)
    ct = _compute_dtype(query.dtype)
    drop = _Dropout(found, (batch, heads, q_len, key.shape[2]), generator, query.device)
    run = _Run(plan, score_mod, mask_mod, scale, ct, groups, drop)
    recompute = torch.is_grad_enabled()
    sinks = found.sinks
    try:
        if recompute and any(t is not None and t.requires_grad for t in (query, key, value, sinks)):
            out, lse = _Flex.apply(query, key, value, sinks, run)
        else:
            out, lse = run.forward(query, key, value, sinks, check=recompute)
            out = out.to(value.dtype)
        return (out, lse) if return_lse else out
    except _NeedsCheckpoint:
        pass
    # a score mod over tensors that need gradients: each query block under a checkpoint
    outs, lses = [], []
    for number, qb in enumerate(plan):
        rows = qb.stop - qb.start
        if not qb.runs:  # every key blocked: zeros, lse -inf (with sinks: the sink's)
            outs.append(query.new_zeros((batch, heads, rows, v_dim), dtype=value.dtype))
            lses.append(_empty_lse(query, sinks, ct, rows))
            continue
        block = _query_block(qb, score_mod, mask_mod, scale, ct, heads, return_lse, sinks, drop, number)
        q_rows = qg[:, :, :, qb.start:qb.stop]
        out, lse = checkpoint(block, q_rows, kg, vg, use_reentrant=False) if recompute else block(q_rows, kg, vg)
        outs.append(out.to(value.dtype))
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, Hq, L, Ev)
    if not return_lse:
        return out
    return out, lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)


class _NeedsCheckpoint(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by ``_Run.forward`` where the score mod reaches tensors that need gradients
    (a learnt bias it captures), which ``_Flex`` cannot reach: ``flex_attention`` then runs
    each query block under ``torch.utils.checkpoint``, which does."""


class _Run:
    """One call's plan and mods, and its forward and backward, a query block at a time
    and, within it, ``KEY_CHUNK`` keys at a time (``_chunks``): FlashAttention's
    recurrences (an online softmax forward; a backward recomputing each chunk's weights
    from the row's log-sum-exp), in the compute dtype, written into tensors made once.
    Nothing is allocated per block that outlives it, so that the allocator reuses one
    block's freed memory for the next (module docstring)."""

    def __init__(self, plan: tuple[spec.QueryBlock, ...], score_mod: Callable[..., Any] | None,
                 mask_mod: Callable[..., Any] | None, scale: float, ct: torch.dtype, groups: int,
                 drop: _Dropout) -> None:
        self.plan, self.score_mod, self.mask_mod = plan, score_mod, mask_mod
        self.scale, self.ct, self.groups, self.drop = scale, ct, groups, drop

    def _factors(self, number: int, part: int, chunk: spec.QueryBlock, shape: tuple[int, ...]) -> Tensor | None:
        """Query block ``number``'s chunk ``part``: keep / (1 - rate) (B, Hq, rows, n) in the
        compute dtype (``dropout_weights``' factor), None without dropout."""
        kept = self.drop.keep_mask(number, part, chunk, shape)
        return None if kept is None else kept.to(self.ct) * (1.0 / (1.0 - self.drop.rate))

    def _scores(self, chunk: spec.QueryBlock, q: Tensor, k: Tensor, heads: int, grad: bool,
                check: bool = False) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Any]:
        """One chunk's (raw scaled scores, modded scores (B, Hq, rows, n), mask (True =
        visible, broadcastable; None: all), its keys k (B, Hkv, 1, n, E), its key index:
        a (start, stop) span or positions).  ``grad``: the modded scores are a function of
        the raw ones for autograd.  ``check``: raises ``_NeedsCheckpoint`` where the mod's
        answer needs gradients of its own (with raw scores that need none)."""
        batch, kv_heads, groups, rows, _ = q.shape
        device = q.device
        span = chunk.span
        index: Any = span if span is not None else torch.as_tensor(chunk.key_positions, device=device)
        k_c = k[..., span[0]:span[1], :] if span is not None else k.index_select(-2, index)
        n = k_c.shape[-2]
        raw = torch.matmul(q, k_c.to(self.ct).transpose(-2, -1)).reshape(batch, heads, rows, n) * self.scale
        b = torch.arange(batch, device=device).reshape(batch, 1, 1, 1)
        h = torch.arange(heads, device=device).reshape(1, heads, 1, 1)
        q_idx = torch.arange(chunk.start, chunk.stop, device=device).reshape(1, 1, rows, 1)
        mask = _mask(chunk, self.mask_mod, b, h, q_idx, tuple(raw.shape))
        scores = raw
        if self.score_mod is not None:
            kv_idx = torch.as_tensor(chunk.key_positions, device=device).reshape(1, 1, 1, n)
            if grad:
                raw.requires_grad_(True)
            with torch.set_grad_enabled(grad or check):
                scores = torch.as_tensor(self.score_mod(raw, b, h, q_idx, kv_idx)).expand(raw.shape).to(self.ct)
            if check and not grad and scores.requires_grad:
                raise _NeedsCheckpoint
            finite = scores.detach() != -math.inf  # a score the mod makes -inf blocks its key
            mask = finite if mask is None else mask & finite
        return raw, scores, mask, k_c, index

    def _keys(self, v: Tensor, index: Any) -> Tensor:
        return v[..., index[0]:index[1], :] if isinstance(index, tuple) else v.index_select(-2, index)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, sinks: Tensor | None,
                check: bool) -> tuple[Tensor, Tensor]:
        """(out (B, Hq, L, Ev), lse (B, Hq, L)), both in the compute dtype.  ``check``
        (gradients are being recorded): the first chunk's score mod is asked with autograd
        on whether it needs gradients of its own (``_NeedsCheckpoint``).

        A sink (``sinks`` (Hq,)) is a key with no value that each row has seen before its
        first chunk: the running maximum starts at the sink and the running sum at
        exp(sink - sink) = 1 (0 for a sink of -inf), so the recurrences give the
        library's softmax with sinks (``_reference._softmax``: m the larger of the row's
        maximum and the sink, exp(sink - m) in the denominator) and lse its logarithm.
        Dropout multiplies the weights that mix the values, never the sum."""
        batch, heads, q_len, dim = query.shape
        kv_heads, v_dim = key.shape[1], value.shape[3]
        ct = self.ct
        out = query.new_zeros((batch, heads, q_len, v_dim), dtype=ct)
        sink = None if sinks is None else sinks.detach().to(ct).reshape(1, heads, 1, 1)
        lse = _empty_lse(query, sink, ct, q_len)
        with torch.no_grad():
            qg = query.to(ct).reshape(batch, kv_heads, self.groups, q_len, dim)
            kg, vg = key[:, :, None], value[:, :, None]  # (B, Hkv, 1, S, E|Ev)
            for number, qb in enumerate(self.plan):
                if not qb.runs:  # every key blocked: zeros, lse -inf (with sinks: the sink's)
                    continue
                rows = qb.stop - qb.start
                q = qg[:, :, :, qb.start:qb.stop]
                if sink is None:
                    top = out.new_full((batch, heads, rows, 1), -math.inf)
                    total = out.new_zeros((batch, heads, rows, 1))
                else:  # the sink seen first: m = sink, sum = exp(sink - m)
                    top = sink.expand(batch, heads, rows, 1).clone()
                    total = (top != -math.inf).to(ct)
                acc = out.new_zeros((batch, heads, rows, v_dim))
                for part_number, chunk in enumerate(_chunks(qb, KEY_CHUNK)):
                    _, scores, mask, _, index = self._scores(chunk, q, kg, heads, grad=False, check=check)
                    check = False
                    if mask is not None:
                        scores = scores.masked_fill(~mask, -math.inf)
                    new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
                    shift = torch.where(new_top == -math.inf, torch.zeros_like(new_top), new_top)
                    weights = torch.exp(scores - shift)  # (B, Hq, rows, n); a blocked key's 0
                    decay = torch.exp(top - shift)
                    total = total * decay + weights.sum(dim=-1, keepdim=True)
                    factors = self._factors(number, part_number, chunk, tuple(weights.shape))
                    mixed = weights if factors is None else weights * factors
                    part = torch.matmul(mixed.reshape(batch, kv_heads, self.groups, rows, -1),
                                        self._keys(vg, index).to(ct))
                    acc = acc * decay + part.reshape(batch, heads, rows, v_dim)
                    top = new_top
                live = total > 0
                out[:, :, qb.start:qb.stop] = acc / torch.where(live, total, torch.ones_like(total))
                shift = torch.where(live, top, torch.zeros_like(top))
                lse[:, :, qb.start:qb.stop] = torch.where(live, shift + torch.log(torch.where(
                    live, total, torch.ones_like(total))), torch.full_like(total, -math.inf))[..., 0]
        return out, lse

    def backward(self, query: Tensor, key: Tensor, value: Tensor, sinks: Tensor | None, out: Tensor, lse: Tensor,
                 d_out: Tensor, d_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(dq, dk, dv, dsinks) in the inputs' dtypes (dsinks None without sinks), from the
        forward's out and lse (compute dtype) and the gradients of the outputs: per chunk,
        the weights p = exp(s - lse), with dropout's factors m = keep / (1 - rate) (the
        forward's keep-mask, drawn again), dv += (p m)^T dO,
        ds = p (m dO v^T - rowsum(dO out) + dlse), through the score mod by autograd, then
        dq += ds k, dk += ds^T q (times the scale); a sink's weight exp(sink - lse) gives
        dsink = -sum over rows of exp(sink - lse) (rowsum(dO out) - dlse)."""
        batch, heads, q_len, dim = query.shape
        kv_heads, v_dim = key.shape[1], value.shape[3]
        ct, groups = self.ct, self.groups
        with torch.no_grad():
            qg = query.to(ct).reshape(batch, kv_heads, groups, q_len, dim)
            kg, vg = key[:, :, None], value[:, :, None]
            d_out = d_out.to(ct)
            delta = (d_out * out).sum(dim=-1, keepdim=True)  # (B, Hq, L, 1)
            if d_lse is not None:
                delta = delta - d_lse.to(ct)[..., None]
            dq = torch.zeros_like(qg)
            dk = key.new_zeros((batch, kv_heads, key.shape[2], dim), dtype=ct)
            dv = value.new_zeros((batch, kv_heads, value.shape[2], v_dim), dtype=ct)
            for number, qb in enumerate(self.plan):
                if not qb.runs:
                    continue
                rows, rs = qb.stop - qb.start, slice(qb.start, qb.stop)
                q = qg[:, :, :, rs]
                row_lse = lse[:, :, rs, None]
                row_lse = torch.where(row_lse == -math.inf, torch.zeros_like(row_lse), row_lse)
                grad_rows = d_out[:, :, rs].reshape(batch, kv_heads, groups, rows, v_dim)
                row_delta = delta[:, :, rs]
                for part_number, chunk in enumerate(_chunks(qb, KEY_CHUNK)):
                    raw, scores, mask, k_c, index = self._scores(chunk, q, kg, heads,
                                                                 grad=self.score_mod is not None)
                    weights = torch.exp(scores.detach() - row_lse)
                    if mask is not None:
                        weights = weights.masked_fill(~mask, 0.0)
                    n = weights.shape[-1]
                    factors = self._factors(number, part_number, chunk, tuple(weights.shape))
                    mixed = weights if factors is None else weights * factors
                    w5 = mixed.reshape(batch, kv_heads, groups, rows, n)
                    dv_c = torch.matmul(w5.transpose(-2, -1), grad_rows).sum(dim=2)  # (B, Hkv, n, Ev)
                    dp = torch.matmul(grad_rows, self._keys(vg, index).to(ct).transpose(-2, -1))
                    dp = dp.reshape(batch, heads, rows, n)
                    ds = weights * ((dp if factors is None else dp * factors) - row_delta)
                    if self.score_mod is not None:
                        ds = _through(scores, raw, ds, mask)
                    d5 = ds.reshape(batch, kv_heads, groups, rows, n) * self.scale
                    dq[:, :, :, rs] += torch.matmul(d5, k_c.to(ct))
                    dk_c = torch.matmul(d5.transpose(-2, -1), q).sum(dim=2)  # (B, Hkv, n, E)
                    if isinstance(index, tuple):
                        dk[:, :, index[0]:index[1]] += dk_c
                        dv[:, :, index[0]:index[1]] += dv_c
                    else:
                        dk.index_add_(2, index, dk_c)
                        dv.index_add_(2, index, dv_c)
            d_sinks = None
            if sinks is not None:
                sink = sinks.to(ct).reshape(1, heads, 1)
                p_sink = torch.where(lse == -math.inf, torch.zeros_like(lse), torch.exp(sink - lse))  # (B, Hq, L)
                d_sinks = -(p_sink * delta[..., 0]).sum(dim=(0, 2)).to(sinks.dtype)
        return (dq.reshape(batch, heads, q_len, dim).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), d_sinks)


def _through(scores: Tensor, raw: Tensor, grad: Tensor, mask: Tensor | None) -> Tensor:
    """``grad`` (of the modded scores) taken back through the score mod to the raw
    scores, 0 at blocked keys (a mod's derivative there may be inf or NaN)."""
    if not scores.requires_grad:  # the mod's answer does not depend on the score
        return torch.zeros_like(grad)
    with torch.enable_grad():
        (got,) = torch.autograd.grad(scores, raw, grad, allow_unused=True)
    if got is None:
        return torch.zeros_like(grad)
    return got if mask is None else got.masked_fill(~mask, 0.0)


class _Flex(torch.autograd.Function):
    """``_Run``'s forward and backward as one autograd node: (q, k, v) -> (out in v's
    dtype, lse), saving q, k, v, out and lse (O(L + S)), never a block's scores."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, sinks: Tensor | None,
                run: _Run) -> tuple[Tensor, Tensor]:
        out, lse = run.forward(query, key, value, sinks, check=True)
        ctx.save_for_backward(query, key, value, out, lse, sinks)
        ctx.run = run
        return out.to(value.dtype), lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_lse: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None, None]:
        query, key, value, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, d_sinks = ctx.run.backward(query, key, value, sinks, out, lse, d_out, d_lse)
        return dq, dk, dv, d_sinks, None


class _Dropout:
    """A call's dropout on the flex path: off (``rate`` 0), an explicit keep-mask (a view
    of it broadcast to (B, Hq, L, S), sliced per chunk), or drawn: one seed drawn from the
    call's generator (torch's global one where None), and each (query block, chunk of
    keys) a generator of its own seeded from it, so that the backward, which walks the
    same blocks and chunks, draws the same keep-mask, and no (L, S) mask is made."""

    def __init__(self, found: spec.FlexExtras, shape: tuple[int, int, int, int], generator: Any,
                 device: Any) -> None:
        self.rate, self.device = found.rate, device
        keep = found.keep
        self.keep = None if keep is None else keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape)).expand(shape)
        self.seed = None
        if found.drawn:
            where = "cpu" if generator is None else generator.device
            self.seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=where))

    def keep_mask(self, number: int, part: int, chunk: spec.QueryBlock, shape: tuple[int, ...]) -> Tensor | None:
        """Query block ``number``'s chunk ``part`` (its rows and key positions): the keep-mask
        (bool, True = keep) of its weights ``shape`` (B, Hq, rows, n), None without dropout."""
        if self.rate == 0.0:
            return None
        if self.keep is not None:
            rows = self.keep[:, :, chunk.start:chunk.stop]
            span = chunk.span
            if span is not None:
                return rows[..., span[0]:span[1]]
            return rows.index_select(-1, torch.as_tensor(chunk.key_positions, device=rows.device))
        assert self.seed is not None
        own = torch.Generator(device=self.device).manual_seed(self.seed + (number << 20) + part)
        return torch.rand(shape, generator=own, device=self.device) >= self.rate


def _empty_lse(query: Tensor, sink: Tensor | None, ct: torch.dtype, rows: int) -> Tensor:
    """The lse (B, Hq, rows) of rows that see no key: -inf, or with sinks (Hq,) (or
    (1, Hq, 1, 1)) each head's sink (log(exp(sink)): the whole weight on the sink; a sink
    of -inf is none, with no gradient)."""
    batch, heads = query.shape[:2]
    if sink is None:
        return query.new_full((batch, heads, rows), -math.inf, dtype=ct)
    sink = sink.to(ct).reshape(1, heads, 1)
    sink = torch.where(sink == -math.inf, torch.full_like(sink, -math.inf), sink)
    return sink.expand(batch, heads, rows).clone()


def run_call(q: Tensor, k: Tensor, v: Tensor, call: Any, *, scale: float) -> Tensor:
    """The flex path of a module's call whose mods stand for no named option (a row of
    ``_paths``): the call's options and tensors and the module's mods as one score mod
    and one mask mod (``attention_spec.flex.call_mods``), the mask mod's block mask (for
    the examples and heads it reads, ``attention_spec.flex.mask_reads``; (1, 1) where it
    reads neither), then
    ``flex_attention``, with the call's sinks and its explicit dropout mask (dropout drawn
    without one never comes here: ``attention_spec.flex.mod_blockers``).  q (B, H, T, D),
    k and v (B, Hkv, S, D)."""
    score_mod, mask_mod = spec.call_mods(call.options, offset=call.offset, mask=call.mask, bias=call.bias,
                                         lengths=call.kv_lengths, segments=call.segments,
                                         chunk_origin=call.chunk_origin)
    block_mask = None
    if mask_mod is not None:
        reads_b, reads_h = spec.mask_reads(mask_mod)
        batch, heads = (q.shape[0] if reads_b else 1), (q.shape[1] if reads_h else 1)
        block_mask = create_block_mask(mask_mod, batch, heads, q.shape[2], k.shape[2], device=q.device,
                                       BLOCK_SIZE=DEFAULT_BLOCK)
    out = flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa=q.shape[1] != k.shape[1],
                         sinks=call.sinks, dropout_rate=call.options.dropout_rate, training=call.options.training,
                         dropout_mask=call.dropout_mask)
    assert isinstance(out, Tensor)
    return out


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
                 scale: float, ct: torch.dtype, heads: int, with_lse: bool, sinks: Tensor | None, drop: _Dropout,
                 number: int) -> Callable[..., tuple[Tensor, Tensor]]:
    """The function of query block ``number``, (q (B, Hkv, G, rows, E), k, v (B, Hkv, 1, S, .))
    -> (out (B, Hq, rows, Ev) in the compute dtype, lse (B, Hq, rows); ``with_lse`` False:
    an empty tensor in its place, the log-sum-exp not computed): the library's softmax
    (with ``sinks`` (Hq,) in its denominator, lse then log(exp(lse) + exp(sink))), then
    ``dropout_weights`` with ``drop``'s keep-mask of the whole block (drawn again when the
    checkpoint recomputes it)."""
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
        weights = _softmax(scores, mask, sinks=None if sinks is None else sinks.to(ct))
        kept = drop.keep_mask(number, 0, qb, tuple(weights.shape))
        if kept is not None:
            weights = dropout_weights(weights, drop.rate, training=True, dropout_mask=kept)
        out = torch.matmul(weights.reshape(batch, kv_heads, groups, rows, n), v.to(ct))
        if not with_lse:
            return out.reshape(batch, heads, rows, -1), scores.new_empty(0)
        lse = _lse(scores, mask)
        if sinks is not None:  # log(sum_j exp(s_j) + exp(sink)); a sink of -inf is none (no NaN gradient)
            sink = sinks.to(ct).reshape(1, heads, 1)
            none = sink == -math.inf
            lse = torch.where(none, lse, torch.logaddexp(lse, torch.where(none, torch.zeros_like(sink), sink)))
        return out.reshape(batch, heads, rows, -1), lse

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


def _chunks(qb: spec.QueryBlock, size: int) -> list[spec.QueryBlock]:
    """A query block's key runs cut into chunks of at most ``size`` keys, each a query block
    of the same rows (a mixed run's flags cut with its keys)."""
    chunks: list[spec.QueryBlock] = []
    runs: list[spec.KeyRun] = []
    room = size
    for run in qb.runs:
        start = run.start
        while start < run.stop:
            stop = min(run.stop, start + room)
            a, z = start - run.start, stop - run.start
            runs.append(run._replace(start=start, stop=stop,
                                     full=None if run.full is None else run.full[..., a:z],
                                     partial=None if run.partial is None else run.partial[..., a:z]))
            room -= stop - start
            start = stop
            if room == 0:
                chunks.append(qb._replace(runs=tuple(runs)))
                runs, room = [], size
    if runs:
        chunks.append(qb._replace(runs=tuple(runs)))
    return chunks


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

