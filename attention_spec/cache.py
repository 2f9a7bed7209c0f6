"""Checks of a KV cache and of a call that decodes through one: which modules have a
cache, what ``init_cache`` makes, what a cached call needs, and whether the positions it
appends fit.  Shapes and dtype names in, the one error text of both twins out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attention_spec.arrays import FLOAT_DTYPES, as_shape

if TYPE_CHECKING:
    from attention_spec.registry import AttentionConfig

CACHE_NEEDS_INIT_MESSAGE = "cache must come from module.init_cache(batch_size, max_len); got {got}"


def cache_unsupported_message(variant: str) -> str:
    return (
        f"{variant} has no KV cache: decoding needs one set of key/value projections "
        "(MultiHeadAttention, CausalAttention, SelfAttention_v1/v2 or Head)"
    )


def check_cacheable(spec: AttentionConfig) -> None:
    """Only a module with one set of key/value projections has a KV cache (not a module
    without projections, nor a wrapper of heads).  Raises TypeError."""
    if not spec.projections() or spec.declaration.heads == "wrapper":
        raise TypeError(cache_unsupported_message(spec.variant))


def check_cache_call(x_shape: Any, *, batched: bool, has_context: bool) -> None:
    """A module call with a cache: self-attention on batched x (B, T, d_in), B >= 1 (a
    cache has at least one example: ``init_cache`` refuses batch_size 0)."""
    if has_context:
        raise ValueError("a cache is for self-attention decoding; context must be None")
    if not batched:
        raise ValueError(f"a call with a cache needs batched x (batch, len, d_in); got shape {as_shape(x_shape)}")
    if as_shape(x_shape)[0] == 0:
        raise ValueError(
            "a call with a cache needs at least one example (init_cache takes batch_size >= 1); "
            f"got x of shape {as_shape(x_shape)}"
        )


def check_cache_dtype(dtype: str) -> None:
    """A KV cache's keys and values are floating point (``init_cache``'s ``dtype``, and a
    cache given to a call): an integer or bool cache would truncate them.  Raises TypeError."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"a KV cache must hold floating-point keys and values; got dtype {dtype}")


def check_cache_context(max_len: int, context_length: int | None) -> None:
    """A module with a ``context_length`` refuses a longer sequence, and decoding through a
    cache is a sequence too: a cache never holds more than ``context_length`` positions
    (``init_cache``'s ``max_len``, and a cache given to a call).  Raises ValueError."""
    if context_length is not None and max_len > context_length:
        raise ValueError(
            f"a KV cache of max_len={max_len} does not fit context_length {context_length}: the module "
            "attends over at most context_length positions (a longer sequence is refused, decoded or not)"
        )


def cache_room_message(index_max: int, new: int, max_len: int) -> str:
    return (
        f"the KV cache holds {index_max} of max_len={max_len} positions and cannot take "
        f"{new} more; init_cache with a larger max_len"
    )


def check_cache_room(index_max: int, new: int, max_len: int) -> None:
    """A decode step appends ``new`` positions to a cache that holds ``index_max`` (the
    fullest example's) of ``max_len``."""
    if index_max + new > max_len:
        raise ValueError(cache_room_message(index_max, new, max_len))


def check_cache_overflow_record(fill: int, new: int, max_len: int) -> None:
    """A cache whose record says that a compiled step (which cannot raise) ran past
    ``max_len``: ``(fill, new)``, the fullest fill and the positions that step brought,
    ``new`` 0 for none.  Raises the ValueError that the eager call would have raised."""
    if new:
        raise ValueError(cache_room_message(fill, new, max_len))


def check_cache(fields: Any, batch: int, kv_heads: int, key_width: int, value_width: int) -> int:
    """A KV cache ``(key, value, lengths)`` from ``init_cache``: key (B, Hkv, max_len, D),
    value (B, Hkv, max_len, Dv), lengths (B,) integers; returns max_len.  ``fields`` holds
    each field's (shape, dtype name), or is None for something that is not a cache; a
    fourth entry, Flax's overflow record, is None or integers of shape (2,)."""
    if fields is None:
        raise TypeError(CACHE_NEEDS_INIT_MESSAGE.format(got="something else"))
    (key, key_dtype), (value, value_dtype), (index, index_dtype) = ((as_shape(s), d) for s, d in fields[:3])
    record = fields[3] if len(fields) > 3 else None  # Flax's overflow record of a compiled step
    if record is not None and (as_shape(record[0]) != (2,) or not record[1].startswith(("int", "uint"))):
        raise ValueError(
            f"the cache's overflow record must be integers of shape (2,) (init_cache makes it); got "
            f"shape {as_shape(record[0])} of {record[1]}"
        )
    max_len = key[2] if len(key) == 4 else -1
    want = (batch, kv_heads, max_len, key_width), (batch, kv_heads, max_len, value_width), (batch,)
    if (key, value, index) != want or not index_dtype.startswith(("int", "uint")):
        raise ValueError(
            f"the cache does not fit this call: key {key}, value {value}, lengths {index}; "
            f"expected key (batch, kv_heads, max_len, head_dim) = {want[0]}, value {want[1]} and "
            f"lengths ({batch},) of integers (init_cache({batch}, max_len))"
        )
    check_cache_dtype(key_dtype)
    check_cache_dtype(value_dtype)
    return max_len
