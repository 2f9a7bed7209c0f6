"""The explicit attention math of PyTorch: scores, their normalisation, dropout and the
weights, written out (the reference path, and the pieces the other paths share).

Precision: scores are formed, scaled, masked and normalised in float32 for
float16/bfloat16 inputs (float64 stays float64); ``functional`` re-exports the public
functions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attention_spec import check_mask_strategy, zero_row_sum_message
from torch_attention._canonical import _bias_allows
from torch_attention.masks import _and_masks as combine_masks
from torch_attention.masks import causal_mask


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``None`` -> 1/sqrt(head_dim); a float is used as given (1.0 = unscaled)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _adjust(scores: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """Scaled scores -> ``softcap * tanh(s / softcap)``, then ``+ bias`` (in the scores'
    compute dtype: a half-precision bias is added in float32)."""
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    return scores


def attention_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """``scale * q @ k^T``: (..., T, D), (..., S, D) -> (..., T, S) in the compute dtype
    (q and k are upcast first: half-precision scores would overflow or lose digits)."""
    ct = _compute_dtype(q.dtype)
    return torch.matmul(q.to(ct), k.to(ct).transpose(-2, -1)) * scale  # (..., T, S)


def normalize_scores(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
) -> Tensor:
    """Scores (..., T, S) -> weights (..., T, S), each row summing to 1 or 0.

    ``mask_strategy="fill"`` sets masked scores to -inf before the softmax;
    ``"renormalize"`` takes the softmax over every key, zeroes the masked weights and
    divides by the new row sum (seed 004).  In exact arithmetic the two are equal, so
    both are computed as the stable ``"fill"`` (the row maximum over the visible keys):
    the literal renormalisation underflows to a zero row when a hidden key's logit is
    about 104 above the visible ones.  Both give zeros for a fully masked row.
    ``normalization="sum"`` divides the (masked) scores by their row sum instead of a
    softmax, and raises ``ValueError`` where a row with something to attend to sums to 0.
    """
    if normalization == "sum":
        kept = scores if mask is None else scores.masked_fill(~mask, 0.0)
        row_sum = kept.sum(dim=-1, keepdim=True)
        live = torch.ones_like(row_sum, dtype=torch.bool) if mask is None else mask.any(-1, keepdim=True)
        if bool(((row_sum == 0) & live).any()):
            raise ValueError(zero_row_sum_message())
        return kept / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)

    return _softmax(scores, mask)


def _softmax(scores: Tensor, mask: Tensor | None, scale: float = 1.0, sinks: Tensor | None = None) -> Tensor:
    """softmax(scale * scores) over the keys that ``mask`` lets through (``scale > 0``).

    The maximum is taken over the unscaled scores and ``(scores - max) * scale`` is
    exponentiated: the subtraction is exact for the largest score whatever a compiler
    fuses (the twin of the JAX formulation, where it matters).

    With ``sinks`` (H,) the scores (..., H, T, S) are the final ones (``scale`` 1) and each
    row's denominator also holds its head's sink logit (gpt-oss):
    ``exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m))`` with m the larger of the row
    maximum and the sink, so a row sums to less than 1.  A row with nothing to attend to
    has m = sink: its sum is 1 and its weights 0 (zeros, finite gradients).  The sinks
    are cast to the scores' (compute) dtype and get their gradient through the
    denominator (m is a constant shift)."""
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    if sinks is not None:
        sink = sinks.to(scores.dtype)[:, None, None]  # (H, 1, 1): broadcasts over T and the lead
        row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sink).detach()
        # a row with nothing to attend to whose sink is -inf (no sink) subtracts 0: its
        # weights are 0 / 0, which _safe_divide turns into zeros (finite gradients)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        unnormalized = torch.exp(scores - row_max)
        return _safe_divide(unnormalized, unnormalized.sum(dim=-1, keepdim=True) + torch.exp(sink - row_max))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    if mask is not None:
        # A row with nothing to attend to (known from the mask) subtracts 0: exp(-inf)
        # stays exactly 0 and the division below turns 0/0 into 0, gradients finite.
        row_max = torch.where(mask.any(dim=-1, keepdim=True), row_max, torch.zeros_like(row_max))
    unnormalized = torch.exp((scores - row_max) * scale)
    return _safe_divide(unnormalized, unnormalized.sum(dim=-1, keepdim=True))


def _safe_divide(weights: Tensor, row_sum: Tensor) -> Tensor:
    return weights / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)


def dropout_weights(
    weights: Tensor, rate: float, *, training: bool, dropout_mask: Tensor | None = None
) -> Tensor:
    """Dropout on attention weights, training mode only, survivors scaled by 1/(1-rate).

    ``dropout_mask`` (bool, True = keep) replaces the random draw, so that two frameworks
    can apply the same dropout; without it the draw uses torch's RNG, as ``nn.Dropout``.
    """
    if not training or rate == 0.0:
        return weights
    if dropout_mask is not None:
        return weights * (dropout_mask.to(weights.dtype) * (1.0 / (1.0 - rate)))
    return F.dropout(weights, rate, training=True)


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    bias: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> Tensor:
    """Weights (..., T, S) from q (..., T, D) and k (..., S, D), before dropout.
    ``bias`` (broadcastable to (..., T, S)) is added to the scaled, soft-capped scores.
    ``sinks`` (H,) where q is (..., H, T, D): one logit per query head in the units of
    those final scores, in each softmax's denominator (``_softmax``; the key weights are
    returned, a row summing to less than 1); softmax only.
    ``score_mod`` / ``mask_mod`` (a module's mods, seeing the indices of q (B, H, T, D)
    and k: ``index_arrays``): the score mod after the bias, the mask mod with the
    mask (and a score it makes -inf blocks its key)."""
    mask = _combine(mask, causal, q.shape[-2], k.shape[-2], q.device)
    if bias is not None:  # a -inf entry blocks its key
        mask = combine_masks(mask, _bias_allows(bias))
    scale = resolve_scale(scale, q.shape[-1])
    if score_mod is not None or mask_mod is not None:
        scores, mask = _modded(_adjust(attention_scores(q, k, scale), bias, softcap), mask, q, k, score_mod, mask_mod)
        if normalization == "sum":
            return normalize_scores(scores, mask, normalization=normalization)
        return _softmax(scores, mask, sinks=sinks)
    if normalization == "sum":
        scores = _adjust(attention_scores(q, k, scale), bias, softcap)
        return normalize_scores(scores, mask, normalization=normalization)
    check_mask_strategy(mask_strategy)  # "renormalize" equals "fill" (see normalize_scores)
    if bias is not None or softcap is not None or sinks is not None:
        return _softmax(_adjust(attention_scores(q, k, scale), bias, softcap), mask, sinks=sinks)
    return _softmax(attention_scores(q, k, 1.0), mask, scale)


def index_arrays(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, T, 1), kv_idx (1, 1, 1, S)): the
    indices a mod takes for every score of q (B, H, T, D) against k (..., S, D)."""
    batch, heads, q_len = q.shape[:3]
    kv_len, device = k.shape[-2], q.device
    return (torch.arange(batch, device=device).reshape(batch, 1, 1, 1),
            torch.arange(heads, device=device).reshape(1, heads, 1, 1),
            torch.arange(q_len, device=device).reshape(1, 1, q_len, 1),
            torch.arange(kv_len, device=device).reshape(1, 1, 1, kv_len))


def _modded(scores: Tensor, mask: Tensor | None, q: Tensor, k: Tensor, score_mod: Any,
            mask_mod: Any) -> tuple[Tensor, Tensor | None]:
    """The final scores (B, H, T, S) and mask with a module's mods applied."""
    b, h, q_idx, kv_idx = index_arrays(q, k)
    if mask_mod is not None:
        mask = combine_masks(mask, torch.as_tensor(mask_mod(b, h, q_idx, kv_idx)).expand(scores.shape))
    if score_mod is not None:
        scores = torch.as_tensor(score_mod(scores, b, h, q_idx, kv_idx)).to(scores.dtype).expand(scores.shape)
        mask = combine_masks(mask, scores != -math.inf)
    return scores, mask


def _combine(mask: Tensor | None, causal: bool, q_len: int, kv_len: int, device) -> Tensor | None:
    if not causal:
        return mask
    tril = causal_mask(q_len, kv_len, device=device)
    return tril if mask is None else mask & tril
