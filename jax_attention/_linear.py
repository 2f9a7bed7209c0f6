"""Projections: ``linear`` (x @ kernel + bias, as ``nnx.Linear``), on XLA's dot or, for
``"fused"`` / ``"auto"`` on CPU, on the library's matrix-product kernel with its own
``jax.custom_vjp``.  Re-exported by ``functional``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec.arrays import check_linear
from attention_spec.options import check_implementation
from jax_attention import _cpu_kernel
from jax_attention._cpu_fused import candidate, confirm
from jax_attention._reference import Precision

# "auto" leaves a product of at most this many rows of x (a decode step's tokens) to XLA's
# dot: the kernel's thread pool and packing cost more than such a product.
FEW_ROWS = 16


def linear(x: Array, kernel: Array, bias: Array | None = None, *, dtype: Any = None,
           precision: Precision = None, implementation: str = "auto") -> Array:
    """A projection, x (..., d_in) @ kernel (d_in, d_out) (+ bias (d_out,)), as
    ``nnx.Linear`` computes it: the operands promoted to ``dtype`` (None: their common
    type), the bias added after the product.

    ``implementation`` is the attention call's.  ``"fused"`` (and ``"auto"`` where its
    decision for full calls takes the kernel, ``_cpu_kernel.auto_declines``, and x has
    more than ``FEW_ROWS`` rows) run a float32 product on the library's CPU matrix-product kernel
    (``_cpu_kernel.matmul``, built with the attention kernel on first use; see
    ``cpu_kernel_supports``), forward and backward; every other case is XLA's dot at
    ``precision``.  The two differ only in the order of the sums."""
    implementation = check_implementation(implementation)
    check_linear(tuple(x.shape), tuple(kernel.shape), None if bias is None else tuple(bias.shape), layout="in_out")
    return project(x, kernel, bias, dtype=dtype, precision=precision, implementation=implementation)


def project(x: Array, kernel: Array, bias: Array | None = None, *, dtype: Any = None,
            precision: Precision = None, implementation: str = "auto") -> Array:
    """``linear`` of operands already known good (a module's projection of a checked
    call: its own weights, its implementation checked by its planner): the same work,
    without the checks."""
    operands = (x, kernel) if bias is None else (x, kernel, bias)
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(*operands)
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    few = implementation == "auto" and math.prod(x.shape[:-1]) <= FEW_ROWS
    if not few and candidate(x, implementation) and confirm(implementation) and dtype == jnp.float32:
        y = _kernel_linear(x.reshape(-1, x.shape[-1]), kernel).reshape(*x.shape[:-1], kernel.shape[1])
    else:
        y = _xla_product(x, kernel, precision)
    return y if bias is None else y + bias.astype(dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def _xla_product(x: Array, kernel: Array, precision: Precision) -> Array:
    """x (..., d_in) @ kernel (d_in, d_out) on XLA's dot, the kernel viewed as
    (d_in, 1, d_out).  The products are the same; the unit dimension is for the weight
    gradient x^T dy.  With a 2-d kernel, XLA's CPU backend folds that product's
    transposes into a dot whose left operand is contracted over its rows, which its
    fast matrix product (YNNPACK) does not take, and runs it on its generic dot at about
    half the rate.  With the unit dimension it computes dy^T x on YNNPACK and transposes
    the small (d_out, d_in) result, as it does for Flax's ``nnx.MultiHeadAttention``,
    whose kernels are 3-d.  Measured on the 2-core Zen 5 (x (32, 128, 256), kernel
    (256, 256), float32, forward + backward, medians of 40): 5.0 -> 2.5 ms natively,
    4.6 -> 2.6 ms in the AVX2 build (``--xla_cpu_max_isa=AVX2``)."""
    y = jax.lax.dot_general(x, kernel[:, None, :], (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
    return y.reshape(*x.shape[:-1], kernel.shape[1])


@jax.custom_vjp
def _kernel_linear(x: Array, kernel: Array) -> Array:
    """float32 x (M, d_in) @ kernel (d_in, d_out) on the CPU kernel, and its gradients
    (dx = dy kernel^T, dkernel = x^T dy) on the same kernel, with no transposed copies."""
    return _cpu_kernel.matmul(x, kernel)


def _kernel_linear_fwd(x: Array, kernel: Array) -> tuple[Array, Any]:
    return _cpu_kernel.matmul(x, kernel), (x, kernel)


def _kernel_linear_bwd(residuals: Any, dy: Array) -> tuple[Array, Array]:
    x, kernel = residuals
    return _cpu_kernel.matmul(dy, kernel, trans_b=True), _cpu_kernel.matmul(x, dy, trans_a=True)


_kernel_linear.defvjp(_kernel_linear_fwd, _kernel_linear_bwd)
