"""PyTorch's blockwise path: the reference math one block of queries at a time, each
block computing only the keys within its reach (``attention_spec.geometry``)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import Tensor

from attention_spec.geometry import key_range as _key_range
from attention_spec.options import CallOptions
from torch_attention._canonical import Call, Operands, Structure, _band
from torch_attention._reference import _adjust, _compute_dtype, _softmax
from torch_attention.masks import _and_masks as combine_masks


def default_block_size(q_len: int) -> int:
    """Query rows per block: 128, growing so that a long sequence has at most 16 blocks."""
    return max(128, -(-q_len // 16))


def blockwise(q: Tensor, k: Tensor, v: Tensor, s: Structure, call: Call, *, scale: float,
              block_size: int | None = None) -> Tensor:
    """The reference math one block of queries at a time.  A causal block of rows
    [r0, r1) needs only the keys [0, r1): the hidden upper triangle is never computed,
    and at most (block, S) scores exist at once; a ``window`` (and a causal mask aligned
    at key ``offset``, and a ``chunk``) likewise restricts each block to the keys [lo, hi) within its
    reach.  Rows are normalised exactly as in the reference path (with ``sinks`` (H,),
    each row's softmax denominator holds its head's sink logit: a block holds whole rows,
    so the sink joins each row once).  Twin of the JAX
    formulation (where it is the CPU fast path).

    Under autograd each block is checkpointed: the backward keeps only the inputs and
    recomputes one block's weights at a time, so training holds O(block x S) scores,
    not all T x S weights (the JAX twin gets the same bound from its flash backward).
    The structure (mask of q's rank, offset, causal, window, chunk, lengths (B, 1, 1, S)) is
    ``s``'s (``_canonical.structure``); bias, soft-cap and sinks are the call's."""
    mask, offset, lengths = s.mask, s.offset, s.lengths
    bias, sinks = call.bias, call.sinks
    q_len, kv_len = q.shape[-2], k.shape[-2]
    block = block_size or default_block_size(q_len)
    ct = _compute_dtype(q.dtype)
    # half-precision scores would overflow or lose digits, and half-precision weights
    # would add a rounding each: everything in the compute dtype, the output rounded once
    qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)
    recompute = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias, sinks)
    )
    outputs = []
    for r0 in range(0, q_len, block):
        r1 = min(r0 + block, q_len)
        lo, hi = _key_range(r0, r1, kv_len, offset, s)  # keys this block can see
        if hi == lo:  # nothing within reach: zero rows
            outputs.append(v.new_zeros((*q.shape[:-2], r1 - r0, v.shape[-1])))
            continue
        allowed = None
        if mask is not None:  # a broadcast (size-1) dimension stays size 1 under the slice
            allowed = mask[..., r0:r1, lo:hi] if mask.shape[-2] > 1 else mask[..., lo:hi]
        allowed = combine_masks(allowed, _band(r1 - r0, hi - lo, r0 + offset, s, 2, q.device, start=lo))
        if lengths is not None:
            allowed = combine_masks(allowed, lengths[..., lo:hi])
        # a broadcast (size-1) dimension of the bias stays size 1 under the slice
        part = None if bias is None else (bias[..., r0:r1, lo:hi] if bias.shape[-2] > 1 else bias[..., lo:hi])
        args = (qc[..., r0:r1, :], kc[..., lo:hi, :], vc[..., lo:hi, :], scale, call.options,
                Operands(bias=part, mask=allowed, sinks=sinks))
        if recompute:
            out = torch.utils.checkpoint.checkpoint(_query_block, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            out = _query_block(*args)
        outputs.append(out.to(v.dtype))
    return torch.cat(outputs, dim=-2) if len(outputs) > 1 else outputs[0]


def _query_block(q: Tensor, k: Tensor, v: Tensor, scale: float, options: CallOptions, block: Operands) -> Tensor:
    """One block of ``blockwise``: q (..., Tb, D), and k and v (..., Sb, D or Dv) on the keys
    within its reach, in the compute dtype -> the block's output (..., Tb, Dv).  ``block``
    holds the block's slice of the bias, its mask (True = may attend) and the call's sinks
    (H,); ``options`` its soft-cap."""
    softcap = options.softcap
    scores = torch.matmul(q, k.transpose(-2, -1))  # unscaled
    if block.bias is None and softcap is None and block.sinks is None:
        weights = _softmax(scores, block.mask, scale)
    else:
        weights = _softmax(_adjust(scores * scale, block.bias, softcap), block.mask, sinks=block.sinks)
    return torch.matmul(weights, v)
