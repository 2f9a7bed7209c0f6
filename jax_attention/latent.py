"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values expanded per head
from one low-rank latent, which is all a decoding cache holds (with the one rope key that
every head shares).  The math is ``attention_spec.latent``'s.

Twin of ``torch_attention/latent.py``.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from attention_spec import dtype_name
from attention_spec.latent import (
    SELECT_KEYS_ONLY_SPARSE,
    cache_bytes_per_token,
    check_latent_call,
    check_selection,
    indexer_layers,
    indexer_rope,
    softmax_scale,
)
from jax_attention import functional
from jax_attention._base import AttentionModule, _Call, _unbatch
from jax_attention._cache import attend_filled, new_cache, new_lengths, unless
from jax_attention._cache_data import append_to_cache
from jax_attention._canonical import band, bias_allows, length_mask
from jax_attention._projections import dense, split_heads
from jax_attention._qk import normalise, rotate
from jax_attention.masks import combine_masks


class Indexer(nnx.Module):
    """Sparse attention's (DSA) indexer, ``transformers``' ``DeepseekV32Indexer``'s layers
    and names (``attention_spec.latent.indexer_layers``): ``wq_b``, ``wk``, the LayerNorm
    ``k_norm`` (epsilon ``norm_eps``; scale and bias), ``weights_proj``.  Twin of the
    PyTorch ``Indexer``."""

    def __init__(self, spec: Any, *, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs) -> None:
        for name, kind, fan_in, fan_out in indexer_layers(spec):
            layer: nnx.Module = (
                nnx.LayerNorm(fan_in, epsilon=spec.norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                if kind == "layer" else
                dense(fan_in, fan_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, precision=precision,
                      rngs=rngs))
            setattr(self, name, layer)


def index_scores(iq: Array, ik: Array, w: Array, precision: Any) -> Array:
    """The indexer's scores, as ``transformers``' (in float32 at least: float64 stays):
    iq (B, Hi, T, Di) and ik (B, 1, S, Di) turned, w (B, T, Hi) already times Hi ** -0.5 ->
    ``sum_h w[t, h] * relu(iq[h, t] . ik[s] * Di ** -0.5)`` (B, T, S)."""
    work = jnp.promote_types(iq.dtype, jnp.float32)
    scores = jnp.matmul(iq.astype(work), jnp.swapaxes(ik.astype(work), -1, -2), precision=precision)
    scores = jax.nn.relu(scores * iq.shape[-1] ** -0.5)
    # (B, T, 1, Hi) @ (B, T, Hi, S) -> (B, T, S): the heads summed by their weights
    return jnp.matmul(w.astype(work)[..., None, :], jnp.swapaxes(scores, 1, 2), precision=precision)[..., 0, :]


def visible_keys(call: functional.Call, q_len: int, kv_len: int) -> Array | None:
    """(B or 1, T, S) bool: the keys the attention of ``call`` lets each query see (its
    mask, a -inf bias, segments, causal / window, lengths), a key seen by any head; None
    if every key is.  What the indexer chooses among."""
    mask = combine_masks(call.mask, None if call.bias is None else bias_allows(call.bias), call.segments,
                         band(q_len, kv_len, call.offset, call.options, 4),
                         None if call.kv_lengths is None else length_mask(call.kv_lengths, kv_len, 4))
    return None if mask is None else jnp.broadcast_to(mask, (*mask.shape[:2], q_len, kv_len)).any(axis=1)


def top_keys(scores: Array, visible: Array | None, topk: int) -> tuple[Array, Array]:
    """The indexer's choice: scores (B, T, S) -inf where not ``visible``, and each query's
    top ``min(topk, S)`` of them, as bool (B, T, S) (True = selected, visible only); equal
    scores go to the earlier key (``jax.lax.top_k``'s order, the PyTorch twin's)."""
    if visible is not None:
        scores = jnp.where(visible, scores, -jnp.inf)
    index = jax.lax.top_k(scores, min(topk, scores.shape[-1]))[1]
    chosen = jnp.put_along_axis(jnp.zeros(scores.shape, bool), index, True, axis=-1, inplace=False)
    return scores, chosen if visible is None else chosen & visible


class MultiHeadLatentAttention(AttentionModule):
    """Multi-head latent attention, Hugging Face's ``DeepseekV3Attention`` with its
    parameter names: queries through ``q_a_proj`` (d_in -> q_lora_rank), the RMSNorm
    ``q_a_layernorm`` and ``q_b_proj`` (-> num_heads * qk_head_dim), or one ``q_proj``
    when ``q_lora_rank`` is None (DeepSeek-V2-Lite); ``kv_a_proj_with_mqa`` (d_in ->
    kv_lora_rank + qk_rope_head_dim) gives the latent, normalised by ``kv_a_layernorm``,
    and one rope key shared by every head; ``kv_b_proj`` (kv_lora_rank -> num_heads *
    (qk_nope_head_dim + v_head_dim)) expands the latent to each head's nope key and value;
    ``o_proj`` (num_heads * v_head_dim -> d_in) mixes the heads.  ``qk_head_dim =
    qk_nope_head_dim + qk_rope_head_dim``.

    ``rope=`` (an ``attention_spec.rope.RopeConfig``; DeepSeek-V3: interleaved, YaRN)
    turns the rope parts of q and k only, at the call's ``positions=``; None leaves the
    rope parts unturned.  ``query_scale`` (Mistral 4's ``llama_4_scaling_beta``) scales
    the whole query after rope, as the PyTorch twin's.  ``scale`` None: ``qk_head_dim ** -0.5``, times YaRN's
    ``mscale(factor, mscale_all_dim) ** 2`` when rope scales by YaRN.  ``attention_bias``:
    biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.  ``norm_eps``: both
    RMSNorms' epsilon.  The RMSNorms' weights are ``nnx.RMSNorm``'s ``scale``.

    (B, T, d_in) -> (B, T, d_in); weights (B, num_heads, T, T).  Self-attention only.
    A call takes every option of the other variants' calls and ``absorb`` (the absorbed
    form: ``kv_b_proj`` folded into the query and the output).  ``init_cache`` holds the
    latent and the turned rope key, ``kv_lora_rank + qk_rope_head_dim`` numbers a token,
    fixed shapes: a jitted decode step compiles once.  dtypes as ``MultiHeadAttention``.

    Sparse attention (DSA): ``index_topk`` (with ``index_heads``, ``index_head_dim``,
    ``q_lora_rank``) adds the submodule ``indexer`` (``wq_b``, ``wk``, ``k_norm``,
    ``weights_proj``) whose top-k choice of keys the attention reads as a mask, as the
    PyTorch twin's; ``selection`` replaces it; ``select_keys`` returns it and the scores;
    the choice is under ``jax.lax.stop_gradient``.
    """

    variant = "MultiHeadLatentAttention"

    def __init__(
        self,
        d_in: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        *,
        q_lora_rank: int | None = None,
        context_length: int | None = None,
        dropout: float = 0.0,
        attention_bias: bool = False,
        norm_eps: float = 1e-6,
        rope: Any = None,
        query_scale: Any = None,
        scale: float | None = None,
        causal: bool = True,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        softcap: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        alignment: str = "top_left",
        index_topk: int | None = None,
        index_heads: int | None = None,
        index_head_dim: int | None = None,
        index_rope_layout: str = "half",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(locals(), dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        for name, width in self.spec.latent_norms():  # scale ones, as PyTorch's weight
            setattr(self, name, nnx.RMSNorm(width, epsilon=self.spec.norm_eps, dtype=dtype,
                                            param_dtype=param_dtype, rngs=rngs))
        if self.spec.index_topk is not None:
            self.indexer = Indexer(self.spec, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.softmax_scale = softmax_scale(self.spec)

    def __call__(  # type: ignore[override]
        self,
        x: Array,
        mask: Array | None = None,
        *,
        context: Any = None,
        return_weights: bool = False,
        dropout_mask: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | Array | None = None,
        kv_lengths: Any = None,
        implementation: str | None = None,
        bias: Array | None = None,
        segment_ids: Any = None,
        kv_segment_ids: Any = None,
        cache: Any = None,
        positions: Any = None,
        absorb: bool = False,
        selection: Any = None,
    ) -> Any:
        """As every variant's call (``AttentionModule.__call__``), self-attention only;
        ``absorb=True`` attends in the absorbed form.  A ``cache`` from ``init_cache``
        takes x's latent and rope key; returns ``(out, new_cache)``.  ``selection`` (sparse
        attention only): the keys each query attends to, in place of the indexer's."""
        check_latent_call(context, absorb)
        call = self._prepare(x, mask, dropout_mask, deterministic, kv_lengths, implementation, bias,
                             segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, cache=cache,
                             return_weights=return_weights, positions=positions)
        chosen = self._checked_selection(selection, call)
        key = self._draw_key(call, rngs, return_weights)  # after every check: it advances a stream
        if call.cache is not None:
            return self._run_cached(call, return_weights, key, absorb, chosen)
        return _unbatch(self._run(call, return_weights, key, absorb, chosen), call.batched)

    def select_keys(self, x: Array, *, positions: Any = None) -> tuple[Array, Array]:
        """Sparse attention's choice for x (B, T, d_in) or (T, d_in), no cache: the keys
        each query attends to, bool (B, T, T) (True = selected), and the indexer's scores
        (B, T, T) in float32 (float64 stays), -inf at the keys the module's structure
        hides.  Raises ValueError without an indexer."""
        if self.spec.index_topk is None:
            raise ValueError(SELECT_KEYS_ONLY_SPARSE)
        call = self._prepare(x, None, None, True, None, None, positions=positions)
        q, _, _, q_resid = self._latent_inputs(call.x, call.implementation, call.positions)
        iq, ik, w = self._index_inputs(call.x, q_resid, call.implementation, call.positions)
        scores, chosen = jax.lax.stop_gradient(self._choose(call, q, iq, ik, w))
        return (chosen, scores) if call.batched else (chosen[0], scores[0])

    def _checked_selection(self, selection: Any, call: _Call) -> Array | None:
        """A call's ``selection`` checked (``check_selection``) -> (B, 1, T, S)."""
        if selection is None:
            return None
        batch, seq = call.x.shape[0], call.x.shape[1]
        keys = seq if call.cache is None else int(call.cache.key.shape[2])
        expected = (batch, seq, keys) if call.batched else (seq, keys)
        dtype = dtype_name(selection.dtype) if hasattr(selection, "dtype") else type(selection).__name__
        check_selection(tuple(getattr(selection, "shape", ())), dtype, expected, self.spec.index_topk is not None)
        chosen = jnp.asarray(selection)
        return (chosen if call.batched else chosen[None])[:, None]

    def init_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> functional.KVCache:
        """An empty latent cache: ``key`` holds the normalised latent (batch_size, 1,
        max_len, kv_lora_rank; sparse attention: then the indexer's key, index_head_dim more), ``value`` the turned rope key (batch_size, 1, max_len,
        qk_rope_head_dim), zeros in ``dtype`` (None: the module's); ``lengths`` the fill.
        Raises as ``AttentionModule.init_cache``."""
        return new_cache(self, batch_size, max_len, dtype)  # (the widths: spec.cache_widths())

    @staticmethod
    def cache_bytes_per_token(cache: functional.KVCache) -> int:
        """Bytes a token takes in ``cache``: ``(kv_lora_rank + qk_rope_head_dim) * itemsize``."""
        return cache_bytes_per_token((tuple(t.shape), jnp.dtype(t.dtype).itemsize) for t in cache[:3])

    # ------------------------------------------------------------------ the work

    def _proj(self, name: str) -> nnx.Linear:
        """The projection called ``name`` (Hugging Face's name)."""
        return cast(nnx.Linear, getattr(self, name))

    def _rms(self, name: str, t: Array) -> Array:
        """Hugging Face's RMSNorm: in float32 (float64 stays), cast back, times the scale
        (``_qk.normalise``, qk-norm's math, over the whole width)."""
        return normalise(t, getattr(self, name).scale[...], self.spec.norm_eps)

    def _latent_inputs(
        self, x: Array, implementation: str, positions: Array | None, start: Array | None = None
    ) -> tuple[Array, Array, Array, Array | None]:
        """x (B, T, d_in) -> q (B, H, T, qk_head_dim) with its rope part turned, the
        normalised latent (B, 1, T, kv_lora_rank), the turned rope key (B, 1, T, rope),
        and the queries' low-rank input (B, T, q_lora_rank) (None without q_lora_rank)."""
        spec = self.spec
        nope, rank = cast(int, spec.qk_nope_head_dim), cast(int, spec.kv_lora_rank)
        q_a = None
        if spec.q_lora_rank is None:
            q = self._linear(self._proj("q_proj"), x, implementation)
        else:
            q_a = self._rms("q_a_layernorm", self._linear(self._proj("q_a_proj"), x, implementation))
            q = self._linear(self._proj("q_b_proj"), q_a, implementation)
        q = split_heads(q, spec.num_heads)
        compressed = self._linear(self._proj("kv_a_proj_with_mqa"), x, implementation)
        latent = self._rms("kv_a_layernorm", compressed[..., :rank])
        q_rope, k_rope = self._rotate(q[..., nope:], compressed[:, None, :, rank:], positions, start)
        # Mistral 4: the whole query (nope and rope parts) scaled by position, after rope
        q, k_rope = self._scale_queries(jnp.concatenate((q[..., :nope], q_rope), axis=-1), k_rope, positions,
                                        start)
        return q, latent[:, None], k_rope, q_a

    def _index_inputs(self, x: Array, q_resid: Any, implementation: str, positions: Array | None,
                      start: Array | None = None) -> tuple[Array, Array, Array]:
        """The indexer's queries (B, Hi, T, Di) and key (B, 1, T, Di), turned by its rope
        (``indexer_rope``), and its head weights (B, T, Hi) times Hi ** -0.5, in float32
        at least."""
        spec, indexer = self.spec, cast(Any, self.indexer)
        iq = split_heads(self._linear(indexer.wq_b, q_resid, implementation), cast(int, spec.index_heads))
        norm = indexer.k_norm
        ik = normalise(self._linear(indexer.wk, x, implementation), norm.scale[...], spec.norm_eps, centre=True,
                       bias=norm.bias[...])[:, None]
        iq, ik = rotate(indexer_rope(spec), iq, ik, positions, start)
        w = self._linear(indexer.weights_proj, x, implementation)
        return iq, ik, w.astype(jnp.promote_types(w.dtype, jnp.float32)) * cast(int, spec.index_heads) ** -0.5

    def _choose(self, call: _Call, q: Array, iq: Array, ik: Array, w: Array, **extra: Any) -> tuple[Array, Array]:
        """The indexer's scores (B, T, S) and choice (B, T, S) among the keys the call's
        attention (``extra``: a cached step's lengths and offset) lets each query see."""
        attention = self._attention(call, q, ik, False, **extra)
        visible = visible_keys(attention, q.shape[-2], ik.shape[-2])
        return top_keys(index_scores(iq, ik, w, self.precision), visible, cast(int, self.spec.index_topk))

    def _sparse(self, call: _Call, q: Array, index: tuple[Array, Array, Array] | None, chosen: Array | None,
                **extra: Any) -> _Call:
        """The call with the selection (given, else the indexer's) joined to its mask."""
        if chosen is None:
            if index is None:
                return call
            # the choice is not differentiated (transformers': no_grad)
            chosen = jax.lax.stop_gradient(self._choose(call, q, *index, **extra)[1])[:, None]
        return call._replace(mask=chosen if call.mask is None else call.mask & chosen)

    def _mix(self, call: _Call, q: Array, latent: Array, k_rope: Array, return_weights: bool, key: Array | None,
             absorb: bool, **extra: Any) -> Any:
        """Attention of q (B, H, T, qk_head_dim) over the latent (B, 1, S, kv_lora_rank)
        and the rope key (B, 1, S, rope): keys and values expanded by ``kv_b_proj``, or
        (``absorb``) its key part folded into q and its value part applied after.
        -> out (B, H, T, v_head_dim) (and the weights (B, H, T, S))."""
        spec = self.spec
        heads, nope, dv = spec.num_heads, cast(int, spec.qk_nope_head_dim), cast(int, spec.v_head_dim)
        if absorb:
            # kernel (kv_lora_rank, H * (nope + dv)) -> (H, nope + dv, kv_lora_rank), torch's weight layout
            w = self._proj("kv_b_proj").kernel[...].astype(q.dtype).T.reshape(heads, nope + dv, -1)
            q_latent = jnp.einsum("bhtn,hnr->bhtr", q[..., :nope], w[:, :nope], precision=self.precision)
            keys = jnp.concatenate((latent, k_rope), axis=-1)
            result = self._attend(call, jnp.concatenate((q_latent, q[..., nope:]), axis=-1), keys, latent,
                                  return_weights, key, **extra)
            out = result[0] if return_weights else result
            out = jnp.einsum("bhtr,hvr->bhtv", out, w[:, nope:], precision=self.precision)
        else:
            kv = split_heads(self._linear(self._proj("kv_b_proj"), latent[:, 0], call.implementation), heads)
            k = jnp.concatenate((kv[..., :nope], jnp.broadcast_to(k_rope, (*kv.shape[:3], k_rope.shape[-1]))),
                                axis=-1)
            result = self._attend(call, q, k, kv[..., nope:], return_weights, key, **extra)
            out = result[0] if return_weights else result
        return (out, result[1]) if return_weights else out

    def _attend(self, call: _Call, q: Array, k: Array, v: Array, return_weights: bool, key: Array | None,
                **extra: Any) -> Any:
        """The base's attention of the call, at the latent scale."""
        return super()._attend(call, q, k, v, return_weights, key, scale=self.softmax_scale, **extra)

    def _out(self, result: Any, return_weights: bool, implementation: str) -> Any:
        """(B, H, T, v_head_dim) -> o_proj of the merged heads (B, T, d_in), and the weights."""
        out = result[0] if return_weights else result
        b, h, num_tokens, dv = out.shape
        merged = self._linear(self._proj("o_proj"), out.transpose(0, 2, 1, 3).reshape(b, num_tokens, h * dv), implementation)
        return (merged, result[1]) if return_weights else merged

    def _run(self, call: _Call, return_weights: bool, key: Array | None,  # type: ignore[override]
             absorb: bool = False, chosen: Array | None = None) -> Any:
        q, latent, k_rope, q_resid = self._latent_inputs(call.x, call.implementation, call.positions)
        index = None
        if self.spec.index_topk is not None and chosen is None:
            index = self._index_inputs(call.x, q_resid, call.implementation, call.positions)
        call = self._sparse(call, q, index, chosen)
        return self._out(self._mix(call, q, latent, k_rope, return_weights, key, absorb), return_weights,
                         call.implementation)

    def _run_cached(self, call: _Call, return_weights: bool, key: Array | None,  # type: ignore[override]
                    absorb: bool = False, chosen: Array | None = None) -> Any:
        """A decode step: x's latent and rope key appended to (a new) cache, then x attends
        to every filled position (keys and values rebuilt from the cache, or absorbed),
        query t of example b at key position lengths[b] + t; fixed shapes (max_len), the
        attention over the first positions up to the fullest fill, a step past max_len
        under jit recorded in the cache (as ``_cache.run_cached``).  Sparse attention: the
        indexer's key stored after each latent, its choice among the first n positions."""
        start = call.cache.lengths
        rank, sparse = cast(int, self.spec.kv_lora_rank), self.spec.index_topk is not None
        q, latent, k_rope, q_resid = self._latent_inputs(call.x, call.implementation, call.positions, start)
        index = None
        if sparse:
            index = self._index_inputs(call.x, q_resid, call.implementation, call.positions, start)
            latent = jnp.concatenate((latent, index[1].astype(latent.dtype)), axis=-1)  # (B, 1, T, rank + Di)
        if chosen is not None:  # a given choice (B, 1, T, max_len): cut with the call's mask
            call = call._replace(mask=chosen if call.mask is None else call.mask & chosen)
        cache, ok = append_to_cache(call.cache, latent, k_rope, new_lengths(call))
        filled = cache.lengths  # after the write (the same as before on an overflow)

        def attend(c: _Call, n: int) -> Any:
            latents, ropes = (t[:, :, :n].astype(q.dtype) for t in (cache.key, cache.value))
            extra: dict[str, Any] = {"kv_lengths": filled, "q_offset": start, "alignment": "top_left"}
            if sparse:  # the indexer's keys of the first n positions, after the latents
                latents, index_keys = latents[..., :rank], latents[..., rank:]
                if chosen is None and index is not None:
                    c = self._sparse(c, q, (index[0], index_keys, index[2]), None, **extra)
            return self._mix(c, q, latents, ropes, return_weights, key, absorb, **extra)

        result = attend_filled(self, call, attend, filled, int(cache.key.shape[2]), return_weights)
        out = self._out(result, return_weights, call.implementation)
        if return_weights:
            return unless(ok, out[0]), unless(ok, out[1]), cache
        return unless(ok, out), cache
