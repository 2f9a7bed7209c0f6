"""The reference path: the explicit math, scores -> weights -> dropout -> mix, with the
whole (T, S) weights at once.  ``functional`` re-exports its public steps
(``attention_scores``, ``normalize_scores``, ``attention_weights``, ``dropout_weights``);
the blockwise paths read its scale (``adjust``) and its stable softmax's order.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec import check_mask_strategy, dtype_name, zero_row_sum_message
from attention_spec.arrays import check_sinks
from jax_attention._canonical import bias_allows, compute_dtype, expand_to, length_mask
from jax_attention._online_softmax import with_sinks
from jax_attention.masks import _and_masks as combine_masks
from jax_attention.masks import _raise_if, causal_mask

Precision = Any  # None, a string such as "highest", or a jax.lax.Precision


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``None`` -> 1/sqrt(head_dim); a float is used as given (1.0 = unscaled)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def adjust(scores: Array, bias: Array | None, softcap: float | None) -> Array:
    """Scaled scores -> ``softcap * tanh(s / softcap)``, then ``+ bias`` (in the scores'
    compute dtype: a half-precision bias is added in float32)."""
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if bias is not None:
        scores = scores + expand_to(bias, scores.ndim).astype(scores.dtype)
    return scores


def attention_scores(q: Array, k: Array, scale: float, *, precision: Precision = "highest") -> Array:
    """``scale * q @ k^T``: (..., T, D), (..., S, D) -> (..., T, S) in the compute dtype
    (q and k are upcast first: half-precision scores would overflow or lose digits)."""
    return raw_scores(q, k, precision) * scale


def raw_scores(q: Array, k: Array, precision: Precision) -> Array:
    ct = compute_dtype(q.dtype)
    return jnp.matmul(q.astype(ct), jnp.swapaxes(k.astype(ct), -2, -1), precision=precision)  # (..., T, S)


def normalize_scores(
    scores: Array,
    mask: Array | None = None,
    *,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    sinks: Array | None = None,
) -> Array:
    """Scores (..., T, S) -> weights (..., T, S), each row summing to 1 or 0 (less than
    1 with ``sinks``).

    ``mask_strategy="fill"`` sets masked scores to -inf before the softmax;
    ``"renormalize"`` takes the softmax over every key, zeroes the masked weights and
    divides by the new row sum (seed 004).  In exact arithmetic the two are equal, so
    both are computed as the stable ``"fill"`` (the row maximum over the visible keys):
    the literal renormalisation underflows to a zero row when a hidden key's logit is
    about 104 above the visible ones.  Both give zeros for a fully masked row.
    ``normalization="sum"`` divides the (masked) scores by their row sum instead of a
    softmax, and raises ``ValueError`` where a row with something to attend to sums to 0
    (eagerly; under jit the same text arrives as a runtime error from a callback).
    ``sinks`` (H,), the scores being (..., H, T, S): one logit per head that joins each
    softmax's denominator (``softmax``); ``check_sinks`` refuses them with ``"sum"``.
    """
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        check_sinks(sinks.shape, dtype_name(sinks.dtype), scores.shape, normalization)
    if mask is not None:
        mask = expand_to(mask, scores.ndim)
    if normalization == "sum":
        kept = scores if mask is None else jnp.where(mask, scores, 0.0)
        row_sum = kept.sum(axis=-1, keepdims=True)
        live = True if mask is None else mask.any(axis=-1, keepdims=True)
        _raise_if(jnp.any((row_sum == 0) & live), zero_row_sum_message())
        return safe_divide(kept, row_sum)

    return softmax(scores, mask, sinks=sinks)


def unnormalized(scores: Array, mask: Array | None, scale: float) -> Array:
    """exp(scale * (scores - row max)) over the keys ``mask`` lets through (``scale > 0``).

    The maximum is that of the unscaled scores, and the subtraction comes before the
    scaling, so no multiply-add can be fused across it: the largest score gives exactly
    exp(0) whatever XLA fuses."""
    scores, row_max = _masked_max(scores, mask)
    return jnp.exp((scores - row_max) * scale)


def _masked_max(scores: Array, mask: Array | None) -> tuple[Array, Array]:
    """(scores with the masked ones at -inf, their row maximum, without gradient)."""
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    if mask is not None:
        # A row with nothing to attend to (known from the mask) subtracts 0: exp(-inf)
        # stays exactly 0 and the division by the row sum turns 0/0 into 0.
        row_max = jnp.where(mask.any(axis=-1, keepdims=True), row_max, 0.0)
    return scores, row_max


def softmax(scores: Array, mask: Array | None, scale: float = 1.0, sinks: Array | None = None) -> Array:
    """The stable softmax of ``scores * scale`` over the keys ``mask`` lets through;
    ``sinks`` (H,) join each row's denominator of head h (scores (..., H, T, S)) as
    ``exp(sink_h)``, in the units of the scaled scores (``with_sinks``)."""
    if sinks is None:
        weights = unnormalized(scores, mask, scale)
        return safe_divide(weights, weights.sum(axis=-1, keepdims=True))
    scores, row_max = _masked_max(scores, mask)
    weights = jnp.exp((scores - row_max) * scale)
    sink = expand_to(sinks.astype(scores.dtype).reshape(-1, 1, 1), scores.ndim)
    keys, sink_weight = with_sinks(row_max * scale, sink)
    return safe_divide(weights * keys, weights.sum(axis=-1, keepdims=True) * keys + sink_weight)


def safe_divide(weights: Array, row_sum: Array) -> Array:
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
        # Drawn flat and reshaped: the same bits as a draw of weights.shape (every key
        # implementation counts over the flat index), and XLA's CPU compiler takes 6-12x
        # less time over one axis than over four (0.3 s against 1.9-4.2 s, measured).
        flat = jax.random.bernoulli(rng, 1.0 - rate, (math.prod(weights.shape),))
        dropout_mask = flat.reshape(weights.shape)
    keep = expand_to(dropout_mask, weights.ndim).astype(weights.dtype)
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
    sinks: Array | None = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> Array:
    """Weights (..., T, S) from q (..., T, D) and k (..., S, D), before dropout.
    ``bias`` (broadcastable to (..., T, S)) is added to the scaled, soft-capped scores;
    ``sinks`` (H,), q being (..., H, T, D), join each softmax's denominator, one logit per
    query head in the units of the final scores (the rows then sum to less than 1).
    ``score_mod`` / ``mask_mod`` (a module's mods, seeing the indices of q (B, H, T, D)
    and k: ``index_arrays``): the score mod after the bias, the mask mod with the
    mask (and a score it makes -inf blocks its key)."""
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        check_sinks(sinks.shape, dtype_name(sinks.dtype), q.shape, normalization)
        sinks = sinks.astype(compute_dtype(q.dtype))
    scale = resolve_scale(scale, q.shape[-1])
    raw = raw_scores(q, k, precision)
    mask = _combine(mask, causal, q.shape[-2], k.shape[-2], raw.ndim)
    if bias is not None:  # a -inf entry blocks its key
        mask = combine_masks(mask, expand_to(bias_allows(bias), raw.ndim))
    if score_mod is not None or mask_mod is not None:
        scores, mask = _modded(adjust(raw * scale, bias, softcap), mask, q, k, score_mod, mask_mod)
        if normalization == "sum":
            return normalize_scores(scores, mask, normalization=normalization)
        return softmax(scores, mask, sinks=sinks)
    if normalization == "sum":
        return normalize_scores(adjust(raw * scale, bias, softcap), mask, normalization=normalization)
    check_mask_strategy(mask_strategy)  # "renormalize" equals "fill" (see normalize_scores)
    if bias is not None or softcap is not None:
        return softmax(adjust(raw * scale, bias, softcap), mask, sinks=sinks)
    return softmax(raw, mask, scale, sinks=sinks)


def index_arrays(q: Array, k: Array) -> tuple[Array, Array, Array, Array]:
    """(b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, T, 1), kv_idx (1, 1, 1, S)), int32: the
    indices a mod takes for every score of q (B, H, T, D) against k (..., S, D)."""
    batch, heads, q_len = q.shape[:3]
    kv_len = k.shape[-2]
    return (jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1),
            jnp.arange(heads, dtype=jnp.int32).reshape(1, heads, 1, 1),
            jnp.arange(q_len, dtype=jnp.int32).reshape(1, 1, q_len, 1),
            jnp.arange(kv_len, dtype=jnp.int32).reshape(1, 1, 1, kv_len))


def _modded(scores: Array, mask: Array | None, q: Array, k: Array, score_mod: Any,
            mask_mod: Any) -> tuple[Array, Array | None]:
    """The final scores (B, H, T, S) and mask with a module's mods applied."""
    b, h, q_idx, kv_idx = index_arrays(q, k)
    if mask_mod is not None:
        mask = combine_masks(mask, jnp.broadcast_to(mask_mod(b, h, q_idx, kv_idx), scores.shape))
    if score_mod is not None:
        scores = jnp.broadcast_to(score_mod(scores, b, h, q_idx, kv_idx), scores.shape).astype(scores.dtype)
        mask = combine_masks(mask, scores != -jnp.inf)
    return scores, mask


def _combine(mask: Array | None, causal: bool, q_len: int, kv_len: int, ndim: int) -> Array | None:
    if mask is not None:
        mask = expand_to(mask, ndim)
    if not causal:
        return mask
    tril = expand_to(causal_mask(q_len, kv_len), ndim)
    return tril if mask is None else mask & tril


def reference_mask(mask: Array | None, kv_lengths: Array | None, kv_len: int, ndim: int) -> Array | None:
    """The mask for ``attention_weights``: ``mask`` and the lengths.  A window, an offset
    and per-example positions reach this path as a dense mask already
    (``_canonical.structure``): its own causal mask is top-left aligned."""
    return combine_masks(mask, None if kv_lengths is None else length_mask(kv_lengths, kv_len, ndim))


def mix(weights: Array, v: Array, precision: Precision, return_weights: bool) -> Array | tuple[Array, Array]:
    """weights @ v, mixed in the compute dtype (half-precision weights would add a
    rounding per weight), in v's dtype; with ``return_weights`` also the weights."""
    out = jnp.matmul(weights, v.astype(weights.dtype), precision=precision).astype(v.dtype)  # (..., T, Dv)
    return (out, weights.astype(v.dtype)) if return_weights else out
