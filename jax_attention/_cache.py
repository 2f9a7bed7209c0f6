"""The key/value cache for decoding: a fixed-shape pytree (``KVCache``) and its update
(``append_to_cache``), re-exported by ``functional``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import Array

from attention_spec import dtype_name


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
