"""PyTorch's fused path: ``F.scaled_dot_product_attention`` (SDPA), with this library's
fully-masked-row policy (zeros, finite gradients), padding as a dense mask and a bias
as SDPA's additive mask."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from torch_attention.masks import _and_masks as combine_masks
from torch_attention.masks import causal_mask

# SDPA draws dropout itself (JAX's fused kernel cannot).
FUSED_DRAWS_DROPOUT = True


def _fused(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, lengths: Tensor | None,
    scale: float, dropout_rate: float, bias: Tensor | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention`` with this library's fully-masked-row policy
    (zeros, finite gradients).  Causal alone goes to the kernel as ``is_causal``; SDPA
    takes no lengths, so padding becomes part of a dense mask.  On CPU, half precision
    runs in float32 and the output is rounded once (the CPU kernel rounds its
    intermediate results to bfloat16; the twin of JAX's fused path on CPU)."""
    out_dtype = v.dtype
    gqa = q.dim() >= 3 and k.shape[-3] != q.shape[-3]  # grouped heads, read in place by SDPA
    if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    full = combine_masks(mask, lengths)
    if full is None and bias is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_rate, is_causal=causal, scale=scale,
                                             enable_gqa=gqa)
        return out if out.dtype == out_dtype else out.to(out_dtype)  # (a decode step's path: no no-op call)
    if causal:  # SDPA takes is_causal or attn_mask, not both
        full = combine_masks(full, causal_mask(q.shape[-2], k.shape[-2], device=q.device))
    if bias is not None:
        return _fused_with_bias(q, k, v, full, bias, scale=scale, dropout_rate=dropout_rate, gqa=gqa).to(out_dtype)
    assert full is not None  # (no mask and no bias returned above)
    live = full.any(dim=-1, keepdim=True)  # rows with something to attend to
    # A row with nothing to attend to attends to everything (finite, unlike SDPA's NaN),
    # and its output is zeroed: zero values, zero and finite gradients.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=full | ~live, dropout_p=dropout_rate, scale=scale,
                                         enable_gqa=gqa)
    return torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device)).to(out_dtype)


def _fused_with_bias(
    q: Tensor, k: Tensor, v: Tensor, full: Tensor | None, bias: Tensor, *, scale: float, dropout_rate: float,
    gqa: bool,
) -> Tensor:
    """SDPA with the bias as its additive mask, -inf where ``full`` blocks.  A -inf entry
    blocks its key as a mask does (``_bias_allows``), read here from the additive mask
    itself, in three passes over it rather than a bool mask's six: a row whose maximum is
    -inf (nothing to attend to) gets 0 in place of its -inf (finite, unlike SDPA's NaN)
    and a zero output; a key that is -inf for every query of its group gets zero k and v
    (a NaN stored there reaches nothing, as for a masked key)."""
    additive = bias.to(q.dtype)
    if full is not None:  # (broadcasting both ways: the mask may have dimensions that the bias shares)
        additive = torch.where(full, additive, torch.tensor(-math.inf, dtype=q.dtype, device=q.device))
    dead = additive.amax(dim=-1, keepdim=True) == -math.inf  # rows with nothing to attend to (NaN stays live)
    unseen = (additive.amax(dim=-2, keepdim=True) == -math.inf).transpose(-2, -1)  # (..., S, 1)
    groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
    if groups > 1 and unseen.dim() >= 3 and unseen.shape[-3] > 1:  # hidden from every head of its group
        unseen = unseen.unflatten(-3, (-1, groups)).all(dim=-3)
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    k, v = k.masked_fill(unseen, zero), v.masked_fill(unseen, zero)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive.masked_fill(dead, 0.0), dropout_p=dropout_rate,
                                         scale=scale, enable_gqa=gqa)
    return out.masked_fill(dead, 0.0)
