"""DeepSeek-V4's attention for Flax NNX, ``CompressedAttention``: the twin of
``torch_attention/compressed.py``, whose docstring (and ``attention_spec.compressed``'s)
gives the computation; same class name, keywords, parameter names (Flax kernels (in, out)
where PyTorch's ``nn.Linear`` weights are (out, in); a norm's ``weight`` is its
``scale``; ``position_bias`` and ``sinks`` the same arrays) and numbers.

The attention is ``functional.dot_product_attention`` (one key/value head, ``sinks=``, a
bool mask over the window keys and the compressed entries).  The cache grows with the
sequence (its entries; transformers' does too) and its token count is static (the
pytree's auxiliary data), so under ``nnx.jit`` each cached call compiles for its length.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

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
from jax_attention._projections import dense
from jax_attention._rope import rope_cos_sin
from jax_attention.functional import dot_product_attention

__all__ = ["CompressedAttention", "CompressedCache"]


class CompressedCache(NamedTuple):
    """A ``CompressedAttention``'s decoding state after ``length`` tokens (the PyTorch
    twin's ``CompressedCache``; ``attention_spec.compressed.cache_shapes``)."""

    length: int
    keys: Array
    buffer_kv: Array | None = None
    buffer_gate: Array | None = None
    entries: Array | None = None
    overlap_kv: Array | None = None
    overlap_gate: Array | None = None
    index_buffer_kv: Array | None = None
    index_buffer_gate: Array | None = None
    index_entries: Array | None = None
    index_overlap_kv: Array | None = None
    index_overlap_gate: Array | None = None


def _flatten(cache: CompressedCache) -> tuple[tuple[Any, ...], int]:
    return tuple(cache[1:]), cache.length


def _unflatten(length: int, arrays: Any) -> CompressedCache:
    return CompressedCache(length, *arrays)


# The length is the pytree's static part: under ``nnx.jit`` a cached call compiles for it
# (and for the shapes it gives the entries and buffers).
jax.tree_util.register_pytree_node(CompressedCache, _flatten, _unflatten)


def _work(dtype: Any) -> Any:
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def rms_norm(x: Array, weight: Array | None, eps: float) -> Array:
    """DeepSeek-V4's RMSNorms (the PyTorch twin's ``rms_norm``)."""
    work = _work(x.dtype)
    if weight is None:
        h = x.astype(work)
        return x * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps).astype(x.dtype)
    h = x.astype(work)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return (weight.astype(work).reshape((1,) * (h.ndim - 1) + (-1,)) * h).astype(x.dtype)


def rotate(x: Array, cos: Array, sin: Array) -> Array:
    """The interleaved rotation of x's trailing ``2 * cos.shape[-1]`` features (the
    PyTorch twin's ``rotate``)."""
    cos, sin = jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
    dim = cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - dim], x[..., x.shape[-1] - dim:]
    turned = jnp.stack((-rope[..., 1::2], rope[..., 0::2]), axis=-1).reshape(rope.shape)
    work = _work(x.dtype)
    out = (rope.astype(work) * cos.astype(work) + turned.astype(work) * sin.astype(work)).astype(x.dtype)
    return jnp.concatenate([nope, out], axis=-1)


class _Norm(nnx.Module):
    """A norm's weight, ``scale`` (PyTorch ``weight``)."""

    def __init__(self, width: int, param_dtype: Any) -> None:
        self.scale = nnx.Param(jnp.ones((width,), param_dtype))


class _Scorer(nnx.Module):
    def __init__(self, d_in: int, heads: int, make: Any) -> None:
        self.weights_proj = make(d_in, heads)


class _Series(nnx.Module):
    def __init__(self, d_in: int, width: int, entry: int, rate: int, make: Any, param_dtype: Any) -> None:
        self.kv_proj = make(d_in, width)
        self.gate_proj = make(d_in, width)
        self.position_bias = nnx.Param(jnp.zeros((rate, width), param_dtype))
        self.kv_norm = _Norm(entry, param_dtype)


class _Indexer(_Series):
    def __init__(self, g: CompressedGeometry, make: Any, param_dtype: Any) -> None:
        assert g.index_head_dim is not None and g.index_heads is not None and g.compress_rate is not None
        super().__init__(g.d_in, 2 * g.index_head_dim, g.index_head_dim, g.compress_rate, make, param_dtype)
        self.q_b_proj = make(g.q_lora_rank, g.index_heads * g.index_head_dim)
        self.scorer = _Scorer(g.d_in, g.index_heads, make)


class _Compressor(_Series):
    def __init__(self, g: CompressedGeometry, make: Any, param_dtype: Any) -> None:
        assert g.compress_rate is not None
        super().__init__(g.d_in, g.compressed_width, g.head_dim, g.compress_rate, make, param_dtype)
        if g.compression == "csa":
            self.indexer = _Indexer(g, make, param_dtype)


class CompressedAttention(nnx.Module):
    """DeepSeek-V4's attention layer: the PyTorch twin's ``CompressedAttention`` (same
    keywords; ``dtype`` computes, ``param_dtype`` stores, ``precision`` the matmuls')."""

    def __init__(self, d_in: int, num_heads: int, head_dim: int, q_lora_rank: int, o_groups: int,
                 o_lora_rank: int, window: int, *, rope: RopeConfig, compression: str | None = None,
                 compress_rate: int | None = None, index_heads: int | None = None, index_head_dim: int | None = None,
                 index_topk: int | None = None, norm_eps: float = 1e-6, dtype: Any = None,
                 param_dtype: Any = jnp.float32, precision: Any = "highest", rngs: nnx.Rngs) -> None:
        g = check_compressed_options(d_in, num_heads, head_dim, q_lora_rank, o_groups, o_lora_rank, window, rope,
                                     compression, compress_rate, index_heads, index_head_dim, index_topk, norm_eps)
        self.geometry, self.rope = g, rope
        self.config = {"d_in": d_in, "num_heads": num_heads, "head_dim": head_dim, "q_lora_rank": q_lora_rank,
                       "o_groups": o_groups, "o_lora_rank": o_lora_rank, "window": window, "rope": rope,
                       "compression": compression, "compress_rate": compress_rate, "index_heads": index_heads,
                       "index_head_dim": index_head_dim, "index_topk": index_topk, "norm_eps": g.norm_eps}
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision

        def make(fan_in: int, fan_out: int) -> nnx.Linear:
            return dense(fan_in, fan_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, precision=precision,
                         rngs=rngs)

        width = num_heads * head_dim
        self.q_a_proj = make(d_in, q_lora_rank)
        self.q_a_norm = _Norm(q_lora_rank, param_dtype)
        self.q_b_proj = make(q_lora_rank, width)
        self.kv_proj = make(d_in, head_dim)
        self.kv_norm = _Norm(head_dim, param_dtype)
        self.o_a_proj = make(width // o_groups, o_groups * o_lora_rank)
        self.o_b_proj = make(o_groups * o_lora_rank, d_in)
        self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype))
        if compression is not None:
            self.compressor = _Compressor(g, make, param_dtype)

    def _compute(self) -> str:
        return dtype_name(jnp.dtype(self.dtype if self.dtype is not None else self.param_dtype))

    def init_cache(self, batch_size: int) -> CompressedCache:
        """An empty cache for ``batch_size`` examples, in the module's compute dtype."""
        check_positive_int("batch_size", batch_size)
        arrays: dict[str, Any] = {}
        for name, shape in cache_shapes(self.geometry, batch_size, 0).items():
            if shape is not None:
                fill = -jnp.inf if name.endswith("overlap_gate") else 0.0
                arrays[name] = jnp.full(shape, fill, self._compute())
        return CompressedCache(0, **arrays)

    def _fields(self, cache: Any) -> Any:
        if cache is None:
            return None
        if not isinstance(cache, CompressedCache) or not all(
                getattr(cache, n) is None or hasattr(getattr(cache, n), "shape") for n in CACHE_FIELDS):
            return "not a CompressedCache"
        return cache.length, {n: None if getattr(cache, n) is None else
                              (tuple(getattr(cache, n).shape), dtype_name(getattr(cache, n).dtype))
                              for n in CACHE_FIELDS}

    def __call__(self, x: Array, mask: Any = None, *, cache: CompressedCache | None = None,
                 selection: Array | None = None) -> Array | tuple[Array, CompressedCache]:
        """x (B, T, d_in) in the module's compute dtype -> (B, T, d_in); with ``cache``
        ``(out, new_cache)``; ``selection`` (CSA) in place of the indexer's choice (the
        PyTorch twin's ``forward``; ``mask`` refused by name: no padding)."""
        check_compressed_mask(mask)
        g = self.geometry
        batch, tokens, start = check_compressed_call(g, tuple(x.shape), dtype_name(x.dtype), self._compute(),
                                                     self._fields(cache))
        if selection is not None:
            check_compressed_selection(g, batch, tokens, start, tuple(getattr(selection, "shape", ())),
                                       dtype_name(selection.dtype) if hasattr(selection, "dtype")
                                       else type(selection).__name__)
        given, cache = cache, cache if cache is not None else self.init_cache(batch)
        positions = jnp.arange(start, start + tokens)
        cos, sin = rope_cos_sin(positions[None], self.rope, g.head_dim, dtype=x.dtype)  # (1, T, r/2)
        eps = g.norm_eps
        q_res = rms_norm(self.q_a_proj(x), self.q_a_norm.scale[...], eps)                  # (B, T, q_lora_rank)
        q = jnp.swapaxes(self.q_b_proj(q_res).reshape(batch, tokens, g.num_heads, g.head_dim), 1, 2)
        q = rotate(rms_norm(q, None, eps), cos[:, None], sin[:, None])                   # (B, H, T, D)
        kv = rms_norm(self.kv_proj(x), self.kv_norm.scale[...], eps)[:, None]              # (B, 1, T, D)
        kv = rotate(kv, cos[:, None], sin[:, None])
        keys = jnp.concatenate([cache.keys, kv], axis=2)                                   # (B, 1, P + T, D)
        key_positions = jnp.arange(start - cache.keys.shape[2], start + tokens)
        mask = (key_positions[None] <= positions[:, None]) & (key_positions[None] > positions[:, None] - g.window)
        mask = jnp.broadcast_to(mask[None, None], (batch, 1, tokens, keys.shape[2]))
        new: dict[str, Any] = {}
        attended = keys
        if g.compression is not None:
            c = self.compressor
            entries, state = _compress(c.kv_proj(x), c.gate_proj(x), c.position_bias[...], c.kv_norm.scale[...],
                                       _state(cache, ""), g, g.head_dim, self.rope, eps)
            new.update(dict(zip(_STATE, state, strict=True)))
            visible = jnp.broadcast_to(_visible(positions, entries.shape[1], g)[None],
                                       (batch, tokens, entries.shape[1]))
            if g.compression == "csa":
                scores, index_state = self._scores(x, q_res, positions, cache, cos, sin)
                new.update({"index_" + n: t for n, t in zip(_STATE, index_state, strict=True)})
                chosen = self._choose(scores, positions) if selection is None else jnp.asarray(selection)
                visible = visible & chosen
            attended = jnp.concatenate([keys, entries[:, None]], axis=2)                     # (B, 1, P + T + W, D)
            mask = jnp.concatenate([mask, visible[:, None]], axis=-1)
        o = cast(Array, dot_product_attention(q, attended, attended, mask=mask, sinks=self.sinks[...],
                                              scale=g.head_dim ** -0.5, precision=self.precision))
        o = rotate(o, cos[:, None], -sin[:, None])                                        # (B, H, T, D)
        o = jnp.swapaxes(o, 1, 2).reshape(batch, tokens, g.o_groups, -1)                   # (B, T, G, H * D / G)
        kernel = self.o_a_proj.kernel[...].astype(o.dtype).reshape(-1, g.o_groups, g.o_lora_rank)  # (in, G, R)
        o = jnp.einsum("btgi,igr->btgr", o, kernel, precision=self.precision)
        out = self.o_b_proj(o.reshape(batch, tokens, g.o_groups * g.o_lora_rank))
        if given is None:
            return out
        kept = min(keys.shape[2], g.window - 1)
        return out, CompressedCache(start + tokens, keys[:, :, keys.shape[2] - kept:], **new)

    def select_keys(self, x: Array, *, cache: CompressedCache | None = None) -> tuple[Array, Array]:
        """CSA's choice for x after ``cache`` and the indexer's scores (the PyTorch twin's
        ``select_keys``)."""
        g = self.geometry
        if g.compression != "csa":
            raise ValueError(SELECTION_ONLY_CSA)
        batch, tokens, start = check_compressed_call(g, tuple(x.shape), dtype_name(x.dtype), self._compute(),
                                                     self._fields(cache))
        cache = cache if cache is not None else self.init_cache(batch)
        positions = jnp.arange(start, start + tokens)
        cos, sin = rope_cos_sin(positions[None], self.rope, g.head_dim, dtype=x.dtype)
        q_res = rms_norm(self.q_a_proj(x), self.q_a_norm.scale[...], g.norm_eps)
        scores, _ = self._scores(x, q_res, positions, cache, cos, sin)
        scores = jax.lax.stop_gradient(scores)
        return self._choose(scores, positions), scores

    def _choose(self, scores: Array, positions: Array) -> Array:
        """Each query's top ``index_topk`` visible entries of ``scores`` (B, T, W), bool."""
        g = self.geometry
        assert g.index_topk is not None and g.compress_rate is not None
        count = scores.shape[-1]
        if count == 0:
            return jnp.zeros(scores.shape, bool)
        chosen = jax.lax.top_k(jax.lax.stop_gradient(scores), min(g.index_topk, count))[1]  # (B, T, k)
        threshold = ((positions + 1) // g.compress_rate)[None, :, None]
        chosen = jnp.where(chosen < threshold, chosen, count)
        return jnp.any(chosen[..., None] == jnp.arange(count)[None, None, None], axis=-2)  # (B, T, W)

    def _scores(self, x: Array, q_res: Array, positions: Array, cache: CompressedCache, cos: Array,
                sin: Array) -> tuple[Array, tuple[Any, ...]]:
        """The indexer's entries and scores (B, T, W), -inf where hidden, and its
        compressor's new state (the PyTorch twin's ``_scores``)."""
        g = self.geometry
        assert g.index_heads is not None and g.index_head_dim is not None and g.index_topk is not None
        ix = self.compressor.indexer
        entries, state = _compress(ix.kv_proj(x), ix.gate_proj(x), ix.position_bias[...], ix.kv_norm.scale[...],
                                   _state(cache, "index_"), g, g.index_head_dim, self.rope, g.norm_eps)
        batch, tokens = x.shape[:2]
        qi = ix.q_b_proj(q_res).reshape(batch, tokens, g.index_heads, g.index_head_dim)     # (B, T, IH, ID)
        qi = rotate(qi, cos[:, :, None], sin[:, :, None])
        work = _work(x.dtype)
        scores = jnp.matmul(qi.astype(work), jnp.swapaxes(entries, -1, -2).astype(work)[:, None],
                            precision=self.precision)                                       # (B, T, IH, W)
        scores = jax.nn.relu(scores) * g.index_head_dim ** -0.5
        weights = ix.scorer.weights_proj(x).astype(work) * g.index_heads ** -0.5             # (B, T, IH)
        scores = jnp.sum(scores * weights[..., None], axis=2)                               # (B, T, W)
        visible = _visible(positions, entries.shape[1], g)[None]                           # (1, T, W)
        return jnp.where(visible, scores, -jnp.inf), state


_STATE = ("buffer_kv", "buffer_gate", "entries", "overlap_kv", "overlap_gate")


def _state(cache: CompressedCache, prefix: str) -> tuple[Any, ...]:
    return tuple(getattr(cache, prefix + n) for n in _STATE)


def _visible(positions: Array, count: int, g: CompressedGeometry) -> Array:
    """(T, W) bool: entry w is visible to the query at position p iff w < (p + 1) // rate."""
    assert g.compress_rate is not None
    return jnp.arange(count)[None] < ((positions + 1) // g.compress_rate)[:, None]


def _compress(kv: Array, gate: Array, bias: Array, norm_weight: Array, state: tuple[Any, ...],
              g: CompressedGeometry, width: int, rope: RopeConfig, eps: float) -> tuple[Array, tuple[Any, ...]]:
    """One compressor over the call's projected tokens (the PyTorch twin's ``_compress``)."""
    buffer_kv, buffer_gate, entries, overlap_kv, overlap_gate = state
    rate = g.compress_rate
    assert rate is not None
    kv, gate = jnp.concatenate([buffer_kv, kv], axis=1), jnp.concatenate([buffer_gate, gate], axis=1)
    usable = (kv.shape[1] // rate) * rate
    windows = usable // rate
    if windows:
        batch = kv.shape[0]
        work = _work(kv.dtype)
        chunk = kv[:, :usable].reshape(batch, windows, rate, -1)                            # (B, n, rate, width')
        logits = gate[:, :usable].reshape(batch, windows, rate, -1).astype(work) + bias.astype(work)[None, None]
        if g.compression == "csa":  # the previous window's first series beside this window's second
            chunk_logits = logits
            chunk = jnp.concatenate([jnp.concatenate([overlap_kv[:, None], chunk[:, :-1, :, :width]], axis=1),
                                     chunk[..., width:]], axis=2)                           # (B, n, 2 rate, width)
            logits = jnp.concatenate(
                [jnp.concatenate([overlap_gate[:, None].astype(work), chunk_logits[:, :-1, :, :width]], axis=1),
                 chunk_logits[..., width:]], axis=2)
            overlap_kv = kv[:, usable - rate:usable, :width]
            overlap_gate = chunk_logits[:, -1, :, :width].astype(kv.dtype)
        pooled = jnp.sum(chunk * jax.nn.softmax(logits, axis=2).astype(chunk.dtype), axis=2)  # (B, n, width)
        pooled = rms_norm(pooled, norm_weight, eps)
        first = entries.shape[1] * rate
        at = first + jnp.arange(windows) * rate
        cos, sin = rope_cos_sin(at[None], rope, g.head_dim, dtype=pooled.dtype)             # (1, n, r/2)
        entries = jnp.concatenate([entries, rotate(pooled, cos, sin)], axis=1)
    return entries, (kv[:, usable:], gate[:, usable:], entries, overlap_kv, overlap_gate)
