"""Checks of the arrays a call is given, on their shapes and dtype names: a module's input
``x`` and cross-attention ``context``, the functional core's ``q``, ``k`` and ``v``, a
projection's operands, an additive ``bias``.

Every function takes plain Python values (ints, tuples of ints, dtype *names*) so that it
runs before any framework work and cannot change a module's state.  The frameworks call
them with ``tuple(x.shape)`` and ``dtype_name(x.dtype)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Shape = tuple[int, ...]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` and ``jnp.float32`` both become ``"float32"``."""
    name = str(dtype)
    return name.removeprefix("torch.")


def as_shape(shape: Any) -> Shape:
    """Any sequence of sizes (a framework's shape included) as a tuple of Python ints."""
    return tuple(int(s) for s in shape)


def host_array(name: str, value: Any) -> np.ndarray:
    """``value``, given for ``name`` as a list, a tuple or a NumPy array instead of a
    framework's array, as a NumPy array.  Both twins check that array (its dtype included)
    before they convert it, so one input gets one dtype and one error text in both:
    converted first, a float64 list would become float32 in JAX and stay float64 in
    PyTorch, and strings would fail inside each framework with its own text.

    Raises:
      TypeError: NumPy makes no array of ``value`` (lists of different lengths).
    """
    try:
        return np.asarray(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be an array, or nested lists of one length per level; NumPy makes no array "
            f"of this {type(value).__name__}"
        ) from None


def broadcasts(shape: Shape, target: Shape) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` (from the right)."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target[len(target) - len(shape):]), strict=True))


def check_bool(name: str, dtype: str, meaning: str) -> None:
    if dtype != "bool":
        raise TypeError(f"{name} must be a bool array ({meaning}); got dtype {dtype}")


def check_floating(name: str, dtype: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point array; got dtype {dtype}")


def check_input(
    shape: Any, dtype: str, *, d_in: int | None, context_length: int | None = None
) -> bool:
    """Checks a module input ``x``; returns whether it is batched.

    Raises:
      ValueError: rank not 2 or 3, last dimension != d_in, empty sequence, or a sequence
        longer than ``context_length``.
      TypeError: a dtype that is not floating point.
    """
    shape = as_shape(shape)
    if len(shape) not in (2, 3):
        raise ValueError(
            "x must have shape (batch, seq, d_in) or (seq, d_in); "
            f"got a {len(shape)}-d array of shape {shape}"
        )
    check_floating("x", dtype)
    if d_in is not None and shape[-1] != d_in:
        raise ValueError(f"x has last dimension {shape[-1]} but the module expects d_in={d_in}")
    seq = shape[-2]
    if seq == 0:
        raise ValueError(f"x has an empty sequence: shape {shape}")
    if context_length is not None and seq > context_length:
        raise ValueError(
            f"sequence length {seq} exceeds context_length {context_length}"
        )
    return len(shape) == 3


def check_compute_dtype(x_dtype: str, compute_dtype: str | None, name: str = "x") -> None:
    """A module computes in one dtype (PyTorch: its parameters'; Flax: ``dtype``, else
    ``param_dtype``); ``x`` must come in that dtype, in both frameworks alike: PyTorch
    would fail inside a matmul and JAX would silently promote.  ``compute_dtype=None``
    (a module without parameters) computes in ``x``'s dtype.  ``name``: the input
    checked (``"x"``, or a context input).  Raises TypeError."""
    if compute_dtype is not None and x_dtype != compute_dtype:
        raise TypeError(
            f"{name} has dtype {x_dtype} but the module computes in {compute_dtype}; cast {name} first"
        )


def context_pair(context: Any) -> tuple[Any, Any]:
    """A module's ``context`` -> (key input, value input): None, one array for both, or a pair."""
    if context is None:
        return None, None
    if isinstance(context, (tuple, list)):
        if len(context) != 2:
            raise TypeError(f"context must be an array or a pair (key_input, value_input); got {len(context)} items")
        return context[0], context[1]
    return context, context


def check_context(x_shape: Any, context_shape: Any, name: str, width: int) -> None:
    """Cross-attention input ``context`` (or one of its pair): (B, S, width) for a batched
    x (B, T, d_in), (S, width) for an unbatched one."""
    x, c = as_shape(x_shape), as_shape(context_shape)
    if len(c) != len(x):
        raise ValueError(f"{name} must have the rank of x ({len(x)}); got shape {c} for x of shape {x}")
    if len(x) == 3 and c[0] != x[0]:
        raise ValueError(f"{name} and x must have the same batch size; got {c[0]} and {x[0]}")
    if c[-1] != width:
        raise ValueError(f"{name} must have width {width} (its last dimension); got shape {c}")
    if c[-2] == 0:
        raise ValueError(f"{name} must not be empty; got shape {c}")


def check_qkv(q: Any, k: Any, v: Any, dtypes: tuple[str, str, str]) -> None:
    """Shapes ``(..., q_len, d)``, ``(..., kv_len, d)``, ``(..., kv_len, d_v)``, one dtype."""
    q, k, v = as_shape(q), as_shape(k), as_shape(v)
    got = f"got q {q}, k {k}, v {v}"
    if not (len(q) == len(k) == len(v)) or len(q) < 2:
        raise ValueError(f"q, k and v must have the same rank, at least 2; {got}")
    if k[:-2] != v[:-2]:
        raise ValueError(f"k and v must have the same leading (batch, heads) dimensions; {got}")
    grouped = len(q) >= 3 and q[:-3] == k[:-3] and k[-3] >= 1 and q[-3] % k[-3] == 0
    if q[:-2] != k[:-2] and not grouped:
        raise ValueError(
            "q, k and v must have the same leading (batch, heads) dimensions, or k and v "
            f"fewer heads that divide q's (grouped-query attention); {got}"
        )
    if q[-1] != k[-1]:
        raise ValueError(f"q and k must have the same last dimension (head_dim); {got}")
    if k[-2] != v[-2]:
        raise ValueError(f"k and v must have the same length (kv_len); {got}")
    if q[-2] == 0 or k[-2] == 0:
        raise ValueError(f"q, k and v must not have an empty sequence; {got}")
    if len(set(dtypes)) != 1 or dtypes[0] not in FLOAT_DTYPES:
        raise TypeError(
            "q, k and v must share one floating-point dtype; got "
            f"{dtypes[0]}, {dtypes[1]}, {dtypes[2]}"
        )


def check_linear(x_shape: tuple[int, ...], weight_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None,
                 *, layout: str) -> None:
    """A projection's operands: x (..., d_in), a weight of d_in input and d_out output
    features laid out ``"in_out"`` (Flax's kernel (d_in, d_out)) or ``"out_in"``
    (PyTorch's weight (d_out, d_in)), a bias (d_out,)."""
    if layout not in ("in_out", "out_in"):
        raise ValueError(f"linear: layout must be 'in_out' or 'out_in'; got {layout!r}")
    if len(weight_shape) != 2:
        raise ValueError(f"linear: the weight must be a matrix; got shape {tuple(weight_shape)}")
    d_in, d_out = weight_shape if layout == "in_out" else weight_shape[::-1]
    if len(x_shape) < 1 or x_shape[-1] != d_in:
        raise ValueError(f"linear: x must end in the weight's {d_in} input features; got shape {tuple(x_shape)}")
    if bias_shape is not None and tuple(bias_shape) != (d_out,):
        raise ValueError(f"linear: the bias must have shape ({d_out},) (the weight's output features); "
                         f"got {tuple(bias_shape)}")


def check_bias(shape: Any, dtype: str, target: Any) -> None:
    """``bias``: a floating-point array added to the scaled scores, broadcastable to
    ``target`` = (batch, heads, q_len, kv_len).  Raises TypeError / ValueError."""
    check_floating("bias", dtype)
    shape, target = as_shape(shape), as_shape(target)
    if not broadcasts(shape, target):
        names = "(batch, heads, q_len, kv_len)" if len(target) == 4 else "(heads, q_len, kv_len)"
        raise ValueError(f"bias of shape {shape} does not broadcast to {names} = {target}")


def check_sinks(shape: Any, dtype: str, q_shape: Any, normalization: str) -> None:
    """Attention sinks (gpt-oss): one logit per query head, a floating array of shape
    (H,) where q is (..., H, T, D); only a softmax has a denominator to join."""
    check_floating("sinks", dtype)
    q_shape = as_shape(q_shape)
    heads = q_shape[-3] if len(q_shape) >= 3 else None
    if heads is None:
        raise ValueError(f"sinks need q with a heads axis, (..., H, T, D); got q of shape {q_shape}")
    if as_shape(shape) != (heads,):
        raise ValueError(f"sinks must have shape ({heads},), one logit per query head; got {as_shape(shape)}")
    if normalization != "softmax":
        raise ValueError(
            f"sinks need normalization='softmax' (a sink joins the softmax's denominator); got {normalization!r}"
        )
