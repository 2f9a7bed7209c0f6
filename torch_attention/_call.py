"""One call of a module after every check (``_Call``): what the module's planner
(``_base``) hands its projections, its attention and cached decoding (``_cache``).

Twin of ``jax_attention/_call.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor


class _Call(NamedTuple):
    """One call's inputs after every check, batched and canonical."""

    x: Tensor  # (B, T, d_in)
    mask: Tensor | None  # bool, rank 4, broadcastable to (B, H, T, S)
    dropout_mask: Tensor | None  # bool, broadcastable to (B, H, T, S)
    kv_lengths: Tensor | None  # int64 (B,): valid keys (with a cache: valid tokens of x)
    implementation: str
    batched: bool
    bias: Tensor | None = None  # float, rank 4, broadcastable to (B, H, T, S)
    keys: Tensor | None = None  # (B, S, kdim): cross-attention's key input (None: x)
    values: Tensor | None = None  # (B, S, vdim): its value input (None: x)
    segment_ids: Tensor | None = None  # int (B, T)
    kv_segment_ids: Tensor | None = None  # int (B, S)
    cache: Any = None  # functional.KVCache
    positions: Tensor | None = None  # int (B, T) or (1, T): rope's positions (None: the default)
    plans: dict[str, Any] | None = None  # a checked decode step's kept attention plans (see _prepare)
    kv: tuple[Tensor, Tensor] | None = None  # a kv_shared call's keys and values (B, Hkv, T, D), batched
    return_kv: bool = False  # the call returns its keys and values too
