"""The attention math, once, for JAX.  ``torch_attention/functional.py`` is its twin.

Dimension legend (the same names on both sides):
  B: batch          H: heads          T / q_len: queries      S / kv_len: keys and values
  D: head_dim (query/key width)       Dv: value width

Masks are bool, ``True`` = may attend, broadcastable to ``(B, H, T, S)`` (or to the
leading dimensions that ``q`` has).  A query row that may attend to nothing gets zero
weights and a zero output, never NaN, with finite gradients.

Precision: matmuls run at ``precision="highest"`` by default (JAX's GPU/TPU default is
lower; PyTorch keeps TF32 off).  The scores are formed, scaled, masked and normalised,
and the weights mix the values, in float32 for float16/bfloat16 inputs (q, k and v are
upcast, so a logit beyond the half-precision range stays finite and the output is
rounded once; float64 stays float64); returned weights are cast to the input dtype.
Whether a row has anything to attend to is decided from the mask, never from an infinite
row maximum.  The softmax exponentiates ``(scores - max) * scale`` with the maximum of the
unscaled scores: XLA on CPU fuses ``scores * scale - max`` into one instruction whose
rounding differs from the maximum's, which turns logits of 1e10 into NaN.

Masks and lengths are canonicalised once (``canonical_mask``, ``canonical_kv_lengths``)
before any path runs, and keys and values at key positions that no query may attend to
(past ``kv_lengths``, or blocked for every query) are replaced by zeros with ``where``:
a NaN or Inf stored there never reaches an output or a gradient.

Everything here is jit-compatible; options are Python values (static under jit).

This module holds the public functions and ``route``, the one place that decides which
path and kernel compute a call; the paths live in private modules: ``_canonical`` (the
checks and canonical forms), ``_reference`` (the explicit math), ``_blockwise`` and
``_tiled`` (query blocks, unrolled and in loops), ``_online_softmax`` (their step,
shared with the ring), ``_fused`` (``jax.nn.dot_product_attention`` and splash),
``_cpu_fused`` (the library's CPU kernel, ``_cpu_kernel``), ``_linear`` and ``_cache``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
from jax import Array

from attention_spec.flex import flex_call_options
from attention_spec.flex import flex_route as flex_route_of
from attention_spec.mods import and_masks as and_masks
from attention_spec.mods import or_masks as or_masks
from attention_spec.options import KEYWORD_FIELDS, call_options
from attention_spec.rope import RopeConfig as RopeConfig
from attention_spec.routing import PathEntry, Route, walk
from jax_attention import _cpu_fused, _flex, _paths
from jax_attention._cache_data import KVCache as KVCache
from jax_attention._cache_data import append_to_cache as append_to_cache
from jax_attention._cache_data import cache_fields as cache_fields
from jax_attention._canonical import Call as Call
from jax_attention._canonical import assemble as assemble
from jax_attention._canonical import canonical_bias as canonical_bias
from jax_attention._canonical import canonical_kv_lengths as canonical_kv_lengths
from jax_attention._canonical import canonical_mask as canonical_mask
from jax_attention._canonical import canonical_q_offset as canonical_q_offset
from jax_attention._canonical import canonical_segments as canonical_segments
from jax_attention._canonical import canonicalise as canonicalise
from jax_attention._canonical import heads_first
from jax_attention._cpu_fused import cpu_kernel_supports as cpu_kernel_supports
from jax_attention._delta import gated_delta_rule as gated_delta_rule
from jax_attention._flex import BlockMask as BlockMask
from jax_attention._flex import create_block_mask as create_block_mask
from jax_attention._fused import cudnn_supports as cudnn_supports
from jax_attention._fused import splash_attention as splash_attention
from jax_attention._fused import splash_supports as splash_supports
from jax_attention._linear import linear as linear
from jax_attention._linear import project as project
from jax_attention._paths import FEW_QUERY_ROWS as FEW_QUERY_ROWS
from jax_attention._paths import FUSED_DRAWS_DROPOUT as FUSED_DRAWS_DROPOUT
from jax_attention._paths import default_block_size as default_block_size
from jax_attention._reference import Precision
from jax_attention._reference import attention_scores as attention_scores
from jax_attention._reference import attention_weights as attention_weights
from jax_attention._reference import dropout_weights as dropout_weights
from jax_attention._reference import normalize_scores as normalize_scores
from jax_attention._reference import resolve_scale as resolve_scale
from jax_attention._rope import apply_rope as apply_rope

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
    "cpu_kernel_supports",
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

# The kernels that read no key past ``kv_lengths``: a call on them costs what the keys
# up to each example's length cost, however long its buffers (a cache's max_len).
READS_TO_LENGTHS = ("cpu-decode",)


def route(
    q: Array | jax.ShapeDtypeStruct, k: Array | jax.ShapeDtypeStruct, v: Array | jax.ShapeDtypeStruct, *, mask: Array | None = None, causal: bool = False, kv_lengths: Any = None,
    scale: float | None = None, mask_strategy: str = "fill", normalization: str = "softmax",
    dropout_rate: float = 0.0, dropout_mask: Any = None, deterministic: bool = True,
    rng: Array | None = None, return_weights: bool = False, implementation: str = "auto",
    precision: Precision = "highest", bias: Array | None = None, softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None, chunk: int | None = None, alignment: str = "top_left",
    q_offset: Any = None,
    segment_ids: Any = None, kv_segment_ids: Any = None, sinks: Array | None = None, layout: str = "bhsd",
    chunk_origin: Any = None,
) -> Route:
    """The route ``dot_product_attention`` takes for these arguments (the same keywords):
    ``Route(path, kernel, reasons)``, the path (``"reference"``, ``"fused"`` or
    ``"blockwise"``), the kernel that runs it here (``"reference"``; ``"blockwise"``,
    the unrolled query blocks, or ``"blockwise-tiled"``, the loops from
    ``_paths.LONG_SEQUENCE`` keys on; ``"cpu-kernel"``, the library's CPU kernel, and
    ``"cpu-decode"``, its forward for at most ``FEW_QUERY_ROWS`` query rows;
    ``"xla"``, ``"cudnn"`` or ``"splash"``, ``jax.nn.dot_product_attention``'s
    kernels and Pallas splash attention) and, for ``"auto"``, why each faster path was
    passed by (``Route.explain()`` prints them).

    q, k and v are read for their shapes and dtypes only: ``jax.ShapeDtypeStruct`` will
    do.  The arguments are checked as the call checks them (the same errors, before any
    work), and nothing is built: the CPU kernel's answer comes from what is known of
    it (turned off, a failed build, the instruction set its build targets).  The call
    builds the kernel on first use; should that build fail, the call falls back as the
    route of a machine without the kernel (``"auto"``: blockwise; ``"fused"``: XLA's
    kernel, with a ``RuntimeWarning``)."""
    return route_of(q, k, v, _checked(locals()))


def _checked(given: dict[str, Any]) -> Call:
    """The checked call of ``route``'s or ``dot_product_attention``'s arguments (their
    ``locals()``, the same keywords): the options made and checked once
    (``call_options``), then q, k, v and the arrays against them (``canonicalise``)."""
    arrays = {name: given[name] for name in _ARRAYS}
    options = call_options(**{name: given[name] for name in _OPTIONS}, training=not given["deterministic"])
    return canonicalise(given["q"], given["k"], given["v"], options, **arrays)


# dot_product_attention's keywords by where they go: the options, the arrays (rng and
# precision go to the run).
_OPTIONS = tuple(name for name in KEYWORD_FIELDS if name != "training")
_ARRAYS = ("mask", "bias", "kv_lengths", "dropout_mask", "q_offset", "segment_ids", "kv_segment_ids", "sinks",
           "chunk_origin")


def route_of(q: Array | jax.ShapeDtypeStruct, k: Array | jax.ShapeDtypeStruct, v: Array | jax.ShapeDtypeStruct,
             call: Call) -> Route:
    """``route`` of a call already checked (``canonicalise``, or a module's ``assemble``):
    q, k and v in the call's layout, read for their shapes and dtypes."""
    shaped = heads_first(q, k, v, call.options.layout)
    entry, chosen = _walk(*shaped, call)
    if call.options.implementation != "auto":
        return chosen
    table = _paths.table()
    consulted = table[: table.index(entry) + 1]  # (a measurement decides only between rows it reached)
    basis = "; ".join(b for row in consulted if row.auto and row.basis and (b := row.basis(*shaped, call)))
    return Route(*chosen, basis=basis)


def _walk(q: Any, k: Any, v: Any, call: Call) -> tuple[PathEntry, Route]:
    """The row of this backend's table of paths (``_paths.table``) that computes a
    checked call (q, k and v (..., H, S, D), read for their shapes), and its route."""
    entry, reasons = walk(_paths.table(), q, k, v, call)
    return entry, Route(entry.path, entry.kernel(q, k, v, call), reasons)


def dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Array | None = None,
    causal: bool = False,
    kv_lengths: Any = None,
    scale: float | None = None,
    mask_strategy: str = "fill",
    normalization: str = "softmax",
    dropout_rate: float = 0.0,
    dropout_mask: Any = None,
    deterministic: bool = True,
    rng: Array | None = None,
    return_weights: bool = False,
    implementation: str = "auto",
    precision: Precision = "highest",
    bias: Array | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    chunk: int | None = None,
    alignment: str = "top_left",
    q_offset: Any = None,
    segment_ids: Any = None,
    kv_segment_ids: Any = None,
    sinks: Array | None = None,
    layout: str = "bhsd",
    chunk_origin: Any = None,
) -> Array | tuple[Array, Array]:
    """Attention over q (..., H, T, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv) -> (..., H, T, Dv),
    or, with ``layout="bshd"``, over q (..., T, H, D), k (..., S, Hkv, D), v (..., S, Hkv, Dv)
    -> (..., T, H, Dv).

    Args:
      mask: bool, True = may attend, broadcastable to (..., T, S); 0-d and 1-d included.
      causal: also block keys after the query (top-left aligned ``tril``).
      kv_lengths: the number of valid keys per example (padding given as lengths, which
        fused kernels take natively): an int, a list of ints or an integer array of shape
        () or (B,), each in [0, S]; see ``canonical_kv_lengths``.  Needs q of shape
        (B, H, T, D).
      scale: None = 1/sqrt(D); a float as given.
      mask_strategy: "fill" or "renormalize", equal in exact arithmetic and computed
        alike (stably) on every path; see ``normalize_scores``.
      dropout_rate, deterministic, rng, dropout_mask: dropout on the weights, see
        ``dropout_weights``; ``dropout_mask`` a bool array, or a list or NumPy array
        (checked as given).
      return_weights: also return the weights that mixed the values (after dropout).
      bias: float, broadcastable to (..., T, S), added to the scores (after scaling and
        soft-capping, before masking; differentiable).  A blocked key stays blocked, and
        a ``-inf`` entry blocks its key as a mask does: weight 0, zeros for a row that is
        ``-inf`` (or masked) throughout, finite gradients (zero for the ``-inf`` entries).
      softcap: None (off) or c > 0: the scaled scores become ``c * tanh(s / c)`` before
        the bias and the mask (Gemma 2's order).  The fused path refuses it
        (``jax.nn.dot_product_attention`` has no soft-capping on XLA); ``"auto"`` then
        takes a path that honours it.
      sinks: None (off) or a float array (H,), H = q's heads (per query head under
        grouped-query attention): attention sinks (gpt-oss), one logit per head that
        joins every softmax's denominator as a key with no value, in the units of the
        final scores (after the scale, the soft-cap and the bias).  A row's weights are
        ``exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m))``, m the larger of the
        row's maximum and the sink: they sum to less than 1 (``return_weights`` returns
        these key weights; dropout acts on them), and a row that sees no key stays
        zeros.  Cast to the compute dtype; differentiable.  Needs
        ``normalization="softmax"``.  ``jax.nn.dot_product_attention`` and splash have
        none: the fused path refuses them unless the library's CPU kernel takes the call
        (it has them); ``"auto"`` then takes a path that honours them.
      window: ``(left, right)``, inclusive: the query at key position p attends to keys
        p - left .. p + right; None on a side is unbounded (with ``causal`` the right
        side is at most 0).  See ``check_window``.
      chunk: chunked local attention (Llama 4's ``attention_chunk_size``): the query at
        key position p attends only to keys j with ``(j - o) // chunk == (p - o) // chunk``,
        o the example's ``chunk_origin``, on top of ``causal``, ``window`` and the masks.
        See ``check_chunk``.  The library's CPU kernel has none: it declines a chunked
        call (``"auto"`` passes it by, an explicit ``"fused"`` runs on XLA's kernel, the
        chunks a dense mask).
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
        heads to the kernel; the others repeat them.
      implementation: ``"reference"`` (the explicit math), ``"fused"`` (a fused
        kernel: on CPU the library's own FlashAttention kernel where it takes the call,
        see ``cpu_kernel_supports``; otherwise ``jax.nn.dot_product_attention``, cuDNN
        for half precision on NVIDIA GPUs and XLA in float32 elsewhere; Pallas splash
        attention on TPU; refuses float64, which it would compute with float32
        accuracy), ``"blockwise"`` (query blocks that skip the keys a causal mask
        hides; never materialises T x S), or ``"auto"`` (fused on GPU/TPU and where the
        CPU kernel takes the call and measured faster than the blockwise path on this
        machine (once per build, cached; ``$TWIN_ATTENTION_CPU_AUTO`` forces it),
        blockwise elsewhere on CPU and for float64, reference where those
        cannot honour an option; see ``attention_spec.resolve_implementation`` and
        ``_cpu_kernel.auto_declines``).  ``route`` says which path and kernel a call
        takes, and why not a faster one; the call runs that route.
      precision: of the matmuls; "highest" by default.
      layout: ``"bhsd"`` (heads before tokens, above) or ``"bshd"`` (tokens before heads,
        as projections produce them and as the library's CPU kernel and
        ``jax.nn.dot_product_attention`` take them): q, k, v and the output in that
        layout; every other argument keeps its meaning (masks and bias broadcast to
        (B, H, T, S), sinks (H,), ...) and returned weights are (..., H, T, S) in both.
        The fused path's kernels take ``"bshd"`` as it is (the library's CPU kernel,
        ``jax.nn.dot_product_attention``'s XLA and cuDNN; splash transposes); the
        reference and blockwise paths transpose once in and once out.

    Keys and values at positions that no query may attend to are zeroed with ``where``
    before any product: whatever is stored there (NaN included) reaches no output and
    gets a zero gradient.

    Raises:
      ValueError / TypeError: inconsistent shapes or dtypes, a mask that is not bool or
        does not broadcast, bad ``kv_lengths``, a ``dropout_mask`` while dropout is off
        (deterministic or rate 0), a bad option value, an explicit implementation that
        cannot honour an option; all before any computation.  Under jit, the values of
        ``kv_lengths`` are not checked (see ``canonical_kv_lengths``).
    """
    return attend(q, k, v, _checked(locals()), rng=rng, precision=precision)


def flex_attention(query: Array, key: Array, value: Array, score_mod: Callable[..., Any] | None = None,
                   block_mask: _flex.BlockMask | None = None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, *, sinks: Array | None = None, dropout_rate: float = 0.0,
                   deterministic: bool = True, rng: Array | None = None,
                   dropout_mask: Any = None) -> Array | tuple[Array, Array]:
    """PyTorch's ``flex_attention`` (``_flex.flex_attention``: score and mask mods, block
    masks, forward and backward; on every CPU, under ``jax.jit``), with what PyTorch's
    lacks: ``sinks`` (Hq,) and dropout on the weights (``dropout_rate``,
    ``deterministic``, an explicit keep-mask ``dropout_mask`` or ``rng``; see
    ``_flex.flex_attention``).  A call whose mods are all library mods that
    stand for named options (``attention_spec.mods``: ``causal``, ``sliding_window``,
    ``softcap``, ``documents`` and their ``and_masks`` / ``chain``), without
    ``return_lse`` or drawn dropout, is that call of ``dot_product_attention`` (sinks and a
    keep-mask passed on) and runs there, on the
    fastest path that honours the options; any other runs on the flex path.
    ``flex_route`` says which, and why.  Every check is the flex path's, made first."""
    given = {"sinks": sinks, "dropout_rate": dropout_rate, "deterministic": deterministic,
             "dropout_mask": dropout_mask, "rng": rng}
    options, _ = flex_call_options(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                   extras=functools.partial(_flex.extras, query, key, **given))
    if options is None:
        return _flex.flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, **given)
    return cast(Array, dot_product_attention(query, key, value, scale=scale, **_jax_options(options)))


def _jax_options(options: dict[str, Any]) -> dict[str, Any]:
    """``flex_call_options``' options as this twin's keywords (``training`` is
    ``deterministic=False``)."""
    options = dict(options)
    if "training" in options:
        options["deterministic"] = not options.pop("training")
    return options


def flex_route(query: Array, key: Array, value: Array, score_mod: Callable[..., Any] | None = None,
               block_mask: _flex.BlockMask | None = None, scale: float | None = None, enable_gqa: bool = False,
               return_lse: bool = False, *, sinks: Array | None = None, dropout_rate: float = 0.0,
               deterministic: bool = True, rng: Array | None = None, dropout_mask: Any = None) -> Route:
    """Which path ``flex_attention`` takes for these arguments, and why: where its mods
    stand for named options, ``route``'s answer for them, its reasons led by the options
    (``"flex: the mods stand for causal=True, softcap=30.0"``); else ``("flex",
    "flex-blocks", (why not,))``, the flex path (query blocks over the key blocks the
    block mask keeps).  Raises what ``flex_attention`` raises for bad arguments."""
    given = {"sinks": sinks, "dropout_rate": dropout_rate, "deterministic": deterministic,
             "dropout_mask": dropout_mask, "rng": rng}
    options, why = flex_call_options(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                     extras=functools.partial(_flex.extras, query, key, **given))
    return flex_route_of(options, why, lambda **named: route(query, key, value, scale=scale,
                                                             **_jax_options(named)))


def attend(q: Array, k: Array, v: Array, call: Call, *, rng: Array | None = None,
           precision: Precision = "highest") -> Array | tuple[Array, Array]:
    """``dot_product_attention`` of a call already checked (``call``: its options and
    canonical arrays, from ``canonicalise``), q, k and v in the call's layout: the row of
    the table of paths that ``route`` names, run.  A row on the library's CPU kernel
    builds the kernel on first use; should that fail, the call is routed again without
    it (``"auto"``: blockwise; ``"fused"``: XLA's kernel, with a ``RuntimeWarning``)."""
    shaped = heads_first(q, k, v, call.options.layout)  # (..., H, S, D): what the route reads
    entry, chosen = _walk(*shaped, call)
    kernel_wanted = entry is _paths.CPU_KERNEL or (call.options.implementation == "fused" and _cpu_fused.candidate(
        shaped[0], "fused", mask=call.mask, bias=call.bias, segments=call.segments, offset=call.offset))
    if kernel_wanted and not _cpu_fused.confirm(call.options.implementation, few_rows=_paths.few_rows(shaped[0])):
        entry, chosen = _walk(*shaped, call)  # without it (known now): blockwise for "auto", XLA's for "fused"
    scale = resolve_scale(call.options.scale, shaped[0].shape[-1])
    return entry.run(q, k, v, shaped[0], call, chosen.kernel, scale=scale, precision=precision, rng=rng)
