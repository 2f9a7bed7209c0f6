"""DeepSeek-V4's attention, ``CompressedAttention`` (transformers' ``DeepseekV4Attention``):
shared-KV multi-query attention over a sliding window of keys and, per layer type, the
compressed keys of a compressor (``compression="hca"``) or those an indexer chooses
among them (``"csa"``); per-head sinks; the rope slice trailing each head, undone on the
output at the query's position; a grouped low-rank output projection.  The computation
is ``attention_spec.compressed``'s docstring; the twin of ``jax_attention/compressed.py``
(same class name, keywords, parameter names, numbers).

The attention itself is ``functional.dot_product_attention`` (one key/value head read by
every query head, ``sinks=``, a bool mask that says which window keys and which
compressed entries each query sees): no attention math of its own.

Parameters carry transformers' names, so a ``DeepseekV4Attention`` copies over by name
(``from_hf``): ``q_a_proj``, ``q_a_norm.weight``, ``q_b_proj``, ``kv_proj``,
``kv_norm.weight``, ``o_a_proj`` (weight (o_groups * o_lora_rank, H * D / o_groups): group
g's block is rows g * o_lora_rank ..), ``o_b_proj``, ``sinks`` (H,); with a compressor
``compressor.kv_proj``, ``compressor.gate_proj`` (width D, ``csa`` 2 D), ``compressor.
position_bias`` (rate, width), ``compressor.kv_norm.weight`` (D,); ``csa``'s indexer
``compressor.indexer.{kv_proj, gate_proj, position_bias, kv_norm.weight, q_b_proj,
scorer.weights_proj}``.  No biases.

The cache (``init_cache``) holds what transformers' ``DeepseekV4HCACache`` /
``DeepseekV4CSACache`` hold: the window's last keys, each compressor's open window
(buffer), its entries and (``csa``) the last closed window's overlap half, and the token
count; ``module(x, cache=c)`` returns ``(out, new_cache)`` (``c`` is not changed) and a
prompt then one-token steps equal the whole sequence.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn

from attention_spec.arrays import dtype_name
from attention_spec.compressed import (
    CACHE_FIELDS,
    SELECTION_ONLY_CSA,
    CompressedGeometry,
    cache_shapes,
    check_compressed_call,
    check_compressed_mask,
    check_compressed_options,
    check_compressed_selection,
)
from attention_spec.options import check_positive_int
from attention_spec.rope import RopeConfig
from torch_attention._rope import rope_cos_sin
from torch_attention.functional import dot_product_attention

__all__ = ["CompressedAttention", "CompressedCache"]


class CompressedCache(NamedTuple):
    """A ``CompressedAttention``'s decoding state after ``length`` tokens (the arrays
    ``attention_spec.compressed.cache_shapes`` describes; None where the layer has no
    such part), in the module's dtype."""

    length: int
    keys: Tensor
    buffer_kv: Tensor | None = None
    buffer_gate: Tensor | None = None
    entries: Tensor | None = None
    overlap_kv: Tensor | None = None
    overlap_gate: Tensor | None = None
    index_buffer_kv: Tensor | None = None
    index_buffer_gate: Tensor | None = None
    index_entries: Tensor | None = None
    index_overlap_kv: Tensor | None = None
    index_overlap_gate: Tensor | None = None


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """DeepSeek-V4's RMSNorms over the last axis: weighted (``DeepseekV4RMSNorm``: the
    statistics and the weight's product in float32, rounded once) or not
    (``DeepseekV4UnweightedRMSNorm``: the float32 factor rounded to x's dtype, then
    multiplied); float64 throughout for float64."""
    work = _work(x.dtype)
    if weight is None:
        return x * torch.rsqrt(x.to(work).square().mean(-1, keepdim=True) + eps).to(x.dtype)
    h = x.to(work)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(work) * h).to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The interleaved rotation of x's trailing ``2 * cos.shape[-1]`` features (pairs
    (2i, 2i + 1) of that slice), cos and sin broadcast against x's leading axes, in
    float32 (float64 for float64) and rounded once; the leading features pass."""
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    dim = cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - dim], x[..., x.shape[-1] - dim:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    work = _work(x.dtype)
    out = (rope.to(work) * cos.to(work) + turned.to(work) * sin.to(work)).to(x.dtype)
    return torch.cat([nope, out], dim=-1)


class _Norm(nn.Module):
    """A norm's weight, kept under transformers' name (``<norm>.weight``)."""

    def __init__(self, width: int, factory: dict[str, Any]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, **factory))


class _Scorer(nn.Module):
    def __init__(self, d_in: int, heads: int, factory: dict[str, Any]) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(d_in, heads, bias=False, **factory)


class _Series(nn.Module):
    """A compressor's parameters: ``kv_proj``, ``gate_proj`` (d_in -> width),
    ``position_bias`` (rate, width), ``kv_norm`` (the entries' width)."""

    def __init__(self, d_in: int, width: int, entry: int, rate: int, factory: dict[str, Any]) -> None:
        super().__init__()
        self.kv_proj = nn.Linear(d_in, width, bias=False, **factory)
        self.gate_proj = nn.Linear(d_in, width, bias=False, **factory)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, **factory))
        self.kv_norm = _Norm(entry, factory)


class _Indexer(_Series):
    def __init__(self, g: CompressedGeometry, factory: dict[str, Any]) -> None:
        assert g.index_head_dim is not None and g.index_heads is not None and g.compress_rate is not None
        super().__init__(g.d_in, 2 * g.index_head_dim, g.index_head_dim, g.compress_rate, factory)
        self.q_b_proj = nn.Linear(g.q_lora_rank, g.index_heads * g.index_head_dim, bias=False, **factory)
        self.scorer = _Scorer(g.d_in, g.index_heads, factory)


class _Compressor(_Series):
    def __init__(self, g: CompressedGeometry, factory: dict[str, Any]) -> None:
        assert g.compress_rate is not None
        super().__init__(g.d_in, g.compressed_width, g.head_dim, g.compress_rate, factory)
        if g.compression == "csa":
            self.indexer = _Indexer(g, factory)


class CompressedAttention(nn.Module):
    """DeepSeek-V4's attention layer (see the module docstring and
    ``attention_spec.compressed``).

    Keywords: ``d_in`` (hidden size), ``num_heads`` query heads of ``head_dim`` (one
    key/value head), ``q_lora_rank``, ``o_groups`` and ``o_lora_rank`` (the grouped output
    projection), ``window`` (the sliding window: a query sees itself and the
    ``window - 1`` keys before it), ``rope`` (a ``RopeConfig``, layout ``"interleaved"``:
    its rotary dim is the slice that trails each head), ``compression`` (None: the
    window alone; ``"hca"``; ``"csa"``), ``compress_rate``, ``index_heads``,
    ``index_head_dim``, ``index_topk`` (``csa``'s indexer), ``norm_eps`` (every RMSNorm's).
    Raises ValueError / TypeError (one text with the JAX twin) before anything is built.
    """

    def __init__(self, d_in: int, num_heads: int, head_dim: int, q_lora_rank: int, o_groups: int,
                 o_lora_rank: int, window: int, *, rope: RopeConfig, compression: str | None = None,
                 compress_rate: int | None = None, index_heads: int | None = None, index_head_dim: int | None = None,
                 index_topk: int | None = None, norm_eps: float = 1e-6, dtype: Any = None,
                 device: Any = None) -> None:
        g = check_compressed_options(d_in, num_heads, head_dim, q_lora_rank, o_groups, o_lora_rank, window, rope,
                                     compression, compress_rate, index_heads, index_head_dim, index_topk, norm_eps)
        super().__init__()
        self.geometry, self.rope = g, rope
        self.config = {"d_in": d_in, "num_heads": num_heads, "head_dim": head_dim, "q_lora_rank": q_lora_rank,
                       "o_groups": o_groups, "o_lora_rank": o_lora_rank, "window": window, "rope": rope,
                       "compression": compression, "compress_rate": compress_rate, "index_heads": index_heads,
                       "index_head_dim": index_head_dim, "index_topk": index_topk, "norm_eps": g.norm_eps}
        factory = {"dtype": dtype, "device": device}
        width = num_heads * head_dim
        self.q_a_proj = nn.Linear(d_in, q_lora_rank, bias=False, **factory)
        self.q_a_norm = _Norm(q_lora_rank, factory)
        self.q_b_proj = nn.Linear(q_lora_rank, width, bias=False, **factory)
        self.kv_proj = nn.Linear(d_in, head_dim, bias=False, **factory)
        self.kv_norm = _Norm(head_dim, factory)
        self.o_a_proj = nn.Linear(width // o_groups, o_groups * o_lora_rank, bias=False, **factory)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, d_in, bias=False, **factory)
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory))
        if compression is not None:
            self.compressor = _Compressor(g, factory)

    # ------------------------------------------------------------------ the cache

    def init_cache(self, batch_size: int) -> CompressedCache:
        """An empty cache for ``batch_size`` examples (no token seen), in the module's dtype."""
        check_positive_int("batch_size", batch_size)
        weight = self.kv_proj.weight
        arrays: dict[str, Any] = {}
        for name, shape in cache_shapes(self.geometry, batch_size, 0).items():
            if shape is not None:
                fill = float("-inf") if name.endswith("overlap_gate") else 0.0
                arrays[name] = torch.full(shape, fill, dtype=weight.dtype, device=weight.device)
        return CompressedCache(0, **arrays)

    def _fields(self, cache: Any) -> Any:
        if cache is None:
            return None
        if not isinstance(cache, CompressedCache) or not all(
                getattr(cache, n) is None or isinstance(getattr(cache, n), Tensor) for n in CACHE_FIELDS):
            return "not a CompressedCache"
        return cache.length, {n: None if getattr(cache, n) is None else
                              (tuple(getattr(cache, n).shape), dtype_name(getattr(cache, n).dtype))
                              for n in CACHE_FIELDS}

    # ------------------------------------------------------------------ the call

    def forward(self, x: Tensor, mask: Any = None, *, cache: CompressedCache | None = None,
                selection: Tensor | None = None) -> Tensor | tuple[Tensor, CompressedCache]:
        """x (B, T, d_in) in the module's dtype -> (B, T, d_in); with ``cache`` (a
        ``CompressedCache``) ``(out, new_cache)``, x continuing the cached tokens.  Token
        t sits at position ``cache.length + t`` (0 + t without a cache).  ``selection``
        (CSA only): bool (B, T, W), the compressed entries each query attends to in place
        of the indexer's choice (the entries it cannot see yet stay hidden), W those after
        the call (``select_keys`` gives the indexer's).  ``mask`` is refused by name (no
        padding: ``attention_spec.compressed.check_compressed_mask``).  Raises ValueError /
        TypeError (one text with the JAX twin) before any work."""
        check_compressed_mask(mask)
        g = self.geometry
        batch, tokens, start = check_compressed_call(g, tuple(x.shape), dtype_name(x.dtype),
                                                     dtype_name(self.kv_proj.weight.dtype), self._fields(cache))
        if selection is not None:
            check_compressed_selection(g, batch, tokens, start, tuple(getattr(selection, "shape", ())),
                                       dtype_name(selection.dtype) if isinstance(selection, Tensor)
                                       else type(selection).__name__)
        given, cache = cache, cache if cache is not None else self.init_cache(batch)
        device = x.device
        positions = torch.arange(start, start + tokens, device=device)
        cos, sin = rope_cos_sin(positions[None], self.rope, g.head_dim, dtype=x.dtype)  # (1, T, r/2)
        eps = g.norm_eps
        q_res = rms_norm(self.q_a_proj(x), self.q_a_norm.weight, eps)                    # (B, T, q_lora_rank)
        q = self.q_b_proj(q_res).view(batch, tokens, g.num_heads, g.head_dim).transpose(1, 2)  # (B, H, T, D)
        q = rotate(rms_norm(q, None, eps), cos[:, None], sin[:, None])
        kv = rms_norm(self.kv_proj(x), self.kv_norm.weight, eps)[:, None]                  # (B, 1, T, D)
        kv = rotate(kv, cos[:, None], sin[:, None])
        keys = torch.cat([cache.keys, kv], dim=2)                                          # (B, 1, P + T, D)
        key_positions = torch.arange(start - cache.keys.shape[2], start + tokens, device=device)
        mask = (key_positions[None] <= positions[:, None]) & (key_positions[None] > positions[:, None] - g.window)
        mask = mask[None, None].expand(batch, 1, tokens, keys.shape[2])                   # (B, 1, T, P + T)
        new: dict[str, Any] = {}
        attended = keys
        if g.compression is not None:
            c = self.compressor
            entries, state = _compress(c.kv_proj(x), c.gate_proj(x), c.position_bias, c.kv_norm.weight,
                                       _state(cache, ""), g, g.head_dim, self.rope, eps)
            new.update({n: t for n, t in zip(_STATE, state, strict=True)})
            visible = _visible(positions, entries.shape[1], g)[None].expand(batch, tokens, entries.shape[1])
            if g.compression == "csa":
                scores, index_state = self._scores(x, q_res, positions, cache, cos, sin)
                new.update({"index_" + n: t for n, t in zip(_STATE, index_state, strict=True)})
                chosen = self._choose(scores, positions) if selection is None else selection.to(x.device)
                visible = visible & chosen
            attended = torch.cat([keys, entries[:, None]], dim=2)                           # (B, 1, P + T + W, D)
            mask = torch.cat([mask, visible[:, None]], dim=-1)
        o = cast(Tensor, dot_product_attention(q, attended, attended, mask=mask, sinks=self.sinks,
                                               scale=g.head_dim ** -0.5))
        o = rotate(o, cos[:, None], -sin[:, None])                                        # (B, H, T, D)
        o = o.transpose(1, 2).reshape(batch, tokens, g.o_groups, -1)                       # (B, T, G, H * D / G)
        blocks = self.o_a_proj.weight.view(g.o_groups, g.o_lora_rank, -1)                   # (G, R, H * D / G)
        o = torch.einsum("btgi,gri->btgr", o, blocks).reshape(batch, tokens, g.o_groups * g.o_lora_rank)
        out = self.o_b_proj(o)
        if given is None:
            return out
        kept = min(keys.shape[2], g.window - 1)
        return out, CompressedCache(start + tokens, keys[:, :, keys.shape[2] - kept:], **new)

    def select_keys(self, x: Tensor, *, cache: CompressedCache | None = None) -> tuple[Tensor, Tensor]:
        """CSA's choice for x (B, T, d_in) after ``cache`` (None: from position 0): the
        compressed entries each query attends to, bool (B, T, W), and the indexer's scores
        (B, T, W) in float32 (float64 stays), -inf at the entries a query cannot see yet.
        Not differentiated.  Raises ValueError without an indexer, and what the call
        raises."""
        g = self.geometry
        if g.compression != "csa":
            raise ValueError(SELECTION_ONLY_CSA)
        batch, tokens, start = check_compressed_call(g, tuple(x.shape), dtype_name(x.dtype),
                                                     dtype_name(self.kv_proj.weight.dtype), self._fields(cache))
        cache = cache if cache is not None else self.init_cache(batch)
        positions = torch.arange(start, start + tokens, device=x.device)
        cos, sin = rope_cos_sin(positions[None], self.rope, g.head_dim, dtype=x.dtype)
        with torch.no_grad():
            q_res = rms_norm(self.q_a_proj(x), self.q_a_norm.weight, g.norm_eps)
            scores, _ = self._scores(x, q_res, positions, cache, cos, sin)
            return self._choose(scores, positions), scores

    def _choose(self, scores: Tensor, positions: Tensor) -> Tensor:
        """Each query's top ``index_topk`` visible entries of ``scores`` (B, T, W), bool."""
        g = self.geometry
        assert g.index_topk is not None and g.compress_rate is not None
        batch, tokens, count = scores.shape
        if count == 0:
            return scores.new_zeros(scores.shape, dtype=torch.bool)
        chosen = scores.detach().topk(min(g.index_topk, count), dim=-1).indices             # (B, T, k)
        threshold = ((positions + 1) // g.compress_rate)[None, :, None]
        chosen = torch.where(chosen < threshold, chosen, torch.full_like(chosen, count))
        selected = torch.zeros((batch, tokens, count + 1), dtype=torch.bool, device=scores.device)
        selected.scatter_(-1, chosen, True)
        return selected[..., :count]

    def _scores(self, x: Tensor, q_res: Tensor, positions: Tensor, cache: CompressedCache, cos: Tensor,
                sin: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The indexer: its entries (its own compressor, at index_head_dim) and its
        scores (B, T, W), -inf at the entries a query cannot see yet; and its compressor's
        new state."""
        g = self.geometry
        assert g.index_heads is not None and g.index_head_dim is not None and g.index_topk is not None
        ix = self.compressor.indexer
        entries, state = _compress(ix.kv_proj(x), ix.gate_proj(x), ix.position_bias, ix.kv_norm.weight,
                                   _state(cache, "index_"), g, g.index_head_dim, self.rope, g.norm_eps)
        batch, tokens = x.shape[:2]
        qi = ix.q_b_proj(q_res).view(batch, tokens, g.index_heads, g.index_head_dim)        # (B, T, IH, ID)
        qi = rotate(qi, cos[:, :, None], sin[:, :, None])
        work = _work(x.dtype)
        scores = torch.matmul(qi.to(work), entries.transpose(-1, -2).to(work)[:, None])     # (B, T, IH, W)
        scores = torch.relu(scores) * g.index_head_dim ** -0.5
        weights = ix.scorer.weights_proj(x).to(work) * g.index_heads ** -0.5                 # (B, T, IH)
        scores = (scores * weights[..., None]).sum(dim=2)                                   # (B, T, W)
        visible = _visible(positions, entries.shape[1], g)[None]                           # (1, T, W)
        return scores.masked_fill(~visible, float("-inf")), state


_STATE = ("buffer_kv", "buffer_gate", "entries", "overlap_kv", "overlap_gate")


def _state(cache: CompressedCache, prefix: str) -> tuple[Any, ...]:
    return tuple(getattr(cache, prefix + n) for n in _STATE)


def _visible(positions: Tensor, count: int, g: CompressedGeometry) -> Tensor:
    """(T, W) bool: entry w is visible to the query at position p iff w < (p + 1) // rate."""
    assert g.compress_rate is not None
    return torch.arange(count, device=positions.device)[None] < ((positions + 1) // g.compress_rate)[:, None]


def _compress(kv: Tensor, gate: Tensor, bias: Tensor, norm_weight: Tensor, state: tuple[Any, ...],
              g: CompressedGeometry, width: int, rope: RopeConfig, eps: float) -> tuple[Tensor, tuple[Any, ...]]:
    """One compressor over the call's projected tokens, kv and gate (B, T, series *
    width), after the cached state (buffer_kv, buffer_gate, entries, overlap_kv,
    overlap_gate): every window the buffer and the call close becomes an entry (roped at
    its first token's position).  Returns (all entries (B, W, width), the new state)."""
    buffer_kv, buffer_gate, entries, overlap_kv, overlap_gate = state
    rate = g.compress_rate
    assert rate is not None
    kv, gate = torch.cat([buffer_kv, kv], dim=1), torch.cat([buffer_gate, gate], dim=1)
    usable = (kv.shape[1] // rate) * rate
    windows = usable // rate
    if windows:
        batch = kv.shape[0]
        work = _work(kv.dtype)
        chunk = kv[:, :usable].view(batch, windows, rate, -1)                               # (B, n, rate, width')
        logits = gate[:, :usable].view(batch, windows, rate, -1).to(work) + bias.to(work)
        if g.compression == "csa":  # the previous window's first series beside this window's second
            chunk_logits = logits
            chunk = torch.cat([torch.cat([overlap_kv[:, None], chunk[:, :-1, :, :width]], dim=1),
                               chunk[..., width:]], dim=2)                                  # (B, n, 2 rate, width)
            logits = torch.cat([torch.cat([overlap_gate[:, None].to(work), chunk_logits[:, :-1, :, :width]], dim=1),
                                chunk_logits[..., width:]], dim=2)
            overlap_kv = kv[:, usable - rate:usable, :width]
            overlap_gate = chunk_logits[:, -1, :, :width].to(kv.dtype)
        pooled = (chunk * logits.softmax(dim=2).to(chunk.dtype)).sum(dim=2)                # (B, n, width)
        pooled = rms_norm(pooled, norm_weight, eps)
        first = entries.shape[1] * rate
        at = first + torch.arange(windows, device=kv.device) * rate
        cos, sin = rope_cos_sin(at[None], rope, g.head_dim, dtype=pooled.dtype)             # (1, n, r/2)
        entries = torch.cat([entries, rotate(pooled, cos, sin)], dim=1)
    return entries, (kv[:, usable:], gate[:, usable:], entries, overlap_kv, overlap_gate)
