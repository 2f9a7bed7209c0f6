"""Packed q/k/v and head-shaped kernels: the layouts real checkpoints use, framework-free.

The layouts of other libraries' checkpoints, beside the twins' declared map
(``attention_spec.interop.conversion``):

* **Packed q/k/v**: one weight holds the three projections side by side.
  ``layout="in_out"``: (d_in, 3*d_out), applied as ``x @ W`` (GPT-2's ``Conv1D``
  ``c_attn.weight``); ``layout="out_in"``: (3*d_out, d_in), applied as ``x @ W.T``
  (``nn.Linear``, ``nn.MultiheadAttention.in_proj_weight``).  The packed bias is
  (3*d_out,) in both.  The order along the packed axis is always query, key, value.
  ``split_qkv`` / ``join_qkv`` (defined in ``attention_spec.interop.qkv``, named here too)
  go between a packed weight and three weights in PyTorch's (out, in) layout;
  ``packed_state_dict`` / ``pack_state_dict`` go between a packed checkpoint and our
  modules' PyTorch names (``W_query.weight``, ...), read from the registry.

* **Packing order** along the packed axis (``packing=``, every function above):
  ``"codegen"``: 4 model-parallel shards in turn, each ``[q; v; k]`` of ``d_out / 4`` rows
  (CodeGen's ``qkv_proj``, ``mp_num = 4``);
  ``"thirds"`` (the default): ``[q; k; v]`` in three equal blocks, heads contiguous within
  each (GPT-2's ``c_attn``, ``in_proj_weight``); ``"per_head"``: for each head in turn its
  query, key and value rows, ``(num_heads, 3, head_dim)`` (GPT-NeoX's
  ``query_key_value``); ``"grouped"``: ``[q; k; v]`` with ``num_heads`` query heads and
  ``num_kv_heads`` key/value heads, widths ``num_heads*head_dim``,
  ``num_kv_heads*head_dim`` twice (Phi-3's ``qkv_proj``).

* **Head-shaped kernels** of Flax's own attention (``nnx.MultiHeadAttention``, Linen
  ``MultiHeadDotProductAttention``): query/key/value kernels (in, heads, head_dim) with
  biases (heads, head_dim), the output kernel (heads, head_dim, out) with bias (out,).
  Heads are contiguous blocks of ``head_dim`` along the width, the same split as our
  ``MultiHeadAttention``.  ``split_heads_*`` / ``merge_heads_*`` reshape one array;
  ``native_flax_params`` / ``state_dict_from_native_flax`` convert a whole parameter tree
  through the rules of ``native_flax_rules`` (the one weight map,
  ``attention_spec.interop.specs``).

Everything takes NumPy arrays (or anything ``as_numpy`` reads: torch tensors, JAX
arrays), returns NumPy copies (never views of the input) with the input's dtype, and
validates everything before returning anything: bad input raises ``ValueError`` (shapes,
layout names, a bias that does not fit) or ``TypeError`` (non-floating arrays).
Every conversion is a reshape, a transpose or a slice: round trips are bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_spec.interop.numpy_arrays import as_numpy
from attention_spec.interop.qkv import (
    PACKED_LAYOUTS,
    QKV_PACKINGS,
    ROLES,
    UNHEADED,
    _float,
    _heads,
    _heads_words,
    _packing_heads,
    _rank,
    check_layout,
    check_packing,
    join_qkv,
    split_qkv,
)
from attention_spec.interop.specs import Concat, Rule, SplitAxis, Transpose, run_rules
from attention_spec.registry import AttentionConfig

__all__ = [
    "PACKED_LAYOUTS",
    "QKV_PACKINGS",
    "ROLES",
    "check_layout",
    "check_packing",
    "join_qkv",
    "merge_heads_bias",
    "merge_heads_kernel",
    "merge_heads_out_kernel",
    "native_flax_params",
    "native_flax_rules",
    "nn_multihead_rules",
    "pack_state_dict",
    "packed_state_dict",
    "split_heads_bias",
    "split_heads_kernel",
    "split_heads_out_kernel",
    "split_qkv",
    "state_dict_from_native_flax",
    "torch_names_for_packed",
]


def not_ours_message(module: Any) -> str:
    """The TypeError text of ``load_packed_qkv`` (both twins) for a foreign module."""
    return f"load_packed_qkv loads into this library's modules; got {type(module).__name__}"


# ---------------------------------------------------------------- our modules' names


def _qkv_projections(config: AttentionConfig) -> dict[str, Any]:
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"expected an AttentionConfig (module.spec); got {type(config).__name__}")
    projs = {role: config.projection(role) for role in (*ROLES, "out")}
    if any(projs[r] is None for r in ROLES):
        raise ValueError(
            f"{config.variant} has no query, key and value projections of its own, so packed q/k/v "
            "cannot be loaded into it (MultiHeadAttentionWrapper holds one per head)"
        )
    return projs


def torch_names_for_packed(config: AttentionConfig) -> dict[str, tuple[str, str | None]]:
    """{"query"|"key"|"value"|"out": (weight name, bias name or None)}: where each part of a
    packed checkpoint goes among our modules' PyTorch parameter names, read from the
    registry (``W_query.weight`` for ``MultiHeadAttention``, ``query.weight`` for ``Head``;
    ``W_query`` alone for ``SelfAttention_v1``'s raw matrices).  "out" is absent when the
    config has no output projection.  Raises ValueError for a variant without its own
    q/k/v projections."""
    names: dict[str, tuple[str, str | None]] = {}
    for role, proj in _qkv_projections(config).items():
        if proj is None:
            continue
        if proj.layout == "matrix":
            names[role] = (proj.name, None)
        else:
            names[role] = (f"{proj.name}.weight", f"{proj.name}.bias" if proj.has_bias(config) else None)
    return names


def _thirds_for(config: AttentionConfig, packing: str = "thirds") -> None:
    """Refuses ``packing="thirds"`` (or ``"codegen"``) for a module whose key/value heads are grouped."""
    if config.kv_heads != config.num_heads:
        widths = ", ".join(str(config.fan_out(r)) for r in ROLES)
        raise ValueError(
            f"packing={packing!r} splits q/k/v into three equal blocks, but the module has grouped-query "
            f"heads (num_heads={config.num_heads}, num_kv_heads={config.kv_heads}: key and value are "
            f"narrower than query); pass packing='grouped' for [q; k; v] of widths {widths} "
            "(Phi-3's qkv_proj)"
        )


def _split_for(
    config: AttentionConfig, qkv_weight: Any, qkv_bias: Any, layout: str, packing: str
) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """``split_qkv`` of a packed weight for the module of ``config``, its widths checked."""
    layout, packing = check_layout(layout), check_packing(packing)
    if packing in UNHEADED:
        _thirds_for(config, packing)
        parts = split_qkv(qkv_weight, qkv_bias, layout=layout, packing=packing)
        d_out, d_in = parts["query"][0].shape
        if (d_in, d_out) != (config.d_in, config.width):
            raise ValueError(
                f"the packed q/k/v weight is for d_in={d_in}, d_out={d_out} (layout={layout!r}); "
                f"the module has d_in={config.d_in}, d_out={config.width}"
            )
        return parts
    heads = _packing_heads(packing, config.num_heads, config.kv_heads)
    assert heads is not None and config.width is not None and config.d_in is not None
    packed = sum(int(config.fan_out(r) or 0) for r in ROLES)
    expected = (config.d_in, packed) if layout == "in_out" else (packed, config.d_in)
    shape = tuple(np.shape(as_numpy(qkv_weight)))
    if len(shape) == 2 and shape != expected:
        words, _ = _heads_words(packing, heads)
        raise ValueError(
            f"the packed q/k/v weight {shape} does not fit packing={packing!r} (layout={layout!r}) for "
            f"the module: expected {expected}, a packed width of {words} with "
            f"head_dim={config.width // config.num_heads}, and d_in={config.d_in}"
        )
    return split_qkv(qkv_weight, qkv_bias, layout=layout, packing=packing, num_heads=heads[0],
                     num_kv_heads=heads[1])


def packed_state_dict(
    config: AttentionConfig,
    qkv_weight: Any,
    qkv_bias: Any = None,
    *,
    layout: str,
    packing: str = "thirds",
    out_weight: Any = None,
    out_bias: Any = None,
) -> dict[str, np.ndarray]:
    """A packed checkpoint -> the PyTorch-named arrays of our module (``module.spec``) that
    it gives: q/k/v always, the output projection when ``out_weight`` is given.  Load the
    result over the module's current state dict (it may hold only part of it).

    qkv_weight: (d_in, 3*d_out) for ``layout="in_out"`` (GPT-2's ``c_attn.weight``),
      (3*d_out, d_in) for ``"out_in"`` (``in_proj_weight``); qkv_bias (3*d_out,) or None.
      ``packing`` orders the packed axis (``split_qkv``): ``"thirds"`` (the default),
      ``"per_head"`` (GPT-NeoX) or ``"grouped"`` (Phi-3), with the config's heads; the
      packed width is then (num_heads + 2*num_kv_heads)*head_dim.
    out_weight: (d_out, d_out) in the same layout (``"in_out"``: (in, out), GPT-2's
      ``c_proj.weight``; ``"out_in"``: (out, in), ``out_proj.weight``); out_bias (d_out,).
      Our output projection always has a bias: ``out_weight`` without ``out_bias`` loads a
      zero bias (what a bias-free projection computes).

    Raises ValueError, before returning anything, for a bad layout, packing or shape, widths
    that do not match the config (d_in, d_out; the exact packed shape for a by-heads
    packing), ``"thirds"`` for a module with grouped-query heads, a ``qkv_bias`` for a module without q/k/v
    biases or none for a module with them (build it with ``qkv_bias=`` to match), an
    ``out_weight`` for a module without ``out_proj``, an ``out_bias`` without
    ``out_weight``; TypeError for non-floating arrays.
    """
    names = torch_names_for_packed(config)
    parts = _split_for(config, qkv_weight, qkv_bias, layout, packing)
    d_out = parts["query"][0].shape[0]
    has_qkv_bias = names["query"][1] is not None
    if qkv_bias is not None and not has_qkv_bias:
        raise ValueError(
            f"a qkv_bias was given but the module has no q/k/v biases; build it with qkv_bias=True "
            f"({config.variant})"
        )
    if qkv_bias is None and has_qkv_bias:
        raise ValueError(
            "the module has q/k/v biases but no qkv_bias was given; pass the checkpoint's bias or "
            "build the module with qkv_bias=False"
        )
    out: dict[str, np.ndarray] = {}
    if out_weight is None:
        if out_bias is not None:
            raise ValueError("out_bias was given without out_weight")
    else:
        if "out" not in names:
            raise ValueError(f"out_weight was given but the module has no output projection ({config.variant} "
                             "with out_proj=False)")
        ow = _float("out_weight", out_weight)
        if ow.shape != (d_out, d_out):
            raise ValueError(f"out_weight must have shape ({d_out}, {d_out}) (d_out, d_out); "
                             f"got {tuple(ow.shape)}")
        ob = None if out_bias is None else _float("out_bias", out_bias)
        if ob is not None and ob.shape != (d_out,):
            raise ValueError(f"out_bias must have shape ({d_out},); got {tuple(ob.shape)}")
        weight_name, bias_name = names["out"]
        assert bias_name is not None  # the registry declares out_proj's bias "always"
        out[weight_name] = np.array(ow.T if layout == "in_out" else ow)
        out[bias_name] = np.zeros(d_out, ow.dtype) if ob is None else np.array(ob)
    for role in ROLES:
        weight_name, bias_name = names[role]
        w, b = parts[role]
        out[weight_name] = np.array(w.T) if "." not in weight_name else w  # a raw matrix is (d_in, d_out)
        if bias_name is not None:
            assert b is not None
            out[bias_name] = b
    return {k: out[k] for k in sorted(out, key=_order(names))}


def _order(names: Mapping[str, tuple[str, str | None]]) -> Any:
    ranking = [n for pair in names.values() for n in pair if n is not None]
    return ranking.index


def pack_state_dict(
    config: AttentionConfig, state_dict: Mapping[str, Any], *, layout: str, packing: str = "thirds"
) -> dict[str, np.ndarray | None]:
    """Our module's PyTorch-named arrays -> a packed checkpoint: {"qkv_weight", "qkv_bias",
    "out_weight", "out_bias"} in ``layout`` and ``packing`` (the inverse of
    ``packed_state_dict``; a bias the module does not have, or the output projection of one
    without it, is None).  Raises ValueError for a missing name, ``"thirds"`` for a module
    with grouped-query heads, and as ``join_qkv``."""
    names = torch_names_for_packed(config)
    layout, packing = check_layout(layout), check_packing(packing)
    if packing in UNHEADED:
        _thirds_for(config, packing)
    missing = [n for pair in names.values() for n in pair if n is not None and n not in state_dict]
    if missing:
        raise ValueError("the state_dict lacks " + ", ".join(missing))
    arrays = {n: as_numpy(state_dict[n]) for pair in names.values() for n in pair if n is not None}
    weights = [arrays[names[r][0]] for r in ROLES]
    if "." not in names["query"][0]:  # raw (d_in, d_out) matrices
        weights = [w.T for w in weights]
    biases = None if names["query"][1] is None else [arrays[names[r][1]] for r in ROLES]  # type: ignore[index]
    heads = {} if packing in UNHEADED else {"num_heads": config.num_heads, "num_kv_heads": config.kv_heads}
    qkv_weight, qkv_bias = join_qkv(weights[0], weights[1], weights[2], biases, layout=layout, packing=packing,
                                    **heads)
    out_weight = out_bias = None
    if "out" in names:
        w_name, b_name = names["out"]
        out_weight = np.array(arrays[w_name].T if layout == "in_out" else arrays[w_name])
        out_bias = None if b_name is None else np.array(arrays[b_name])
    return {"qkv_weight": qkv_weight, "qkv_bias": qkv_bias, "out_weight": out_weight, "out_bias": out_bias}


# ------------------------------------------------------- Flax's head-shaped kernels


def _divides(what: str, width: int, num_heads: int) -> None:
    if width % num_heads:
        raise ValueError(f"{what} width {width} is not divisible by num_heads={num_heads}")


def _check_kernel(k: np.ndarray, num_heads: Any) -> int:
    _rank("the q/k/v kernel", k, 2, "(in, heads*head_dim)")
    h = _heads(num_heads)
    _divides("the q/k/v kernel's", k.shape[1], h)
    return h


def _check_bias(b: np.ndarray, num_heads: Any) -> int:
    _rank("the q/k/v bias", b, 1, "(heads*head_dim,)")
    h = _heads(num_heads)
    _divides("the q/k/v bias's", b.shape[0], h)
    return h


def _check_out_kernel(k: np.ndarray, num_heads: Any) -> int:
    _rank("the output kernel", k, 2, "(heads*head_dim, out)")
    h = _heads(num_heads)
    _divides("the output kernel's input", k.shape[0], h)
    return h


def split_heads_kernel(kernel: Any, num_heads: int) -> np.ndarray:
    """A q/k/v kernel (in, heads*head_dim) -> (in, heads, head_dim)."""
    k = _float("the kernel", kernel)
    h = _check_kernel(k, num_heads)
    return np.array(k.reshape(k.shape[0], h, k.shape[1] // h))


def merge_heads_kernel(kernel: Any) -> np.ndarray:
    """A q/k/v kernel (in, heads, head_dim) -> (in, heads*head_dim)."""
    k = _float("the kernel", kernel)
    _rank("the q/k/v kernel", k, 3, "(in, heads, head_dim)")
    return np.array(k.reshape(k.shape[0], k.shape[1] * k.shape[2]))


def split_heads_bias(bias: Any, num_heads: int) -> np.ndarray:
    """A q/k/v bias (heads*head_dim,) -> (heads, head_dim)."""
    b = _float("the bias", bias)
    h = _check_bias(b, num_heads)
    return np.array(b.reshape(h, b.shape[0] // h))


def merge_heads_bias(bias: Any) -> np.ndarray:
    """A q/k/v bias (heads, head_dim) -> (heads*head_dim,)."""
    b = _float("the bias", bias)
    _rank("the q/k/v bias", b, 2, "(heads, head_dim)")
    return np.array(b.reshape(-1))


def split_heads_out_kernel(kernel: Any, num_heads: int) -> np.ndarray:
    """An output kernel (heads*head_dim, out) -> (heads, head_dim, out)."""
    k = _float("the kernel", kernel)
    h = _check_out_kernel(k, num_heads)
    return np.array(k.reshape(h, k.shape[0] // h, k.shape[1]))


def merge_heads_out_kernel(kernel: Any) -> np.ndarray:
    """An output kernel (heads, head_dim, out) -> (heads*head_dim, out)."""
    k = _float("the kernel", kernel)
    _rank("the output kernel", k, 3, "(heads, head_dim, out)")
    return np.array(k.reshape(k.shape[0] * k.shape[1], k.shape[2]))


_NATIVE = {"query": "W_query", "key": "W_key", "value": "W_value", "out": "out_proj"}


def nn_multihead_rules(*, packed: bool, qkv_bias: bool, out_bias: bool) -> list[Rule]:
    """The map between our ``MultiHeadAttention``'s PyTorch names and the parameters of
    ``torch.nn.MultiheadAttention`` (the other side's paths, ``in_proj_weight``,
    ``out_proj/weight``), as rules of the one weight map: ``W_query.weight``,
    ``W_key.weight``, ``W_value.weight`` <-> ``in_proj_weight`` (joined along the output
    axis; ``packed=False``: ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` as
    they are), the three biases <-> ``in_proj_bias`` with ``qkv_bias``, ``out_proj.weight``
    <-> ``out_proj/weight`` and, with ``out_bias``, ``out_proj.bias`` <-> ``out_proj/bias``."""
    names = [f"{_NATIVE[role]}.weight" for role in ROLES]
    if packed:
        rules = [Rule(names, "in_proj_weight", (Concat(0, 3),))]
    else:
        rules = [Rule(name, f"{role[0]}_proj_weight") for name, role in zip(names, ROLES, strict=True)]
    if qkv_bias:
        rules.append(Rule([f"{_NATIVE[role]}.bias" for role in ROLES], "in_proj_bias", (Concat(0, 3),)))
    rules.append(Rule("out_proj.weight", "out_proj/weight"))
    if out_bias:
        rules.append(Rule("out_proj.bias", "out_proj/bias"))
    return rules


def native_flax_rules(num_heads: int, *, use_bias: bool = True) -> list[Rule]:
    """The map between our ``MultiHeadAttention``'s PyTorch names and the parameter tree
    of Flax's own attention, as rules of the one weight map: ``W_query.weight`` (d_out,
    d_in) <-> ``query/kernel`` (d_in, heads, head_dim) (transposed, then its width split
    into heads), ``W_query.bias`` <-> ``query/bias`` (heads, head_dim), likewise key and
    value; ``out_proj.weight`` <-> ``out/kernel`` (heads, head_dim, d_out),
    ``out_proj.bias`` <-> ``out/bias``.  ``use_bias=False``: no bias rules."""
    h = _heads(num_heads)
    rules = []
    for role, name in _NATIVE.items():
        # the q/k/v kernels split their output axis into heads, the output kernel its input axis
        heads = SplitAxis(0, (h, -1)) if role == "out" else SplitAxis(1, (h, -1))
        rules.append(Rule(f"{name}.weight", (role, "kernel"), (Transpose(), heads)))
        if use_bias:
            rules.append(Rule(f"{name}.bias", (role, "bias"), () if role == "out" else (SplitAxis(0, (h, -1)),)))
    return rules


def native_flax_params(
    state_dict: Mapping[str, Any], num_heads: int, *, use_bias: bool = True
) -> dict[str, dict[str, np.ndarray]]:
    """Our ``MultiHeadAttention``'s PyTorch-named arrays (``W_query.weight`` (d_out, d_in),
    ..., ``out_proj.weight``/``.bias``) -> the parameter tree of Flax's own attention:
    {"query"|"key"|"value": {"kernel": (d_in, heads, head_dim)[, "bias": (heads, head_dim)]},
    "out": {"kernel": (heads, head_dim, d_out)[, "bias": (d_out,)]}}, through
    ``native_flax_rules``.

    ``use_bias=False`` leaves every bias out (Flax's module then has none, the output's
    included); the caller checks that the dropped biases are zero.  Raises ValueError for
    missing names or shapes that do not fit."""
    h = _heads(num_heads)
    arrays = {k: _float(k, v) for k, v in state_dict.items()}
    need = [f"{n}.weight" for n in _NATIVE.values()]
    if use_bias:
        need += [f"{n}.bias" for n in _NATIVE.values()]
    missing = [n for n in need if n not in arrays]
    if missing:
        raise ValueError("the state_dict lacks " + ", ".join(missing))
    for role in ROLES:
        _check_kernel(arrays[f"{_NATIVE[role]}.weight"].T, h)
        if use_bias:
            _check_bias(arrays[f"{_NATIVE[role]}.bias"], h)
    _check_out_kernel(arrays["out_proj.weight"].T, h)
    tree: dict[str, dict[str, np.ndarray]] = {}
    for (role, name), array in run_rules(arrays, native_flax_rules(h, use_bias=use_bias), "to_flax").items():
        tree.setdefault(role, {})[name] = np.array(array)
    widths = {tree[r]["kernel"].shape[1:] for r in ROLES} | {tree["out"]["kernel"].shape[:2]}
    if len(widths) != 1:
        raise ValueError(f"the q/k/v and output projections disagree on (heads, head_dim): {sorted(widths)}")
    return tree


def state_dict_from_native_flax(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The parameter tree of Flax's own attention ({"query": {"kernel", "bias"?}, "key",
    "value", "out"}, as ``native_flax_params`` gives) -> our ``MultiHeadAttention``'s
    PyTorch-named arrays, through ``native_flax_rules``.  Biases the tree lacks
    (``use_bias=False``) are absent from the result too.  Raises ValueError for a missing
    or unexpected entry, a kernel or bias of the wrong rank, q/k/v/out that disagree on
    heads and head_dim, or biases on some projections only."""
    expected = (*ROLES, "out")
    keys = set(params)
    if keys != set(expected):
        raise ValueError(
            f"the attention params must hold exactly {', '.join(expected)}; "
            f"missing {sorted(set(expected) - keys)}, unexpected {sorted(map(str, keys - set(expected)))}"
        )
    flat: dict[tuple[str, str], np.ndarray] = {}
    heads = set()
    for role in expected:
        node = params[role]
        if not isinstance(node, Mapping) or "kernel" not in node or set(node) - {"kernel", "bias"}:
            raise ValueError(f"params[{role!r}] must be a mapping with 'kernel' and optionally 'bias'; "
                             f"got {sorted(node) if isinstance(node, Mapping) else type(node).__name__}")
        kernel = flat[(role, "kernel")] = _float(f"{role}/kernel", node["kernel"])
        if role == "out":
            _rank("the output kernel", kernel, 3, "(heads, head_dim, out)")
            heads.add(tuple(kernel.shape[:2]))
        else:
            _rank("the q/k/v kernel", kernel, 3, "(in, heads, head_dim)")
            heads.add(tuple(kernel.shape[1:]))
        if "bias" in node:
            flat[(role, "bias")] = _native_bias(role, _float(f"{role}/bias", node["bias"]), kernel)
    if len(heads) != 1:
        raise ValueError(f"the q/k/v and output kernels disagree on (heads, head_dim): {sorted(heads)}")
    with_bias = [role for role in expected if (role, "bias") in flat]
    if with_bias and len(with_bias) != len(expected):
        raise ValueError(f"only some projections have a bias ({', '.join(with_bias)}); Flax's attention "
                         "has all or none")
    rules = native_flax_rules(heads.pop()[0], use_bias=bool(with_bias))
    return {name: np.array(a) for name, a in run_rules(flat, rules, "to_torch").items()}


def _native_bias(role: str, bias: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """A bias of Flax's own attention, checked against its kernel."""
    if role == "out":
        _rank("the output bias", bias, 1, "(out,)")
        if bias.shape[0] != kernel.shape[2]:
            raise ValueError(f"the output bias {tuple(bias.shape)} does not fit the output kernel "
                             f"{tuple(kernel.shape)}")
    elif bias.shape != kernel.shape[1:]:
        raise ValueError(f"params[{role!r}]['bias'] {tuple(bias.shape)} does not fit the kernel "
                         f"{tuple(kernel.shape)}: expected {tuple(kernel.shape[1:])}")
    return bias
