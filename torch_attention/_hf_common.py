"""What the Hugging Face importers share (``_hf``, ``_hf_latent``): the keywords a layer's
forward takes, the rotary frequencies a family computes from its config, and whether our
rope turns q and k as the layer's does.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
from torch import nn

from attention_spec.rope import RopeConfig


def _forward_takes(layer: Any) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(layer.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _rotary_class(layer: nn.Module) -> Any:
    """The family's rotary embedding class: ``<Family>RotaryEmbedding`` beside the layer's
    class, else the one class named ``*RotaryEmbedding`` its module defines or imports."""
    module = sys.modules[type(layer).__module__]
    name = type(layer).__name__.removesuffix("Attention") + "RotaryEmbedding"
    found = getattr(module, name, None)
    if isinstance(found, type) and issubclass(found, nn.Module):
        return found
    candidates = {v for k, v in vars(module).items()
                  if k.endswith("RotaryEmbedding") and isinstance(v, type) and issubclass(v, nn.Module)}
    if len(candidates) > 1:  # Qwen3.5's module defines its vision tower's too: the text model's
        candidates = {c for c in candidates if "Vision" not in c.__name__}
    if len(candidates) == 1:
        return candidates.pop()
    raise ValueError(f"from_hf: {type(layer).__module__} has no {name} (nor one other *RotaryEmbedding) to read "
                     "the rotary frequencies from")


def _hf_inv_freq(layer: nn.Module, config: Any, layer_type: str | None, theta: float = 10000.0) -> torch.Tensor:
    """The ``inv_freq`` buffer of the family's rotary embedding (``_rotary_class``) built
    from the layer's config (Gemma 3 keeps one per layer type, ``<layer_type>_inv_freq``);
    for an embedding that keeps a table of sines and cosines instead (GPT-J's and CodeGen's
    ``embed_positions``, (positions, dim) = [sin(p f); cos(p f)]), the frequencies computed
    from the config as it computes them (float32, ``theta ** -(2i / dim)``), checked
    against its table."""
    rotary_class = _rotary_class(layer)
    with torch.device("cpu"):
        rotary = rotary_class(config)
    buffer = getattr(rotary, "inv_freq" if layer_type is None else f"{layer_type}_inv_freq", None)
    if buffer is None:
        buffer = getattr(rotary, "inv_freq", None)
    table = getattr(rotary, "embed_positions", None)
    if not isinstance(buffer, torch.Tensor) and isinstance(table, torch.Tensor) and table.dim() == 2:
        dim = int(table.shape[1])
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
        angles = torch.arange(min(int(table.shape[0]), 64), dtype=torch.int64).float()[:, None] * freqs
        if torch.equal(torch.cat((angles.sin(), angles.cos()), dim=1), table[: angles.shape[0]].float()):
            buffer = freqs
        else:
            raise ValueError(f"from_hf: {type(rotary).__name__} keeps a table of sines and cosines that is not "
                             f"[sin(p f); cos(p f)] for f = {theta:g} ** -(2i / {dim}) (a rotary embedding of another kind)")
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"from_hf: {type(rotary).__name__} keeps no inv_freq (a rotary embedding of another kind)")
    return buffer.detach().float()


def _rope_mismatch(mine: RopeConfig | None, theirs: RopeConfig | None) -> list[str]:
    """Ours must turn q and k as the layer does: the same rope configuration, and, where
    ours fixes its frequencies (``inv_freq``), the layer's own ones (the layer computes
    them from its config: they cannot be written).  Ours without ``inv_freq`` (the
    float64 formula) is the same rope a few ulps apart, accepted."""
    if mine is None or theirs is None:
        return [] if mine is theirs else [f"rope={mine!r} where the layer has {theirs!r}"]
    if dataclasses.replace(mine, inv_freq=None) != dataclasses.replace(theirs, inv_freq=None):
        return [f"rope={dataclasses.replace(mine, inv_freq=None)!r} where the layer has "
                f"{dataclasses.replace(theirs, inv_freq=None)!r}"]
    if mine.inv_freq is not None and mine.inv_freq != theirs.inv_freq:
        return ["rope inv_freq: ours fixes frequencies other than the ones the layer computes from its config"]
    return []
