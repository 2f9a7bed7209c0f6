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
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec import dtype_name
from attention_spec.geometry import band_reach
from attention_spec.options import check_qkv_in_layout
from attention_spec.planning import fused_blockers
from attention_spec.rope import RopeConfig as RopeConfig
from attention_spec.routing import Route, resolve_route
from jax_attention import _cpu_fused
from jax_attention._blockwise import blockwise as _blockwise  # the paths' entry points, by their old names
from jax_attention._cache import KVCache as KVCache
from jax_attention._cache import append_to_cache as append_to_cache
from jax_attention._cache import cache_fields as cache_fields
from jax_attention._canonical import Canonical, canonicalise, structure
from jax_attention._canonical import canonical_bias as canonical_bias
from jax_attention._canonical import canonical_kv_lengths as canonical_kv_lengths
from jax_attention._canonical import canonical_mask as canonical_mask
from jax_attention._canonical import canonical_q_offset as canonical_q_offset
from jax_attention._canonical import canonical_segments as canonical_segments
from jax_attention._cpu_fused import cpu_kernel_supports as cpu_kernel_supports
from jax_attention._fused import attend as _fused
from jax_attention._fused import cudnn_supports as cudnn_supports
from jax_attention._fused import kernel_for
from jax_attention._fused import splash_attention as splash_attention
from jax_attention._fused import splash_supports as splash_supports
from jax_attention._linear import linear as linear
from jax_attention._reference import Precision, mix, reference_mask
from jax_attention._reference import attention_scores as attention_scores
from jax_attention._reference import attention_weights as attention_weights
from jax_attention._reference import dropout_weights as dropout_weights
from jax_attention._reference import normalize_scores as normalize_scores
from jax_attention._reference import resolve_scale as resolve_scale
from jax_attention._rope import apply_rope as apply_rope

__all__ = [
    "RopeConfig",
    "apply_rope",
    "attention_scores",
    "attention_weights",
    "canonical_bias",
    "canonical_kv_lengths",
    "canonical_mask",
    "cpu_kernel_supports",
    "default_block_size",
    "dot_product_attention",
    "dropout_weights",
    "linear",
    "normalize_scores",
    "resolve_scale",
    "route",
]

# jax.nn.dot_product_attention (and the CPU kernel) cannot draw dropout.
FUSED_DRAWS_DROPOUT = False

# From this many keys on, the blockwise path walks key tiles in loops (``_tiled``)
# instead of unrolling one (block, S) score block per query block.
_LONG_SEQUENCE = 4096
# On CPU, a call of at most this many query rows (a decode step: one token, or, folded,
# one token's query heads of a key/value head) runs on the CPU kernel's forward for few
# rows ("cpu-decode", csrc/decode.h), which reads keys and values where they lie and none
# past a length; where "auto" passes the kernel by, on the explicit math: the blockwise
# path's query blocks are mostly empty there, and the weights are a few rows of S.
# Measured per step before the few-rows forward (d_model 512, 8 / 2 heads, 256
# positions): 66 / 277 us at batch 1 / 8 explicit, 64 / 447 blockwise, 166 / 433 on the
# kernel's blocks of query rows.
FEW_QUERY_ROWS = 16
# The kernels that read no key past ``kv_lengths``: a call on them costs what the keys
# up to each example's length cost, however long its buffers (a cache's max_len).
READS_TO_LENGTHS = ("cpu-decode",)
# (query rows, keys) of one tile of the loops: a (256, 512) float32 score tile is 512 KiB.
_LONG_TILE = (256, 512)
_LONG_BACKWARD_TILE = (512, 256)


def default_block_size(q_len: int) -> int:
    """Query rows per block: 128 (measured best on a 2-core CPU at T=1024), growing so
    that a long sequence unrolls into at most 16 blocks."""
    return max(128, -(-q_len // 16))


def _blockwise_plan(q_len: int, kv_len: int) -> tuple[int, tuple[int, int] | None, tuple[int, int] | None]:
    """(query block, forward tile, backward tile) of the blockwise path at a shape.
    Below ``_LONG_SEQUENCE`` keys: query blocks of ``default_block_size`` rows, each
    against every key in its reach at once, unrolled (tiles None; kernel
    ``"blockwise"``).  From it on: (rows, keys) tiles in ``lax.fori_loop``s with an
    online softmax, ``_LONG_TILE`` forward and ``_LONG_BACKWARD_TILE`` backward (the
    backward keeps no per-tile state, so its tiles may differ), and the largest buffer
    is one tile, whatever S (kernel ``"blockwise-tiled"``).

    Measured on the 2-core CPU (causal, head width 64, float32, the core alone, one
    process each, medians of 5; forward / forward + backward): B2 H8 S2048, unrolled
    69 / 320 ms, the loops 92 / 321; B1 H8 S4096, unrolled 174 / 677, the loops
    148 / 550; B1 H4 S16384, unrolled 1665 / 5837, the loops 1054-1195 / 4057-4200
    (backward tiles of 256 x 512 instead: 6084).  At S=32768 the unrolled form's
    resident peak was 6 GiB (its (block, S) score blocks), the loops' 0.5 GiB."""
    if kv_len < _LONG_SEQUENCE:
        return default_block_size(q_len), None, None
    return _LONG_TILE[0], _LONG_TILE, _LONG_BACKWARD_TILE


def route(
    q: Array | jax.ShapeDtypeStruct, k: Array | jax.ShapeDtypeStruct, v: Array | jax.ShapeDtypeStruct, *, mask: Array | None = None, causal: bool = False, kv_lengths: Any = None,
    scale: float | None = None, mask_strategy: str = "fill", normalization: str = "softmax",
    dropout_rate: float = 0.0, dropout_mask: Any = None, deterministic: bool = True,
    rng: Array | None = None, return_weights: bool = False, implementation: str = "auto",
    precision: Precision = "highest", bias: Array | None = None, softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None, alignment: str = "top_left", q_offset: Any = None,
    segment_ids: Any = None, kv_segment_ids: Any = None, sinks: Array | None = None, layout: str = "bhsd",
) -> Route:
    """The route ``dot_product_attention`` takes for these arguments (the same keywords):
    ``Route(path, kernel, reasons)``, the path (``"reference"``, ``"fused"`` or
    ``"blockwise"``), the kernel that runs it here (``"reference"``; ``"blockwise"``,
    the unrolled query blocks, or ``"blockwise-tiled"``, the loops from
    ``_LONG_SEQUENCE`` keys on; ``"cpu-kernel"``, the library's CPU kernel, and
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
    shaped = _heads_first(q, k, v, layout)
    call = canonicalise(
        *shaped, mask=mask, bias=bias, softcap=softcap, kv_lengths=kv_lengths, dropout_rate=dropout_rate,
        dropout_mask=dropout_mask, deterministic=deterministic, scale=scale, mask_strategy=mask_strategy,
        normalization=normalization, window=window, alignment=alignment, q_offset=q_offset,
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, sinks=sinks,
    )
    return _route(*shaped, call, causal=causal, implementation=implementation, return_weights=return_weights,
                  normalization=normalization, dropout_active=not deterministic and dropout_rate > 0.0,
                  dropout_mask_given=dropout_mask is not None)


def _heads_first(q: Array | jax.ShapeDtypeStruct, k: Array | jax.ShapeDtypeStruct, v: Array | jax.ShapeDtypeStruct,
                 layout: str) -> tuple[Any, Any, Any]:
    """q, k and v checked in ``layout`` (``check_qkv_in_layout``; the layout first) and
    given as (..., H, S, D): the arrays themselves for ``"bhsd"``, their shapes and dtypes
    (``jax.ShapeDtypeStruct``) for ``"bshd"``, which is all the checks and the route read."""
    shapes = check_qkv_in_layout(q.shape, k.shape, v.shape, (dtype_name(q.dtype), dtype_name(k.dtype),
                                                              dtype_name(v.dtype)), layout)
    if layout == "bhsd":
        return q, k, v
    return (jax.ShapeDtypeStruct(shapes[0], q.dtype), jax.ShapeDtypeStruct(shapes[1], k.dtype),
            jax.ShapeDtypeStruct(shapes[2], v.dtype))


def _route(q: Array, k: Array, v: Array, call: Canonical, *, causal: bool, implementation: str,
           return_weights: bool, normalization: str, dropout_active: bool, dropout_mask_given: bool) -> Route:
    """``route`` of a canonicalised call.  The fast paths: fused and blockwise on GPU and
    TPU; on CPU blockwise, after the library's kernel where it takes the call (for
    ``"auto"``, where it is tuned for the CPU), else with why not; then
    ``resolve_route``'s choice by the options, and the kernel of the path."""
    backend = jax.default_backend()
    few_rows = backend == "cpu" and q.shape[-2] <= FEW_QUERY_ROWS
    cpu_kernel = False
    declined: tuple[tuple[str, str], ...] = ()  # (path, why) of the fast paths this machine passes by
    if backend == "cpu" and implementation in ("fused", "auto"):
        why = _cpu_fused.declines(q, mask=call.mask, bias=call.bias, segments=call.segments, offset=call.offset,
                                  implementation=implementation, few_rows=few_rows)
        cpu_kernel = why is None
        declined = () if why is None or implementation != "auto" else (("fused", why),)
    preference: tuple[str, ...] = ("fused", "blockwise") if backend in ("gpu", "tpu") or cpu_kernel else ("blockwise",)
    path, reasons = resolve_route(
        implementation,
        preference=preference,
        declined=declined,
        return_weights=return_weights,
        normalization=normalization,
        dropout_active=dropout_active,
        dropout_mask_given=dropout_mask_given,
        fused_draws_dropout=FUSED_DRAWS_DROPOUT,
        # sinks block the fused kernels but the library's CPU kernel, which has them
        fused_blockers=fused_blockers(q.dtype == jnp.float64, call.softcap,
                                      sinks=call.sinks is not None and not cpu_kernel),
    )
    on_kernel = path == "fused" and cpu_kernel
    if few_rows and implementation == "auto" and path != "reference" and not on_kernel:
        few = (f"{q.shape[-2]} query rows (at most {FEW_QUERY_ROWS}, as a decode step has): "
               "the explicit math is faster on CPU")
        reasons = (*reasons, *(f"{p}: {few}" for p in preference[preference.index(path):]))
        path = "reference"
    if path == "blockwise":
        kernel = "blockwise" if _blockwise_plan(q.shape[-2], k.shape[-2])[1] is None else "blockwise-tiled"
    elif on_kernel:
        kernel = "cpu-decode" if few_rows else "cpu-kernel"
    elif path == "fused":
        kernel = kernel_for(q, k, v, plain=_plain(q, k, call, causal))
    else:
        kernel = "reference"
    return Route(path, kernel, reasons)


def _plain(q: Array, k: Array, call: Canonical, causal: bool) -> bool:
    """Whether the fused path hands its kernel no dense mask, bias or lengths: none
    given, and no band made dense (``_canonical.structure``)."""
    if any(a is not None for a in (call.mask, call.segments, call.bias, call.kv_lengths)):
        return False
    offset = call.offset
    if isinstance(offset, int) and call.window is None and not (causal and offset):
        return True
    reach = band_reach(q.shape[-2], k.shape[-2], offset if isinstance(offset, int) else None, causal, call.window)
    return reach == (None, None)


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
    alignment: str = "top_left",
    q_offset: Any = None,
    segment_ids: Any = None,
    kv_segment_ids: Any = None,
    sinks: Array | None = None,
    layout: str = "bhsd",
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
        CPU kernel takes the call and is built for AVX-512, the instruction set it is
        tuned for, blockwise elsewhere on CPU and for float64, reference where those
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
    shaped = _heads_first(q, k, v, layout)  # (..., H, S, D): what the checks and the route read
    call = canonicalise(
        *shaped, mask=mask, bias=bias, softcap=softcap, kv_lengths=kv_lengths, dropout_rate=dropout_rate,
        dropout_mask=dropout_mask, deterministic=deterministic, scale=scale, mask_strategy=mask_strategy,
        normalization=normalization, window=window, alignment=alignment, q_offset=q_offset,
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, sinks=sinks,
    )
    decide = functools.partial(
        _route, *shaped, call, causal=causal, implementation=implementation, return_weights=return_weights,
        normalization=normalization, dropout_active=not deterministic and dropout_rate > 0.0,
        dropout_mask_given=dropout_mask is not None,
    )
    chosen = decide()
    on_kernel = chosen.kernel in ("cpu-kernel", "cpu-decode")
    if on_kernel or (implementation == "fused" and _cpu_fused.candidate(
            q, implementation, mask=call.mask, bias=call.bias, segments=call.segments, offset=call.offset)):
        if not _cpu_fused.confirm(implementation, few_rows=chosen.kernel == "cpu-decode"):  # builds it on first use
            chosen = decide()  # without it (known now): blockwise for "auto", XLA's kernel for "fused"
            on_kernel = False
    scale = resolve_scale(scale, q.shape[-1])
    if chosen.path == "fused":  # the kernels take either layout as it is (splash transposes)
        s = structure(shaped[0], k, v, call, causal, structural=on_kernel, layout=layout, reads_to_lengths=on_kernel)
        if on_kernel:
            return _cpu_fused.attend(q, s.k, s.v, causal=s.causal, kv_lengths=call.kv_lengths, scale=scale,
                                     offset=s.offset, window=s.window, sinks=call.sinks, layout=layout,
                                     few_rows=chosen.kernel == "cpu-decode")
        return _fused(q, s.k, s.v, mask=s.mask, causal=s.causal, kv_lengths=call.kv_lengths, scale=scale,
                      precision=precision, kernel=chosen.kernel, bias=call.bias, layout=layout)
    if layout == "bshd":  # the explicit paths: once in, once out below
        q, k, v = (jnp.swapaxes(t, -3, -2) for t in (q, k, v))
    result = _explicit(q, k, v, call, chosen, causal=causal, scale=scale, precision=precision,
                       mask_strategy=mask_strategy, normalization=normalization, return_weights=return_weights,
                       dropout=(dropout_rate, deterministic, rng, call.dropout_mask))
    if layout == "bhsd":
        return result
    if isinstance(result, tuple):  # the weights stay (..., H, T, S)
        return jnp.swapaxes(result[0], -3, -2), result[1]
    return jnp.swapaxes(result, -3, -2)


def _explicit(
    q: Array, k: Array, v: Array, call: Canonical, chosen: Route, *, causal: bool, scale: float,
    precision: Precision, mask_strategy: str, normalization: str, return_weights: bool,
    dropout: tuple[float, bool, Array | None, Array | None],
) -> Array | tuple[Array, Array]:
    """The explicit paths on (..., H, S, D) inputs: blockwise, or the reference with
    dropout (``dropout``: rate, deterministic, rng, dropout_mask)."""
    s = structure(q, k, v, call, causal, structural=chosen.path == "blockwise")
    k, v = s.k, s.v
    if s.groups > 1:  # the explicit paths repeat each key/value head for its group of queries
        k, v = jnp.repeat(k, s.groups, axis=-3), jnp.repeat(v, s.groups, axis=-3)
    if chosen.path == "blockwise":
        return _blockwise(
            q, k, v, mask=s.mask, causal=s.causal, kv_lengths=call.kv_lengths, scale=scale, precision=precision,
            plan=_blockwise_plan(q.shape[-2], k.shape[-2]), bias=call.bias, softcap=call.softcap, offset=s.offset,
            window=s.window, sinks=call.sinks,
        )
    weights = attention_weights(
        q, k, mask=reference_mask(s.mask, call.kv_lengths, k.shape[-2], q.ndim), causal=s.causal, scale=scale,
        mask_strategy=mask_strategy, normalization=normalization, precision=precision, bias=call.bias,
        softcap=call.softcap, sinks=call.sinks,
    )
    rate, deterministic, rng, dropout_mask = dropout
    weights = dropout_weights(weights, rate, deterministic=deterministic, rng=rng, dropout_mask=dropout_mask)
    return mix(weights, v, precision, return_weights)
