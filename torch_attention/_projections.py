"""A module's projections: built as the registry declares them (``new_projection``); q, k
and v from the inputs (``project``: clamped by ``clip_qkv``, the output gate split from
the queries, q and k through the ``"projected"`` transforms of ``_qk`` before the head
split); the heads merged, gated and mixed by ``out_proj`` (``merge``); each product
through ``functional.project`` (``linear``).

Twin of ``jax_attention/_projections.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attention_spec.registry import AttentionConfig, Projection
from torch_attention._linear import project as project_linear
from torch_attention._qk import normalise, rms, transform_projected

# --------------------------------------------------------------------------- construction


def new_projection(spec: AttentionConfig, proj: Projection, factory: dict[str, Any]) -> nn.Module | nn.Parameter:
    """The projection ``proj`` of a module of ``spec``: a bare (d_in, d_out) matrix drawn
    N(0, 1) (``layout="matrix"``), else an ``nn.Linear``; ``factory``: its dtype and
    device."""
    width, fan_in = cast(int, spec.fan_out(proj.role)), cast(int, spec.fan_in(proj.role))
    if proj.layout == "matrix":  # N(0, 1) (d_in, d_out), drawn by torch.randn as in seed 004
        return nn.Parameter(torch.randn(fan_in, width, **factory))
    return nn.Linear(fan_in, width, bias=proj.has_bias(spec), **factory)


# --------------------------------------------------------------------------- the work


def linear(layer: nn.Module | nn.Parameter, inputs: Tensor, implementation: str) -> Tensor:
    """inputs @ a projection's weight (+ bias) through ``functional.project``: an
    ``nn.Linear``'s math, or a bare (d_in, d_out) matrix used as x @ W."""
    if isinstance(layer, nn.Module):  # (tested first: isinstance of a Parameter runs Python code)
        dense = cast(nn.Linear, layer)
        return project_linear(inputs, dense.weight, dense.bias, implementation=implementation)
    return project_linear(inputs, layer.T, implementation=implementation)


def project(module: Any, x: Tensor, keys: Tensor | None, values: Tensor | None,
            implementation: str) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(B, T, d_in) -> q (B, H, T, D); k, v (B, Hkv, S, D) from ``keys`` / ``values``
    (cross-attention) or x, by the module's declared projections (its ``_linear``), on
    ``implementation``'s path: each clamped to [-clip_qkv, clip_qkv] (``clip``), after
    its bias; with ``output_gate``, W_query's gate split from its queries (``split_gate``:
    the fourth of the four, (B, T, H * D), for ``merge``; None without); q and k through
    its ``"projected"`` transforms (``_qk.transform_projected``: qk-norm) before the head
    split.  ``values_from_keys``: v is W_key's output (clamped) before those transforms;
    ``v_norm``: v through a weightless RMS norm per head (``_qk.rms``, ``qk_norm_eps``).
    ``kv_shared``: q alone (k and v None: the call's ``kv=`` are another layer's)."""
    spec = module.spec
    keys = x if keys is None else keys
    values = x if values is None else values
    names = {p.role: p.name for p in spec.projections()}  # (one pass over the registry's list)
    if not names:
        # (B, T, C) -> (B, 1, T, C): one head, the inputs themselves
        return x.unsqueeze(1), keys.unsqueeze(1), values.unsqueeze(1), None
    gate = projected_keys = None

    def one(role: str, inputs: Tensor, heads: int) -> Tensor:
        nonlocal gate, projected_keys
        if role == "value" and spec.values_from_keys:  # Gemma 4's attention_k_eq_v: no W_value
            t = cast(Tensor, projected_keys)
        else:
            t = clip(module._linear(getattr(module, names[role]), inputs, implementation), spec.clip_qkv)
        if role == "query" and spec.output_gate:  # (B, T, H * (D + G)) -> queries, gate (B, T, H * G)
            t, gate = split_gate(t, heads, spec.gate_width())
        if role == "key":
            projected_keys = t
        if role != "value":
            t = transform_projected(module, role, t)
        elif spec.v_norm is not None:  # Gemma 4's v_norm: each value head, no weight
            t = rms(t, cast(int, spec.value_head_dim), spec.qk_norm_eps)
        if role == "value" and spec.v_scale is not None:  # MiMo-V2-Flash: the values times a constant
            t = t * spec.v_scale
        # (B, T, d_in) -> (B, T, heads * D) -> (B, heads, T, D)
        return split_heads(t, heads)

    if spec.kv_shared:  # no W_key / W_value: the call's kv= are another layer's (k and v None here)
        return one("query", x, spec.num_heads), cast(Tensor, None), cast(Tensor, None), gate
    kv_heads = spec.kv_heads
    q, k, v = one("query", x, spec.num_heads), one("key", keys, kv_heads), one("value", values, kv_heads)
    return q, k, v, gate


def split_heads(t: Tensor, heads: int) -> Tensor:
    b, num_tokens, width = t.shape
    # (B, T, heads * D) -> (B, T, heads, D) -> (B, heads, T, D)
    return t.view(b, num_tokens, heads, width // heads).transpose(1, 2)


def merge(module: Any, out: Tensor, implementation: str, gate: Tensor | None = None) -> Tensor:
    """Heads (B, H, T, Dv) -> (B, T, H * Dv), times the activated gate with ``output_gate``
    (``apply_gate``: the gate ``project`` split from this call's queries, (B, T, H * G)),
    through ``out_norm`` (an RMSNorm of the merged heads, BitNet's ``attn_sub_norm``) where it
    has one, mixed by the module's ``out_proj`` (its ``_linear``) where it has one."""
    spec = module.spec
    b, h, num_tokens, head_dim = out.shape
    # (B, H, T, D) -> (B, T, H, D) -> (B, T, H * D)
    out = out.transpose(1, 2).reshape(b, num_tokens, h * head_dim)
    if spec.output_gate:
        assert gate is not None, "a module with output_gate merges with the gate its project split"
        out = apply_gate(spec, out, gate, module.gate_bias if spec.output_gate_bias else None)
    if spec.out_norm is not None:  # BitNet's attn_sub_norm: over the merged heads, with a weight
        out = normalise(out, module.out_norm.weight, spec.qk_norm_eps)
    out_proj = getattr(module, "out_proj", None)
    return out if out_proj is None else module._linear(out_proj, out, implementation)  # heads mixed


# --------------------------------------------------------------------------- clip_qkv, the output gate


def clip(t: Tensor, clip_qkv: float | None) -> Tensor:
    """t clamped to [-clip_qkv, clip_qkv] (OLMo's ``clip_qkv``; ``torch.clamp``: the
    gradient passes where -c <= t <= c, zero outside); unchanged for None."""
    return t if clip_qkv is None else t.clamp(-clip_qkv, clip_qkv)


def split_gate(t: Tensor, heads: int, gate_width: int) -> tuple[Tensor, Tensor]:
    """W_query's output (B, T, heads * (D + G)) of a gated module -> queries (B, T, heads *
    D) and gate (B, T, heads * G): each head's features are its D queries, then its G gate
    features (G = D: Qwen3-Next's ``q_proj(x).view(B, T, H, 2D).chunk(2, -1)``; G = 1:
    ``output_gate_per_head``, one value a head)."""
    b, num_tokens, _ = t.shape
    per_head = t.view(b, num_tokens, heads, -1)  # (B, T, H, D + G)
    queries = per_head.shape[-1] - gate_width
    return per_head[..., :queries].reshape(b, num_tokens, -1), per_head[..., queries:].reshape(b, num_tokens, -1)


def apply_gate(spec: AttentionConfig, out: Tensor, gate: Tensor, bias: Tensor | None = None) -> Tensor:
    """The merged heads (B, T, H * D) times the activated gate (B, T, H * G): sigmoid(gate)
    in the gate's dtype (Qwen3-Next, AFMoE) or softplus(gate) in float32 at least, cast
    back (Laguna's ``F.softplus(g.float())``); G = 1 (``output_gate_per_head``) scales each
    head's D features by its one value.  ``bias`` (H,) (``output_gate_bias``, Beam's
    ``gate_bias``): each head's added to its G gate features first."""
    if bias is not None:
        b, num_tokens, width = gate.shape
        # (B, T, H, G) + (H, 1) -> (B, T, H * G)
        gate = (gate.view(b, num_tokens, spec.num_heads, -1) + bias[:, None]).view(b, num_tokens, width)
    if spec.output_gate_activation == "softplus":
        activated = F.softplus(gate.to(torch.promote_types(gate.dtype, torch.float32))).to(out.dtype)
    else:
        activated = torch.sigmoid(gate)
    if not spec.output_gate_per_head:
        return out * activated
    b, num_tokens, width = out.shape
    # (B, T, H, D) * (B, T, H, 1) -> (B, T, H * D)
    return (out.view(b, num_tokens, spec.num_heads, -1) * activated.unsqueeze(-1)).view(b, num_tokens, width)


