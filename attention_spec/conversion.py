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

# kind of each parameter-holding child: "linear" (weight transposed, bias if any) or
# "matrix" (a raw (d_in, d_out) parameter used as x @ W, same layout in both frameworks).
LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "SimplifiedAttention": (),
    "SelfAttention_v1": (("W_query", "matrix"), ("W_key", "matrix"), ("W_value", "matrix")),
    "SelfAttention_v2": (("W_query", "linear"), ("W_key", "linear"), ("W_value", "linear")),
    "CausalAttention": (("W_query", "linear"), ("W_key", "linear"), ("W_value", "linear")),
    "Head": (("key", "linear"), ("query", "linear"), ("value", "linear")),
    "MultiHeadAttention": (
        ("W_query", "linear"), ("W_key", "linear"), ("W_value", "linear"), ("out_proj", "linear"),
    ),
}


# Every variant of the library: those with a layout above, and the wrapper, whose layout
# is CausalAttention's once per head.
VARIANTS: tuple[str, ...] = (*LAYOUTS, "MultiHeadAttentionWrapper")


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


def rules_for(variant: str, config: Mapping[str, Any], prefix: Path = ()) -> list[ParamRule]:
    """The parameter rules of a variant with the given constructor config.

    Raises ValueError for a variant that has no declared layout.
    """
    if variant == "MultiHeadAttentionWrapper":
        head = {**config, "num_heads": 1}
        return [
            rule
            for i in range(config["num_heads"])
            for rule in rules_for("CausalAttention", head, (*prefix, "heads", i))
        ]
    if variant not in LAYOUTS:
        known = ", ".join(sorted(VARIANTS))
        raise ValueError(f"no declared weight layout for {variant!r}; known variants: {known}")
    if not LAYOUTS[variant]:
        return []
    d_in = int(config["d_in"])
    d_out = int(config["d_out"] if "d_out" in config else config["head_size"])
    rules: list[ParamRule] = []
    for child, kind in LAYOUTS[variant]:
        path = (*prefix, child)
        if kind == "matrix":
            rules.append(ParamRule(".".join(map(str, path)), path, (d_in, d_out), False))
        elif child == "out_proj":
            if config.get("out_proj", True):
                rules += _linear(path, d_out, d_out, True)
        else:
            rules += _linear(path, d_in, d_out, bool(config.get("qkv_bias", False)))
    return rules


def module_rules(module: Any) -> list[ParamRule]:
    """Rules for one of our modules (either framework), from its ``config``."""
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

    An ``nnx.State`` is a nested mapping too; its leaves (Variables) are read with ``[...]``.
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
        else:
            # An nnx.Variable (duck-typed: no flax import here) holds its array as get_value().
            flat[prefix] = as_numpy(node.get_value() if hasattr(node, "get_value") else node)

    walk((), arrays)
    return flat
