"""Rotary position embeddings for JAX (``torch_attention/_rope.py`` is the twin):
``apply_rope`` turns the first ``rotary_dim`` features of q or k by their positions.

cos and sin are computed as ``transformers`` computes them: the float64 inverse
frequencies of ``attention_spec.rope.inv_freq`` rounded to float32, the positions as
float32, their product, cos and sin (times the attention factor of yarn / longrope) in
float32, then cast to x's dtype; the rotation ``x * cos + rotate(x) * sin`` runs in x's
dtype.  For float64 x every step is float64 instead.

jit-compatible: the configuration is a hashable Python value (static), the frequencies
are constants.  The dynamic and longrope scalings depend on the sequence length seen
(the largest position + 1): under jit, with traced positions and no ``seq_len=``, longrope
picks its short or long factors from the traced positions, and dynamic NTK keeps the
frequencies of the original length (the same constants as eagerly) until the largest
position passes it, then computes them from the traced length in the working precision,
as ``transformers`` computes them (float32: within a few ulps of the float64 ones rounded
once, which is what the eager call gives).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

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


def _freqs(
    positions: Array, config: RopeConfig, head_dim: int, seq_len: int | None, work: type
) -> tuple[Array, float]:
    """The inverse frequencies in the ``work`` dtype (rounded from float64: constants) and
    the attention factor; for longrope with traced positions and no ``seq_len``, the short
    or long ones, chosen from the positions."""
    if seq_len is None and needs_seq_len(config) and config.inv_freq is None and positions.size:
        if not isinstance(positions, jax.core.Tracer):
            seq_len = int(np.max(np.asarray(positions))) + 1
        elif config.scaling == "dynamic":
            return _traced_dynamic(positions, config, head_dim, work), 1.0
        else:
            original = int(config.original_max_position_embeddings)  # type: ignore[arg-type]
            short, factor = inv_freq(config, head_dim, None)
            long, _ = inv_freq(config, head_dim, original + 1)
            chosen = jnp.where(jnp.max(positions) + 1 > original, long.astype(work), short.astype(work))
            return chosen, factor
    freqs, factor = inv_freq(config, head_dim, seq_len)
    return jnp.asarray(freqs.astype(work)), factor


def _traced_dynamic(positions: Array, config: RopeConfig, head_dim: int, work: type) -> Array:
    """Dynamic NTK's frequencies for traced positions: ``base_freq / g ** (2i / dim)`` with
    ``g = (factor * L / L0 - (factor - 1)) ** (dim / (dim - 2))`` from the traced length
    ``L`` where it passes the original ``L0``; at or below it, ``base_freq`` itself (the
    constants an eager call uses, bit for bit)."""
    original, factor = int(config.original_max_position_embeddings), float(config.factor)  # type: ignore[arg-type]
    dim = rotary_dim(config, head_dim)
    base, _ = inv_freq(config, head_dim, None)  # the original length's: theta unscaled
    length = (jnp.max(positions) + 1).astype(work)
    growth = (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
    longer = base.astype(work) / growth ** (np.arange(0, dim, 2) / dim).astype(work)
    return jnp.where(length > original, longer, base.astype(work))


def rope_cos_sin(
    positions: Array,
    config: RopeConfig,
    head_dim: int,
    *,
    dtype: jnp.dtype,
    seq_len: int | None = None,
    inv_freq_override: Array | None = None,
) -> tuple[Array, Array]:
    """cos and sin of every position's angles, ``(B, T, rotary_dim / 2)``, in ``dtype``
    (from ``inv_freq_override`` instead of the config's frequencies when given)."""
    work = np.float64 if jnp.dtype(dtype) == jnp.float64 else np.float32
    if inv_freq_override is not None:
        freqs, attention_factor = inv_freq_override.astype(work), inv_freq(config, head_dim, None)[1]
    else:
        freqs, attention_factor = _freqs(positions, config, head_dim, seq_len, work)
    angles = positions[..., None].astype(work) * freqs[None, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(
    x: Array, positions: Any, config: RopeConfig, *, seq_len: int | None = None, inv_freq: Any = None
) -> Array:
    """Rotary position embedding of ``x`` (q or k, ``(B, H, T, D)``) at ``positions``
    (integers, ``(B, T)`` or ``(1, T)``: an array, or a list or NumPy array, checked as
    given, before JAX's conversion changes its dtype): feature pairs of the first ``rotary_dim``
    features turn by ``position * inv_freq``, the rest pass through.  ``seq_len``: the
    sequence length the dynamic and longrope scalings see (default: the largest position
    + 1).  ``inv_freq``: float frequencies, ``(rotary_dim / 2,)``, to use instead of the
    config's (a ported layer's own buffer: ``transformers`` computes its frequencies in
    float32 arithmetic, a few ulps from the float64 ones rounded once); the attention
    factor still comes from the config."""
    check_rope(config)
    if not isinstance(positions, jax.Array):
        positions = host_array("rope positions", positions)
    check_rope_call(tuple(x.shape), tuple(positions.shape), dtype_name(positions.dtype))
    positions = jnp.asarray(positions)
    head_dim = int(x.shape[-1])
    dim = rotary_dim(config, head_dim)
    override = None
    if inv_freq is not None:
        override = jnp.asarray(inv_freq)
        check_inv_freq(tuple(override.shape), dtype_name(override.dtype), dim)
    cos, sin = rope_cos_sin(positions, config, head_dim, dtype=x.dtype, seq_len=seq_len, inv_freq_override=override)
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, dim / 2): one angle per pair, every head
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    if config.layout == "half":
        cos, sin = jnp.concatenate((cos, cos), axis=-1), jnp.concatenate((sin, sin), axis=-1)
        half = dim // 2
        rotated = jnp.concatenate((-x_rot[..., half:], x_rot[..., :half]), axis=-1)
    else:
        cos, sin = jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
        rotated = jnp.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), axis=-1).reshape(x_rot.shape)
    out = x_rot * cos + rotated * sin
    return jnp.concatenate((out, x_pass), axis=-1) if dim < head_dim else out
