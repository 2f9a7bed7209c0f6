"""The float64 layers the oracles share (``reference``, ``reference_sparse``): a linear
layer, the split into heads, the q/k norms and rope, in NumPy, parameters in PyTorch's
naming (``{name}.weight``, ``{name}.bias``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def _linear(params: Mapping[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
    y = x @ np.asarray(params[f"{name}.weight"], np.float64).T
    bias = params.get(f"{name}.bias")
    return y if bias is None else y + np.asarray(bias, np.float64)


def _heads(t: np.ndarray, num_heads: int, head_dim: int | None = None) -> np.ndarray:
    """(B, T, heads * D) -> (B, heads, T, D); a ``head_dim`` given must be the width's."""
    b, n, width = t.shape
    if head_dim is not None and width != num_heads * head_dim:
        raise ValueError(f"a projection of width {width} is not {num_heads} heads of head_dim={head_dim}")
    return t.reshape(b, n, num_heads, width // num_heads).transpose(0, 2, 1, 3)


def _qk_norm(params: Mapping[str, np.ndarray], name: str, y: np.ndarray, kind: str, eps: float,
             offset: float = 0.0) -> np.ndarray:
    """RMSNorm (``kind="rms"``) or LayerNorm (``"layer"``) of y (B, T, width) in float64,
    over groups as wide as ``{name}.weight`` (one head's head_dim, or the whole width),
    scaled by ``offset + weight`` (Gemma 3: offset 1)."""
    weight = offset + np.asarray(params[f"{name}.weight"], np.float64)
    g = y.reshape(*y.shape[:-1], -1, weight.shape[0])
    if kind == "layer":
        g = g - g.mean(-1, keepdims=True)
    g = g / np.sqrt((g * g).mean(-1, keepdims=True) + eps) * weight
    if kind == "layer":
        g = g + np.asarray(params[f"{name}.bias"], np.float64)
    return g.reshape(y.shape)


def rope(t: np.ndarray, positions: np.ndarray, config: Any) -> np.ndarray:
    """Rotary position embedding in float64, pair by pair: t (B, H, T, D), positions
    (B, T) or (1, T); pair i of the first ``rotary_dim`` features of the token at position
    p turns by ``p * inv_freq[i]`` (``attention_spec.rope.inv_freq``, float64), cos and sin
    times the attention factor; the pairs are ``(i, i + rotary_dim / 2)`` (layout
    ``"half"``) or ``(2i, 2i + 1)`` (``"interleaved"``)."""
    from attention_spec.rope import inv_freq, needs_seq_len, rotary_dim

    t = np.asarray(t, np.float64)
    positions = np.broadcast_to(np.asarray(positions), (t.shape[0], t.shape[2]))
    dim = rotary_dim(config, t.shape[-1])
    seq_len = int(positions.max()) + 1 if needs_seq_len(config) and positions.size else None
    freqs, factor = inv_freq(config, t.shape[-1], seq_len)
    out = t.copy()
    for i in range(dim // 2):
        a, b = (i, i + dim // 2) if config.layout == "half" else (2 * i, 2 * i + 1)
        angle = positions[:, None, :].astype(np.float64) * freqs[i]  # (B, 1, T)
        cos, sin = np.cos(angle) * factor, np.sin(angle) * factor
        out[..., a] = t[..., a] * cos - t[..., b] * sin
        out[..., b] = t[..., b] * cos + t[..., a] * sin
    return out
