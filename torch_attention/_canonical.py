"""Masks, biases, lengths, offsets and segments in one canonical form, and which keys the
queries can see (the band of ``causal`` and ``window``, the keys some query may attend
to), for every PyTorch path.  Key reach comes from ``attention_spec.geometry``."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch import Tensor

from attention_spec import check_dropout_mask, check_mask, dtype_name
from attention_spec.arrays import check_bias, check_sinks, host_array
from attention_spec.geometry import (
    Band,
    Reach,
    band_chunk,
    band_reach,
    bounded,
    check_chunk_origin,
    unanchored,
    visible,
    within_length,
)
from attention_spec.geometry import key_range as _key_range
from attention_spec.masks import (
    check_kv_lengths_array,
    check_kv_lengths_values,
    check_q_offset_array,
    check_segment_ids,
    kv_lengths_rank_message,
    kv_segment_ids_message,
    rank_message,
)
from attention_spec.options import CallOptions, check_qkv_in_layout
from torch_attention.masks import _and_masks as combine_masks


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
    else:
        check_kv_lengths_array(tuple(kv_lengths.shape), dtype_name(kv_lengths.dtype), batch)
    if kv_lengths.numel():  # batch 0 has no lengths to check
        check_kv_lengths_values(int(kv_lengths.min()), int(kv_lengths.max()), kv_len)
    return _lengths_form(kv_lengths, batch)


def _lengths_form(kv_lengths: Tensor, batch: int) -> Tensor:
    """Checked key counts as every path reads them: int64 (batch,)."""
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
    return _offset_form(array, q_shape[0], device)


def _offset_form(q_offset: Tensor, batch: int, device: Any) -> Tensor:
    """Checked per-example query offsets as every path reads them: int64 (batch,) on ``device``."""
    return q_offset.to(device=device, dtype=torch.int64).reshape(-1).expand(batch)


def canonical_chunk_origin(chunk_origin: Any, chunk: int | None, q_shape: tuple[int, ...],
                           device: Any = None) -> int | Tensor:
    """Where each example's chunks start (``attention_spec.geometry.check_chunk_origin``):
    a Python int (static: 0 .. chunk - 1, the same chunks), or int64 (B,) when it differs
    per example.  None -> 0."""
    if chunk_origin is None:
        return 0
    if not isinstance(chunk_origin, (Tensor, np.ndarray)) and not hasattr(chunk_origin, "__len__"):
        ok = not isinstance(chunk_origin, bool) and hasattr(chunk_origin, "__index__")
        check_chunk_origin(None, "int" if ok else type(chunk_origin).__name__, 0, chunk)
        return int(chunk_origin) % cast(int, chunk)
    array = chunk_origin if isinstance(chunk_origin, Tensor) else torch.as_tensor(np.asarray(chunk_origin))
    if chunk is not None and len(q_shape) != 4:
        raise ValueError(rank_message("chunk_origin", q_shape))
    check_chunk_origin(tuple(array.shape), dtype_name(array.dtype), q_shape[0], chunk)
    return _offset_form(array, q_shape[0], device)


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
    return _same_segment(seg_q, seg_k, device)


def _same_segment(seg_q: Tensor, seg_k: Tensor, device: Any) -> Tensor:
    """Checked segment ids (B, T) and (B, S) -> the bool mask (B, 1, T, S) of same-segment
    pairs, on ``device``."""
    seg_q, seg_k = seg_q.to(device), seg_k.to(device)
    return (seg_q[:, :, None] == seg_k[:, None, :])[:, None]


def _band(q_len: int, kv_len: int, offset: int | Tensor, reach: Band, ndim: int, device: Any = None,
          start: int = 0, origin: int | Tensor = 0) -> Tensor | None:
    """bool, ``ndim`` dimensions: key j (at key position start + j) is visible from
    query i (at key position i + offset) within ``reach`` (causal, window, chunk, its
    chunks counted from ``origin``, an int or (B,)); None if every key is.  ``start``: a
    block's first key (a chunk reads absolute positions)."""
    static = offset if isinstance(offset, int) else None
    left, right = band_reach(q_len, kv_len, None if static is None else static - start, reach)
    chunk = band_chunk(q_len, kv_len, static, reach, start, origin if isinstance(origin, int) else None)
    if left is None and right is None and chunk is None:
        return None
    rows = torch.arange(q_len, device=device)
    if isinstance(offset, int):
        position = rows[:, None] + offset  # (T, 1)
    else:  # (B,) -> (B, 1, T, 1)
        position = (rows[None, :] + offset[:, None])[:, None, :, None]
    keys = torch.arange(start, start + kv_len, device=device)
    if not isinstance(origin, int):  # (B,) -> (B, 1, 1, 1), the positions at rank 4
        origin, position = origin[:, None, None, None], position.reshape((1,) * (4 - position.dim()) + position.shape)
        keys = keys.reshape(1, 1, 1, kv_len)
    band = visible(keys, position, left, right, chunk, origin)
    return band.reshape((1,) * (ndim - band.dim()) + tuple(band.shape))


def _length_mask(kv_lengths: Tensor, kv_len: int, ndim: int) -> Tensor:
    # (B,) -> (B, 1, ..., 1, S): key positions before each example's length
    valid = within_length(torch.arange(kv_len, device=kv_lengths.device)[None, :], kv_lengths[:, None])
    return valid.reshape(valid.shape[:1] + (1,) * (ndim - 2) + valid.shape[1:])


def _live_keys(
    mask: Tensor | None, reach: Band, lengths: Tensor | None, q_len: int, kv_len: int, device, *, offset: int = 0
) -> Tensor | None:
    """(..., S, 1) bool: key positions that some query may attend to; None if all may."""
    live = None
    if mask is not None:
        band = _band(q_len, kv_len, offset, reach, 2, device)
        visible = mask if band is None else mask & band
        live = visible.any(dim=-2)  # (..., S), size-1 dimensions kept
    elif bounded(reach):  # the keys within reach of the first to the last query
        lo, hi = _key_range(0, q_len, kv_len, offset, reach)
        if lo > 0 or hi < kv_len:
            positions = torch.arange(kv_len, device=device)
            live = (positions >= lo) & (positions < hi)
    if lengths is not None:
        live = lengths[..., 0, :] if live is None else live & lengths[..., 0, :]
    return None if live is None else live.unsqueeze(-1)


class Call(NamedTuple):
    """One call, checked: its options (``CallOptions``, Python values) and its tensors in
    the form every path reads, on q's device."""

    options: CallOptions
    mask: Tensor | None = None
    bias: Tensor | None = None
    kv_lengths: Tensor | None = None
    offset: int | Tensor = 0
    segments: Tensor | None = None
    sinks: Tensor | None = None
    dropout_mask: Tensor | None = None  # given as a list or NumPy array: checked as given
    chunk_origin: int | Tensor = 0  # where each example's chunks start: an int, or (B,) integers


class Operands(NamedTuple):
    """The tensors a kernel reads beside q, k and v, as one value (the JAX twin's
    ``Operands``): an additive ``bias``, a bool ``mask``, key counts ``lengths`` and sink
    logits ``sinks``, each in the form that kernel documents, None where the call has
    none.  Autograd tracks the tensors in it where a kernel runs as plain operations or
    under a non-reentrant checkpoint; an ``autograd.Function`` takes them as direct
    arguments."""

    bias: Tensor | None = None
    mask: Tensor | None = None
    lengths: Tensor | None = None
    sinks: Tensor | None = None


def assemble(
    q: Tensor, kv_len: int, options: CallOptions, *, mask: Tensor | None = None, bias: Tensor | None = None,
    kv_lengths: Tensor | None = None, dropout_mask: Any = None, q_offset: Any = None, segment_ids: Any = None,
    kv_segment_ids: Any = None, sinks: Tensor | None = None, chunk_origin: Any = None,
) -> Call:
    """The ``Call`` of a module's attention, whose inputs its planner has checked
    (``attention_spec.planning.plan_call``): the forms ``canonicalise`` makes, on q's
    device, without its checks.  q is (B, H, T, D); ``mask`` and ``bias`` are canonical at
    rank 4; ``kv_lengths`` (B,) integers; ``q_offset`` None (``options.alignment``), an
    int, or (B,) integers; segment ids (B, T) and (B, S) (None: the queries'); ``sinks``
    (H,); ``chunk_origin`` None (0) or (B,) integers (the module's chunks at its
    positions, ``attention_spec.geometry.chunk_origin``)."""
    batch, device = q.shape[0], q.device
    if bias is not None:
        bias = bias.to(device)
    if kv_lengths is not None:
        kv_lengths = _lengths_form(kv_lengths, batch).to(device)
    if q_offset is None:
        offset: int | Tensor = 0 if options.alignment == "top_left" else kv_len - q.shape[-2]
    else:
        offset = q_offset if isinstance(q_offset, int) else _offset_form(q_offset, batch, device)
    segments = None
    if segment_ids is not None:
        segments = _same_segment(segment_ids, segment_ids if kv_segment_ids is None else kv_segment_ids, device)
    if sinks is not None:
        sinks = sinks.to(device)
    if dropout_mask is not None:
        dropout_mask = torch.as_tensor(dropout_mask, device=device)
    origin = 0 if chunk_origin is None or options.chunk is None else _offset_form(chunk_origin, batch, device)
    return Call(options, mask, bias, kv_lengths, offset, segments, sinks, dropout_mask, origin)


def heads_first(q: Tensor, k: Tensor, v: Tensor, layout: str) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v as (..., H, S, D): themselves for ``"bhsd"``, transposed views (no copy)
    for ``"bshd"``."""
    if layout == "bhsd":
        return q, k, v
    return q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)


def canonicalise(
    q: Tensor, k: Tensor, v: Tensor, options: CallOptions, *, mask: Any = None, bias: Any = None,
    kv_lengths: Any = None, dropout_mask: Any = None, q_offset: Any = None, segment_ids: Any = None,
    kv_segment_ids: Any = None, sinks: Any = None, chunk_origin: Any = None,
) -> Call:
    """Every check of a call's tensors, in ``dot_product_attention``'s order, before any
    work, and the tensors canonicalised on q's device: q, k and v in ``options.layout``
    (``check_qkv_in_layout``), then the mask, bias, lengths, dropout mask, query offset,
    segment ids and sinks against them.  ``options`` were checked when they were made
    (``call_options``)."""
    dtypes = (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype))
    q_shape, k_shape, _ = check_qkv_in_layout(q.shape, k.shape, v.shape, dtypes, options.layout)
    kv_len = k_shape[-2]
    weights_shape = (*q_shape[:-1], kv_len)
    mask = canonical_mask(mask, weights_shape)
    bias = canonical_bias(bias, weights_shape)
    if bias is not None:
        bias = bias.to(q.device)
    if kv_lengths is not None:
        if len(q_shape) != 4:
            raise ValueError(kv_lengths_rank_message(q_shape))
        lengths = canonical_kv_lengths(kv_lengths, q_shape[0], kv_len)
        assert lengths is not None  # kv_lengths is not None
        kv_lengths = lengths.to(q.device)
    if dropout_mask is not None:
        if not isinstance(dropout_mask, Tensor):
            dropout_mask = host_array("dropout_mask", dropout_mask)
        check_dropout_mask(dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape,
                           training=options.training, rate=options.dropout_rate)
        dropout_mask = torch.as_tensor(dropout_mask, device=q.device)
    offset = canonical_q_offset(q_offset, options.alignment, q_shape, kv_len, q.device)
    segments = canonical_segments(segment_ids, kv_segment_ids, q_shape, kv_len, q.device)
    if sinks is not None:
        sinks = sinks if isinstance(sinks, Tensor) else torch.as_tensor(sinks)
        check_sinks(tuple(sinks.shape), dtype_name(sinks.dtype), q_shape, options.normalization)
        sinks = sinks.to(q.device)
    origin = canonical_chunk_origin(chunk_origin, options.chunk, q_shape, q.device)
    return Call(options, mask, bias, kv_lengths, offset, segments, sinks, dropout_mask, origin)


class Structure(NamedTuple):
    """What a path computes from: the dense mask (None: none), the structure it keeps
    (offset, causal, window, chunk), the lengths as a mask (B, 1, ..., 1, S), and k and v
    with the keys that no query sees zeroed."""

    mask: Tensor | None
    offset: int
    causal: bool
    window: tuple[int | None, int | None] | None
    lengths: Tensor | None
    k: Tensor
    v: Tensor
    chunk: int | None = None


def structure(q: Tensor, k: Tensor, v: Tensor, call: Call, path: str) -> Structure:
    """The structure of a call for ``path``: a -inf bias (read by the fused path from the
    bias itself), segments, and positions that differ per example join the dense mask on
    every path; a static offset and the window stay structural where the path can use
    them (blockwise).  Then k and v with zeros at the key positions that no query may
    attend to: whatever is stored there (NaN included) reaches no output and gets a zero
    gradient.  q, k and v are (..., H, S, D)."""
    reach: Band = call.options  # causal, window and chunk; none once they are a dense mask
    mask, offset = call.mask, call.offset
    if call.bias is not None and path != "fused":  # the fused path reads -inf from the bias itself: fewer passes
        mask = combine_masks(mask, _bias_allows(call.bias))
    if call.segments is not None:
        mask = combine_masks(mask, call.segments)
    origin, q_len, kv_len = call.chunk_origin, q.shape[-2], k.shape[-2]
    if reach.chunk is not None and not (isinstance(origin, int) and origin == 0):  # chunks from each origin: dense
        if band_chunk(q_len, kv_len, offset if isinstance(offset, int) else None, reach, 0,
                      origin if isinstance(origin, int) else None) is not None:
            mask = combine_masks(mask, _band(q_len, kv_len, offset, Reach(chunk=reach.chunk), q.dim(), q.device,
                                             origin=origin))
            reach = unanchored(reach)
        else:
            reach = Reach(reach.causal, reach.window)
    if not isinstance(offset, int) or (path != "blockwise" and (reach.window is not None or reach.chunk is not None
                                                                 or (reach.causal and offset))):
        mask = combine_masks(mask, _band(q.shape[-2], k.shape[-2], offset, reach, q.dim(), q.device))
        offset, reach = 0, Reach()
    lengths = None if call.kv_lengths is None else _length_mask(call.kv_lengths, k.shape[-2], q.dim())
    live_keys = _live_keys(mask, reach, lengths, q.shape[-2], k.shape[-2], q.device, offset=offset)
    if live_keys is not None:
        groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
        if groups > 1 and live_keys.dim() >= 3 and live_keys.shape[-3] > 1:
            # a key is live if any head of its group sees it
            live_keys = live_keys.unflatten(-3, (-1, groups)).any(dim=-3)
        zero = torch.zeros((), dtype=v.dtype, device=v.device)
        k, v = torch.where(live_keys, k, zero), torch.where(live_keys, v, zero)
    return Structure(mask, offset, reach.causal, reach.window, lengths, k, v, reach.chunk)
