"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values expanded per head
from one low-rank latent, which is all a decoding cache holds (with the one rope key that
every head shares).  The math is ``attention_spec.latent``'s.

Twin of ``jax_attention/latent.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

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
from torch_attention import functional
from torch_attention._base import AttentionModule, _Call, _unbatch
from torch_attention._cache import new_cache, prefix
from torch_attention._cache_data import restored_on_failure
from torch_attention._canonical import _band, _bias_allows, _length_mask
from torch_attention._projections import split_heads
from torch_attention._qk import normalise, rotate
from torch_attention.masks import _and_masks


class Indexer(nn.Module):
    """Sparse attention's (DSA) indexer, ``transformers``' ``DeepseekV32Indexer``'s layers
    and names (``attention_spec.latent.indexer_layers``): ``wq_b``, ``wk``, the LayerNorm
    ``k_norm`` (epsilon ``norm_eps``), ``weights_proj``.  Its work is the latent
    attention's (``MultiHeadLatentAttention._index_inputs``)."""

    def __init__(self, spec: Any, factory: dict[str, Any]) -> None:
        super().__init__()
        for name, kind, fan_in, fan_out in indexer_layers(spec):
            layer = (nn.LayerNorm(fan_in, eps=spec.norm_eps, **factory) if kind == "layer"
                     else nn.Linear(fan_in, fan_out, bias=False, **factory))
            setattr(self, name, layer)


def index_scores(iq: Tensor, ik: Tensor, w: Tensor) -> Tensor:
    """The indexer's scores, as ``transformers``' (in float32 at least: float64 stays):
    iq (B, Hi, T, Di) and ik (B, 1, S, Di) turned, w (B, T, Hi) already times Hi ** -0.5 ->
    ``sum_h w[t, h] * relu(iq[h, t] . ik[s] * Di ** -0.5)`` (B, T, S)."""
    work = torch.promote_types(iq.dtype, torch.float32)
    scores = torch.relu(torch.matmul(iq.to(work), ik.to(work).transpose(-1, -2)) * iq.shape[-1] ** -0.5)
    # (B, T, 1, Hi) @ (B, T, Hi, S) -> (B, T, S): the heads summed by their weights
    return torch.matmul(w.to(work).unsqueeze(-2), scores.transpose(1, 2)).squeeze(-2)


def visible_keys(call: functional.Call, q_len: int, kv_len: int, device: Any) -> Tensor | None:
    """(B or 1, T, S) bool: the keys the attention of ``call`` lets each query see (its
    mask, a -inf bias, segments, causal / window, lengths), a key seen by any head; None
    if every key is.  What the indexer chooses among."""
    mask = _and_masks(call.mask, None if call.bias is None else _bias_allows(call.bias), call.segments,
                      _band(q_len, kv_len, call.offset, call.options, 4, device),
                      None if call.kv_lengths is None else _length_mask(call.kv_lengths, kv_len, 4))
    return None if mask is None else mask.expand(*mask.shape[:2], q_len, kv_len).any(dim=1)


def top_keys(scores: Tensor, visible: Tensor | None, topk: int) -> tuple[Tensor, Tensor]:
    """The indexer's choice: scores (B, T, S) -inf where not ``visible``, and each query's
    top ``min(topk, S)`` of them, as bool (B, T, S) (True = selected, visible only).  Equal
    scores go to the earlier key (a stable sort; ``jax.lax.top_k``'s order): the ReLU makes
    exact ties (0) common, and both twins and the oracle break them alike."""
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    chosen.scatter_(-1, order[..., : min(topk, scores.shape[-1])], True)
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

    Sparse attention (DSA; DeepSeek-V3.2, GLM-5): ``index_topk`` (with ``index_heads``,
    ``index_head_dim`` and ``q_lora_rank``) adds the submodule ``indexer``
    (``transformers``' names: ``wq_b``, ``wk``, the LayerNorm ``k_norm``,
    ``weights_proj``), which scores every visible key for every query
    (``attention_spec.latent``: float32, ReLU, per-head weights, its own rope in
    ``index_rope_layout``) and keeps each query's top ``index_topk``; the attention (every
    path, absorbed or not) reads that choice as a mask beside the call's own.  The choice
    is not differentiated.  A call's ``selection`` (bool (B, T, S), True = selected; S =
    T, or the cache's max_len) replaces it (another layer's choice: GLM-5's shared
    layers; the harness's).  ``select_keys`` returns the choice and the scores.  The
    cache holds the indexer's key after each token's latent.
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
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(locals(), dtype=dtype, device=device)
        for name, width in self.spec.latent_norms():  # weight ones, as Hugging Face's
            setattr(self, name, nn.RMSNorm(width, eps=self.spec.norm_eps, dtype=dtype, device=device))
        if self.spec.index_topk is not None:
            self.indexer = Indexer(self.spec, {"dtype": dtype, "device": device})
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
        selection: Any = None,
    ) -> Any:
        """As every variant's call (``AttentionModule.forward``), self-attention only;
        ``absorb=True`` attends in the absorbed form.  A ``cache`` from ``init_cache``
        takes x's latent and rope key; returns ``(out, cache)``.  ``selection`` (sparse
        attention only): the keys each query attends to, in place of the indexer's."""
        check_latent_call(context, absorb)
        call = self._prepare(x, mask, dropout_mask, kv_lengths, implementation, bias, segment_ids=segment_ids,
                             kv_segment_ids=kv_segment_ids, cache=cache, return_weights=return_weights,
                             positions=positions)
        chosen = self._checked_selection(selection, call)
        if call.cache is not None:
            return self._run_cached(call, return_weights, absorb, chosen)
        return _unbatch(self._run(call, return_weights, absorb, chosen), call.batched)

    def select_keys(self, x: Tensor, *, positions: Any = None) -> tuple[Tensor, Tensor]:
        """Sparse attention's choice for x (B, T, d_in) or (T, d_in), no cache: the keys
        each query attends to, bool (B, T, T) (True = selected), and the indexer's scores
        (B, T, T) in float32 (float64 stays), -inf at the keys the module's structure
        hides (causal, window).  Not differentiated.  Raises ValueError without an indexer."""
        if self.spec.index_topk is None:
            raise ValueError(SELECT_KEYS_ONLY_SPARSE)
        call = self._prepare(x, None, None, None, None, positions=positions)
        with torch.no_grad():
            q, _, _, q_resid = self._latent_inputs(call.x, call.implementation, call.positions)
            iq, ik, w = self._index_inputs(call.x, q_resid, call.implementation, call.positions)
            scores, chosen = self._choose(call, q, iq, ik, w)
        return (chosen, scores) if call.batched else (chosen[0], scores[0])

    def _checked_selection(self, selection: Any, call: _Call) -> Tensor | None:
        """A call's ``selection`` checked (``check_selection``) -> (B, 1, T, S) on x's device."""
        if selection is None:
            return None
        batch, seq = call.x.shape[0], call.x.shape[1]
        keys = seq if call.cache is None else int(call.cache.key.shape[2])
        expected = (batch, seq, keys) if call.batched else (seq, keys)
        shape = tuple(getattr(selection, "shape", ()))
        check_selection(shape, dtype_name(selection.dtype) if isinstance(selection, Tensor) else type(selection).__name__,
                        expected, self.spec.index_topk is not None)
        chosen = selection.to(call.x.device)
        return (chosen if call.batched else chosen[None])[:, None]

    def init_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> functional.KVCache:
        """An empty latent cache: ``key`` holds the normalised latent (batch_size, 1,
        max_len, kv_lora_rank; sparse attention: then the indexer's key, index_head_dim more), ``value`` the turned rope key (batch_size, 1, max_len,
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
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """x (B, T, d_in) -> q (B, H, T, qk_head_dim) with its rope part turned, the
        normalised latent (B, 1, T, kv_lora_rank), the turned rope key (B, 1, T, rope),
        and the queries' low-rank input (B, T, q_lora_rank) (None without q_lora_rank)."""
        spec = self.spec
        q_a = None
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
        return q, latent.unsqueeze(1), k_rope, q_a

    def _index_inputs(self, x: Tensor, q_resid: Any, implementation: str, positions: Tensor | None,
                      start: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The indexer's queries (B, Hi, T, Di) and key (B, 1, T, Di), turned by its rope
        (``indexer_rope``), and its head weights (B, T, Hi) times Hi ** -0.5, in float32
        at least."""
        spec, indexer = self.spec, cast(Any, self.indexer)
        iq = split_heads(self._linear(indexer.wq_b, q_resid, implementation), cast(int, spec.index_heads))
        norm = cast(nn.LayerNorm, indexer.k_norm)
        ik = normalise(self._linear(indexer.wk, x, implementation), norm.weight, spec.norm_eps, centre=True,
                       bias=norm.bias).unsqueeze(1)
        iq, ik = rotate(indexer_rope(spec), iq, ik, positions, start)
        w = self._linear(indexer.weights_proj, x, implementation)
        return iq, ik, w.to(torch.promote_types(w.dtype, torch.float32)) * cast(int, spec.index_heads) ** -0.5

    def _choose(self, call: _Call, q: Tensor, iq: Tensor, ik: Tensor, w: Tensor,
                **extra: Any) -> tuple[Tensor, Tensor]:
        """The indexer's scores (B, T, S) and choice (B, T, S) among the keys the call's
        attention (``extra``: a cached step's lengths and offset) lets each query see."""
        attention = self._attention(call, q, ik, False, **extra)
        visible = visible_keys(attention, q.shape[-2], ik.shape[-2], q.device)
        return top_keys(index_scores(iq, ik, w), visible, cast(int, self.spec.index_topk))

    def _sparse(self, call: _Call, q: Tensor, index: tuple[Tensor, Tensor, Tensor] | None, chosen: Tensor | None,
                **extra: Any) -> _Call:
        """The call with the selection (given, else the indexer's) joined to its mask."""
        if chosen is None:
            if index is None:
                return call
            with torch.no_grad():  # the choice is not differentiated (transformers': no_grad)
                chosen = self._choose(call, q, *index, **extra)[1][:, None]
        return call._replace(mask=chosen if call.mask is None else call.mask & chosen)

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

    def _run(self, call: _Call, return_weights: bool, absorb: bool = False,  # type: ignore[override]
             chosen: Tensor | None = None) -> Any:
        q, latent, k_rope, q_resid = self._latent_inputs(call.x, call.implementation, call.positions)
        index = None
        if self.spec.index_topk is not None and chosen is None:
            index = self._index_inputs(call.x, q_resid, call.implementation, call.positions)
        call = self._sparse(call, q, index, chosen)
        return self._out(self._mix(call, q, latent, k_rope, return_weights, absorb), return_weights,
                         call.implementation)

    def _run_cached(self, call: _Call, return_weights: bool, absorb: bool = False,  # type: ignore[override]
                    chosen: Tensor | None = None) -> Any:
        """A decode step: x's latent and rope key (and the indexer's key, after the latent)
        appended to the cache, then x attends to every filled position (keys and values
        rebuilt from the cache, or absorbed; sparse: the indexer's choice among them),
        query t of example b at key position lengths[b] + t."""
        cache = call.cache
        batch, seq = call.x.shape[0], call.x.shape[1]
        rank, sparse = cast(int, self.spec.kv_lora_rank), self.spec.index_topk is not None
        lengths = call.kv_lengths if call.kv_lengths is not None else torch.full(
            (batch,), seq, dtype=torch.int64, device=call.x.device)
        start = cache.lengths.clone()
        q, latent, k_rope, q_resid = self._latent_inputs(call.x, call.implementation, call.positions, start)
        index = None
        if sparse:
            index = self._index_inputs(call.x, q_resid, call.implementation, call.positions, start)
            latent = torch.cat((latent, index[1].to(latent.dtype)), dim=-1)  # (B, 1, T, rank + Di)
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
            extra: dict[str, Any] = {"kv_lengths": kv_lengths, "q_offset": q_offset, "alignment": "top_left"}
            if sparse:  # the indexer's keys of every filled position, after the latents
                latents, index_keys = latents[..., :rank], latents[..., rank:]
                index = None if index is None else (index[0], index_keys, index[2])
                call = self._sparse(call, q, index if chosen is None else None,
                                    None if chosen is None else chosen[..., :filled], **extra)
            result = self._mix(call, q, latents, rope_keys, return_weights, absorb, **extra)
            if return_weights:  # zero weights on the unfilled positions: (B, H, T, max_len), as the twin's
                out, weights = self._out(result, True, call.implementation)
                return out, torch.nn.functional.pad(weights, (0, cache.key.shape[2] - filled)), cache
            return self._out(result, False, call.implementation), cache
