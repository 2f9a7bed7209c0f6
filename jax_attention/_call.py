"""One call of a module after every check (``_Call``): what the module's planner
(``_base``) hands its projections, its attention and cached decoding (``_cache``).

Twin of ``torch_attention/_call.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax import Array


class _Call(NamedTuple):
    """One call's inputs after every check, batched and canonical."""

    x: Array  # (B, T, d_in)
    mask: Array | None  # bool, rank 4, broadcastable to (B, H, T, S)
    dropout_mask: Array | None  # bool, broadcastable to (B, H, T, S)
    kv_lengths: Array | None  # int (B,): valid keys (with a cache: valid tokens of x)
    implementation: str
    batched: bool
    deterministic: bool
    bias: Array | None = None  # float, rank 4, broadcastable to (B, H, T, S)
    keys: Array | None = None  # (B, S, kdim): cross-attention's key input (None: x)
    values: Array | None = None  # (B, S, vdim): its value input (None: x)
    segment_ids: Array | None = None  # int (B, T)
    kv_segment_ids: Array | None = None  # int (B, S)
    cache: Any = None  # functional.KVCache
    positions: Array | None = None  # int (B, T) or (1, T): rope's positions (None: the default)
    kv: tuple[Array, Array] | None = None  # a kv_shared call's keys and values (B, Hkv, T, D), batched
    return_kv: bool = False  # the call returns its keys and values too
