"""The attention math, once, for JAX.  ``torch_attention/functional.py`` is its twin.

Dimension legend (the same names on both sides):
  B: batch          H: heads          T / q_len: queries      S / kv_len: keys and values
  D: head_dim (query/key width)       Dv: value width

Masks are bool, ``True`` = may attend, broadcastable to ``(B, H, T, S)`` (or to the
leading dimensions that ``q`` has).  A query row that may attend to nothing gets zero
weights and a zero output, never NaN, with finite gradients.

Precision: matmuls run at ``precision="highest"`` by default (JAX's GPU/TPU default is
lower; PyTorch keeps TF32 off), scores and values are multiplied in the input dtype;
scaling, masking and normalisation run in float32 for float16/bfloat16 inputs (float64
stays float64); the weights are cast back to the input dtype before they mix the values.
Everything here is jit-compatible; options are Python values (static under jit).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec import (
    check_dropout_mask,
    check_dropout_rate,
    check_implementation,
    check_mask,
    check_mask_strategy,
    check_normalization,
    check_qkv,
    check_scale,
    dtype_name,
    zero_row_sum_message,
)
from jax_attention.masks import causal_mask

__all__ = [
    "attention_scores",
    "attention_weights",
    "dot_product_attention",
    "dropout_weights",
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


def attention_scores(q: Array, k: Array, scale: float, *, precision: Precision = "highest") -> Array:
    """``scale * q @ k^T``: (..., T, D), (..., S, D) -> (..., T, S) in the compute dtype."""
    scores = jnp.matmul(q, jnp.swapaxes(k, -2, -1), precision=precision)  # (..., T, S)
    return scores.astype(_compute_dtype(q.dtype)) * scale


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
    divides by the new row sum (seed 004).  Both give zeros for a fully masked row.
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

    if mask is None:
        return _softmax(scores)
    if mask_strategy == "fill":
        return _softmax(jnp.where(mask, scores, -jnp.inf))
    weights = jnp.where(mask, _softmax(scores), 0.0)
    return _safe_divide(weights, weights.sum(axis=-1, keepdims=True))


def _raise_if(bad: Array, message: str) -> None:
    if isinstance(bad, jax.core.Tracer):
        def callback(flag: Any) -> None:
            if bool(flag):
                raise ValueError(message)
        jax.debug.callback(callback, bad)
    elif bool(bad):
        raise ValueError(message)


def _softmax(scores: Array) -> Array:
    # A row of -inf (nothing to attend to) has max -inf; subtracting 0 instead keeps
    # exp() at exactly 0 and the division below turns 0/0 into 0, gradients finite.
    row_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalized = jnp.exp(scores - row_max)
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
) -> Array:
    """Weights (..., T, S) from q (..., T, D) and k (..., S, D), before dropout."""
    scores = attention_scores(q, k, resolve_scale(scale, q.shape[-1]), precision=precision)
    mask = _combine(mask, causal, q.shape[-2], k.shape[-2], scores.ndim)
    return normalize_scores(scores, mask, mask_strategy=mask_strategy, normalization=normalization)


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
    scale: float | None = None,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    dropout_rate: float = 0.0,
    dropout_mask: Array | None = None,
    deterministic: bool = True,
    rng: Array | None = None,
    return_weights: bool = False,
    implementation: str = "reference",
    precision: Precision = "highest",
) -> Array | tuple[Array, Array]:
    """Attention over q (..., T, D), k (..., S, D), v (..., S, Dv) -> (..., T, Dv).

    Args:
      mask: bool, True = may attend, broadcastable to (..., T, S).
      causal: also block keys after the query (top-left aligned ``tril``).
      scale: None = 1/sqrt(D); a float as given.
      dropout_rate, deterministic, rng, dropout_mask: dropout on the weights, see
        ``dropout_weights``.
      return_weights: also return the weights that mixed the values (after dropout).
      precision: of the two matmuls; "highest" by default.

    Raises:
      ValueError / TypeError: inconsistent shapes or dtypes, a mask that is not bool or
        does not broadcast, a bad option value; all before any computation.
    """
    check_qkv(q.shape, k.shape, v.shape, (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype)))
    weights_shape = (*q.shape[:-1], k.shape[-2])
    if mask is not None:
        check_mask(mask.shape, dtype_name(mask.dtype), weights_shape)
    if dropout_mask is not None:
        check_dropout_mask(
            dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape,
            training=not deterministic,
        )
    check_dropout_rate(dropout_rate)
    check_scale(scale)
    check_mask_strategy(mask_strategy)
    check_normalization(normalization)
    check_implementation(implementation)

    weights = attention_weights(
        q, k, mask=mask, causal=causal, scale=scale, mask_strategy=mask_strategy,
        normalization=normalization, precision=precision,
    )
    weights = dropout_weights(
        weights, dropout_rate, deterministic=deterministic, rng=rng, dropout_mask=dropout_mask
    )
    weights = weights.astype(v.dtype)
    out = jnp.matmul(weights, v, precision=precision)  # (..., T, Dv)
    return (out, weights) if return_weights else out
