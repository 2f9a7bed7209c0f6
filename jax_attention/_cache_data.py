"""The key/value cache for decoding, its data: a fixed-shape pytree (``KVCache``), its
guarded update (``append_to_cache``), re-exported by ``functional``, an eager call's room
check, and attention over the filled part of it (``over_filled``, in buckets of
``fill_buckets``).  Cached decoding, the strategy that uses them, is ``_cache``'s.

Twin of ``torch_attention/_cache_data.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec import dtype_name
from attention_spec.cache import check_cache_overflow_record, check_cache_room

# The smallest number of positions a cached step attends over (``fill_buckets``).
_SMALLEST_BUCKET = 128


class KVCache(NamedTuple):
    """Keys and values of earlier positions for decoding: key (B, Hkv, max_len, D), value
    (B, Hkv, max_len, Dv), lengths (B,), how many positions of each example are filled,
    and overflow (2,) int32, zeros, or ``(fill, new)`` of the first jitted step that ran
    past ``max_len``.  A pytree of fixed shape: a jitted decode step takes it and returns
    the next one, so one compilation serves every position.  ``AttentionModule.init_cache``
    makes one; ``append_to_cache`` fills it.

    Running past ``max_len`` raises a ValueError before any work in an eager call.  A
    jitted step cannot raise without a host round trip, so it records the error instead:
    it writes nothing, leaves ``lengths`` as they were, returns NaN outputs, and sets
    ``overflow``; every later step on that cache does the same, and the next eager use
    (a call, or ``check()``) raises the eager ValueError, its text included.  A step that
    donates the cache (``nnx.jit(..., donate_argnums=...)``) updates its buffers in
    place and consumes it: the caller holds only the cache it returns (which, after an
    overflow, holds the record).  A cache built by hand without ``overflow`` (None) is
    taken as one without a record."""

    key: Array
    value: Array
    lengths: Array
    overflow: Array | None = None

    def check(self) -> KVCache:
        """The cache itself, eagerly checked: raises the ValueError of the step that ran
        past ``max_len`` under jit (the eager text, ``check_cache_room``'s) if one did.
        Reads two integers from the device; not for use under jit."""
        if self.overflow is not None:
            fill, new = (int(n) for n in self.overflow)
            check_cache_overflow_record(fill, new, int(self.key.shape[2]))
        return self


def cache_fields(cache: Any) -> Any:
    """(shape, dtype name) of key, value and lengths, then of the overflow record (None
    where the cache has none), or None for something that is not a KVCache."""
    if not isinstance(cache, KVCache) or not all(
            hasattr(t, "shape") and hasattr(t, "dtype") for t in cache if t is not None):
        return None
    return tuple(None if t is None else (tuple(t.shape), dtype_name(t.dtype)) for t in cache)


def check_room(cache: KVCache, new: int, max_len: int) -> None:
    """An eager call's room check: the record of an earlier jitted overflow, then whether
    ``new`` positions fit after the fullest example's fill (``check_cache_room``).  Under
    jit (traced fields) nothing is read: ``append_to_cache`` guards the step instead."""
    if isinstance(cache.lengths, jax.core.Tracer):
        return
    cache.check()
    check_cache_room(int(jnp.max(cache.lengths)), new, max_len)


def append_to_cache(cache: KVCache, k: Array, v: Array, lengths: Array) -> tuple[KVCache, Array]:
    """k (B, Hkv, T, D) and v written at positions lengths .. lengths + T - 1 of each
    example, its fill advanced by ``lengths`` (B,) (the valid tokens of this chunk; the
    rest, padding, is overwritten by the next call); and whether the step fits.

    A step that does not fit (T positions past the fullest fill exceed max_len, or the
    cache holds an overflow record) writes nothing (each write puts back what it read),
    keeps the fill, and records ``(fill, T)`` unless a record is there: the eager check
    that refuses such a call cannot run under jit.  Written with ``dynamic_update_slice``
    on the cache's own buffers, so a donated cache is updated in place."""
    seq, max_len = k.shape[2], cache.key.shape[2]
    fullest = jnp.max(cache.lengths)
    record = jnp.zeros((2,), jnp.int32) if cache.overflow is None else cache.overflow.astype(jnp.int32)
    ok = (fullest + seq <= max_len) & (record[1] == 0)

    def write(store: Array, new: Array, start: Array) -> Array:  # one example: (Hkv, L, D)
        # (the indices in one dtype, the fill's: a Python 0 is int64 under jax_enable_x64)
        where = (jnp.zeros((), start.dtype), start, jnp.zeros((), start.dtype))
        old = jax.lax.dynamic_slice(store, where, new.shape)  # the same clamped window
        return jax.lax.dynamic_update_slice(store, jnp.where(ok, new.astype(store.dtype), old), where)

    key = jax.vmap(write)(cache.key, k, cache.lengths)
    value = jax.vmap(write)(cache.value, v, cache.lengths)
    fill = cache.lengths + jnp.where(ok, lengths.astype(cache.lengths.dtype), 0)
    failed = jnp.stack([fullest.astype(jnp.int32), jnp.int32(seq)])
    record = jnp.where(ok | (record[1] != 0), record, failed)
    return KVCache(key, value, fill, record), ok


def fill_buckets(max_len: int) -> tuple[int, ...]:
    """The numbers of positions a cached step may attend over: 128, 256, ... doubling
    below ``max_len``, then ``max_len``; one bucket for a cache of at most 128."""
    sizes, n = [], _SMALLEST_BUCKET
    while n < max_len:
        sizes.append(n)
        n *= 2
    return (*sizes, max_len)


def over_filled(run: Callable[[int], Any], filled: Array, max_len: int, sizes: Sequence[int] | None = None) -> Any:
    """``run(n)``, the attention of a cached step over the first n positions of the cache,
    for the smallest bucket n (``fill_buckets``) that holds ``filled`` (the fullest
    example's fill after the write): a ``lax.switch`` over one compiled branch per bucket,
    so a step costs what its fill costs, not ``max_len`` (eagerly, the branch alone, chosen
    in Python).  Positions past each example's
    fill are masked by its lengths in every branch, so every branch computes the same."""
    sizes = fill_buckets(max_len) if sizes is None else tuple(sizes)
    if len(sizes) == 1:
        return run(sizes[0])
    if not isinstance(filled, jax.core.Tracer):  # eager: the one branch that runs
        return run(next((n for n in sizes if n >= int(filled)), sizes[-1]))
    index = jnp.sum(filled > jnp.asarray(sizes[:-1], filled.dtype))
    return jax.lax.switch(index, [lambda n=n: run(n) for n in sizes])
