"""The fused path on CPU: the library's own FlashAttention kernel (``_cpu_kernel``, which
builds and loads it) behind a ``jax.custom_vjp``, and the questions ``functional.route``
asks of it (``declines``), answered without building it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec import dtype_name
from attention_spec.geometry import reach
from jax_attention import _cpu_kernel
from jax_attention._canonical import Call, Operands, float0
from jax_attention._fused import bthd


def fits(q: Array, *, mask: Array | None = None, bias: Array | None = None, segments: Array | None = None,
         offset: int | Array = 0) -> str | None:
    """Why the kernel cannot compute a call whatever the machine (None: it can): it takes
    float32, bfloat16 or float16 inputs (computed in float32), no dense mask, bias or
    segment ids, and one query offset for every example; causal, window, ``kv_lengths``
    and grouped heads are its own."""
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"the CPU kernel takes float32, bfloat16 or float16, not {dtype_name(q.dtype)}"
    if mask is not None or bias is not None or segments is not None:
        return "the CPU kernel takes no dense mask, bias or segment ids"
    if not isinstance(offset, int):
        return "the CPU kernel takes one query offset for every example"
    return None


def declines(q: Array, *, mask: Array | None = None, bias: Array | None = None, segments: Array | None = None,
             offset: int | Array = 0, implementation: str = "fused", few_rows: bool = False) -> str | None:
    """Why ``implementation`` (``"fused"`` or ``"auto"``) does not run the kernel for a
    call on XLA's CPU backend (None: it does), asked without building it: the call
    (``fits``), then the machine: a kernel known not to be had (turned off, or a build
    that failed), and for ``"auto"`` its decision: ``$TWIN_ATTENTION_CPU_AUTO`` or the
    measurement cached for this build (``_cpu_kernel.auto_would_decline``; ``few_rows``:
    the decision for the forward for few rows)."""
    why = fits(q, mask=mask, bias=bias, segments=segments, offset=offset)
    if why is not None:
        return why
    if implementation == "auto":
        return _cpu_kernel.auto_would_decline(few_rows)
    missing = _cpu_kernel.known_unavailable()
    return None if missing is None else f"the CPU kernel is not available: {missing}"


def cpu_kernel_supports(q: Array, *, mask: Array | None = None, bias: Array | None = None,
                        segments: Array | None = None, offset: int | Array = 0,
                        implementation: str = "fused", few_rows: bool = False) -> bool:
    """Whether ``implementation`` (``"fused"`` or ``"auto"``) runs the library's CPU
    kernel (``_cpu_kernel``) for a call, asked without building it: XLA's CPU backend,
    float32, bfloat16 or float16 inputs (computed in float32), no dense mask, bias or
    segment ids, one query offset for every example (causal, window, ``kv_lengths`` and
    grouped heads are the kernel's own), and a kernel not known to be missing (turned
    off, or a build that failed); for ``"auto"`` also a decision that takes the kernel
    (``$TWIN_ATTENTION_CPU_AUTO``, or the measurement cached for this build; none cached
    yet: taken, and the call measures; ``_cpu_kernel.auto_declines()`` says why not),
    told without building or measuring.  Elsewhere the fused path is ``jax.nn.dot_product_attention``.  The call
    builds the kernel on first use; where only the kernel itself is missing (a failed
    build) an explicit ``"fused"`` says so with a ``RuntimeWarning``."""
    return jax.default_backend() == "cpu" and declines(
        q, mask=mask, bias=bias, segments=segments, offset=offset, implementation=implementation,
        few_rows=few_rows) is None


def candidate(q: Array, implementation: str, *, mask: Array | None = None, bias: Array | None = None,
              segments: Array | None = None, offset: int | Array = 0) -> bool:
    """Whether a call would run the kernel if it could be had: an explicit ``"fused"``
    on CPU that the kernel ``fits``, or an ``"auto"`` that ``cpu_kernel_supports``."""
    if jax.default_backend() != "cpu" or implementation not in ("fused", "auto"):
        return False
    if implementation == "fused":
        return fits(q, mask=mask, bias=bias, segments=segments, offset=offset) is None
    return cpu_kernel_supports(q, mask=mask, bias=bias, segments=segments, offset=offset, implementation="auto")


def confirm(implementation: str, few_rows: bool = False) -> bool:
    """Whether the kernel runs a call that was routed to it (or, for an explicit
    ``"fused"``, would be): it is built and loaded, building it on its first use, and
    for ``"auto"`` taken by its decision, measured on first use if none is cached
    (``few_rows``: the forward for few rows; ``_cpu_kernel.auto_declines``).  An explicit
    ``"fused"`` that cannot have it says so (``_cpu_kernel.warn_fallback``, naming the
    caller of this function's caller)."""
    if not _cpu_kernel.available():
        if implementation == "fused":
            _cpu_kernel.warn_fallback()
        return False
    return implementation != "auto" or _cpu_kernel.auto_declines(few_rows) is None


class _KernelStatic(NamedTuple):
    """The static part of a CPU-kernel call: query 0 at key position ``offset``; a query
    at p sees keys p - left .. p + right (None: unbounded)."""

    scale: float
    offset: int
    left: int | None
    right: int | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_attention(st: _KernelStatic, q: Array, k: Array, v: Array, ops: Operands) -> Array:
    """float32 q (B, T, H, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv), and ``ops`` holding
    int32 ``lengths`` (B,) and float32 ``sinks`` (H,) or None -> (B, T, H, Dv): the CPU
    kernel, with its FlashAttention backward (the sinks' gradient included)."""
    return _kernel_attention_fwd(st, q, k, v, ops)[0]


def _kernel_attention_fwd(st: _KernelStatic, q: Array, k: Array, v: Array, ops: Operands) -> tuple[Array, Any]:
    out, row_max, row_sum = _cpu_kernel.forward(q, k, v, ops, **st._asdict())
    return out, (q, k, v, ops, out, row_max, row_sum)


def _kernel_attention_bwd(st: _KernelStatic, residuals: Any, d_out: Array) -> tuple[Any, ...]:
    q, k, v, ops, out, row_max, row_sum = residuals
    dq, dk, dv, dsinks = _cpu_kernel.backward(q, k, v, ops, out, d_out, row_max, row_sum, **st._asdict())
    return dq, dk, dv, _cotangent(ops, dsinks)


def _cotangent(ops: Operands, dsinks: Array) -> Operands:
    """The cotangent of the kernel's operands: none for the lengths, the kernel's
    ``dsinks`` for sinks (none without)."""
    return Operands(lengths=float0(ops.lengths), sinks=None if ops.sinks is None else dsinks)


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _few_rows_attention(st: _KernelStatic, q: Array, k: Array, v: Array, ops: Operands, heads_first: bool) -> Array:
    """``_kernel_attention`` for few query rows (``_cpu_kernel.decode_forward``): keys and
    values read where they lie, in either layout (``heads_first``: q (B, H, T, D), k and v
    (B, Hkv, S, D), the output (B, H, T, Dv)); the gradient is the kernel's backward."""
    return _few_rows_fwd(st, q, k, v, ops, heads_first)[0]


def _few_rows_fwd(st: _KernelStatic, q: Array, k: Array, v: Array, ops: Operands,
                  heads_first: bool) -> tuple[Array, Any]:
    out, row_max, row_sum = _cpu_kernel.decode_forward(q, k, v, ops, heads_first=heads_first, **st._asdict())
    return out, (q, k, v, ops, out, row_max, row_sum)


def _few_rows_bwd(st: _KernelStatic, heads_first: bool, residuals: Any, d_out: Array) -> tuple[Any, ...]:
    # The backward takes tokens before heads: heads-first operands swap in and out.
    swap = (lambda t: jnp.swapaxes(t, 1, 2)) if heads_first else (lambda t: t)
    q, k, v, ops, out, row_max, row_sum = residuals
    dq, dk, dv, dsinks = _cpu_kernel.backward(swap(q), swap(k), swap(v), ops, swap(out), swap(d_out), row_max,
                                              row_sum, **st._asdict())
    return swap(dq), swap(dk), swap(dv), _cotangent(ops, dsinks)


_few_rows_attention.defvjp(_few_rows_fwd, _few_rows_bwd)


def attend(q: Array, k: Array, v: Array, call: Call, *, scale: float, few_rows: bool = False) -> Array:
    """The fused path on CPU: the library's kernel on (..., H, T, D) inputs, or (..., T, H,
    D) ones with the call's ``layout="bshd"`` (leading dimensions flattened into one batch), in
    float32, the output in v's dtype and in the inputs' layout.  Causal,
    window, the call's (static) query offset and its lengths stay structural: hidden tiles are skipped, a query that sees no
    key gets a zero row, and keys past a length are never read.  ``sinks`` (H,) join each
    row's normaliser in the kernel (in float32; their gradient in their own dtype).

    The kernel takes tokens before heads, (B, T, H, D): a module's head split (a
    transpose to (B, H, T, D)) and the transpose back here cancel under jit, so the
    projections feed the kernel with no copy in between; ``"bshd"`` inputs are passed
    through as they are, eagerly too.

    ``few_rows`` (``functional.route``'s ``"cpu-decode"``: at most ``FEW_QUERY_ROWS``
    query rows) runs the kernel's forward for few rows, on either layout as it is: keys
    and values are read where they lie and none past a length, so a decode step over a
    cache costs what its filled part costs."""
    options, kv_lengths, sinks = call.options, call.kv_lengths, call.sinks
    tokens_first = options.layout == "bshd"
    batch, kv_len = math.prod(q.shape[:-3]), k.shape[-3 if tokens_first else -2]
    lengths = jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    left, right = reach(options)
    st = _KernelStatic(scale, cast(int, call.offset), left, right)
    ops = Operands(lengths=lengths, sinks=None if sinks is None else sinks.astype(jnp.float32))
    if few_rows:
        q4, k4, v4 = (t.reshape(batch, *t.shape[-3:]).astype(jnp.float32) for t in (q, k, v))
        out = _few_rows_attention(st, q4, k4, v4, ops, not tokens_first)
        return out.reshape(*q.shape[:-1], v.shape[-1]).astype(v.dtype)
    if tokens_first:  # already (..., T, H, D): only the leading dimensions are flattened
        q4, k4, v4 = (t.reshape(batch, *t.shape[-3:]).astype(jnp.float32) for t in (q, k, v))
    else:
        q4, k4, v4 = (bthd(t, batch).astype(jnp.float32) for t in (q, k, v))
    out = _kernel_attention(st, q4, k4, v4, ops)  # (B, T, H, Dv)
    if not tokens_first:
        out = jnp.swapaxes(out, 1, 2)
    return out.reshape(*q.shape[:-1], v.shape[-1]).astype(v.dtype)
