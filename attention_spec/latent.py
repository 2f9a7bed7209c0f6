"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), framework-free: the checks of
its options and calls with the one text of each error, its softmax scale, and what its
cache costs a token.

The layer, as ``transformers``' ``DeepseekV3Attention`` computes it (x: (B, T, d_in))::

    q      = q_b_proj(rms(q_a_proj(x)))  or  q_proj(x)    (B, T, H * (nope + rope))
    q_nope, q_rope = split(q per head)                    (B, H, T, nope), (B, H, T, rope)
    c, k_rope = split(kv_a_proj_with_mqa(x))              (B, T, kv_lora_rank), (B, T, rope)
    c = rms(c)                                            the latent: what the cache holds
    q_rope, k_rope = RoPE(q_rope), RoPE(k_rope)           k_rope: one key for every head
    k_nope, v = split(kv_b_proj(c) per head)              (B, H, S, nope), (B, H, S, v_head_dim)
    k = concat(k_nope, k_rope broadcast to H heads)       (B, H, S, nope + rope)
    out = o_proj(merge(attention(concat(q_nope, q_rope), k, v, scale)))

The absorbed form (DeepSeek's inference) never expands keys or values: ``kv_b_proj``'s
key part folds into the query (``q_nope @ W_uk``: (B, H, T, kv_lora_rank)) and its
value part into the output (``(weights @ c) @ W_uv``), so the heads attend over the
latent itself, one key/value head for all (keys ``concat(c, k_rope)``, values ``c``).
"""

from __future__ import annotations

import math
from typing import Any

from attention_spec.options import _is_real, check_positive_int

LATENT_CONTEXT_MESSAGE = (
    "MultiHeadLatentAttention is self-attention: its keys and values come from x's own latent; "
    "context must be None"
)


def check_latent_widths(spec: Any) -> int:
    """The ranks and head widths of a latent attention config (an ``AttentionConfig``):
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim`` positive
    ints, ``q_lora_rank`` None or one; returns ``qk_rope_head_dim`` (the width rope turns).
    Raises TypeError / ValueError."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        check_positive_int(name, getattr(spec, name))
    if spec.q_lora_rank is not None:
        check_positive_int("q_lora_rank", spec.q_lora_rank)
    return int(spec.qk_rope_head_dim)


def check_norm_eps(eps: Any) -> float:
    """The epsilon of the latent's and the query's RMSNorm: a positive finite number."""
    if not _is_real(eps) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"norm_eps must be a positive finite float; got {eps!r}")
    return float(eps)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(spec: Any) -> float:
    """The scale of the scores: the ``scale`` option, else ``qk_head_dim ** -0.5``, times
    ``yarn_mscale(factor, mscale_all_dim) ** 2`` when rope scales by YaRN with
    ``mscale_all_dim`` (DeepSeek-V3: the attention grows with the context it was
    stretched to, as ``transformers``' ``yarn_apply_mscale``)."""
    if spec.scale is not None:
        return float(spec.scale)
    scale = float(spec.head_dim) ** -0.5
    rope = spec.rope
    if rope is not None and rope.scaling == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(float(rope.factor), float(rope.mscale_all_dim)) ** 2
    return scale


def check_latent_call(context: Any, absorb: Any) -> None:
    """A latent attention call: self-attention only (no ``context=``), ``absorb`` a bool."""
    if context is not None:
        raise ValueError(LATENT_CONTEXT_MESSAGE)
    if not isinstance(absorb, bool):
        raise TypeError(f"absorb must be a bool; got {type(absorb).__name__} {absorb!r}")


def cache_bytes_per_token(fields: Any) -> int:
    """Bytes one token takes in a cache, from its fields' ``(shape, itemsize)``: each
    stored array (B, heads, max_len, width) holds ``heads * width`` numbers a token (the
    lengths field, (B,), holds none).  Latent attention: ``(kv_lora_rank +
    qk_rope_head_dim) * itemsize``; multi-head attention: ``2 * kv_heads * head_dim *
    itemsize``."""
    return sum(int(shape[1]) * int(shape[3]) * int(itemsize) for shape, itemsize in fields if len(shape) == 4)
