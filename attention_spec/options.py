"""Checks of a module's configuration and of the options a call is given: positive sizes,
heads and their widths (``head_dim``, ``out_features``), the dropout rate, ``scale``, ``clip_qkv``, ``mask_strategy``, ``normalization``,
``implementation``, ``window``, ``chunk``, ``alignment``, ``softcap``, ``num_kv_heads``, the
functional ``layout`` of q, k and v (``check_attention_layout``, ``check_qkv_in_layout``), and the
constructor arguments together (``check_config``).

Each check takes the value as given and returns it canonical (a Python int or float),
or raises the one TypeError / ValueError text that both twins share.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

from attention_spec.arrays import check_qkv

MASK_STRATEGIES = ("fill", "renormalize")
NORMALIZATIONS = ("softmax", "sum")
IMPLEMENTATIONS = ("auto", "reference", "fused", "blockwise")
ALIGNMENTS = ("top_left", "bottom_right")
QK_NORMS = ("rms", "layer")
QK_NORM_SCOPES = ("head", "all")
QK_NORM_POSITIONS = ("before_rope", "after_rope")
OUTPUT_GATE_ACTIVATIONS = ("sigmoid", "softplus")
OUT_NORMS = ("rms",)
ATTENTION_LAYOUTS = ("bhsd", "bshd")


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {options}; got {value!r}")
    return value


def _is_real(value: Any) -> bool:
    """A Python or NumPy real number (``np.float32(0.5)``, ``np.int64(2)``), not a bool
    (``np.bool_`` is no ``numbers.Real``) and not an array."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    """A Python or NumPy integer (``np.int64(2)``), or another integer-like scalar; not a
    bool and not an array (a NumPy scalar has a shape, (), but is ``numbers.Integral``)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral) or (hasattr(value, "__index__") and not hasattr(value, "shape"))


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return value


def check_optional_width(name: str, value: Any) -> int | None:
    """``kdim`` / ``vdim`` (None: d_in), ``out_features`` (None: d_out): None or a
    positive int."""
    return None if value is None else check_positive_int(name, value)


def check_heads(d_out: Any, num_heads: Any) -> int:
    """Checks ``num_heads`` and that ``d_out`` splits evenly into heads; returns head_dim."""
    check_positive_int("d_out", d_out)
    check_positive_int("num_heads", num_heads)
    if d_out % num_heads:
        raise ValueError(
            f"d_out must be divisible by num_heads; got d_out={d_out}, num_heads={num_heads}"
        )
    return d_out // num_heads


def check_head_dim(d_out: Any, num_heads: Any, head_dim: Any) -> int:
    """``head_dim``, the width of one head: None (``d_out // num_heads``: ``d_out`` must
    split evenly, ``check_heads``) or a positive int (the q/k/v projections are then
    ``num_heads * head_dim`` wide, whatever ``d_out``); returns the head width."""
    if head_dim is None:
        return check_heads(d_out, num_heads)
    check_positive_int("d_out", d_out)
    check_positive_int("num_heads", num_heads)
    return check_positive_int("head_dim", head_dim)


def check_out_width(d_out: int, num_heads: int, head_dim: int, *, out_proj: bool, out_features: Any) -> int:
    """The module's output width.  With ``out_proj``: ``out_features`` (None: ``d_out``),
    the width that ``out_proj`` maps the merged heads (``num_heads * head_dim``) to.
    Without it the output is the merged heads themselves: ``out_features`` must be None
    and ``num_heads * head_dim`` must equal ``d_out``."""
    check_optional_width("out_features", out_features)
    if out_proj:
        return d_out if out_features is None else int(out_features)
    if out_features is not None:
        raise ValueError(
            f"out_features is the width out_proj maps to, and out_proj=False has none; got "
            f"out_features={out_features} (without out_proj the output is the merged heads, d_out wide)"
        )
    if num_heads * head_dim != d_out:
        raise ValueError(
            f"with out_proj=False the output is the merged heads: num_heads * head_dim must equal d_out; "
            f"got num_heads={num_heads}, head_dim={head_dim}, d_out={d_out}"
        )
    return d_out


def check_qk_norm(qk_norm: Any, scope: Any, eps: Any) -> tuple[str | None, str, float]:
    """``qk_norm`` (None: off, ``"rms"`` or ``"layer"``: RMSNorm / LayerNorm of the
    projected queries and keys), ``qk_norm_scope`` (``"head"``: over each head's
    head_dim, as Qwen3 and Phi; ``"all"``: over all heads together, as OLMo 2) and
    ``qk_norm_eps`` (a positive finite number); returns them canonical."""
    if qk_norm is not None:
        _one_of("qk_norm", qk_norm, (None, *QK_NORMS))  # type: ignore[arg-type]
    _one_of("qk_norm_scope", scope, QK_NORM_SCOPES)
    if not _is_real(eps) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"qk_norm_eps must be a positive finite float; got {eps!r}")
    return qk_norm, scope, float(eps)


def check_qk_norm_offset(qk_norm: str | None, offset: Any) -> float:
    """``qk_norm_offset``: the norms scale by ``offset + weight`` (Gemma 3's RMSNorm:
    1.0, its weights start at zeros) instead of the weight (0.0); a finite number, and
    nonzero only with ``qk_norm``; returns it as a float."""
    if not _is_real(offset) or not math.isfinite(offset):
        raise ValueError(f"qk_norm_offset must be a finite float; got {offset!r}")
    if offset != 0 and qk_norm is None:
        raise ValueError(f"qk_norm_offset={offset!r} needs qk_norm ('rms' or 'layer')")
    return float(offset)


def check_qk_norm_position(qk_norm: str | None, position: Any) -> str:
    """``qk_norm_position``: where the qk-norm runs, ``"before_rope"`` (on the projections,
    before the head split and rope: Qwen3, OLMo 2, Gemma 3) or ``"after_rope"`` (on the
    turned q and k: HunYuan's ``query_layernorm`` / ``key_layernorm``); anything but the
    default needs ``qk_norm``."""
    _one_of("qk_norm_position", position, QK_NORM_POSITIONS)
    if position != "before_rope" and qk_norm is None:
        raise ValueError(f"qk_norm_position={position!r} needs qk_norm ('rms' or 'layer')")
    return position


def check_output_gate(output_gate: bool, activation: Any, per_head: Any, bias: Any = False) -> tuple[str, bool, bool]:
    """``output_gate_activation`` (``"sigmoid"``: Qwen3-Next, AFMoE; ``"softplus"``: Laguna,
    computed in float32 at least), ``output_gate_per_head`` (True: one gate value per
    head, W_query's ``head_dim + 1`` rows a head, Laguna's per-head ``g_proj``; False: one
    per feature) and ``output_gate_bias`` (True: a parameter ``gate_bias`` (num_heads,),
    each head's one bias added to its gate before the activation: Beam's); anything but
    the defaults needs ``output_gate=True``."""
    _one_of("output_gate_activation", activation, OUTPUT_GATE_ACTIVATIONS)
    for name, value in (("output_gate_per_head", per_head), ("output_gate_bias", bias)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool; got {type(value).__name__} {value!r}")
    if not output_gate and (activation != "sigmoid" or per_head or bias):
        given = (f"output_gate_activation={activation!r}" if activation != "sigmoid" else
                 "output_gate_per_head=True" if per_head else "output_gate_bias=True")
        raise ValueError(f"{given} needs output_gate=True")
    return activation, per_head, bias


def check_out_norm(out_norm: Any) -> str | None:
    """``out_norm`` (BitNet's ``attn_sub_norm``): None (off) or ``"rms"``, an RMSNorm with a
    weight (``out_norm``) of the merged heads (``num_heads * head_dim``, after any output
    gate) before ``out_proj``, epsilon ``qk_norm_eps``."""
    return None if out_norm is None else _one_of("out_norm", out_norm, OUT_NORMS)


def check_clip_qkv(clip_qkv: Any) -> float | None:
    """``clip_qkv`` (OLMo's): None (off) or a positive finite number c; the query, key
    and value projections' outputs (after their biases, before qk-norm and rope) are
    clamped to [-c, c].  Returns a Python float.  Raises TypeError (not a number, or a
    bool) or ValueError (not positive, not finite)."""
    if clip_qkv is None:
        return None
    if not _is_real(clip_qkv):
        raise TypeError(f"clip_qkv must be None or a float; got {type(clip_qkv).__name__} {clip_qkv!r}")
    if not (math.isfinite(clip_qkv) and clip_qkv > 0):
        raise ValueError(f"clip_qkv must be None or a positive finite number; got {clip_qkv!r}")
    return float(clip_qkv)


def check_qk_norm_weight(qk_norm: str | None, weight: Any, offset: float) -> bool:
    """``qk_norm_weight``: True, the qk-norms have a learnable weight; False, a weightless
    RMS norm ``x * rsqrt(mean(x^2) + eps)`` (nanochat's, Llama 4's ``L2Norm``: no
    parameter), so it needs ``qk_norm="rms"`` and no ``qk_norm_offset``."""
    if not isinstance(weight, bool):
        raise TypeError(f"qk_norm_weight must be a bool; got {type(weight).__name__} {weight!r}")
    if not weight and qk_norm != "rms":
        raise ValueError(f"qk_norm_weight=False (a weightless RMS norm) needs qk_norm='rms'; got qk_norm={qk_norm!r}")
    if not weight and offset:
        raise ValueError(f"qk_norm_offset={offset!r} scales by offset + weight: it needs qk_norm_weight=True")
    return weight


V_NORMS = ("rms",)


def check_v_norm(v_norm: Any) -> str | None:
    """``v_norm`` (Gemma 4): None (off) or ``"rms"``, a weightless RMS norm of each value
    head over its head_dim (epsilon ``qk_norm_eps``), after the value projection."""
    return None if v_norm is None else _one_of("v_norm", v_norm, V_NORMS)


def check_values_from_keys(values_from_keys: Any, vdim: Any) -> bool:
    """``values_from_keys`` (Gemma 4's ``attention_k_eq_v``): True, no ``W_value``; the
    values are ``W_key``'s output before k-norm and rope, so there is no value input
    width (``vdim`` must be None)."""
    if not isinstance(values_from_keys, bool):
        raise TypeError(f"values_from_keys must be a bool; got {type(values_from_keys).__name__} {values_from_keys!r}")
    if values_from_keys and vdim is not None:
        raise ValueError(f"values_from_keys=True takes the values from W_key's output: vdim must be None; got vdim={vdim!r}")
    return values_from_keys


def check_kv_shared(kv_shared: Any, *, kdim: Any, vdim: Any, values_from_keys: bool, v_norm: Any) -> bool:
    """``kv_shared`` (Gemma 4's ``num_kv_shared_layers``, a layer whose
    ``kv_sharing_modes`` entry is ``"reuse"``): True, no ``W_key`` / ``W_value`` / ``k_norm``;
    the call takes another layer's keys and values (``kv=``), already normed and rotated,
    so there is no key or value input (``kdim`` / ``vdim`` None) and nothing of the
    values to build (``values_from_keys`` False, ``v_norm`` None)."""
    if not isinstance(kv_shared, bool):
        raise TypeError(f"kv_shared must be a bool; got {type(kv_shared).__name__} {kv_shared!r}")
    if kv_shared:
        for name, value, unset in (("kdim", kdim, None), ("vdim", vdim, None),
                                   ("values_from_keys", values_from_keys, False), ("v_norm", v_norm, None)):
            if value != unset:
                raise ValueError(f"kv_shared=True takes another layer's keys and values (kv=): {name} must be "
                                 f"{unset!r}; got {name}={value!r}")
    return kv_shared


def check_value_heads(v_head_dim: Any, v_scale: Any, *, output_gate: bool, values_from_keys: bool,
                      kv_shared: bool, out_proj: bool) -> float | None:
    """``v_head_dim`` (MiMo-V2-Flash's): None (the values' heads as wide as the keys') or a
    positive int, each value head's width (W_value ``num_kv_heads * v_head_dim`` wide,
    out_proj taking ``num_heads * v_head_dim``); it needs ``out_proj`` and no output gate,
    keys as values or shared keys and values (each of those has the values as wide as the
    keys).  ``v_scale``: None or a finite float != 0, the values times it as they leave
    W_value (after ``clip_qkv`` and ``v_norm``); returned as a Python float (or None)."""
    if v_head_dim is not None:
        check_positive_int("v_head_dim", v_head_dim)
        for name, value, unset in (("out_proj", out_proj, True), ("output_gate", output_gate, False),
                                   ("values_from_keys", values_from_keys, False), ("kv_shared", kv_shared, False)):
            if value != unset:
                raise ValueError(f"v_head_dim={v_head_dim} gives the values heads of their own width: {name} must "
                                 f"be {unset!r}; got {name}={value!r}")
    if v_scale is None:
        return None
    if isinstance(v_scale, bool) or not isinstance(v_scale, int | float) or not math.isfinite(v_scale) or v_scale == 0:
        raise ValueError(f"v_scale must be None or a finite number other than 0 (the values times it); got {v_scale!r}")
    return float(v_scale)


KV_SHARED_NEEDS_KV = (
    "a module built with kv_shared=True computes no keys or values: its call needs kv=, the (keys, values) "
    "another layer's call returned with return_kv=True, or, in cached decoding, that layer's KVCache after "
    "its call"
)
KV_SHARED_WITH_CACHE = (
    "a module built with kv_shared=True writes no cache: pass the storing layer's KVCache as kv=, not cache="
)
KV_SHARED_NO_CACHE = (
    "a module built with kv_shared=True writes no cache (it reads the storing layer's, kv=): it has no init_cache"
)
KV_WITH_CONTEXT = "kv= is another layer's self-attention keys and values: context must be None"
RETURN_KV_SHARED = (
    "return_kv=True returns the keys and values the call computes; a module built with kv_shared=True "
    "computes none (its kv= are another layer's)"
)
RETURN_KV_CACHE = (
    "return_kv=True with a cache: the cache the call returns holds its keys and values; pass that cache as "
    "kv= to the layers that reuse them"
)


def kv_not_shared_message(variant: str) -> str:
    """A call given ``kv=`` on a module that computes its own keys and values."""
    return (f"kv= takes another layer's keys and values, for a MultiHeadAttention built with kv_shared=True; "
            f"this {variant} computes its own")


def return_kv_unsupported_message(variant: str) -> str:
    return (f"return_kv=True returns a MultiHeadAttention's keys and values (for the kv_shared modules that "
            f"reuse them); {variant} has no return_kv")


def kv_kind(kv: Any, cache_type: type) -> str | None:
    """What a call's ``kv=`` is: None, ``"cache"`` (a ``cache_type``, the twin's KVCache)
    or ``"pair"`` (two arrays); a TypeError for anything else."""
    if kv is None:
        return None
    if isinstance(kv, cache_type):
        return "cache"
    if isinstance(kv, (tuple, list)) and len(kv) == 2 and all(hasattr(t, "shape") and hasattr(t, "dtype") for t in kv):
        return "pair"
    got = "one array" if hasattr(kv, "shape") else type(kv).__name__  # (the twins' array types differ)
    raise TypeError(f"kv must be a (keys, values) pair, as a return_kv=True call returns it, or the storing "
                    f"layer's KVCache; got {got}")


def check_kv_call(variant: str, has_option: bool, kv_shared: bool, kind: str | None, *, return_kv: Any,
                  cached: bool, context: bool) -> None:
    """The keywords of a call that shares keys and values, before any other check:
    ``kv=`` (``kind``, ``kv_kind``'s) only for a kv_shared module, which needs it and takes
    no cache, context or return_kv; ``return_kv`` only for a MultiHeadAttention (``has_option``)
    that computes its keys, without a cache."""
    if not isinstance(return_kv, bool):
        raise TypeError(f"return_kv must be a bool; got {type(return_kv).__name__} {return_kv!r}")
    if kind is not None and not kv_shared:
        raise ValueError(kv_not_shared_message(variant))
    if kv_shared:
        if cached:
            raise ValueError(KV_SHARED_WITH_CACHE)
        if return_kv:
            raise ValueError(RETURN_KV_SHARED)
        if kind is None:
            raise ValueError(KV_SHARED_NEEDS_KV)
        if context:
            raise ValueError(KV_WITH_CONTEXT)
    elif return_kv:
        if not has_option:
            raise ValueError(return_kv_unsupported_message(variant))
        if cached:
            raise ValueError(RETURN_KV_CACHE)


def check_shared_kv(kv: Any, *, batched: bool, batch: int, seq: int, kv_heads: int, head_dim: int,
                    dtype: str) -> None:
    """``kv=(keys, values)`` of a kv_shared module's call without a cache, given as
    (shape, dtype name) pairs: each (B, Hkv, T, D), as a return_kv=True call of x's length
    returns them ((Hkv, T, D) for an unbatched x), in the module's compute dtype."""
    (k_shape, k_dtype), (v_shape, v_dtype) = kv
    want = (batch, kv_heads, seq, head_dim) if batched else (kv_heads, seq, head_dim)
    if tuple(k_shape) != want or tuple(v_shape) != want:
        raise ValueError(
            f"kv does not fit this module: keys {tuple(k_shape)}, values {tuple(v_shape)}; expected keys and "
            f"values of shape {want} ((batch,) kv_heads, the length of x, head_dim), as the storing layer's "
            f"return_kv=True call on the same x returns them"
        )
    if k_dtype != dtype or v_dtype != dtype:
        raise ValueError(f"kv must be in the module's compute dtype {dtype}; got keys {k_dtype}, values {v_dtype}")


def check_shared_fill(fills: Any, new: Any) -> None:
    """A kv_shared call with ``kv=`` a KVCache: the storing layer has written this call's
    tokens, so each example's fill is at least its valid tokens (the queries sit at
    fill - new onward)."""
    if any(int(f) < int(n) for f, n in zip(fills, new, strict=True)):
        raise ValueError(
            "kv= a KVCache holds the storing layer's keys after its call on the same x: each example's fill "
            f"must be at least its valid tokens; got fills {[int(f) for f in fills]}, tokens {[int(n) for n in new]}"
        )


class QueryScale(NamedTuple):
    """Queries scaled by their absolute position p (after rope and qk-norm):
    ``q * (1 + beta * log1p(floor((p + offset) / floor)))``, exactly 1 while p + offset <
    floor.  Llama 4's attention temperature tuning is ``QueryScale(attn_scale,
    floor_scale, 1)``; Ministral 3 / Mistral 4's ``llama_4_scaling_beta`` is
    ``QueryScale(beta, original_max_position_embeddings, 0)``.  With
    ``query_scale_kind="power"`` the factor is ``(1 + (p + offset) / floor) ** beta`` instead
    (``exp(beta * log1p((p + offset) / floor))``, no flooring: Beam's scalable softmax on its
    NoPE layers is ``QueryScale(0.1, 2048, 1)`` of that kind)."""

    beta: float
    floor: int
    offset: int = 0


QUERY_SCALE_KINDS = ("log", "power")


def check_query_scale_kind(query_scale: QueryScale | None, kind: Any) -> str:
    """``query_scale_kind``: ``"log"`` (Llama 4's, Ministral 3's) or ``"power"`` (Beam's
    scalable softmax), the form of the factor ``query_scale`` gives; ``"power"`` needs a
    ``query_scale``."""
    _one_of("query_scale_kind", kind, QUERY_SCALE_KINDS)
    if kind != "log" and query_scale is None:
        raise ValueError(f"query_scale_kind={kind!r} needs query_scale (a QueryScale(beta, floor, offset))")
    return kind


def check_query_scale(query_scale: Any) -> QueryScale | None:
    """``query_scale``: None (off), a ``QueryScale`` or a tuple ``(beta, floor[, offset])``:
    beta a finite number, floor a positive int, offset an int; returns a ``QueryScale``
    of Python numbers."""
    if query_scale is None:
        return None
    if not isinstance(query_scale, tuple) or len(query_scale) not in (2, 3):
        raise TypeError(f"query_scale must be None or a QueryScale(beta, floor, offset); got "
                        f"{type(query_scale).__name__} {query_scale!r}")
    beta, floor, offset = (*query_scale, 0)[:3]
    if not _is_real(beta) or not math.isfinite(beta):
        raise ValueError(f"query_scale's beta must be a finite number; got {beta!r}")
    if not _is_int(floor) or floor.__index__() < 1:
        raise ValueError(f"query_scale's floor must be an int >= 1; got {floor!r}")
    if not _is_int(offset):
        raise ValueError(f"query_scale's offset must be an int; got {offset!r}")
    return QueryScale(float(beta), floor.__index__(), offset.__index__())


VALUES_FROM_KEYS_PAIR = (
    "values_from_keys=True takes the values from the keys: context must be one array, not a "
    "(key_input, value_input) pair"
)
QUERY_SCALE_WITH_CONTEXT = (
    "query_scale= scales the queries of self-attention by their positions: a call with context= "
    "(cross-attention) is not taken"
)


def check_kv_heads(num_heads: Any, num_kv_heads: Any) -> int:
    """``num_kv_heads`` (grouped-query attention): a positive int dividing ``num_heads``;
    returns it (None -> ``num_heads``)."""
    if num_kv_heads is None:
        return int(num_heads)
    check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads; got num_heads={num_heads}, "
            f"num_kv_heads={num_kv_heads}"
        )
    return int(num_kv_heads)


def check_dropout_rate(rate: Any) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1); got {type(rate).__name__} {rate!r}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout must be in [0, 1); got {rate}")
    return float(rate)


def check_scale(scale: Any) -> float | None:
    """``scale``: None, or a positive finite number (a NumPy scalar included); returns a
    Python float.  Raises TypeError (not a number, or a bool) or ValueError."""
    if scale is None:
        return None
    if not _is_real(scale):
        raise TypeError(f"scale must be None or a float; got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be None or a positive finite number; got {scale}")
    return float(scale)


def check_mask_strategy(value: Any) -> str:
    return _one_of("mask_strategy", value, MASK_STRATEGIES)


def check_normalization(value: Any) -> str:
    return _one_of("normalization", value, NORMALIZATIONS)


def zero_row_sum_message() -> str:
    return (
        "normalization='sum' divides each row of scores by its sum, and a row sums to zero; "
        "use normalization='softmax'"
    )


def check_implementation(value: Any) -> str:
    return _one_of("implementation", value, IMPLEMENTATIONS)


def check_alignment(value: Any) -> str:
    """Where query 0 sits among the keys for ``causal`` and ``window``: ``"top_left"`` (at
    key 0) or ``"bottom_right"`` (at key kv_len - q_len: the last query sees the last key)."""
    return _one_of("alignment", value, ALIGNMENTS)


def check_window(window: Any) -> tuple[int | None, int | None] | None:
    """``window=(left, right)``: query at position p may attend to keys p - left .. p + right
    (inclusive); None on a side is unbounded there.  Returns the pair as Python ints, or
    None for no window (None, or (None, None))."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints >= 0 or None; got {window!r}")
    pair = []
    for side, value in zip(("left", "right"), window, strict=True):
        if value is not None and not _is_int(value):
            raise TypeError(
                f"window must be None or a pair (left, right) of ints >= 0 or None; got {window!r}"
            )
        if value is not None and value.__index__() < 0:
            raise ValueError(f"window {side} must be >= 0 or None; got {value}")
        pair.append(None if value is None else value.__index__())
    left, right = pair
    return None if left is None and right is None else (left, right)


def check_chunk(chunk: Any) -> int | None:
    """``chunk`` (chunked local attention, Llama 4's ``attention_chunk_size``): None (off)
    or a positive int C; the query at key position p sees key j only where
    ``j // C == p // C`` (the chunks of key positions 0 .. C - 1, C .. 2C - 1, ...), on top
    of ``causal``, ``window``, lengths, masks and segments (all of them hold together).
    Chunks are counted in key positions: ``alignment`` and ``q_offset`` place the queries
    among them, a cache's slots are its positions.  Returns a Python int.  Raises
    TypeError (not an int, or a bool) or ValueError (below 1)."""
    if chunk is None:
        return None
    if not _is_int(chunk):
        raise TypeError(f"chunk must be None or an int >= 1; got {type(chunk).__name__} {chunk!r}")
    if chunk.__index__() < 1:
        raise ValueError(f"chunk must be None or an int >= 1; got {chunk!r}")
    return chunk.__index__()


# Order on every path and in the oracle: s = scale * q.k; s = softcap * tanh(s / softcap)
# (Gemma 2 caps the raw logits); s = s + bias (a position bias such as ALiBi is added to
# the capped logits, as Gemma 2 adds its attention mask after the cap); then masking.
def check_softcap(softcap: Any) -> float | None:
    """``softcap``: None (off) or a positive finite number (a NumPy scalar included);
    returns a Python float.  Raises ValueError."""
    if softcap is None:
        return None
    if not _is_real(softcap) or not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a positive finite float; got {softcap!r}")
    return float(softcap)


def check_attention_layout(value: Any) -> str:
    """The functional ``dot_product_attention``'s ``layout``: ``"bhsd"``, q (..., H, T, D)
    and k, v (..., Hkv, S, D), or ``"bshd"``, tokens before heads, q (..., T, H, D) and k,
    v (..., S, Hkv, D), as projections produce them.  (Not the rings' ``check_layout``.)"""
    return _one_of("layout", value, ATTENTION_LAYOUTS)


def heads_first(shape: Any, layout: str) -> tuple[int, ...]:
    """A q, k or v shape given in ``layout`` as (..., H, S, D), the shape the checks and
    the paths read; ``"bshd"`` needs at least 3 dimensions (..., S, H, D)."""
    shape = tuple(int(n) for n in shape)
    if layout == "bhsd":
        return shape
    if len(shape) < 3:
        raise ValueError(f"layout='bshd' takes q, k and v as (..., S, H, D), at least 3 dimensions; got {shape}")
    return (*shape[:-3], shape[-2], shape[-3], shape[-1])


def check_qkv_in_layout(q: Any, k: Any, v: Any, dtypes: tuple[str, str, str], layout: str) -> tuple[
        tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``check_qkv`` of q, k and v shapes given in ``layout`` (``check_attention_layout``
    first); returns them as (..., H, S, D).  A shape error of a ``"bshd"`` call names the
    layout and the shapes as given."""
    layout = check_attention_layout(layout)
    shapes = heads_first(q, layout), heads_first(k, layout), heads_first(v, layout)
    try:
        check_qkv(shapes[0], shapes[1], shapes[2], dtypes)
    except ValueError as error:
        if layout == "bhsd":
            raise
        given = ", ".join(f"{n} {tuple(int(d) for d in s)}" for n, s in zip("qkv", (q, k, v), strict=True))
        raise ValueError(f"{error} (read as (..., H, S, D) from layout='bshd', given {given})") from None
    return shapes[0], shapes[1], shapes[2]


_UNSET: Any = object()


def check_config(
    *,
    d_in: Any = _UNSET,
    d_out: Any = _UNSET,
    head_size: Any = _UNSET,
    context_length: Any = _UNSET,
    num_heads: Any = _UNSET,
    dropout: Any = _UNSET,
    scale: Any = _UNSET,
    causal: Any = _UNSET,
    mask_strategy: Any = _UNSET,
    normalization: Any = _UNSET,
    implementation: Any = _UNSET,
) -> None:
    """Checks the constructor arguments that a module has (the others stay unset)."""
    for name, value in (
        ("d_in", d_in), ("d_out", d_out), ("head_size", head_size),
        ("context_length", context_length),
    ):
        if value is not _UNSET:
            check_positive_int(name, value)
    if num_heads is not _UNSET:
        check_heads(d_out, num_heads)
    if dropout is not _UNSET:
        check_dropout_rate(dropout)
    if scale is not _UNSET:
        check_scale(scale)
    if causal is not _UNSET and not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__} {causal!r}")
    if mask_strategy is not _UNSET:
        check_mask_strategy(mask_strategy)
    if normalization is not _UNSET:
        check_normalization(normalization)
    if implementation is not _UNSET:
        check_implementation(implementation)


class CallOptions(NamedTuple):
    """The options of one attention call that are Python values, checked once
    (``call_options``) and then read, never checked again, by the route, every path, the
    CPU kernel's wrapper, the rings and the oracle.  Frozen and hashable: a static value
    under ``jit``.  The call's arrays (mask, bias, lengths, offsets, segments, sinks, a
    dropout mask) travel beside it in the twin's ``Call`` (``_canonical``).

    ``training``: dropout is drawn (PyTorch's ``training``, JAX's ``not deterministic``).
    ``sinks``: the call has attention sinks (their logits are an array of the ``Call``).
    """

    causal: bool = False
    scale: float | None = None
    mask_strategy: str = "fill"
    normalization: str = "softmax"
    softcap: float | None = None
    window: tuple[int | None, int | None] | None = None
    alignment: str = "top_left"
    dropout_rate: float = 0.0
    training: bool = False
    return_weights: bool = False
    implementation: str = "auto"
    layout: str = "bhsd"
    # Chunked local attention (``check_chunk``): None, or the chunk's width in key positions.
    chunk: int | None = None
    # A module's score and mask mods that stand for no named option (``flex.fold_named``):
    # the flex path and the reference math apply them, every other path refuses them.
    score_mod: Any = None
    mask_mod: Any = None

    @property
    def dropout_active(self) -> bool:
        """Dropout is drawn on this call: training mode and a positive rate."""
        return self.training and self.dropout_rate > 0.0



# The fields that the public functions take as keywords of the same names (a module's
# mods reach ``CallOptions`` through its planner alone).
KEYWORD_FIELDS = tuple(name for name in CallOptions._fields if name not in ("score_mod", "mask_mod"))


def call_options(
    *, causal: Any = False, scale: Any = None, mask_strategy: Any = "fill", normalization: Any = "softmax",
    softcap: Any = None, window: Any = None, alignment: Any = "top_left", dropout_rate: Any = 0.0,
    training: bool = False, return_weights: bool = False, implementation: Any = "auto", layout: Any = "bhsd",
    chunk: Any = None,
) -> CallOptions:
    """The checked ``CallOptions`` of the public functions' keywords (the same names),
    each check raising its one text; the value in canonical form (Python ints and
    floats, the window a tuple or None)."""
    layout = check_attention_layout(layout)  # first: the shapes are read in it
    return CallOptions(
        softcap=check_softcap(softcap),
        dropout_rate=check_dropout_rate(dropout_rate),
        scale=check_scale(scale),
        mask_strategy=check_mask_strategy(mask_strategy),
        normalization=check_normalization(normalization),
        window=check_window(window),
        chunk=check_chunk(chunk),
        alignment=check_alignment(alignment),
        implementation=check_implementation(implementation),
        causal=bool(causal),
        training=bool(training),
        return_weights=bool(return_weights),
        layout=layout,
    )
