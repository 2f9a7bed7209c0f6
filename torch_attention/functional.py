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

import functools
from collections.abc import Callable
from typing import Any, cast

from torch import Tensor

from attention_spec.flex import flex_call_options
from attention_spec.flex import flex_route as flex_route_of
from attention_spec.mods import and_masks as and_masks
from attention_spec.mods import or_masks as or_masks
from attention_spec.options import KEYWORD_FIELDS, call_options
from attention_spec.rope import RopeConfig as RopeConfig
from attention_spec.routing import PathEntry, Route, walk
from torch_attention import _flex, _paths
from torch_attention._blockwise import default_block_size as default_block_size
from torch_attention._cache_data import KVCache as KVCache
from torch_attention._cache_data import append_to_cache as append_to_cache
from torch_attention._cache_data import cache_fields as cache_fields
from torch_attention._canonical import Call as Call
from torch_attention._canonical import assemble as assemble
from torch_attention._canonical import canonical_bias as canonical_bias
from torch_attention._canonical import canonical_kv_lengths as canonical_kv_lengths
from torch_attention._canonical import canonical_mask as canonical_mask
from torch_attention._canonical import canonical_q_offset as canonical_q_offset
from torch_attention._canonical import canonical_segments as canonical_segments
from torch_attention._canonical import canonicalise as canonicalise
from torch_attention._canonical import heads_first
from torch_attention._delta import gated_delta_rule as gated_delta_rule
from torch_attention._flex import BlockMask as BlockMask
from torch_attention._flex import create_block_mask as create_block_mask
from torch_attention._linear import linear as linear
from torch_attention._linear import project as project
from torch_attention._paths import FUSED_DRAWS_DROPOUT as FUSED_DRAWS_DROPOUT
from torch_attention._reference import attention_scores as attention_scores
from torch_attention._reference import attention_weights as attention_weights
from torch_attention._reference import dropout_weights as dropout_weights
from torch_attention._reference import normalize_scores as normalize_scores
from torch_attention._reference import resolve_scale as resolve_scale
from torch_attention._rope import apply_rope as apply_rope

__all__ = [
    "BlockMask",
    "RopeConfig",
    "and_masks",
    "apply_rope",
    "attention_scores",
    "attention_weights",
    "canonical_bias",
    "canonical_kv_lengths",
    "canonical_mask",
    "create_block_mask",
    "default_block_size",
    "dot_product_attention",
    "dropout_weights",
    "flex_attention",
    "flex_route",
    "gated_delta_rule",
    "linear",
    "normalize_scores",
    "or_masks",
    "resolve_scale",
    "route",
]

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
    chunk: int | None = None,
    alignment: str = "top_left",
    q_offset: Any = None,
    segment_ids: Any = None,
    kv_segment_ids: Any = None,
    sinks: Tensor | None = None,
    layout: str = "bhsd",
    chunk_origin: Any = None,
) -> Route:
    """The route ``dot_product_attention`` takes for this call: ``Route(path, kernel,
    reasons)``, with path ``"reference"``, ``"fused"`` or ``"blockwise"``, kernel
    ``"reference"``, ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"blockwise"``,
    and for ``"auto"`` why each faster path was passed by (``Route.explain()`` prints it).

    Checks the call exactly as ``dot_product_attention`` does (the same errors) and
    computes nothing.  The JAX twin's ``route`` likewise takes its ``dot_product_attention``'s
    arguments.
    """
    call = _checked(locals())
    return _walk(*heads_first(q, k, v, layout), call)[1]


def _checked(given: dict[str, Any]) -> Call:
    """The checked call of ``route``'s or ``dot_product_attention``'s arguments (their
    ``locals()``, the same keywords): the options made and checked once
    (``call_options``), then q, k, v and the tensors against them (``canonicalise``)."""
    options = call_options(**{name: given[name] for name in KEYWORD_FIELDS})
    return canonicalise(given["q"], given["k"], given["v"], options, **{name: given[name] for name in _ARRAYS})


# dot_product_attention's keywords that are tensors (or lists or NumPy arrays of values).
_ARRAYS = ("mask", "bias", "kv_lengths", "dropout_mask", "q_offset", "segment_ids", "kv_segment_ids", "sinks",
           "chunk_origin")


def route_of(q: Tensor, k: Tensor, v: Tensor, call: Call) -> Route:
    """``route`` of a call already checked (``canonicalise``, or a module's ``assemble``):
    q, k and v in the call's layout, read for their shapes and dtypes."""
    return _walk(*heads_first(q, k, v, call.options.layout), call)[1]


def _walk(q: Tensor, k: Tensor, v: Tensor, call: Call) -> tuple[PathEntry, Route]:
    """The row of the table of paths (``_paths.TABLE``) that computes a checked call (q,
    k and v (..., H, S, D)), and its route."""
    entry, reasons = walk(_paths.TABLE, q, k, v, call)
    return entry, Route(entry.path, entry.kernel(q, k, v, call), reasons)


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
    chunk: int | None = None,
    alignment: str = "top_left",
    q_offset: Any = None,
    segment_ids: Any = None,
    kv_segment_ids: Any = None,
    sinks: Tensor | None = None,
    layout: str = "bhsd",
    chunk_origin: Any = None,
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
      chunk: chunked local attention (Llama 4's ``attention_chunk_size``): the query at
        key position p attends only to keys j with ``(j - o) // chunk == (p - o) // chunk``,
        o the example's ``chunk_origin``, on top of ``causal``, ``window`` and the masks.
        See ``check_chunk``.
      chunk_origin: where the chunks start counting, the key position of each example's
        token 0 (a left-padded row's first real token, as ``transformers`` counts Llama
        4's chunks): an int or integers of shape (B,); None (0) by default.  Needs
        ``chunk``, and q of shape (B, H, T, D) for an array.  An origin that differs per
        example makes the chunks a dense mask on every path (the blockwise path still
        skips the blocks beyond ``chunk - 1`` keys of each query).
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
    return attend(q, k, v, _checked(locals()))


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Callable[..., Any] | None = None,
                   block_mask: _flex.BlockMask | None = None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, *, sinks: Tensor | None = None, dropout_rate: float = 0.0,
                   training: bool = False, dropout_mask: Any = None,
                   generator: Any = None) -> Tensor | tuple[Tensor, Tensor]:
    """PyTorch's ``flex_attention`` (``_flex.flex_attention``: score and mask mods, block
    masks, forward and backward; on the CPU too), with what PyTorch's lacks: ``sinks``
    (Hq,) and dropout on the weights (``dropout_rate``, ``training``, an explicit keep-mask
    ``dropout_mask`` or ``generator``; see ``_flex.flex_attention``).  A call whose mods are all library mods that
    stand for named options (``attention_spec.mods``: ``causal``, ``sliding_window``,
    ``softcap``, ``documents`` and their ``and_masks`` / ``chain``), without
    ``return_lse`` or drawn dropout, is that call of ``dot_product_attention`` (sinks and a
    keep-mask passed on) and runs there, on the
    fastest path that honours the options; any other runs on the flex path.
    ``flex_route`` says which, and why.  Every check is the flex path's, made first."""
    given = {"sinks": sinks, "dropout_rate": dropout_rate, "training": training, "dropout_mask": dropout_mask,
             "generator": generator}
    options, _ = flex_call_options(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                   extras=functools.partial(_flex.extras, query, key, **given))
    if options is None:
        return _flex.flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, **given)
    return cast(Tensor, dot_product_attention(query, key, value, scale=scale, **options))


def flex_route(query: Tensor, key: Tensor, value: Tensor, score_mod: Callable[..., Any] | None = None,
               block_mask: _flex.BlockMask | None = None, scale: float | None = None, enable_gqa: bool = False,
               return_lse: bool = False, *, sinks: Tensor | None = None, dropout_rate: float = 0.0,
               training: bool = False, dropout_mask: Any = None, generator: Any = None) -> Route:
    """Which path ``flex_attention`` takes for these arguments, and why: where its mods
    stand for named options, ``route``'s answer for them, its reasons led by the options
    (``"flex: the mods stand for causal=True, softcap=30.0"``); else ``("flex",
    "flex-blocks", (why not,))``, the flex path (query blocks over the key blocks the
    block mask keeps).  Raises what ``flex_attention`` raises for bad arguments."""
    given = {"sinks": sinks, "dropout_rate": dropout_rate, "training": training, "dropout_mask": dropout_mask,
             "generator": generator}
    options, why = flex_call_options(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                     extras=functools.partial(_flex.extras, query, key, **given))
    return flex_route_of(options, why, functools.partial(route, query, key, value, scale=scale))


def attend(q: Tensor, k: Tensor, v: Tensor, call: Call) -> Tensor | tuple[Tensor, Tensor]:
    """``dot_product_attention`` of a call already checked (``call``: its options and
    canonical tensors, from ``canonicalise``), q, k and v in the call's layout: the row
    of the table of paths that ``route`` names, run.  A call kept by a caller serves q,
    k and v of the shapes and dtypes it was made for, kv_len aside where nothing of it
    depends on it (no mask, bias, kv_lengths or segments, and a query offset that is not
    bottom-right aligned)."""
    layout = call.options.layout
    q, k, v = heads_first(q, k, v, layout)
    entry, _ = _walk(q, k, v, call)
    result = entry.run(q, k, v, call, scale=resolve_scale(call.options.scale, q.shape[-1]))
    if layout == "bhsd":
        return result
    if isinstance(result, tuple):  # the weights stay (..., H, T, S)
        return result[0].transpose(-3, -2), result[1]
    return result.transpose(-3, -2)

