"""``from_hf`` / ``to_hf`` for DeepSeek-V4's attention: transformers' ``DeepseekV4Attention``
(its three layer types: ``sliding_attention``, ``heavily_compressed_attention``,
``compressed_sparse_attention``) <-> our ``CompressedAttention``.

Read from the layer and its ``config``: the widths (``hidden_size``, heads,
``head_dim``, ``q_lora_rank``, ``o_groups``, ``o_lora_rank``, ``sliding_window``,
``rms_norm_eps``), the layer type and its ``compress_rates`` entry, the indexer's
(``index_n_heads``, ``index_head_dim``, ``index_topk``), and the rope of the layer's rope
type (``"main"`` for a sliding layer, ``"compress"`` for the others: transformers'
``rope_parameters[type]``) with the frequencies transformers computes for it
(``DeepseekV4RotaryEmbedding``'s float32 buffer, carried as the rope's ``inv_freq``).  Our
parameters carry transformers' names, so the weights copy one to one by name, exactly.
What our layer does not compute is refused by name before a weight is read: attention
dropout in training, a layer type we do not know, and parameters in two dtypes (a
checkpoint loaded in bfloat16 keeps its norms, sinks and position biases in float32,
``_keep_in_fp32_modules_strict``; ours holds one dtype, so such a layer is ported cast to
one, ``layer.float()`` exactly).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torch_attention.compressed import CompressedAttention

_TYPES = {"sliding_attention": None, "heavily_compressed_attention": "hca", "compressed_sparse_attention": "csa"}


def is_v4(layer: Any) -> bool:
    """Whether ``layer`` is a DeepSeek-V4 attention layer (what it holds: the shared-KV
    projection, the grouped output projection, sinks, and a config with layer types)."""
    if not isinstance(layer, nn.Module):
        return False
    children = {n for n, _ in layer.named_children()}
    return ({"q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm", "o_a_proj", "o_b_proj"} <= children
            and isinstance(getattr(layer, "sinks", None), torch.Tensor) and hasattr(layer, "layer_type"))


def _refuse(layer: Any, why: str) -> ValueError:
    return ValueError(f"{type(layer).__name__}: from_hf cannot port this DeepSeek-V4 attention layer: {why}")


def _rope(layer: Any) -> Any:
    """The layer's rope (its rope type's parameters) with transformers' own frequencies."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from attention_spec.rope import RopeConfig, rope_from_hf

    config, kind = layer.config, layer.rope_layer_type
    params = config.rope_parameters[kind]
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        raise _refuse(layer, f"its {kind!r} rope_type {rope_type!r} (ours: 'default' or 'yarn')")
    base = rope_from_hf(config, layer_type=kind, honours_partial=True)
    rotary = DeepseekV4RotaryEmbedding(config)
    freqs = getattr(rotary, f"{kind}_inv_freq").detach().to(torch.float64).tolist()
    fields = {f: getattr(base, f) for f in ("theta", "scaling", "factor", "original_max_position_embeddings",
                                             "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                             "attention_factor", "yarn_truncate")}
    if getattr(rotary, f"{kind}_attention_scaling") != 1.0 and fields["scaling"] != "yarn":
        raise _refuse(layer, "an attention scaling of its rope other than yarn's")
    if fields["scaling"] == "yarn":  # the factor transformers scales cos and sin by, as it computed it
        fields["attention_factor"] = float(getattr(rotary, f"{kind}_attention_scaling"))
    return RopeConfig(**fields, rotary_dim=2 * len(freqs), layout="interleaved", inv_freq=tuple(freqs))


def config_of(layer: Any) -> dict[str, Any]:
    """Our ``CompressedAttention``'s keywords for transformers' layer."""
    config = layer.config
    if layer.layer_type not in _TYPES:
        raise _refuse(layer, f"layer type {layer.layer_type!r} (ours: {', '.join(_TYPES)})")
    if layer.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise _refuse(layer, "attention_dropout in training mode (ours has no dropout)")
    compression = _TYPES[layer.layer_type]
    keywords: dict[str, Any] = {
        "d_in": config.hidden_size, "num_heads": layer.num_heads, "head_dim": layer.head_dim,
        "q_lora_rank": config.q_lora_rank, "o_groups": config.o_groups, "o_lora_rank": config.o_lora_rank,
        "window": layer.sliding_window, "rope": _rope(layer), "compression": compression,
        "norm_eps": float(config.rms_norm_eps),
    }
    if compression is not None:
        keywords["compress_rate"] = int(layer.compressor.compress_rate)
    if compression == "csa":
        indexer = layer.compressor.indexer
        keywords.update(index_heads=indexer.num_heads, index_head_dim=indexer.head_dim,
                        index_topk=indexer.index_topk)
    return keywords


def from_hf(layer: nn.Module) -> CompressedAttention:
    """Our ``CompressedAttention`` with ``layer``'s weights (exact copies, by name), in its
    dtype and mode.  Raises ValueError naming what ours does not compute."""
    theirs = layer.state_dict()
    weight = theirs["q_a_proj.weight"]
    others = sorted(n for n, t in theirs.items() if t.dtype != weight.dtype)
    if others:  # transformers' checkpoints keep the norms, sinks and position biases in float32
        raise _refuse(layer, f"{', '.join(others)} are in another dtype than its {weight.dtype} weights (ours holds "
                             "one dtype: rounding them would change the numbers); port it cast to one dtype "
                             "(layer.float() is exact)")
    keywords = config_of(layer)
    ours = CompressedAttention(**keywords, dtype=weight.dtype, device=weight.device)
    mine = ours.state_dict()
    if set(mine) != set(theirs):
        missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        raise _refuse(layer, f"its parameters differ from ours (missing {missing}, unexpected {extra})")
    with torch.no_grad():
        for name, tensor in mine.items():
            if tuple(theirs[name].shape) != tuple(tensor.shape):
                raise _refuse(layer, f"{name} has shape {tuple(theirs[name].shape)}, ours {tuple(tensor.shape)}")
            tensor.copy_(theirs[name].to(tensor.dtype))
    return ours.train(layer.training)


def to_hf(ours: CompressedAttention, layer: nn.Module) -> nn.Module:
    """Writes ``ours``'s weights into transformers' ``layer`` (exact copies, by name) after
    checking that the layer computes what ours does (its ``from_hf`` keywords equal ours);
    returns the layer.  Raises ValueError naming the first difference."""
    if not isinstance(ours, CompressedAttention):
        raise TypeError(f"{type(layer).__name__} (DeepSeek-V4's attention) takes our CompressedAttention; got "
                        f"{type(ours).__name__}")
    keywords = config_of(layer)
    mine = dict(ours.config)
    for name, value in keywords.items():
        if mine.get(name) != value:
            raise _refuse(layer, f"its {name} is {value!r}, ours {mine.get(name)!r}")
    theirs = layer.state_dict()
    state = ours.state_dict()
    if set(state) != set(theirs):
        raise _refuse(layer, f"its parameters differ from ours ({sorted(set(state) ^ set(theirs))})")
    with torch.no_grad():
        for name, tensor in theirs.items():
            tensor.copy_(state[name].to(tensor.dtype))
    return layer
