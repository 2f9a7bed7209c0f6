"""The plan of one module call, made once before any work: which checks it passes (in the
order that gives every bad call its one error), and whether an explicit ``implementation``
can honour it (asked of the twin's table of paths, on the call's shapes).

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
from attention_spec.flex import fold_named
from attention_spec.masks import check_dropout_mask, segment_ids_pair
from attention_spec.options import CallOptions, check_implementation
from attention_spec.registry import AttentionConfig

# Why an explicit "fused" refuses float64 (both frameworks, one behaviour): JAX's fused
# attention computes float64 with float32 accuracy; "auto" sends float64 to a path that
# stays float64.
FUSED_FLOAT64_BLOCKER = "float64 inputs (the fused kernel does not guarantee float64 accuracy)"

SOFTCAP_FUSED_BLOCKER = "softcap (the fused kernel has no logit soft-capping)"

SINKS_FUSED_BLOCKER = "sinks (the fused kernel has no attention sinks)"


def fused_blockers(options: CallOptions, *, float64: bool, sinks_given: bool) -> tuple[str, ...]:
    """What the fused kernels of both twins cannot honour beyond ``option_blockers``'
    common list: float64 inputs, soft-capping and attention sinks (``sinks_given``: given
    to a kernel that has none; the library's CPU kernel has them)."""
    return (
        ((FUSED_FLOAT64_BLOCKER,) if float64 else ())
        + ((SOFTCAP_FUSED_BLOCKER,) if options.softcap is not None else ())
        + ((SINKS_FUSED_BLOCKER,) if sinks_given else ())
    )


def module_options(
    spec: AttentionConfig, *, training: bool, return_weights: bool, implementation: str,
    causal: bool | None = None, scale: float | None = None, alignment: str | None = None,
) -> CallOptions:
    """The ``CallOptions`` of a module's attention: the spec's options and the call's
    flags (``training``: dropout is on); ``causal``, ``scale`` and ``alignment`` override
    the spec's where given (a cached step aligns its queries at each example's fill)."""
    scoring = spec.scoring
    causal = scoring.causal if causal is None else causal
    softcap, window, score_mod, mask_mod = scoring.softcap, scoring.window, scoring.score_mod, scoring.mask_mod
    if score_mod is not None or mask_mod is not None:  # those that stand for named options are them
        causal, window, softcap, score_mod, mask_mod = fold_named(causal, window, softcap, score_mod, mask_mod)
    return CallOptions(
        causal=causal,
        scale=scoring.scale if scale is None else scale,
        mask_strategy=scoring.mask_strategy,
        normalization=scoring.normalization,
        softcap=softcap,
        window=window,
        chunk=scoring.chunk,
        alignment=scoring.alignment if alignment is None else alignment,
        dropout_rate=scoring.dropout,
        training=training,
        return_weights=return_weights,
        implementation=implementation,
        score_mod=score_mod,
        mask_mod=mask_mod,
    )


class RouteFacts(NamedTuple):
    """What a module call's route depends on beyond its plan: the dtype it computes in,
    whether dropout is on (``training``), whether it returns the weights, its dropout
    mask (or None) and whether it decodes into a cache."""

    dtype: str
    training: bool
    return_weights: bool
    dropout_mask: Any
    cached: bool


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


class CallOps(NamedTuple):
    """A twin's array work that planning a call asks for, each at its place among the
    checks (a twin's ``functional`` provides most of it)."""

    canonical_mask: Callable[[Any, Shape], Any]  # (mask, target) -> checked, 1s up to target's rank
    canonical_bias: Callable[[Any, Shape], Any]  # likewise for an additive bias
    canonical_kv_lengths: Callable[[Any, int, int], Any]  # (lengths, batch, kv_len) -> checked (B,)
    as_array: Callable[[Any], Any]  # segment ids -> the framework's array
    cache_fields: Callable[[Any], Any]  # cache -> each field's (shape, dtype name); None: no cache
    check_cache_room: Callable[[Any, int, int], None]  # (cache, new, max_len): reads the fill
    # (spec, plan, RouteFacts) -> None: raises what the twin's table refuses of an explicit
    # implementation for this call, asked on its shapes (``functional.route_of``)
    check_route: Callable[[AttentionConfig, CallPlan, RouteFacts], None]


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
    plan = CallPlan(batched, implementation, batch, seq, kv_seq, keys, values, mask, bias, kv_lengths,
                    segment_ids, kv_segment_ids)
    if implementation not in ("auto", "reference"):  # they refuse nothing: "auto" falls back to the reference
        # An explicit path that cannot honour the call is refused here, by the twin's
        # table, not after the projections (and, with a cache, after the write).
        ops.check_route(spec, plan, RouteFacts(compute_dtype or x_dtype, training, return_weights, dropout_mask,
                                               cache is not None))
    return plan


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
