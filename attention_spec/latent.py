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

Sparse attention (DSA: DeepSeek-V3.2, GLM-5), ``index_topk`` set: an indexer of its own
projections scores every key for every query and keeps each query's top ``index_topk``
visible keys; the attention runs on those only (a bool mask, True = selected, joining the
call's mask: whatever else hides a key still hides it).  As ``transformers``'
``DeepseekV32Indexer`` (q_resid = rms(q_a_proj(x)), the queries' low-rank input)::

    iq = wq_b(q_resid) per head                           (B, T, Hi, Di)
    ik = k_norm(wk(x))                                    (B, S, Di), a LayerNorm; one key for all heads
    iq, ik: RoPE on their first qk_rope_head_dim features (index_rope_layout: V3.2 "half",
            GLM-5 "interleaved"), at the main rope's frequencies; the rest pass
    score[t, s] = sum_h w[t, h] * relu(iq[t, h] . ik[s] * Di ** -0.5),
                  w = weights_proj(x) * Hi ** -0.5        in float32 (iq, ik, w cast up)
    selected = top index_topk of score over the visible keys (-inf elsewhere)

The selection is not differentiated (as ``transformers``' ``torch.no_grad``); a decoding
cache holds the indexer's keys after each token's latent (``cache_widths``).
"""

from __future__ import annotations

import dataclasses
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


INDEX_ROPE_LAYOUTS = ("half", "interleaved")


def check_indexer(spec: Any) -> None:
    """The indexer options of a latent attention config: ``index_topk`` None (dense: then
    no other ``index_*`` option is set) or a positive int, which needs ``index_heads``
    and ``index_head_dim`` (positive ints, the head at least ``qk_rope_head_dim`` wide: its
    rope slice) and ``q_lora_rank`` (the indexer's queries read the queries' low-rank
    input); ``index_rope_layout`` ``"half"`` or ``"interleaved"``.  Raises TypeError /
    ValueError."""
    if spec.index_rope_layout not in INDEX_ROPE_LAYOUTS:
        raise ValueError(f"index_rope_layout must be one of {INDEX_ROPE_LAYOUTS}; got {spec.index_rope_layout!r}")
    if spec.index_topk is None:
        for name in ("index_heads", "index_head_dim"):
            if getattr(spec, name) is not None:
                raise ValueError(f"{name} is the sparse attention indexer's: it needs index_topk")
        if spec.index_rope_layout != "half":
            raise ValueError("index_rope_layout is the sparse attention indexer's: it needs index_topk")
        return
    check_positive_int("index_topk", spec.index_topk)
    for name in ("index_heads", "index_head_dim"):
        if getattr(spec, name) is None:
            raise ValueError(f"index_topk (sparse attention) needs {name}")
        check_positive_int(name, getattr(spec, name))
    if spec.q_lora_rank is None:
        raise ValueError("index_topk (sparse attention) needs q_lora_rank: the indexer's queries read "
                         "q_a_layernorm(q_a_proj(x))")
    if spec.index_head_dim < spec.qk_rope_head_dim:
        raise ValueError(f"index_head_dim must be >= qk_rope_head_dim {spec.qk_rope_head_dim} (its rope slice); "
                         f"got {spec.index_head_dim}")


def indexer_layers(spec: Any) -> tuple[tuple[str, str, int, int], ...]:
    """The indexer's layers, ``(name, kind, fan_in, fan_out)`` with ``transformers``' names
    (the submodule ``indexer``): ``wq_b`` (q_lora_rank -> index_heads * index_head_dim),
    ``wk`` (d_in -> index_head_dim), ``weights_proj`` (d_in -> index_heads), linear
    without bias; ``k_norm`` a LayerNorm of ``index_head_dim`` (weight and bias; kind
    ``"layer"``, fan_in = fan_out = its width).  None without ``index_topk``."""
    if getattr(spec, "index_topk", None) is None:
        return ()
    heads, width = int(spec.index_heads), int(spec.index_head_dim)
    return (("wq_b", "linear", int(spec.q_lora_rank), heads * width), ("wk", "linear", int(spec.d_in), width),
            ("k_norm", "layer", width, width), ("weights_proj", "linear", int(spec.d_in), heads))


def indexer_rope(spec: Any) -> Any:
    """The indexer's rope: the module's (its frequencies, scaling and attention factor),
    turning the first ``rotary_dim`` features (the main rope's, over ``qk_rope_head_dim``)
    of an ``index_head_dim`` head in ``index_rope_layout``; None without rope."""
    from attention_spec.rope import rotary_dim

    if spec.rope is None:
        return None
    dim = rotary_dim(spec.rope, int(spec.qk_rope_head_dim))
    return dataclasses.replace(spec.rope, rotary_dim=dim, partial_rotary_factor=None, layout=spec.index_rope_layout)


SELECT_KEYS_ONLY_SPARSE = "select_keys is sparse attention's (the indexer's choice): the module has no index_topk"
SELECTION_ONLY_SPARSE = "selection= is the sparse attention indexer's choice of keys: the module has no index_topk"


def check_selection(shape: tuple[int, ...], dtype: str, expected: tuple[int, ...], sparse: bool) -> None:
    """A call's ``selection=`` (the keys each query may attend to, replacing the indexer's
    top-k: another layer's, GLM-5's shared layers, or the harness's): bool, ``expected``
    (B, T, S) (unbatched: (T, S)), for a module with an indexer only."""
    if not sparse:
        raise ValueError(SELECTION_ONLY_SPARSE)
    if dtype != "bool" or tuple(shape) != tuple(expected):
        raise ValueError(f"selection must be a bool array of shape {tuple(expected)} (True = selected); "
                         f"got {dtype} {tuple(shape)}")


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
