"""Weights in and out of the Flax NNX twins, in either framework's layout.  Needs no PyTorch.

Twin of ``torch_attention/interop.py``: both offer ``torch_state_dict``, ``flax_arrays``,
``load_torch_state_dict``, ``load_flax_arrays`` and ``load_packed_qkv`` for their own
modules, plus array-level converters for checkpoints.  The map is declared in
``attention_spec.interop.conversion`` (names, transposes, shapes) and ``attention_spec.interop.packing``
(packed q/k/v, head-shaped kernels), both in the rules of one weight map
(``attention_spec.interop.specs``); a load checks everything before it writes
anything, so a failed load leaves the module as it was.

Flax's own attention, both ways: ``from_nnx_multihead`` / ``to_nnx_multihead`` for
``flax.nnx.MultiHeadAttention``, ``from_linen_multihead_params`` /
``to_linen_multihead_params`` (and ``from_linen_multihead`` / ``to_linen_multihead``
with the Linen module) for Linen's ``MultiHeadDotProductAttention``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, cast

import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_spec.interop.conversion import (
    as_numpy,
    check_float_arrays,
    flatten_paths,
    flax_to_torch,
    rules_for,
    torch_to_flax,
)
from attention_spec.interop.native import ANY, Check, native_options, refusals, spec_refusals
from attention_spec.interop.packing import (
    native_flax_params,
    not_ours_message,
    packed_state_dict,
    state_dict_from_native_flax,
)
from attention_spec.registry import AttentionConfig
from jax_attention._base import AttentionModule
from jax_attention._state import flax_arrays, load_flax_arrays, load_torch_state_dict, torch_state_dict
from jax_attention.causal import CausalAttention, Head
from jax_attention.latent import MultiHeadLatentAttention
from jax_attention.multihead import MultiHeadAttention, MultiHeadAttentionWrapper
from jax_attention.self_attention import SelfAttention_v1, SelfAttention_v2
from jax_attention.simplified import SimplifiedAttention

__all__ = [
    "flax_arrays",
    "from_linen_multihead",
    "from_linen_multihead_params",
    "from_nnx_multihead",
    "load",
    "load_flax_arrays",
    "load_packed_qkv",
    "load_torch_state_dict",
    "state_from_torch",
    "state_to_torch",
    "save",
    "to_linen_multihead",
    "to_linen_multihead_params",
    "to_nnx_multihead",
    "torch_state_dict",
]


# The module of each variant of the registry (``attention_spec.registry.VARIANTS``), by name.
_MODULES: dict[str, type[AttentionModule]] = {cls.__name__: cls for cls in (
    SimplifiedAttention, SelfAttention_v1, SelfAttention_v2, CausalAttention, Head, MultiHeadAttentionWrapper,
    MultiHeadAttention, MultiHeadLatentAttention)}


def state_from_torch(
    state_dict: Mapping[str, Any], variant: str, config: Mapping[str, Any]
) -> nnx.State:
    """A PyTorch ``state_dict`` (tensors or NumPy arrays) -> an ``nnx.State`` of params,
    each ``nnx.Param`` with the metadata the module's own has (its partitioning), so the
    state has the module's tree structure."""
    flat = torch_to_flax({k: as_numpy(v) for k, v in state_dict.items()}, rules_for(variant, config))
    cls = _MODULES[variant]
    abstract = nnx.eval_shape(lambda: cls(**config, rngs=nnx.Rngs(0)))  # shapes and metadata, no values
    template = dict(nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
    return nnx.from_flat_state({  # a copy
        p: template[p].replace(jnp.array(a)) if p in template else nnx.Param(jnp.array(a)) for p, a in flat.items()
    })


def state_to_torch(
    state: nnx.State | Mapping[Any, Any], variant: str, config: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """An ``nnx.State`` (or {path: array}, {"a/b": array}, nested) -> PyTorch-named arrays.

    A full ``nnx.state(module)`` is accepted: only its ``nnx.Param`` variables are
    weights, the dropout streams' ``RngKey``/``RngCount`` are skipped."""
    if isinstance(state, nnx.State):
        state = {tuple(p): v[...] for p, v in nnx.to_flat_state(state) if isinstance(v, nnx.Param)}
    return flax_to_torch(flatten_paths(state), rules_for(variant, config))


def load_packed_qkv(
    module: nnx.Module,
    qkv_weight: Any,
    qkv_bias: Any = None,
    *,
    layout: str,
    packing: str = "thirds",
    out_weight: Any = None,
    out_bias: Any = None,
) -> nnx.Module:
    """Writes a packed q/k/v checkpoint (GPT-2's ``c_attn``, ``in_proj_weight``) into one
    of our modules with its own q/k/v projections (``MultiHeadAttention``, ...).

    ``layout`` (keyword, required: a square packed weight would be ambiguous) applies to
    both weights: ``"in_out"``: qkv_weight (d_in, 3*d_out), out_weight (d_out, d_out)
    applied as ``x @ W`` (GPT-2's ``Conv1D``); ``"out_in"``: (3*d_out, d_in) and (out,
    in), as ``nn.Linear``.  Biases: qkv_bias (3*d_out,), out_bias (d_out,).  ``packing``
    orders the packed axis: ``"thirds"`` (the default, ``[q; k; v]`` in equal blocks),
    ``"per_head"`` (each head's q, k, v in turn: GPT-NeoX) or ``"grouped"`` (``[q; k; v]``
    with the module's num_heads and num_kv_heads: Phi-3), as the PyTorch twin's.  Without
    ``out_weight`` the output projection is left as it is; ``out_weight`` without
    ``out_bias`` loads a zero bias (our projection always has one).  Arrays are cast to
    the module's parameter dtype.

    Raises ValueError (``attention_spec.interop.packing.packed_state_dict``'s checks: layout,
    packing, shapes, widths against the module, a qkv_bias the module lacks or needs) and
    TypeError (non-floating arrays) before writing anything.  Returns the module.
    """
    if not isinstance(module, AttentionModule):
        raise TypeError(not_ours_message(module))
    arrays = packed_state_dict(module.spec, qkv_weight, qkv_bias, layout=layout, packing=packing,
                               out_weight=out_weight, out_bias=out_bias)
    state = torch_state_dict(module)
    state.update(arrays)
    return load_torch_state_dict(module, state)  # checks names, shapes, dtypes before any write


# ------------------------------------------------------------ Flax's own attention modules


def _default_attention_fn() -> Any:
    from flax.nnx.nn.attention import dot_product_attention

    return dot_product_attention


def _linen_attention_fn() -> Any:
    from flax.linen.attention import dot_product_attention

    return dot_product_attention


# normalize_qk's LayerNorms (a scale, no bias, each head's head_dim) <-> our qk-norms
_NATIVE_NORMS = {"query_ln": "q_norm", "key_ln": "k_norm"}
_PROJECTIONS = ("W_query", "W_key", "W_value", "out_proj")


def _layer_norm_epsilon(linen: bool) -> float:
    """The epsilon of normalize_qk's LayerNorms: the LayerNorm default (Flax sets none)."""
    if linen:
        import flax.linen as nn

        return float(nn.LayerNorm.epsilon)
    return float(inspect.signature(nnx.LayerNorm.__init__).parameters["epsilon"].default)


def _native_qk_norm(m: Any) -> str | None:
    q, k = getattr(m, "query_ln", None), getattr(m, "key_ln", None)
    if not m.normalize_qk or q is None or k is None or q.epsilon == k.epsilon:
        return None
    return (f"normalize_qk=True with query_ln.epsilon={q.epsilon!r} != key_ln.epsilon={k.epsilon!r} "
            "(our q_norm and k_norm share one qk_norm_eps)")


def _native_carries(default_fn: Any) -> dict[str | tuple[str, ...], Check]:
    """What our MultiHeadAttention reproduces of an nnx.MultiHeadAttention's / a Linen
    MultiHeadDotProductAttention's constructor options (the allow-list of
    ``attention_spec.interop.native``): any other one that is not at its default (a custom
    promotion or matmul, an option added to Flax later) is refused by name."""
    return {
        "normalize_qk": _native_qk_norm,  # our qk_norm="layer", per head, zero biases
        "decode": lambda m: "decode=True (an autoregressive cache)" if m.decode else None,
        "num_kv_heads": ANY,  # nnx's grouped-query heads: our num_kv_heads (Linen's module has none)
        "in_features": lambda m: None if isinstance(m.in_features, int) else (
            f"in_features={m.in_features!r} (a tuple of input axes)"),
        "attention_fn": lambda m: None if m.attention_fn is default_fn else (
            f"attention_fn={getattr(m.attention_fn, '__name__', m.attention_fn)!r} "
            "(only Flax's dot_product_attention)"),
        # widths: qkv_features = num_heads * head_dim, out_features ours
        ("num_heads", "qkv_features", "out_features", "in_kv_features"): ANY,
        ("dtype", "param_dtype", "precision", "use_bias", "dropout_rate", "deterministic"): ANY,
        # the dropout draws differ in training mode whatever this is (see from_nnx_multihead)
        "broadcast_dropout": ANY,
        # ours computes the softmax in float32 (float64 for float64) whatever this is
        "force_fp32_for_softmax": ANY,
        # what shaped the weights we copy, and the module's own place and streams
        ("kernel_init", "out_kernel_init", "bias_init", "out_bias_init", "rngs", "parent", "name"): ANY,
    }


def _refuse(what: str, problems: list[str]) -> None:
    if problems:
        raise ValueError("\n".join([f"{what}:", *(f"  {p}" for p in problems)]))


def _rngs_for(dropout: float, rngs: nnx.Rngs | None, what: str) -> nnx.Rngs:
    # The weights are overwritten, so any key initialises; a dropout stream is a choice
    # of randomness that we do not make silently.
    if rngs is not None:
        return rngs
    if dropout > 0.0:
        raise ValueError(f"{what} has dropout_rate={dropout}: pass rngs= (an nnx.Rngs, e.g. nnx.Rngs(0), "
                         "whose default or 'dropout' stream draws the dropout; it also initialises the "
                         "weights before they are overwritten)")
    return nnx.Rngs(0)


def _grouped_kv_heads(core: Mapping[str, Any]) -> int | None:
    """The key/value heads of a grouped-query tree (nnx's ``num_kv_heads``: key and value
    kernels (in_kv, kv_heads, head_dim), kv_heads a divisor of the query's heads other
    than all of them), or None for any other tree (``state_dict_from_native_flax``
    checks it, naming what is wrong)."""
    try:
        query, key, value = (np.shape(core[role]["kernel"]) for role in ("query", "key", "value"))
    except (KeyError, TypeError):
        return None
    if len(query) != 3 or len(key) != 3 or key[1:] != value[1:] or key[2] != query[2] or key[1] == query[1]:
        return None
    return int(key[1]) if key[1] > 0 and query[1] % key[1] == 0 else None


def _native_state(tree: Mapping[str, Any], *, grouped: bool = False
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int, int]:
    """Flax's attention param tree -> (our projections' PyTorch-named arrays, our
    q_norm/k_norm weights from query_ln/key_ln (empty without normalize_qk), num_heads,
    num_kv_heads), after every check of the tree.  ``grouped``: key/value kernels of
    fewer heads (nnx's ``num_kv_heads``) are taken; Linen's attention has none."""
    core = {role: node for role, node in tree.items() if role not in _NATIVE_NORMS}
    kv_heads = _grouped_kv_heads(core) if grouped else None
    if kv_heads is None:
        state = state_dict_from_native_flax(core)  # every shape check of the projections
    else:
        # The checks on every head: the grouped key/value heads repeated to the query's;
        # then their weights as they are (the same (in, heads, head_dim) -> (heads *
        # head_dim, in) as every projection's).
        repeat = np.shape(core["query"]["kernel"])[1] // kv_heads
        wide = {role: dict(node) for role, node in core.items()}
        for role in ("key", "value"):
            node = wide[role]
            kernel = as_numpy(node["kernel"])
            node["kernel"] = np.repeat(kernel, repeat, axis=1)
            if "bias" in node and np.shape(node["bias"]) == kernel.shape[1:]:
                node["bias"] = np.repeat(as_numpy(node["bias"]), repeat, axis=0)
        state = state_dict_from_native_flax(wide)
        for role, name in (("key", "W_key"), ("value", "W_value")):
            kernel = as_numpy(core[role]["kernel"])
            state[f"{name}.weight"] = np.array(kernel.reshape(kernel.shape[0], -1).T)
            if "bias" in core[role]:
                state[f"{name}.bias"] = np.array(as_numpy(core[role]["bias"]).reshape(-1))
    heads, head_dim = np.shape(core["query"]["kernel"])[1:]
    found = [role for role in _NATIVE_NORMS if role in tree]
    if found and len(found) != len(_NATIVE_NORMS):
        raise ValueError(f"the attention params hold {found[0]} without {set(_NATIVE_NORMS).difference(found).pop()}: "
                         "normalize_qk has both")
    norms: dict[str, np.ndarray] = {}
    for role in found:
        node = tree[role]
        if not isinstance(node, Mapping) or set(node) != {"scale"}:
            raise ValueError(f"params[{role!r}] must be a mapping with only 'scale' (normalize_qk's LayerNorm "
                             f"has no bias); got {sorted(node) if isinstance(node, Mapping) else type(node).__name__}")
        scale = as_numpy(node["scale"])
        if scale.shape != (head_dim,):
            raise ValueError(f"params[{role!r}]['scale'] {scale.shape} does not fit heads of {head_dim}: "
                             f"expected ({head_dim},)")
        norms[f"{_NATIVE_NORMS[role]}.weight"] = scale
    return state, norms, int(heads), int(heads) if kv_heads is None else kv_heads


def _our_module_from_native(
    tree: Mapping[str, Mapping[str, Any]],
    *,
    num_heads: int,
    dropout: float,
    dtype: Any,
    precision: Any,
    rngs: nnx.Rngs,
    qk_norm_eps: float,
    grouped: bool = False,
) -> nnx.Module:
    """Our MultiHeadAttention from Flax's attention param tree: q/k/v kernels (d_in,
    heads, head_dim) give d_in, num_heads and head_dim; the output kernel (heads,
    head_dim, out) gives d_out = out (``head_dim=`` when heads * head_dim is another
    width); query_ln/key_ln give qk_norm="layer" with ``qk_norm_eps`` and zero biases;
    ``grouped``: key/value kernels of fewer heads give ``num_kv_heads`` (nnx's)."""
    state, norms, heads, kv_heads = _native_state(tree, grouped=grouped)  # every check, before anything is built
    width, d_in = state["W_query.weight"].shape
    d_out = state["out_proj.weight"].shape[0]
    if heads != num_heads:
        raise ValueError(f"num_heads={num_heads} but the query kernel {np.shape(tree['query']['kernel'])} "
                         f"has {heads} heads")
    check_float_arrays({**state, **norms}, "the attention params")
    dtypes = {a.dtype for a in (*state.values(), *norms.values())}
    if len(dtypes) != 1:
        raise ValueError(f"the attention params mix dtypes {sorted(map(str, dtypes))}")
    param_dtype = dtypes.pop()
    use_bias = "W_query.bias" in state
    if not use_bias:  # our out_proj always has a bias: a bias-free projection is a zero one
        state["out_proj.bias"] = np.zeros(d_out, param_dtype)
    for name, scale in norms.items():  # normalize_qk's LayerNorms have no bias: a zero one
        state[name] = scale
        state[name.replace(".weight", ".bias")] = np.zeros_like(scale)
    kv_in = state["W_key.weight"].shape[1]  # in_kv_features (cross-attention), else d_in
    if state["W_value.weight"].shape[1] != kv_in:
        raise ValueError(f"the key and value kernels take {kv_in} and {state['W_value.weight'].shape[1]} "
                         "input features: Flax's attention has one in_kv_features")
    kv_width = None if kv_in == d_in else kv_in
    norm: dict[str, Any] = {"qk_norm": "layer", "qk_norm_eps": qk_norm_eps} if norms else {}
    module = MultiHeadAttention(
        d_in, d_out, None, dropout, num_heads, use_bias, causal=False, kdim=kv_width, vdim=kv_width,
        num_kv_heads=None if kv_heads == heads else kv_heads,
        # heads of d_out // num_heads need no head_dim: one form for one module, so a round trip
        # gives back the config it started from
        head_dim=None if width == d_out else width // heads, **norm,
        dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs,
    )
    return load_torch_state_dict(module, state)


def from_nnx_multihead(m: nnx.MultiHeadAttention, *, rngs: nnx.Rngs | None = None) -> nnx.Module:
    """Our Flax ``MultiHeadAttention`` with the weights and behaviour of an
    ``nnx.MultiHeadAttention``: ``d_in=in_features``, ``kdim=vdim=in_kv_features`` when it
    differs (cross-attention: ``m(x, context)`` is ``ours(x, context=context)``),
    ``d_out=out_features``, ``head_dim=qkv_features // num_heads`` when ``qkv_features !=
    out_features`` (else None, the same heads), ``num_heads``, ``num_kv_heads`` (grouped-query
    heads: the key/value kernels' heads, copied exactly), ``qkv_bias=use_bias``,
    ``dropout=dropout_rate``, ``dtype``, ``param_dtype`` (the kernels' dtype),
    ``precision``, ``causal=False``, ``context_length=None``; ``deterministic`` when set.
    ``use_bias=False`` gives a zero ``out_proj`` bias (ours always has one).
    ``normalize_qk=True`` (a LayerNorm without bias of each head's queries and keys, after
    the projection) gives ``qk_norm="layer"``, ``qk_norm_scope="head"``,
    ``qk_norm_eps`` = the norms' epsilon, ``q_norm``/``k_norm`` weights = their scales and
    zero biases.

    Call it as ``ours(x, mask)`` where the native module was called ``m(x, mask=mask)``
    (the same polarity: True = attend); ``m(x, is_causal=True)`` is ``ours(x,
    causal_mask(T))``.  Where the two differ: a query with nothing to attend to gives a
    zero row here (Flax's softmax averages every value); in training mode the dropout
    draws differ (ours drops each weight independently, Flax's ``broadcast_dropout=True``
    shares one draw over batch and heads).

    What is imported is decided by an allow-list of the native constructor's options
    (``_native_carries``): any other option not at its default is refused by name.
    ``rngs``: for the dropout stream, needed when ``dropout_rate > 0``.  Raises
    ValueError, naming each, for what our module cannot express (``decode``/a cache,
    a custom ``attention_fn``, matmul or dtype promotion, query and
    key norms of two epsilons, a tuple ``in_features``), before building anything;
    TypeError for another module type.
    """
    if not isinstance(m, nnx.MultiHeadAttention):
        raise TypeError(f"from_nnx_multihead takes an nnx.MultiHeadAttention; got {type(m).__name__}")
    problems = refusals(*native_options(m, nnx.MultiHeadAttention), _native_carries(_default_attention_fn()), m,
                        "our MultiHeadAttention")
    if getattr(m, "cached_key", None) is not None:
        problems.append("an initialised decode cache (cached_key/cached_value)")
    _refuse("nnx.MultiHeadAttention options that our MultiHeadAttention cannot express", problems)
    rngs = _rngs_for(m.dropout_rate, rngs, "the nnx.MultiHeadAttention")
    roles = ("query", "key", "value", "out", *(_NATIVE_NORMS if m.normalize_qk else ()))
    tree = {role: {name: as_numpy(getattr(getattr(m, role), name)[...])
                   for name in ("kernel", "bias", "scale") if getattr(getattr(m, role), name, None) is not None}
            for role in roles}
    eps = m.query_ln.epsilon if m.query_ln is not None else _layer_norm_epsilon(linen=False)
    module: Any = _our_module_from_native(tree, num_heads=m.num_heads, dropout=m.dropout_rate, dtype=m.dtype,
                                          precision=m.precision, rngs=rngs, qk_norm_eps=float(eps), grouped=True)
    if m.deterministic is not None and m.dropout_rate > 0.0:
        module.dropout.deterministic = bool(m.deterministic)
    return module


def _flax_scale(spec: AttentionConfig) -> str | None:
    head_dim = cast(int, spec.head_dim)
    if spec.scale is None or abs(spec.scale * math.sqrt(head_dim) - 1.0) <= 1e-12:
        return None
    return f"scale={spec.scale} (Flax's attention scales by 1/sqrt(head_dim) = {1 / math.sqrt(head_dim)})"


def _flax_carries(what: str, allow_causal: bool, eps: float, linen: bool) -> dict[str | tuple[str, ...], Check]:
    """What Flax's own attention (``what``: nnx's or Linen's) reproduces of our
    MultiHeadAttention, option by option (the allow-list of ``attention_spec.interop.native``):
    any other option of ours that is not at its default (``softcap``, ``window``,
    ``rope``, ``sinks``, ``qk_norm_offset``, an option added later) is refused by name.
    ``eps``: the epsilon of normalize_qk's LayerNorms."""
    return {
        "out_proj": lambda s: None if s.out_proj else (
            "out_proj=False (Flax's attention always has an output projection)"),
        "causal": lambda s: None if allow_causal or not s.causal else (
            "causal=True (Flax's module takes causality per call: pass allow_causal=True and call it with "
            "is_causal=True or a causal mask)"),
        ("kdim", "vdim"): lambda s: None if s.kdim == s.vdim else (
            f"kdim={s.kdim} != vdim={s.vdim} (Flax's attention has one in_kv_features)"),
        # grouped-query heads: nnx's num_kv_heads; Linen's module has none
        "num_kv_heads": lambda s: None if not linen or s.kv_heads == s.num_heads else (
            f"num_kv_heads={s.num_kv_heads} (grouped-query heads; {what} has one key/value head per query "
            "head)"),
        # normalize_qk: a LayerNorm without bias of each head (zero biases: checked on the weights)
        "qk_norm": lambda s: None if s.qk_norm in (None, "layer") else (
            f"qk_norm={s.qk_norm!r} ({what}'s normalize_qk is a LayerNorm without bias of each head: only "
            "qk_norm=None or 'layer')"),
        "qk_norm_scope": lambda s: None if s.qk_norm is None or s.qk_norm_scope == "head" else (
            f"qk_norm_scope={s.qk_norm_scope!r} ({what}'s normalize_qk normalises each head: only 'head')"),
        "qk_norm_eps": lambda s: None if s.qk_norm is None or s.qk_norm_eps == eps else (
            f"qk_norm_eps={s.qk_norm_eps!r} ({what}'s normalize_qk has epsilon {eps!r})"),
        "scale": _flax_scale,
        # widths: in_features, qkv_features = num_heads * head_dim, out_features
        ("d_in", "d_out", "num_heads", "head_dim", "out_features"): ANY,
        # use_bias: all or none, zero ones added or (checked on the weights) dropped
        ("qkv_bias", "out_bias"): ANY,
        "dropout": ANY,
        "context_length": ANY,  # a cap on the input, not part of the computation: not kept
        "mask_strategy": ANY,  # every path computes "renormalize" in the "fill" form: the same numbers
        "implementation": ANY,  # which of our paths computes it; all of them are under the parity harness
    }


def _native_tree(module: Any, use_bias: bool | None, allow_causal: bool, what: str,
                 linen: bool = False) -> tuple[dict, bool]:
    """Our MultiHeadAttention -> (Flax's attention param tree of NumPy arrays, use_bias),
    after every check; query_ln/key_ln in the tree with qk_norm="layer"."""
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"{what} takes our MultiHeadAttention; got {type(module).__name__}")
    spec = module.spec
    problems = spec_refusals(spec, _flax_carries(what, allow_causal, _layer_norm_epsilon(linen), linen), what)
    if use_bias is not None and not isinstance(use_bias, bool):
        raise TypeError(f"use_bias must be None or a bool; got {use_bias!r}")
    bias = spec.qkv_bias if use_bias is None else use_bias
    state = torch_state_dict(module)
    if not bias:  # every bias dropped must be zero, or the module would change
        nonzero = [name for name, a in state.items()
                   if name.endswith(".bias") and name.split(".")[0] in _PROJECTIONS and np.any(a != 0)]
        if nonzero:
            problems.append(f"nonzero biases {', '.join(nonzero)} with use_bias=False (Flax's attention has "
                            "all biases or none; pass use_bias=True to export zero q/k/v biases)")
    norms = {role: f"{ours}.weight" for role, ours in _NATIVE_NORMS.items()} if spec.qk_norm == "layer" else {}
    nonzero = [name.replace(".weight", ".bias") for name in norms.values()
               if np.any(state[name.replace(".weight", ".bias")] != 0)]
    if nonzero:
        problems.append(f"nonzero biases {', '.join(nonzero)} ({what}'s normalize_qk LayerNorm has no bias)")
    _refuse(f"our MultiHeadAttention options that {what} cannot express", problems)
    if bias and not spec.qkv_bias:  # exact: a zero bias adds nothing
        for name in ("W_query", "W_key", "W_value"):
            state[f"{name}.bias"] = np.zeros(cast(int, spec.width), state[f"{name}.weight"].dtype)
    if bias and not spec.out_bias:  # out_bias=False: likewise a zero output bias
        state["out_proj.bias"] = np.zeros(cast(int, spec.fan_out("out")), state["out_proj.weight"].dtype)
    projections = {name: a for name, a in state.items() if name.split(".")[0] in _PROJECTIONS}
    heads, kv_heads = spec.num_heads, spec.kv_heads
    if kv_heads == heads:
        tree = native_flax_params(projections, heads, use_bias=bias)
    else:  # nnx's num_kv_heads: the checks on key/value heads repeated to the query's, then the weights as they are
        wide = dict(projections)
        for name in ("W_key", "W_value"):
            weight = projections[f"{name}.weight"]
            wide[f"{name}.weight"] = np.repeat(weight.reshape(kv_heads, -1, weight.shape[1]), heads // kv_heads,
                                               axis=0).reshape(-1, weight.shape[1])
            if bias:
                wide[f"{name}.bias"] = np.repeat(projections[f"{name}.bias"].reshape(kv_heads, -1),
                                                 heads // kv_heads, axis=0).reshape(-1)
        tree = native_flax_params(wide, heads, use_bias=bias)
        for role, name in (("key", "W_key"), ("value", "W_value")):
            weight = projections[f"{name}.weight"]
            tree[role]["kernel"] = np.array(weight.T.reshape(weight.shape[1], kv_heads, -1))
            if bias:
                tree[role]["bias"] = np.array(projections[f"{name}.bias"].reshape(kv_heads, -1))
    tree.update({role: {"scale": np.array(state[name])} for role, name in norms.items()})
    return tree, bias


def to_nnx_multihead(
    module: Any,
    *,
    use_bias: bool | None = None,
    allow_causal: bool = False,
    rngs: nnx.Rngs | None = None,
) -> nnx.MultiHeadAttention:
    """An ``nnx.MultiHeadAttention`` (``decode=False``) with our ``MultiHeadAttention``'s
    weights: ``in_features=d_in``, ``qkv_features=out_features=d_out`` (free widths:
    ``qkv_features=num_heads * head_dim``, ``out_features`` ours), ``num_heads``,
    ``num_kv_heads`` (grouped-query heads),
    ``dropout_rate``, ``dtype``, ``param_dtype``, ``precision``, ``deterministic`` (from
    the module's mode); ``qk_norm="layer"`` (per head, epsilon 1e-6, zero biases) as
    ``normalize_qk=True`` with ``query_ln``/``key_ln`` scales = our ``q_norm``/``k_norm``
    weights.  ``from_nnx_multihead`` undoes it bit-exactly (every weight; ``out_bias=False``
    comes back as a zero output bias when ``use_bias``).

    ``use_bias``: None = ``qkv_bias``.  With ``qkv_bias=False`` our ``out_proj`` still
    has a bias: a nonzero one is refused unless ``use_bias=True``, which exports zero
    q/k/v biases (exact); likewise a zero output bias for ``out_bias=False``.  ``allow_causal``: a causal module is refused unless given,
    since the native module has no causal setting: call it with ``is_causal=True`` (or
    ``mask=causal_mask(T)``) every time.  ``context_length`` is not carried (Flax's
    module has no cap).  ``rngs``: needed when ``dropout > 0``.

    What is exported is decided by an allow-list (``_flax_carries``): the options that
    Flax's attention reproduces, with the values it supports; every other option of ours
    that is not at its default (``softcap``, ``window``, ``rope``, ``sinks``, ..., and any
    option added later) is refused by name.  Raises ValueError, naming each, for what the
    native module cannot express (``out_proj=False``, a scale other than
    1/sqrt(head_dim), ``causal`` without ``allow_causal``, two kv widths, a qk-norm other than normalize_qk's, dropped nonzero biases, any option
    outside the allow-list not at its default) before building anything.
    """
    tree, bias = _native_tree(module, use_bias, allow_causal, "nnx.MultiHeadAttention")
    spec = module.spec
    rngs = _rngs_for(spec.dropout, rngs, "the module")
    dropout = getattr(module, "dropout", None)
    m = nnx.MultiHeadAttention(
        num_heads=spec.num_heads, in_features=spec.d_in, qkv_features=spec.width, out_features=spec.fan_out("out"),
        in_kv_features=spec.kdim, num_kv_heads=spec.kv_heads,
        dtype=module.dtype, param_dtype=module.param_dtype, dropout_rate=spec.dropout,
        deterministic=None if dropout is None else dropout.deterministic,
        precision=module.precision, use_bias=bias, decode=False, normalize_qk="query_ln" in tree, rngs=rngs,
    )
    variables = {(role, name): getattr(getattr(m, role), name) for role, node in tree.items() for name in node}
    ready = {key: jnp.array(tree[key[0]][key[1]], dtype=v[...].dtype) for key, v in variables.items()}
    for key, value in ready.items():
        variables[key][...] = value
    return m


def _linen_tree(params: Mapping[str, Any]) -> dict[str, dict[str, np.ndarray]]:
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping (Linen's params dict); got {type(params).__name__}")
    if set(params) == {"params"}:  # the variables dict that Module.init returns
        params = params["params"]
    tree: dict[str, dict[str, np.ndarray]] = {}
    for role, node in params.items():
        if isinstance(node, Mapping):
            tree[role] = {name: as_numpy(a) for name, a in node.items()}
        else:
            tree[role] = node  # state_dict_from_native_flax names what is wrong with it
    return tree


def from_linen_multihead_params(
    params: Mapping[str, Any],
    *,
    num_heads: int | None = None,
    dropout: float = 0.0,
    dtype: Any = None,
    precision: Any = None,
    rngs: nnx.Rngs | None = None,
) -> nnx.Module:
    """Our Flax ``MultiHeadAttention`` from a Linen ``MultiHeadDotProductAttention``'s
    params: ``{"query"|"key"|"value": {"kernel": (d_in, heads, head_dim), "bias": (heads,
    head_dim)}, "out": {"kernel": (heads, head_dim, d_out), "bias": (d_out,)}}`` (or the
    ``{"params": ...}`` variables that ``init`` returns; biases absent for
    ``use_bias=False``; ``"query_ln"``/``"key_ln"``: ``{"scale": (head_dim,)}`` with
    ``normalize_qk=True``, imported as ``qk_norm="layer"`` with Linen's LayerNorm epsilon
    and zero biases).  ``num_heads`` is read from the kernels (checked if given);
    ``d_out`` is the output kernel's width (``head_dim=`` when heads * head_dim differs);
    ``param_dtype`` is the params' dtype; ``dropout``, ``dtype`` and ``precision`` are the
    Linen module's ``dropout_rate``, ``dtype`` and ``precision`` (the params do not hold
    them).  ``causal=False``, ``context_length=None``; behaviour as ``from_nnx_multihead``.

    Raises ValueError for a tree that is not Linen's attention (missing or unexpected
    entries, shapes that disagree, biases on some projections only, one query/key norm
    without the other, mixed dtypes) before building anything.
    """
    tree = _linen_tree(params)
    _, _, heads, _ = _native_state(tree)  # the tree's own checks, with their messages
    rngs = _rngs_for(dropout, rngs, "the Linen attention")
    return _our_module_from_native(tree, num_heads=heads if num_heads is None else num_heads,
                                   dropout=dropout, dtype=dtype, precision=precision, rngs=rngs,
                                   qk_norm_eps=_layer_norm_epsilon(linen=True))


def to_linen_multihead_params(module: nnx.Module, *, use_bias: bool | None = None,
                              allow_causal: bool = False) -> dict[str, dict[str, jnp.ndarray]]:
    """Our ``MultiHeadAttention``'s weights as a Linen ``MultiHeadDotProductAttention``'s
    params ({"query": {"kernel", "bias"}, "key", "value", "out"}, JAX arrays; apply with
    ``{"params": ...}``); the module to apply them with is ``to_linen_multihead``'s.
    ``use_bias``, ``allow_causal`` and the refusals as ``to_nnx_multihead``, and grouped-query
    heads (``num_kv_heads``), which Linen's module has not."""
    tree, _ = _native_tree(module, use_bias, allow_causal, "Linen MultiHeadDotProductAttention", linen=True)
    return {role: {name: jnp.array(a) for name, a in node.items()} for role, node in tree.items()}


def to_linen_multihead(module: Any, *, use_bias: bool | None = None,
                       allow_causal: bool = False) -> tuple[Any, dict[str, Any]]:
    """(a Linen ``MultiHeadDotProductAttention``, its ``{"params": ...}``) with our
    ``MultiHeadAttention``'s weights and options (``num_heads``, ``qkv_features =
    out_features = d_out`` or the free widths, ``dropout_rate``, ``dtype``, ``param_dtype``,
    ``precision``, ``use_bias``, ``normalize_qk`` for ``qk_norm="layer"``, ``decode=False``);
    ``module.apply(variables, x)`` runs it.  Refusals as ``to_nnx_multihead``."""
    import flax.linen as nn

    params = to_linen_multihead_params(module, use_bias=use_bias, allow_causal=allow_causal)
    spec = module.spec
    linen = nn.MultiHeadDotProductAttention(
        num_heads=spec.num_heads, dtype=module.dtype, param_dtype=module.param_dtype,
        qkv_features=spec.width, out_features=spec.fan_out("out"), dropout_rate=spec.dropout,
        precision=module.precision, use_bias="bias" in params["query"], decode=False,
        normalize_qk="query_ln" in params,
    )
    return linen, {"params": params}


def from_linen_multihead(linen: Any, variables: Mapping[str, Any], *, rngs: nnx.Rngs | None = None) -> nnx.Module:
    """Our Flax ``MultiHeadAttention`` from a Linen ``MultiHeadDotProductAttention`` and its
    variables (``init``'s ``{"params": ...}``): its options are read from the module
    (``num_heads``, ``dropout_rate``, ``dtype``, ``precision``, ``normalize_qk``, which the
    params' ``query_ln``/``key_ln`` must agree with) and refused, naming each, where ours
    cannot express them, as ``from_nnx_multihead`` (an allow-list of its fields)."""
    import flax.linen as nn

    if not isinstance(linen, nn.MultiHeadDotProductAttention):
        raise TypeError(f"from_linen_multihead takes a MultiHeadDotProductAttention; got {type(linen).__name__}")
    problems = refusals(*native_options(linen, nn.MultiHeadDotProductAttention),
                        _native_carries(_linen_attention_fn()), linen, "our MultiHeadAttention")
    params = variables.get("params", variables) if isinstance(variables, Mapping) else variables
    if isinstance(params, Mapping) and bool(linen.normalize_qk) != ("query_ln" in params):
        problems.append(f"normalize_qk={linen.normalize_qk} but the params {'lack' if linen.normalize_qk else 'hold'} "
                        "query_ln/key_ln")
    _refuse("Linen MultiHeadDotProductAttention options that our MultiHeadAttention cannot express", problems)
    module: Any = from_linen_multihead_params(variables, num_heads=linen.num_heads, dropout=linen.dropout_rate,
                                         dtype=linen.dtype, precision=linen.precision, rngs=rngs)
    if linen.deterministic is not None and linen.dropout_rate > 0.0:
        module.dropout.deterministic = bool(linen.deterministic)
    return module


# --------------------------------------------------------------------------- files


def save(module: nnx.Module, path: Any, *, format: str | None = None, layout: str = "flax") -> None:
    """Writes one of our modules' parameters to ``path``, atomically (a temporary name in
    the same directory, renamed when complete; an existing file or directory is untouched
    on failure).  An existing directory is replaced only by an Orbax checkpoint and only
    when it is one this library wrote; a symlink ``path`` is written through.

    ``format``: ``"safetensors"``, ``"msgpack"`` (``flax.serialization.msgpack_serialize``
    of ``{"W_query": {"kernel": ...}}``) or ``"orbax"`` (a directory written by
    ``orbax.checkpoint.PyTreeCheckpointer``), else from the extension (``.safetensors``,
    ``.msgpack``, an existing directory).  ``layout``: ``"flax"`` (``W_query/kernel``, (in,
    out)) or ``"torch"`` (safetensors only: ``W_query.weight``, (out, in), what PyTorch's
    ``load_state_dict`` and ``torch_attention.interop.load`` take).  A ``.pt`` file needs
    torch: write it with ``torch_attention.interop.save`` or ``python -m
    parity_tests.convert``.  Raises ``attention_spec.interop.files.CheckpointError`` (a ValueError)
    for an unknown format, one that cannot hold the layout or a ``path`` that must not be
    replaced (a directory that is not our Orbax checkpoint, a directory where a file goes),
    before anything is written; OSError naming ``path`` when the write fails.
    """
    from attention_spec.interop.files import flax_names, write_arrays

    _flax_formats(path, format, "save")
    if layout == "torch":
        write_arrays(torch_state_dict(module), path, layout="torch", format=format)
    else:
        write_arrays(flax_names(flax_arrays(module)), path, layout=layout, format=format)


def load(module: nnx.Module, path: Any, *, format: str | None = None) -> nnx.Module:
    """Reads ``path`` into one of our modules (cast to its ``param_dtype``) and returns it.

    Reads safetensors in either layout (a name with ``/`` means Flax's; PyTorch's
    ``W_query.weight`` is transposed on the way), Flax msgpack and Orbax directories.
    Raises ``attention_spec.interop.files.CheckpointError`` for an unreadable or truncated file,
    an unknown format or a ``.pt`` file (it needs torch); the map's ValueError listing
    missing, unexpected and misshaped parameters; TypeError for non-floating arrays.
    Nothing is written to the module unless every check passed.
    """
    from attention_spec.interop.files import read_arrays

    layout, arrays = read_arrays(path, _flax_formats(path, format, "load"))
    if layout == "torch":
        return load_torch_state_dict(module, arrays)
    return load_flax_arrays(module, arrays)


def _flax_formats(path: Any, format: str | None, what: str) -> str:
    from attention_spec.interop.files import CheckpointError, format_for

    fmt = format_for(path, format)
    if fmt == "pt":
        raise CheckpointError(
            f"jax_attention.interop.{what} handles safetensors, msgpack and Orbax; a .pt file needs torch: "
            "use torch_attention.interop or python -m parity_tests.convert"
        )
    return fmt
