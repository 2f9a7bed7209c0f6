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
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import Array

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
from jax_attention.masks import causal_mask, combine_masks

__all__ = [
    "attention_scores",
    "attention_weights",
    "default_block_size",
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
    kv_lengths: Array | None = None,
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
) -> Array | tuple[Array, Array]:
    """Attention over q (..., T, D), k (..., S, D), v (..., S, Dv) -> (..., T, Dv).

    Args:
      mask: bool, True = may attend, broadcastable to (..., T, S).
      causal: also block keys after the query (top-left aligned ``tril``).
      kv_lengths: int (B,), the number of valid keys per example (padding given as
        lengths, which fused kernels take natively); needs q of shape (B, H, T, D).
      scale: None = 1/sqrt(D); a float as given.
      dropout_rate, deterministic, rng, dropout_mask: dropout on the weights, see
        ``dropout_weights``.
      return_weights: also return the weights that mixed the values (after dropout).
      implementation: ``"reference"`` (the explicit math), ``"fused"``
        (``jax.nn.dot_product_attention``: cuDNN for half precision on NVIDIA GPUs, XLA
        elsewhere; Pallas splash attention on TPU), ``"blockwise"`` (query blocks that
        skip the keys a causal mask hides; never materialises T x S), or ``"auto"``
        (fused on GPU/TPU, blockwise on CPU, reference where those cannot honour an
        option; see ``attention_spec.resolve_implementation``).
      precision: of the matmuls; "highest" by default.

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
            dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape,
            training=not deterministic,
        )
    check_dropout_rate(dropout_rate)
    check_scale(scale)
    check_mask_strategy(mask_strategy)
    check_normalization(normalization)
    path = resolve_implementation(
        implementation,
        # On CPU, XLA's fused attention is slower than the explicit math; blockwise is faster.
        preference=("fused", "blockwise") if jax.default_backend() in ("gpu", "tpu") else ("blockwise",),
        return_weights=return_weights,
        normalization=normalization,
        dropout_active=not deterministic and dropout_rate > 0.0,
        dropout_mask_given=dropout_mask is not None,
        fused_draws_dropout=False,
        fused_blockers=() if v.shape[-1] == q.shape[-1] else ("a value width different from the key width",),
    )
    scale = resolve_scale(scale, q.shape[-1])
    if path == "fused":
        return _fused(q, k, v, mask=mask, causal=causal, kv_lengths=kv_lengths, scale=scale,
                      precision=precision)
    if path == "blockwise":
        return _blockwise(q, k, v, mask=mask, causal=causal, kv_lengths=kv_lengths, scale=scale,
                          precision=precision)

    mask = combine_masks(mask, None if kv_lengths is None else _length_mask(kv_lengths, k.shape[-2], q.ndim))
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


def _length_mask(kv_lengths: Array, kv_len: int, ndim: int) -> Array:
    # (B,) -> (B, 1, ..., 1, S): key positions before each example's length
    valid = jnp.arange(kv_len)[None, :] < kv_lengths[:, None]
    return valid.reshape(valid.shape[:1] + (1,) * (ndim - 2) + valid.shape[1:])


def _fused(
    q: Array, k: Array, v: Array, *, mask: Array | None, causal: bool, kv_lengths: Array | None,
    scale: float, precision: Precision,
) -> Array:
    """``jax.nn.dot_product_attention`` on (..., H, T, D) inputs, with this library's
    fully-masked-row policy (zeros, finite gradients) and causal/padding passed to the
    kernel as ``is_causal`` / sequence lengths rather than dense masks."""
    lead = q.shape[:-3] if q.ndim >= 3 else ()
    heads = q.shape[-3] if q.ndim >= 3 else 1
    batch = math.prod(lead)

    def bthd(t: Array) -> Array:  # (..., H, T, D) -> (B, T, H, D)
        return jnp.swapaxes(t.reshape(batch, heads, *t.shape[-2:]), 1, 2)

    live = None  # (B, H, T, 1): rows with something to attend to, when some may have none
    dense = None
    if mask is not None:
        dense = _expand_to(mask, q.ndim)
        dense = jnp.broadcast_to(dense, (*dense.shape[:-2], q.shape[-2], k.shape[-2]))
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
    if jax.default_backend() == "tpu" and dense is None and kv_lengths is None and splash_supports(q, k, v):
        return splash_attention(q, k, v, causal=causal, scale=scale)
    half = q.dtype in (jnp.bfloat16, jnp.float16)
    kernel: Literal["xla", "cudnn"] = "cudnn" if jax.default_backend() == "gpu" and half else "xla"
    with jax.default_matmul_precision(_precision_name(precision)):
        out = jax.nn.dot_product_attention(
            bthd(q), bthd(k), bthd(v), mask=dense, scale=scale, is_causal=causal,
            key_value_seq_lengths=lengths, implementation=kernel,
        )
    out = jnp.swapaxes(out, 1, 2).reshape(*q.shape[:-1], v.shape[-1])  # (..., H, T, Dv)
    return out if live is None else jnp.where(live, out, jnp.zeros((), out.dtype))


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


def _blockwise(
    q: Array, k: Array, v: Array, *, mask: Array | None, causal: bool, kv_lengths: Array | None,
    scale: float, precision: Precision, block_size: int | None = None,
) -> Array:
    """The reference math one block of queries at a time.  A causal block of rows
    [r0, r1) needs only the keys [0, r1): the hidden upper triangle is never computed,
    and at most (block, S) scores exist at once.

    The (batch, heads) slices go through ``lax.map`` one at a time, each a sequence of
    plain 2-d matrix products: on XLA's CPU backend these run about 1.6x faster than the
    same products batched over (batch x heads) (measured in benchmarks/profile_cpu.py).
    Within a slice the loop over query blocks is unrolled (static shapes; everything is
    differentiable).  Rows are normalised as in the reference path, except that the
    division by the row sum is applied to the (block, Dv) output instead of the
    (block, S) weights: one pass less over the scores, the same value up to rounding."""
    lead, q_len, kv_len = q.shape[:-2], q.shape[-2], k.shape[-2]
    batch = math.prod(lead)
    block = block_size or default_block_size(q_len)
    ct = _compute_dtype(q.dtype)
    slices: dict[str, Array] = {
        name: t.reshape(batch, *t.shape[-2:]) for name, t in (("q", q), ("k", k), ("v", v))
    }
    shared_mask = None  # the same (T or 1, S or 1) mask for every slice
    if mask is not None:
        mask = _expand_to(mask, q.ndim)
        if all(d == 1 for d in mask.shape[:-2]):
            shared_mask = mask.reshape(mask.shape[-2:])
        else:  # one mask per (batch, head) slice
            slices["mask"] = jnp.broadcast_to(mask, (*lead, *mask.shape[-2:])).reshape(batch, *mask.shape[-2:])
    if kv_lengths is not None:  # (B,) -> one length per (batch, head) slice
        per_slice = kv_lengths.reshape((-1,) + (1,) * (len(lead) - 1))
        slices["length"] = jnp.broadcast_to(per_slice, lead).reshape(batch)

    def one_slice(t: dict[str, Array]) -> Array:
        outputs = []
        for r0 in range(0, q_len, block):
            r1 = min(r0 + block, q_len)
            n = min(r1, kv_len) if causal else kv_len  # keys this block can see
            scores = jnp.matmul(t["q"][r0:r1], t["k"][:n].T, precision=precision)
            scores = scores.astype(ct) * scale  # (r1 - r0, n)
            allowed = None
            for m in (shared_mask, t.get("mask")):
                if m is not None:  # a broadcast (size-1) dimension stays size 1 under the slice
                    m = m[r0:r1, :n] if m.shape[0] > 1 else m[:, :n]
                    allowed = m if allowed is None else allowed & m
            if causal:
                tri = jnp.arange(n)[None, :] <= jnp.arange(r0, r1)[:, None]
                allowed = tri if allowed is None else allowed & tri
            if "length" in t:
                valid = (jnp.arange(n) < t["length"])[None, :]
                allowed = valid if allowed is None else allowed & valid
            if allowed is not None:
                scores = jnp.where(allowed, scores, -jnp.inf)
            row_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
            row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
            unnormalized = jnp.exp(scores - row_max)
            row_sum = unnormalized.sum(axis=-1, keepdims=True)
            mixed = jnp.matmul(unnormalized.astype(v.dtype), t["v"][:n], precision=precision)
            outputs.append((mixed.astype(ct) / jnp.where(row_sum == 0, 1.0, row_sum)).astype(v.dtype))
        return jnp.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]

    out = jax.lax.map(one_slice, slices)  # (BH, T, Dv)
    return out.reshape(*lead, q_len, v.shape[-1])
