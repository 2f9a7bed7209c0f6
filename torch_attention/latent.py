"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values expanded per head
from one low-rank latent, which is all a decoding cache holds (with the one rope key that
every head shares).  The math is ``attention_spec.latent``'s.

Twin of ``jax_attention/latent.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from attention_spec.latent import cache_bytes_per_token, check_latent_call, softmax_scale
from torch_attention import functional
from torch_attention._base import AttentionModule, _Call, _unbatch
from torch_attention._cache import new_cache, prefix, restored_on_failure
from torch_attention._projections import split_heads
from torch_attention._qk import normalise


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
    rope parts unturned (the shared key then carries no position).  ``query_scale``
    (an ``attention_spec.options.QueryScale``; Mistral 4's ``llama_4_scaling_beta``)
    multiplies the whole query, after rope, by ``1 + beta * log1p(floor((p + offset) /
    floor))`` at its position p, as ``MultiHeadAttention``'s.  ``scale`` None:
    ``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when rope
    scales by YaRN.  ``attention_bias``: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and
    ``o_proj`` (never on ``q_proj``, ``q_b_proj``, ``kv_b_proj``).  ``norm_eps``: both
    RMSNorms' epsilon (transformers' layer: 1e-6 whatever the model's ``rms_norm_eps``).

    (B, T, d_in) -> (B, T, d_in); weights (B, num_heads, T, T).  Self-attention only.
    A call takes every option of the other variants' calls (mask, kv_lengths, bias,
    segment ids, dropout_mask, implementation, return_weights, positions, cache) and
    ``absorb``: attend in the absorbed form (``kv_b_proj`` folded into the query and the
    output, the heads reading the latent itself), the same numbers up to rounding.
    ``init_cache`` holds the latent and the turned rope key, ``kv_lora_rank +
    qk_rope_head_dim`` numbers a token (``cache_bytes_per_token``).
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
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(locals(), dtype=dtype, device=device)
        for name, width in self.spec.latent_norms():  # weight ones, as Hugging Face's
            setattr(self, name, nn.RMSNorm(width, eps=self.spec.norm_eps, dtype=dtype, device=device))
        self.softmax_scale = softmax_scale(self.spec)

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        context: Any = None,
        return_weights: bool = False,
        dropout_mask: Tensor | None = None,
        kv_lengths: Any = None,
        implementation: str | None = None,
        bias: Tensor | None = None,
        segment_ids: Any = None,
        kv_segment_ids: Any = None,
        cache: Any = None,
        positions: Any = None,
        absorb: bool = False,
    ) -> Any:
        """As every variant's call (``AttentionModule.forward``), self-attention only;
        ``absorb=True`` attends in the absorbed form.  A ``cache`` from ``init_cache``
        takes x's latent and rope key; returns ``(out, cache)``."""
        check_latent_call(context, absorb)
        call = self._prepare(x, mask, dropout_mask, kv_lengths, implementation, bias, segment_ids=segment_ids,
                             kv_segment_ids=kv_segment_ids, cache=cache, return_weights=return_weights,
                             positions=positions)
        if call.cache is not None:
            return self._run_cached(call, return_weights, absorb)
        return _unbatch(self._run(call, return_weights, absorb), call.batched)

    def init_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> functional.KVCache:
        """An empty latent cache: ``key`` holds the normalised latent (batch_size, 1,
        max_len, kv_lora_rank), ``value`` the turned rope key (batch_size, 1, max_len,
        qk_rope_head_dim), zeros in ``dtype`` (None: the module's); ``lengths`` the fill.
        Raises as ``AttentionModule.init_cache``."""
        return new_cache(self, batch_size, max_len, dtype)  # (the widths: spec.cache_widths())

    @staticmethod
    def cache_bytes_per_token(cache: functional.KVCache) -> int:
        """Bytes a token takes in ``cache``: ``(kv_lora_rank + qk_rope_head_dim) * itemsize``."""
        return cache_bytes_per_token((tuple(t.shape), t.element_size()) for t in cache)

    # ------------------------------------------------------------------ the work

    def _proj(self, name: str) -> nn.Linear:
        """The projection called ``name`` (Hugging Face's name)."""
        return cast(nn.Linear, getattr(self, name))

    def _rms(self, name: str, t: Tensor) -> Tensor:
        """Hugging Face's RMSNorm: in float32 (float64 stays), cast back, times the weight
        (``_qk.normalise``, qk-norm's math, over the whole width)."""
        return normalise(t, getattr(self, name).weight, self.spec.norm_eps)

    def _latent_inputs(
        self, x: Tensor, implementation: str, positions: Tensor | None, start: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, d_in) -> q (B, H, T, qk_head_dim) with its rope part turned, the
        normalised latent (B, 1, T, kv_lora_rank), the turned rope key (B, 1, T, rope)."""
        spec = self.spec
        if spec.q_lora_rank is None:
            q = self._linear(self._proj("q_proj"), x, implementation)
        else:
            q_a = self._rms("q_a_layernorm", self._linear(self._proj("q_a_proj"), x, implementation))
            q = self._linear(self._proj("q_b_proj"), q_a, implementation)
        q_nope, q_rope = split_heads(q, spec.num_heads).split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        compressed = self._linear(self._proj("kv_a_proj_with_mqa"), x, implementation)
        latent, k_rope = compressed.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        latent = self._rms("kv_a_layernorm", latent)
        q_rope, k_rope = self._rotate(q_rope, k_rope.unsqueeze(1), positions, start)
        # Mistral 4: the whole query (nope and rope parts) scaled by position, after rope
        q, k_rope = self._scale_queries(torch.cat((q_nope, q_rope), dim=-1), k_rope, positions, start)
        return q, latent.unsqueeze(1), k_rope

    def _mix(self, call: _Call, q: Tensor, latent: Tensor, k_rope: Tensor, return_weights: bool, absorb: bool,
             **extra: Any) -> Any:
        """Attention of q (B, H, T, qk_head_dim) over the latent (B, 1, S, kv_lora_rank)
        and the rope key (B, 1, S, rope): keys and values expanded by ``kv_b_proj``, or
        (``absorb``) its key part folded into q and its value part applied after, the
        heads attending over ``concat(latent, rope key)`` with the latent as values.
        -> out (B, H, T, v_head_dim) (and the weights (B, H, T, S))."""
        spec = self.spec
        heads, nope, dv = spec.num_heads, cast(int, spec.qk_nope_head_dim), cast(int, spec.v_head_dim)
        if absorb:
            w = self._proj("kv_b_proj").weight.view(heads, nope + dv, -1)  # (H, nope + dv, kv_lora_rank)
            q_latent = torch.einsum("bhtn,hnr->bhtr", q[..., :nope], w[:, :nope])
            keys = torch.cat((latent, k_rope), dim=-1)
            result = self._attend(call, torch.cat((q_latent, q[..., nope:]), dim=-1), keys, latent,
                                  return_weights, **extra)
            out = result[0] if return_weights else result
            out = torch.einsum("bhtr,hvr->bhtv", out, w[:, nope:])
        else:
            kv = split_heads(self._linear(self._proj("kv_b_proj"), latent[:, 0], call.implementation), heads)
            k_nope, v = kv.split([nope, dv], dim=-1)
            k = torch.cat((k_nope, k_rope.expand(-1, heads, -1, -1)), dim=-1)
            result = self._attend(call, q, k, v, return_weights, **extra)
            out = result[0] if return_weights else result
        return (out, result[1]) if return_weights else out

    def _attend(self, call: _Call, q: Tensor, k: Tensor, v: Tensor, return_weights: bool, **extra: Any) -> Any:
        """The base's attention of the call, at the latent scale."""
        return super()._attend(call, q, k, v, return_weights, scale=self.softmax_scale, **extra)

    def _out(self, result: Any, return_weights: bool, implementation: str) -> Any:
        """(B, H, T, v_head_dim) -> o_proj of the merged heads (B, T, d_in), and the weights."""
        out = result[0] if return_weights else result
        b, h, num_tokens, dv = out.shape
        merged = self._linear(self._proj("o_proj"), out.transpose(1, 2).reshape(b, num_tokens, h * dv), implementation)
        return (merged, result[1]) if return_weights else merged

    def _run(self, call: _Call, return_weights: bool, absorb: bool = False) -> Any:  # type: ignore[override]
        q, latent, k_rope = self._latent_inputs(call.x, call.implementation, call.positions)
        return self._out(self._mix(call, q, latent, k_rope, return_weights, absorb), return_weights,
                         call.implementation)

    def _run_cached(self, call: _Call, return_weights: bool, absorb: bool = False) -> Any:  # type: ignore[override]
        """A decode step: x's latent and rope key appended to the cache, then x attends to
        every filled position (keys and values rebuilt from the cache, or absorbed), query
        t of example b at key position lengths[b] + t."""
        cache = call.cache
        batch, seq = call.x.shape[0], call.x.shape[1]
        lengths = call.kv_lengths if call.kv_lengths is not None else torch.full(
            (batch,), seq, dtype=torch.int64, device=call.x.device)
        start = cache.lengths.clone()
        q, latent, k_rope = self._latent_inputs(call.x, call.implementation, call.positions, start)
        with restored_on_failure(cache, seq):  # (a failure after the write puts the cache back)
            cache = functional.append_to_cache(cache, latent, k_rope, lengths.to(q.device))
            filled = int(cache.lengths.max())  # eager: attend over the filled prefix only
            latents, rope_keys = cache.key[:, :, :filled].to(q.dtype), cache.value[:, :, :filled].to(q.dtype)
            if latents.requires_grad or rope_keys.requires_grad:  # the next step writes in place: read a copy
                latents, rope_keys = latents.clone(), rope_keys.clone()
            call = call._replace(mask=prefix(call.mask, filled), bias=prefix(call.bias, filled),
                                 dropout_mask=prefix(call.dropout_mask, filled))
            kv_lengths: Tensor | None = start + lengths.to(q.device)
            q_offset: Tensor | int = start
            if bool((start == start[0]).all()) and bool((lengths == seq).all()):
                q_offset, kv_lengths = int(start[0]), None  # one fill for all: a static offset
            result = self._mix(call, q, latents, rope_keys, return_weights, absorb, kv_lengths=kv_lengths,
                               q_offset=q_offset, alignment="top_left")
            if return_weights:  # zero weights on the unfilled positions: (B, H, T, max_len), as the twin's
                out, weights = self._out(result, True, call.implementation)
                return out, torch.nn.functional.pad(weights, (0, cache.key.shape[2] - filled)), cache
            return self._out(result, False, call.implementation), cache
