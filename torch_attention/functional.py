"""The attention math, once, for PyTorch.  ``jax_attention/functional.py`` is its twin.

Dimension legend (the same names on both sides):
  B: batch          H: heads          T / q_len: queries      S / kv_len: keys and values
  D: head_dim (query/key width)       Dv: value width

Masks are bool, ``True`` = may attend, broadcastable to ``(B, H, T, S)`` (or to the
leading dimensions that ``q`` has).  A query row that may attend to nothing gets zero
weights and a zero output, never NaN, with finite gradients.

Precision: the scores are formed, scaled, masked and normalised, and the weights mix the
values, in float32 for float16/bfloat16 inputs (q, k and v are upcast, so a logit beyond
the half-precision range stays finite and the output is rounded once; float64 stays
float64); returned weights are cast to the input dtype.  Whether a row has anything to
attend to is decided from the mask, never from an infinite row maximum.

Masks and lengths are canonicalised once (``canonical_mask``, ``canonical_kv_lengths``)
before any path runs, and keys and values at key positions that no query may attend to
(past ``kv_lengths``, or blocked for every query) are replaced by zeros with ``where``:
a NaN or Inf stored there never reaches an output or a gradient.

This module holds the public functions and ``route``; each path lives in its own private
module (``_reference``: the explicit math; ``_fused``: SDPA; ``_blockwise``; ``_canonical``:
masks, lengths, offsets, segments and the keys each query sees; ``_cache``; ``_linear``),
whose public names are re-exported here.  ``dot_product_attention`` checks and plans a
call once (``_plan``), takes the route that ``route`` reports, then runs that path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from attention_spec import (
    check_dropout_mask,
    check_dropout_rate,
    check_mask_strategy,
    check_normalization,
    check_qkv,
    check_scale,
    dtype_name,
)
from attention_spec.arrays import check_sinks, host_array
from attention_spec.masks import kv_lengths_rank_message
from attention_spec.options import check_alignment, check_qkv_in_layout, check_softcap, check_window
from attention_spec.planning import fused_blockers
from attention_spec.rope import RopeConfig as RopeConfig
from attention_spec.routing import Route, resolve_route
from torch_attention._blockwise import _blockwise
from torch_attention._blockwise import default_block_size as default_block_size
from torch_attention._cache import KVCache as KVCache
from torch_attention._cache import append_to_cache as append_to_cache
from torch_attention._cache import cache_fields as cache_fields
from torch_attention._canonical import (
    _band,
    _bias_allows,
    _length_mask,
    _live_keys,
    canonical_bias,
    canonical_kv_lengths,
    canonical_mask,
    canonical_q_offset,
    canonical_segments,
)
from torch_attention._fused import FUSED_DRAWS_DROPOUT, _fused
from torch_attention._linear import linear as linear
from torch_attention._reference import attention_scores as attention_scores
from torch_attention._reference import attention_weights, dropout_weights, resolve_scale
from torch_attention._reference import normalize_scores as normalize_scores
from torch_attention._rope import apply_rope as apply_rope
from torch_attention.masks import _and_masks as combine_masks

__all__ = [
    "RopeConfig",
    "apply_rope",
    "attention_scores",
    "attention_weights",
    "canonical_bias",
    "canonical_kv_lengths",
    "canonical_mask",
    "default_block_size",
    "dot_product_attention",
    "dropout_weights",
    "linear",
    "normalize_scores",
    "resolve_scale",
    "route",
]

# The paths in PyTorch's order of preference for "auto" (SDPA is its fast path on every
# device, on CPU a fused blockwise kernel), and what runs each.
PREFERENCE = ("fused", "blockwise")
KERNELS = {"reference": "reference", "fused": "sdpa", "blockwise": "blockwise"}


class _Plan(NamedTuple):
    """A call checked and in canonical form, and its route."""

    mask: Tensor | None
    bias: Tensor | None
    softcap: float | None
    kv_lengths: Tensor | None
    window: tuple[int | None, int | None] | None
    offset: int | Tensor
    segments: Tensor | None
    sinks: Tensor | None
    route: Route
    dropout_mask: Tensor | None = None  # on q's device (given as a list or NumPy array: checked as given)


def route(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    kv_lengths: Any = None,
    scale: float | None = None,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    dropout_rate: float = 0.0,
    dropout_mask: Any = None,
    training: bool = False,
    return_weights: bool = False,
    implementation: str = "auto",
    bias: Tensor | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    alignment: str = "top_left",
    q_offset: Any = None,
    segment_ids: Any = None,
    kv_segment_ids: Any = None,
    sinks: Tensor | None = None,
    layout: str = "bhsd",
) -> Route:
    """The route ``dot_product_attention`` takes for this call: ``Route(path, kernel,
    reasons)``, with path ``"reference"``, ``"fused"`` or ``"blockwise"``, kernel
    ``"reference"``, ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"blockwise"``,
    and for ``"auto"`` why each faster path was passed by (``Route.explain()`` prints it).

    Checks the call exactly as ``dot_product_attention`` does (the same errors) and
    computes nothing.  The JAX twin's ``route`` likewise takes its ``dot_product_attention``'s
    arguments.
    """
    del causal  # (the same keywords as dot_product_attention: causal changes no route)
    q, k, v = _heads_first(q, k, v, layout)
    return _plan(
        q, k, v, mask=mask, kv_lengths=kv_lengths, scale=scale, mask_strategy=mask_strategy,
        normalization=normalization, dropout_rate=dropout_rate, dropout_mask=dropout_mask, training=training,
        return_weights=return_weights, implementation=implementation, bias=bias, softcap=softcap,
        window=window, alignment=alignment, q_offset=q_offset, segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids, sinks=sinks,
    ).route


def _heads_first(q: Tensor, k: Tensor, v: Tensor, layout: str) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v checked in ``layout`` (``check_qkv_in_layout``; the layout first) and
    returned as (..., H, S, D): themselves for ``"bhsd"``, transposed views (no copy) for
    ``"bshd"``."""
    check_qkv_in_layout(q.shape, k.shape, v.shape, (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype)),
                        layout)
    if layout == "bhsd":
        return q, k, v
    return q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)


def _plan(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Any, kv_lengths: Any, scale: float | None, mask_strategy: str,
    normalization: str, dropout_rate: float, dropout_mask: Any, training: bool, return_weights: bool,
    implementation: str, bias: Any, softcap: float | None, window: Any, alignment: str, q_offset: Any,
    segment_ids: Any, kv_segment_ids: Any, sinks: Any,
) -> _Plan:
    """Every check of a call, in order, before any computation; its options in canonical
    form; and its route."""
    check_qkv(q.shape, k.shape, v.shape, (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype)))
    weights_shape = (*q.shape[:-1], k.shape[-2])
    mask = canonical_mask(mask, weights_shape)
    bias = canonical_bias(bias, weights_shape)
    softcap = check_softcap(softcap)
    if kv_lengths is not None:
        if q.dim() != 4:
            raise ValueError(kv_lengths_rank_message(q.shape))
        lengths = canonical_kv_lengths(kv_lengths, q.shape[0], k.shape[-2])
        assert lengths is not None  # kv_lengths is not None
        kv_lengths = lengths.to(q.device)
    check_dropout_rate(dropout_rate)
    if dropout_mask is not None:
        if not isinstance(dropout_mask, Tensor):
            dropout_mask = host_array("dropout_mask", dropout_mask)
        check_dropout_mask(
            dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape, training=training,
            rate=dropout_rate,
        )
        dropout_mask = torch.as_tensor(dropout_mask, device=q.device)
    check_scale(scale)
    check_mask_strategy(mask_strategy)
    check_normalization(normalization)
    if sinks is not None:
        sinks = sinks if isinstance(sinks, Tensor) else torch.as_tensor(sinks)
        check_sinks(tuple(sinks.shape), dtype_name(sinks.dtype), tuple(q.shape), normalization)
        sinks = sinks.to(q.device)
    window = check_window(window)
    offset = canonical_q_offset(q_offset, check_alignment(alignment), q.shape, k.shape[-2], q.device)
    segments = canonical_segments(segment_ids, kv_segment_ids, q.shape, k.shape[-2], q.device)
    path, reasons = resolve_route(
        implementation,
        preference=PREFERENCE,
        return_weights=return_weights,
        normalization=normalization,
        dropout_active=training and dropout_rate > 0.0,
        dropout_mask_given=dropout_mask is not None,
        fused_draws_dropout=FUSED_DRAWS_DROPOUT,
        fused_blockers=fused_blockers(q.dtype == torch.float64, softcap, sinks=sinks is not None),
    )
    route_taken = Route(path, KERNELS[path], reasons)
    return _Plan(mask, bias, softcap, kv_lengths, window, offset, segments, sinks, route_taken, dropout_mask)


def dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    kv_lengths: Any = None,
    scale: float | None = None,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    dropout_rate: float = 0.0,
    dropout_mask: Any = None,
    training: bool = False,
    return_weights: bool = False,
    implementation: str = "auto",
    bias: Tensor | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    alignment: str = "top_left",
    q_offset: Any = None,
    segment_ids: Any = None,
    kv_segment_ids: Any = None,
    sinks: Tensor | None = None,
    layout: str = "bhsd",
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over q (..., H, T, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv) -> (..., H, T, Dv),
    or, with ``layout="bshd"``, over q (..., T, H, D), k (..., S, Hkv, D), v (..., S, Hkv, Dv)
    -> (..., T, H, Dv).

    Args:
      mask: bool, True = may attend, broadcastable to (..., T, S); 0-d and 1-d included.
      causal: also block keys after the query (top-left aligned ``tril``).
      kv_lengths: the number of valid keys per example (padding given as lengths): an
        int, a list of ints or an integer array of shape () or (B,), each in [0, S]; see
        ``canonical_kv_lengths``.  Needs q of shape (B, H, T, D).
      scale: None = 1/sqrt(D); a float as given.
      mask_strategy: "fill" or "renormalize", equal in exact arithmetic and computed
        alike (stably) on every path; see ``normalize_scores``.
      dropout_rate, training, dropout_mask: dropout on the weights, see ``dropout_weights``;
        ``dropout_mask`` a bool tensor, or a list or NumPy array (checked as given, then
        made a tensor on q's device).
      return_weights: also return the weights that mixed the values (after dropout).
      bias: float, broadcastable to (..., T, S), added to the scores (after scaling and
        soft-capping, before masking; differentiable).  A blocked key stays blocked, and
        a ``-inf`` entry blocks its key as a mask does: weight 0, zeros for a row that is
        ``-inf`` (or masked) throughout, finite gradients (zero for the ``-inf`` entries).
      softcap: None (off) or c > 0: the scaled scores become ``c * tanh(s / c)`` before
        the bias and the mask (Gemma 2's order).  The fused path refuses it (SDPA has no
        soft-capping); ``"auto"`` then takes a path that honours it.
      sinks: attention sinks (gpt-oss): float, shape (H,), one logit per query head (with
        grouped heads still per query head), in the units of the final scores (after the
        scale, the soft-cap and the bias), added to each softmax's denominator as a key
        with no value: w_j = exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m)), so a
        row sums to less than 1 (``return_weights`` returns these key weights; dropout
        acts on them).  A row that sees no key stays zeros.  Cast to the compute dtype;
        differentiable.  Softmax only (``normalization="sum"`` is refused).  The fused
        path refuses them (SDPA has no sinks); ``"auto"`` then takes a path that
        honours them.
      window: ``(left, right)``, inclusive: the query at key position p attends to keys
        p - left .. p + right; None on a side is unbounded (with ``causal`` the right
        side is at most 0).  See ``check_window``.
      alignment: where query 0 sits among the keys for ``causal`` and ``window``:
        ``"top_left"`` (key 0) or ``"bottom_right"`` (key S - T: the last query sees
        the last key, as when decoding after S - T cached keys).
      q_offset: the key position of query 0, an int or integers of shape (B,) (a KV
        cache's per-example fill); replaces ``alignment``.
      segment_ids, kv_segment_ids: integers (B, T) and (B, S): packed sequences, a token
        attends only to keys of its own segment id; ``kv_segment_ids`` defaults to
        ``segment_ids`` when T == S.  Need q of shape (B, H, T, D).
      Grouped-query attention: k and v may have Hkv heads where Hkv divides H; query
        head h reads key/value head h // (H // Hkv).  The fused path hands the grouped
        heads to SDPA (``enable_gqa=True``); the others repeat them.
      implementation: ``"reference"`` (the explicit math), ``"fused"``
        (``F.scaled_dot_product_attention``, which also draws dropout; refuses float64
        like its JAX twin, whose kernel computes in float32, although SDPA is exact in
        float64 on CPU: one behaviour for both frameworks), ``"blockwise"`` (query
        blocks that skip the keys a causal mask hides; never materialises T x S; the
        twin of JAX's CPU path), or ``"auto"`` (fused, else blockwise, else the reference
        where those cannot honour an option; float64 never goes to fused; see
        ``attention_spec.resolve_implementation``).
      layout: ``"bhsd"`` (heads before tokens, above) or ``"bshd"`` (tokens before heads,
        as projections produce them): q, k, v and the output in that layout; every other
        argument keeps its meaning (masks and bias broadcast to (B, H, T, S), sinks (H,),
        ...) and returned weights are (..., H, T, S) in both.  Every path reads
        ``"bshd"`` through transposed views (no copy made here; SDPA takes strided inputs).

    Keys and values at positions that no query may attend to are zeroed with ``where``
    before any product: whatever is stored there (NaN included) reaches no output and
    gets a zero gradient.

    Raises:
      ValueError / TypeError: inconsistent shapes or dtypes, a mask that is not bool or
        does not broadcast, bad ``kv_lengths``, a ``dropout_mask`` while dropout is off
        (eval mode or rate 0), a bad option value, an explicit implementation that cannot
        honour an option; all before any computation.
    """
    q, k, v = _heads_first(q, k, v, layout)
    plan = _plan(
        q, k, v, mask=mask, kv_lengths=kv_lengths, scale=scale, mask_strategy=mask_strategy,
        normalization=normalization, dropout_rate=dropout_rate, dropout_mask=dropout_mask, training=training,
        return_weights=return_weights, implementation=implementation, bias=bias, softcap=softcap,
        window=window, alignment=alignment, q_offset=q_offset, segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids, sinks=sinks,
    )
    result = _run_plan(q, k, v, plan, causal=causal, scale=scale, mask_strategy=mask_strategy,
                       normalization=normalization, dropout=(dropout_rate, training, plan.dropout_mask),
                       return_weights=return_weights)
    if layout == "bhsd":
        return result
    if isinstance(result, tuple):  # the weights stay (..., H, T, S)
        return result[0].transpose(-3, -2), result[1]
    return result.transpose(-3, -2)


def _run_plan(
    q: Tensor, k: Tensor, v: Tensor, plan: _Plan, *, causal: bool, scale: float | None, mask_strategy: str,
    normalization: str, dropout: tuple[float, bool, Tensor | None], return_weights: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """The work of a call that ``_plan`` checked and planned, q, k and v heads first: the
    mask's structure, unseen keys zeroed, then the planned path.  ``dropout`` is
    (rate, training, dropout_mask), as given to the plan.  A caller that keeps a plan
    (a module's decode step) gives it the options it was made with, and q, k and v of
    the shapes and dtypes it was made for, kv_len aside where nothing of the plan depends
    on it (no mask, bias, kv_lengths or segments, and a query offset that is not
    bottom-right aligned)."""
    dropout_rate, training, _ = dropout
    if (plan.route.path == "fused" and not causal and plan.mask is None and plan.bias is None and plan.window is None
            and plan.kv_lengths is None and plan.segments is None and isinstance(plan.offset, int)):
        # every query sees every key (a decoded token over the filled prefix): nothing to
        # structure, no key to zero, straight to SDPA
        return _fused(q, k, v, mask=None, causal=False, lengths=None, scale=resolve_scale(scale, q.shape[-1]),
                      dropout_rate=dropout_rate if training else 0.0)
    path, bias, softcap = plan.route.path, plan.bias, plan.softcap
    if bias is not None:
        bias = bias.to(q.device)
    mask, offset, causal, window = _structure(q, k, plan, path, bias, causal)
    lengths = None if plan.kv_lengths is None else _length_mask(plan.kv_lengths, k.shape[-2], q.dim())
    k, v = _without_unseen_keys(q, k, v, mask, causal, lengths, offset, window)
    scale = resolve_scale(scale, q.shape[-1])
    groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
    result: Tensor | tuple[Tensor, Tensor]
    if path == "fused":
        result = _fused(q, k, v, mask=mask, causal=causal, lengths=lengths, scale=scale,
                        dropout_rate=dropout_rate if training else 0.0, bias=bias)
    elif groups > 1:  # the explicit paths repeat each key/value head for its group of queries
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    if path == "blockwise":
        result = _blockwise(q, k, v, mask=mask, causal=causal, lengths=lengths, scale=scale,
                            bias=bias, softcap=softcap, offset=offset, window=window, sinks=plan.sinks)
    elif path == "reference":
        result = _explicit(
            q, k, v, mask=combine_masks(mask, lengths), causal=causal, offset=offset, window=window, scale=scale,
            mask_strategy=mask_strategy, normalization=normalization, bias=bias, softcap=softcap,
            dropout=dropout, return_weights=return_weights, sinks=plan.sinks,
        )
    return result


def _structure(
    q: Tensor, k: Tensor, plan: _Plan, path: str, bias: Tensor | None, causal: bool,
) -> tuple[Tensor | None, int, bool, tuple[int | None, int | None] | None]:
    """(mask, offset, causal, window) for ``path``: a -inf bias (read by the fused path
    from the bias itself), segments, and positions that differ per example join the
    dense mask on every path; a static offset and the window stay structural where the
    path can use them."""
    mask, offset, window = plan.mask, plan.offset, plan.window
    if bias is not None and path != "fused":  # the fused path reads -inf from the bias itself: fewer passes
        mask = combine_masks(mask, _bias_allows(bias))
    if plan.segments is not None:
        mask = combine_masks(mask, plan.segments)
    if not isinstance(offset, int) or (path != "blockwise" and (window is not None or (causal and offset))):
        mask = combine_masks(mask, _band(q.shape[-2], k.shape[-2], offset, causal, window, q.dim(), q.device))
        offset, causal, window = 0, False, None
    return mask, offset, causal, window


def _without_unseen_keys(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, lengths: Tensor | None, offset: int,
    window: tuple[int | None, int | None] | None,
) -> tuple[Tensor, Tensor]:
    """k and v with zeros at the key positions that no query may attend to: whatever is
    stored there (NaN included) reaches no output and gets a zero gradient."""
    live_keys = _live_keys(mask, causal, lengths, q.shape[-2], k.shape[-2], q.device, offset=offset, window=window)
    if live_keys is None:
        return k, v
    groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
    if groups > 1 and live_keys.dim() >= 3 and live_keys.shape[-3] > 1:
        # a key is live if any head of its group sees it
        live_keys = live_keys.unflatten(-3, (-1, groups)).any(dim=-3)
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    return torch.where(live_keys, k, zero), torch.where(live_keys, v, zero)


def _explicit(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, offset: int,
    window: tuple[int | None, int | None] | None, scale: float, mask_strategy: str, normalization: str,
    bias: Tensor | None, softcap: float | None, dropout: tuple[float, bool, Tensor | None], return_weights: bool,
    sinks: Tensor | None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The reference path: the weights (``attention_weights``), dropout, the values mixed."""
    if window is not None or (causal and offset):
        mask = combine_masks(mask, _band(q.shape[-2], k.shape[-2], offset, causal, window, q.dim(), q.device))
        causal = False
    weights = attention_weights(
        q, k, mask=mask, causal=causal, scale=scale,
        mask_strategy=mask_strategy, normalization=normalization, bias=bias, softcap=softcap, sinks=sinks,
    )
    rate, training, dropout_mask = dropout
    weights = dropout_weights(weights, rate, training=training, dropout_mask=dropout_mask)
    # mixed in the compute dtype: half-precision weights would add a rounding per weight
    out = torch.matmul(weights, v.to(weights.dtype)).to(v.dtype)  # (..., T, Dv)
    return (out, weights.to(v.dtype)) if return_weights else out
