"""NumPy arrays at the interop boundary: reading any framework's arrays, and the checks
of a set of named arrays before anything is converted or written.

``as_numpy`` reads torch tensors and JAX arrays (bfloat16 included) without importing
either framework; ``flatten_paths`` reads a Flax parameter tree (or an ``nnx.State``) as
{path tuple: array}; ``check_complete`` and ``check_float_arrays`` check names, shapes and
dtypes, each raising one error that lists every problem.  The lowest layer of
``attention_spec.interop``: it imports nothing of this library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["Path", "as_numpy", "check_complete", "check_float_arrays", "flatten_paths"]

# A Flax parameter's path: a tuple of keys (str, or int for a list's index).
Path = tuple[Any, ...]


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
