"""The attention math, once, for JAX.  ``torch_attention/functional.py`` is its twin.

Dimension legend (the same names on both sides):
  B: batch          H: heads          T / q_len: queries      S / kv_len: keys and values
  D: head_dim (query/key width)       Dv: value width

Masks are bool, ``True`` = may attend, broadcastable to ``(B, H, T, S)`` (or to the
leading dimensions that ``q`` has).  A query row that may attend to nothing gets zero
weights and a zero output, never NaN, with finite gradients.

Precision: matmuls run at ``precision="highest"`` by default (JAX's GPU/TPU default is
lower; PyTorch keeps TF32 off).  The scores are formed, scaled, masked and normalised,
and the weights mix the values, in float32 for float16/bfloat16 inputs (q, k and v are
upcast, so a logit beyond the half-precision range stays finite and the output is
rounded once; float64 stays float64); returned weights are cast to the input dtype.
Whether a row has anything to attend to is decided from the mask, never from an infinite
row maximum.  The softmax exponentiates ``(scores - max) * scale`` with the maximum of the
unscaled scores: XLA on CPU fuses ``scores * scale - max`` into one instruction whose
rounding differs from the maximum's, which turns logits of 1e10 into NaN.

Masks and lengths are canonicalised once (``canonical_mask``, ``canonical_kv_lengths``)
before any path runs, and keys and values at key positions that no query may attend to
(past ``kv_lengths``, or blocked for every query) are replaced by zeros with ``where``:
a NaN or Inf stored there never reaches an output or a gradient.

Everything here is jit-compatible; options are Python values (static under jit).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

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
from attention_spec.geometry import reach as _reach
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
from jax_attention import _cpu_kernel
from jax_attention.masks import _and_masks as combine_masks
from jax_attention.masks import _raise_if, causal_mask

__all__ = [
    "attention_scores",
    "attention_weights",
    "canonical_bias",
    "canonical_kv_lengths",
    "canonical_mask",
    "cpu_kernel_supports",
    "default_block_size",
    "dot_product_attention",
    "dropout_weights",
    "linear",
    "normalize_scores",
    "resolve_scale",
]

Precision = Any  # None, a string such as "highest", or a jax.lax.Precision


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``None`` -> 1/sqrt(head_dim); a float is used as given (1.0 = unscaled)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _compute_dtype(dtype: Any) -> Any:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _expand_to(m: Array, ndim: int) -> Array:
    # Explicit leading 1s: the library runs under jax_numpy_rank_promotion="raise".
    return m.reshape((1,) * (ndim - m.ndim) + m.shape)


def canonical_mask(mask: Any, weights_shape: tuple[int, ...]) -> Array | None:
    """A bool mask (True = may attend) broadcastable to ``weights_shape`` -> the same mask
    with leading 1s up to ``len(weights_shape)`` dimensions (0-d and 1-d masks included).

    Raises ``TypeError`` (not bool) or ``ValueError`` (does not broadcast), as ``check_mask``.
    """
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    check_mask(mask.shape, dtype_name(mask.dtype), weights_shape)
    return _expand_to(mask, len(weights_shape))


def canonical_bias(bias: Any, weights_shape: tuple[int, ...]) -> Array | None:
    """A floating-point bias broadcastable to ``weights_shape`` -> the same bias with
    leading 1s up to ``len(weights_shape)`` dimensions.  Raises ``TypeError`` (not
    floating point) or ``ValueError`` (does not broadcast), as ``check_bias``."""
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    check_bias(bias.shape, dtype_name(bias.dtype), weights_shape)
    return _expand_to(bias, len(weights_shape))


def _bias_allows(bias: Array) -> Array:
    """bool, the bias's shape: False where the bias is -inf.  Such an entry blocks its key
    exactly as a mask does (weight 0, a row blocked throughout gets zeros, gradients
    finite); left to the softmax, a row of -inf would give 0/0 = NaN."""
    return bias != -jnp.inf


def _adjust(scores: Array, bias: Array | None, softcap: float | None) -> Array:
    """Scaled scores -> ``softcap * tanh(s / softcap)``, then ``+ bias`` (in the scores'
    compute dtype: a half-precision bias is added in float32)."""
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if bias is not None:
        scores = scores + _expand_to(bias, scores.ndim).astype(scores.dtype)
    return scores


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
    check_kv_lengths_array(kv_lengths.shape, dtype_name(kv_lengths.dtype), batch)
    if not isinstance(kv_lengths, jax.core.Tracer) and kv_lengths.size:  # batch 0: nothing to check
        # read with NumPy: inside a jit trace, even a concrete array's min() is staged out
        values = np.asarray(kv_lengths)
        check_kv_lengths_values(int(values.min()), int(values.max()), kv_len)
    lengths = jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, kv_len)
    return jnp.broadcast_to(lengths.reshape(-1), (batch,))


def attention_scores(q: Array, k: Array, scale: float, *, precision: Precision = "highest") -> Array:
    """``scale * q @ k^T``: (..., T, D), (..., S, D) -> (..., T, S) in the compute dtype
    (q and k are upcast first: half-precision scores would overflow or lose digits)."""
    return _raw_scores(q, k, precision) * scale


def _raw_scores(q: Array, k: Array, precision: Precision) -> Array:
    ct = _compute_dtype(q.dtype)
    return jnp.matmul(q.astype(ct), jnp.swapaxes(k.astype(ct), -2, -1), precision=precision)  # (..., T, S)


def normalize_scores(
    scores: Array,
    mask: Array | None = None,
    *,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
) -> Array:
    """Scores (..., T, S) -> weights (..., T, S), each row summing to 1 or 0.

    ``mask_strategy="fill"`` sets masked scores to -inf before the softmax;
    ``"renormalize"`` takes the softmax over every key, zeroes the masked weights and
    divides by the new row sum (seed 004).  In exact arithmetic the two are equal, so
    both are computed as the stable ``"fill"`` (the row maximum over the visible keys):
    the literal renormalisation underflows to a zero row when a hidden key's logit is
    about 104 above the visible ones.  Both give zeros for a fully masked row.
    ``normalization="sum"`` divides the (masked) scores by their row sum instead of a
    softmax, and raises ``ValueError`` where a row with something to attend to sums to 0
    (eagerly; under jit the same text arrives as a runtime error from a callback).
    """
    if mask is not None:
        mask = _expand_to(mask, scores.ndim)
    if normalization == "sum":
        kept = scores if mask is None else jnp.where(mask, scores, 0.0)
        row_sum = kept.sum(axis=-1, keepdims=True)
        live = True if mask is None else mask.any(axis=-1, keepdims=True)
        _raise_if(jnp.any((row_sum == 0) & live), zero_row_sum_message())
        return _safe_divide(kept, row_sum)

    return _softmax(scores, mask)


def _unnormalized(scores: Array, mask: Array | None, scale: float) -> Array:
    """exp(scale * (scores - row max)) over the keys ``mask`` lets through (``scale > 0``).

    The maximum is that of the unscaled scores, and the subtraction comes before the
    scaling, so no multiply-add can be fused across it: the largest score gives exactly
    exp(0) whatever XLA fuses."""
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    if mask is not None:
        # A row with nothing to attend to (known from the mask) subtracts 0: exp(-inf)
        # stays exactly 0 and the division by the row sum turns 0/0 into 0.
        row_max = jnp.where(mask.any(axis=-1, keepdims=True), row_max, 0.0)
    return jnp.exp((scores - row_max) * scale)


def _softmax(scores: Array, mask: Array | None, scale: float = 1.0) -> Array:
    unnormalized = _unnormalized(scores, mask, scale)
    return _safe_divide(unnormalized, unnormalized.sum(axis=-1, keepdims=True))


def _safe_divide(weights: Array, row_sum: Array) -> Array:
    return weights / jnp.where(row_sum == 0, 1.0, row_sum)


def dropout_weights(
    weights: Array,
    rate: float,
    *,
    deterministic: bool,
    rng: Array | None = None,
    dropout_mask: Array | None = None,
) -> Array:
    """Dropout on attention weights, training mode only (``deterministic=False``),
    survivors scaled by 1/(1-rate).

    ``dropout_mask`` (bool, True = keep) replaces the random draw, so that two frameworks
    can apply the same dropout; without it the draw uses the key ``rng``.
    """
    if deterministic or rate == 0.0:
        return weights
    if dropout_mask is None:
        if rng is None:
            raise ValueError("dropout in training mode needs an rng key (or a dropout_mask)")
        dropout_mask = jax.random.bernoulli(rng, 1.0 - rate, weights.shape)
    keep = _expand_to(dropout_mask, weights.ndim).astype(weights.dtype)
    return weights * (keep * (1.0 / (1.0 - rate)))


def attention_weights(
    q: Array,
    k: Array,
    *,
    mask: Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    precision: Precision = "highest",
    bias: Array | None = None,
    softcap: float | None = None,
) -> Array:
    """Weights (..., T, S) from q (..., T, D) and k (..., S, D), before dropout.
    ``bias`` (broadcastable to (..., T, S)) is added to the scaled, soft-capped scores."""
    scale = resolve_scale(scale, q.shape[-1])
    raw = _raw_scores(q, k, precision)
    mask = _combine(mask, causal, q.shape[-2], k.shape[-2], raw.ndim)
    if bias is not None:  # a -inf entry blocks its key
        mask = combine_masks(mask, _expand_to(_bias_allows(bias), raw.ndim))
    if normalization == "sum":
        return normalize_scores(_adjust(raw * scale, bias, softcap), mask, normalization=normalization)
    check_mask_strategy(mask_strategy)  # "renormalize" equals "fill" (see normalize_scores)
    if bias is not None or softcap is not None:
        return _softmax(_adjust(raw * scale, bias, softcap), mask)
    return _softmax(raw, mask, scale)


def _combine(mask: Array | None, causal: bool, q_len: int, kv_len: int, ndim: int) -> Array | None:
    if mask is not None:
        mask = _expand_to(mask, ndim)
    if not causal:
        return mask
    tril = _expand_to(causal_mask(q_len, kv_len), ndim)
    return tril if mask is None else mask & tril


def dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Array | None = None,
    causal: bool = False,
    kv_lengths: Any = None,
    scale: float | None = None,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    dropout_rate: float = 0.0,
    dropout_mask: Array | None = None,
    deterministic: bool = True,
    rng: Array | None = None,
    return_weights: bool = False,
    implementation: str = "auto",
    precision: Precision = "highest",
    bias: Array | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    alignment: str = "top_left",
    q_offset: Any = None,
    segment_ids: Any = None,
    kv_segment_ids: Any = None,
) -> Array | tuple[Array, Array]:
    """Attention over q (..., H, T, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv) -> (..., H, T, Dv).

    Args:
      mask: bool, True = may attend, broadcastable to (..., T, S); 0-d and 1-d included.
      causal: also block keys after the query (top-left aligned ``tril``).
      kv_lengths: the number of valid keys per example (padding given as lengths, which
        fused kernels take natively): an int, a list of ints or an integer array of shape
        () or (B,), each in [0, S]; see ``canonical_kv_lengths``.  Needs q of shape
        (B, H, T, D).
      scale: None = 1/sqrt(D); a float as given.
      mask_strategy: "fill" or "renormalize", equal in exact arithmetic and computed
        alike (stably) on every path; see ``normalize_scores``.
      dropout_rate, deterministic, rng, dropout_mask: dropout on the weights, see
        ``dropout_weights``.
      return_weights: also return the weights that mixed the values (after dropout).
      bias: float, broadcastable to (..., T, S), added to the scores (after scaling and
        soft-capping, before masking; differentiable).  A blocked key stays blocked, and
        a ``-inf`` entry blocks its key as a mask does: weight 0, zeros for a row that is
        ``-inf`` (or masked) throughout, finite gradients (zero for the ``-inf`` entries).
      softcap: None (off) or c > 0: the scaled scores become ``c * tanh(s / c)`` before
        the bias and the mask (Gemma 2's order).  The fused path refuses it
        (``jax.nn.dot_product_attention`` has no soft-capping on XLA); ``"auto"`` then
        takes a path that honours it.
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
        heads to the kernel; the others repeat them.
      implementation: ``"reference"`` (the explicit math), ``"fused"`` (a fused
        kernel: on CPU the library's own FlashAttention kernel where it takes the call,
        see ``cpu_kernel_supports``; otherwise ``jax.nn.dot_product_attention``, cuDNN
        for half precision on NVIDIA GPUs and XLA in float32 elsewhere; Pallas splash
        attention on TPU; refuses float64, which it would compute with float32
        accuracy), ``"blockwise"`` (query blocks that skip the keys a causal mask
        hides; never materialises T x S), or ``"auto"`` (fused on GPU/TPU and where the
        CPU kernel takes the call and is built for AVX-512, the instruction set it is
        tuned for, blockwise elsewhere on CPU and for float64, reference where those
        cannot honour an option; see ``attention_spec.resolve_implementation`` and
        ``_cpu_kernel.auto_declines``).
      precision: of the matmuls; "highest" by default.

    Keys and values at positions that no query may attend to are zeroed with ``where``
    before any product: whatever is stored there (NaN included) reaches no output and
    gets a zero gradient.

    Raises:
      ValueError / TypeError: inconsistent shapes or dtypes, a mask that is not bool or
        does not broadcast, bad ``kv_lengths``, a ``dropout_mask`` while dropout is off
        (deterministic or rate 0), a bad option value, an explicit implementation that
        cannot honour an option; all before any computation.  Under jit, the values of
        ``kv_lengths`` are not checked (see ``canonical_kv_lengths``).
    """
    check_qkv(q.shape, k.shape, v.shape, (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype)))
    weights_shape = (*q.shape[:-1], k.shape[-2])
    mask = canonical_mask(mask, weights_shape)
    bias = canonical_bias(bias, weights_shape)
    softcap = check_softcap(softcap)
    if kv_lengths is not None:
        if q.ndim != 4:
            raise ValueError(kv_lengths_rank_message(q.shape))
        kv_lengths = canonical_kv_lengths(kv_lengths, q.shape[0], k.shape[-2])
    check_dropout_rate(dropout_rate)
    if dropout_mask is not None:
        check_dropout_mask(
            dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape,
            training=not deterministic, rate=dropout_rate,
        )
    check_scale(scale)
    check_mask_strategy(mask_strategy)
    check_normalization(normalization)
    window = check_window(window)
    offset = canonical_q_offset(q_offset, check_alignment(alignment), q.shape, k.shape[-2])
    segments = canonical_segments(segment_ids, kv_segment_ids, q.shape, k.shape[-2])
    # On CPU the fused path is the library's kernel where it takes the call (else XLA's
    # fused attention, slower there than the explicit math: blockwise is faster); auto
    # takes the kernel only where it is tuned for the instruction set (AVX-512).
    cpu_kernel = implementation in ("fused", "auto") and cpu_kernel_supports(
        q, mask=mask, bias=bias, segments=segments, offset=offset,
        implementation=implementation)  # builds the kernel on first use
    path = resolve_implementation(
        implementation,
        preference=("fused", "blockwise") if jax.default_backend() in ("gpu", "tpu") or cpu_kernel
        else ("blockwise",),
        return_weights=return_weights,
        normalization=normalization,
        dropout_active=not deterministic and dropout_rate > 0.0,
        dropout_mask_given=dropout_mask is not None,
        fused_draws_dropout=FUSED_DRAWS_DROPOUT,
        fused_blockers=fused_blockers(q.dtype == jnp.float64, softcap),
    )
    scale = resolve_scale(scale, q.shape[-1])
    q_len, kv_len = q.shape[-2], k.shape[-2]
    # Segments, and positions that differ per example, are a dense mask on every path;
    # a static offset and the window stay structural where a path can use them.
    if segments is not None:
        mask = combine_masks(mask, segments)
    if bias is not None:  # a -inf entry blocks its key, as a mask does (``_bias_allows``)
        mask = combine_masks(mask, _bias_allows(bias))
    structural = path == "blockwise" or (path == "fused" and cpu_kernel)
    if not isinstance(offset, int) or (not structural and (window is not None or (causal and offset))):
        mask = combine_masks(mask, _band(q_len, kv_len, offset, causal, window, q.ndim))
        offset, causal, window = 0, False, None
    live_keys = _live_keys(mask, causal, kv_lengths, q_len, kv_len, q.ndim, offset=offset, window=window)
    groups = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    if live_keys is not None:
        if groups > 1 and live_keys.shape[-3] > 1:  # a key is live if any head of its group sees it
            live_keys = live_keys.reshape(*live_keys.shape[:-3], -1, groups, kv_len, 1).any(axis=-3)
        k, v = jnp.where(live_keys, k, jnp.zeros((), k.dtype)), jnp.where(live_keys, v, jnp.zeros((), v.dtype))
    if path == "fused" and cpu_kernel:
        return _cpu_fused(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale, offset=offset, window=window)
    if path == "fused":
        return _fused(q, k, v, mask=mask, causal=causal, kv_lengths=kv_lengths, scale=scale,
                      precision=precision, bias=bias)
    if groups > 1:  # the explicit paths repeat each key/value head for its group of queries
        k, v = jnp.repeat(k, groups, axis=-3), jnp.repeat(v, groups, axis=-3)
    if path == "blockwise":
        return _blockwise(q, k, v, mask=mask, causal=causal, kv_lengths=kv_lengths, scale=scale,
                          precision=precision, bias=bias, softcap=softcap, offset=offset, window=window)

    mask = combine_masks(mask, None if kv_lengths is None else _length_mask(kv_lengths, kv_len, q.ndim))
    if window is not None or (causal and offset):
        mask = combine_masks(mask, _band(q_len, kv_len, offset, causal, window, q.ndim))
        causal = False
    weights = attention_weights(
        q, k, mask=mask, causal=causal, scale=scale, mask_strategy=mask_strategy,
        normalization=normalization, precision=precision, bias=bias, softcap=softcap,
    )
    weights = dropout_weights(
        weights, dropout_rate, deterministic=deterministic, rng=rng, dropout_mask=dropout_mask
    )
    # mixed in the compute dtype: half-precision weights would add a rounding per weight
    out = jnp.matmul(weights, v.astype(weights.dtype), precision=precision).astype(v.dtype)  # (..., T, Dv)
    return (out, weights.astype(v.dtype)) if return_weights else out


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
    return jnp.broadcast_to(jnp.asarray(array, jnp.int32).reshape(-1), (q_shape[0],))


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
    return (seg_q[:, :, None] == seg_k[:, None, :])[:, None]


def _band(
    q_len: int, kv_len: int, offset: int | Array, causal: bool, window: tuple[int | None, int | None] | None,
    ndim: int,
) -> Array | None:
    """bool, ``ndim`` dimensions: key j is visible from query i (at key position
    i + offset) under ``causal`` and ``window``; None if every key is."""
    left, right = band_reach(q_len, kv_len, offset if isinstance(offset, int) else None, causal, window)
    if left is None and right is None:
        return None
    if isinstance(offset, int):
        position = jnp.arange(q_len)[:, None] + offset  # (T, 1)
    else:  # (B,) -> (B, 1, T, 1)
        position = (jnp.arange(q_len)[None, :] + offset[:, None])[:, None, :, None]
    keys = jnp.arange(kv_len).reshape((1,) * (position.ndim - 1) + (kv_len,))
    distance = keys - position  # key minus query position
    band = jnp.ones(distance.shape, dtype=jnp.bool_)
    if right is not None:
        band = band & (distance <= right)
    if left is not None:
        band = band & (distance >= -left)
    return _expand_to(band, ndim)


def _length_mask(kv_lengths: Array, kv_len: int, ndim: int) -> Array:
    # (B,) -> (B, 1, ..., 1, S): key positions before each example's length
    valid = jnp.arange(kv_len)[None, :] < kv_lengths[:, None]
    return valid.reshape(valid.shape[:1] + (1,) * (ndim - 2) + valid.shape[1:])


def _live_keys(
    mask: Array | None, causal: bool, kv_lengths: Array | None, q_len: int, kv_len: int, ndim: int,
    *, offset: int = 0, window: tuple[int | None, int | None] | None = None,
) -> Array | None:
    """(..., S, 1) bool, ``ndim`` dimensions: key positions that some query may attend
    to; None if all may.  ``mask`` has ``ndim`` dimensions (``canonical_mask``)."""
    live = None
    if mask is not None:
        band = _band(q_len, kv_len, offset, causal, window, ndim)
        visible = mask if band is None else mask & band
        live = visible.any(axis=-2)  # (..., S), size-1 dimensions kept
    elif causal or window is not None:  # the keys within reach of the first to the last query
        lo, hi = _key_range(0, q_len, kv_len, offset, causal, window)
        if lo > 0 or hi < kv_len:
            positions = jnp.arange(kv_len)
            live = _expand_to((positions >= lo) & (positions < hi), ndim - 1)
    if kv_lengths is not None:
        valid = _length_mask(kv_lengths, kv_len, ndim)[..., 0, :]
        live = valid if live is None else live & valid
    return None if live is None else live[..., None]


def _bthd(t: Array, batch: int) -> Array:
    """(..., H, T, D) -> (B, T, H, D), the leading dimensions flattened into ``batch``
    (unbatched (T, D): one head): the layout of the fused kernels.  k and v may have
    fewer heads than q."""
    return jnp.swapaxes(t.reshape(batch, t.shape[-3] if t.ndim >= 3 else 1, *t.shape[-2:]), 1, 2)


def _fused(
    q: Array, k: Array, v: Array, *, mask: Array | None, causal: bool, kv_lengths: Array | None,
    scale: float, precision: Precision, bias: Array | None = None,
) -> Array:
    """``jax.nn.dot_product_attention`` on (..., H, T, D) inputs, with this library's
    fully-masked-row policy (zeros, finite gradients) and causal/padding passed to the
    kernel as ``is_causal`` / sequence lengths rather than dense masks.

    cuDNN runs where ``cudnn_supports`` says it can, XLA's kernel everywhere else.  The
    XLA kernel gets float32 inputs with the scale folded into q (its
    ``logits * scale`` fuses into the softmax's subtraction: NaN for logits of 1e10, and
    its float16 matmul does not compile on CPU under jit); cuDNN gets half precision as
    it is.  A value width Dv != D is zero-padded to a common width and the output
    sliced: zero columns change neither the scores nor the other output columns."""
    width, v_width = q.shape[-1], v.shape[-1]
    if v_width < width:
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, width - v_width)])
    elif v_width > width:
        pad = [(0, 0)] * (q.ndim - 1) + [(0, v_width - width)]
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    heads = q.shape[-3] if q.ndim >= 3 else 1
    batch = math.prod(q.shape[:-3])

    live = None  # (B, H, T, 1): rows with something to attend to, when some may have none
    dense = None
    if mask is not None:
        dense = jnp.broadcast_to(mask, (*mask.shape[:-2], q.shape[-2], k.shape[-2]))
        full = combine_masks(dense, None if not causal else _expand_to(causal_mask(q.shape[-2], k.shape[-2]), q.ndim))
        full = combine_masks(full, None if kv_lengths is None else _length_mask(kv_lengths, k.shape[-2], q.ndim))
        assert full is not None  # dense is not None
        row_live = full.any(axis=-1, keepdims=True)
        dense = dense | ~row_live  # a row with nothing to attend to attends to everything...
        live = row_live  # ...and its output is zeroed below: finite values and gradients
        dense = jnp.broadcast_to(dense, (*q.shape[:-2], q.shape[-2], k.shape[-2]))
        dense = dense.reshape(batch, heads, q.shape[-2], k.shape[-2])
    lengths = None
    if kv_lengths is not None:
        lengths = jnp.maximum(kv_lengths, 1).astype(jnp.int32)
        empty = (kv_lengths > 0).reshape((-1,) + (1,) * (q.ndim - 1))
        live = empty if live is None else live & empty
    if bias is not None:  # (B, H, T, S), added by the kernel to the scaled scores
        # Its -inf entries are in the mask already (``_bias_allows``): 0 in their place
        # keeps a row that attends to everything (see above) finite, its gradient too.
        bias = jnp.where(_bias_allows(bias), bias, jnp.zeros((), bias.dtype))
        bias = jnp.broadcast_to(bias, (*q.shape[:-2], q.shape[-2], k.shape[-2]))
        bias = bias.reshape(batch, heads, q.shape[-2], k.shape[-2])
    if (jax.default_backend() == "tpu" and dense is None and bias is None and kv_lengths is None
            and k.shape[-3:-2] == q.shape[-3:-2] and splash_supports(q, k, v)):
        out = splash_attention(q, k, v, causal=causal, scale=scale)
        return out[..., :v_width]
    kernel: Literal["xla", "cudnn"] = "cudnn" if cudnn_supports(q, k, v) else "xla"
    out_dtype = v.dtype
    if kernel == "xla":
        q, k, v = q.astype(jnp.float32) * scale, k.astype(jnp.float32), v.astype(jnp.float32)
        scale = 1.0
        bias = None if bias is None else bias.astype(jnp.float32)
    elif bias is not None:
        bias = bias.astype(q.dtype)
    with jax.default_matmul_precision(_precision_name(precision)):
        out = jax.nn.dot_product_attention(
            _bthd(q, batch), _bthd(k, batch), _bthd(v, batch), bias=bias, mask=dense, scale=scale, is_causal=causal,
            key_value_seq_lengths=lengths, implementation=kernel,
        )
    out = jnp.swapaxes(out, 1, 2).reshape(*q.shape[:-1], v.shape[-1])[..., :v_width]  # (..., H, T, Dv)
    out = out.astype(out_dtype)
    return out if live is None else jnp.where(live, out, jnp.zeros((), out.dtype))


def cpu_kernel_supports(q: Array, *, mask: Array | None = None, bias: Array | None = None,
                        segments: Array | None = None, offset: int | Array = 0,
                        implementation: str = "fused") -> bool:
    """Whether ``implementation`` (``"fused"`` or ``"auto"``) runs the library's CPU
    kernel (``_cpu_kernel``) for a call: XLA's CPU backend, float32, bfloat16 or float16
    inputs (computed in float32), no dense mask, bias or segment ids, one query offset for
    every example (causal, window, ``kv_lengths`` and grouped heads are the kernel's own),
    and a kernel that builds on this machine; for ``"auto"`` also a kernel built for the
    instruction set it is tuned for (AVX-512; elsewhere the blockwise path is faster, and
    ``_cpu_kernel.auto_declines()`` says so).  Elsewhere the fused path is
    ``jax.nn.dot_product_attention``; where only the kernel itself is missing (a failed
    build) an explicit ``"fused"`` says so with a ``RuntimeWarning``."""
    if not (jax.default_backend() == "cpu" and q.dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
            and mask is None and bias is None and segments is None and isinstance(offset, int)):
        return False
    if not _cpu_kernel.available():
        if implementation == "fused":
            _cpu_kernel.warn_fallback()
        return False
    return implementation != "auto" or _cpu_kernel.auto_declines() is None


class _KernelStatic(NamedTuple):
    """The static part of a CPU-kernel call: query 0 at key position ``offset``; a query
    at p sees keys p - left .. p + right (None: unbounded)."""

    scale: float
    offset: int
    left: int | None
    right: int | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_attention(st: _KernelStatic, q: Array, k: Array, v: Array, lengths: Array) -> Array:
    """float32 q (B, T, H, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv), int32 lengths (B,) ->
    (B, T, H, Dv): the CPU kernel, with its FlashAttention backward."""
    return _kernel_attention_fwd(st, q, k, v, lengths)[0]


def _kernel_attention_fwd(st: _KernelStatic, q: Array, k: Array, v: Array, lengths: Array) -> tuple[Array, Any]:
    out, row_max, row_sum = _cpu_kernel.forward(q, k, v, lengths, **st._asdict())
    return out, (q, k, v, lengths, out, row_max, row_sum)


def _kernel_attention_bwd(st: _KernelStatic, residuals: Any, d_out: Array) -> tuple[Any, ...]:
    q, k, v, lengths, out, row_max, row_sum = residuals
    dq, dk, dv = _cpu_kernel.backward(q, k, v, lengths, out, d_out, row_max, row_sum, **st._asdict())
    return dq, dk, dv, _float0(lengths)


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def _cpu_fused(q: Array, k: Array, v: Array, *, causal: bool, kv_lengths: Array | None, scale: float,
               offset: int, window: tuple[int | None, int | None] | None) -> Array:
    """The fused path on CPU: the library's kernel on (..., H, T, D) inputs (leading
    dimensions flattened into one batch), in float32, the output in v's dtype.  Causal,
    window and lengths stay structural: hidden tiles are skipped, a query that sees no
    key gets a zero row, and keys past a length are never read.

    The kernel takes tokens before heads, (B, T, H, D): a module's head split (a
    transpose to (B, H, T, D)) and the transpose back here cancel under jit, so the
    projections feed the kernel with no copy in between."""
    batch, kv_len = math.prod(q.shape[:-3]), k.shape[-2]
    lengths = jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    left, right = _reach(causal, window)
    q4, k4, v4 = (_bthd(t, batch).astype(jnp.float32) for t in (q, k, v))
    out = _kernel_attention(_KernelStatic(scale, offset, left, right), q4, k4, v4, lengths)  # (B, T, H, Dv)
    return jnp.swapaxes(out, 1, 2).reshape(*q.shape[:-1], v.shape[-1]).astype(v.dtype)


# --------------------------------------------------------------------------- projections


def linear(x: Array, kernel: Array, bias: Array | None = None, *, dtype: Any = None,
           precision: Precision = None, implementation: str = "auto") -> Array:
    """A projection, x (..., d_in) @ kernel (d_in, d_out) (+ bias (d_out,)), as
    ``nnx.Linear`` computes it: the operands promoted to ``dtype`` (None: their common
    type), the bias added after the product.

    ``implementation`` is the attention call's.  ``"fused"`` (and ``"auto"`` where the
    kernel is tuned for the CPU, AVX-512) run a float32 product on the library's CPU
    matrix-product kernel (``_cpu_kernel.matmul``, built with the attention kernel; see
    ``cpu_kernel_supports``), forward and backward; every other case is XLA's dot at
    ``precision``.  The two differ only in the order of the sums."""
    implementation = check_implementation(implementation)
    check_linear(tuple(x.shape), tuple(kernel.shape), None if bias is None else tuple(bias.shape), layout="in_out")
    operands = (x, kernel) if bias is None else (x, kernel, bias)
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(*operands)
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    if (implementation in ("fused", "auto") and cpu_kernel_supports(x, implementation=implementation)
            and dtype == jnp.float32):
        y = _kernel_linear(x.reshape(-1, x.shape[-1]), kernel).reshape(*x.shape[:-1], kernel.shape[1])
    else:
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
    return y if bias is None else y + bias.astype(dtype).reshape((1,) * (y.ndim - 1) + (-1,))


@jax.custom_vjp
def _kernel_linear(x: Array, kernel: Array) -> Array:
    """float32 x (M, d_in) @ kernel (d_in, d_out) on the CPU kernel, and its gradients
    (dx = dy kernel^T, dkernel = x^T dy) on the same kernel, with no transposed copies."""
    return _cpu_kernel.matmul(x, kernel)


def _kernel_linear_fwd(x: Array, kernel: Array) -> tuple[Array, Any]:
    return _cpu_kernel.matmul(x, kernel), (x, kernel)


def _kernel_linear_bwd(residuals: Any, dy: Array) -> tuple[Array, Array]:
    x, kernel = residuals
    return _cpu_kernel.matmul(dy, kernel, trans_b=True), _cpu_kernel.matmul(x, dy, trans_a=True)


_kernel_linear.defvjp(_kernel_linear_fwd, _kernel_linear_bwd)


def cudnn_supports(q: Array, k: Array, v: Array) -> bool:
    """Whether cuDNN's fused attention takes these inputs (after the value-width padding
    in ``_fused``): an NVIDIA GPU, float16 or bfloat16, a head width that is a multiple
    of 8 and at most 256 (Hopper and later; 128 before), and even sequence lengths (its
    backward kernel refuses odd ones, and whether a call will be differentiated is not
    known here).  Anything else runs ``jax.nn.dot_product_attention``'s XLA kernel in
    float32 (checked on an H100 with jax 0.11.2: Q = KV = 77 raised "Unsupported sequence
    length" from cuDNN)."""
    if jax.default_backend() != "gpu" or q.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    widest = 256 if float(capability) >= 9.0 else 128
    width, q_len, kv_len = q.shape[-1], q.shape[-2], k.shape[-2]
    return width % 8 == 0 and width <= widest and q_len % 2 == 0 and kv_len % 2 == 0


def splash_supports(q: Array, k: Array, v: Array) -> bool:
    """Whether the TPU splash-attention kernel takes these shapes (whole 128-blocks, one
    width for q, k and v) and the installed jax has it."""
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the jax build
        return False
    q_len, kv_len, width = q.shape[-2], k.shape[-2], q.shape[-1]
    return q.ndim >= 3 and q_len % 128 == 0 and kv_len % 128 == 0 and width % 128 == 0 and v.shape[-1] == width


def splash_attention(
    q: Array, k: Array, v: Array, *, causal: bool, scale: float, interpret: bool = False
) -> Array:
    """The Pallas splash-attention kernel (TPU) on (..., H, T, D): a causal mask is a
    block-sparse mask object, so the hidden blocks are skipped.  ``interpret=True`` runs
    the kernel in the Pallas interpreter (any backend; how it is tested on CPU)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    heads, q_len, kv_len = q.shape[-3], q.shape[-2], k.shape[-2]
    one = masks.CausalMask((q_len, kv_len)) if causal else masks.FullMask((q_len, kv_len))
    kernel = kernels.make_splash_mha(
        mask=masks.MultiHeadMask([one] * heads), head_shards=1, q_seq_shards=1, interpret=interpret,
    )
    batch = math.prod(q.shape[:-3])
    # The kernel takes pre-scaled queries and one example (H, T, D); vmap over the batch.
    q3, k3, v3 = ((t.reshape(batch, heads, *t.shape[-2:])) for t in ((q * scale).astype(q.dtype), k, v))
    out = jax.vmap(kernel)(q3, k3, v3)
    return out.reshape(*q.shape[:-1], v.shape[-1]).astype(v.dtype)


def _precision_name(precision: Precision) -> str | None:
    if precision is None or isinstance(precision, str):
        return precision
    return str(precision).split(".")[-1].lower()  # jax.lax.Precision.HIGHEST -> "highest"


def default_block_size(q_len: int) -> int:
    """Query rows per block: 128 (measured best on a 2-core CPU at T=1024), growing so
    that a long sequence unrolls into at most 16 blocks."""
    return max(128, -(-q_len // 16))


# From this many keys on, the blockwise path walks key tiles in loops (``_tiled_forward``)
# instead of unrolling one (block, S) score block per query block.
_LONG_SEQUENCE = 4096
# (query rows, keys) of one tile of the loops: a (256, 512) float32 score tile is 512 KiB.
_LONG_TILE = (256, 512)
_LONG_BACKWARD_TILE = (512, 256)


def _blockwise_plan(q_len: int, kv_len: int) -> tuple[int, tuple[int, int] | None, tuple[int, int] | None]:
    """(query block, forward tile, backward tile) of the blockwise path at a shape.
    Below ``_LONG_SEQUENCE`` keys: query blocks of ``default_block_size`` rows, each
    against every key in its reach at once, unrolled (tiles None).  From it on: (rows,
    keys) tiles in ``lax.fori_loop``s with an online softmax, ``_LONG_TILE`` forward and
    ``_LONG_BACKWARD_TILE`` backward (the backward keeps no per-tile state, so its tiles
    may differ), and the largest buffer is one tile, whatever S.

    Measured on the 2-core CPU (causal, head width 64, float32, the core alone, one
    process each, medians of 5; forward / forward + backward): B2 H8 S2048, unrolled
    69 / 320 ms, the loops 92 / 321; B1 H8 S4096, unrolled 174 / 677, the loops
    148 / 550; B1 H4 S16384, unrolled 1665 / 5837, the loops 1054-1195 / 4057-4200
    (backward tiles of 256 x 512 instead: 6084).  At S=32768 the unrolled form's
    resident peak was 6 GiB (its (block, S) score blocks), the loops' 0.5 GiB."""
    if kv_len < _LONG_SEQUENCE:
        return default_block_size(q_len), None, None
    return _LONG_TILE[0], _LONG_TILE, _LONG_BACKWARD_TILE


class _FlashStatic(NamedTuple):
    """The static (hashable) structure of one blockwise slice; ``tile`` (rows, keys)
    selects the loops (``_tiled_forward``), None the unrolled blocks of ``block`` rows."""

    block: int
    tile: tuple[int, int] | None
    backward_tile: tuple[int, int] | None
    causal: bool
    offset: int
    window: tuple[int | None, int | None] | None
    scale: float
    softcap: float | None
    precision: Any
    q_len: int
    kv_len: int


def _part(a: Array | None, r0: int, r1: int, lo: int, hi: int) -> Array | None:
    """Rows [r0, r1) and keys [lo, hi) of a (T or 1, S or 1) mask or bias; a size-1
    (broadcast) dimension stays size 1."""
    if a is None:
        return None
    rows = slice(r0, r1) if a.shape[0] > 1 else slice(None)
    cols = slice(lo, hi) if a.shape[1] > 1 else slice(None)
    return a[rows, cols]


def _flash_blocks(st: _FlashStatic):  # type: ignore[no-untyped-def]
    """(r0, r1, lo, hi) of every query block with keys in reach, and the empty ones."""
    for r0 in range(0, st.q_len, st.block):
        r1 = min(r0 + st.block, st.q_len)
        lo, hi = _key_range(r0, r1, st.kv_len, st.offset, st.causal, st.window)
        yield r0, r1, lo, hi


def _flash_logits(st: _FlashStatic, q_c: Array, k_c: Array, bias: Array | None, mask: Array | None,
                  length: Array | None, r0: int, r1: int, lo: int, hi: int) -> tuple[Array, Array, float, Array | None]:
    """One block: (unscaled scores s, logits z, z's scale, allowed keys or None); the
    softmax is over ``z * z_scale``, the library's stable form (see ``_unnormalized``)."""
    raw = jnp.matmul(q_c[r0:r1], k_c[lo:hi].T, precision=st.precision)  # (r1 - r0, hi - lo)
    if bias is not None or st.softcap is not None:
        part = _part(bias, r0, r1, lo, hi)
        z, z_scale = _adjust(raw * st.scale, part, st.softcap), 1.0
    else:
        z, z_scale = raw, st.scale
    allowed = _part(mask, r0, r1, lo, hi)
    if length is not None:
        allowed = combine_masks(allowed, (jnp.arange(lo, hi) < length)[None, :])
    allowed = combine_masks(allowed, _band(r1 - r0, hi - lo, r0 + st.offset - lo, st.causal, st.window, 2))
    if allowed is not None:
        allowed = jnp.broadcast_to(allowed, z.shape)
    return raw, z, z_scale, allowed


def _flash_forward(st: _FlashStatic, q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                   length: Array | None) -> tuple[Array, tuple[Array, Array, Array]]:
    """(out in v's dtype, (out, row max, row sum) in the compute dtype) of one slice."""
    if st.tile is not None:
        return _tiled_forward(st, q, k, v, bias, mask, length)
    ct = _compute_dtype(q.dtype)
    q_c, k_c, v_c = q.astype(ct), k.astype(ct), v.astype(ct)
    outs, maxes, sums = [], [], []
    for r0, r1, lo, hi in _flash_blocks(st):
        if hi == lo:  # nothing within reach: zero rows
            outs.append(jnp.zeros((r1 - r0, v.shape[-1]), ct))
            maxes.append(jnp.zeros((r1 - r0, 1), ct))
            sums.append(jnp.zeros((r1 - r0, 1), ct))
            continue
        _, z, z_scale, allowed = _flash_logits(st, q_c, k_c, bias, mask, length, r0, r1, lo, hi)
        if allowed is not None:
            z = jnp.where(allowed, z, -jnp.inf)
        row_max = z.max(axis=-1, keepdims=True)
        if allowed is not None:  # a row with nothing to attend to subtracts 0: exp(-inf) = 0
            row_max = jnp.where(allowed.any(axis=-1, keepdims=True), row_max, 0.0)
        unnormalized = jnp.exp((z - row_max) * z_scale)
        row_sum = unnormalized.sum(axis=-1, keepdims=True)
        mixed = jnp.matmul(unnormalized, v_c[lo:hi], precision=st.precision)
        outs.append(mixed / jnp.where(row_sum == 0, 1.0, row_sum))
        maxes.append(row_max)
        sums.append(row_sum)
    out = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    row_max = jnp.concatenate(maxes, axis=0) if len(maxes) > 1 else maxes[0]
    row_sum = jnp.concatenate(sums, axis=0) if len(sums) > 1 else sums[0]
    return out.astype(v.dtype), (out, row_max, row_sum)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _FlashStatic, q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
           length: Array | None) -> Array:
    """The blockwise path over N (T, D) x (S, D) x (S, Dv) slices, with FlashAttention's
    backward: ``bias`` (N or 1, T or 1, S or 1) float, differentiable; ``mask`` bool of
    the same kind (a leading 1: one for every slice); ``length`` (N,) key counts; the
    structure (causal, window, offset, blocks) in ``st``."""
    return _slices_forward(st, q, k, v, bias, mask, length, vectorised=st.tile is not None)[0]


def _per_slice(bias: Array | None, mask: Array | None, length: Array | None,
               **batched: Array) -> tuple[dict[str, Array], Array | None, Array | None]:
    """(the arrays that differ per slice, the bias and mask shared by every slice)."""
    shared_bias = bias[0] if bias is not None and bias.shape[0] == 1 else None
    shared_mask = mask[0] if mask is not None and mask.shape[0] == 1 else None
    for name, a, shared in (("bias", bias, shared_bias), ("mask", mask, shared_mask), ("length", length, None)):
        if a is not None and shared is None:
            batched[name] = a
    return batched, shared_bias, shared_mask


def _one_block(st: _FlashStatic) -> bool:
    """Whether each slice is a single unrolled block (S <= 128 by default): too little
    work for a ``lax.map`` / ``lax.scan`` step, so a differentiated call runs such slices
    vectorised (``vmap``), forward and backward.  Measured on the 2-core CPU (causal,
    head width 64, float32): the core's forward + backward took 0.77-0.89x the time at
    B32 H4 S128 and B64 H4 S64, MultiHeadAttention's 0.95-0.97x at B32 H4 S128; but its
    forward alone took 1.05-1.08x, so an undifferentiated call maps them one at a time."""
    return st.tile is None and st.q_len <= st.block


def _slices_forward(st: _FlashStatic, q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                    length: Array | None, *, vectorised: bool) -> tuple[Array, Any]:
    """``_flash_forward`` over the slices, vectorised (``vmap``) or one at a time (``lax.map``).
    The loops (``st.tile``) always run vectorised: 1/1.2 the time of one slice at a time
    at S=16384, B1 H4.  Unrolled blocks one slice at a time are plain 2-d products, which
    XLA's CPU backend ran about 1.6x faster than the same products batched at B4 H8 S1024
    (benchmarks/profile_cpu.py), except for a single block (``_one_block``)."""
    xs, shared_bias, shared_mask = _per_slice(bias, mask, length, q=q, k=k, v=v)

    def one(t: dict[str, Array]) -> tuple[Array, tuple[Array, Array, Array]]:
        return _flash_forward(st, t["q"], t["k"], t["v"], t.get("bias", shared_bias), t.get("mask", shared_mask),
                              t.get("length"))

    out, (out_c, row_max, row_sum) = jax.vmap(one)(xs) if vectorised else jax.lax.map(one, xs)
    return out, (q, k, v, bias, mask, length, out_c, row_max, row_sum)


def _flash_fwd(st: _FlashStatic, q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
               length: Array | None) -> tuple[Array, Any]:
    return _slices_forward(st, q, k, v, bias, mask, length, vectorised=st.tile is not None or _one_block(st))


def _flash_bwd(st: _FlashStatic, residuals: Any, d_out: Array) -> tuple[Any, ...]:
    """One slice at a time (a ``lax.scan``, the gradient of a shared bias summed in its
    carry; for the loops too: vectorised, their backward took 1.2x longer at S=16384,
    B1 H4), except single-block slices, which run vectorised (``_one_block``)."""
    q, k, v, bias, mask, length, out_c, row_max, row_sum = residuals
    xs, shared_bias, shared_mask = _per_slice(bias, mask, length, q=q, k=k, v=v, out_c=out_c, row_max=row_max,
                                              row_sum=row_sum, d_out=d_out)

    def one(t: dict[str, Array]) -> tuple[Any, ...]:
        part = (t["q"], t["k"], t["v"], t.get("bias", shared_bias), t.get("mask", shared_mask), t.get("length"),
                t["out_c"], t["row_max"], t["row_sum"])
        return _slice_backward(st, part, t["d_out"])

    if _one_block(st):
        dq, dk, dv, d_bias = jax.vmap(one)(xs)
        if shared_bias is not None:  # (N, T or 1, S or 1): one block each, summed
            d_bias = d_bias.sum(axis=0, keepdims=True)
    else:
        def step(d_shared_bias: Array | None, t: dict[str, Array]) -> tuple[Array | None, tuple[Any, ...]]:
            dq, dk, dv, d_bias = one(t)
            if d_shared_bias is not None:
                d_shared_bias, d_bias = d_shared_bias + d_bias, None
            return d_shared_bias, (dq, dk, dv, d_bias)

        start = None if shared_bias is None else jnp.zeros(shared_bias.shape, _compute_dtype(shared_bias.dtype))
        d_shared_bias, (dq, dk, dv, d_bias) = jax.lax.scan(step, start, xs)
        if d_shared_bias is not None:
            d_bias = d_shared_bias[None]
    if d_bias is not None:
        d_bias = d_bias.astype(bias.dtype)
    return dq, dk, dv, d_bias, _float0(mask), _float0(length)


def _float0(a: Array | None) -> Any:
    return None if a is None else np.zeros(a.shape, dtype=jax.dtypes.float0)


def _slice_backward(st: _FlashStatic, residuals: Any, d_out: Array) -> tuple[Any, ...]:
    """(dq, dk, dv, d_bias) of one slice.  Recomputes each block's weights from the saved row maximum and sum:
    p = exp((z - max) * z_scale) / sum, then the softmax's backward
    g = p * (d_out @ v^T - rowsum(d_out * out)) on the logits, carried back through
    the soft-cap and the scale to q and k; the bias gets g itself."""
    if st.backward_tile is not None:
        return _tiled_backward(st, residuals, d_out)
    q, k, v, bias, mask, length, out_c, row_max, row_sum = residuals
    ct = _compute_dtype(q.dtype)
    q_c, k_c, v_c = q.astype(ct), k.astype(ct), v.astype(ct)
    do = d_out.astype(ct)
    delta = (do * out_c).sum(axis=-1, keepdims=True)  # (T, 1)
    dq = [jnp.zeros((0, q.shape[-1]), ct)]
    dk_t = jnp.zeros(k_c.shape[::-1], ct)  # dk and dv transposed: see the products below
    dv_t = jnp.zeros(v_c.shape[::-1], ct)
    d_bias = None if bias is None else jnp.zeros(bias.shape, ct)
    for r0, r1, lo, hi in _flash_blocks(st):
        if hi == lo:
            dq.append(jnp.zeros((r1 - r0, q.shape[-1]), ct))
            continue
        raw, z, z_scale, allowed = _flash_logits(st, q_c, k_c, bias, mask, length, r0, r1, lo, hi)
        if allowed is not None:
            z = jnp.where(allowed, z, -jnp.inf)
        m, total = row_max[r0:r1], row_sum[r0:r1]
        p = jnp.exp((z - m) * z_scale) / jnp.where(total == 0, 1.0, total)  # the forward's weights
        do_b = do[r0:r1]
        # dv and dk as (width, keys) products, do^T @ p and q^T @ ds: XLA's CPU backend runs
        # p^T @ do, which transposes the large operand, at about half the rate.
        dv_t = dv_t.at[:, lo:hi].add(jnp.matmul(do_b.T, p, precision=st.precision))
        dp = jnp.matmul(do_b, v_c[lo:hi].T, precision=st.precision)
        g = p * (dp - delta[r0:r1])  # gradient of the loss w.r.t. the logits z * z_scale
        if bias is not None or st.softcap is not None:  # z = cap(s * scale) + bias, z_scale = 1
            if d_bias is not None:
                d_bias = _add_part(d_bias, g, r0, r1, lo, hi)
            if st.softcap is not None:
                g = g * (1.0 - jnp.tanh(raw * st.scale / st.softcap) ** 2)
            ds = g * st.scale
        else:  # z = s, z_scale = scale
            ds = g * st.scale
        dq.append(jnp.matmul(ds, k_c[lo:hi], precision=st.precision))
        dk_t = dk_t.at[:, lo:hi].add(jnp.matmul(q_c[r0:r1].T, ds, precision=st.precision))
    dq_all = jnp.concatenate(dq, axis=0)
    return dq_all.astype(q.dtype), dk_t.T.astype(k.dtype), dv_t.T.astype(v.dtype), d_bias


def _add_part(total: Array, g: Array, r0: int, r1: int, lo: int, hi: int) -> Array:
    """Adds a block's (r1 - r0, hi - lo) gradient into a (T or 1, S or 1) bias gradient,
    summing over the bias's broadcast (size-1) dimensions."""
    if total.shape[0] == 1:
        g = g.sum(axis=0, keepdims=True)
    if total.shape[1] == 1:
        g = g.sum(axis=1, keepdims=True)
    rows = slice(r0, r1) if total.shape[0] > 1 else slice(None)
    cols = slice(lo, hi) if total.shape[1] > 1 else slice(None)
    return total.at[rows, cols].add(g)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _tile_ranges(st: _FlashStatic, r0: Array) -> tuple[Array, Array, Array, Array]:
    """For the query rows [r0, r0 + rows): the key tiles [first, last) within reach
    (``key_range``'s arithmetic on a traced r0), and within them [inner_first,
    inner_last), the tiles that every row of the block sees whole, which need no band."""
    rows, keys = st.tile  # type: ignore[misc]
    left, right = _reach(st.causal, st.window)
    r1 = jnp.minimum(r0 + rows, st.q_len)
    lo = jnp.int32(0) if left is None else jnp.clip(r0 + st.offset - left, 0, st.kv_len)
    hi = jnp.int32(st.kv_len) if right is None else jnp.clip(r1 + st.offset + right, 0, st.kv_len)
    hi = jnp.maximum(lo, hi)
    seen_lo = jnp.int32(0) if left is None else jnp.clip(r1 - 1 + st.offset - left, 0, st.kv_len)
    seen_hi = jnp.int32(st.kv_len) if right is None else jnp.clip(r0 + st.offset + right + 1, 0, st.kv_len)
    empty = hi == lo
    first = lo // keys
    last = jnp.where(empty, first, -(-hi // keys))
    inner_first = jnp.where(empty, first, jnp.clip(-(-seen_lo // keys), first, last))
    inner_last = jnp.where(empty, first, jnp.clip(seen_hi // keys, inner_first, last))
    return first, inner_first, inner_last, last


def _tile_of(a: Array | None, r0: Array, c0: Array, rows: int, keys: int) -> Array | None:
    """The (rows, keys) tile at (r0, c0) of a (T or 1, S or 1) mask or bias (padded to
    whole tiles); a size-1 (broadcast) dimension stays size 1."""
    if a is None:
        return None
    zero = jnp.zeros((), jnp.int32)
    start = (r0 if a.shape[0] > 1 else zero, c0 if a.shape[1] > 1 else zero)
    return jax.lax.dynamic_slice(a, start, (rows if a.shape[0] > 1 else 1, keys if a.shape[1] > 1 else 1))


def _tile_logits(st: _FlashStatic, q_b: Array, k_t: Array, v_t: Array, bias: Array | None, mask: Array | None,
                 length: Array | None, r0: Array, c0: Array, edge: bool) -> tuple[Array, Array, float, Array, Array]:
    """One tile: (unscaled scores s, logits z with hidden keys at -inf, z's scale, k_t,
    v_t); as ``_flash_logits``.  An ``edge`` tile (one that some row sees only in part,
    or that reaches past S) gets the band, and its keys and values outside the block's
    reach are zeroed first, so that a NaN stored there stays out, as on the unrolled
    path, which never reads them."""
    rows, keys = st.tile  # type: ignore[misc]
    cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, keys), 1)
    allowed = _tile_of(mask, r0, c0, rows, keys)
    if length is not None:
        allowed = combine_masks(allowed, cols < length)
    if edge:
        left, right = _reach(st.causal, st.window)
        lag = cols - (r0 + st.offset + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0))  # key - query position
        band = jnp.broadcast_to(cols < st.kv_len, (rows, keys))
        if left is not None:
            band = band & (lag >= -left)
        if right is not None:
            band = band & (lag <= right)
        allowed = combine_masks(allowed, band)
        reach = band.any(axis=0)[:, None]  # (keys, 1): seen by some row of the block
        k_t, v_t = jnp.where(reach, k_t, 0.0), jnp.where(reach, v_t, 0.0)
    raw = jnp.matmul(q_b, k_t.T, precision=st.precision)  # (rows, keys)
    if bias is not None or st.softcap is not None:
        z, z_scale = _adjust(raw * st.scale, _tile_of(bias, r0, c0, rows, keys), st.softcap), 1.0
    else:
        z, z_scale = raw, st.scale
    if allowed is not None:
        z = jnp.where(allowed, z, -jnp.inf)
    return raw, z, z_scale, k_t, v_t


def _pad_to(a: Array, size: int, axis: int, value: Any = 0, *, broadcast: bool = True) -> Array:
    """``a`` padded with ``value`` to ``size`` along ``axis``.  With ``broadcast`` (a mask or a
    bias) a size-1 axis broadcasts and stays; without (q, k, v and per-row statistics) it
    is one row like any other: a single query (a decoding step) is padded to the tile."""
    if a.shape[axis] == size or (broadcast and a.shape[axis] == 1):
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths, constant_values=value)


def _tiled_operands(st: _FlashStatic, q: Array, k: Array, v: Array, bias: Array | None,
                    mask: Array | None) -> tuple[Array, Array, Array, Array | None, Array | None]:
    """q, k, v in the compute dtype and bias and mask, padded to whole tiles."""
    rows, keys = st.tile  # type: ignore[misc]
    t_pad, s_pad = -(-st.q_len // rows) * rows, -(-st.kv_len // keys) * keys
    ct = _compute_dtype(q.dtype)
    q_p = _pad_to(q.astype(ct), t_pad, 0, broadcast=False)
    k_p, v_p = (_pad_to(t.astype(ct), s_pad, 0, broadcast=False) for t in (k, v))
    if bias is not None:
        bias = _pad_to(_pad_to(bias.astype(ct), t_pad, 0), s_pad, 1)
    if mask is not None:
        mask = _pad_to(_pad_to(mask, t_pad, 0, False), s_pad, 1, False)
    return q_p, k_p, v_p, bias, mask


def _tiled_forward(st: _FlashStatic, q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                   length: Array | None) -> tuple[Array, tuple[Array, Array, Array]]:
    """``_flash_forward`` for long sequences: a ``fori_loop`` over query blocks, and in
    each a loop over the key tiles in reach with FlashAttention's online softmax (a
    running row maximum m and sum l; the output is rescaled by exp(m_old - m_new) when
    the maximum grows).  The band is applied only to the edge tiles.  The largest buffer
    is one (rows, keys) tile: memory O(T * Dv + S * D) for any S."""
    rows, keys = st.tile  # type: ignore[misc]
    q_p, k_p, v_p, bias, mask = _tiled_operands(st, q, k, v, bias, mask)
    ct, dv = q_p.dtype, v.shape[-1]

    def query_block(i: Array, done: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        r0 = (i * rows).astype(jnp.int32)
        q_b = jax.lax.dynamic_slice_in_dim(q_p, r0, rows)

        def step(edge: bool) -> Any:
            def body(t: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
                m, total, acc = carry
                c0 = (t * keys).astype(jnp.int32)
                k_t, v_t = jax.lax.dynamic_slice_in_dim(k_p, c0, keys), jax.lax.dynamic_slice_in_dim(v_p, c0, keys)
                _, z, z_scale, _, v_t = _tile_logits(st, q_b, k_t, v_t, bias, mask, length, r0, c0, edge)
                m_new = jnp.maximum(m, z.max(axis=-1, keepdims=True))
                m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: exp(-inf) = 0
                p = jnp.exp((z - m_sub) * z_scale)
                rescale = jnp.exp((m - m_sub) * z_scale)
                total = total * rescale + p.sum(axis=-1, keepdims=True)
                acc = acc * rescale + jnp.matmul(p, v_t, precision=st.precision)
                return m_new, total, acc
            return body

        first, inner_first, inner_last, last = _tile_ranges(st, r0)
        carry = (jnp.full((rows, 1), -jnp.inf, ct), jnp.zeros((rows, 1), ct), jnp.zeros((rows, dv), ct))
        carry = jax.lax.fori_loop(first, inner_first, step(True), carry)
        carry = jax.lax.fori_loop(inner_first, inner_last, step(False), carry)
        m, total, acc = jax.lax.fori_loop(inner_last, last, step(True), carry)
        out, row_max, row_sum = done
        out = jax.lax.dynamic_update_slice_in_dim(out, acc / jnp.where(total == 0, 1.0, total), r0, 0)
        row_max = jax.lax.dynamic_update_slice_in_dim(row_max, jnp.where(m == -jnp.inf, 0.0, m), r0, 0)
        row_sum = jax.lax.dynamic_update_slice_in_dim(row_sum, total, r0, 0)
        return out, row_max, row_sum

    t_pad = q_p.shape[0]
    done = (jnp.zeros((t_pad, dv), ct), jnp.zeros((t_pad, 1), ct), jnp.zeros((t_pad, 1), ct))
    out, row_max, row_sum = jax.lax.fori_loop(0, t_pad // rows, query_block, done)
    out, row_max, row_sum = out[: st.q_len], row_max[: st.q_len], row_sum[: st.q_len]
    return out.astype(v.dtype), (out, row_max, row_sum)


def _tiled_backward(st: _FlashStatic, residuals: Any, d_out: Array) -> tuple[Any, ...]:
    """``_slice_backward`` for long sequences, in the forward's loops: each tile's weights
    are recomputed from the saved row maximum and sum; dq is summed over a block's
    tiles, dk, dv (and a bias's gradient) are added into their tiles in place."""
    q, k, v, bias, mask, length, out_c, row_max, row_sum = residuals
    st = st._replace(tile=st.backward_tile)  # its own tile shape: the stats are per row, not per tile
    rows, keys = st.tile  # type: ignore[misc]
    q_p, k_p, v_p, bias_p, mask_p = _tiled_operands(st, q, k, v, bias, mask)
    ct, t_pad = q_p.dtype, q_p.shape[0]
    do = d_out.astype(ct)
    delta = _pad_to((do * out_c).sum(axis=-1, keepdims=True), t_pad, 0, broadcast=False)
    do, row_max, row_sum = (_pad_to(t, t_pad, 0, broadcast=False) for t in (do, row_max, row_sum))

    def query_block(i: Array, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        r0 = (i * rows).astype(jnp.int32)
        q_b, do_b, delta_b, m = (jax.lax.dynamic_slice_in_dim(a, r0, rows) for a in (q_p, do, delta, row_max))
        total = jax.lax.dynamic_slice_in_dim(row_sum, r0, rows)
        inv_total = 1.0 / jnp.where(total == 0, 1.0, total)

        def step(edge: bool) -> Any:
            def body(t: Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
                dq_b, dk, dv, d_bias = carry
                c0 = (t * keys).astype(jnp.int32)
                k_t, v_t = jax.lax.dynamic_slice_in_dim(k_p, c0, keys), jax.lax.dynamic_slice_in_dim(v_p, c0, keys)
                raw, z, z_scale, k_t, v_t = _tile_logits(st, q_b, k_t, v_t, bias_p, mask_p, length, r0, c0, edge)
                p = jnp.exp((z - m) * z_scale) * inv_total  # the forward's weights
                dv = _add_tile(dv, jnp.matmul(p.T, do_b, precision=st.precision), c0)
                g = p * (jnp.matmul(do_b, v_t.T, precision=st.precision) - delta_b)  # w.r.t. z * z_scale
                if d_bias is not None:
                    d_bias = _add_bias_tile(d_bias, g, r0, c0)
                if st.softcap is not None:  # z = cap(s * scale) + bias
                    g = g * (1.0 - jnp.tanh(raw * st.scale / st.softcap) ** 2)
                ds = g * st.scale
                dq_b = dq_b + jnp.matmul(ds, k_t, precision=st.precision)
                dk = _add_tile(dk, jnp.matmul(ds.T, q_b, precision=st.precision), c0)
                return dq_b, dk, dv, d_bias
            return body

        first, inner_first, inner_last, last = _tile_ranges(st, r0)
        dq, dk, dv, d_bias = grads
        carry = (jnp.zeros((rows, q_p.shape[-1]), ct), dk, dv, d_bias)
        carry = jax.lax.fori_loop(first, inner_first, step(True), carry)
        carry = jax.lax.fori_loop(inner_first, inner_last, step(False), carry)
        dq_b, dk, dv, d_bias = jax.lax.fori_loop(inner_last, last, step(True), carry)
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_b, r0, 0), dk, dv, d_bias

    grads = (jnp.zeros(q_p.shape, ct), jnp.zeros(k_p.shape, ct), jnp.zeros(v_p.shape, ct),
             None if bias_p is None else jnp.zeros(bias_p.shape, ct))
    dq, dk, dv, d_bias = jax.lax.fori_loop(0, t_pad // rows, query_block, grads)
    if d_bias is not None:
        d_bias = d_bias[: bias.shape[0], : bias.shape[1]]
    return dq[: st.q_len].astype(q.dtype), dk[: st.kv_len].astype(k.dtype), dv[: st.kv_len].astype(v.dtype), d_bias


def _add_tile(total: Array, g: Array, c0: Array) -> Array:
    """total[c0 : c0 + len(g)] += g, in place."""
    current = jax.lax.dynamic_slice_in_dim(total, c0, g.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(total, current + g, c0, 0)


def _add_bias_tile(total: Array, g: Array, r0: Array, c0: Array) -> Array:
    """Adds a tile's gradient into a (T or 1, S or 1) bias gradient at (r0, c0), summed
    over the bias's broadcast (size-1) dimensions."""
    if total.shape[0] == 1:
        g, r0 = g.sum(axis=0, keepdims=True), jnp.int32(0)
    if total.shape[1] == 1:
        g, c0 = g.sum(axis=1, keepdims=True), jnp.int32(0)
    current = jax.lax.dynamic_slice(total, (r0, c0), g.shape)
    return jax.lax.dynamic_update_slice(total, current + g, (r0, c0))


def _blockwise(
    q: Array, k: Array, v: Array, *, mask: Array | None, causal: bool, kv_lengths: Array | None,
    scale: float, precision: Precision, block_size: int | None = None, bias: Array | None = None,
    softcap: float | None = None, offset: int = 0, window: tuple[int | None, int | None] | None = None,
) -> Array:
    """The reference math one block of queries at a time.  A causal block of rows
    [r0, r1) needs only the keys [0, r1): the hidden upper triangle is never computed,
    and at most (block, S) scores exist at once.  Likewise a ``window`` (and a causal
    mask aligned at key ``offset``) restricts each block to the keys [lo, hi) within its
    reach (``key_range``); the blocks outside are skipped.

    Two forms, chosen by shape (``_blockwise_plan``; ``block_size`` forces the first):
    below ``_LONG_SEQUENCE`` keys, the loop over query blocks is unrolled (static shapes)
    and each block's scores against all keys in its reach exist at once; from it on,
    ``lax.fori_loop``s walk (rows, keys) tiles with FlashAttention's online softmax
    (``_tiled_forward``), so that the largest buffer is one tile.  Rows are normalised
    as in the reference path, except that the division by the row sum is applied to the
    (block, Dv) output instead of the (block, S) weights: one pass less over the scores,
    the same value up to rounding.  The gradient is FlashAttention's (``_flash``, a
    ``jax.custom_vjp``): the forward keeps only each row's maximum and sum, and the
    backward recomputes each block's scores from them, skipping the same blocks;
    training memory is O(T * D) per slice, never a (T, S) array.
    ``mask`` has q's rank (``canonical_mask``)."""
    lead, q_len, kv_len = q.shape[:-2], q.shape[-2], k.shape[-2]
    batch = math.prod(lead)
    block, tile, backward_tile = _blockwise_plan(q_len, kv_len)
    if block_size is not None:  # an explicit block: the unrolled form
        block, tile, backward_tile = block_size, None, None

    def slices(a: Array | None) -> Array | None:  # (..., T or 1, S or 1) -> (BH or 1, T or 1, S or 1)
        if a is None or all(d == 1 for d in a.shape[:-2]):  # None, or one for every slice
            return None if a is None else a.reshape(1, *a.shape[-2:])
        return jnp.broadcast_to(a, (*lead, *a.shape[-2:])).reshape(batch, *a.shape[-2:])

    length = None
    if kv_lengths is not None:  # (B,) -> one length per (batch, head) slice
        per_slice = kv_lengths.reshape((-1,) + (1,) * (len(lead) - 1))
        length = jnp.broadcast_to(per_slice, lead).reshape(batch)
    static = _FlashStatic(block, tile, backward_tile, causal, offset, window, scale, softcap, precision, q_len, kv_len)
    q_s, k_s, v_s = (t.reshape(batch, *t.shape[-2:]) for t in (q, k, v))
    out = _flash(static, q_s, k_s, v_s, slices(bias), slices(mask), length)  # (BH, T, Dv)
    return out.reshape(*lead, q_len, v.shape[-1])


# jax.nn.dot_product_attention (and the CPU kernel) cannot draw dropout.
FUSED_DRAWS_DROPOUT = False


class KVCache(NamedTuple):
    """Keys and values of earlier positions for decoding: key (B, Hkv, max_len, D), value
    (B, Hkv, max_len, Dv), and lengths (B,), how many positions of each example are
    filled.  A pytree of fixed shape: a jitted decode step takes it and returns the next
    one, so one compilation serves every position.  ``AttentionModule.init_cache``
    makes one; ``append_to_cache`` fills it.  A step that donates the cache
    (``nnx.jit(..., donate_argnums=...)``) consumes it: the caller holds only the cache
    it returns, none if the step fails (past ``max_len``: check the room before)."""

    key: Array
    value: Array
    lengths: Array


def cache_fields(cache: Any) -> Any:
    """(shape, dtype name) of each field, or None for something that is not a KVCache."""
    if not isinstance(cache, KVCache) or not all(hasattr(t, "shape") and hasattr(t, "dtype") for t in cache):
        return None
    return tuple((tuple(t.shape), dtype_name(t.dtype)) for t in cache)


def append_to_cache(cache: KVCache, k: Array, v: Array, lengths: Array) -> KVCache:
    """A new cache with k (B, Hkv, T, D) and v written at positions lengths .. lengths + T - 1
    of each example and its fill advanced by ``lengths`` (B,) (the valid tokens of this
    chunk; the rest, padding, is overwritten by the next call).  The caller checks that
    T positions fit first (``check_cache_room``): ``dynamic_update_slice`` would clamp."""

    def write(store: Array, new: Array, start: Array) -> Array:  # one example: (Hkv, L, D)
        return jax.lax.dynamic_update_slice(store, new.astype(store.dtype), (0, start, 0))

    key = jax.vmap(write)(cache.key, k, cache.lengths)
    value = jax.vmap(write)(cache.value, v, cache.lengths)
    return KVCache(key, value, cache.lengths + lengths.astype(cache.lengths.dtype))
