"""The KV cache of PyTorch's decoding: its fields, and the writes that fill it
(``append_to_cache``, ``append_at``), re-exported by ``functional``; and cached decoding,
the one strategy of every module (``new_cache``, ``run_cached``: a module's
``init_cache`` and its call with a cache).

Twin of ``jax_attention/_cache.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch import Tensor

from attention_spec import dtype_name
from attention_spec.cache import check_cache_context, check_cache_dtype, check_cache_room, check_cacheable
from attention_spec.options import KV_SHARED_NO_CACHE, check_positive_int
from torch_attention._projections import merge
from torch_attention._qk import transform_heads

if TYPE_CHECKING:
    from torch_attention._base import _Call


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


# --------------------------------------------------------------------------- a module's decoding


def new_cache(module: Any, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
    """A module's ``init_cache``: an empty cache of ``batch_size`` examples and ``max_len``
    positions, key (batch_size, heads, max_len, key width) and value (..., value width)
    as ``spec.cache_widths()`` says, zeros in ``dtype`` (None: the module's), the fills
    zeros, on the module's device.  Raises TypeError for a module without a cache or a
    dtype that is not floating point, ValueError for ``max_len`` beyond the module's
    ``context_length``."""
    spec = module.spec
    check_cacheable(spec)
    if spec.kv_shared:
        raise TypeError(KV_SHARED_NO_CACHE)
    check_positive_int("batch_size", batch_size)
    check_positive_int("max_len", max_len)
    check_cache_context(max_len, spec.context_length)
    p = next(module.parameters())
    dtype = p.dtype if dtype is None else dtype
    check_cache_dtype(dtype_name(dtype))
    heads, key_width, value_width = spec.cache_widths()
    return KVCache(
        torch.zeros(batch_size, heads, max_len, key_width, dtype=dtype, device=p.device),
        torch.zeros(batch_size, heads, max_len, value_width, dtype=dtype, device=p.device),
        torch.zeros(batch_size, dtype=torch.int64, device=p.device),
    )


def run_cached(module: Any, call: _Call, return_weights: bool) -> Any:
    """A module's decode step on a checked call: x's keys and values appended to the
    cache, then x attends to every filled position, query t of example b at key position
    lengths[b] + t (``attend_cached``); a failure after the write puts the cache back as
    it was (``restored_on_failure``).  Returns ``(out, cache)`` or ``(out, weights,
    cache)``.  A kv_shared module's call reads the storing layer's cache instead
    (``read_shared``)."""
    if module.spec.kv_shared:
        return read_shared(module, call, return_weights)
    q, k, v, gate = module._project(call.x, None, None, call.implementation)
    cache = call.cache
    batch, seq = call.x.shape[0], call.x.shape[1]
    fills = cache.lengths.tolist()  # each example's fill before this call (one read)
    if min(fills) == max(fills) and (call.kv_lengths is None or bool((call.kv_lengths == seq).all())):
        # One fill for every example and every token valid: one slice written, a static
        # offset, and no lengths (every key of the prefix is filled), so SDPA gets no mask.
        q, k = transform_heads(module, q, k, call.positions, cache.lengths)  # (read before the write)
        with restored_on_failure(cache, seq, fills):
            cache = append_at(cache, k, v, fills[0])
            return attend_cached(module, call, cache, q, fills[0] + seq, fills[0], None, return_weights, gate)
    lengths = call.kv_lengths if call.kv_lengths is not None else torch.full(
        (batch,), seq, dtype=torch.int64, device=q.device)
    start = cache.lengths.clone()
    q, k = transform_heads(module, q, k, call.positions, start)
    with restored_on_failure(cache, seq, fills):
        cache = append_to_cache(cache, k, v, lengths.to(q.device))
        kv_lengths = start + lengths.to(q.device)
        return attend_cached(module, call, cache, q, int(cache.lengths.max()), start, kv_lengths, return_weights,
                             gate)


def read_shared(module: Any, call: _Call, return_weights: bool) -> Any:
    """A kv_shared module's decode step: ``call.cache`` is the storing layer's cache after
    its call on the same tokens (its fill advanced by them), read, never written; x's
    queries sit at each example's fill minus its valid tokens onward (turned there alone)
    and attend to every filled position, as the storing layer's did.  Returns ``out`` or
    ``(out, weights)`` (no cache: the storing layer's call returned it)."""
    q, _, _, gate = module._project(call.x, None, None, call.implementation)
    cache, seq = call.cache, call.x.shape[1]
    fills = cache.lengths.tolist()
    if min(fills) == max(fills) and (call.kv_lengths is None or bool((call.kv_lengths == seq).all())):
        start, kv_lengths, offset = fills[0] - seq, None, None  # one fill: a static offset, no lengths
        q = transform_heads(module, q, q, call.positions, cache.lengths - seq)[0]
    else:
        new = call.kv_lengths if call.kv_lengths is not None else torch.full_like(cache.lengths, seq)
        offset = cache.lengths - new.to(cache.lengths.device)
        kv_lengths = cache.lengths.clone()
        q = transform_heads(module, q, q, call.positions, offset)[0]  # (q as the keys too: discarded)
    result = attend_cached(module, call, cache, q, max(fills), start if offset is None else offset, kv_lengths,
                           return_weights, gate)
    return result[:-1] if return_weights else result[0]


def attend_cached(
    module: Any, call: _Call, cache: KVCache, q: Tensor, filled: int, q_offset: Tensor | int,
    kv_lengths: Tensor | None, return_weights: bool, gate: Tensor | None = None,
) -> Any:
    """q attends to the cache's keys [0, filled) (its fullest example's fill), query 0
    of each example at key position ``q_offset``: eager shapes may change per step, so
    a step costs what the filled part costs (the twin keeps max_len, the fixed shape
    that lets one compilation serve every step).  Returns ``(out, cache)`` or, with
    ``return_weights``, ``(out, weights, cache)``."""
    keys, values = cache.key[:, :, :filled], cache.value[:, :, :filled]
    if keys.dtype != q.dtype:  # (a cache in another dtype than the module's)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if keys.requires_grad or values.requires_grad:
        # Autograd saves what the attention reads; the next step writes the cache in
        # place, so this step reads a copy (gradients still reach every written k and v
        # through the in-place writes, as through the twin's functional update).
        keys, values = keys.clone(), values.clone()
    if call.mask is not None or call.bias is not None or call.dropout_mask is not None:
        call = call._replace(mask=prefix(call.mask, filled), bias=prefix(call.bias, filled),
                             dropout_mask=prefix(call.dropout_mask, filled))
    spec = module.spec
    if (isinstance(q_offset, int) and q_offset + 1 == filled and q.shape[2] == 1 and spec.window is None
            and spec.chunk is None and call.plans is not None and not spec.sinks and call.mask is None and call.bias is None
            and call.dropout_mask is None and spec.score_mod is None and spec.mask_mod is None):
        # One query at the last filled position: every key is before it, causal or not
        # (a chunk hides the keys of earlier chunks: the general path).
        # (Sinks stay on the general path: a kept plan would hold the module's tensor;
        # mods see positions, and may hide keys or change scores by them.)
        result = attend_all(module, call, q, keys, values, return_weights)
    else:
        result = module._attend(call, q, keys, values, return_weights, kv_lengths=kv_lengths, q_offset=q_offset,
                                alignment="top_left")
    if return_weights:  # zero weights on the unfilled positions: (B, H, T, max_len), as the twin's
        out, weights = cast(tuple[Tensor, Tensor], result)
        weights = torch.nn.functional.pad(weights, (0, cache.key.shape[2] - filled))
        return merge(module, out, call.implementation, gate), weights, cache
    return merge(module, cast(Tensor, result), call.implementation, gate), cache


def attend_all(module: Any, call: _Call, q: Tensor, k: Tensor, v: Tensor, return_weights: bool) -> Any:
    """The module's ``_attend`` for queries that see every key of k and v (no causal
    band, mask, bias, lengths or segments: a decoded token over the filled prefix), with
    the checks and the route of ``dot_product_attention`` made at the first such call of
    a checked decode step (kept in ``call.plans``, see the module's ``_prepare``) and
    reused by the next: nothing of that plan depends on kv_len, the only shape that
    changes."""
    from torch_attention import functional  # (functional re-exports this module: imported once it is)

    plans = cast(dict[str, Any], call.plans)
    plan = plans.get("all keys")
    if plan is None:
        plan = plans["all keys"] = module._attention(call, q, k, return_weights, causal=False, alignment="top_left")
    return functional.attend(q, k, v, plan)


def prefix(t: Tensor | None, n: int) -> Tensor | None:
    """The first ``n`` key positions of a mask or bias broadcastable to (B, H, T, S); a
    broadcast (size-1) key dimension stays."""
    return t if t is None or t.shape[-1] == 1 else t[..., :n]
