"""Rotary position embeddings for PyTorch (``jax_attention/_rope.py`` is the twin):
``apply_rope`` turns the first ``rotary_dim`` features of q or k by their positions.

cos and sin are computed as ``transformers`` computes them: the float64 inverse
frequencies of ``attention_spec.rope.inv_freq`` rounded to float32, the positions as
float32, their product, cos and sin (times the attention factor of yarn / longrope) in
float32, then cast to x's dtype; the rotation ``x * cos + rotate(x) * sin`` runs in x's
dtype.  For float64 x every step is float64 instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attention_spec.arrays import dtype_name, host_array
from attention_spec.rope import (
    RopeConfig,
    check_inv_freq,
    check_rope,
    check_rope_call,
    inv_freq,
    needs_seq_len,
    rotary_dim,
)


def _seq_len(positions: Tensor, config: RopeConfig, seq_len: int | None) -> int | None:
    if seq_len is not None or not needs_seq_len(config) or positions.numel() == 0:
        return seq_len
    return int(positions.max()) + 1


def rope_cos_sin(
    positions: Tensor,
    config: RopeConfig,
    head_dim: int,
    *,
    dtype: torch.dtype,
    seq_len: int | None = None,
    inv_freq_override: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin of every position's angles, ``(B, T, rotary_dim / 2)``, in ``dtype``
    (from ``inv_freq_override`` instead of the config's frequencies when given)."""
    freqs: Any
    freqs, attention_factor = inv_freq(config, head_dim, _seq_len(positions, config, seq_len))
    if inv_freq_override is not None:
        freqs = inv_freq_override
    work = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions[..., None].to(work) * torch.as_tensor(freqs, device=positions.device).to(work)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(
    x: Tensor, positions: Any, config: RopeConfig, *, seq_len: int | None = None, inv_freq: Any = None
) -> Tensor:
    """Rotary position embedding of ``x`` (q or k, ``(B, H, T, D)``) at ``positions``
    (integers, ``(B, T)`` or ``(1, T)``: a tensor, or a list or NumPy array, checked as
    given and then made a tensor on x's device): feature pairs of the first ``rotary_dim``
    features turn by ``position * inv_freq``, the rest pass through.  ``seq_len``: the
    sequence length the dynamic and longrope scalings see (default: the largest position
    + 1).  ``inv_freq``: float frequencies, ``(rotary_dim / 2,)``, to use instead of the
    config's (a ported layer's own buffer: ``transformers`` computes its frequencies in
    float32 arithmetic, a few ulps from the float64 ones rounded once); the attention
    factor still comes from the config."""
    check_rope(config)
    if not isinstance(positions, Tensor):
        positions = host_array("rope positions", positions)
    check_rope_call(tuple(x.shape), tuple(positions.shape), dtype_name(positions.dtype))
    positions = torch.as_tensor(positions, device=x.device)
    head_dim = int(x.shape[-1])
    dim = rotary_dim(config, head_dim)
    override = None
    if inv_freq is not None:
        override = torch.as_tensor(inv_freq, device=x.device)
        check_inv_freq(tuple(override.shape), dtype_name(override.dtype), dim)
    cos, sin = rope_cos_sin(positions, config, head_dim, dtype=x.dtype, seq_len=seq_len, inv_freq_override=override)
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, dim / 2): one angle per pair, every head
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    if config.layout == "half":
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        half = dim // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    else:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1) if dim < head_dim else out
