"""Multi-head attention: a wrapper of single heads, and heads split from one projection
(seed 004; seed 000's last section without the output projection).

Twin of ``jax_attention/multihead.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from torch_attention._base import AttentionModule, _head_slice, _unbatch
from torch_attention.causal import CausalAttention


class MultiHeadAttentionWrapper(AttentionModule):
    """``num_heads`` independent ``CausalAttention`` heads (``heads[i]``), outputs
    concatenated: (B, T, d_in) -> (B, T, num_heads * d_out); weights (B, num_heads, T, T).

    A mask or dropout mask with a head dimension of ``num_heads`` gives head i its slice.
    A call is checked once, here; the heads then run on the checked input.
    """

    variant = "MultiHeadAttentionWrapper"

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int | None,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
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
        head = self.spec.head().options()
        self.heads = nn.ModuleList(
            CausalAttention(**head, dtype=dtype, device=device) for _ in range(self.spec.num_heads)
        )

    def forward(
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
        kv: Any = None,
        return_kv: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        call = self._prepare(x, mask, dropout_mask, kv_lengths, implementation, bias, context=context,
                             segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, cache=cache,
                             return_weights=return_weights, positions=positions, kv=kv,
                             return_kv=return_kv)  # (refused by name: a wrapper shares no kv)
        results = [
            cast(CausalAttention, head)._run(
                call._replace(mask=_head_slice(call.mask, i), dropout_mask=_head_slice(call.dropout_mask, i),
                              bias=_head_slice(call.bias, i)),
                return_weights,
            )
            for i, head in enumerate(self.heads)
        ]
        if not return_weights:
            out = torch.cat(cast(list[Tensor], results), dim=-1)  # (B, T, num_heads * d_out)
            return _unbatch(out, call.batched)
        pairs = cast(list[tuple[Tensor, Tensor]], results)
        out = torch.cat([o for o, _ in pairs], dim=-1)
        weights = torch.cat([w for _, w in pairs], dim=-3)  # (B, num_heads, T, S)
        return _unbatch((out, weights), call.batched)


class MultiHeadAttention(AttentionModule):
    """Causal multi-head attention with weight splits: one ``nn.Linear(d_in, d_out)`` per
    q/k/v (``W_query``, ``W_key``, ``W_value``) split into ``num_heads`` heads of
    ``d_out // num_heads``, heads mixed by ``out_proj`` (``nn.Linear(d_out, d_out)``).
    ``out_proj=False`` only concatenates the heads (seed 000).

    Free widths: ``head_dim=`` sets the width of one head (q/k/v then map d_in to
    ``num_heads * head_dim``, k/v ``num_kv_heads * head_dim``; d_out need not be a
    multiple of num_heads), ``out_features=`` the width ``out_proj`` maps the merged
    heads to (None: d_out; Gemma: 8 heads x 256 -> 2304), ``out_bias=False`` drops
    ``out_proj``'s bias (Llama's ``o_proj``).  Without ``out_proj`` the output is the
    merged heads, so ``num_heads * head_dim`` must equal d_out.

    ``clip_qkv=c`` (OLMo): the q, k and v projections' outputs, biases added, are clamped
    to [-c, c] before qk-norm and rope (the gradient passes inside, bounds included, as
    ``torch.clamp``'s).  ``output_gate=True`` (Qwen3-Next, Qwen3.5): ``W_query`` has
    ``2 * num_heads * head_dim`` outputs, each head's ``head_dim`` queries then its
    ``head_dim`` gate features (Hugging Face's ``q_proj`` as it is); the merged heads
    are multiplied by ``sigmoid(gate)`` before ``out_proj``.  With both, the gate is
    clamped too (it is W_query's output).  ``output_gate_activation="softplus"`` (Laguna):
    ``softplus(gate)`` in float32 at least, cast back, instead of the sigmoid;
    ``output_gate_per_head=True`` (Laguna's per-head ``g_proj``): one gate value a head,
    ``W_query`` then has ``num_heads * (head_dim + 1)`` outputs, each head's queries then
    its one gate value, which scales the head's ``head_dim`` features.
    ``output_gate_bias=True`` (Beam's ``gate_bias``): a parameter ``gate_bias`` of shape
    (num_heads,), zeros at first, each head's added to its gate before the activation.
    ``out_norm="rms"`` (BitNet's ``attn_sub_norm``): an RMSNorm with a weight ``out_norm``
    (``num_heads * head_dim`` wide, ones at first; epsilon ``qk_norm_eps``) of the merged
    heads, after the gate, before ``out_proj``.

    qk-norm: ``qk_norm="rms"`` or ``"layer"`` normalises the projected queries and keys
    (``q_norm``, ``k_norm``: a learnable weight, and a bias for ``"layer"``; ``eps`` =
    ``qk_norm_eps``) before attention, per head over head_dim (``qk_norm_scope="head"``:
    Qwen3, Phi's ``qk_layernorm``) or over all heads together (``"all"``: OLMo 2).
    ``qk_norm_offset=1.0``: the norms scale by ``1 + weight`` (Gemma 3's RMSNorm; the
    weights then start at zeros).
    ``qk_norm_position="after_rope"`` (HunYuan's ``query_layernorm`` / ``key_layernorm``):
    the qk-norm runs on the turned q and k (before any ``query_scale``) instead of on the
    projections; a cache then holds keys normed after their turn, as HunYuan's.
    ``qk_norm_weight=False`` (nanochat, Llama 4's ``L2Norm``): a weightless RMS norm
    ``x * rsqrt(mean(x^2) + eps)``, no ``q_norm`` / ``k_norm`` parameter (``qk_norm="rms"``
    only; the families norm after rope, which a rotation does not change: the same to
    rounding).  ``v_norm="rms"`` (Gemma 4): each value head through a weightless RMS
    norm (``qk_norm_eps``), so a cache holds normed values.  ``values_from_keys=True``
    (Gemma 4's ``attention_k_eq_v``): no ``W_value``; the values are ``W_key``'s output
    before k-norm and rope (then ``v_norm``).  ``query_scale=QueryScale(beta, floor,
    offset)`` (``attention_spec.options``; Llama 4's attention temperature tuning,
    Ministral 3's ``llama_4_scaling_beta``): after rope and qk-norm the queries at
    position p are multiplied by ``1 + beta * log1p(floor((p + offset) / floor))``
    (``query_scale_kind="power"``, Beam's scalable softmax: ``(1 + (p + offset) / floor) **
    beta``), at
    the call's ``positions=`` (rope's positions; taken without rope too) or, with a cache,
    each example's fill onward; self-attention only.
    Keys and values shared across layers (Gemma 4's ``num_kv_shared_layers``, a layer
    whose ``kv_sharing_modes`` entry is ``"reuse"``): ``kv_shared=True`` builds only
    ``W_query`` (and ``q_norm``) and ``out_proj``; its call takes another layer's keys and
    values, ``kv=(k, v)`` as that layer's call with ``return_kv=True`` returns them
    (``(out, (k, v))``: (B, Hkv, T, D) each, normed and rotated, on the same x's length),
    or, in cached decoding, ``kv=cache``, the storing layer's ``KVCache`` after its call on
    the same tokens: read, never written (the call returns ``out`` alone; queries at each
    example's fill minus its valid tokens onward).  The reusing module rotates (and
    scales) only its queries, at its own ``positions=``; its mask, window, scale and
    soft cap are its own.  Gradients flow through ``kv`` into the storing layer.
    Rotary position embeddings: ``rope=`` (an ``attention_spec.rope.RopeConfig``) turns q and k
    after the head split, before attention, at the call's ``positions=`` (integers
    (B, T); None: 0..T-1, or, with a cache, each example's fill onward); the frequencies
    are computed from the config, or are a port's own (``RopeConfig(inv_freq=...)``); no
    parameter.  Self-attention only (no ``context=``).
    Chunked local attention (Llama 4's ``attention_chunk_size``): ``chunk=C`` lets the query
    at key position p see only keys j with ``j // C == p // C``, with ``causal`` and
    ``window`` too; in cached decoding the cache's slots are those positions.
    Attention sinks (gpt-oss): ``sinks=True`` adds a parameter ``sinks`` of shape
    (num_heads,), zeros at first: each head's learned logit joins every softmax's
    denominator as a key without a value, so a query's weights sum to less than 1.
    Flex attention's mods: ``score_mod=`` (``score_mod(score, b, h, q_idx, kv_idx)``) and
    ``mask_mod=`` (``mask_mod(b, h, q_idx, kv_idx)``, True = may attend), from
    ``attention_spec.mods`` or written in this framework's operations; ``q_idx`` and
    ``kv_idx`` are key positions (a query's own position in self-attention, each
    example's fill onward in a cached step).  A mod that stands for a named option
    (``causal``, ``sliding_window``, ``softcap``) is that option, on every path; any other
    runs on the flex path (``"auto"``) or the reference math, after the soft cap and
    the call's bias, with the module's own mask (``to_flax`` / ``to_torch`` carry library
    mods).

    (B, T, d_in) -> (B, T, out_features or d_out); weights (B, num_heads, T, T).
    Scale None = 1/sqrt(head_dim).  ``context_length=None``: no cap on T (a port of
    ``nn.MultiheadAttention``).  ``dtype``/``device`` as ``nn.Linear``'s.
    """

    variant = "MultiHeadAttention"

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int | None,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        out_proj: bool = True,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        head_dim: int | None = None,
        out_features: int | None = None,
        out_bias: bool = True,
        clip_qkv: float | None = None,
        output_gate: bool = False,
        output_gate_activation: str = "sigmoid",
        output_gate_per_head: bool = False,
        output_gate_bias: bool = False,
        qk_norm: str | None = None,
        qk_norm_scope: str = "head",
        qk_norm_eps: float = 1e-6,
        qk_norm_offset: float = 0.0,
        qk_norm_weight: bool = True,
        qk_norm_position: str = "before_rope",
        v_norm: str | None = None,
        values_from_keys: bool = False,
        query_scale: Any = None,
        query_scale_kind: str = "log",
        kv_shared: bool = False,
        out_norm: str | None = None,
        v_head_dim: int | None = None,
        v_scale: float | None = None,
        rope: Any = None,
        sinks: bool = False,
        score_mod: Any = None,
        mask_mod: Any = None,
        chunk: int | None = None,
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
