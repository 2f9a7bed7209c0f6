"""The attention math, once, for PyTorch.  ``jax_attention/functional.py`` is its twin.

Dimension legend (the same names on both sides):
  B: batch          H: heads          T / q_len: queries      S / kv_len: keys and values
  D: head_dim (query/key width)       Dv: value width

Masks are bool, ``True`` = may attend, broadcastable to ``(B, H, T, S)`` (or to the
leading dimensions that ``q`` has).  A query row that may attend to nothing gets zero
weights and a zero output, never NaN, with finite gradients.

Precision: scores and values are multiplied in the input dtype; scaling, masking and
normalisation run in float32 for float16/bfloat16 inputs (float64 stays float64); the
weights are cast back to the input dtype before they mix the values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attention_spec import (
    check_dropout_mask,
    check_dropout_rate,
    check_kv_lengths,
    check_mask,
    check_mask_strategy,
    check_normalization,
    check_qkv,
    check_scale,
    dtype_name,
    resolve_implementation,
    zero_row_sum_message,
)
from torch_attention.masks import causal_mask, combine_masks

__all__ = [
    "attention_scores",
    "attention_weights",
    "default_block_size",
    "dot_product_attention",
    "dropout_weights",
    "normalize_scores",
    "resolve_scale",
]


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``None`` -> 1/sqrt(head_dim); a float is used as given (1.0 = unscaled)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """``scale * q @ k^T``: (..., T, D), (..., S, D) -> (..., T, S) in the compute dtype."""
    scores = torch.matmul(q, k.transpose(-2, -1))  # (..., T, S), input dtype
    return scores.to(_compute_dtype(q.dtype)) * scale


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
    divides by the new row sum (seed 004).  Both give zeros for a fully masked row.
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

    if mask is None:
        return _softmax(scores)
    if mask_strategy == "fill":
        return _softmax(scores.masked_fill(~mask, -math.inf))
    weights = _softmax(scores).masked_fill(~mask, 0.0)
    return _safe_divide(weights, weights.sum(dim=-1, keepdim=True))


def _softmax(scores: Tensor) -> Tensor:
    # A row of -inf (nothing to attend to) has max -inf; subtracting 0 instead keeps
    # exp() at exactly 0 and the division below turns 0/0 into 0, gradients finite.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    unnormalized = torch.exp(scores - row_max)
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
) -> Tensor:
    """Weights (..., T, S) from q (..., T, D) and k (..., S, D), before dropout."""
    mask = _combine(mask, causal, q.shape[-2], k.shape[-2], q.device)
    scores = attention_scores(q, k, resolve_scale(scale, q.shape[-1]))
    return normalize_scores(scores, mask, mask_strategy=mask_strategy, normalization=normalization)


def _combine(mask: Tensor | None, causal: bool, q_len: int, kv_len: int, device) -> Tensor | None:
    if not causal:
        return mask
    tril = causal_mask(q_len, kv_len, device=device)
    return tril if mask is None else mask & tril


def dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    kv_lengths: Tensor | None = None,
    scale: float | None = None,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    dropout_rate: float = 0.0,
    dropout_mask: Tensor | None = None,
    training: bool = False,
    return_weights: bool = False,
    implementation: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over q (..., T, D), k (..., S, D), v (..., S, Dv) -> (..., T, Dv).

    Args:
      mask: bool, True = may attend, broadcastable to (..., T, S).
      causal: also block keys after the query (top-left aligned ``tril``).
      kv_lengths: int (B,), the number of valid keys per example (padding given as
        lengths); needs q of shape (B, H, T, D).
      scale: None = 1/sqrt(D); a float as given.
      dropout_rate, training, dropout_mask: dropout on the weights, see ``dropout_weights``.
      return_weights: also return the weights that mixed the values (after dropout).
      implementation: ``"reference"`` (the explicit math), ``"fused"``
        (``F.scaled_dot_product_attention``, which also draws dropout), ``"blockwise"``
        (query blocks that skip the keys a causal mask hides; never materialises T x S;
        the twin of JAX's CPU path), or ``"auto"`` (fused, else blockwise, else the
        reference where those cannot honour an option; see
        ``attention_spec.resolve_implementation``).

    Raises:
      ValueError / TypeError: inconsistent shapes or dtypes, a mask that is not bool or
        does not broadcast, a bad option value, an explicit implementation that cannot
        honour an option; all before any computation.
    """
    check_qkv(q.shape, k.shape, v.shape, (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype)))
    weights_shape = (*q.shape[:-1], k.shape[-2])
    if mask is not None:
        check_mask(mask.shape, dtype_name(mask.dtype), weights_shape)
    if kv_lengths is not None:
        check_kv_lengths(kv_lengths.shape, dtype_name(kv_lengths.dtype), weights_shape)
    if dropout_mask is not None:
        check_dropout_mask(
            dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape, training=training
        )
    check_dropout_rate(dropout_rate)
    check_scale(scale)
    check_mask_strategy(mask_strategy)
    check_normalization(normalization)
    path = resolve_implementation(
        implementation,
        # SDPA is PyTorch's fast path on every device (on CPU a fused blockwise kernel).
        preference=("fused", "blockwise"),
        return_weights=return_weights,
        normalization=normalization,
        dropout_active=training and dropout_rate > 0.0,
        dropout_mask_given=dropout_mask is not None,
        fused_draws_dropout=True,
    )
    scale = resolve_scale(scale, q.shape[-1])
    if path == "fused":
        return _fused(q, k, v, mask=mask, causal=causal, kv_lengths=kv_lengths, scale=scale,
                      dropout_rate=dropout_rate if training else 0.0)
    if path == "blockwise":
        return _blockwise(q, k, v, mask=mask, causal=causal, kv_lengths=kv_lengths, scale=scale)

    mask = combine_masks(mask, None if kv_lengths is None else _length_mask(kv_lengths, k.shape[-2], q.dim()))
    weights = attention_weights(
        q, k, mask=mask, causal=causal, scale=scale,
        mask_strategy=mask_strategy, normalization=normalization,
    )
    weights = dropout_weights(weights, dropout_rate, training=training, dropout_mask=dropout_mask)
    weights = weights.to(v.dtype)
    out = torch.matmul(weights, v)  # (..., T, Dv)
    return (out, weights) if return_weights else out


def _length_mask(kv_lengths: Tensor, kv_len: int, ndim: int) -> Tensor:
    # (B,) -> (B, 1, ..., 1, S): key positions before each example's length
    valid = torch.arange(kv_len, device=kv_lengths.device)[None, :] < kv_lengths[:, None]
    return valid.reshape(valid.shape[:1] + (1,) * (ndim - 2) + valid.shape[1:])


def _fused(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, kv_lengths: Tensor | None,
    scale: float, dropout_rate: float,
) -> Tensor:
    """``F.scaled_dot_product_attention`` with this library's fully-masked-row policy
    (zeros, finite gradients).  Causal alone goes to the kernel as ``is_causal``; SDPA
    takes no lengths, so padding becomes part of a dense mask."""
    full = combine_masks(mask, None if kv_lengths is None else _length_mask(kv_lengths, k.shape[-2], q.dim()))
    if full is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_rate, is_causal=causal, scale=scale)
    if causal:
        full = full & causal_mask(q.shape[-2], k.shape[-2], device=q.device)
    live = full.any(dim=-1, keepdim=True)  # rows with something to attend to
    # A row with nothing to attend to attends to everything (finite, unlike SDPA's NaN),
    # and its output is zeroed: zero values, zero and finite gradients.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=full | ~live, dropout_p=dropout_rate, scale=scale)
    return torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))


def default_block_size(q_len: int) -> int:
    """Query rows per block: 128, growing so that a long sequence has at most 16 blocks."""
    return max(128, -(-q_len // 16))


def _blockwise(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, kv_lengths: Tensor | None,
    scale: float, block_size: int | None = None,
) -> Tensor:
    """The reference math one block of queries at a time.  A causal block of rows
    [r0, r1) needs only the keys [0, r1): the hidden upper triangle is never computed,
    and at most (block, S) scores exist at once.  Rows are normalised exactly as in the
    reference path.  Twin of the JAX formulation (where it is the CPU fast path)."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    block = block_size or default_block_size(q_len)
    ct = _compute_dtype(q.dtype)
    lengths = None if kv_lengths is None else _length_mask(kv_lengths, kv_len, q.dim())
    outputs = []
    for r0 in range(0, q_len, block):
        r1 = min(r0 + block, q_len)
        n = min(r1, kv_len) if causal else kv_len  # keys this block can see
        scores = torch.matmul(q[..., r0:r1, :], k[..., :n, :].transpose(-2, -1)).to(ct) * scale
        allowed = None
        if mask is not None:  # a broadcast (size-1) dimension stays size 1 under the slice
            allowed = mask[..., r0:r1, :n] if mask.dim() >= 2 and mask.shape[-2] > 1 else mask[..., :n]
        if causal:
            tri = torch.arange(n, device=q.device)[None, :] <= torch.arange(r0, r1, device=q.device)[:, None]
            allowed = combine_masks(allowed, tri)
        if lengths is not None:
            allowed = combine_masks(allowed, lengths[..., :n])
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -math.inf)
        weights = _softmax(scores).to(v.dtype)
        outputs.append(torch.matmul(weights, v[..., :n, :]))
    return torch.cat(outputs, dim=-2) if len(outputs) > 1 else outputs[0]
