"""The plan of one module call, made once before any work: which checks it passes (in the
order that gives every bad call its one error), and whether an explicit ``implementation``
can honour its options.

Both twins' modules ask it; a twin keeps only its array work (converting masks and
lengths, reading values, adding the batch dimension).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

from attention_spec.arrays import (
    Shape,
    check_compute_dtype,
    check_context,
    check_input,
    context_pair,
    dtype_name,
)
from attention_spec.cache import check_cache, check_cache_call, check_cache_context, check_cacheable
from attention_spec.masks import check_dropout_mask, segment_ids_pair
from attention_spec.options import check_implementation
from attention_spec.registry import AttentionConfig
from attention_spec.routing import resolve_implementation

# Why an explicit "fused" refuses float64 (both frameworks, one behaviour): JAX's fused
# attention computes float64 with float32 accuracy; "auto" sends float64 to a path that
# stays float64.
FUSED_FLOAT64_BLOCKER = "float64 inputs (the fused kernel does not guarantee float64 accuracy)"

SOFTCAP_FUSED_BLOCKER = "softcap (the fused kernel has no logit soft-capping)"

SINKS_FUSED_BLOCKER = "sinks (the fused kernel has no attention sinks)"


def fused_blockers(float64: bool, softcap: float | None, sinks: bool = False) -> tuple[str, ...]:
    """What the fused kernels of both twins cannot honour beyond ``resolve_implementation``'s
    common list: float64 inputs (``float64``), soft-capping and attention sinks (``sinks``:
    given; the library's CPU kernel honours them, so the JAX twin passes False for it)."""
    return (
        ((FUSED_FLOAT64_BLOCKER,) if float64 else ())
        + ((SOFTCAP_FUSED_BLOCKER,) if softcap is not None else ())
        + ((SINKS_FUSED_BLOCKER,) if sinks else ())
    )


def check_explicit_path(
    implementation: str,
    *,
    fused_draws_dropout: bool,
    float64: bool,
    softcap: float | None,
    sinks: bool = False,
    return_weights: bool,
    normalization: str,
    dropout_active: bool,
    dropout_mask_given: bool,
) -> None:
    """Raises the ``ValueError`` that ``dot_product_attention`` raises for an explicit
    ``implementation`` that cannot honour these options, from the options alone: a
    module asks it before any work, a cached call before it writes its cache.  (An
    explicit path's refusals do not depend on the preference order of ``"auto"``;
    ``fused_draws_dropout`` is the twin's: SDPA draws it, JAX's fused kernels cannot.)"""
    if implementation in ("auto", "reference"):
        return  # they refuse nothing: "auto" falls back to the reference math
    resolve_implementation(
        implementation, preference=(), return_weights=return_weights, normalization=normalization,
        dropout_active=dropout_active, dropout_mask_given=dropout_mask_given,
        fused_draws_dropout=fused_draws_dropout, fused_blockers=fused_blockers(float64, softcap, sinks),
    )


class CallOps(NamedTuple):
    """A twin's array work that planning a call asks for, each at its place among the
    checks (a twin's ``functional`` provides most of it)."""

    canonical_mask: Callable[[Any, Shape], Any]  # (mask, target) -> checked, 1s up to target's rank
    canonical_bias: Callable[[Any, Shape], Any]  # likewise for an additive bias
    canonical_kv_lengths: Callable[[Any, int, int], Any]  # (lengths, batch, kv_len) -> checked (B,)
    as_array: Callable[[Any], Any]  # segment ids -> the framework's array
    cache_fields: Callable[[Any], Any]  # cache -> each field's (shape, dtype name); None: no cache
    check_cache_room: Callable[[Any, int, int], None]  # (cache, new, max_len): reads the fill
    fused_draws_dropout: bool  # whether the twin's fused kernel draws dropout
    fused_takes_sinks: Callable[[], bool]  # whether the twin's fused path can honour sinks here


class CallPlan(NamedTuple):
    """What one module call will do, once every check has passed.

    batched: whether x has a batch dimension.  implementation: the call's path (the
    module's when the call names none), checked.  batch, seq, kv_seq: B, T and S, the
    keys attended (the context's length, a cache's max_len, else T).  keys, values:
    cross-attention's inputs as given (None: x), checked.  mask, bias: canonical at the
    input's rank (rank 4 for batched x, 3 for unbatched), or None.  kv_lengths: (B,), or
    None.  segment_ids (B, T), kv_segment_ids (B, S), or None.
    """

    batched: bool
    implementation: str
    batch: int
    seq: int
    kv_seq: int
    keys: Any
    values: Any
    mask: Any
    bias: Any
    kv_lengths: Any
    segment_ids: Any
    kv_segment_ids: Any


def plan_call(
    spec: AttentionConfig,
    ops: CallOps,
    x: Any,
    *,
    compute_dtype: str | None,
    training: bool,
    implementation: str | None = None,
    context: Any = None,
    mask: Any = None,
    bias: Any = None,
    dropout_mask: Any = None,
    kv_lengths: Any = None,
    segment_ids: Any = None,
    kv_segment_ids: Any = None,
    cache: Any = None,
    return_weights: bool = False,
) -> CallPlan:
    """Every check of one module call, in one order, before any work: nothing after these
    raises for the call's input, so a refused call never writes its cache or draws.

    ``compute_dtype``: the module's (None: x's).  ``training``: dropout is on for this
    call (PyTorch's ``training``, Flax's ``not deterministic``).  The other arguments are
    the call's, as given.  Raises the TypeError / ValueError of the first check that fails.
    """
    x_dtype = dtype_name(x.dtype)
    batched = check_input(x.shape, x_dtype, d_in=spec.d_in, context_length=spec.context_length)
    check_compute_dtype(x_dtype, compute_dtype)
    implementation = check_implementation(spec.implementation if implementation is None else implementation)
    batch, seq = (x.shape[0] if batched else 1), x.shape[-2]
    keys, values = _checked_context(spec, x, context, compute_dtype or x_dtype)
    kv_seq = seq if keys is None else keys.shape[-2]
    if cache is not None:
        check_cacheable(spec)
        check_cache_call(tuple(x.shape), batched=batched, has_context=context is not None)
        heads, key_width, value_width = spec.cache_widths()  # latent attention's: latent, rope key
        kv_seq = check_cache(ops.cache_fields(cache), batch, heads, key_width, value_width)
        check_cache_context(kv_seq, spec.context_length)
    # Masks are checked against the input's own rank (a 4-d mask for unbatched input is refused).
    weights_shape = (batch, spec.num_heads, seq, kv_seq) if batched else (spec.num_heads, seq, kv_seq)
    mask = ops.canonical_mask(mask, weights_shape)
    bias = ops.canonical_bias(bias, weights_shape)
    if dropout_mask is not None:
        # A variant without dropout has no train/eval distinction for it: its rate is 0.
        check_dropout_mask(
            dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape,
            training=training or not spec.has_dropout, rate=spec.dropout,
        )
    kv_lengths = ops.canonical_kv_lengths(kv_lengths, batch, seq if cache is not None else kv_seq)
    segment_ids, kv_segment_ids = segment_ids_pair(
        segment_ids, kv_segment_ids, batched=batched, batch=batch, seq=seq, kv_seq=kv_seq,
        cached=cache is not None, as_array=ops.as_array,
    )
    if cache is not None:
        ops.check_cache_room(cache, seq, kv_seq)
    # An explicit path that cannot honour the options is refused here, not after the
    # projections (and, with a cache, after the write) inside ``functional``.
    check_explicit_path(
        implementation, fused_draws_dropout=ops.fused_draws_dropout, float64=x_dtype == "float64",
        softcap=spec.softcap, sinks=spec.sinks and not ops.fused_takes_sinks(),
        return_weights=return_weights, normalization=spec.normalization,
        dropout_active=training and spec.dropout > 0.0, dropout_mask_given=dropout_mask is not None,
    )
    return CallPlan(batched, implementation, batch, seq, kv_seq, keys, values, mask, bias, kv_lengths,
                    segment_ids, kv_segment_ids)


def _checked_context(spec: AttentionConfig, x: Any, context: Any, compute_dtype: str) -> tuple[Any, Any]:
    """Cross-attention's (key input, value input), each checked against x and the width of
    its projection (x's own width for a module without projections), or (None, None)."""
    keys, values = context_pair(context)
    for name, t, role in (("context key input", keys, "key"), ("context value input", values, "value")):
        if t is not None:
            width = spec.fan_in(role) if spec.projections() else x.shape[-1]
            check_context(tuple(x.shape), tuple(t.shape), name, cast(int, width))
            check_compute_dtype(dtype_name(t.dtype), compute_dtype, name)
    if keys is not None and values is not None and keys.shape[-2] != values.shape[-2]:
        raise ValueError(
            f"context key and value inputs must have the same length; got {tuple(keys.shape)} and "
            f"{tuple(values.shape)}"
        )
    return keys, values
