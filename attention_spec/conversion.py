"""The declared weight map between the twins, and the checks around every copy.

PyTorch names a parameter by a dotted path (``heads.0.W_query.weight``) and stores
``nn.Linear.weight`` as (out, in); Flax NNX names it by a path of keys
(``("heads", 0, "W_query", "kernel")``) and stores a kernel as (in, out).  One table per
variant (``LAYOUTS``) says which parameters exist and how each moves; nothing is ever
matched by position.  Works on NumPy arrays, so either twin can convert a checkpoint
without the other framework installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_spec.registry import REGISTRY, AttentionConfig, make_config
from attention_spec.registry import VARIANTS as REGISTRY_VARIANTS
from attention_spec.registry import variant as _variant

__all__ = [
    "LAYOUTS",
    "ParamRule",
    "VARIANTS",
    "as_numpy",
    "check_complete",
    "check_float_arrays",
    "flatten_paths",
    "flax_to_torch",
    "module_rules",
    "rules_for",
    "torch_to_flax",
]

Path = tuple[Any, ...]

# kind of each parameter-holding child, per variant, read from the registry: "linear"
# (weight transposed, bias if any) or "matrix" (a raw (d_in, d_out) parameter used as
# x @ W, same layout in both frameworks).  The wrapper has none of its own: its layout is
# its head variant's once per head.
LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    name: tuple((p.name, p.layout) for p in decl.projections)
    for name, decl in REGISTRY.items()
    if decl.heads != "wrapper"
}


# Every variant of the library, in the registry's order.
VARIANTS: tuple[str, ...] = REGISTRY_VARIANTS


@dataclass(frozen=True)
class ParamRule:
    """One parameter: its PyTorch name, its Flax path, its PyTorch shape, and whether the
    array is transposed on the way (a Linear weight (out, in) <-> kernel (in, out))."""

    torch_name: str
    flax_path: Path
    torch_shape: tuple[int, ...]
    transpose: bool

    @property
    def flax_shape(self) -> tuple[int, ...]:
        return self.torch_shape[::-1] if self.transpose else self.torch_shape


def _linear(prefix: Path, d_in: int, d_out: int, bias: bool) -> list[ParamRule]:
    name = ".".join(str(p) for p in prefix)
    rules = [ParamRule(f"{name}.weight", (*prefix, "kernel"), (d_out, d_in), True)]
    if bias:
        rules.append(ParamRule(f"{name}.bias", (*prefix, "bias"), (d_out,), False))
    return rules


def rules_for(
    variant: str, config: Mapping[str, Any] | AttentionConfig, prefix: Path = ()
) -> list[ParamRule]:
    """The parameter rules of a variant with the given constructor config (a dict of
    constructor keywords, missing ones at their declared defaults, or an
    ``AttentionConfig``), in the registry's creation order.

    Raises ValueError for a variant that has no declared layout, TypeError/ValueError for
    a config that the variant's constructor would refuse.
    """
    decl = _variant(variant)
    if isinstance(config, AttentionConfig):
        spec = config
    else:
        spec = make_config(variant, config)
    if decl.heads == "wrapper":
        head = spec.head()
        return [
            rule
            for i in range(spec.num_heads)
            for rule in rules_for(head.variant, head, (*prefix, "heads", i))
        ]
    rules: list[ParamRule] = []
    for proj in spec.projections():
        path = (*prefix, proj.name)
        # kdim / vdim widen the key / value inputs; grouped heads narrow their outputs
        fan_in, width = spec.fan_in(proj.role), spec.fan_out(proj.role)
        assert fan_in is not None and width is not None  # a variant with projections has both
        if proj.layout == "matrix":
            rules.append(ParamRule(".".join(map(str, path)), path, (fan_in, width), False))
        else:
            rules += _linear(path, fan_in, width, proj.has_bias(spec))
    return rules


def module_rules(module: Any) -> list[ParamRule]:
    """Rules for one of our modules (either framework), from its ``spec``."""
    spec = getattr(module, "spec", None)
    if isinstance(spec, AttentionConfig):
        return rules_for(spec.variant, spec)
    return rules_for(type(module).__name__, module.config)


def check_complete(
    given: Mapping[Any, tuple[int, ...]],
    expected: Mapping[Any, tuple[int, ...]],
    what: str,
) -> None:
    """Every expected name present once with its shape, nothing else; else one
    ValueError that lists the missing, unexpected and misshaped names with shapes."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    misshaped = [k for k in expected if k in given and tuple(given[k]) != tuple(expected[k])]
    if not (missing or unexpected or misshaped):
        return
    lines = [f"{what} does not match the declared weight layout:"]
    lines += [f"  missing: {_fmt(k)} {tuple(expected[k])}" for k in missing]
    lines += [f"  unexpected: {_fmt(k)} {tuple(given[k])}" for k in unexpected]
    lines += [
        f"  misshaped: {_fmt(k)} is {tuple(given[k])}, expected {tuple(expected[k])}"
        for k in misshaped
    ]
    raise ValueError("\n".join(lines))


def check_float_arrays(arrays: Mapping[Any, np.ndarray], what: str) -> None:
    """Every array floating point (bfloat16 included); else one TypeError naming each
    offender, raised before anything is written."""
    bad = [f"  {_fmt(k)}: dtype {a.dtype}" for k, a in arrays.items()
           if not (np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16")]
    if bad:
        raise TypeError("\n".join([f"{what} holds arrays that are not floating point:", *bad]))


def _fmt(key: Any) -> str:
    return key if isinstance(key, str) else "/".join(str(p) for p in key)


def torch_to_flax(arrays: Mapping[str, np.ndarray], rules: list[ParamRule]) -> dict[Path, np.ndarray]:
    """PyTorch-named arrays -> {flax path: array}, after checking names and shapes."""
    check_complete(
        {k: np.shape(v) for k, v in arrays.items()},
        {r.torch_name: r.torch_shape for r in rules},
        "the PyTorch state_dict",
    )
    return {r.flax_path: (arrays[r.torch_name].T if r.transpose else arrays[r.torch_name]) for r in rules}


def flax_to_torch(arrays: Mapping[Path, np.ndarray], rules: list[ParamRule]) -> dict[str, np.ndarray]:
    """{flax path: array} -> PyTorch-named arrays, after checking paths and shapes."""
    check_complete(
        {k: np.shape(v) for k, v in arrays.items()},
        {r.flax_path: r.flax_shape for r in rules},
        "the Flax state",
    )
    return {r.torch_name: (arrays[r.flax_path].T if r.transpose else arrays[r.flax_path]) for r in rules}


def as_numpy(value: Any) -> np.ndarray:
    """A NumPy view or copy of a torch tensor, a JAX array or an array-like, exactly.

    A bfloat16 tensor becomes an ``ml_dtypes.bfloat16`` array (or float32 if ml_dtypes is
    not installed; both hold every bfloat16 value exactly).  Imports no framework.
    """
    if hasattr(value, "detach"):  # a torch.Tensor (torch is loaded if one exists)
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            return value.float().numpy().astype(_bfloat16())
        return value.numpy()
    return np.asarray(value)


def _bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - jax always brings ml_dtypes
        return np.float32
    return ml_dtypes.bfloat16


def flatten_paths(arrays: Mapping[Any, Any]) -> dict[Path, np.ndarray]:
    """{path tuple: array}, {"a/0/b": array} or a nested dict -> {path tuple: NumPy array}.

    An ``nnx.State`` is a nested mapping too: its ``nnx.Param`` leaves are read, its other
    variables (the dropout streams' ``RngKey``/``RngCount`` of a full ``nnx.state(module)``)
    are skipped.
    """
    flat: dict[Path, np.ndarray] = {}

    def walk(prefix: Path, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                if isinstance(key, tuple):
                    walk((*prefix, *key), child)
                elif isinstance(key, str) and "/" in key:
                    walk((*prefix, *(int(p) if p.isdigit() else p for p in key.split("/"))), child)
                else:
                    walk((*prefix, key), child)
        elif hasattr(node, "get_value"):
            # An nnx.Variable (duck-typed: no flax import here).  A full ``nnx.state(module)``
            # also holds the dropout streams' RngKey/RngCount (and could hold other
            # non-parameter variables): only parameters are weights, the rest is skipped.
            if _is_param(node):
                flat[prefix] = as_numpy(node.get_value())
        else:
            flat[prefix] = as_numpy(node)

    walk((), arrays)
    return flat


def _is_param(variable: Any) -> bool:
    """Whether an nnx.Variable is an ``nnx.Param`` (or a subclass), without importing flax."""
    return any(c.__name__ == "Param" and c.__module__.startswith("flax") for c in type(variable).__mro__)
