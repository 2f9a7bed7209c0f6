"""Mask helpers for JAX.  One polarity everywhere: bool, ``True`` = may attend.

Twin of ``torch_attention/masks.py``.  Shapes: a causal mask is (T, S); a padding mask is
(B, 1, 1, S) so that it broadcasts over heads and queries; ``combine_masks`` ands any
number of masks that broadcast together.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec import ADDITIVE_BIAS_MESSAGE, check_bool, check_floating, dtype_name
from attention_spec.masks import (
    ADDITIVE_BLOCKED_AT,
    HF_ATTENTION_MASK_VALUES_MESSAGE,
    check_hf_attention_mask,
    check_key_padding_mask,
    check_lengths_dtype,
    check_mask_lengths,
    check_masks_broadcast,
)
from attention_spec.positions import alibi_slopes

__all__ = [
    "alibi_bias",
    "causal_mask",
    "combine_masks",
    "from_additive_mask",
    "from_blocked_mask",
    "from_hf_attention_mask",
    "from_key_padding_mask",
    "padding_mask",
]


def causal_mask(q_len: int, kv_len: int | None = None, *, bottom_right: bool = False) -> Array:
    """(T, S) bool, query i may attend to key j <= i (top-left aligned).

    ``bottom_right=True`` aligns the last query with the last key, as when decoding with
    a cache of ``kv_len - q_len`` earlier keys: query i may attend to key j <= i + S - T.
    """
    kv_len = q_len if kv_len is None else kv_len
    check_mask_lengths(q_len, kv_len)
    offset = kv_len - q_len if bottom_right else 0
    return jnp.tril(jnp.ones((q_len, kv_len), dtype=jnp.bool_), k=offset)


def padding_mask(lengths: Array, kv_len: int) -> Array:
    """(B,) integer valid lengths -> (B, 1, 1, S) bool, True for key positions < length.

    Raises ``TypeError`` for lengths that are not integers (a fraction is a bug)."""
    lengths = jnp.asarray(lengths)
    check_lengths_dtype(dtype_name(lengths.dtype))
    check_mask_lengths(kv_len, kv_len)
    positions = jnp.arange(kv_len)
    return (positions[None, :] < lengths[:, None])[:, None, None, :]


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical and of the given masks (None entries are skipped); None if none given.
    Masks of lower rank get leading 1s, so (T, S) and (B, 1, 1, S) combine to (B, 1, T, S).
    Raises ``TypeError`` for a mask that is not bool, ``ValueError`` for shapes that do not
    broadcast together."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    check_masks_broadcast([m.shape for m in present], [dtype_name(m.dtype) for m in present])
    return _and_masks(*present)


def _and_masks(*masks: Array | None) -> Array | None:
    """``combine_masks`` without the checks, for the functional core's own (canonical)
    masks: no Python-level validation inside a compiled graph."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    ndim = max(m.ndim for m in present)
    present = [m.reshape((1,) * (ndim - m.ndim) + m.shape) for m in present]
    out = present[0]
    for m in present[1:]:
        out = out & m
    return out


def from_blocked_mask(blocked: Array) -> Array:
    """From ``nn.MultiheadAttention``'s ``attn_mask`` polarity (True = blocked) to ours
    (True = may attend), same shape.

    Shapes keep their meaning in our convention (broadcast from the right against
    (batch, heads, q_len, kv_len)): a 2-d mask is (q_len, kv_len), as ``attn_mask``; 4-d
    is (batch, heads, q_len, kv_len).  ``attn_mask``'s 3-d form (batch * heads, q_len,
    kv_len) must be reshaped to (batch, heads, q_len, kv_len) first.  A (batch, kv_len)
    ``key_padding_mask`` is not for this function (it would be read as (q_len, kv_len),
    silently so when batch == q_len): use ``from_key_padding_mask``.
    Raises ``TypeError`` for a mask that is not bool.
    """
    check_bool("blocked mask", dtype_name(blocked.dtype), "True = blocked")
    return ~blocked


def from_additive_mask(additive: Array) -> Array:
    """From an additive float mask (0 = attend, blocked = -inf or any value at or below
    -1e4 as rounded to the mask's dtype, such as -1e9 or ``finfo.min``) to a bool mask.

    Any other value is a bias, which a bool mask cannot hold, so it raises ``ValueError``
    rather than silently dropping it: eagerly, and under jit as a runtime error carrying
    the same text (from a callback; the mask's values are unknown while tracing).
    """
    check_floating("additive mask", dtype_name(additive.dtype))
    blocked = additive <= jnp.asarray(ADDITIVE_BLOCKED_AT, additive.dtype)
    _raise_if(jnp.any((additive != 0) & ~blocked), ADDITIVE_BIAS_MESSAGE)
    return ~blocked


def from_key_padding_mask(mask: Array) -> Array:
    """``nn.MultiheadAttention``'s ``key_padding_mask`` -- bool (batch, kv_len), True = ignore
    this key -- to ours: (batch, 1, 1, kv_len) bool, True = may attend.

    Raises ``ValueError`` for any other rank (a (q_len, kv_len) mask is ``from_blocked_mask``'s)
    and ``TypeError`` for a non-bool mask.  A float ``key_padding_mask``, which
    ``nn.MultiheadAttention`` adds to the scores, is refused rather than guessed at: convert
    it with ``from_additive_mask(mask)[:, None, None, :]``.  For unbatched input
    (``nn.MultiheadAttention``'s (kv_len,) form) convert ``mask[None]`` and take ``[0]``.
    """
    mask = jnp.asarray(mask)
    check_key_padding_mask(mask.shape, dtype_name(mask.dtype))
    return (~mask)[:, None, None, :]


def from_hf_attention_mask(mask: Array) -> Array:
    """A Hugging Face ``attention_mask`` -- integer (or bool) (batch, seq), 1 = attend,
    0 = padding, as tokenizers return it -- to ours: (batch, 1, 1, seq) bool, True = may
    attend.  Combine it with the causal mask yourself, or let a causal module do it.

    Raises ``ValueError`` for a rank other than 2 or values other than 0 and 1, and
    ``TypeError`` for a float mask (in an additive mask 0 means attend: use
    ``from_additive_mask`` for those).  Values are checked eagerly, and under jit as a
    runtime error carrying the same text (from a callback, as ``from_additive_mask``).
    """
    mask = jnp.asarray(mask)
    check_hf_attention_mask(mask.shape, dtype_name(mask.dtype))
    if mask.dtype != jnp.bool_:
        _raise_if(jnp.any((mask != 0) & (mask != 1)), HF_ATTENTION_MASK_VALUES_MESSAGE)
    return (mask != 0)[:, None, None, :]


def _raise_if(bad: Array, message: str) -> None:
    """``ValueError(message)`` if ``bad``: eagerly at once; under tracing from a callback
    when the computation runs (JAX then reports it wrapped in its runtime error)."""
    if isinstance(bad, jax.core.Tracer):
        def callback(flag: Any) -> None:
            if bool(flag):
                raise ValueError(message)
        jax.debug.callback(callback, bad)
    elif bool(bad):
        raise ValueError(message)


def alibi_bias(num_heads: int, q_len: int, kv_len: int | None = None) -> Array:
    """ALiBi (Press et al.): (1, H, T, S) float32, ``bias[0, h, i, j] = slope_h * (j - i)``
    for query i and key j (top-left aligned, as ``causal_mask``): 0 on the diagonal,
    more negative the further back a key lies.  Pass it as ``bias=``.  The slopes are
    ``attention_spec.positions.alibi_slopes`` (2^(-8 i / H) for H a power of two).
    Raises TypeError / ValueError for lengths or a head count that are not positive ints.
    """
    kv_len = q_len if kv_len is None else kv_len
    check_mask_lengths(q_len, kv_len)
    slopes = jnp.asarray(alibi_slopes(num_heads), dtype=jnp.float32)
    distance = (jnp.arange(kv_len)[None, :] - jnp.arange(q_len)[:, None]).astype(jnp.float32)
    return (slopes[:, None, None] * distance[None])[None]
