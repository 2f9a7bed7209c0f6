"""DeepSeek's multi-head latent attention layers of ``transformers`` <-> our
``MultiHeadLatentAttention`` (``_hf.from_hf`` / ``_hf.to_hf`` hand them here).

The parameter names are the same on both sides (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``), so the weights copy one to one.  Every option is read from the layer as its
forward reads it: the widths from its config, ``scaling`` (YaRN's mscale included),
``is_causal``, the norms' ``variance_epsilon`` (1e-6 whatever ``rms_norm_eps`` says: the
layer builds them so), and the rope: ``rope_from_hf`` with the frequencies of the family's
own rotary embedding.  DeepSeek-V2 turns its rope parts as complex numbers, pair ``(2i,
2i + 1)``: the interleaved layout, whatever the config says; DeepSeek-V3 by
``rope_interleave``.  transformers writes the turned pairs as evens then odds, ours in
place: the same scores (q and k alike), so the same outputs.

DeepSeek-V3.2's and GLM-5's sparse attention (``DeepseekV32Attention``,
``GlmMoeDsaAttention``): the layer's ``indexer`` (``wq_b``, ``wk``, the LayerNorm ``k_norm``,
``weights_proj``, the same names in ours) gives ``index_topk``, ``index_heads`` (its config's
``index_n_heads``; the name ``CompressedAttention`` has too),
``index_head_dim``, and the layout of its rope, which its forward fixes: half-split for
DeepSeek-V3.2's indexer, interleaved for GLM-5's (``_INDEX_ROPE_LAYOUTS``, by the indexer's
class: the config does not say).  Refused by name: a GLM-5 layer that reuses the previous
layer's choice (``indexer_types`` "shared": ours takes that choice as ``selection=``), an
indexer of another class, an indexer whose parts differ from ours (its LayerNorm's epsilon
other than the latent norms', biases, another scale), and a ``weights_proj`` kept in
another dtype than the layer's (``transformers``' ``_keep_in_fp32_modules``: ours holds
one dtype, and a cast would not copy the weights exactly).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from attention_spec.rope import RopeConfig, needs_seq_len, rope_from_hf
from torch_attention._hf_common import _forward_takes, _hf_inv_freq, _rope_mismatch
from torch_attention.latent import MultiHeadLatentAttention

# The options that decide how a latent layer computes (not dropout or the path).
_BEHAVIOUR = ("d_in", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "q_lora_rank", "attention_bias", "norm_eps", "causal", "softcap", "window", "query_scale",
              "index_topk", "index_heads", "index_head_dim", "index_rope_layout")


# What a latent layer holds that ours computes (the same names as ours).
_HOLDS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
          "o_proj", "indexer")
# Sparse attention's indexers ours computes, and the layout its forward turns its rope slice in.
_INDEX_ROPE_LAYOUTS = {"DeepseekV32Indexer": "half", "GlmMoeDsaIndexer": "interleaved"}
_INDEXER_PARTS = ("wq_b", "wk", "k_norm", "weights_proj")
_EXTRAS = {"indexer": "sparse attention (an indexer that chooses the keys: DeepSeek-V3.2 / GLM-5)",
           "compressor": "compressed attention (DeepSeek-V4's compressor)",
           "q_gate_proj": "an output gate (q_gate_proj)"}


def refusals(layer: Any, raise_: bool = False) -> list[str]:
    """What a latent layer holds that ours does not compute, named, before any weight is
    read (sub-modules and parameters outside ``_HOLDS``); raises ValueError with them
    where ``raise_``."""
    problems = [f"{_EXTRAS.get(name, 'a sub-module no mechanism accounts for')}: `{name}` ({type(child).__name__})"
                for name, child in layer.named_children()
                if name not in _HOLDS and not isinstance(child, nn.Dropout | nn.Identity)]
    problems += [f"a parameter no mechanism accounts for: `{n}`" for n, _ in layer.named_parameters(recurse=False)]
    if getattr(layer, "skip_topk", False):
        problems.append("sparse attention that reuses the previous layer's choice of keys (GLM-5's indexer_types "
                        "'shared'): ours takes that choice as a call's selection=, not as a layer")
    indexer = getattr(layer, "_modules", {}).get("indexer")
    if indexer is not None:
        problems += _indexer_refusals(layer, indexer)
    if problems and raise_:
        raise ValueError(f"this {type(layer).__name__} cannot be expressed as MultiHeadLatentAttention: "
                         + "; ".join(problems))
    return problems


def _indexer_refusals(layer: Any, indexer: Any) -> list[str]:
    """What a sparse attention layer's indexer holds or does that ours does not."""
    kind = type(indexer).__name__
    if kind not in _INDEX_ROPE_LAYOUTS:
        return [f"an indexer ours does not know: `indexer` ({kind}; ours: {', '.join(_INDEX_ROPE_LAYOUTS)})"]
    problems = [f"an indexer part no mechanism accounts for: `indexer.{name}` ({type(child).__name__})"
                for name, child in indexer.named_children() if name not in _INDEXER_PARTS]
    norm, eps = indexer.k_norm, layer.kv_a_layernorm.variance_epsilon
    if not isinstance(norm, nn.LayerNorm) or norm.weight is None or norm.bias is None:
        problems.append(f"an indexer k_norm that is not a LayerNorm with weight and bias ({type(norm).__name__})")
    elif norm.eps != eps:
        problems.append(f"an indexer k_norm of epsilon {norm.eps} beside latent norms of {eps} (ours: one norm_eps)")
    problems += [f"a bias on `indexer.{n}`" for n in ("wq_b", "wk", "weights_proj")
                 if getattr(indexer, n).bias is not None]
    if not math.isclose(float(indexer.softmax_scale), indexer.head_dim ** -0.5, rel_tol=1e-12):
        problems.append(f"an indexer scale {indexer.softmax_scale} (ours: index_head_dim ** -0.5)")
    dtype = layer.kv_b_proj.weight.dtype
    problems += [f"`indexer.{n}` in {p.dtype} beside a {dtype} layer (transformers' _keep_in_fp32_modules): ours "
                 "holds one dtype" for n, p in indexer.named_parameters() if p.dtype != dtype]
    return problems


def _index_options(layer: Any) -> dict[str, Any]:
    """A sparse attention layer's indexer as our options (none for a dense layer)."""
    indexer = getattr(layer, "_modules", {}).get("indexer")
    if indexer is None:
        return {}
    return {"index_topk": int(indexer.index_topk), "index_heads": int(indexer.n_heads),
            "index_head_dim": int(indexer.head_dim), "index_rope_layout": _INDEX_ROPE_LAYOUTS[type(indexer).__name__]}


def _rope(layer: Any) -> RopeConfig | None:
    """The layer's rope: its config's, in DeepSeek-V2's interleaved pairs (a config
    without ``rope_interleave`` turns complex pairs), with the frequencies of its own
    rotary embedding where they do not follow the sequence length; None for a layer
    whose forward takes no ``position_embeddings`` (``_hf``'s rule for rope: by the call
    convention): Kimi Linear's MLA turns nothing, its model holds no rotary embedding."""
    if "position_embeddings" not in _forward_takes(layer):
        return None
    rope = rope_from_hf(layer.config)
    if not hasattr(layer.config, "rope_interleave"):
        rope = dataclasses.replace(rope, layout="interleaved")  # complex pairs (2i, 2i + 1)
    if needs_seq_len(rope):
        return rope
    inv_freq = _hf_inv_freq(layer, layer.config, None)
    return dataclasses.replace(rope, inv_freq=tuple(float(f) for f in inv_freq.tolist()))


def options(layer: Any) -> dict[str, Any]:
    """Our ``MultiHeadLatentAttention``'s keywords for this layer (no dtype / device)."""
    config = layer.config
    return {
        "d_in": int(config.hidden_size), "num_heads": int(config.num_attention_heads),
        "kv_lora_rank": int(config.kv_lora_rank), "qk_nope_head_dim": int(config.qk_nope_head_dim),
        "qk_rope_head_dim": int(config.qk_rope_head_dim), "v_head_dim": int(config.v_head_dim),
        "q_lora_rank": None if config.q_lora_rank is None else int(config.q_lora_rank),
        "context_length": None, "dropout": float(config.attention_dropout),
        "attention_bias": bool(config.attention_bias), "norm_eps": float(layer.kv_a_layernorm.variance_epsilon),
        "rope": _rope(layer), "scale": float(layer.scaling), "causal": bool(layer.is_causal),
        **_query_scale(config), **_index_options(layer),
    }


def _query_scale(config: Any) -> dict[str, Any]:
    """Mistral 4's ``llama_4_scaling_beta``: the whole query times 1 + beta * log(1 +
    floor(p / original_max_position_embeddings)) after rope, ``query_scale=(beta,
    original_max_position_embeddings, 0)``; ValueError naming it without an int length."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params.get("llama_4_scaling_beta"):
        return {}
    length = params.get("original_max_position_embeddings")
    if type(length) is not int:
        raise ValueError("this layer cannot be expressed as MultiHeadLatentAttention: llama_4_scaling_beta without an "
                         f"int original_max_position_embeddings (got {length!r})")
    return {"query_scale": (float(params["llama_4_scaling_beta"]), length, 0)}


def from_hf(layer: Any) -> MultiHeadLatentAttention:
    """A DeepSeek-V2/V3 attention layer (DeepSeek-V3.2's and GLM-5's sparse ones with their
    indexer) -> our ``MultiHeadLatentAttention``, its weights copied exactly, in its dtype,
    device and train/eval mode; ValueError naming what it holds that ours does not
    compute (DeepSeek-V4's compressor, GLM-5's shared layers ...)."""
    refusals(layer, raise_=True)
    like = layer.kv_b_proj.weight
    module = MultiHeadLatentAttention(**options(layer), dtype=like.dtype, device="meta").to_empty(device=like.device)
    from torch_attention._state import load_torch_state_dict

    load_torch_state_dict(module, {k: v.detach() for k, v in layer.state_dict().items()})
    return module.train(layer.training)


def _mismatches(ours: MultiHeadLatentAttention, want: MultiHeadLatentAttention) -> list[str]:
    mine, theirs = ours.spec, want.spec
    problems = [f"{f}={getattr(mine, f)!r} where the layer has {getattr(theirs, f)!r}"
                for f in _BEHAVIOUR if getattr(mine, f) != getattr(theirs, f)]
    if not math.isclose(ours.softmax_scale, want.softmax_scale, rel_tol=1e-12):
        problems.append(f"scale={ours.softmax_scale!r} where the layer has {want.softmax_scale!r}")
    return problems + _rope_mismatch(mine.rope, theirs.rope)


def to_hf(ours: Any, layer: nn.Module) -> nn.Module:
    """Writes our ``MultiHeadLatentAttention``'s weights into a DeepSeek-V2/V3 attention
    layer in place (cast to its dtype) and returns it; checks everything first and writes
    nothing unless the layer computes as ours does with them."""
    if not isinstance(ours, MultiHeadLatentAttention):
        raise TypeError(f"to_hf takes torch_attention.MultiHeadLatentAttention for a {type(layer).__name__}; "
                        f"got {type(ours).__name__}")
    refusals(layer, raise_=True)
    want = MultiHeadLatentAttention(**options(layer), device="meta")
    problems = _mismatches(ours, want)
    if problems:
        raise ValueError(f"to_hf: this MultiHeadLatentAttention does not fit the {type(layer).__name__} "
                         "(nothing was written): " + "; ".join(problems))
    arrays = {k: v.detach() for k, v in ours.state_dict().items()}
    params = dict(layer.named_parameters())
    if set(arrays) != set(params) or any(arrays[n].shape != params[n].shape for n in params):
        raise ValueError("to_hf: the weights do not fit the layer (nothing was written): ours "
                         f"{sorted(arrays)}, the layer's {sorted(params)}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(arrays[name].to(dtype=param.dtype, device=param.device))
    return layer
