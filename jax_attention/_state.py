"""One of our Flax modules' weights in and out, in either framework's layout
(``torch_state_dict``, ``flax_arrays``, ``load_torch_state_dict``, ``load_flax_arrays``),
by the map ``attention_spec.interop.conversion`` declares; re-exported by ``interop``.

Twin of ``torch_attention/_state.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_spec.interop.conversion import (
    Path,
    as_numpy,
    check_complete,
    check_float_arrays,
    flatten_paths,
    flax_to_torch,
    module_rules,
    torch_to_flax,
)


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
