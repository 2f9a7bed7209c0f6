"""A call's arrays in one form before any path runs: masks, biases, lengths, the query
offset and segment ids checked and canonicalised (``canonicalise``), then the structure
that a path does not keep as structure turned into a dense mask and the keys that no
query sees zeroed (``structure``).  The private half of ``functional``'s checks.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from attention_spec import check_dropout_mask, check_mask, dtype_name
from attention_spec.arrays import check_bias, check_sinks, host_array
from attention_spec.geometry import (
    Band,
    Reach,
    band_chunk,
    band_reach,
    bounded,
    check_chunk_origin,
    key_range,
    unanchored,
    visible,
    within_length,
)
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
from jax_attention.masks import _and_masks as combine_masks


def compute_dtype(dtype: Any) -> Any:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def expand_to(m: Array, ndim: int) -> Array:
    # Explicit leading 1s: the library runs under jax_numpy_rank_promotion="raise".
    return m.reshape((1,) * (ndim - m.ndim) + m.shape)


def float0(a: Array | None) -> Any:
    """The cotangent of an integer or bool input: none."""
    return None if a is None else np.zeros(a.shape, dtype=jax.dtypes.float0)


def canonical_mask(mask: Any, weights_shape: tuple[int, ...]) -> Array | None:
    """A bool mask (True = may attend) broadcastable to ``weights_shape`` -> the same mask
    with leading 1s up to ``len(weights_shape)`` dimensions (0-d and 1-d masks included).

    Raises ``TypeError`` (not bool) or ``ValueError`` (does not broadcast), as ``check_mask``.
    """
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    check_mask(mask.shape, dtype_name(mask.dtype), weights_shape)
    return expand_to(mask, len(weights_shape))


def canonical_bias(bias: Any, weights_shape: tuple[int, ...]) -> Array | None:
    """A floating-point bias broadcastable to ``weights_shape`` -> the same bias with
    leading 1s up to ``len(weights_shape)`` dimensions.  Raises ``TypeError`` (not
    floating point) or ``ValueError`` (does not broadcast), as ``check_bias``."""
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    check_bias(bias.shape, dtype_name(bias.dtype), weights_shape)
    return expand_to(bias, len(weights_shape))


def bias_allows(bias: Array) -> Array:
    """bool, the bias's shape: False where the bias is -inf.  Such an entry blocks its key
    exactly as a mask does (weight 0, a row blocked throughout gets zeros, gradients
    finite); left to the softmax, a row of -inf would give 0/0 = NaN."""
    return bias != -jnp.inf


def canonical_kv_lengths(kv_lengths: Any, batch: int, kv_len: int) -> Array | None:
    """Valid key counts -> int32 (batch,), or None.

    Accepts None, a Python int (one length for every example), a list/tuple of ints, a
    NumPy integer array, or a JAX integer array of shape () or (batch,).  Raises
    ``TypeError`` for non-integer values (floats, bools) and ``ValueError`` for another
    shape or, eagerly, a length outside [0, kv_len].  Under tracing (jit, vmap) the values
    are unknown and not checked: they are clipped to [0, kv_len], so a negative length
    attends to nothing and one above kv_len to every key.  A list or tuple may hold traced
    values (``[n, 5]`` with ``n`` traced); an empty list is batch 0's lengths.
    """
    if kv_lengths is None:
        return None
    if isinstance(kv_lengths, (list, tuple)) and any(
        isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(kv_lengths)
    ):
        kv_lengths = jnp.asarray(kv_lengths)  # NumPy cannot hold a traced value: JAX stacks them
    if not isinstance(kv_lengths, jax.Array):
        array = np.asarray(kv_lengths)
        if array.size == 0 and isinstance(kv_lengths, (list, tuple)):
            array = array.astype(np.int32)  # NumPy makes [] float64: it holds no value of that type
        check_kv_lengths_array(array.shape, array.dtype.name, batch)
        kv_lengths = array
    else:
        check_kv_lengths_array(kv_lengths.shape, dtype_name(kv_lengths.dtype), batch)
    if not isinstance(kv_lengths, jax.core.Tracer) and kv_lengths.size:  # batch 0: nothing to check
        # read with NumPy: inside a jit trace, even a concrete array's min() is staged out
        values = np.asarray(kv_lengths)
        check_kv_lengths_values(int(values.min()), int(values.max()), kv_len)
    return _lengths_form(kv_lengths, batch, kv_len)


def _lengths_form(kv_lengths: Any, batch: int, kv_len: int) -> Array:
    """Checked key counts as every path reads them: int32 (batch,), clipped to [0, kv_len]."""
    lengths = jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, kv_len)
    return jnp.broadcast_to(lengths.reshape(-1), (batch,))


def canonical_q_offset(q_offset: Any, alignment: str, q_shape: tuple[int, ...], kv_len: int) -> int | Array:
    """The key position of query 0: a Python int (static), or int32 (B,) when it differs
    per example.  None -> 0 (``"top_left"``) or kv_len - q_len (``"bottom_right"``)."""
    if q_offset is None:
        return 0 if alignment == "top_left" else kv_len - q_shape[-2]
    if alignment != "top_left":
        raise ValueError("give q_offset or alignment='bottom_right', not both")
    if not isinstance(q_offset, (jax.Array, np.ndarray)) and not hasattr(q_offset, "__len__"):
        if isinstance(q_offset, bool) or not hasattr(q_offset, "__index__"):
            raise TypeError(f"q_offset must hold integers (the key position of query 0); got {q_offset!r}")
        return int(q_offset)
    array = q_offset if isinstance(q_offset, jax.Array) else np.asarray(q_offset)
    if len(q_shape) != 4:
        raise ValueError(rank_message("q_offset", q_shape))
    check_q_offset_array(array.shape, dtype_name(array.dtype), q_shape[0])
    return _offset_form(array, q_shape[0])


def _offset_form(q_offset: Any, batch: int) -> Array:
    """Checked per-example query offsets as every path reads them: int32 (batch,)."""
    return jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32).reshape(-1), (batch,))


def canonical_chunk_origin(chunk_origin: Any, chunk: int | None, q_shape: tuple[int, ...]) -> int | Array:
    """Where each example's chunks start (``attention_spec.geometry.check_chunk_origin``):
    a Python int (static: 0 .. chunk - 1, the same chunks), or int32 (B,) when it differs
    per example.  None -> 0."""
    if chunk_origin is None:
        return 0
    if not isinstance(chunk_origin, (jax.Array, np.ndarray)) and not hasattr(chunk_origin, "__len__"):
        ok = not isinstance(chunk_origin, bool) and hasattr(chunk_origin, "__index__")
        check_chunk_origin(None, "int" if ok else type(chunk_origin).__name__, 0, chunk)
        return int(chunk_origin) % cast(int, chunk)
    array = chunk_origin if isinstance(chunk_origin, jax.Array) else np.asarray(chunk_origin)
    if chunk is not None and len(q_shape) != 4:
        raise ValueError(rank_message("chunk_origin", q_shape))
    check_chunk_origin(tuple(array.shape), dtype_name(array.dtype), q_shape[0], chunk)
    return _offset_form(array, q_shape[0])


def canonical_segments(
    segment_ids: Any, kv_segment_ids: Any, q_shape: tuple[int, ...], kv_len: int
) -> Array | None:
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
    seg_q, seg_k = jnp.asarray(segment_ids), jnp.asarray(kv_segment_ids)
    check_segment_ids("segment_ids", seg_q.shape, dtype_name(seg_q.dtype), batch, q_len)
    check_segment_ids("kv_segment_ids", seg_k.shape, dtype_name(seg_k.dtype), batch, kv_len)
    return _same_segment(seg_q, seg_k)


def _same_segment(seg_q: Array, seg_k: Array) -> Array:
    """Checked segment ids (B, T) and (B, S) -> the bool mask (B, 1, T, S) of same-segment pairs."""
    return (seg_q[:, :, None] == seg_k[:, None, :])[:, None]


class Call(NamedTuple):
    """One call, checked: its options (``CallOptions``, Python values) and its arrays in
    the form every path reads."""

    options: CallOptions
    mask: Array | None = None
    bias: Array | None = None
    kv_lengths: Array | None = None
    offset: int | Array = 0
    segments: Array | None = None
    sinks: Array | None = None
    dropout_mask: Array | None = None  # given as a list or NumPy array: checked as given
    chunk_origin: int | Array = 0  # where each example's chunks start: an int, or (B,) integers


class Operands(NamedTuple):
    """The arrays a kernel reads beside q, k and v, as one value (a pytree: a field that
    is None is no leaf): an additive ``bias``, a bool ``mask``, key counts ``lengths`` and
    sink logits ``sinks``, each in the form that kernel documents, None where the call has
    none.  A kernel's ``custom_vjp`` takes it as one argument and returns its cotangent as
    an ``Operands`` too (``float0`` for integers and bools)."""

    bias: Array | None = None
    mask: Array | None = None
    lengths: Array | None = None
    sinks: Array | None = None


def canonical_sinks(sinks: Any, q_shape: tuple[int, ...], dtype: Any, normalization: str) -> Array | None:
    """Attention sinks (H,), one logit per query head of q (..., H, T, D), checked
    (``check_sinks``) and cast to the compute dtype of q's ``dtype`` (float32 for half
    precision, float64 stays float64)."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    check_sinks(sinks.shape, dtype_name(sinks.dtype), q_shape, normalization)
    return sinks.astype(compute_dtype(dtype))


def canonicalise(
    q: Any, k: Any, v: Any, options: CallOptions, *, mask: Any = None, bias: Any = None, kv_lengths: Any = None,
    dropout_mask: Any = None, q_offset: Any = None, segment_ids: Any = None, kv_segment_ids: Any = None,
    sinks: Any = None, chunk_origin: Any = None,
) -> Call:
    """Every check of a call's arrays, in ``dot_product_attention``'s order, before any
    work, and the arrays canonicalised: q, k and v in ``options.layout`` (read for their
    shapes and dtypes, ``check_qkv_in_layout``), then the mask, bias, lengths, dropout
    mask, query offset, segment ids and sinks against them.  ``options`` were checked
    when they were made (``call_options``)."""
    dtypes = (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype))
    q_shape, k_shape, _ = check_qkv_in_layout(q.shape, k.shape, v.shape, dtypes, options.layout)
    kv_len = k_shape[-2]
    weights_shape = (*q_shape[:-1], kv_len)
    mask = canonical_mask(mask, weights_shape)
    bias = canonical_bias(bias, weights_shape)
    if kv_lengths is not None:
        if len(q_shape) != 4:
            raise ValueError(kv_lengths_rank_message(q_shape))
        kv_lengths = canonical_kv_lengths(kv_lengths, q_shape[0], kv_len)
    if dropout_mask is not None:
        if not isinstance(dropout_mask, jax.Array):
            dropout_mask = host_array("dropout_mask", dropout_mask)
        check_dropout_mask(
            dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape,
            training=options.training, rate=options.dropout_rate,
        )
        dropout_mask = jnp.asarray(dropout_mask)
    offset = canonical_q_offset(q_offset, options.alignment, q_shape, kv_len)
    segments = canonical_segments(segment_ids, kv_segment_ids, q_shape, kv_len)
    sinks = canonical_sinks(sinks, q_shape, q.dtype, options.normalization)
    origin = canonical_chunk_origin(chunk_origin, options.chunk, q_shape)
    return Call(options, mask, bias, kv_lengths, offset, segments, sinks, dropout_mask, origin)


def assemble(
    q_shape: tuple[int, ...], kv_len: int, dtype: Any, options: CallOptions, *, mask: Array | None = None,
    bias: Array | None = None, kv_lengths: Any = None, dropout_mask: Any = None, q_offset: Any = None,
    segment_ids: Any = None, kv_segment_ids: Any = None, sinks: Any = None, chunk_origin: Any = None,
) -> Call:
    """The ``Call`` of a module's attention, whose inputs its planner has checked
    (``attention_spec.planning.plan_call``): the forms ``canonicalise`` makes, without
    its checks.  q is (B, H, T, D) of ``dtype``; ``mask`` and ``bias`` are canonical at
    rank 4; ``kv_lengths`` (B,) integers; ``q_offset`` None (``options.alignment``), an
    int, or (B,) integers; segment ids (B, T) and (B, S) (None: the queries'); ``sinks``
    (H,); ``chunk_origin`` None (0) or (B,) integers (the module's chunks at its
    positions, ``attention_spec.geometry.chunk_origin``)."""
    batch = q_shape[0]
    if kv_lengths is not None:
        kv_lengths = _lengths_form(kv_lengths, batch, kv_len)
    if q_offset is None:
        offset: int | Array = 0 if options.alignment == "top_left" else kv_len - q_shape[-2]
    else:
        offset = q_offset if isinstance(q_offset, int) else _offset_form(q_offset, batch)
    segments = None
    if segment_ids is not None:
        seg_q = jnp.asarray(segment_ids)
        segments = _same_segment(seg_q, seg_q if kv_segment_ids is None else jnp.asarray(kv_segment_ids))
    if sinks is not None:
        sinks = jnp.asarray(sinks).astype(compute_dtype(dtype))
    if dropout_mask is not None:
        dropout_mask = jnp.asarray(dropout_mask)
    origin = 0 if chunk_origin is None or options.chunk is None else _offset_form(chunk_origin, batch)
    return Call(options, mask, bias, kv_lengths, offset, segments, sinks, dropout_mask, origin)


def heads_first(q: Any, k: Any, v: Any, layout: str) -> tuple[Any, Any, Any]:
    """q, k and v as (..., H, S, D), what the route and the checks read: the arrays
    themselves for ``"bhsd"``, their shapes and dtypes (``jax.ShapeDtypeStruct``) for
    ``"bshd"``."""
    if layout == "bhsd":
        return q, k, v
    return tuple(jax.ShapeDtypeStruct((*t.shape[:-3], t.shape[-2], t.shape[-3], t.shape[-1]), t.dtype)
                 for t in (q, k, v))  # type: ignore[return-value]


def band(q_len: int, kv_len: int, offset: int | Array, reach: Band, ndim: int, start: int = 0,
         origin: int | Array = 0) -> Array | None:
    """bool, ``ndim`` dimensions: key j (at key position start + j) is visible from
    query i (at key position i + offset) within ``reach`` (causal, window, chunk, its
    chunks counted from ``origin``, an int or (B,)); None if every key is.  ``start``: a
    block's first key (a chunk reads absolute positions)."""
    static = offset if isinstance(offset, int) else None
    left, right = band_reach(q_len, kv_len, None if static is None else static - start, reach)
    chunk = band_chunk(q_len, kv_len, static, reach, start, origin if isinstance(origin, int) else None)
    if left is None and right is None and chunk is None:
        return None
    if isinstance(offset, int):
        position = jnp.arange(q_len)[:, None] + offset  # (T, 1)
    else:  # (B,) -> (B, 1, T, 1)
        position = (jnp.arange(q_len)[None, :] + offset[:, None])[:, None, :, None]
    if not isinstance(origin, int):  # (B,) -> (B, 1, 1, 1), the positions at rank 4
        origin, position = origin[:, None, None, None], expand_to(position, 4)
    keys = (jnp.arange(kv_len) + start).reshape((1,) * (position.ndim - 1) + (kv_len,))
    return expand_to(visible(keys, position, left, right, chunk, origin), ndim)


def length_mask(kv_lengths: Array, kv_len: int, ndim: int) -> Array:
    # (B,) -> (B, 1, ..., 1, S): key positions before each example's length
    valid = within_length(jnp.arange(kv_len)[None, :], kv_lengths[:, None])
    return valid.reshape(valid.shape[:1] + (1,) * (ndim - 2) + valid.shape[1:])


def live_keys(
    mask: Array | None, reach: Band, kv_lengths: Array | None, q_len: int, kv_len: int, ndim: int, *, offset: int = 0
) -> Array | None:
    """(..., S, 1) bool, ``ndim`` dimensions: key positions that some query may attend
    to; None if all may.  ``mask`` has ``ndim`` dimensions (``canonical_mask``)."""
    live = None
    if mask is not None:
        seen_band = band(q_len, kv_len, offset, reach, ndim)
        seen = mask if seen_band is None else mask & seen_band
        live = seen.any(axis=-2)  # (..., S), size-1 dimensions kept
    elif bounded(reach):  # the keys within reach of the first to the last query
        lo, hi = key_range(0, q_len, kv_len, offset, reach)
        if lo > 0 or hi < kv_len:
            positions = jnp.arange(kv_len)
            live = expand_to((positions >= lo) & (positions < hi), ndim - 1)
    if kv_lengths is not None:
        valid = length_mask(kv_lengths, kv_len, ndim)[..., 0, :]
        live = valid if live is None else live & valid
    return None if live is None else live[..., None]


class Structure(NamedTuple):
    """What a path computes from: the dense mask, the keys and values with those that no
    query sees zeroed, the structure it keeps (offset, causal, window, chunk) and the
    heads per key/value head."""

    mask: Array | None
    k: Array
    v: Array
    offset: int
    causal: bool
    window: tuple[int | None, int | None] | None
    groups: int
    chunk: int | None = None


def structure(q: Any, k: Array, v: Array, call: Call, structural: bool, layout: str = "bhsd",
              reads_to_lengths: bool = False) -> Structure:
    """Segments, and positions that differ per example, are a dense mask on every path; a
    static offset and the window stay structural where a path can use them
    (``structural``).  Keys and values that no query may attend to become zeros, but for
    a path that reads no key past ``kv_lengths`` (``reads_to_lengths``: the library's CPU
    kernel) those past a length stay as they are: it never reads them, and a copy of a
    long cache would cost what the cache's length costs.  q is read for its shape, (...,
    H, T, D); k and v are in ``layout`` (``"bshd"``: (..., S, Hkv, D), as the fused
    kernels take them) and are returned in it."""
    q_len, kv_len = q.shape[-2], k.shape[-3] if layout == "bshd" else k.shape[-2]
    reach: Band = call.options  # causal, window and chunk; none once they are a dense mask
    mask, offset = call.mask, call.offset
    if call.segments is not None:
        mask = combine_masks(mask, call.segments)
    if call.bias is not None:  # a -inf entry blocks its key, as a mask does (``bias_allows``)
        mask = combine_masks(mask, bias_allows(call.bias))
    origin = call.chunk_origin
    if reach.chunk is not None and not (isinstance(origin, int) and origin == 0):  # chunks from each origin: dense
        if band_chunk(q_len, kv_len, offset if isinstance(offset, int) else None, reach, 0,
                      origin if isinstance(origin, int) else None) is not None:
            mask = combine_masks(mask, band(q_len, kv_len, offset, Reach(chunk=reach.chunk), q.ndim, origin=origin))
            reach = unanchored(reach)
        else:
            reach = Reach(reach.causal, reach.window)
    if not isinstance(offset, int) or (not structural and (reach.window is not None or reach.chunk is not None
                                                           or (reach.causal and offset))):
        mask = combine_masks(mask, band(q_len, kv_len, offset, reach, q.ndim))
        offset, reach = 0, Reach()
    lengths = None if reads_to_lengths else call.kv_lengths
    live = live_keys(mask, reach, lengths, q_len, kv_len, q.ndim, offset=offset)
    groups = q.shape[-3] // k.shape[-2 if layout == "bshd" else -3] if q.ndim >= 3 else 1
    if live is not None:
        if groups > 1 and live.shape[-3] > 1:  # a key is live if any head of its group sees it
            live = live.reshape(*live.shape[:-3], -1, groups, kv_len, 1).any(axis=-3)
        if layout == "bshd":  # (..., Hkv, S, 1) -> (..., S, Hkv, 1)
            live = jnp.swapaxes(live, -3, -2)
        k, v = jnp.where(live, k, jnp.zeros((), k.dtype)), jnp.where(live, v, jnp.zeros((), v.dtype))
    return Structure(mask, k, v, offset, reach.causal, reach.window, groups, reach.chunk)
