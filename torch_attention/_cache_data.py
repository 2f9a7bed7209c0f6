"""The KV cache of PyTorch's decoding, its data: the fields (``KVCache``), the writes that
fill it (``append_to_cache``, ``append_at``), re-exported by ``functional``; a call's
room check and the undo of a failed call's write (``restored_on_failure``).  Cached
decoding, the strategy that uses them, is ``_cache``'s.

Twin of ``jax_attention/_cache_data.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attention_spec import dtype_name
from attention_spec.cache import check_cache_room


class KVCache(NamedTuple):
    """Keys and values of earlier positions for decoding: key (B, Hkv, max_len, D), value
    (B, Hkv, max_len, Dv), and lengths (B,), how many positions of each example are
    filled.  ``AttentionModule.init_cache`` makes one; ``append_to_cache`` fills it.
    Every call checks eagerly, so running past ``max_len`` raises before any work and a
    cache never holds an overflow (the Flax twin's jitted steps record one instead, in a
    fourth field that ``check()`` raises)."""

    key: Tensor
    value: Tensor
    lengths: Tensor

    def check(self) -> KVCache:
        """The cache itself: the Flax twin's ``KVCache.check``, for code that runs on
        either.  Nothing to raise here: a PyTorch call that would run past ``max_len``
        raised before it wrote."""
        return self


def cache_fields(cache: Any) -> Any:
    """(shape, dtype name) of each field, or None for something that is not a KVCache."""
    if not isinstance(cache, KVCache) or not all(isinstance(t, Tensor) for t in cache):
        return None
    return tuple((tuple(t.shape), dtype_name(t.dtype)) for t in cache)


def append_to_cache(cache: KVCache, k: Tensor, v: Tensor, lengths: Tensor) -> KVCache:
    """Writes k (B, Hkv, T, D) and v at positions lengths .. lengths + T - 1 of each example
    and advances its fill by ``lengths`` (B,) (the valid tokens of this chunk; the rest,
    padding, is overwritten by the next call).  Written in place: the same tensors, with
    the fill advanced, are returned.  The caller makes every check of the call first (a
    module's ``_prepare``: that T positions fit, ``check_cache_room``, and that the path
    can honour the call, asked of the table by ``attention_spec.planning.plan_call``), so a refused call leaves the
    cache as it was; a failure after the write (in the attention that reads it) is undone
    by ``restored_on_failure``.
    Autograd records the writes: a reader that keeps what it read across the next write
    reads a copy (a module's cached step does, while autograd records)."""
    positions = cache.lengths[:, None] + torch.arange(k.shape[-2], device=k.device)  # (B, T)
    for store, new in ((cache.key, k), (cache.value, v)):
        where = positions[:, None, :, None].expand(*new.shape[:-1], new.shape[-1])
        store.scatter_(2, where, new.to(store.dtype))
    cache.lengths.add_(lengths.to(cache.lengths.dtype))
    return cache


def append_at(cache: KVCache, k: Tensor, v: Tensor, start: int) -> KVCache:
    """``append_to_cache`` where every example holds ``start`` positions and every token of
    k (B, Hkv, T, D) and v is valid: positions start .. start + T - 1 written as one slice
    of each store (no index tensors), every fill advanced by T.  In place, with the same
    contract (the caller has checked the call, room included)."""
    end = start + k.shape[-2]
    for store, new in ((cache.key, k), (cache.value, v)):
        store[:, :, start:end] = new if new.dtype == store.dtype else new.to(store.dtype)
    cache.lengths.add_(k.shape[-2])
    return cache


def check_room(cache: KVCache, new: int, max_len: int) -> None:
    """A call's room check: whether ``new`` positions fit after the fullest example's fill
    (``check_cache_room``, the fill read from the device)."""
    check_cache_room(max(cache.lengths.tolist()), new, max_len)


@contextmanager
def restored_on_failure(cache: KVCache, seq: int, fills: list[int] | None = None) -> Iterator[None]:
    """A cached call's write and the attention that reads it, undone if they raise: what
    a write of ``seq`` positions at each example's fill will overwrite (the window from
    the emptiest fill to the fullest fill + seq, a copy; ``fills``, the fills as read
    before the write, else read here) and the fills are kept, and put back, every bit,
    before the error propagates.  So a call that fails after its checks (in its attention:
    a mod, a path, anything that raises) leaves the cache as it was, as a refused call
    does.  The attention reads the keys where the write put them, so the write cannot
    wait for it; the copy is of the written window only.  The restore is recorded as the
    write was (an in-place copy), so autograd through earlier steps stays correct."""
    fills = cache.lengths.tolist() if fills is None else fills
    low, high = min(fills), max(fills) + seq
    lengths = cache.lengths.clone()
    kept = [store[:, :, low:high].clone() for store in (cache.key, cache.value)]
    try:
        yield
    except BaseException:
        for store, old in zip((cache.key, cache.value), kept, strict=True):
            store[:, :, low:high] = old
        cache.lengths.copy_(lengths)
        raise
