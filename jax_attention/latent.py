"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values expanded per head
from one low-rank latent, which is all a decoding cache holds (with the one rope key that
every head shares).  The math is ``attention_spec.latent``'s.

Twin of ``torch_attention/latent.py``.
"""

from __future__ import annotations

from typing import Any, cast

import jax.numpy as jnp
from flax import nnx
from jax import Array

from attention_spec.latent import cache_bytes_per_token, check_latent_call, softmax_scale
from jax_attention import functional
from jax_attention._base import AttentionModule, _Call, _unbatch
from jax_attention._cache import append_to_cache, attend_filled, new_cache, new_lengths, unless
from jax_attention._projections import split_heads
from jax_attention._qk import normalise


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
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(locals(), dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        for name, width in self.spec.latent_norms():  # scale ones, as PyTorch's weight
            setattr(self, name, nnx.RMSNorm(width, epsilon=self.spec.norm_eps, dtype=dtype,
                                            param_dtype=param_dtype, rngs=rngs))
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
    ) -> Any:
        """As every variant's call (``AttentionModule.__call__``), self-attention only;
        ``absorb=True`` attends in the absorbed form.  A ``cache`` from ``init_cache``
        takes x's latent and rope key; returns ``(out, new_cache)``."""
        check_latent_call(context, absorb)
        call = self._prepare(x, mask, dropout_mask, deterministic, kv_lengths, implementation, bias,
                             segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, cache=cache,
                             return_weights=return_weights, positions=positions)
        key = self._draw_key(call, rngs, return_weights)  # after every check: it advances a stream
        if call.cache is not None:
            return self._run_cached(call, return_weights, key, absorb)
        return _unbatch(self._run(call, return_weights, key, absorb), call.batched)

    def init_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> functional.KVCache:
        """An empty latent cache: ``key`` holds the normalised latent (batch_size, 1,
        max_len, kv_lora_rank), ``value`` the turned rope key (batch_size, 1, max_len,
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
    ) -> tuple[Array, Array, Array]:
        """x (B, T, d_in) -> q (B, H, T, qk_head_dim) with its rope part turned, the
        normalised latent (B, 1, T, kv_lora_rank), the turned rope key (B, 1, T, rope)."""
        spec = self.spec
        nope, rank = cast(int, spec.qk_nope_head_dim), cast(int, spec.kv_lora_rank)
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
        return q, latent[:, None], k_rope

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
             absorb: bool = False) -> Any:
        q, latent, k_rope = self._latent_inputs(call.x, call.implementation, call.positions)
        return self._out(self._mix(call, q, latent, k_rope, return_weights, key, absorb), return_weights,
                         call.implementation)

    def _run_cached(self, call: _Call, return_weights: bool, key: Array | None,  # type: ignore[override]
                    absorb: bool = False) -> Any:
        """A decode step: x's latent and rope key appended to (a new) cache, then x attends
        to every filled position (keys and values rebuilt from the cache, or absorbed),
        query t of example b at key position lengths[b] + t; fixed shapes (max_len), the
        attention over the first positions up to the fullest fill, a step past max_len
        under jit recorded in the cache (as ``_cache.run_cached``)."""
        start = call.cache.lengths
        q, latent, k_rope = self._latent_inputs(call.x, call.implementation, call.positions, start)
        cache, ok = append_to_cache(call.cache, latent, k_rope, new_lengths(call))
        filled = cache.lengths  # after the write (the same as before on an overflow)

        def attend(c: _Call, n: int) -> Any:
            latents, ropes = (t[:, :, :n].astype(q.dtype) for t in (cache.key, cache.value))
            return self._mix(c, q, latents, ropes, return_weights, key, absorb, kv_lengths=filled, q_offset=start,
                             alignment="top_left")

        result = attend_filled(self, call, attend, filled, int(cache.key.shape[2]), return_weights)
        out = self._out(result, return_weights, call.implementation)
        if return_weights:
            return unless(ok, out[0]), unless(ok, out[1]), cache
        return unless(ok, out), cache
