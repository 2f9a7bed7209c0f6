"""Cached decoding in PyTorch, the one strategy of every module (``new_cache``,
``run_cached``: a module's ``init_cache`` and its call with a cache), over the cache's
data (``_cache_data``).

Twin of ``jax_attention/_cache.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from attention_spec import dtype_name
from attention_spec.cache import check_cache_context, check_cache_dtype, check_cacheable
from attention_spec.options import KV_SHARED_NO_CACHE, check_positive_int
from torch_attention import functional
from torch_attention._cache_data import KVCache, append_at, append_to_cache, restored_on_failure
from torch_attention._call import _Call
from torch_attention._projections import merge
from torch_attention._qk import transform_heads


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
    plans = cast(dict[str, Any], call.plans)
    plan = plans.get("all keys")
    if plan is None:
        plan = plans["all keys"] = module._attention(call, q, k, return_weights, causal=False, alignment="top_left")
    return functional.attend(q, k, v, plan)


def prefix(t: Tensor | None, n: int) -> Tensor | None:
    """The first ``n`` key positions of a mask or bias broadcastable to (B, H, T, S); a
    broadcast (size-1) key dimension stays."""
    return t if t is None or t.shape[-1] == 1 else t[..., :n]
