"""The attention math, once, for PyTorch.  ``jax_attention/functional.py`` is its twin.

Dimension legend (the same names on both sides):
  B: batch          H: heads          T / q_len: queries      S / kv_len: keys and values
  D: head_dim (query/key width)       Dv: value width

Masks are bool, ``True`` = may attend, broadcastable to ``(B, H, T, S)`` (or to the
leading dimensions that ``q`` has).  A query row that may attend to nothing gets zero
weights and a zero output, never NaN, with finite gradients.

Precision: the scores are formed, scaled, masked and normalised, and the weights mix the
values, in float32 for float16/bfloat16 inputs (q, k and v are upcast, so a logit beyond
the half-precision range stays finite and the output is rounded once; float64 stays
float64); returned weights are cast to the input dtype.  Whether a row has anything to
attend to is decided from the mask, never from an infinite row maximum.

Masks and lengths are canonicalised once (``canonical_mask``, ``canonical_kv_lengths``)
before any path runs, and keys and values at key positions that no query may attend to
(past ``kv_lengths``, or blocked for every query) are replaced by zeros with ``where``:
a NaN or Inf stored there never reaches an output or a gradient.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from attention_spec import (
    check_dropout_mask,
    check_dropout_rate,
    check_mask,
    check_mask_strategy,
    check_normalization,
    check_qkv,
    check_scale,
    dtype_name,
    resolve_implementation,
    zero_row_sum_message,
)
from attention_spec.geometry import band_reach
from attention_spec.geometry import key_range as _key_range
from attention_spec.validation import (
    check_alignment,
    check_bias,
    check_implementation,
    check_kv_lengths_array,
    check_kv_lengths_values,
    check_linear,
    check_q_offset_array,
    check_segment_ids,
    check_softcap,
    check_window,
    fused_blockers,
    kv_lengths_rank_message,
    kv_segment_ids_message,
    rank_message,
)
from torch_attention.masks import _and_masks as combine_masks
from torch_attention.masks import causal_mask

__all__ = [
    "attention_scores",
    "attention_weights",
    "canonical_bias",
    "canonical_kv_lengths",
    "canonical_mask",
    "default_block_size",
    "dot_product_attention",
    "dropout_weights",
    "linear",
    "normalize_scores",
    "resolve_scale",
]


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``None`` -> 1/sqrt(head_dim); a float is used as given (1.0 = unscaled)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def canonical_mask(mask: Any, weights_shape: tuple[int, ...]) -> Tensor | None:
    """A bool mask (True = may attend) broadcastable to ``weights_shape`` -> the same mask
    with leading 1s up to ``len(weights_shape)`` dimensions (0-d and 1-d masks included).

    Raises ``TypeError`` (not bool) or ``ValueError`` (does not broadcast), as ``check_mask``.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        mask = torch.as_tensor(np.asarray(mask))
    check_mask(tuple(mask.shape), dtype_name(mask.dtype), weights_shape)
    return mask.reshape((1,) * (len(weights_shape) - mask.dim()) + tuple(mask.shape))


def canonical_bias(bias: Any, weights_shape: tuple[int, ...]) -> Tensor | None:
    """A floating-point bias broadcastable to ``weights_shape`` -> the same bias with
    leading 1s up to ``len(weights_shape)`` dimensions.  Raises ``TypeError`` (not
    floating point) or ``ValueError`` (does not broadcast), as ``check_bias``."""
    if bias is None:
        return None
    if not isinstance(bias, Tensor):
        bias = torch.as_tensor(np.asarray(bias))
    check_bias(tuple(bias.shape), dtype_name(bias.dtype), weights_shape)
    return bias.reshape((1,) * (len(weights_shape) - bias.dim()) + tuple(bias.shape))


def _bias_allows(bias: Tensor) -> Tensor:
    """bool, the bias's shape: False where the bias is -inf.  Such an entry blocks its key
    exactly as a mask does (weight 0, a row blocked throughout gets zeros, gradients
    finite); left to the softmax, a row of -inf would give 0/0 = NaN."""
    return bias != -math.inf


def _adjust(scores: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """Scaled scores -> ``softcap * tanh(s / softcap)``, then ``+ bias`` (in the scores'
    compute dtype: a half-precision bias is added in float32)."""
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    return scores


def canonical_kv_lengths(kv_lengths: Any, batch: int, kv_len: int) -> Tensor | None:
    """Valid key counts -> int64 (batch,), or None.

    Accepts None, a Python int (one length for every example), a list/tuple of ints, a
    NumPy integer array, or an integer tensor of shape () or (batch,).  Raises
    ``TypeError`` for non-integer values (floats, bools) and ``ValueError`` for another
    shape or a length outside [0, kv_len] (values are read, so on a GPU this syncs).  An
    empty list is batch 0's lengths.
    """
    if kv_lengths is None:
        return None
    if not isinstance(kv_lengths, Tensor):
        array = np.asarray(kv_lengths)
        if array.size == 0 and isinstance(kv_lengths, (list, tuple)):
            array = array.astype(np.int64)  # NumPy makes [] float64: it holds no value of that type
        check_kv_lengths_array(array.shape, array.dtype.name, batch)
        kv_lengths = torch.as_tensor(array)
    check_kv_lengths_array(tuple(kv_lengths.shape), dtype_name(kv_lengths.dtype), batch)
    if kv_lengths.numel():  # batch 0 has no lengths to check
        check_kv_lengths_values(int(kv_lengths.min()), int(kv_lengths.max()), kv_len)
    return kv_lengths.to(torch.int64).reshape(-1).expand(batch)


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


def _softmax(scores: Tensor, mask: Tensor | None, scale: float = 1.0) -> Tensor:
    """softmax(scale * scores) over the keys that ``mask`` lets through (``scale > 0``).

    The maximum is taken over the unscaled scores and ``(scores - max) * scale`` is
    exponentiated: the subtraction is exact for the largest score whatever a compiler
    fuses (the twin of the JAX formulation, where it matters)."""
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
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
) -> Tensor:
    """Weights (..., T, S) from q (..., T, D) and k (..., S, D), before dropout.
    ``bias`` (broadcastable to (..., T, S)) is added to the scaled, soft-capped scores."""
    mask = _combine(mask, causal, q.shape[-2], k.shape[-2], q.device)
    if bias is not None:  # a -inf entry blocks its key
        mask = combine_masks(mask, _bias_allows(bias))
    scale = resolve_scale(scale, q.shape[-1])
    if normalization == "sum":
        scores = _adjust(attention_scores(q, k, scale), bias, softcap)
        return normalize_scores(scores, mask, normalization=normalization)
    check_mask_strategy(mask_strategy)  # "renormalize" equals "fill" (see normalize_scores)
    if bias is not None or softcap is not None:
        return _softmax(_adjust(attention_scores(q, k, scale), bias, softcap), mask)
    return _softmax(attention_scores(q, k, 1.0), mask, scale)


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
    kv_lengths: Any = None,
    scale: float | None = None,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    dropout_rate: float = 0.0,
    dropout_mask: Tensor | None = None,
    training: bool = False,
    return_weights: bool = False,
    implementation: str = "auto",
    bias: Tensor | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    alignment: str = "top_left",
    q_offset: Any = None,
    segment_ids: Any = None,
    kv_segment_ids: Any = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over q (..., H, T, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv) -> (..., H, T, Dv).

    Args:
      mask: bool, True = may attend, broadcastable to (..., T, S); 0-d and 1-d included.
      causal: also block keys after the query (top-left aligned ``tril``).
      kv_lengths: the number of valid keys per example (padding given as lengths): an
        int, a list of ints or an integer array of shape () or (B,), each in [0, S]; see
        ``canonical_kv_lengths``.  Needs q of shape (B, H, T, D).
      scale: None = 1/sqrt(D); a float as given.
      mask_strategy: "fill" or "renormalize", equal in exact arithmetic and computed
        alike (stably) on every path; see ``normalize_scores``.
      dropout_rate, training, dropout_mask: dropout on the weights, see ``dropout_weights``.
      return_weights: also return the weights that mixed the values (after dropout).
      bias: float, broadcastable to (..., T, S), added to the scores (after scaling and
        soft-capping, before masking; differentiable).  A blocked key stays blocked, and
        a ``-inf`` entry blocks its key as a mask does: weight 0, zeros for a row that is
        ``-inf`` (or masked) throughout, finite gradients (zero for the ``-inf`` entries).
      softcap: None (off) or c > 0: the scaled scores become ``c * tanh(s / c)`` before
        the bias and the mask (Gemma 2's order).  The fused path refuses it (SDPA has no
        soft-capping); ``"auto"`` then takes a path that honours it.
      window: ``(left, right)``, inclusive: the query at key position p attends to keys
        p - left .. p + right; None on a side is unbounded (with ``causal`` the right
        side is at most 0).  See ``check_window``.
      alignment: where query 0 sits among the keys for ``causal`` and ``window``:
        ``"top_left"`` (key 0) or ``"bottom_right"`` (key S - T: the last query sees
        the last key, as when decoding after S - T cached keys).
      q_offset: the key position of query 0, an int or integers of shape (B,) (a KV
        cache's per-example fill); replaces ``alignment``.
      segment_ids, kv_segment_ids: integers (B, T) and (B, S): packed sequences, a token
        attends only to keys of its own segment id; ``kv_segment_ids`` defaults to
        ``segment_ids`` when T == S.  Need q of shape (B, H, T, D).
      Grouped-query attention: k and v may have Hkv heads where Hkv divides H; query
        head h reads key/value head h // (H // Hkv).  The fused path hands the grouped
        heads to SDPA (``enable_gqa=True``); the others repeat them.
      implementation: ``"reference"`` (the explicit math), ``"fused"``
        (``F.scaled_dot_product_attention``, which also draws dropout; refuses float64
        like its JAX twin, whose kernel computes in float32, although SDPA is exact in
        float64 on CPU: one behaviour for both frameworks), ``"blockwise"`` (query
        blocks that skip the keys a causal mask hides; never materialises T x S; the
        twin of JAX's CPU path), or ``"auto"`` (fused, else blockwise, else the reference
        where those cannot honour an option; float64 never goes to fused; see
        ``attention_spec.resolve_implementation``).

    Keys and values at positions that no query may attend to are zeroed with ``where``
    before any product: whatever is stored there (NaN included) reaches no output and
    gets a zero gradient.

    Raises:
      ValueError / TypeError: inconsistent shapes or dtypes, a mask that is not bool or
        does not broadcast, bad ``kv_lengths``, a ``dropout_mask`` while dropout is off
        (eval mode or rate 0), a bad option value, an explicit implementation that cannot
        honour an option; all before any computation.
    """
    check_qkv(q.shape, k.shape, v.shape, (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype)))
    weights_shape = (*q.shape[:-1], k.shape[-2])
    mask = canonical_mask(mask, weights_shape)
    bias = canonical_bias(bias, weights_shape)
    softcap = check_softcap(softcap)
    if kv_lengths is not None:
        if q.dim() != 4:
            raise ValueError(kv_lengths_rank_message(q.shape))
        lengths = canonical_kv_lengths(kv_lengths, q.shape[0], k.shape[-2])
        assert lengths is not None  # kv_lengths is not None
        kv_lengths = lengths.to(q.device)
    check_dropout_rate(dropout_rate)
    if dropout_mask is not None:
        check_dropout_mask(
            dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape, training=training,
            rate=dropout_rate,
        )
    check_scale(scale)
    check_mask_strategy(mask_strategy)
    check_normalization(normalization)
    window = check_window(window)
    offset = canonical_q_offset(q_offset, check_alignment(alignment), q.shape, k.shape[-2], q.device)
    segments = canonical_segments(segment_ids, kv_segment_ids, q.shape, k.shape[-2], q.device)
    path = resolve_implementation(
        implementation,
        # SDPA is PyTorch's fast path on every device (on CPU a fused blockwise kernel).
        preference=("fused", "blockwise"),
        return_weights=return_weights,
        normalization=normalization,
        dropout_active=training and dropout_rate > 0.0,
        dropout_mask_given=dropout_mask is not None,
        fused_draws_dropout=FUSED_DRAWS_DROPOUT,
        fused_blockers=fused_blockers(q.dtype == torch.float64, softcap),
    )
    if bias is not None:
        bias = bias.to(q.device)
        if path != "fused":  # the fused path reads -inf from the bias itself (``_fused``): fewer passes
            mask = combine_masks(mask, _bias_allows(bias))
    scale = resolve_scale(scale, q.shape[-1])
    q_len, kv_len = q.shape[-2], k.shape[-2]
    # Segments, and positions that differ per example, are a dense mask on every path;
    # a static offset and the window stay structural where a path can use them.
    if segments is not None:
        mask = combine_masks(mask, segments)
    if not isinstance(offset, int) or (path != "blockwise" and (window is not None or (causal and offset))):
        mask = combine_masks(mask, _band(q_len, kv_len, offset, causal, window, q.dim(), q.device))
        offset, causal, window = 0, False, None
    lengths = None if kv_lengths is None else _length_mask(kv_lengths, kv_len, q.dim())
    live_keys = _live_keys(mask, causal, lengths, q_len, kv_len, q.device, offset=offset, window=window)
    groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
    if live_keys is not None:
        if groups > 1 and live_keys.dim() >= 3 and live_keys.shape[-3] > 1:
            # a key is live if any head of its group sees it
            live_keys = live_keys.unflatten(-3, (-1, groups)).any(dim=-3)
        zero = torch.zeros((), dtype=v.dtype, device=v.device)
        k, v = torch.where(live_keys, k, zero), torch.where(live_keys, v, zero)
    if path == "fused":
        return _fused(q, k, v, mask=mask, causal=causal, lengths=lengths, scale=scale,
                      dropout_rate=dropout_rate if training else 0.0, bias=bias)
    if groups > 1:  # the explicit paths repeat each key/value head for its group of queries
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    if path == "blockwise":
        return _blockwise(q, k, v, mask=mask, causal=causal, lengths=lengths, scale=scale,
                          bias=bias, softcap=softcap, offset=offset, window=window)

    mask = combine_masks(mask, lengths)
    if window is not None or (causal and offset):
        mask = combine_masks(mask, _band(q_len, kv_len, offset, causal, window, q.dim(), q.device))
        causal = False
    weights = attention_weights(
        q, k, mask=mask, causal=causal, scale=scale,
        mask_strategy=mask_strategy, normalization=normalization, bias=bias, softcap=softcap,
    )
    weights = dropout_weights(weights, dropout_rate, training=training, dropout_mask=dropout_mask)
    # mixed in the compute dtype: half-precision weights would add a rounding per weight
    out = torch.matmul(weights, v.to(weights.dtype)).to(v.dtype)  # (..., T, Dv)
    return (out, weights.to(v.dtype)) if return_weights else out


def canonical_q_offset(
    q_offset: Any, alignment: str, q_shape: tuple[int, ...], kv_len: int, device: Any = None
) -> int | Tensor:
    """The key position of query 0: a Python int, or int64 (B,) when it differs per
    example.  None -> 0 (``"top_left"``) or kv_len - q_len (``"bottom_right"``)."""
    if q_offset is None:
        return 0 if alignment == "top_left" else kv_len - q_shape[-2]
    if alignment != "top_left":
        raise ValueError("give q_offset or alignment='bottom_right', not both")
    if not isinstance(q_offset, (Tensor, np.ndarray)) and not hasattr(q_offset, "__len__"):
        if isinstance(q_offset, bool) or not hasattr(q_offset, "__index__"):
            raise TypeError(f"q_offset must hold integers (the key position of query 0); got {q_offset!r}")
        return int(q_offset)
    array = q_offset if isinstance(q_offset, Tensor) else torch.as_tensor(np.asarray(q_offset))
    if len(q_shape) != 4:
        raise ValueError(rank_message("q_offset", q_shape))
    check_q_offset_array(tuple(array.shape), dtype_name(array.dtype), q_shape[0])
    return array.to(device=device, dtype=torch.int64).reshape(-1).expand(q_shape[0])


def canonical_segments(
    segment_ids: Any, kv_segment_ids: Any, q_shape: tuple[int, ...], kv_len: int, device: Any = None
) -> Tensor | None:
    """Segment ids (B, T) and (B, S) -> the bool mask (B, 1, T, S) of same-segment pairs."""
    if segment_ids is None and kv_segment_ids is None:
        return None
    name = "segment_ids" if segment_ids is not None else "kv_segment_ids"
    if len(q_shape) != 4:
        raise ValueError(rank_message(name, q_shape))
    batch, q_len = q_shape[0], q_shape[-2]
    if segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids for the queries")
    if kv_segment_ids is None:
        if q_len != kv_len:
            raise ValueError(kv_segment_ids_message(q_len, kv_len))
        kv_segment_ids = segment_ids
    seg_q, seg_k = (t if isinstance(t, Tensor) else torch.as_tensor(np.asarray(t))
                    for t in (segment_ids, kv_segment_ids))
    check_segment_ids("segment_ids", tuple(seg_q.shape), dtype_name(seg_q.dtype), batch, q_len)
    check_segment_ids("kv_segment_ids", tuple(seg_k.shape), dtype_name(seg_k.dtype), batch, kv_len)
    seg_q, seg_k = seg_q.to(device), seg_k.to(device)
    return (seg_q[:, :, None] == seg_k[:, None, :])[:, None]


def _band(
    q_len: int, kv_len: int, offset: int | Tensor, causal: bool,
    window: tuple[int | None, int | None] | None, ndim: int, device: Any = None,
) -> Tensor | None:
    """bool, ``ndim`` dimensions: key j is visible from query i (at key position
    i + offset) under ``causal`` and ``window``; None if every key is."""
    left, right = band_reach(q_len, kv_len, offset if isinstance(offset, int) else None, causal, window)
    if left is None and right is None:
        return None
    rows = torch.arange(q_len, device=device)
    if isinstance(offset, int):
        position = rows[:, None] + offset  # (T, 1)
    else:  # (B,) -> (B, 1, T, 1)
        position = (rows[None, :] + offset[:, None])[:, None, :, None]
    distance = torch.arange(kv_len, device=device) - position  # key minus query position
    band = torch.ones(distance.shape, dtype=torch.bool, device=device)
    if right is not None:
        band = band & (distance <= right)
    if left is not None:
        band = band & (distance >= -left)
    return band.reshape((1,) * (ndim - band.dim()) + tuple(band.shape))


def _length_mask(kv_lengths: Tensor, kv_len: int, ndim: int) -> Tensor:
    # (B,) -> (B, 1, ..., 1, S): key positions before each example's length
    valid = torch.arange(kv_len, device=kv_lengths.device)[None, :] < kv_lengths[:, None]
    return valid.reshape(valid.shape[:1] + (1,) * (ndim - 2) + valid.shape[1:])


def _live_keys(
    mask: Tensor | None, causal: bool, lengths: Tensor | None, q_len: int, kv_len: int, device, *,
    offset: int = 0, window: tuple[int | None, int | None] | None = None,
) -> Tensor | None:
    """(..., S, 1) bool: key positions that some query may attend to; None if all may."""
    live = None
    if mask is not None:
        band = _band(q_len, kv_len, offset, causal, window, 2, device)
        visible = mask if band is None else mask & band
        live = visible.any(dim=-2)  # (..., S), size-1 dimensions kept
    elif causal or window is not None:  # the keys within reach of the first to the last query
        lo, hi = _key_range(0, q_len, kv_len, offset, causal, window)
        if lo > 0 or hi < kv_len:
            positions = torch.arange(kv_len, device=device)
            live = (positions >= lo) & (positions < hi)
    if lengths is not None:
        live = lengths[..., 0, :] if live is None else live & lengths[..., 0, :]
    return None if live is None else live.unsqueeze(-1)


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
        return out.to(out_dtype)
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


def default_block_size(q_len: int) -> int:
    """Query rows per block: 128, growing so that a long sequence has at most 16 blocks."""
    return max(128, -(-q_len // 16))


def _blockwise(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, lengths: Tensor | None,
    scale: float, block_size: int | None = None, bias: Tensor | None = None, softcap: float | None = None,
    offset: int = 0, window: tuple[int | None, int | None] | None = None,
) -> Tensor:
    """The reference math one block of queries at a time.  A causal block of rows
    [r0, r1) needs only the keys [0, r1): the hidden upper triangle is never computed,
    and at most (block, S) scores exist at once; a ``window`` (and a causal mask aligned
    at key ``offset``) likewise restricts each block to the keys [lo, hi) within its
    reach.  Rows are normalised exactly as in the reference path.  Twin of the JAX
    formulation (where it is the CPU fast path).

    Under autograd each block is checkpointed: the backward keeps only the inputs and
    recomputes one block's weights at a time, so training holds O(block x S) scores,
    not all T x S weights (the JAX twin gets the same bound from its flash backward).
    ``mask`` has q's rank (``canonical_mask``); ``lengths`` is (B, 1, 1, S)."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    block = block_size or default_block_size(q_len)
    ct = _compute_dtype(q.dtype)
    # half-precision scores would overflow or lose digits, and half-precision weights
    # would add a rounding each: everything in the compute dtype, the output rounded once
    qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)
    recompute = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias)
    )
    outputs = []
    for r0 in range(0, q_len, block):
        r1 = min(r0 + block, q_len)
        lo, hi = _key_range(r0, r1, kv_len, offset, causal, window)  # keys this block can see
        if hi == lo:  # nothing within reach: zero rows
            outputs.append(v.new_zeros((*q.shape[:-2], r1 - r0, v.shape[-1])))
            continue
        allowed = None
        if mask is not None:  # a broadcast (size-1) dimension stays size 1 under the slice
            allowed = mask[..., r0:r1, lo:hi] if mask.shape[-2] > 1 else mask[..., lo:hi]
        allowed = combine_masks(allowed, _band(r1 - r0, hi - lo, r0 + offset - lo, causal, window, 2, q.device))
        if lengths is not None:
            allowed = combine_masks(allowed, lengths[..., lo:hi])
        # a broadcast (size-1) dimension of the bias stays size 1 under the slice
        part = None if bias is None else (bias[..., r0:r1, lo:hi] if bias.shape[-2] > 1 else bias[..., lo:hi])
        args = (qc[..., r0:r1, :], kc[..., lo:hi, :], vc[..., lo:hi, :], allowed, part, scale, softcap)
        if recompute:
            out = torch.utils.checkpoint.checkpoint(_query_block, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            out = _query_block(*args)
        outputs.append(out.to(v.dtype))
    return torch.cat(outputs, dim=-2) if len(outputs) > 1 else outputs[0]


def _query_block(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, bias: Tensor | None, scale: float,
    softcap: float | None,
) -> Tensor:
    """One block of ``_blockwise``: the reference math on the keys within its reach."""
    scores = torch.matmul(q, k.transpose(-2, -1))  # unscaled
    if bias is None and softcap is None:
        weights = _softmax(scores, allowed, scale)
    else:
        weights = _softmax(_adjust(scores * scale, bias, softcap), allowed)
    return torch.matmul(weights, v)


# SDPA draws dropout itself (JAX's fused kernel cannot).
FUSED_DRAWS_DROPOUT = True


class KVCache(NamedTuple):
    """Keys and values of earlier positions for decoding: key (B, Hkv, max_len, D), value
    (B, Hkv, max_len, Dv), and lengths (B,), how many positions of each example are
    filled.  ``AttentionModule.init_cache`` makes one; ``append_to_cache`` fills it."""

    key: Tensor
    value: Tensor
    lengths: Tensor


def cache_fields(cache: Any) -> Any:
    """(shape, dtype name) of each field, or None for something that is not a KVCache."""
    if not isinstance(cache, KVCache) or not all(isinstance(t, Tensor) for t in cache):
        return None
    return tuple((tuple(t.shape), dtype_name(t.dtype)) for t in cache)


def append_to_cache(cache: KVCache, k: Tensor, v: Tensor, lengths: Tensor) -> KVCache:
    """Writes k (B, Hkv, T, D) and v at positions lengths .. lengths + T - 1 of each example
    and advances its fill by ``lengths`` (B,) (the valid tokens of this chunk; the rest,
    padding, is overwritten by the next call).  Written in place: the same tensors, with
    the fill advanced, are returned.  The caller makes every check of the call first (a
    module's ``_prepare``: that T positions fit, ``check_cache_room``, and that the path
    can honour the call, ``attention_spec.validation.check_explicit_path``), so a refused call leaves the cache as it was.
    Autograd records the writes: a reader that keeps what it read across the next write
    reads a copy (a module's cached step does, while autograd records)."""
    positions = cache.lengths[:, None] + torch.arange(k.shape[-2], device=k.device)  # (B, T)
    for store, new in ((cache.key, k), (cache.value, v)):
        where = positions[:, None, :, None].expand(*new.shape[:-1], new.shape[-1])
        store.scatter_(2, where, new.to(store.dtype))
    cache.lengths.add_(lengths.to(cache.lengths.dtype))
    return cache


# --------------------------------------------------------------------------- projections


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, implementation: str = "auto") -> Tensor:
    """A projection, x (..., d_in) @ weight.T (+ bias), weight (d_out, d_in) as
    ``nn.Linear`` stores it: ``F.linear``, the same on every path (PyTorch's CPU and GPU
    products are already its BLAS's).  ``implementation`` is the attention call's, checked
    as the JAX twin checks it; there it picks the product's kernel on CPU."""
    check_implementation(implementation)
    check_linear(tuple(x.shape), tuple(weight.shape), None if bias is None else tuple(bias.shape), layout="out_in")
    return F.linear(x, weight, bias)
