"""Weights in and out of the PyTorch twins, in either framework's layout.  Needs no JAX.

Twin of ``jax_attention/interop.py``: both offer ``torch_state_dict``, ``flax_arrays``,
``load_torch_state_dict`` and ``load_flax_arrays`` for their own modules, plus
array-level converters for checkpoints.  The map is declared in
``attention_spec.conversion`` (names, transposes, shapes); a load checks everything
before it writes anything, so a failed load leaves the module as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

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

__all__ = [
    "flax_arrays",
    "load_flax_arrays",
    "load_torch_state_dict",
    "state_dict_from_flax",
    "state_dict_to_flax",
    "torch_state_dict",
]


def state_dict_to_flax(
    state_dict: Mapping[str, Any], variant: str, config: Mapping[str, Any]
) -> dict[Path, np.ndarray]:
    """A PyTorch ``state_dict`` (tensors or arrays) -> {Flax path: NumPy array}."""
    return torch_to_flax({k: as_numpy(v) for k, v in state_dict.items()}, rules_for(variant, config))


def state_dict_from_flax(
    arrays: Mapping[Any, Any], variant: str, config: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """Flax arrays ({path: array}, {"a/b": array} or nested) -> PyTorch-named arrays."""
    return flax_to_torch(flatten_paths(arrays), rules_for(variant, config))


def torch_state_dict(module: nn.Module) -> dict[str, np.ndarray]:
    """One of our modules' parameters, PyTorch layout, as NumPy arrays."""
    rules = module_rules(module)
    own = module.state_dict()
    return {r.torch_name: as_numpy(own[r.torch_name]) for r in rules}


def flax_arrays(module: nn.Module) -> dict[Path, np.ndarray]:
    """One of our modules' parameters in Flax's layout: {Flax path: NumPy array}."""
    return torch_to_flax(torch_state_dict(module), module_rules(module))


def load_torch_state_dict(module: nn.Module, state_dict: Mapping[str, Any]) -> nn.Module:
    """Writes PyTorch-named arrays (tensors or NumPy) into the module, each parameter
    exactly once, cast to the module's dtype.  Raises ValueError listing missing,
    unexpected and misshaped names before writing anything."""
    rules = module_rules(module)
    arrays = {k: as_numpy(v) for k, v in state_dict.items()}
    check_complete({k: a.shape for k, a in arrays.items()}, {r.torch_name: r.torch_shape for r in rules},
                   "the PyTorch state_dict")
    check_float_arrays(arrays, "the PyTorch state_dict")
    own = module.state_dict()
    # Every tensor is converted before the first write: a failure leaves the module as it was.
    ready = {r.torch_name: _tensor(arrays[r.torch_name], own[r.torch_name]) for r in rules}
    with torch.no_grad():
        for name, tensor in ready.items():
            own[name].copy_(tensor)
    return module


def _tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    if array.dtype.name == "bfloat16":  # NumPy has no bfloat16: via float32, exact
        array = array.astype(np.float32)
    return torch.from_numpy(np.array(array)).to(dtype=like.dtype, device=like.device)  # np.array: a writable copy


def load_flax_arrays(module: nn.Module, arrays: Mapping[Any, Any]) -> nn.Module:
    """Writes Flax-layout arrays into the module; checks as ``load_torch_state_dict``.
    A full ``nnx.state(flax_module)`` is accepted: its non-parameter variables (the
    dropout streams' ``RngKey``/``RngCount``) are skipped."""
    flat = flatten_paths(arrays)
    state_dict = flax_to_torch(flat, module_rules(module))  # names and shapes, Flax's words
    check_float_arrays(flat, "the Flax state")
    return load_torch_state_dict(module, state_dict)
