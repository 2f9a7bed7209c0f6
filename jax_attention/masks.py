"""Mask helpers for JAX.  One polarity everywhere: bool, ``True`` = may attend.

Twin of ``torch_attention/masks.py``.  Shapes: a causal mask is (T, S); a padding mask is
(B, 1, 1, S) so that it broadcasts over heads and queries; ``combine_masks`` ands any
number of masks that broadcast together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec import ADDITIVE_BIAS_MESSAGE, check_bool, check_floating, dtype_name

__all__ = [
    "causal_mask",
    "combine_masks",
    "from_additive_mask",
    "from_blocked_mask",
    "padding_mask",
]


def causal_mask(q_len: int, kv_len: int | None = None, *, bottom_right: bool = False) -> Array:
    """(T, S) bool, query i may attend to key j <= i (top-left aligned).

    ``bottom_right=True`` aligns the last query with the last key, as when decoding with
    a cache of ``kv_len - q_len`` earlier keys: query i may attend to key j <= i + S - T.
    """
    kv_len = q_len if kv_len is None else kv_len
    offset = kv_len - q_len if bottom_right else 0
    return jnp.tril(jnp.ones((q_len, kv_len), dtype=jnp.bool_), k=offset)


def padding_mask(lengths: Array, kv_len: int) -> Array:
    """(B,) valid lengths -> (B, 1, 1, S) bool, True for key positions < length."""
    positions = jnp.arange(kv_len)
    return (positions[None, :] < lengths[:, None])[:, None, None, :]


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical and of the given masks (None entries are skipped); None if none given.
    Masks of lower rank get leading 1s, so (T, S) and (B, 1, 1, S) combine to (B, 1, T, S)."""
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
    """From ``nn.MultiheadAttention`` polarity (True = blocked) to ours (True = may attend)."""
    check_bool("blocked mask", dtype_name(blocked.dtype), "True = blocked")
    return ~blocked


def from_additive_mask(additive: Array) -> Array:
    """From an additive float mask (0 = attend, -inf = blocked) to a bool mask.

    Values at or below the dtype's lowest finite number count as blocked (some libraries
    use that instead of -inf).  Any other non-zero value is a bias, which a bool mask
    cannot hold, so it raises ``ValueError`` rather than silently dropping it (checked
    eagerly; under jit the values are unknown and the check is skipped).
    """
    check_floating("additive mask", dtype_name(additive.dtype))
    blocked = additive <= jnp.finfo(additive.dtype).min
    lossy = jnp.any((additive != 0) & ~blocked)
    if not isinstance(lossy, jax.core.Tracer) and bool(lossy):
        raise ValueError(ADDITIVE_BIAS_MESSAGE)
    return ~blocked
