"""One of our PyTorch modules' weights in and out, in either framework's layout
(``torch_state_dict``, ``flax_arrays``, ``load_torch_state_dict``, ``load_flax_arrays``),
by the map ``attention_spec.interop.conversion`` declares; re-exported by ``interop``,
and used by the importers (``_hf``, ``_hf_delta``, ``_hf_latent``), which ``interop``
re-exports in turn.

Twin of ``jax_attention/_state.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

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
