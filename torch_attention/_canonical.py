"""Masks, biases, lengths, offsets and segments in one canonical form, and which keys the
queries can see (the band of ``causal`` and ``window``, the keys some query may attend
to), for every PyTorch path.  Key reach comes from ``attention_spec.geometry``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attention_spec import check_mask, dtype_name
from attention_spec.arrays import check_bias
from attention_spec.geometry import band_reach, visible, within_length
from attention_spec.geometry import key_range as _key_range
from attention_spec.masks import (
    check_kv_lengths_array,
    check_kv_lengths_values,
    check_q_offset_array,
    check_segment_ids,
    kv_segment_ids_message,
    rank_message,
)


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
    lag = torch.arange(kv_len, device=device) - position  # key minus query position
    band = visible(lag, left, right)
    return band.reshape((1,) * (ndim - band.dim()) + tuple(band.shape))


def _length_mask(kv_lengths: Tensor, kv_len: int, ndim: int) -> Tensor:
    # (B,) -> (B, 1, ..., 1, S): key positions before each example's length
    valid = within_length(torch.arange(kv_len, device=kv_lengths.device)[None, :], kv_lengths[:, None])
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
