"""PyTorch's projections (``functional.linear``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from attention_spec.arrays import check_linear
from attention_spec.options import check_implementation


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, implementation: str = "auto") -> Tensor:
    """A projection, x (..., d_in) @ weight.T (+ bias), weight (d_out, d_in) as
    ``nn.Linear`` stores it: ``F.linear``, the same on every path (PyTorch's CPU and GPU
    products are already its BLAS's).  ``implementation`` is the attention call's, checked
    as the JAX twin checks it; there it picks the product's kernel on CPU."""
    check_implementation(implementation)
    check_linear(tuple(x.shape), tuple(weight.shape), None if bias is None else tuple(bias.shape), layout="out_in")
    return project(x, weight, bias)


def project(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, implementation: str = "auto") -> Tensor:
    """``linear`` of operands already known good (a module's projection of a checked
    call: its own weights, its implementation checked by its planner): the same work,
    without the checks."""
    return F.linear(x, weight, bias)
