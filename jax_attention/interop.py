"""Weights in and out of the Flax NNX twins, in either framework's layout.  Needs no PyTorch.

Twin of ``torch_attention/interop.py``: both offer ``torch_state_dict``, ``flax_arrays``,
``load_torch_state_dict``, ``load_flax_arrays`` and ``load_packed_qkv`` for their own
modules, plus array-level converters for checkpoints.  The map is declared in
``attention_spec.conversion`` (names, transposes, shapes) and ``attention_spec.packing``
(packed q/k/v, head-shaped kernels), both in the rules of one weight map
(``attention_spec.specs``); a load checks everything before it writes
anything, so a failed load leaves the module as it was.

Flax's own attention, both ways: ``from_nnx_multihead`` / ``to_nnx_multihead`` for
``flax.nnx.MultiHeadAttention``, ``from_linen_multihead_params`` /
``to_linen_multihead_params`` (and ``from_linen_multihead`` / ``to_linen_multihead``
with the Linen module) for Linen's ``MultiHeadDotProductAttention``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_spec.conversion import (
    Path,
    as_numpy,
    check_complete,
    check_float_arrays,
    flatten_paths,
    flax_to_torch,
    module_rules,
    rules_for,
    torch_to_flax,
)
from attention_spec.packing import (
    native_flax_params,
    not_ours_message,
    packed_state_dict,
    state_dict_from_native_flax,
)
from jax_attention._base import AttentionModule
from jax_attention.multihead import MultiHeadAttention

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


def state_from_torch(
    state_dict: Mapping[str, Any], variant: str, config: Mapping[str, Any]
) -> nnx.State:
    """A PyTorch ``state_dict`` (tensors or NumPy arrays) -> an ``nnx.State`` of params,
    each ``nnx.Param`` with the metadata the module's own has (its partitioning), so the
    state has the module's tree structure."""
    flat = torch_to_flax({k: as_numpy(v) for k, v in state_dict.items()}, rules_for(variant, config))
    import jax_attention

    cls = getattr(jax_attention, variant)
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


def _variable(module: nnx.Module, path: Path) -> nnx.Variable:
    node: Any = module
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def flax_arrays(module: nnx.Module) -> dict[Path, np.ndarray]:
    """One of our modules' parameters, Flax layout: {Flax path: NumPy array}."""
    return {r.flax_path: as_numpy(_variable(module, r.flax_path)[...]) for r in module_rules(module)}


def torch_state_dict(module: nnx.Module) -> dict[str, np.ndarray]:
    """One of our modules' parameters in PyTorch's layout, as NumPy arrays."""
    return flax_to_torch(flax_arrays(module), module_rules(module))


def load_flax_arrays(module: nnx.Module, arrays: Mapping[Any, Any]) -> nnx.Module:
    """Writes Flax-layout arrays into the module, each parameter exactly once, cast to
    the module's parameter dtype.  ``arrays``: {path: array}, {"a/b": array}, a nested
    dict, or an ``nnx.State`` -- ``nnx.state(module, nnx.Param)`` or the full
    ``nnx.state(module)``, whose non-parameter variables (the dropout streams'
    ``RngKey``/``RngCount``) are skipped.  Raises ValueError listing missing, unexpected
    and misshaped paths before writing anything."""
    rules = module_rules(module)
    flat = flatten_paths(arrays)
    check_complete({p: np.shape(a) for p, a in flat.items()}, {r.flax_path: r.flax_shape for r in rules},
                   "the Flax state")
    check_float_arrays(flat, "the Flax state")
    variables = {r.flax_path: _variable(module, r.flax_path) for r in rules}
    # Every array is converted before the first write: a failure leaves the module as it was.
    # jnp.array copies: on CPU jnp.asarray of a NumPy view of a torch tensor can share its
    # memory, and an in-place update of the source (an optimizer step) would reach us.
    ready = {p: jnp.array(flat[p], dtype=v[...].dtype) for p, v in variables.items()}
    for path, variable in variables.items():
        variable[...] = ready[path]
    return module


def load_torch_state_dict(module: nnx.Module, state_dict: Mapping[str, Any]) -> nnx.Module:
    """Writes a PyTorch ``state_dict`` (tensors or NumPy) into the module; checks as
    ``load_flax_arrays``."""
    arrays = {k: as_numpy(v) for k, v in state_dict.items()}
    flat = torch_to_flax(arrays, module_rules(module))  # names and shapes, PyTorch's words
    check_float_arrays(arrays, "the PyTorch state_dict")
    return load_flax_arrays(module, flat)


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

    Raises ValueError (``attention_spec.packing.packed_state_dict``'s checks: layout,
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


def _native_problems(m: Any, default_fn: Any) -> list[str]:
    """What an nnx.MultiHeadAttention / Linen MultiHeadDotProductAttention does that our
    MultiHeadAttention cannot express, one line each."""
    problems = []
    if getattr(m, "normalize_qk", False):
        problems.append("normalize_qk=True (layer-normalised queries and keys)")
    if getattr(m, "decode", None):
        problems.append("decode=True (an autoregressive cache)")
    if getattr(m, "cached_key", None) is not None:
        problems.append("an initialised decode cache (cached_key/cached_value)")
    num_kv = getattr(m, "num_kv_heads", None)
    if num_kv is not None and num_kv != m.num_heads:
        problems.append(f"num_kv_heads={num_kv} != num_heads={m.num_heads} (grouped-query attention)")
    in_features = getattr(m, "in_features", None)
    if in_features is not None and not isinstance(in_features, int):
        problems.append(f"in_features={in_features!r} (a tuple of input axes)")
    qkv, out = getattr(m, "qkv_features", None), getattr(m, "out_features", None)
    if qkv is not None and out is not None and qkv != out:
        problems.append(f"out_features={out} != qkv_features={qkv} (our out_proj is (d_out, d_out))")
    if m.attention_fn is not default_fn:
        problems.append(f"attention_fn={getattr(m.attention_fn, '__name__', m.attention_fn)!r} "
                        "(only Flax's dot_product_attention)")
    for name in ("qkv_dot_general", "out_dot_general", "qkv_dot_general_cls", "out_dot_general_cls",
                 "qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls"):
        if getattr(m, name, None) is not None:
            problems.append(f"{name} (a custom matmul)")
    return problems


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


def _our_module_from_native(
    tree: Mapping[str, Mapping[str, Any]],
    *,
    num_heads: int,
    dropout: float,
    dtype: Any,
    precision: Any,
    rngs: nnx.Rngs,
) -> nnx.Module:
    state = state_dict_from_native_flax(tree)  # every shape check, before anything is built
    d_out, d_in = state["W_query.weight"].shape
    heads = np.shape(tree["query"]["kernel"])[1]
    if heads != num_heads:
        raise ValueError(f"num_heads={num_heads} but the query kernel {np.shape(tree['query']['kernel'])} "
                         f"has {heads} heads")
    if state["out_proj.weight"].shape != (d_out, d_out):
        raise ValueError(f"the output kernel gives {state['out_proj.weight'].shape[0]} features but the "
                         f"heads give {d_out}: our out_proj is (d_out, d_out)")
    check_float_arrays(state, "the attention params")
    dtypes = {a.dtype for a in state.values()}
    if len(dtypes) != 1:
        raise ValueError(f"the attention params mix dtypes {sorted(map(str, dtypes))}")
    param_dtype = dtypes.pop()
    use_bias = "W_query.bias" in state
    if not use_bias:  # our out_proj always has a bias: a bias-free projection is a zero one
        state["out_proj.bias"] = np.zeros(d_out, param_dtype)
    kv_in = state["W_key.weight"].shape[1]  # in_kv_features (cross-attention), else d_in
    if state["W_value.weight"].shape[1] != kv_in:
        raise ValueError(f"the key and value kernels take {kv_in} and {state['W_value.weight'].shape[1]} "
                         "input features: Flax's attention has one in_kv_features")
    width = None if kv_in == d_in else kv_in
    module = MultiHeadAttention(
        d_in, d_out, None, dropout, num_heads, use_bias, causal=False, kdim=width, vdim=width,
        dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs,
    )
    return load_torch_state_dict(module, state)


def from_nnx_multihead(m: nnx.MultiHeadAttention, *, rngs: nnx.Rngs | None = None) -> nnx.Module:
    """Our Flax ``MultiHeadAttention`` with the weights and behaviour of an
    ``nnx.MultiHeadAttention``: ``d_in=in_features``, ``kdim=vdim=in_kv_features`` when it
    differs (cross-attention: ``m(x, context)`` is ``ours(x, context=context)``),
    ``d_out=qkv_features``, ``num_heads``, ``qkv_bias=use_bias``, ``dropout=dropout_rate``,
    ``dtype``, ``param_dtype`` (the kernels' dtype), ``precision``, ``causal=False``,
    ``context_length=None``; ``deterministic`` when set.  ``use_bias=False`` gives a zero
    ``out_proj`` bias (ours always has one).

    Call it as ``ours(x, mask)`` where the native module was called ``m(x, mask=mask)``
    (the same polarity: True = attend); ``m(x, is_causal=True)`` is ``ours(x,
    causal_mask(T))``.  Where the two differ: a query with nothing to attend to gives a
    zero row here (Flax's softmax averages every value); in training mode the dropout
    draws differ (ours drops each weight independently, Flax's ``broadcast_dropout=True``
    shares one draw over batch and heads).

    ``rngs``: for the dropout stream, needed when ``dropout_rate > 0``.  Raises
    ValueError, naming each, for what our module cannot express (``normalize_qk``,
    ``decode``/a cache, grouped-query heads, ``out_features`` != ``qkv_features``, a custom ``attention_fn`` or matmul), before
    building anything; TypeError for another module type.
    """
    if not isinstance(m, nnx.MultiHeadAttention):
        raise TypeError(f"from_nnx_multihead takes an nnx.MultiHeadAttention; got {type(m).__name__}")
    _refuse("nnx.MultiHeadAttention options that our MultiHeadAttention cannot express",
            _native_problems(m, _default_attention_fn()))
    rngs = _rngs_for(m.dropout_rate, rngs, "the nnx.MultiHeadAttention")
    tree = {role: {name: as_numpy(getattr(getattr(m, role), name)[...])
                   for name in ("kernel", "bias") if getattr(getattr(m, role), name, None) is not None}
            for role in ("query", "key", "value", "out")}
    module: Any = _our_module_from_native(tree, num_heads=m.num_heads, dropout=m.dropout_rate, dtype=m.dtype,
                                     precision=m.precision, rngs=rngs)
    if m.deterministic is not None and m.dropout_rate > 0.0:
        module.dropout.deterministic = bool(m.deterministic)
    return module


def _native_tree(module: Any, use_bias: bool | None, allow_causal: bool, what: str) -> tuple[dict, bool]:
    """Our MultiHeadAttention -> (Flax's attention param tree of NumPy arrays, use_bias),
    after every check."""
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"{what} takes our MultiHeadAttention; got {type(module).__name__}")
    spec = module.spec
    problems = []
    if not spec.out_proj:
        problems.append("out_proj=False (Flax's attention always has an output projection)")
    if spec.causal and not allow_causal:
        problems.append("causal=True (Flax's module takes causality per call: pass allow_causal=True and "
                        "call it with is_causal=True or a causal mask)")
    if spec.kdim != spec.vdim:
        problems.append(f"kdim={spec.kdim} != vdim={spec.vdim} (Flax's attention has one in_kv_features)")
    if spec.kv_heads != spec.num_heads:
        problems.append(f"num_kv_heads={spec.num_kv_heads} (grouped-query heads; Flax's "
                        "MultiHeadAttention has one key/value head per query head)")
    if spec.qk_norm is not None:
        problems.append(f"qk_norm={spec.qk_norm!r} (Flax's attention has no query/key norm)")
    if spec.rope is not None:
        problems.append("rope= (Flax's MultiHeadAttention has no rotary position embeddings)")
    if spec.sinks:
        problems.append("sinks=True (Flax's MultiHeadAttention has no attention sinks)")
    head_dim = cast(int, spec.head_dim)
    if spec.scale is not None and abs(spec.scale * math.sqrt(head_dim) - 1.0) > 1e-12:
        problems.append(f"scale={spec.scale} (Flax's attention scales by 1/sqrt(head_dim) = "
                        f"{1 / math.sqrt(head_dim)})")
    if use_bias is not None and not isinstance(use_bias, bool):
        raise TypeError(f"use_bias must be None or a bool; got {use_bias!r}")
    bias = spec.qkv_bias if use_bias is None else use_bias
    state = torch_state_dict(module)
    if not bias:  # every bias dropped must be zero, or the module would change
        nonzero = [name for name, a in state.items() if name.endswith(".bias") and np.any(a != 0)]
        if nonzero:
            problems.append(f"nonzero biases {', '.join(nonzero)} with use_bias=False (Flax's attention has "
                            "all biases or none; pass use_bias=True to export zero q/k/v biases)")
    _refuse(f"our MultiHeadAttention options that {what} cannot express", problems)
    if bias and not spec.qkv_bias:  # exact: a zero bias adds nothing
        for name in ("W_query", "W_key", "W_value"):
            state[f"{name}.bias"] = np.zeros(cast(int, spec.width), state[f"{name}.weight"].dtype)
    if bias and not spec.out_bias:  # out_bias=False: likewise a zero output bias
        state["out_proj.bias"] = np.zeros(cast(int, spec.fan_out("out")), state["out_proj.weight"].dtype)
    return native_flax_params(state, spec.num_heads, use_bias=bias), bias


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
    ``dropout_rate``, ``dtype``, ``param_dtype``, ``precision``, ``deterministic`` (from
    the module's mode).  ``from_nnx_multihead`` undoes it bit-exactly.

    ``use_bias``: None = ``qkv_bias``.  With ``qkv_bias=False`` our ``out_proj`` still
    has a bias: a nonzero one is refused unless ``use_bias=True``, which exports zero
    q/k/v biases (exact); likewise a zero output bias for ``out_bias=False``.  ``allow_causal``: a causal module is refused unless given,
    since the native module has no causal setting: call it with ``is_causal=True`` (or
    ``mask=causal_mask(T)``) every time.  ``context_length`` is not carried (Flax's
    module has no cap).  ``rngs``: needed when ``dropout > 0``.

    Raises ValueError, naming each, for what the native module cannot express
    (``out_proj=False``, a scale other than 1/sqrt(head_dim), ``causal`` without
    ``allow_causal``, dropped nonzero biases) before building anything.
    """
    tree, bias = _native_tree(module, use_bias, allow_causal, "nnx.MultiHeadAttention")
    spec = module.spec
    rngs = _rngs_for(spec.dropout, rngs, "the module")
    dropout = getattr(module, "dropout", None)
    m = nnx.MultiHeadAttention(
        num_heads=spec.num_heads, in_features=spec.d_in, qkv_features=spec.width, out_features=spec.fan_out("out"),
        in_kv_features=spec.kdim,
        dtype=module.dtype, param_dtype=module.param_dtype, dropout_rate=spec.dropout,
        deterministic=None if dropout is None else dropout.deterministic,
        precision=module.precision, use_bias=bias, decode=False, rngs=rngs,
    )
    ready = {(role, name): jnp.array(a, dtype=getattr(m, role).kernel[...].dtype)
             for role, node in tree.items() for name, a in node.items()}
    for (role, name), value in ready.items():
        getattr(getattr(m, role), name)[...] = value
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
    ``use_bias=False``).  ``num_heads`` is read from the kernels (checked if given);
    ``param_dtype`` is the params' dtype; ``dropout``, ``dtype`` and ``precision`` are the
    Linen module's ``dropout_rate``, ``dtype`` and ``precision`` (the params do not hold
    them).  ``causal=False``, ``context_length=None``; behaviour as ``from_nnx_multihead``.

    Raises ValueError for a tree that is not Linen's attention (missing or unexpected
    entries, shapes that disagree, biases on some projections only, out features !=
    heads * head_dim, mixed dtypes) before building anything.
    """
    tree = _linen_tree(params)
    state_dict_from_native_flax(tree)  # the tree's own checks, with their messages
    heads = int(np.shape(tree["query"]["kernel"])[1])
    rngs = _rngs_for(dropout, rngs, "the Linen attention")
    return _our_module_from_native(tree, num_heads=heads if num_heads is None else num_heads,
                                   dropout=dropout, dtype=dtype, precision=precision, rngs=rngs)


def to_linen_multihead_params(module: nnx.Module, *, use_bias: bool | None = None,
                              allow_causal: bool = False) -> dict[str, dict[str, jnp.ndarray]]:
    """Our ``MultiHeadAttention``'s weights as a Linen ``MultiHeadDotProductAttention``'s
    params ({"query": {"kernel", "bias"}, "key", "value", "out"}, JAX arrays; apply with
    ``{"params": ...}``); the module to apply them with is ``to_linen_multihead``'s.
    ``use_bias``, ``allow_causal`` and the refusals as ``to_nnx_multihead``."""
    tree, _ = _native_tree(module, use_bias, allow_causal, "Linen MultiHeadDotProductAttention")
    return {role: {name: jnp.array(a) for name, a in node.items()} for role, node in tree.items()}


def to_linen_multihead(module: Any, *, use_bias: bool | None = None,
                       allow_causal: bool = False) -> tuple[Any, dict[str, Any]]:
    """(a Linen ``MultiHeadDotProductAttention``, its ``{"params": ...}``) with our
    ``MultiHeadAttention``'s weights and options (``num_heads``, ``qkv_features =
    out_features = d_out``, ``dropout_rate``, ``dtype``, ``param_dtype``, ``precision``,
    ``use_bias``, ``decode=False``); ``module.apply(variables, x)`` runs it.  Refusals as
    ``to_nnx_multihead``."""
    import flax.linen as nn

    params = to_linen_multihead_params(module, use_bias=use_bias, allow_causal=allow_causal)
    spec = module.spec
    linen = nn.MultiHeadDotProductAttention(
        num_heads=spec.num_heads, dtype=module.dtype, param_dtype=module.param_dtype,
        qkv_features=spec.width, out_features=spec.fan_out("out"), dropout_rate=spec.dropout,
        precision=module.precision, use_bias="bias" in params["query"], decode=False,
    )
    return linen, {"params": params}


def from_linen_multihead(linen: Any, variables: Mapping[str, Any], *, rngs: nnx.Rngs | None = None) -> nnx.Module:
    """Our Flax ``MultiHeadAttention`` from a Linen ``MultiHeadDotProductAttention`` and its
    variables (``init``'s ``{"params": ...}``): its options are read from the module
    (``num_heads``, ``dropout_rate``, ``dtype``, ``precision``) and refused, naming each,
    where ours cannot express them, as ``from_nnx_multihead``."""
    import flax.linen as nn

    if not isinstance(linen, nn.MultiHeadDotProductAttention):
        raise TypeError(f"from_linen_multihead takes a MultiHeadDotProductAttention; got {type(linen).__name__}")
    _refuse("Linen MultiHeadDotProductAttention options that our MultiHeadAttention cannot express",
            _native_problems(linen, _linen_attention_fn()))
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
    parity_tests.convert``.  Raises ``attention_spec.files.CheckpointError`` (a ValueError)
    for an unknown format, one that cannot hold the layout or a ``path`` that must not be
    replaced (a directory that is not our Orbax checkpoint, a directory where a file goes),
    before anything is written; OSError naming ``path`` when the write fails.
    """
    from attention_spec.files import flax_names, write_arrays

    _flax_formats(path, format, "save")
    if layout == "torch":
        write_arrays(torch_state_dict(module), path, layout="torch", format=format)
    else:
        write_arrays(flax_names(flax_arrays(module)), path, layout=layout, format=format)


def load(module: nnx.Module, path: Any, *, format: str | None = None) -> nnx.Module:
    """Reads ``path`` into one of our modules (cast to its ``param_dtype``) and returns it.

    Reads safetensors in either layout (a name with ``/`` means Flax's; PyTorch's
    ``W_query.weight`` is transposed on the way), Flax msgpack and Orbax directories.
    Raises ``attention_spec.files.CheckpointError`` for an unreadable or truncated file,
    an unknown format or a ``.pt`` file (it needs torch); the map's ValueError listing
    missing, unexpected and misshaped parameters; TypeError for non-floating arrays.
    Nothing is written to the module unless every check passed.
    """
    from attention_spec.files import read_arrays

    layout, arrays = read_arrays(path, _flax_formats(path, format, "load"))
    if layout == "torch":
        return load_torch_state_dict(module, arrays)
    return load_flax_arrays(module, arrays)


def _flax_formats(path: Any, format: str | None, what: str) -> str:
    from attention_spec.files import CheckpointError, format_for

    fmt = format_for(path, format)
    if fmt == "pt":
        raise CheckpointError(
            f"jax_attention.interop.{what} handles safetensors, msgpack and Orbax; a .pt file needs torch: "
            "use torch_attention.interop or python -m parity_tests.convert"
        )
    return fmt
