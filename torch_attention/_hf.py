"""Hugging Face ``transformers`` attention layers <-> our ``MultiHeadAttention`` (and,
for DeepSeek-V2/V3, our ``MultiHeadLatentAttention``: ``_hf_latent``).

``from_hf(layer)`` reads one attention layer of a ``transformers`` model (its weights,
its ``config``, its ``layer_idx`` and the layer type that picks a per-layer window or
rope) and gives our ``MultiHeadAttention`` with the same weights and behaviour;
``to_hf(ours, layer)`` writes our weights back into a compatible layer, in place.
``transformers`` is imported by neither (a test dependency): everything is read from
the layer's attributes.  Exported from ``torch_attention.interop``.

Each supported class is one ``_Family``: where its q/k/v/o weights live (separate
``nn.Linear``s, or one packed q/k/v weight split by ``attention_spec.interop.packing``), its
qk-norm, whether it turns q and k by rope.  Every other option is read from the layer as
Hugging Face's own forward reads it: ``scaling`` (Gemma's ``query_pre_attn_scalar ** -0.5``,
GPT-2's ``scale_attn_weights`` / ``scale_attn_by_inverse_layer_idx``), ``sliding_window``
(``attention_spec.interop.huggingface.window_from_hf``), ``attn_logit_softcapping``, ``is_causal``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from attention_spec.interop.conversion import as_numpy, rules_for
from attention_spec.interop.huggingface import window_from_hf
from attention_spec.interop.packing import pack_state_dict, packed_state_dict
from attention_spec.interop.qkv import CODEGEN_SHARDS, UNHEADED
from attention_spec.interop.specs import (
    Joined,
    MergeAxes,
    Rule,
    SplitAxis,
    Transpose,
    packed_qkv_rules,
)
from attention_spec.mods import Alibi, alibi
from attention_spec.rope import LAYOUTS, RopeConfig, needs_seq_len, rope_from_hf, rotary_dim
from torch_attention._hf_common import _forward_takes, _hf_inv_freq, _rope_mismatch, _rotary_class
from torch_attention.latent import MultiHeadLatentAttention
from torch_attention.multihead import MultiHeadAttention

__all__ = ["from_hf", "hf_children", "hf_rules", "hf_families_table", "recognises_hf_layer", "supported_hf_classes", "to_hf"]


@dataclasses.dataclass(frozen=True)
class _Family:
    """Where one ``transformers`` attention class keeps its weights.  Names are dotted
    paths from the layer (BERT's q/k/v live in ``layer.self``, its o in ``layer.output``)."""

    label: str
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    packed: str | None = None  # one packed q/k/v weight (then q, k, v are unused)
    packing: str = "thirds"  # attention_spec.interop.packing's order along the packed axis
    layout: str = "out_in"  # "in_out": GPT-2's Conv1D, x @ W
    norms: tuple[str, str] | None = None  # the q and k norms, where present
    norm: str = "rms"
    norm_scope: str = "head"
    norm_offset: bool = False  # Gemma 3's RMSNorm scales by (1 + weight)
    norm_weight: bool = True  # False: a weightless RMS qk-norm (nanochat's, Llama 4's L2Norm)
    v_norm: bool = False  # Gemma 4's weightless value norm (``v_norm``)
    values_from_keys: bool = False  # Gemma 4's attention_k_eq_v layers: no v_proj (then v is "")
    kv_shared: bool = False  # Gemma 4's "reuse" layers: no k_proj / v_proj / k_norm / v_norm (k, v "")
    rope: bool = True
    rope_layout: str | None = None  # attention_spec.rope.LAYOUTS: the pairs its rotation turns (None: the config's)
    attention: str = ""  # the sub-module with is_causal / scaling ("self" for BERT)
    sinks: bool = False  # gpt-oss: one learned sink logit per head, ``sinks``
    not_ours: str | None = None  # a sub-module of the layer that ours does not cover (BERT's LayerNorm)
    gate: str = ""  # a separate sigmoid output gate (AFMoE's ``gate_proj``): ours is output_gate, its rows
    #                 interleaved with q_proj's per head in W_query (``_interleave``)
    gate_activation: str = "sigmoid"  # the gate's activation, by a probe ("softplus": Laguna's g_proj)
    gate_per_head: bool = False  # one gate value a head (Laguna's per-head g_proj: num_heads rows)
    gate_bias: bool = False  # one bias a head added to the gate (Beam's gate_bias)
    norm_after_rope: bool = False  # a weighted qk-norm of the turned q and k (HunYuan's query_layernorm)
    out_norm: str = ""  # an RMSNorm of the merged heads before the output projection (BitNet's attn_sub_norm)
    out_bias: str = ""  # an output bias the layer holds apart from its o projection and returns for its decoder
    #                 layer to add (GPT-NeoX-Japanese's ``dense_bias``): ours is out_proj's bias
    rope_reversed: bool = False  # nanochat: halves turned by -angle; ours holds q/k rows with the second half
    #                 of each head's turned features negated (``_flip_halves``), which turns them so exactly


# The families proven in tests/interop/test_from_hf.py (and, model by model, in
# tests/interop/test_hf_families.py).  ``from_hf`` does not look a layer up here: it reads what
# the layer holds (``_recognise``); these are the names ``supported_hf_classes`` gives.
_PROVEN = ("GPT2Attention", "LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
           "GemmaAttention", "Gemma2Attention", "Gemma3Attention", "GPTNeoXAttention", "PhiAttention",
           "Phi3Attention", "Olmo2Attention", "BertAttention", "ViTAttention", "GptOssAttention")


# DeepSeek's latent attention: ours is MultiHeadLatentAttention (``_hf_latent``).
LATENT_CLASSES = ("DeepseekV2Attention", "DeepseekV3Attention")
_LATENT_HOLDS = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def supported_hf_classes() -> tuple[str, ...]:
    """The ``transformers`` attention classes proven against ``from_hf`` one layer at a time
    (``tests/interop/test_from_hf.py``).  ``from_hf`` takes any layer whose mechanisms it
    knows, whatever its class (``recognises_hf_layer``; ``hf_families_table`` lists the
    families of the installed ``transformers`` it ports)."""
    return (*_PROVEN, *LATENT_CLASSES)


# The separate projections (q, k, v, o) under the names the families use.
_SEPARATE = (("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "k_proj", "v_proj", "dense"),
             ("q_proj", "k_proj", "v_proj", "out_proj"), ("query", "key", "value", "dense"),
             ("q_proj", "k_proj", "v_proj", "Wo"))
# One packed q/k/v weight: (name, its output projection, the packing where no probe can tell
# (``_packing``), the config's model types that rule is known for (empty: any)).  The layout
# follows the projection's kind (GPT-2's Conv1D: (in, out); nn.Linear: (out, in)); the
# packing is found by what the layer computes where it can be called.
_PACKED = (("c_attn", ("c_proj",), "thirds", ()), ("query_key_value", ("dense",), "per_head", ("gpt_neox",)),
           ("qkv_proj", ("o_proj", "out_proj"), "grouped", ()), ("Wqkv", ("out_proj",), "thirds", ()))
_NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"), ("query_layernorm", "key_layernorm"),
          ("qk_norm", "qk_norm"))  # Llama 4: one weightless L2Norm (an RMS norm) for q and k
# Sub-modules no mechanism of ours covers yet, by what they are.
_KNOWN_EXTRAS = {
    "indexer": "sparse attention (an indexer that chooses the keys: DeepSeek-V3.2 / GLM-5)",
    "compressor": "compressed attention (DeepSeek-V4's compressor)",
    "v_norm": "a value norm",
    "gate_proj": "an output gate (gate_proj)", "g_proj": "an output gate (g_proj)",
    "q_gate_proj": "an output gate (q_gate_proj)",
    "o_norm": "a norm of the attention output before its projection (o_norm)",
    "qk_norm": "a weightless qk-norm (qk_norm: L2)",
    "experts": "a mixture of attention experts",
}
# Layer kinds that are not softmax attention, by the parameters and sub-modules they hold.
_NOT_SOFTMAX: tuple[tuple[set[str], str], ...] = (
    ({"A_log", "D"}, "a state-space layer (Mamba), not softmax attention"),
    ({"A_log", "dt_bias"}, "a linear-attention layer (gated delta rule), not softmax attention"),
)
# The config switches of mechanisms ours cannot express yet (config attribute, the mechanism).
_CONFIG_REFUSALS = (
    ("num_kv_shared_layers", "KV shared across layers (num_kv_shared_layers)"),
    ("use_alibi", "ALiBi position biases"),
)
# Call conventions that say the layer takes what ours does not compute.
_FORWARD_REFUSALS = {"sinusoidal_pos": "rotary positions its model passes in as sinusoidal_pos (RoFormer's)"}
# ALiBi biases its model builds and passes in (the layer holds no slopes): ours is score_mod=alibi(slopes),
# the slopes computed from the heads (and the config) as its model does (``_alibi_slopes``): Bloom's ``alibi``
# (``build_alibi_tensor``), MPT's ``position_bias`` (``build_mpt_alibi_tensor``, ``attn_config.alibi_bias_max``).
# Bloom's ``residual``, added inside its layer, stays its decoder layer's (the caller's): ours gives the
# attention output alone.


def _nope(layer: Any) -> bool:
    """Whether this layer turns no q and k although its family has rope (NoPE layers), as
    the family's forward decides: SmolLM3 and Llama 4 by ``use_rope``
    (``config.no_rope_layers[layer_idx]``); Cohere 2 (and Cohere 2 MoE unless
    ``force_rope``) only on its sliding layers; Exaone 4, Exaone-MoE and Kolibri when the
    config has a window, only on the sliding layers; Beam where its layer type's rope
    parameters are None (its full-attention layers)."""
    if getattr(layer, "use_rope", True) is False or getattr(layer, "use_rope", 1) == 0:
        return True
    params = getattr(_config(layer), "rope_parameters", None)  # Beam: a layer type whose rope parameters are None
    if isinstance(params, Mapping) and params.get(_layer_type(layer, layer), {}) is None:
        return True
    model_type = str(getattr(getattr(layer, "config", None), "model_type", ""))
    if model_type in ("cohere2", "cohere2_moe"):
        return getattr(layer, "sliding_window", None) is None and not getattr(layer, "force_rope", False)
    if model_type in ("exaone4", "exaone4_5", "exaone_moe", "kolibri1"):
        return getattr(layer, "sliding_window", None) is not None and not getattr(layer, "is_sliding", True)
    return False


_HEADS = ("num_attention_heads", "num_heads", "n_head", "n_heads")


def _config(attention: Any) -> Any:
    """The layer's model config; for a layer that keeps none (GPT-1's, XGLM's, MPT's), what
    its own attributes say of it: its heads (``num_heads`` / ``n_head`` / ``n_heads``), as
    a config would.  None where the layer says neither."""
    config = getattr(attention, "config", None)
    if config is not None or not isinstance(attention, nn.Module):
        return config
    heads = next((getattr(attention, a) for a in _HEADS if type(getattr(attention, a, None)) is int), None)
    if heads is None:
        return None
    return _LayerConfig(num_attention_heads=heads, num_key_value_heads=heads)


@dataclasses.dataclass(frozen=True)
class _LayerConfig:
    """What a layer without its model's config says of itself (``_config``)."""

    num_attention_heads: int
    num_key_value_heads: int
    model_type: str = ""


def _causal(attention: Any) -> bool:
    """Whether the layer masks the future itself: its ``is_causal``, else a lower-triangular
    mask it keeps as a buffer (GPT-1's ``bias``, (1, 1, n, n))."""
    if hasattr(attention, "is_causal"):
        return bool(attention.is_causal)
    tril = getattr(attention, "bias", None)
    if isinstance(tril, torch.Tensor) and not isinstance(tril, nn.Parameter) and tril.dim() == 4 and not tril.is_meta:
        square = tril[0, 0]
        return bool(square.shape[0] == square.shape[1] and torch.equal(square, torch.ones_like(square).tril()))
    return False


def _scaling(attention: Any, head_dim: int) -> float:
    """The layer's score scale: its ``scaling``, else GPT-1's ``scale`` switch (1 / sqrt(d)
    when set, 1 when not), else 1 / its ``norm_factor`` (GPT-NeoX-Japanese's divisor)."""
    scaling = getattr(attention, "scaling", None)
    if scaling is None and type(getattr(attention, "scale", None)) is bool:
        return head_dim ** -0.5 if attention.scale else 1.0
    if scaling is None and isinstance(getattr(attention, "norm_factor", None), float):
        return 1.0 / attention.norm_factor
    for name in ("inv_norm_factor", "softmax_scale"):  # Bloom's (its beta 1), MPT's
        if scaling is None and isinstance(getattr(attention, name, None), float):
            return float(getattr(attention, name))
    return float(scaling)  # type: ignore[arg-type]


def _child(layer: Any, name: str) -> Any:
    child = getattr(layer, name, None) if name else layer
    return child if isinstance(child, nn.Module) else None


def _is_linear(module: Any) -> bool:
    """A plain ``nn.Linear`` (a subclass may change its weight in forward: BitNet's), or
    GPT-2's ``Conv1D`` (x @ W + b)."""
    return type(module) is nn.Linear or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def _refused(layer: Any, problems: list[str]) -> ValueError:
    return ValueError(f"this {type(layer).__name__} cannot be expressed as MultiHeadAttention: " + "; ".join(problems))


def _norm_kind(norm: nn.Module) -> tuple[str, bool] | str:
    """(``"rms"`` or ``"layer"``, whether it scales by ``1 + w``), found by what a copy
    of the norm computes with its weight set to 0 and 1 (its own weights are not read);
    or the reason it is none of ours."""
    import copy

    params = dict(norm.named_parameters())
    if not params and not list(norm.children()) and _weightless_rms(norm):
        return "weightless", False  # nanochat's RMSNorm, Llama 4's L2Norm, Gemma 4's v_norm
    if "weight" not in params:
        if any(isinstance(c, nn.ModuleList) for c in norm.children()):
            return "a LayerNorm per head with its own weights (StableLM's q_layernorm)"
        return f"a qk-norm without a weight ({type(norm).__name__})"
    if set(params) - {"weight", "bias"}:
        return f"a qk-norm with parameters {sorted(set(params) - {'weight', 'bias'})}"
    if params["weight"].dim() != 1:  # Cohere's use_qk_norm: a LayerNorm weight (heads, head_dim)
        return (f"a qk-norm with its own weight per head ({type(norm).__name__}, weight "
                f"{tuple(params['weight'].shape)}: ours shares one across the heads)")
    probe = torch.linspace(-1.0, 2.0, 2 * int(params["weight"].shape[-1]), dtype=torch.float32)
    probe = probe.reshape(2, -1) + torch.tensor([[0.5], [-0.25]])
    twin: Any = copy.deepcopy(norm).float()
    eps = _norm_eps(norm)
    rms = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps)
    centred = probe - probe.mean(-1, keepdim=True)
    layer_norm = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    with torch.no_grad():
        if "bias" in params:
            twin.bias.zero_()
        found = []
        for w in (0.0, 1.0):
            twin.weight.fill_(w)
            found.append(twin(probe).float())
    for kind, want in (("rms", rms), ("layer", layer_norm)):
        if kind == "layer" and "bias" not in params:
            continue  # ours has a bias: Cohere's LayerNorm without one is not ours
        if torch.allclose(found[1], want, atol=1e-5) and torch.allclose(found[0], torch.zeros_like(want), atol=1e-6):
            return kind, False
        if torch.allclose(found[0], want, atol=1e-5) and torch.allclose(found[1], 2 * want, atol=1e-5):
            return kind, True
    return f"a qk-norm that is neither RMSNorm nor LayerNorm with a bias ({type(norm).__name__})"


def _weightless_rms(norm: nn.Module) -> bool:
    """Whether a norm without parameters computes ``x * rsqrt(mean(x^2) + eps)`` over the
    last axis (its ``eps``), on a probe."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, float | int):
        return False
    probe = torch.linspace(-1.0, 2.0, 16, dtype=torch.float32).reshape(2, 8) + torch.tensor([[0.5], [-0.25]])
    try:
        with torch.no_grad():
            got = norm(probe).float()
    except Exception:  # noqa: BLE001 - a norm the probe cannot call is none of ours
        return False
    want = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps)
    return bool(got.shape == want.shape and torch.allclose(got, want, atol=1e-6))


def _recognise(layer: Any, what: str) -> _Family:
    """What ``layer`` holds, as a ``_Family``, from its sub-modules, its config and its
    call convention (not its class); raises TypeError for what is no attention layer of a
    ``transformers`` model, ValueError naming each mechanism ours cannot express, before
    any weight is read."""
    if isinstance(layer, nn.Module):
        own_params = {n for n, _ in layer.named_parameters(recurse=False)}
        for needs, mechanism in _NOT_SOFTMAX:
            if needs <= own_params:
                raise ValueError(f"{type(layer).__name__}: {mechanism}")
        from torch_attention import _hf_delta

        if _hf_delta.layout(layer) is not None:  # Kimi's KDA keeps A_log in its forget_gate
            raise ValueError(f"{type(layer).__name__}: {_hf_delta.LINEAR_ATTENTION}")
    if not isinstance(layer, nn.Module) or _config(_attention_of(layer)) is None:
        raise TypeError(f"{what} takes the attention layer of a transformers model (an nn.Module with a config "
                        f"and q/k/v/o projections, e.g. {', '.join(_PROVEN[:3])}, ...); got {type(layer).__name__}")
    attention = _attention_of(layer)
    name = type(layer).__name__
    params = {n for n, _ in layer.named_parameters()}
    own = {n for n, _ in layer.named_parameters(recurse=False)}
    children = dict(layer.named_children())
    problems = _mechanism_refusals(layer, attention)
    try:
        family = _projections(layer, attention)
    except ValueError:
        if problems:  # Bloom's query_key_value, which no probe can call: its mechanisms first
            raise _refused(layer, problems) from None
        raise
    if family is None:
        if problems:
            raise _refused(layer, problems)
        raise TypeError(f"{what} takes the attention layer of a transformers model, with q/k/v/o projections "
                        f"under names it knows ({', '.join('/'.join(s) for s in _SEPARATE)}, or packed: "
                        f"{', '.join(p[0] for p in _PACKED)}); got {name}, holding "
                        f"{', '.join(sorted(children)) or 'no sub-modules'}")
    norms = next((pair for pair in _NORMS if all(_child(layer, n) is not None for n in pair)), None)
    if family.kv_shared:  # Gemma 4's "reuse" layers: a q_norm alone (the keys come normed)
        norms = next((pair for pair in _NORMS if _child(layer, pair[0]) is not None
                      and _child(layer, pair[1]) is None), None)
    norm_kind: tuple[str, bool] | None = None
    if norms is not None:
        kinds = [_norm_kind(_child(layer, n)) for n in (norms[:1] if family.kv_shared else norms)]
        bad = [k for k in kinds if isinstance(k, str)]
        if bad:
            problems.append(bad[0])
        elif kinds[0] != kinds[-1]:
            problems.append("q and k norms of different kinds")
        else:
            norm_kind = kinds[0]  # type: ignore[assignment]
    v_norm = _child(layer, "v_norm")  # Gemma 4: a weightless RMS norm of each value head
    if v_norm is not None and _norm_kind(v_norm) == ("weightless", False):
        family = dataclasses.replace(family, v_norm=True)
    gate, gate_problems, gate_kind = _separate_gate(layer, family)
    problems += gate_problems
    if isinstance(getattr(layer, "dense_bias", None), nn.Parameter):  # GPT-NeoX-Japanese: (out, weights, bias)
        if _get(layer, family.o).bias is not None:
            problems.append(f"an output bias returned apart (`dense_bias`) beside `{family.o}`'s own bias")
        family = dataclasses.replace(family, out_bias="dense_bias")
    if gate:
        family = dataclasses.replace(family, gate=gate, gate_activation=gate_kind[0], gate_per_head=gate_kind[1],
                                     gate_bias="gate_bias" in own)
    out_norm, out_problems = _out_norm(layer, family)
    problems += out_problems
    if out_norm:
        family = dataclasses.replace(family, out_norm=out_norm)
    covered = {family.o, *((family.packed,) if family.packed else (family.q, family.k, family.v)), *(norms or ()),
               *(("v_norm",) if family.v_norm else ()), *((gate,) if gate else ()), *((out_norm,) if out_norm else ()),
               *((_OUT_NORM,) if out_problems else ()),
               *(_GATES if gate_problems else ())}  # (a gate refused above is named once)
    if family.not_ours:
        covered.update((family.not_ours.split(".")[0], family.o.split(".")[0]))  # BERT's `output`: dense and the rest
    if getattr(layer, "is_cross_attention", False):
        covered.add("q_attn")  # GPT-2's cross-attention query: refused above, named once
    for child_name, child in _named_children(layer, family):
        if child_name in covered or child_name == family.attention or isinstance(child, nn.Dropout | nn.Identity):
            continue
        problems.append(f"{_KNOWN_EXTRAS.get(child_name.split('.')[-1], 'a sub-module no mechanism accounts for')}: "
                        f"`{child_name}` ({type(child).__name__})")
    for p in sorted(own - {"sinks", *(("gate_bias",) if gate_problems or family.gate_bias else ()),
                           *((family.out_bias,) if family.out_bias else ())}):
        problems.append(f"a parameter no mechanism accounts for: `{p}`")
    for proj in (family.o, family.packed) if family.packed else (family.q, family.k, family.v, family.o):
        if not proj:  # Gemma 4's keys as values: no v_proj
            continue
        module = _get(layer, proj)
        if not _is_linear(module):
            problems.append(f"`{proj}` is a {type(module).__name__}, not nn.Linear (its forward may change the weight)")
        elif set(dict(module.named_parameters())) - {"weight", "bias"}:
            problems.append(f"`{proj}` holds parameters other than a weight and a bias")
    if not family.packed and family.k and family.v and family.attention:
        k_rows, v_rows = (int(_get(layer, n).weight.shape[0]) for n in (family.k, family.v))
        if k_rows != v_rows:  # (BERT-like blocks: one head width)
            problems.append(f"value heads of another width than the key heads (`{family.v}` gives {v_rows} features, "
                            f"`{family.k}` {k_rows}) in a block whose caller decides what it attends to")
    unscaled = (getattr(attention, "scaling", None) is None and type(getattr(attention, "scale", None)) is not bool
                and not any(isinstance(getattr(attention, n, None), float)
                            for n in ("norm_factor", "inv_norm_factor", "softmax_scale")))
    if not problems and unscaled:
        problems.append("a score scale it keeps under no name from_hf reads (no `scaling`: it scales inside its forward)")
    if problems:
        raise _refused(layer, problems)
    del params
    label = name.removesuffix("Attention")
    rope = not family.attention and "position_embeddings" in _forward_takes(attention) and not _nope(attention)
    if rope and not _probe_rotates(layer, _d_in(layer, family)):
        rope = False  # a NoPE layer by what it computes (Flint's full-attention layers)
    layout = _rope_layout(layer, attention) if rope else None
    reverse = layout == _REVERSED  # nanochat: ours turns q and k with each head's second half negated
    if reverse:
        layout = "half"
        blocked = _reversal_blocked(layer, family, norm_kind)
        if blocked:
            raise _refused(layer, [f"halves turned by -angle (as ours turns them with each head's second half "
                                   f"negated) together with {blocked}"])
    weightless = norm_kind is not None and norm_kind[0] == "weightless"  # (it commutes with the rotation)
    # HunYuan: a weighted qk-norm of the turned q and k (qk_norm_position="after_rope")
    after = bool(rope and norms is not None and norm_kind is not None and not weightless
                 and _sees_rotation(layer, norms[0], _d_in(layer, family)))
    if after and reverse:
        raise _refused(layer, ["halves turned by -angle (as ours turns them with each head's second half negated) "
                               "together with a qk-norm after rope"])
    family = dataclasses.replace(family, rope=rope, rope_layout=layout, sinks="sinks" in own, rope_reversed=reverse,
                                 norm_after_rope=after)
    if norms is None or norm_kind is None:
        return dataclasses.replace(family, label=label)
    if weightless:  # nanochat, Llama 4: over each head's features, no parameter
        return dataclasses.replace(family, label=label, norms=norms, norm="rms", norm_weight=False)
    q_norm = _child(layer, norms[0])
    width = int(q_norm.weight.shape[-1])
    head_dim = int(getattr(attention, "head_dim", 0) or 0) or width
    return dataclasses.replace(family, label=label, norms=norms, norm=norm_kind[0], norm_offset=norm_kind[1],
                               norm_scope="head" if width == head_dim else "all")


_GATES = ("gate_proj", "g_proj")  # a separate output gate's projection (AFMoE's, Beam's; Laguna's)
_OUT_NORM = "attn_sub_norm"  # an RMSNorm of the merged heads before the output projection (BitNet's)
# The gate activations ours has (``output_gate_activation``), as the probe tells them apart.
_GATE_ACTIVATIONS = {"sigmoid": lambda v: 1.0 / (1.0 + math.exp(-v)), "softplus": lambda v: math.log1p(math.exp(v))}


def _separate_gate(layer: nn.Module, family: _Family) -> tuple[str, list[str], tuple[str, bool]]:
    """A separate output gate ours expresses as ``output_gate`` (AFMoE's ``gate_proj``: an
    ``nn.Linear`` of the model width to as many outputs as ``q_proj``, biased as q_proj is,
    or Laguna's ``g_proj``, one output a head; ``sigmoid(gate)`` or ``softplus(gate)``
    multiplying the merged heads before the output projection, by what the layer computes:
    ``_gate_probe``); ("", [], _) where the layer has none, else ("", what refuses it, _);
    the third is (its activation, whether it has one value a head)."""
    plain = ("sigmoid", False)
    name = next((n for n in _GATES if _child(layer, n) is not None), "")
    if not name or family.packed or family.kv_shared or family.values_from_keys or family.attention:
        return "", [], plain
    module, q = _get(layer, name), _get(layer, family.q)
    problems = []
    if not _is_linear(module) or set(dict(module.named_parameters())) - {"weight", "bias"}:
        return "", [f"an output gate `{name}` that is a {type(module).__name__}, not nn.Linear"], plain
    rows, q_rows = int(module.weight.shape[0]), int(q.weight.shape[0])
    heads = _heads_of(layer)
    per_head = rows == heads and q_rows != heads  # Laguna's per-head g_proj: one value a head
    if rows != q_rows and not per_head:
        problems.append(f"an output gate of {rows} values per token (`{name}`; q_proj gives {q_rows}: ours gates each "
                        f"query feature, or each of the {heads} heads)")
    own = dict(layer.named_parameters(recurse=False))
    gate_bias = own.get("gate_bias")  # Beam's: one a head, added to gate_proj's output
    if gate_bias is not None and tuple(gate_bias.shape) != (heads,):
        problems.append(f"a gate bias of shape {tuple(gate_bias.shape)} (`gate_bias`; ours' output_gate_bias is one "
                        f"a head, ({heads},))")
    if per_head and module.bias is not None:
        problems.append(f"an output gate `{name}` of one value a head with a bias (ours' gate bias is W_query's)")
    elif (module.bias is None) != (q.bias is None):
        problems.append(f"an output gate `{name}` {'with' if module.bias is not None else 'without'} a bias where q_proj "
                        f"has {'none' if q.bias is None else 'one'} (ours' gate bias is W_query's)")
    found = _gate_probe(layer, family, name)
    if found[1]:
        problems.insert(0, found[1])
    return ("", problems, plain) if problems else (name, [], (found[0], per_head))


def _heads_of(layer: nn.Module) -> int:
    """The layer's query heads: its config's ``num_attention_heads``, or its own entry of
    ``num_attention_heads_per_layer`` (Laguna's heads per layer)."""
    attention = _attention_of(layer)
    config = _config(attention)
    per_layer, index = getattr(config, "num_attention_heads_per_layer", None), getattr(attention, "layer_idx", None)
    if isinstance(per_layer, list | tuple) and type(index) is int and index < len(per_layer):
        return int(per_layer[index])
    return int(config.num_attention_heads)


def _gate_probe(layer: nn.Module, family: _Family, name: str) -> tuple[str, str]:
    """What the gate ``name`` does to the layer's output, on a probe with its outputs forced
    to 0, 30 and -30 (a forward hook): ours' (``act(gate)`` times the merged heads, then the
    output projection, whose bias alone is left at -30) scales ``out - o_proj(0)`` by
    ``act(v) / act(30)`` at v (sigmoid: 1/2 at 0; softplus: log(2) / 30).  (the activation,
    "") where one of ours does (sigmoid also where the probe cannot call the layer: the
    self-check after the port decides), else ("", what it does, in words)."""
    weight = next(layer.parameters(), None)
    if weight is None or weight.is_meta:
        return "sigmoid", ""
    attention = _attention_of(layer)
    x = _probe_input(layer, _d_in(layer, family))
    mask = _probe_mask(x, None, bool(getattr(attention, "is_causal", True)))
    found = []
    try:
        embeddings = _probe_rotary(layer, attention, x) if "position_embeddings" in _forward_takes(attention) else None
    except Exception:  # noqa: BLE001 - no rotary embedding to build
        embeddings = None
    gate_bias = dict(layer.named_parameters(recurse=False)).get("gate_bias")  # Beam's: 0 for the probe
    kept = None if gate_bias is None else gate_bias.detach().clone()
    for value in (0.0, 30.0, -30.0):
        handle = _get(layer, name).register_forward_hook(lambda _m, _a, out, v=value: torch.full_like(out, v))
        try:
            if gate_bias is not None:
                with torch.no_grad():
                    gate_bias.zero_()
            found.append(_hf_forward(layer, x, mask, embeddings).float())
        except Exception:  # noqa: BLE001 - a call convention the probe does not know
            return "sigmoid", ""
        finally:
            handle.remove()
            if gate_bias is not None:
                with torch.no_grad():
                    gate_bias.copy_(kept)
    with torch.no_grad():
        width = int(_get(layer, family.o).weight.shape[1])
        silent = (_get(layer, family.o)(torch.zeros(1, 1, width, dtype=x.dtype, device=x.device))[0, 0]
                  + _bias_apart(layer)).float()
    zero, whole, low = (f - silent for f in found)
    tol = 1e-5 * max(float(whole.abs().max()), 1e-6)
    for kind, act in _GATE_ACTIVATIONS.items():
        at_zero, at_low = act(0.0) / act(30.0), act(-30.0) / act(30.0)
        if float((zero - at_zero * whole).abs().max()) <= tol and float((low - at_low * whole).abs().max()) <= tol:
            return kind, ""
    ratio = float((zero * whole).sum() / (whole * whole).sum().clamp_min(1e-30))
    return "", (f"an output gate `{name}` that is neither sigmoid(gate) nor softplus(gate) times the heads (its output "
                f"at a gate of 0 is {ratio:.3g} of that at 30, not 0.5 or 0.0231)")


def _out_norm(layer: nn.Module, family: _Family) -> tuple[str, list[str]]:
    """BitNet's ``attn_sub_norm``, an RMSNorm with a weight as wide as the merged heads that
    the output projection reads, ours' ``out_norm="rms"``; ("", []) where the layer has
    none, else ("", what refuses it)."""
    norm = _child(layer, _OUT_NORM)
    if norm is None or family.attention or family.packed:
        return "", []
    what = f"a norm of the attention output before its projection (`{_OUT_NORM}`, {type(norm).__name__})"
    if "weight" not in dict(norm.named_parameters()):  # Dory's L2 norm
        return "", [f"{what} without a weight (ours' out_norm is an RMSNorm with one)"]
    if _norm_kind(norm) != ("rms", False):
        return "", [f"{what} that is not an RMSNorm with a weight (ours' out_norm)"]
    width, merged = int(norm.weight.shape[-1]), int(_get(layer, family.o).weight.shape[1])
    if width != merged:
        return "", [f"{what} {width} wide, where the merged heads are {merged}"]
    return _OUT_NORM, []


def _reversal_blocked(layer: nn.Module, family: _Family, norm_kind: tuple[str, bool] | None) -> str:
    """What keeps ours from turning a layer's halves by -angle (``_flip_halves``: separate
    q/k projections of the layer's heads, a qk-norm none or RMS), in words ("" if nothing)."""
    if norm_kind is not None and norm_kind[0] == "layer":
        return "a qk-norm that centres (a LayerNorm: negated features change its mean)"
    if family.packed or not family.k or family.values_from_keys:
        return "a packed q/k/v, keys shared or keys as values"
    config = _config(_attention_of(layer))
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    q_rows, k_rows = (int(_get(layer, n).weight.shape[0]) for n in (family.q, family.k))
    if family.gate or q_rows * kv_heads != k_rows * heads:
        return "an output gate, or query heads of another width than the keys'"
    return ""


_PROBE_TOKENS = 4
_PROBE_OFFSET = 5  # positions 5..8: no rotation is the identity there


def _probe_input(layer: nn.Module, d_in: int) -> torch.Tensor:
    """A tiny deterministic input (batch 1, a few tokens) in the layer's dtype and device."""
    weight = next(layer.parameters())
    steps = torch.arange(_PROBE_TOKENS * d_in, dtype=torch.float32).reshape(1, _PROBE_TOKENS, d_in)
    return torch.sin(0.37 * steps + 0.1).to(dtype=weight.dtype, device=weight.device)


def _probe_mask(x: torch.Tensor, window: tuple[int | None, int | None] | None, causal: bool,
                chunk: int | None = None) -> torch.Tensor | None:
    """Hugging Face's additive (1, 1, T, T) mask for a causal (and windowed, or chunked:
    ``masking_utils.chunked_causal_mask_function``) layer."""
    if not causal:
        return None
    t = x.shape[1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    allowed = j <= i
    if window is not None and window[0] is not None:
        allowed &= i - j <= window[0]
    if chunk is not None:
        allowed &= i // chunk == j // chunk
    mask = torch.zeros(t, t, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)
    return mask[None, None].to(x.device)


def _probe_rotary(layer: nn.Module, attention: Any, x: torch.Tensor, offset: int = _PROBE_OFFSET) -> Any:
    """The layer's (cos, sin) at the probe's positions (``offset`` on), from the family's
    own rotary embedding built from the layer's config (per layer type where its forward
    takes one); Llama 4's one complex tensor (``freqs_cis``) as it is."""
    with torch.device("cpu"):
        rotary = _rotary_class(layer)(_config(attention))
    rotary = rotary.to(x.device)
    positions = torch.arange(offset, offset + x.shape[1], device=x.device)[None]
    kwargs = {}
    if "layer_type" in _forward_takes(rotary):
        kwargs["layer_type"] = _layer_type(layer, attention)
    out = rotary(x, positions, **kwargs)
    if isinstance(out, torch.Tensor) and out.is_complex():
        return out
    cos, sin = out
    return cos, sin


class _Filled:
    """A cache of ``fill`` positions that holds nothing: a layer that reads its queries'
    positions from its cache (Llama 4's NoPE layers) sees them ``fill`` on; its keys and
    values are the call's own."""

    def __init__(self, fill: int) -> None:
        self.fill = fill

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.fill

    def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return key, value


def _hf_forward(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor | None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
                offset: int = _PROBE_OFFSET) -> torch.Tensor:
    """The layer called as its decoder layer calls it, in eval mode without gradients (at
    positions ``offset`` on: its ``position_ids`` and, for another offset than the
    probe's, a cache of that fill, ``_Filled``)."""
    kwargs: dict[str, Any] = {"attention_mask": mask}
    if offset != _PROBE_OFFSET:
        name = next((n for n in ("cache", "past_key_values", "past_key_value") if n in _forward_takes(layer)), None)
        if name is not None:
            kwargs[name] = _Filled(offset)
    if position_embeddings is not None:
        kwargs["position_embeddings"] = position_embeddings
    if "shared_kv_states" in _forward_takes(layer):  # Gemma 4: the KV-sharing layers' dict
        reuses = getattr(layer, "is_kv_shared_layer", None) is True  # a "reuse" layer reads the probe's kv
        kwargs["shared_kv_states"] = {_layer_type(layer, layer): _probe_kv(layer, x)} if reuses else {}
    if "position_ids" in _forward_takes(layer):  # Ministral 3 scales its queries by position
        kwargs["position_ids"] = torch.arange(offset, offset + x.shape[1], device=x.device)[None]
    scaling = _model_scaling(layer)
    if callable(scaling):  # Beam's NoPE layers: the query scale its model computes from the positions
        kwargs["attention_scaling"] = scaling(torch.arange(offset, offset + x.shape[1], device=x.device)[None])
    kwargs.update(_alibi_inputs(layer, x, mask))
    training = layer.training
    layer.eval()
    try:
        with torch.no_grad():
            out = layer(x, **kwargs)
    finally:
        layer.train(training)
    if isinstance(out, tuple) and len(out) == 3 and isinstance(getattr(layer, "dense_bias", None), torch.Tensor):
        return out[0] + out[2].detach()  # GPT-NeoX-Japanese: its decoder layer adds the bias it returns (eval: no dropout)
    return out[0] if isinstance(out, tuple | list) else out


def _alibi_inputs(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> dict[str, Any]:
    """What a layer with ALiBi takes from its model, built as its model builds it over the
    probe's tokens: Bloom's ``alibi`` (B * H, 1, T) and ``residual`` (0: the output alone),
    MPT's ``position_bias`` (H, 1, T) and its bool mask (True where masked)."""
    slopes = _alibi_slopes(layer)
    takes = _forward_takes(layer)
    found: dict[str, Any] = {}
    if slopes is not None and "alibi" in takes:
        keys = torch.arange(x.shape[1], dtype=torch.float32)
        found["alibi"] = (slopes[:, None] * keys).repeat(x.shape[0], 1)[:, None, :].to(x)
    if slopes is not None and "position_bias" in takes:
        keys = torch.arange(1 - x.shape[1], 1, dtype=torch.int32)
        found["position_bias"] = (keys * slopes[:, None, None]).to(x)
        if mask is not None:
            found["attention_mask"] = mask < 0
    if "residual" in takes:
        found["residual"] = torch.zeros_like(x)
    return found


def _bias_apart(layer: nn.Module) -> Any:
    """The output bias a layer returns apart for its decoder layer to add (GPT-NeoX-Japanese's
    ``dense_bias``, on its last layer), detached; 0 where it has none."""
    bias = getattr(layer, "dense_bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else 0.0


def _probe_kv(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a Gemma 4 "reuse" layer's probe reads (as another layer stored
    them, normed and rotated), (B, Hkv, T, D) each: a fixed draw, ours given the same."""
    config, index, head_dim = _config(layer), getattr(layer, "layer_idx", None), getattr(layer, "head_dim", None)
    own = config.per_layer_config[index] if getattr(config, "per_layer_config", None) else config
    shape = (x.shape[0], int(own.num_key_value_heads), x.shape[1], int(head_dim or 0))
    draw = torch.Generator().manual_seed(11)
    k, v = (torch.randn(shape, generator=draw, dtype=torch.float64).to(x) for _ in range(2))
    return k, v


def _d_in(layer: nn.Module, family: _Family) -> int:
    """The layer's input width, from its q (or packed q/k/v) projection."""
    weight = _get(layer, family.packed or family.q).weight
    return int(weight.shape[0] if family.layout == "in_out" else weight.shape[1])


def _probe_rotates(layer: nn.Module, d_in: int) -> bool:
    """Whether the layer turns q and k by the ``position_embeddings`` it is given, by what
    it computes: its output on a tiny probe with the real (cos, sin) and with the identity
    rotation (cos = 1, sin = 0).  Equal outputs: the layer ignores them (a NoPE layer by a
    rule of its forward no family rule knows, Flint's full-attention layers).  A layer the
    probe cannot call (or on the meta device) keeps the family's rule (True)."""
    attention = _attention_of(layer)
    weight = next(layer.parameters(), None)
    if weight is None or weight.is_meta:
        return True
    try:
        x = _probe_input(layer, d_in)
        cos, sin = _probe_rotary(layer, attention, x)
        mask = _probe_mask(x, None, bool(getattr(attention, "is_causal", True)))
        turned = _hf_forward(layer, x, mask, (cos, sin))
        plain = _hf_forward(layer, x, mask, (torch.ones_like(cos), torch.zeros_like(sin)))
    except Exception:  # noqa: BLE001 - a call convention the probe does not know: the rules decide
        return True
    return not torch.equal(turned, plain)


def _sees_rotation(layer: nn.Module, name: str, d_in: int) -> bool:
    """Whether the sub-module ``name`` (a qk-norm) sees q after it is turned, by what it is
    given: its input on a probe with the real (cos, sin) and with the identity rotation
    differ (HunYuan's ``query_layernorm`` follows ``apply_rotary_pos_emb``).  False where
    the probe cannot call the layer (the rules decide)."""
    weight = next(layer.parameters(), None)
    if weight is None or weight.is_meta:
        return False
    attention = _attention_of(layer)
    seen: list[torch.Tensor] = []
    handle = _get(layer, name).register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    try:
        x = _probe_input(layer, d_in)
        cos, sin = _probe_rotary(layer, attention, x)
        mask = _probe_mask(x, None, bool(getattr(attention, "is_causal", True)))
        _hf_forward(layer, x, mask, (cos, sin))
        _hf_forward(layer, x, mask, (torch.ones_like(cos), torch.zeros_like(sin)))
    except Exception:  # noqa: BLE001 - a call convention the probe does not know
        return False
    finally:
        handle.remove()
    return len(seen) == 2 and not torch.equal(seen[0], seen[1])


def _rotate_half_layout(layer: nn.Module) -> str | None:
    """Which feature pairs the family's ``rotate_half`` (or GPT-J's ``rotate_every_two``)
    turns, by what it computes on a probe: ``"half"`` (x[i], x[i + D/2]: Llama's),
    ``"interleaved"`` (x[2i], x[2i + 1]: Cohere's, GLM's, ERNIE 4.5's, Helium's, GPT-J's),
    else what it turns, in words; None where its module has no such function."""
    module = sys.modules[type(layer).__module__]
    turn = getattr(module, "rotate_half", None) or getattr(module, "rotate_every_two", None)
    if not callable(turn):
        return None
    probe = torch.arange(8.0).reshape(1, 1, 1, 8)
    got = turn(probe)
    if torch.equal(got, torch.cat((-probe[..., 4:], probe[..., :4]), dim=-1)):
        return "half"
    if torch.equal(got, torch.stack((-probe[..., 1::2], probe[..., 0::2]), dim=-1).flatten(-2)):
        return "interleaved"
    if torch.equal(got, torch.cat((probe[..., 4:], -probe[..., :4]), dim=-1)):
        return "halves turned the other way (cat(x2, -x1): by -angle)"  # nanochat's
    return "neither halves nor interleaved pairs"


def _apply_probe(layer: nn.Module, attention: Any) -> str | None:
    """The layout in which the module's ``apply_rotary_pos_emb``, given the (cos, sin) of the
    family's own rotary embedding (in either order: GPT-J's gives (sin, cos)), turns a probe
    head as ours does (``"half"`` or ``"interleaved"``); ``"neither"`` where it turns it
    otherwise; None where it cannot be called so (Phi's turns a slice its forward cuts)."""
    import inspect

    apply = getattr(sys.modules[type(layer).__module__], "apply_rotary_pos_emb", None)
    weight = next(layer.parameters(), None)
    if not callable(apply) or weight is None or weight.is_meta:
        return None
    from torch_attention._rope import apply_rope

    config = _config(attention)
    head_dim = int(getattr(attention, "head_dim", 0) or 0) or int(config.hidden_size) // int(config.num_attention_heads)
    q = torch.sin(0.37 * torch.arange(_PROBE_TOKENS * head_dim, dtype=torch.float32) + 0.1)
    q = q.reshape(1, 1, _PROBE_TOKENS, head_dim)
    positions = torch.arange(_PROBE_OFFSET, _PROBE_OFFSET + _PROBE_TOKENS)[None]
    try:
        names = set(inspect.signature(apply).parameters)
        pair = _probe_rotary(layer, attention, q[:, 0])
        rope = _rope(layer, attention)
    except Exception:  # noqa: BLE001 - no rotary embedding or rope to read here: the rules decide
        return None
    if isinstance(pair, torch.Tensor):  # complex freqs_cis: _rope_layout's
        return None
    turned = []
    for cos, sin in (pair, pair[::-1]):
        cos, sin = cos.float(), sin.float()
        try:
            if {"tensor", "sin", "cos"} <= names:  # GPT-J's, CodeGen's: one tensor, (B, T, D / 2) angles
                turned.append(apply(tensor=q.transpose(1, 2), sin=sin, cos=cos).transpose(1, 2).float())
            else:
                turned.append(apply(q, q, cos, sin)[0].float())
        except Exception:  # noqa: BLE001 - another call convention
            continue
    turned = [t for t in turned if t.shape == q.shape]
    if not turned:
        return None
    for layout in ("half", "interleaved"):
        want = apply_rope(q, positions, dataclasses.replace(rope, layout=layout), inv_freq=rope.inv_freq)
        if any(torch.allclose(t, want, atol=1e-5, rtol=1e-5) for t in turned):
            return layout
    sign = torch.ones(head_dim)  # nanochat's: the halves by -angle, D R(angle) D with D negating the second half
    width = rotary_dim(rope, head_dim)
    sign[width // 2:width] = -1.0
    want = sign * apply_rope(sign * q, positions, dataclasses.replace(rope, layout="half"), inv_freq=rope.inv_freq)
    if any(torch.allclose(t, want, atol=1e-5, rtol=1e-5) for t in turned):
        return _REVERSED
    return "neither"


_REVERSED = "half, by -angle"  # _apply_probe's word for nanochat's rotation (ours: _flip_halves)


def _rope_layout(layer: nn.Module, attention: Any) -> str | None:
    """The rotary layout (``attention_spec.rope.LAYOUTS``) of the layer, by what its family
    computes: the module's ``apply_rotary_pos_emb`` on a probe head with the family's own
    rotary embedding (``_apply_probe``: Cohere lays its cos out interleaved, GLM / ERNIE 4.5 /
    Helium cat the halves and interleave them inside ``apply_rotary_pos_emb``: either way
    pairs (2i, 2i + 1) turn); where that probe cannot be called, its ``rotate_half``; None
    where neither says (``rope_from_hf``'s layout stands; the self-check after the port
    decides).  Raises ValueError naming a layout ours has not."""
    if _complex_rotary(layer, attention):  # Llama 4: q viewed as complex pairs (x[2i], x[2i + 1]) times freqs_cis
        return "interleaved"
    by_apply = _apply_probe(layer, attention)
    if by_apply in LAYOUTS or by_apply == _REVERSED:
        return by_apply
    by_turn = _rotate_half_layout(layer)
    if by_apply is None and (by_turn is None or by_turn in LAYOUTS):
        return by_turn
    what = f"its rotate_half turns {by_turn}" if by_turn is not None else ""
    if by_apply == "neither":
        what += (", and " if what else "") + ("its apply_rotary_pos_emb turns neither as ours does with its "
                                              "rotary embedding's cos and sin")
    raise _refused(layer, [f"a rotary layout other than halves (x[i], x[i + D/2]) or interleaved pairs "
                           f"(x[2i], x[2i + 1]) ({what})"])


def _complex_rotary(layer: nn.Module, attention: Any) -> bool:
    """Whether the family's rotary embedding gives one complex tensor (Llama 4's
    ``freqs_cis``), which its ``apply_rotary_emb`` multiplies into q and k viewed as
    complex pairs; the self-check after the port decides whether ours turns the same."""
    weight = next(layer.parameters(), None)
    if weight is None or weight.is_meta:
        return False
    try:
        found = _probe_rotary(layer, attention, torch.zeros(1, _PROBE_TOKENS, 1))
    except Exception:  # noqa: BLE001 - no rotary embedding to build
        return False
    return isinstance(found, torch.Tensor)


def _attention_of(layer: Any) -> Any:
    """The sub-module with the config, ``is_causal`` and ``scaling`` (BERT's ``self``)."""
    inner = getattr(layer, "self", None)
    if isinstance(inner, nn.Module) and all(_child(inner, n) is not None for n in ("query", "key", "value")):
        return inner
    return layer


def _named_children(layer: nn.Module, family: _Family) -> list[tuple[str, nn.Module]]:
    found = list(layer.named_children())
    if family.attention:  # BERT: the self-attention's own children
        inner = _get(layer, family.attention)
        found += [(f"{family.attention}.{n}", c) for n, c in inner.named_children()]
    return found


def _projections(layer: nn.Module, attention: Any) -> _Family | None:
    """Where the q/k/v/o weights live (None: nowhere this library knows)."""
    prefix = "self." if attention is not layer else ""
    for q, k, v, o in _SEPARATE:
        qkv = [_child(attention, n) for n in (q, k, v)]
        out = _child(attention, o) if not prefix else _get(layer, "output.dense")
        if (not prefix and qkv[0] is not None and qkv[1] is None and isinstance(out, nn.Module)
                and getattr(attention, "is_kv_shared_layer", None) is True):
            return _Family("", q=q, k="", v="", o=o, kv_shared=True)  # Gemma 4's "reuse" layers (kv_shared)
        if (not prefix and qkv[0] is not None and qkv[1] is not None and hasattr(attention, v)
                and getattr(attention, v) is None and isinstance(out, nn.Module)
                and getattr(_config(attention), "attention_k_eq_v", False)):
            return _Family("", q=q, k=k, v="", o=o, values_from_keys=True)  # Gemma 4's global layers
        if all(m is not None for m in qkv) and isinstance(out, nn.Module):
            if prefix:
                post = isinstance(_get(layer, "output.LayerNorm"), nn.Module)
                return _Family("", q=prefix + q, k=prefix + k, v=prefix + v, o="output.dense", rope=False,
                               attention="self", not_ours="output.LayerNorm" if post else _pre_norm(layer))
            return _Family("", q=q, k=k, v=v, o=o)
    if prefix:
        return None
    model_type = str(getattr(_config(attention), "model_type", ""))
    for packed, outs, rule, types in _PACKED:
        output = next((name for name in outs if _child(layer, name) is not None), None)
        if _child(layer, packed) is None or output is None:
            continue
        layout = "out_in" if type(_child(layer, packed)) is nn.Linear else "in_out"
        family = _Family("", packed=packed, o=output, packing=rule, layout=layout)
        packing = _packing(layer, attention, family)
        if packing is None and types and model_type not in types:
            raise _refused(layer, [f"a packed q/k/v `{packed}` in a packing from_hf does not know for "
                                   f"model type {model_type!r} (known for {', '.join(types)})"])
        return dataclasses.replace(family, packing=packing or rule)
    return None


def _packed_heads(layer: nn.Module, attention: Any, family: _Family) -> tuple[int, int, int]:
    """(heads, key/value heads, head_dim) of a packed q/k/v: the heads from the config, the
    head width from the layer (``head_dim`` / ``head_size``, else the model width over the
    heads), the key/value heads from the packed width (GPTBigCode's multi-query ``c_attn``
    packs one key and one value head whatever its config's ``num_key_value_heads``)."""
    config = _config(attention)
    heads = int(config.num_attention_heads)
    out = _get(layer, family.o)
    d_model = int(out.weight.shape[1] if family.layout == "in_out" else out.weight.shape[0])
    head_dim = int(getattr(attention, "head_dim", 0) or getattr(attention, "head_size", 0) or 0) or d_model // heads
    packed = _get(layer, family.packed or "").weight
    rows = int(packed.shape[1] if family.layout == "in_out" else packed.shape[0])
    extra = rows - heads * head_dim
    if extra > 0 and extra % (2 * head_dim) == 0:
        return heads, extra // (2 * head_dim), head_dim
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return heads, kv_heads, rows // (heads + 2 * kv_heads)


def _value_rows(packing: str, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The indices along the packed axis that ``packing`` reads as the values."""
    if packing == "per_head":  # (heads, 3, head_dim): each head's third block
        return (torch.arange(heads)[:, None] * 3 * head_dim + 2 * head_dim + torch.arange(head_dim)).flatten()
    if packing == "codegen":  # (4 shards, [q, v, k], d_out / 4): each shard's second block
        local = heads * head_dim // CODEGEN_SHARDS
        return (torch.arange(CODEGEN_SHARDS)[:, None] * 3 * local + local + torch.arange(local)).flatten()
    start = (heads + kv_heads) * head_dim  # thirds (kv_heads == heads) and grouped: [q; k; v]
    return torch.arange(start, start + kv_heads * head_dim)


def _packing(layer: nn.Module, attention: Any, family: _Family) -> str | None:
    """The order of the packed q/k/v (``attention_spec.interop.packing``), by what the layer
    computes: with the rows that an order reads as the values set to 0 as they leave the
    packed projection (a forward hook), the layer's output is its output projection of 0
    (softmax weights times zero values) only for the order that holds the values there.
    None where the layer cannot be probed (the meta device, a call convention the probe
    does not know); raises ValueError where no order ours splits fits."""
    weight = next(layer.parameters(), None)
    if weight is None or weight.is_meta:
        return None
    heads, kv_heads, head_dim = _packed_heads(layer, attention, family)
    candidates = ["grouped"] if kv_heads < heads else ["thirds", "per_head"] + (
        ["codegen"] if heads * head_dim % CODEGEN_SHARDS == 0 else [])  # CodeGen's mp_num = 4 shards
    module, out = _get(layer, family.packed or ""), _get(layer, family.o)
    x = _probe_input(layer, _d_in(layer, family))
    try:
        embeddings = _probe_rotary(layer, attention, x) if "position_embeddings" in _forward_takes(attention) else None
    except Exception:  # noqa: BLE001 - no rotary embedding to build: the identity rotation turns nothing
        embeddings = None
    mask = _probe_mask(x, None, bool(getattr(attention, "is_causal", True)))
    with torch.no_grad():
        silent = out(torch.zeros(1, 1, heads * head_dim, dtype=x.dtype, device=x.device))[0, 0] + _bias_apart(layer)
    found = []
    for packing in candidates:
        rows = _value_rows(packing, heads, kv_heads, head_dim).to(x.device)

        def zero_values(_module: Any, _inputs: Any, output: torch.Tensor, rows: torch.Tensor = rows) -> torch.Tensor:
            return output.index_fill(-1, rows, 0.0)

        handle = module.register_forward_hook(zero_values)
        try:
            got = _hf_forward(layer, x, mask, embeddings)
        except Exception:  # noqa: BLE001 - a call convention the probe does not know: the rules decide
            return None
        finally:
            handle.remove()
        if torch.allclose(got.float(), silent.float().expand_as(got), atol=1e-6, rtol=0.0):
            found.append(packing)
    if len(found) == 1:
        return found[0]
    raise _refused(layer, [f"a packed q/k/v `{family.packed}` in an order ours does not split (its values are "
                           f"not where {' or '.join(repr(c) for c in candidates)} packs them: "
                           f"{heads} query heads, {kv_heads} key/value heads of {head_dim})"])


_PRE_NORMS = ("LayerNorm", "ln", "self_attn_layer_norm")


def _pre_norm(layer: nn.Module) -> str | None:
    """The LayerNorm a BERT-like attention block applies to its input before its
    self-attention, with the residual added after ``output.dense`` (RoBERTa-PreLayerNorm's
    ``LayerNorm``, XLM-RoBERTa-XL's ``self_attn_layer_norm``): the caller's, as BERT's
    ``output.LayerNorm`` is.  Found by what the block computes on a probe
    (``_is_pre_norm``); None where no norm is that."""
    weight = next(layer.parameters(), None)
    if weight is None or weight.is_meta or not isinstance(_get(layer, "output.dense"), nn.Module):
        return None
    return next((name for name in _PRE_NORMS if isinstance(_child(layer, name), nn.LayerNorm)
                 and _is_pre_norm(layer, name)), None)


def _is_pre_norm(layer: nn.Module, name: str) -> bool:
    """Whether, on a probe, the norm ``name`` sees the block's input, the self-attention sees
    the norm's output, and the block gives ``output.dense``'s output plus its input."""
    seen: dict[str, Any] = {}

    def norm_hook(_m: Any, args: Any, out: Any) -> None:
        seen["norm"] = (args[0], out)

    def dense_hook(_m: Any, _args: Any, out: Any) -> None:
        seen["dense"] = out

    def self_hook(_m: Any, args: Any, kwargs: Any) -> None:
        seen["self"] = args[0] if args else kwargs.get("hidden_states")

    handles = [_get(layer, name).register_forward_hook(norm_hook),
               _get(layer, "output.dense").register_forward_hook(dense_hook),
               _get(layer, "self").register_forward_pre_hook(self_hook, with_kwargs=True)]
    x = _probe_input(layer, int(_get(layer, "self.query").weight.shape[1]))
    training = layer.training
    layer.eval()
    try:
        with torch.no_grad():
            out = layer(x)
    except Exception:  # noqa: BLE001 - a call convention the probe does not know
        return False
    finally:
        layer.train(training)
        for handle in handles:
            handle.remove()
    out = out[0] if isinstance(out, tuple | list) else out
    if not all(isinstance(seen.get(k), torch.Tensor | tuple) for k in ("norm", "dense", "self")):
        return False
    norm_in, norm_out = seen["norm"]
    return bool(torch.equal(norm_in, x) and torch.equal(seen["self"], norm_out)
                and torch.allclose(out, seen["dense"] + x, atol=1e-6, rtol=1e-6))


def _reuses_kv(attention: Any) -> bool:
    """Whether the layer takes another layer's keys and values (Gemma 4's
    ``kv_sharing_modes[layer_idx] == "reuse"``); True where the config does not say."""
    modes, index = getattr(_config(attention), "kv_sharing_modes", None), getattr(attention, "layer_idx", None)
    return not isinstance(modes, list | tuple) or type(index) is not int or modes[index] == "reuse"


def _mechanism_refusals(layer: nn.Module, attention: Any) -> list[str]:
    """What the config and the call convention say that ours cannot express yet."""
    config = _config(attention)
    problems = _refusals(layer, attention)
    for attr, mechanism in _CONFIG_REFUSALS:
        value = getattr(config, attr, None)
        if attr == "num_kv_shared_layers" and (not _reuses_kv(attention)
                                               or getattr(attention, "is_kv_shared_layer", None) is True):
            continue  # Gemma 4: a layer that computes its own keys and values, or one that reuses (kv_shared)
        if value is not None and value is not False and value != 0:
            problems.append(mechanism)
    rope_parameters = getattr(config, "rope_parameters", None)
    if (isinstance(rope_parameters, Mapping) and rope_parameters.get("llama_4_scaling_beta")
            and type(rope_parameters.get("original_max_position_embeddings")) is not int):
        # Ministral 3, Mistral 4: query_scale=(beta, original_max_position_embeddings, 0) (_options)
        problems.append("llama_4_scaling_beta without an int original_max_position_embeddings (queries scaled by "
                        "position past it)")
    takes = _forward_takes(attention)
    problems += [m for arg, m in _FORWARD_REFUSALS.items() if arg in takes and m not in problems]
    if "residual" in takes and "alibi" not in takes:  # the residual the caller adds is Bloom's alone (proven)
        problems.append("the residual added inside the layer (its forward takes residual; Bloom's, beside its "
                        "ALiBi, is the one left to the caller)")
    if getattr(attention, "config", None) is None:  # a layer without its model's config (GPT-NeoX-Japanese's)
        if "position_embeddings" in takes:
            problems.append("rotary positions whose frequencies its model keeps (the layer keeps no config and takes "
                            "position_embeddings: set layer.config = model.config)")
        if (not hasattr(attention, "is_causal") and not _causal(attention) and "attention_mask" in takes
                and not {"key_value_states", "encoder_hidden_states"} & takes):  # (those: refused below)
            problems.append("whether it is causal is the mask its model gives (the layer has no is_causal and no "
                            "causal mask buffer: set layer.is_causal as its model masks)")
    if getattr(attention, "slow_but_exact", False) and int(getattr(attention, "pretraining_tp", 1) or 1) > 1:
        problems.append(f"an output projection in {attention.pretraining_tp} slices that drops its bias (Bloom's "
                        "slow_but_exact with pretraining_tp > 1)")
    scaling = _model_scaling(layer)
    if scaling is not None and _scalable_softmax(scaling) is None:
        problems.append("a query scale by position that its model builds and passes in on its layers without rope "
                        f"(its forward takes attention_scaling, from `{getattr(scaling, '__name__', scaling)}`), which "
                        "is not Beam's scalable softmax, (1 + (p + 1) / 2048) ** 0.1")
    if type(getattr(attention, "block_size", None)) is int and hasattr(attention, "num_random_blocks"):
        problems.append(f"block-sparse attention (BigBird's: blocks of {attention.block_size} keys, "
                        f"{attention.num_random_blocks} of them random)")
    given = next((a for a in ("key_value_states", "encoder_hidden_states") if a in takes), None)
    if given and not hasattr(attention, "is_causal"):  # BART's kind (XGLM, TrOCR), RemBERT's, Megatron-BERT's
        problems.append(f"self- or cross-attention by its caller (its forward takes {given}; whether it is causal "
                        "is the mask it is given: it has no is_causal), which the layer alone does not say")
    return problems


_SCALABLE_SOFTMAX = (0.1, 2048, 1)  # Beam's: (1 + (p + 1) / 2048) ** 0.1, query_scale_kind="power"


def _model_scaling(layer: nn.Module) -> Any:
    """The function with which the layer's model computes the ``attention_scaling`` its
    forward takes on its layers without rope (Beam's ``compute_attention_scaling``:
    position_ids -> a query factor (B, 1, T, 1)); ``"unknown"`` where the module has none,
    None where the layer takes no such scale."""
    attention = _attention_of(layer)
    rope_parameters = getattr(_config(attention), "rope_parameters", None)
    layer_type = _layer_type(layer, attention)
    if not ("attention_scaling" in _forward_takes(attention) and isinstance(rope_parameters, Mapping)
            and layer_type in rope_parameters and rope_parameters[layer_type] is None):
        return None
    found = getattr(sys.modules[type(layer).__module__], "compute_attention_scaling", None)
    return found if callable(found) else "unknown"


def _scalable_softmax(scaling: Any) -> tuple[float, int, int] | None:
    """Ours' ``query_scale`` for a model's ``attention_scaling`` function, where it computes
    Beam's scalable softmax, ``(1 + (p + 1) / 2048) ** 0.1`` (probed at positions 0 ..
    100000 against float64, within float32's rounding); None where it does not."""
    if not callable(scaling):
        return None
    positions = torch.tensor([[0, 1, 5, 447, 2047, 2048, 4095, 10000, 100000]])
    try:
        got = scaling(positions).double().reshape(-1)
    except Exception:  # noqa: BLE001 - a function the probe cannot call is not Beam's
        return None
    beta, floor, offset = _SCALABLE_SOFTMAX
    want = (1.0 + (positions.double().reshape(-1) + offset) / floor) ** beta
    return _SCALABLE_SOFTMAX if got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-6, atol=0)) else None


def hf_families_table(verdicts: Mapping[str, tuple[str, str, float | None]]) -> str:
    """The Markdown table of which ``transformers`` causal-LM families ``from_hf`` ports:
    ``verdicts`` is {model type: (``"ports"`` / ``"refused"`` / ``"not built"``, the
    layer classes or the reason, the logits' largest relative error)}, as
    ``tests/interop/test_hf_families.py`` finds them on the installed ``transformers``
    (``docs/porting.md`` keeps its output, and the test keeps it true)."""
    # (the errors are not shown: they differ in their last digits from one CPU's kernels to
    # another's, and the table must be the same on every machine; each is <= 1e-5)
    order = {"ports": 0, "refused": 1, "not built": 2, "error": 3}
    rows = ["| model type | from_hf | attention layers, or what refuses it |", "|---|---|---|"]
    for model_type, (verdict, detail, _error) in sorted(verdicts.items(), key=lambda kv: (order[kv[1][0]], kv[0])):
        text = re.sub(r"0x[0-9a-f]+", "0x...", detail).replace("|", "/").replace("\n", " ")
        rows.append(f"| `{model_type}` | {verdict} | {text} |")
    counts = {v: sum(1 for x in verdicts.values() if x[0] == v) for v in order}
    return "\n".join(rows) + (f"\n\n{counts['ports']} families port, {counts['refused']} are refused naming their "
                               f"mechanism, {counts['not built']} cannot be built tiny here.")


def _family(layer: Any, what: str) -> _Family:
    return _recognise(layer, what)


def _latent(layer: Any) -> bool:
    """Whether ``layer`` is latent attention (DeepSeek's: ``_hf_latent``'s), by what it
    holds: a compressed key/value projection with its rope part (``kv_a_proj_with_mqa``),
    its up-projection (``kv_b_proj``) and ``o_proj``."""
    return isinstance(layer, nn.Module) and all(_child(layer, n) is not None for n in _LATENT_HOLDS)


def recognises_hf_layer(module: Any) -> bool:
    """Whether ``from_hf`` takes ``module`` (an attention layer whose mechanisms it knows),
    without reading a weight, and ``hf_rules`` / ``hf_children`` map it (the
    linear-attention layers ``from_hf`` ports included: ``_hf_delta``)."""
    from torch_attention import _hf_delta

    try:
        if _hf_delta.layout(module) is not None:
            _hf_delta.hf_children(module)  # its refusals (a conv activation, biases ...), by name
        elif _latent(module):
            from torch_attention import _hf_latent

            _hf_latent.refusals(module, raise_=True)
        else:
            _recognise(module, "from_hf")
    except (TypeError, ValueError):
        return False
    return True


def _get(layer: nn.Module, path: str) -> Any:
    """The sub-module or attribute at a dotted path (None where any step is missing)."""
    obj: Any = layer
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, None)
    return obj


# --------------------------------------------------------------------------- options


def _layer_type(layer: nn.Module, attention: Any) -> str | None:
    """The layer type that picks a per-layer window or rope (``layer_types[layer_idx]``)."""
    own = getattr(attention, "layer_type", None)
    if own is not None:
        return str(own)
    types, index = getattr(_config(attention), "layer_types", None), getattr(attention, "layer_idx", None)
    return None if not types or index is None else str(types[index])


def _rope(layer: nn.Module, attention: Any, layout: str | None = None) -> RopeConfig:
    """``rope_from_hf`` of the layer's config, for its layer type where the config keeps
    rope parameters per layer type (Gemma 3: local and global), with the frequencies of
    the family's own rotary embedding (``inv_freq``: computed in float32 arithmetic, a
    few ulps from the float64 formula) where they do not follow the sequence length."""
    config = _config(attention)
    layer_type = _layer_type(layer, attention)
    params = getattr(config, "rope_parameters", None) or {}
    nested = layer_type is not None and isinstance(params.get(layer_type), Mapping)
    # the fraction as the config gives it: the layer's own rotary embedding decides below
    rope = rope_from_hf(config, layer_type if nested else None, honours_partial=True)
    if layout is not None:  # the layout the family computes (``_rope_layout``), not the model type's
        rope = dataclasses.replace(rope, layout=layout)
    own = _hf_inv_freq(layer, config, layer_type if nested else None, rope.theta)
    # as many features turn as the layer's own rotary embedding has frequencies for: a
    # family whose embedding ignores the config's partial_rotary_factor (Llama's) turns
    # the whole head, and so does ours
    head_dim = int(getattr(attention, "head_dim", 0) or 0)
    if head_dim and 2 * len(own) != rotary_dim(rope, head_dim):
        turned = 2 * len(own)
        rope = dataclasses.replace(rope, partial_rotary_factor=None,
                                   rotary_dim=None if turned == head_dim else turned)
    if needs_seq_len(rope):  # dynamic NTK, longrope: HF recomputes them per call as we do
        return rope
    return dataclasses.replace(rope, inv_freq=tuple(float(f) for f in own.tolist()))


def _window(layer: nn.Module, attention: Any) -> tuple[int, int] | None:
    """The band of keys each query sees: the layer's own ``sliding_window`` where it has
    one (per layer type: Qwen2, Qwen3, Gemma 2/3; none where ``is_sliding`` is False:
    Exaone 4's global layers), else the config's ``sliding_window`` (Mistral, Phi-3,
    Mixtral, StarCoder2 pass it), unless ``use_sliding_window`` is False or the layer's
    type is full attention."""
    if getattr(attention, "is_sliding", True) is False:
        return None
    if hasattr(attention, "sliding_window"):
        return window_from_hf(attention.sliding_window)
    config = _config(attention)
    if getattr(config, "use_sliding_window", True) is False or _layer_type(layer, attention) == "full_attention":
        return None
    return window_from_hf(getattr(config, "sliding_window", None))


def _chunk(layer: nn.Module, attention: Any) -> int | None:
    """Chunked local attention (Llama 4): the config's ``attention_chunk_size`` on the
    layers whose type is ``"chunked_attention"`` (the mask the model builds for them:
    ``masking_utils.create_chunked_causal_mask``; Llama 4's rope layers, its NoPE layers
    being ``"full_attention"``), on every layer where the config has no layer types (as
    ``create_masks_for_generate`` decides); None elsewhere."""
    size = getattr(_config(attention), "attention_chunk_size", None)
    if size is None:
        return None
    layer_type = _layer_type(layer, attention)
    return int(size) if layer_type in (None, "chunked_attention") else None


def _norm_eps(norm: nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps)  # type: ignore[arg-type]


def _geometry(layer: nn.Module, family: _Family) -> dict[str, Any]:
    """d_in, heads, head_dim and biases, from the weights' shapes (HF's own attributes
    for the heads: ``num_attention_heads`` / ``num_key_value_heads``)."""
    config = _config(_get(layer, family.attention))
    gate = False
    heads = _heads_of(layer) if not family.attention else int(config.num_attention_heads)
    per_layer = getattr(config, "per_layer_config", None)  # Gemma 4: each layer's own head widths
    index = getattr(_get(layer, family.attention), "layer_idx", None)
    own = per_layer[index] if per_layer is not None and index is not None else config
    kv_heads = int(getattr(own, "num_key_value_heads", None) or heads)
    out = _get(layer, family.o)
    d_model = int(out.weight.shape[1] if family.layout == "in_out" else out.weight.shape[0])
    if family.packed is None and family.kv_shared:  # Gemma 4's "reuse" layers: q_proj's alone
        q = _get(layer, family.q)
        width, qkv_bias = int(q.weight.shape[0]), q.bias is not None
    elif family.packed is None:
        q, k, v = (_get(layer, name) for name in (family.q, family.k, family.v or family.k))  # (keys as values)
        biases = {p.bias is not None for p in (q, k, v)}
        if len(biases) != 1:
            raise ValueError(f"{type(layer).__name__}: q, k and v must all have biases or none; ours has one switch")
        width, qkv_bias = int(q.weight.shape[0]), biases.pop()
        attention = _get(layer, family.attention)
        groups, own_dim = getattr(attention, "num_key_value_groups", None), getattr(attention, "head_dim", None)
        if (type(groups) is int and groups > 0 and heads % groups == 0 and heads // groups != kv_heads
                and int(k.weight.shape[0]) == heads // groups * (own_dim or -1)):
            kv_heads = heads // groups  # MiMo-V2-Flash's sliding layers: twice the config's key/value heads
        kv_width = int(k.weight.shape[0]) // kv_heads
        if width == 2 * heads * kv_width:  # Qwen3-Next / Qwen3.5: each head's queries, then its gate
            gate, width = True, width // 2
        gate = gate or bool(family.gate)  # AFMoE: a gate_proj of q_proj's width beside it (Laguna: a value a head)
    else:
        heads, kv_heads, head_dim = _packed_heads(layer, _get(layer, family.attention), family)
        width, qkv_bias = heads * head_dim, _get(layer, family.packed).bias is not None
    head_dim = width // heads
    return {
        "d_in": d_model, "d_out": d_model, "num_heads": heads,
        "num_kv_heads": None if kv_heads == heads else kv_heads,
        "head_dim": None if head_dim * heads == d_model else head_dim,
        "qkv_bias": qkv_bias, "out_bias": out.bias is not None or bool(family.out_bias),
        **({"output_gate": True} if gate else {}),
        **({"output_gate_activation": family.gate_activation} if family.gate_activation != "sigmoid" else {}),
        **({"output_gate_per_head": True} if family.gate_per_head else {}),
        **({"output_gate_bias": True} if family.gate_bias else {}),
    }


def _refusals(layer: nn.Module, attention: Any) -> list[str]:
    problems = []
    if getattr(layer, "is_cross_attention", False) or getattr(attention, "is_cross_attention", False):
        problems.append("cross-attention (its keys and values come from an encoder: ours is self-attention here)")
    if not bool(getattr(attention, "is_causal", True)) and getattr(attention, "sliding_window", None):
        problems.append("a sliding window on bidirectional attention")
    return problems


def _options(layer: nn.Module, family: _Family) -> dict[str, Any]:
    """Our ``MultiHeadAttention``'s keywords for this layer (no dtype / device)."""
    attention = _get(layer, family.attention)
    problems = _refusals(layer, attention)
    if problems:
        raise ValueError(f"this {type(layer).__name__} cannot be expressed as MultiHeadAttention: "
                         + "; ".join(problems))
    options = _geometry(layer, family)
    dropout = getattr(attention, "attention_dropout", None)
    if isinstance(dropout, nn.Dropout):  # Persimmon's, GPT-NeoX-Japanese's: a module
        dropout = dropout.p
    for name in ("attn_dropout", "dropout"):  # GPT-2, BERT: an nn.Dropout on the weights
        if dropout is None and isinstance(getattr(attention, name, None), nn.Dropout):
            dropout = getattr(attention, name).p
    options.update(
        sinks=family.sinks, context_length=None, dropout=float(dropout or 0.0),
        causal=_causal(attention), scale=_scaling(attention, int(options["head_dim"] or options["d_in"] // options["num_heads"])), softcap=getattr(attention, "attn_logit_softcapping", None),
        window=_window(layer, attention), chunk=_chunk(layer, attention), rope=_rope(layer, attention, family.rope_layout) if family.rope else None,
    )
    if options["softcap"] is not None:
        options["softcap"] = float(options["softcap"])
    clip = getattr(_config(attention), "clip_qkv", None)  # OLMo's: q, k, v clamped to [-c, c]
    if clip is None and isinstance(getattr(attention, "clip_qkv", None), float | int) and attention.clip_qkv:
        clip = attention.clip_qkv  # MPT's, on the layer (attn_config.clip_qkv)
    slopes = _alibi_slopes(attention)
    if slopes is not None:
        options["score_mod"] = alibi(slopes.numpy())
    if clip is not None:
        options["clip_qkv"] = float(clip)
    norms = None if family.norms is None else [_get(layer, n) for n in family.norms[:1 if family.kv_shared else 2]]
    if norms is not None and all(n is not None for n in norms):  # Phi: only with qk_layernorm (kv_shared: q's)
        options.update(qk_norm=family.norm, qk_norm_scope=family.norm_scope, qk_norm_eps=_norm_eps(norms[0]),
                       qk_norm_offset=1.0 if family.norm_offset else 0.0)
        if not family.norm_weight:  # nanochat, Llama 4: no parameter
            options["qk_norm_weight"] = False
        if family.norm_after_rope:  # HunYuan: the turned q and k normed
            options["qk_norm_position"] = "after_rope"
    if family.out_norm:  # BitNet's attn_sub_norm: its epsilon must be the qk-norms' (ours has one, qk_norm_eps)
        eps = _norm_eps(_get(layer, family.out_norm))
        if options.get("qk_norm") is not None and eps != options["qk_norm_eps"]:
            raise _refused(layer, [f"a norm of the merged heads with its own epsilon ({eps:g}; the qk-norms' is "
                                   f"{options['qk_norm_eps']:g}: ours has one, qk_norm_eps)"])
        options.update(out_norm="rms", **({} if options.get("qk_norm") is not None else {"qk_norm_eps": eps}))
    options.update(_value_options(layer, family, options))
    if not family.packed and family.k and family.v:  # MiMo-V2-Flash: value heads of their own width, scaled
        k_rows, v_rows = (int(_get(layer, n).weight.shape[0]) for n in (family.k, family.v))
        if k_rows != v_rows:
            options["v_head_dim"] = v_rows // (options["num_kv_heads"] or options["num_heads"])
    v_scale = getattr(attention, "v_scale", None)
    if isinstance(v_scale, float | int) and not isinstance(v_scale, bool) and v_scale != 1:
        options["v_scale"] = float(v_scale)  # (not folded into W_value: to_hf writes v_proj back bit for bit)
    query_scale = _query_scale(layer, attention, family)
    if query_scale is not None:
        options["query_scale"] = query_scale
        if _scalable_softmax(_model_scaling(layer)) is not None:  # Beam's: (1 + (p + 1) / 2048) ** 0.1
            options["query_scale_kind"] = "power"
    return options


_MPT_ALIBI_BIAS_MAX = 8  # transformers' MptModel calls build_mpt_alibi_tensor without attn_config's


def _alibi_slopes(attention: Any) -> torch.Tensor | None:
    """The ALiBi slopes (H,) float32 its model builds the biases from, as transformers
    computes them: Bloom's ``_get_alibi_slopes`` (a layer whose forward takes ``alibi``:
    powers of 2 ** -(8 / n) over the largest power of two n of the heads, the rest at odd
    powers of the next one's base), MPT's ``build_mpt_alibi_tensor`` (one whose forward takes
    ``position_bias``: 1 / 2 ** (8 * i / n) for n the next power of two, the odd ones first
    where n is not the heads: its model passes no ``attn_config.alibi_bias_max`` nor reads
    ``attn_config.alibi``); None for another layer.  Its model adds ``slopes[h] * j`` (Bloom: key j counted
    from the first real token) or ``slopes[h] * (j - (S - 1))`` (MPT) to the scores; ours
    adds ``slopes[h] * (j - i)``: per query a constant apart, the same softmax."""
    takes = _forward_takes(attention)
    heads = next((getattr(attention, a) for a in _HEADS if type(getattr(attention, a, None)) is int), None)
    if heads is None:
        return None
    if "alibi" in takes:
        closest = 2 ** math.floor(math.log2(heads))
        base = torch.full((), 2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
        slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
        if closest != heads:
            extra = torch.full((), 2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
            odd = torch.arange(1, 1 + 2 * min(closest, heads - closest), 2, dtype=torch.int32)
            slopes = torch.cat([slopes, torch.pow(extra, odd)])
        return slopes
    if "position_bias" in takes:  # MptModel builds them with build_mpt_alibi_tensor's default alibi_bias_max
        power = 2 ** math.ceil(math.log2(heads))  # (8, whatever attn_config says), ALiBi always on
        base = torch.arange(1, power + 1, dtype=torch.int64).float() * (_MPT_ALIBI_BIAS_MAX / power)
        slopes = 1.0 / torch.pow(2, base)
        return torch.cat([slopes[1::2], slopes[::2]])[:heads] if power != heads else slopes
    return None


def _value_options(layer: nn.Module, family: _Family, options: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 4's keys as values (no v_proj) and its weightless value norm, whose epsilon
    must be the qk-norms' (ours has one, ``qk_norm_eps``)."""
    found: dict[str, Any] = {"values_from_keys": True} if family.values_from_keys else {}
    if family.kv_shared:
        found["kv_shared"] = True
    if family.v_norm:
        eps = _norm_eps(_get(layer, "v_norm"))
        if options.get("qk_norm") is not None and eps != options["qk_norm_eps"]:
            raise _refused(layer, [f"a value norm with its own epsilon ({eps:g}; the qk-norms' is "
                                   f"{options['qk_norm_eps']:g}: ours has one, qk_norm_eps)"])
        found.update(v_norm="rms", **({} if options.get("qk_norm") is not None else {"qk_norm_eps": eps}))
    return found


def _query_scale(layer: nn.Module, attention: Any, family: _Family) -> tuple[float, int, int] | None:
    """The queries' scale by position: Llama 4's temperature tuning on its NoPE layers
    (``attn_temperature_tuning``: ``(attn_scale, floor_scale, 1)``), Ministral 3's /
    Mistral 4's ``llama_4_scaling_beta`` (``(beta, original_max_position_embeddings, 0)``),
    Beam's scalable softmax on its NoPE layers (``(0.1, 2048, 1)``, ``query_scale_kind="power"``:
    the ``attention_scaling`` its model computes, found by a probe of that function)."""
    config = _config(attention)
    scalable = _scalable_softmax(_model_scaling(layer))
    if scalable is not None:  # Beam's NoPE layers: the scale its model passes in as attention_scaling
        return scalable
    if getattr(config, "attn_temperature_tuning", False) and not family.rope and _nope(attention):
        return float(attention.attn_scale), int(attention.floor_scale), 1
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and params.get("llama_4_scaling_beta"):
        return float(params["llama_4_scaling_beta"]), int(params["original_max_position_embeddings"]), 0
    return None


# --------------------------------------------------------------------------- weights


def _names(family: _Family, options: Mapping[str, Any]) -> dict[str, str]:
    """{our parameter name: HF parameter name} for the weights copied one to one."""
    names = {"out_proj.weight": f"{family.o}.weight"}
    if family.out_norm:  # BitNet's attn_sub_norm
        names["out_norm.weight"] = f"{family.out_norm}.weight"
    if family.sinks:
        names["sinks"] = "sinks"
    if family.gate_bias:  # Beam's one gate bias a head
        names["gate_bias"] = "gate_bias"
    if options["out_bias"]:
        names["out_proj.bias"] = family.out_bias or f"{family.o}.bias"
    if family.packed is None:
        for ours, theirs in (("W_query", family.q), ("W_key", family.k), ("W_value", family.v)):
            if not theirs or (ours == "W_query" and family.gate):  # keys as values: no v_proj; a gate: below
                continue
            names[f"{ours}.weight"] = f"{theirs}.weight"
            if options["qkv_bias"]:
                names[f"{ours}.bias"] = f"{theirs}.bias"
    if options.get("qk_norm") is not None and options.get("qk_norm_weight", True):
        assert family.norms is not None
        for ours, theirs in zip(("q_norm", "k_norm"), family.norms, strict=True):
            if family.kv_shared and ours == "k_norm":  # a "reuse" layer's keys come normed
                continue
            names[f"{ours}.weight"] = f"{theirs}.weight"
            if options["qk_norm"] == "layer":
                names[f"{ours}.bias"] = f"{theirs}.bias"
    return names


def _hf_state(layer: nn.Module, family: _Family, options: Mapping[str, Any], spec: Any) -> dict[str, Any]:
    """The layer's weights under our PyTorch names (not yet cast)."""
    params = dict(layer.named_parameters())
    state: dict[str, Any] = {}
    for ours, theirs in _names(family, options).items():
        value = params[theirs].detach()
        if family.layout == "in_out" and ours == "out_proj.weight":
            value = value.T  # Conv1D keeps (in, out)
        state[ours] = value
    if family.packed is not None:
        bias = params.get(f"{family.packed}.bias")
        parts = packed_state_dict(spec, as_numpy(params[f"{family.packed}.weight"].detach()),
                                  None if bias is None else as_numpy(bias.detach()),
                                  layout=family.layout, packing=family.packing)
        state.update({k: v for k, v in parts.items() if k.startswith("W_")})
    if family.gate:  # AFMoE: each head's q_proj rows, then its gate_proj rows (Qwen3-Next's q_proj order)
        for part in ("weight", "bias") if options["qkv_bias"] else ("weight",):
            state[f"W_query.{part}"] = _interleave(params[f"{family.q}.{part}"].detach(),
                                                   params[f"{family.gate}.{part}"].detach(), options["num_heads"])
    if family.rope_reversed:
        state.update(_flip_halves(state, family, options, spec))
    return state


def _interleave(q: torch.Tensor, gate: torch.Tensor, heads: int) -> torch.Tensor:
    """q_proj's and a separate gate's rows (or biases), head by head: (H, D, ...) each ->
    (H * 2D, ...), each head's queries then its gate (``_split_gate`` undoes it)."""
    return torch.cat((q.reshape(heads, -1, *q.shape[1:]), gate.reshape(heads, -1, *gate.shape[1:])), dim=1).reshape(
        -1, *q.shape[1:])


def _split_gate(w_query: torch.Tensor, heads: int, gate_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W_query's rows (or bias) of an output gate -> (q_proj's, the gate's): each head's
    rows, its queries then its ``gate_width`` gate rows (None: half of them)."""
    per_head = w_query.reshape(heads, -1, *w_query.shape[1:])
    width = per_head.shape[1] // 2 if gate_width is None else per_head.shape[1] - gate_width
    return (per_head[:, :width].reshape(-1, *w_query.shape[1:]), per_head[:, width:].reshape(-1, *w_query.shape[1:]))


def _flip_halves(state: Mapping[str, torch.Tensor], family: _Family, options: Mapping[str, Any],
                 spec: Any) -> dict[str, torch.Tensor]:
    """W_query's and W_key's rows (and biases) with the second half of each head's turned
    features negated (its own inverse, exact).  nanochat turns the halves (x1, x2) by
    -angle, ``(x1 cos + x2 sin, x2 cos - x1 sin)`` = ``D R(angle) D`` with
    ``D = diag(1, -1)``: ours turns ``D q`` by +angle, which is nanochat's turned q with its
    second half negated, the same floating point operations; a score is a sum of products
    of q's and k's features, in which each negated factor meets a negated factor
    (``(-a)(-b) = ab`` exactly), and a weightless (or elementwise-weighted) RMS norm sums
    squares: both are nanochat's, bit for bit.  The values are not turned: not flipped."""
    head_dim = int(spec.head_dim or 0)
    turned = rotary_dim(spec.rope, head_dim)
    sign = torch.ones(head_dim, dtype=torch.float32)
    sign[turned // 2:turned] = -1.0
    out = {}
    for name, heads in (("W_query", options["num_heads"]), ("W_key", options["num_kv_heads"] or options["num_heads"])):
        for part in ("weight", "bias"):
            value = state.get(f"{name}.{part}")
            if value is not None:
                rows = sign.to(value.device).repeat(heads).reshape(-1, *([1] * (value.dim() - 1)))
                out[f"{name}.{part}"] = torch.where(rows < 0, -value, value)
    return out


def hf_rules(layer: nn.Module) -> list[Rule]:
    """The weight map from a ``transformers`` attention layer's parameters (its own names,
    ``q_proj.weight`` ...) to the Flax twin of what ``from_hf(layer)`` gives (paths from
    that module: ``("W_query", "kernel")`` ...), as ``attention_spec.interop.specs.Rule``s: the
    one-to-one weights as our declared map moves them (an ``nn.Linear`` weight transposed
    into a kernel; GPT-2's ``Conv1D`` weights, already (in, out), as they are) and a
    packed q/k/v weight split into three kernels (in thirds, per head or in groups).  Read
    from the layer alone (no weight is copied).  BERT's ``output.LayerNorm`` is not ours
    and has no rule.  The linear-attention layers': ``_hf_delta.hf_rules``.  Raises
    TypeError as ``from_hf`` does."""
    from torch_attention import _hf_delta

    if _hf_delta.layout(layer) is not None:
        return _hf_delta.hf_rules(layer)
    if _latent(layer):
        from torch_attention import _hf_latent

        # the same parameter names on both sides: our declared map as it is
        return rules_for("MultiHeadLatentAttention", _hf_latent.options(layer))
    family = _family(layer, "hf_rules")
    if family.rope_reversed:
        raise ValueError(f"hf_rules: the {type(layer).__name__} turns its halves the other way (by -angle): ours holds "
                         "its q_proj / k_proj rows with the second half of each head's turned features negated, which "
                         "no weight-map step expresses (from_hf and to_hf port it; to_flax(from_hf(layer)) gives the "
                         "Flax twin)")
    options = _options(layer, family)
    names = _names(family, options)  # ours -> theirs
    rules: list[Rule] = []
    for rule in rules_for("MultiHeadAttention", options):
        theirs = names.get(rule.torch_name)
        if theirs is None:  # a packed family's W_query / W_key / W_value: below
            continue
        conv1d = family.layout == "in_out" and theirs.endswith(".weight")  # (in, out): the kernel's layout
        rules.append(Rule(theirs, rule.flax_path, () if conv1d else rule.steps))
    if family.gate:  # q_proj's and gate_proj's rows, head by head, into one W_query kernel (and bias)
        heads, width = options["num_heads"], int(_get(layer, family.q).weight.shape[0]) // options["num_heads"]
        gate_width = 1 if family.gate_per_head else width  # Laguna's per-head g_proj: one row a head
        per_head = (SplitAxis(0, (heads, -1)), Joined(1, (width, gate_width)), MergeAxes(0, (heads, width + gate_width)))
        rules.append(Rule([f"{family.q}.weight", f"{family.gate}.weight"], ("W_query", "kernel"),
                          (*per_head, Transpose())))
        if options["qkv_bias"]:
            rules.append(Rule([f"{family.q}.bias", f"{family.gate}.bias"], ("W_query", "bias"), per_head))
    if family.packed is not None:
        roles = ("W_query", "W_key", "W_value")
        bias = options["qkv_bias"]
        heads = {} if family.packing in UNHEADED else {
            "num_heads": options["num_heads"], "num_kv_heads": options["num_kv_heads"] or options["num_heads"]}
        rules += packed_qkv_rules(f"{family.packed}.weight", [(r, "kernel") for r in roles], layout=family.layout,
                                  bias=f"{family.packed}.bias" if bias else None,
                                  biases=[(r, "bias") for r in roles] if bias else None,
                                  packing=family.packing, **heads)
    return rules


def hf_children(layer: nn.Module) -> dict[str, tuple[str, str | None]]:
    """The layer's sub-modules that have a counterpart in what ``from_hf(layer)`` gives,
    for ``parity_tests.locate_divergence``: {their dotted name: (our sub-module's name,
    layout)}, where layout ``"heads"`` says that theirs sees the tensor split in heads,
    (B, T, H, D) or (B, H, T, D), and ours (B, T, H * D): the qk-norms of a per-head
    scope.  A packed q/k/v has no one counterpart (ours are three); DeepSeek's latent
    layers have the same names as ours; the linear-attention layers': ``_hf_delta``'s.
    Raises TypeError as ``from_hf``."""
    from torch_attention import _hf_delta

    if _hf_delta.layout(layer) is not None:
        return _hf_delta.hf_children(layer)
    if _latent(layer):
        return {name: (name, None) for name, child in layer.named_children() if isinstance(child, nn.Module)}
    family = _family(layer, "hf_children")
    roles = [] if family.out_bias else [(family.o, "out_proj")]  # (out_proj is `dense` plus `dense_bias`)
    if family.packed is None:  # (a gate's W_query is q_proj's and gate_proj's rows; a reversed rotation's W_query
        #                         and W_key have each head's turned second half negated: no one counterpart)
        roles += [*(((family.q, "W_query"),) if not (family.gate or family.rope_reversed) else ()),
                  *(((family.k, "W_key"),) if family.k and not family.rope_reversed else ()),
                  *(((family.v, "W_value"),) if family.v else ())]  # (a kv_shared layer: q alone)
    if family.out_norm:  # BitNet's attn_sub_norm: the merged heads, (B, T, H * D) on both sides
        roles.append((family.out_norm, "out_norm"))
    children: dict[str, tuple[str, str | None]] = {theirs: (ours, None) for theirs, ours in roles}
    norms = None if family.norms is None else family.norms[:1] if family.kv_shared else family.norms
    if family.norm_weight and norms is not None and all(_get(layer, n) is not None for n in norms):
        layout = "heads" if family.norm_scope == "head" else None
        children.update({theirs: (ours, layout) for theirs, ours in zip(norms, ("q_norm", "k_norm"), strict=False)})
    return children


def _build(options: Mapping[str, Any], like: torch.Tensor) -> MultiHeadAttention:
    """Our module for ``options``, built on the meta device (no random draws), then
    given storage in ``like``'s dtype and device."""
    module = MultiHeadAttention(**options, dtype=like.dtype, device="meta")
    return module.to_empty(device=like.device)


def _first_weight(layer: nn.Module, family: _Family) -> torch.Tensor:
    return _get(layer, family.packed or family.q).weight


def from_hf(layer: nn.Module) -> Any:
    """A ``transformers`` attention layer -> our ``MultiHeadAttention`` with its weights
    (copied exactly; Gemma 3's qk-norm weights with ``qk_norm_offset=1.0``, as its RMSNorm
    scales by ``1 + w``), options, dtype, device and train/eval mode.

    Read from the layer and its ``config`` (BERT: ``layer.self.config``): heads (``num_kv_heads`` for grouped heads),
    ``head_dim`` where heads x head_dim is not the hidden size, the biases (``qkv_bias``,
    ``out_bias``), ``scale`` = the layer's ``scaling``, ``causal`` = its ``is_causal``,
    ``softcap`` (``attn_logit_softcapping``), ``window`` (HF's ``sliding_window=W`` is
    ``(W - 1, 0)``, of the layer's own type where windows are per layer type), ``chunk``
    (``attention_chunk_size`` on the ``"chunked_attention"`` layers: Llama 4's rope layers), ``rope``
    (``rope_from_hf``, per layer type for Gemma 3; None where the layer ignores the
    rotation it is given, by a probe), qk-norm, ``clip_qkv`` (OLMo's ``config.clip_qkv``),
    ``output_gate`` (a ``q_proj`` twice as wide as the keys' heads: Qwen3-Next's and
    Qwen3.5's full-attention layers, ``W_query`` = ``q_proj`` as it is), a weightless
    RMS qk-norm (nanochat's, Llama 4's ``qk_norm``: ``qk_norm_weight=False``), Gemma 4's
    ``v_norm`` and keys as values (``attention_k_eq_v``: no v_proj; its layers' own head
    widths), ``query_scale`` (Llama 4's temperature tuning on NoPE layers, Ministral 3's
    ``llama_4_scaling_beta``), Gemma 4's KV-sharing layers (``num_kv_shared_layers``: a
    ``"reuse"`` layer, no k_proj / v_proj / k_norm / v_norm, ports to ``kv_shared=True``:
    ``W_query``, ``q_norm``, ``out_proj``), ``dropout`` (the
    attention weights' rate), ``context_length=None``.

    A model wires Gemma 4's shared layers as its ``shared_kv_states`` does: the last
    ``"store"`` layer of each layer type (``config.kv_sharing_modes``) is called with
    ``return_kv=True`` and its ``(k, v)`` kept under its ``layer_type``; each ``"reuse"``
    layer of that type is called with ``kv=`` that pair (same x length, its own
    ``positions=``).  In cached decoding the storing layer keeps its cache, and each
    reusing layer is called after it with ``kv=`` the cache it returned (no cache of its
    own: ``init_cache`` refuses it).  The self-check probes a reusing layer with one fixed
    draw of keys and values, given to both.  Ours and the layer are then run on
    one tiny probe input and must agree (else ValueError).  Call ours as ``ours(x, mask,
    positions=positions)`` where HF's takes ``position_embeddings=rotary(x, positions)``
    and an additive mask (``torch_attention.from_additive_mask`` converts one).

    What ours covers: the attention and its output projection.  BERT's ``BertAttention``
    ends with ``LayerNorm(dropout(dense(attn)) + x)``: ours is ``dense(attn)``; the residual,
    dropout and LayerNorm (``layer.output.LayerNorm``) stay the caller's.  GPT-2's
    ``resid_dropout`` after ``c_proj`` (training only) likewise.

    DeepSeek-V2/V3 (``DeepseekV2Attention``, ``DeepseekV3Attention``) give our
    ``MultiHeadLatentAttention``, the same parameter names (see ``_hf_latent``).

    The linear-attention layers of Qwen3.5 / Qwen3-Next (``Qwen3_5GatedDeltaNet``,
    ``Qwen3NextGatedDeltaNet``) and Kimi Linear (``KimiLinearDeltaAttention``) give our
    ``GatedDeltaNet`` / ``KimiDeltaAttention`` (see ``_hf_delta``).

    The layer is recognised by what it holds and computes, not by its class (tiny probes,
    eval mode, no gradients): the packing of a packed q/k/v (``_packing``), the rotary
    layout, halves or interleaved pairs (``_rope_layout``), whether a qk-norm sees q before
    or after rope (``_sees_rotation``), a BERT-like block's pre-norm (``_pre_norm``: the
    caller's, with the residual: ``x + ours(layer.LayerNorm(x))``).  A layer without its
    model's config (GPT-1's) is read from its own attributes (``_config``).

    Raises TypeError for a module that holds no attention projections under names it knows
    (naming what it holds); ValueError naming each mechanism ours cannot express (ALiBi, a
    qk-norm after rope, a packing ours does not split ...), for cross-attention, q/k/v with
    some biases but not all, and what ``rope_from_hf`` cannot read.
    """
    from torch_attention import _hf_v4

    if _hf_v4.is_v4(layer):  # DeepSeek-V4's attention: CompressedAttention
        return _hf_v4.from_hf(layer)
    if _latent(layer):
        from torch_attention import _hf_latent

        return _hf_latent.from_hf(layer)
    from torch_attention import _hf_delta

    if _hf_delta.layout(layer) is not None:  # linear attention: GatedDeltaNet / KimiDeltaAttention
        return _hf_delta.from_hf(layer)
    family = _family(layer, "from_hf")
    options = _options(layer, family)
    module = _build(options, _first_weight(layer, family))
    state = _hf_state(layer, family, options, module.spec)
    from torch_attention._state import load_torch_state_dict

    load_torch_state_dict(module, state)
    module.train(layer.training)
    _self_check(layer, family, module)
    if module.spec.clip_qkv is not None:  # again where the clamp bites: a layer that ignores its config's
        _self_check(layer, family, module, clip=module.spec.clip_qkv)
    if module.spec.query_scale is not None:  # again past its floor, across a step of it, where it is not 1
        _self_check(layer, family, module, offset=2 * module.spec.query_scale.floor - 2)
    return module


def _self_check(layer: nn.Module, family: _Family, ours: MultiHeadAttention, clip: float | None = None,
                offset: int = _PROBE_OFFSET) -> None:
    """Ours and the layer on one tiny probe input (eval, no gradients) must agree to the
    dtype's tolerance (float32: 1e-5 of the layer's largest output), else ValueError: a
    mechanism the rules missed is refused, never ported wrong.  Skipped where the layer
    cannot be called as its decoder layer calls it (BERT's ``BertAttention``, which adds
    its residual and LayerNorm; the meta device; a call convention the probe does not know)."""
    weight = next(layer.parameters(), None)
    if family.attention or family.not_ours or weight is None or weight.is_meta:
        return
    attention = _attention_of(layer)
    spec = ours.spec
    x = _probe_input(layer, _d_in(layer, family))
    if clip is not None:  # the probe scaled so that q_proj's largest output is 4 c: some are clamped
        with torch.no_grad():
            x = x * (4.0 * clip / max(float(_get(layer, family.packed or family.q)(x).abs().max()), 1e-6))
    mask = _probe_mask(x, spec.window, bool(spec.causal), spec.chunk)
    try:
        embeddings = None
        if "position_embeddings" in _forward_takes(attention):
            try:  # the real ones even where ours has no rope: a layer that turns by them differs
                embeddings = _probe_rotary(layer, attention, x, offset)
            except ValueError:  # no rotary embedding to build: the identity rotation
                width = int(getattr(attention, "head_dim", 0) or 0) or int(spec.head_dim or 0)
                ones = torch.ones(1, x.shape[1], width, dtype=x.dtype, device=x.device)
                embeddings = (ones, torch.zeros_like(ones))
        theirs = _hf_forward(layer, x, mask, embeddings, offset)
    except Exception:  # noqa: BLE001 - a call convention the check does not know: not checked
        return
    positions = torch.arange(offset, offset + x.shape[1], device=x.device)[None]
    training = ours.training
    ours.eval()
    try:
        with torch.no_grad():
            # (a NoPE layer's probe: 0.. without a cache, unless it scales its queries by position)
            at = spec.rope is not None or spec.query_scale is not None or offset != _PROBE_OFFSET
            kv = {"kv": _probe_kv(layer, x)} if spec.kv_shared else {}  # the keys the layer's probe read
            mine = ours(x, positions=positions, **kv) if at else ours(x, **kv)
    finally:
        ours.train(training)
    theirs, mine = theirs.float(), mine.float()
    difference = float((mine - theirs).abs().max())
    eps = 1e-5 if x.dtype == torch.float32 else 64 * torch.finfo(x.dtype).eps
    if not difference <= eps * max(float(theirs.abs().max()), 1e-6):
        where = "" if spec.clip_qkv is None else (
            f"; with clip_qkv={spec.clip_qkv} from its config: ours clamps q, k and v as they leave their projections, "
            "before any qk-norm (OLMoE clamps after its qk-norm)")
        if offset != _PROBE_OFFSET:
            where = (f"; with query_scale={tuple(spec.query_scale)} from its config, at positions {offset}.. where it "
                     "is not 1: ours scales each query at its own position, after rope and qk-norm")
        raise ValueError(f"from_hf: the port does not compute what the {type(layer).__name__} computes "
                         f"(max difference {difference:.3g} on a probe input{where})")


def _option_mismatches(ours: MultiHeadAttention, want: MultiHeadAttention) -> list[str]:
    """The options in which ``ours`` would not behave as the layer does (dropout, the
    implementation, mask_strategy and context_length change no result of an eval call)."""
    mine, theirs = ours.spec, want.spec
    fields = ("d_in", "d_out", "num_heads", "kv_heads", "head_dim", "out_proj", "qkv_bias", "out_bias",
              "kdim", "vdim", "qk_norm", "qk_norm_eps", "qk_norm_offset", "sinks", "causal", "softcap", "window", "chunk", "alignment",
              "clip_qkv", "output_gate", "output_gate_activation", "output_gate_per_head", "output_gate_bias",
              "qk_norm_weight", "query_scale_kind",
              "qk_norm_position", "out_norm", "v_norm", "values_from_keys", "query_scale", "kv_shared",
              "v_head_dim", "v_scale")
    problems = [f"{f}={getattr(mine, f)!r} where the layer has {getattr(theirs, f)!r}"
                for f in fields if getattr(mine, f) != getattr(theirs, f)]
    if theirs.qk_norm is not None and mine.qk_norm_scope != theirs.qk_norm_scope:
        problems.append(f"qk_norm_scope={mine.qk_norm_scope!r} where the layer has {theirs.qk_norm_scope!r}")
    problems += _rope_mismatch(mine.rope, theirs.rope)
    slopes = [np.asarray(m.slopes) if isinstance(m, Alibi) else None for m in (mine.score_mod, theirs.score_mod)]
    if (slopes[1] is not None and (slopes[0] is None or not np.array_equal(slopes[0], slopes[1]))) or (
            slopes[1] is None and (mine.score_mod is not None or mine.mask_mod is not None)):
        problems.append(f"score_mod={mine.score_mod!r} where the layer has {theirs.score_mod!r}")
    if mine.fan_out("out") != theirs.fan_out("out"):
        problems.append(f"out_features={mine.fan_out('out')} where the layer has {theirs.fan_out('out')}")
    scales = [s if s is not None else 1.0 / math.sqrt(int(spec.head_dim or 0)) for s, spec in
              ((mine.scale, mine), (theirs.scale, theirs))]
    if not math.isclose(scales[0], scales[1], rel_tol=1e-12):
        problems.append(f"scale={scales[0]!r} where the layer has {scales[1]!r}")
    return problems


def _hf_arrays(ours: MultiHeadAttention, family: _Family, options: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Our weights under the layer's parameter names, in its layouts (not yet cast)."""
    own = {k: v.detach() for k, v in ours.state_dict().items()}
    arrays: dict[str, torch.Tensor] = {}
    for mine, theirs in _names(family, options).items():
        value = own[mine]
        if family.layout == "in_out" and mine == "out_proj.weight":
            value = value.T
        arrays[theirs] = value
    if family.packed is not None:
        packed = pack_state_dict(ours.spec, own, layout=family.layout, packing=family.packing)
        arrays[f"{family.packed}.weight"] = torch.from_numpy(np.array(packed["qkv_weight"]))
        if packed["qkv_bias"] is not None:
            arrays[f"{family.packed}.bias"] = torch.from_numpy(np.array(packed["qkv_bias"]))
    if family.rope_reversed:
        flipped = _flip_halves(own, family, options, ours.spec)
        arrays.update({theirs: flipped[mine] for mine, theirs in _names(family, options).items() if mine in flipped})
    if family.gate:
        for part in ("weight", "bias") if options["qkv_bias"] else ("weight",):
            arrays[f"{family.q}.{part}"], arrays[f"{family.gate}.{part}"] = _split_gate(
                own[f"W_query.{part}"], options["num_heads"], ours.spec.gate_width())
    return arrays


def to_hf(ours: MultiHeadAttention | MultiHeadLatentAttention, layer: nn.Module) -> nn.Module:
    """Writes our ``MultiHeadAttention``'s weights into a ``transformers`` attention layer
    of a supported class, in place (cast to the layer's dtype), and returns the layer.
    The inverse of ``from_hf``.

    The layer must already behave as ours does once it has our weights: its geometry
    (d_in, heads, key/value heads, head_dim, biases, qk-norm and its eps) and its options
    (scale, causal, window, softcap, rope: what ``from_hf`` reads from it) must be ours.
    Everything is checked first; nothing is written unless every check passed and every
    parameter of the layer is accounted for (but BERT's ``output.LayerNorm``, which is not
    ours: it stays as it is).  Raises TypeError for a class that is not one
    of ours or not supported; ValueError naming each mismatch.  A linear-attention
    layer (Qwen3.5's, Qwen3-Next's, Kimi's) takes our ``GatedDeltaNet`` /
    ``KimiDeltaAttention``: ``_hf_delta.to_hf``.
    """
    from torch_attention import _hf_delta, _hf_v4

    if _hf_v4.is_v4(layer):  # DeepSeek-V4's attention: CompressedAttention
        return _hf_v4.to_hf(ours, layer)  # type: ignore[arg-type]
    if _hf_delta.layout(layer) is not None:
        return _hf_delta.to_hf(ours, layer)
    if _latent(layer):
        from torch_attention import _hf_latent

        return _hf_latent.to_hf(ours, layer)
    if not isinstance(ours, MultiHeadAttention):
        raise TypeError(f"to_hf takes torch_attention.MultiHeadAttention; got {type(ours).__name__}")
    family = _family(layer, "to_hf")
    options = _options(layer, family)
    want = MultiHeadAttention(**options, device="meta")
    problems = _option_mismatches(ours, want)
    if problems:
        raise ValueError(f"to_hf: this MultiHeadAttention does not fit the {type(layer).__name__} "
                         "(nothing was written): " + "; ".join(problems))
    arrays = _hf_arrays(ours, family, options)
    params = dict(layer.named_parameters())
    keep = () if family.not_ours is None else (family.not_ours + ".",)
    missing = sorted(n for n in set(params) - set(arrays) if not n.startswith(keep))
    misshaped = [f"{n}: ours {tuple(a.shape)}, the layer's {tuple(params[n].shape)}" for n, a in arrays.items()
                 if n not in params or a.shape != params[n].shape]
    if missing or misshaped:
        raise ValueError("to_hf: the weights do not fit the layer (nothing was written): "
                         + "; ".join([f"the layer's {n} has no counterpart in ours" for n in missing] + misshaped))
    ready = {n: a.to(dtype=params[n].dtype, device=params[n].device) for n, a in arrays.items()}
    with torch.no_grad():
        for name, tensor in ready.items():
            params[name].copy_(tensor)
    return layer
