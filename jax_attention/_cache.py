"""Cached decoding in JAX, the one strategy of every module (``new_cache``,
``run_cached``: a module's ``init_cache`` and its call with a cache), over the cache's
data (``_cache_data``).

Twin of ``torch_attention/_cache.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec import dtype_name
from attention_spec.cache import check_cache_context, check_cache_dtype, check_cacheable
from attention_spec.options import KV_SHARED_NO_CACHE, check_positive_int
from jax_attention import functional
from jax_attention._cache_data import KVCache, append_to_cache, fill_buckets, over_filled
from jax_attention._call import _Call
from jax_attention._projections import merge
from jax_attention._qk import transform_heads

# Bytes of keys and values above which a one-token cached step attends example by example
# (``run_cached``): XLA on CPU allocates a call's temporaries afresh on every call, and
# past about 32 MiB (glibc's largest reuse) that cost more than the step; measured at
# batch 8, 2 key/value heads of 64, 4096 positions: 1.4 ms a step against 0.3.
_DECODE_BYTES = 8 << 20


def new_cache(module: Any, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
    """A module's ``init_cache``: an empty cache of ``batch_size`` examples and ``max_len``
    positions, key (batch_size, heads, max_len, key width) and value (..., value width)
    as ``spec.cache_widths()`` says, zeros in ``dtype`` (None: the module's compute
    dtype), the fills and the overflow record zeros.  Raises TypeError for a module
    without a cache or a dtype that is not floating point, ValueError for ``max_len``
    beyond the module's ``context_length``."""
    spec = module.spec
    check_cacheable(spec)
    if spec.kv_shared:
        raise TypeError(KV_SHARED_NO_CACHE)
    check_positive_int("batch_size", batch_size)
    check_positive_int("max_len", max_len)
    check_cache_context(max_len, spec.context_length)
    dtype = jnp.dtype(module._compute_dtype() if dtype is None else dtype)
    check_cache_dtype(dtype_name(dtype))
    heads, key_width, value_width = spec.cache_widths()
    return KVCache(
        jnp.zeros((batch_size, heads, max_len, key_width), dtype),
        jnp.zeros((batch_size, heads, max_len, value_width), dtype),
        jnp.zeros((batch_size,), jnp.int32),
        jnp.zeros((2,), jnp.int32),
    )


def run_cached(module: Any, call: _Call, return_weights: bool, key: Array | None) -> Any:
    """A module's decode step on a checked call: x's keys and values appended to (a new)
    cache, then x attends to every filled position, query t of example b at key position
    lengths[b] + t, over the cache's first positions up to the fullest fill
    (``attend_filled``), or over the whole cache on a kernel that reads no key past a
    length (``reads_to_lengths``).  A step that runs past max_len (possible only under
    jit) writes nothing and returns NaN outputs and the cache with its overflow record
    (``append_to_cache``).  Returns ``(out, cache)`` or ``(out, weights, cache)``.

    A kv_shared module's call reads the storing layer's cache instead (``call.cache``,
    the one that layer's call on the same tokens returned), never writes it: x's queries
    sit at each example's fill minus its valid tokens onward (turned there alone); NaN
    outputs where that step recorded an overflow.  Returns ``out`` or ``(out, weights)``."""
    folded = folds(module, call, return_weights)
    q, k, v, gate = module._project(call.x, None, None, call.implementation)
    shared = module.spec.kv_shared
    if shared:
        cache = call.cache
        ok = jnp.asarray(True) if cache.overflow is None else jnp.all(cache.overflow == 0)
        start = cache.lengths - new_lengths(call).astype(cache.lengths.dtype)
        q = transform_heads(module, q, q, call.positions, start)[0]  # (q as the keys too: discarded)
    else:
        start = call.cache.lengths
        q, k = transform_heads(module, q, k, call.positions, start)
        cache, ok = append_to_cache(call.cache, k, v, new_lengths(call))
    filled = cache.lengths  # after the write (the same as before on an overflow)
    if folded:  # one token: its queries of a key/value head as rows, no causal mask (below)
        shape, q = q.shape, q.reshape(q.shape[0], module.spec.kv_heads, -1, q.shape[-1])
        where: dict[str, Any] = {"causal": False}
    else:
        where = {"q_offset": start, "alignment": "top_left"}

    # On a kernel that reads no key past a length, the whole cache as it lies
    whole = not return_weights and not module._draws(call) and reads_to_lengths(
        module, call, q, cache, kv_lengths=filled, **where)

    def attend(c: _Call, n: int) -> Any:
        def one(q: Array, keys: Array, values: Array, filled: Array) -> Any:
            keys, values = keys[:, :, :n].astype(q.dtype), values[:, :, :n].astype(q.dtype)
            return module._attend(c, q, keys, values, return_weights, key, kv_lengths=filled, **where)

        operands = (q, cache.key, cache.value, filled)
        if whole or not folded or q.shape[0] == 1 or 2 * cache.key[:, :, :n].nbytes <= _DECODE_BYTES:
            return one(*operands)
        # a long bucket, example by example: each call's temporaries stay small
        return jax.lax.map(lambda o: one(*(t[None] for t in o))[0], operands)

    result = attend_filled(module, call, attend, filled, int(cache.key.shape[2]), return_weights or whole)
    if folded:
        result = result.reshape(*shape[:3], -1)
    if return_weights:
        out, weights = cast(tuple[Array, Array], result)
        out, weights = unless(ok, merge(module, out, call.implementation, gate)), unless(ok, weights)
        return (out, weights) if shared else (out, weights, cache)
    out = unless(ok, merge(module, cast(Array, result), call.implementation, gate))
    return out if shared else (out, cache)


def folds(module: Any, call: _Call, return_weights: bool) -> bool:
    """Whether a cached step attends as one token: T = 1, without a window, a chunk, sinks, flex
    mods (they see positions, and the folded rows are heads), dense mask, bias, segment
    ids, dropout or returned weights.  Its queries of each
    key/value head become the rows of one query block (B, Hkv, H / Hkv, D): no path
    repeats the cache's keys and values per query head (a copy of the cache each
    step).  The causal mask is dropped: the token sits at its example's fill, so the
    keys it may see are exactly the ``kv_lengths`` (the fill after the write) that
    every row keeps, whatever the path.  (On CPU, ``"auto"`` then runs the CPU
    kernel's forward for few rows over the whole cache as it lies, as
    ``functional.route`` says of so few query rows (the explicit math where auto
    passes the kernel by), and XLA's dot for the projections of so few tokens:
    ``functional.FEW_QUERY_ROWS``, ``_linear.FEW_ROWS``.)"""
    spec = module.spec
    return (call.x.shape[1] == 1 and spec.window is None and spec.chunk is None and not spec.sinks and not return_weights
            and spec.score_mod is None and spec.mask_mod is None
            and not module._draws(call)
            and all(t is None for t in (call.mask, call.bias, call.dropout_mask, call.segment_ids,
                                        call.kv_segment_ids)))


def new_lengths(call: _Call) -> Array:
    """The valid tokens of a cached call's x per example (B,): its ``kv_lengths``, else T."""
    if call.kv_lengths is not None:
        return call.kv_lengths
    return jnp.full((call.x.shape[0],), call.x.shape[1], jnp.int32)


def reads_to_lengths(module: Any, call: _Call, q: Array, cache: KVCache, **extra: Any) -> bool:
    """Whether a cached step's attention over the whole cache (``extra``: the step's
    keywords) runs on a kernel that reads no key past ``kv_lengths``
    (``functional.READS_TO_LENGTHS``: on CPU, the kernel's forward for few rows), so
    that it costs what the filled positions cost without buckets (``attend_filled``).
    Asked of ``functional.route``, on shapes."""
    keys, values = (jax.ShapeDtypeStruct(t.shape, q.dtype) for t in (cache.key, cache.value))
    chosen = functional.route_of(q, keys, values, module._attention(call, q, keys, False, **extra))
    return chosen.kernel in functional.READS_TO_LENGTHS


def attend_filled(module: Any, call: _Call, attend: Callable[[_Call, int], Any], filled: Array, max_len: int,
                  whole: bool) -> Any:
    """``attend(call, n)`` over the cache's first n positions, n the smallest of
    ``fill_buckets(max_len)`` that holds the fullest fill (``over_filled``; known
    eagerly, a ``lax.switch`` under jit), the call's key-axis inputs cut to n.  Over
    all ``max_len`` positions where the result's shape or draw depends on it (the
    returned weights (B, H, T, max_len), and dropout drawn from a key) and where
    ``whole`` says so (a kernel that reads no key past a length,
    ``reads_to_lengths``)."""
    if whole or module._draws(call):
        return attend(call, max_len)
    return over_filled(lambda n: attend(first_keys(call, n, max_len), n), jnp.max(filled), max_len,
                       fill_buckets(max_len))


def first_keys(call: _Call, n: int, max_len: int) -> _Call:
    """A cached call whose key-axis inputs (mask, bias, dropout mask: (..., max_len);
    kv_segment_ids (B, max_len)) are cut to the cache's first n positions."""
    def cut(t: Array | None) -> Array | None:
        return t if t is None or t.shape[-1] != max_len else t[..., :n]

    return call._replace(mask=cut(call.mask), bias=cut(call.bias), dropout_mask=cut(call.dropout_mask),
                         kv_segment_ids=cut(call.kv_segment_ids))


def unless(ok: Array, t: Array) -> Array:
    """t, or NaN where a compiled cached step ran past max_len (``ok`` False)."""
    return jnp.where(ok, t, jnp.asarray(jnp.nan, t.dtype))
