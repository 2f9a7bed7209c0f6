"""The table of paths for JAX: each row says what it computes a call on, what it does
not honour (``attention_spec.routing.PathEntry``), and runs it.  ``functional.route``
walks the table of the default backend (``table()``); ``dot_product_attention`` runs the
row it names.

In the order ``"auto"`` tries them: on CPU the library's kernel (``_cpu_fused``), the
blockwise path and the reference math, with ``jax.nn.dot_product_attention`` (XLA's
kernel) for an explicit ``"fused"`` that the library's kernel does not take; on GPU and
TPU ``jax.nn.dot_product_attention`` (cuDNN or XLA) or splash, blockwise, reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from attention_spec.flex import mod_blockers
from attention_spec.geometry import band_chunk, band_reach
from attention_spec.mods import positioned
from attention_spec.options import call_options
from attention_spec.planning import fused_blockers
from attention_spec.routing import PathEntry, option_blockers, walk
from jax_attention import _blockwise, _cpu_fused, _cpu_kernel, _cpu_measure, _flex, _fused, _reference
from jax_attention._canonical import Call, canonicalise, heads_first, structure
from jax_attention._linear import project

# jax.nn.dot_product_attention (and the CPU kernel) cannot draw dropout.
FUSED_DRAWS_DROPOUT = False

# From this many keys on, the blockwise path walks key tiles in loops (``_tiled``)
# instead of unrolling one (block, S) score block per query block.
LONG_SEQUENCE = 4096
# On CPU, a call of at most this many query rows (a decode step: one token, or, folded,
# one token's query heads of a key/value head) runs on the CPU kernel's forward for few
# rows ("cpu-decode", csrc/decode.h), which reads keys and values where they lie and none
# past a length; where "auto" passes the kernel by, on the explicit math: the blockwise
# path's query blocks are mostly empty there, and the weights are a few rows of S.
# Measured per step before the few-rows forward (d_model 512, 8 / 2 heads, 256
# positions): 66 / 277 us at batch 1 / 8 explicit, 64 / 447 blockwise, 166 / 433 on the
# kernel's blocks of query rows.
FEW_QUERY_ROWS = 16
# (query rows, keys) of one tile of the loops: a (256, 512) float32 score tile is 512 KiB.
LONG_TILE = (256, 512)
LONG_BACKWARD_TILE = (512, 256)


def default_block_size(q_len: int) -> int:
    """Query rows per block: 128 (measured best on a 2-core CPU at T=1024), growing so
    that a long sequence unrolls into at most 16 blocks."""
    return max(128, -(-q_len // 16))


def blockwise_plan(q_len: int, kv_len: int) -> tuple[int, tuple[int, int] | None, tuple[int, int] | None]:
    """(query block, forward tile, backward tile) of the blockwise path at a shape.
    Below ``LONG_SEQUENCE`` keys: query blocks of ``default_block_size`` rows, each
    against every key in its reach at once, unrolled (tiles None; kernel
    ``"blockwise"``).  From it on: (rows, keys) tiles in ``lax.fori_loop``s with an
    online softmax, ``LONG_TILE`` forward and ``LONG_BACKWARD_TILE`` backward (the
    backward keeps no per-tile state, so its tiles may differ), and the largest buffer
    is one tile, whatever S (kernel ``"blockwise-tiled"``).

    Measured on the 2-core CPU (causal, head width 64, float32, the core alone, one
    process each, medians of 5; forward / forward + backward): B2 H8 S2048, unrolled
    69 / 320 ms, the loops 92 / 321; B1 H8 S4096, unrolled 174 / 677, the loops
    148 / 550; B1 H4 S16384, unrolled 1665 / 5837, the loops 1054-1195 / 4057-4200
    (backward tiles of 256 x 512 instead: 6084).  At S=32768 the unrolled form's
    resident peak was 6 GiB (its (block, S) score blocks), the loops' 0.5 GiB."""
    if kv_len < LONG_SEQUENCE:
        return default_block_size(q_len), None, None
    return LONG_TILE[0], LONG_TILE, LONG_BACKWARD_TILE


def few_rows(q: Any) -> bool:
    """A call of at most ``FEW_QUERY_ROWS`` query rows on XLA's CPU backend."""
    return jax.default_backend() == "cpu" and q.shape[-2] <= FEW_QUERY_ROWS


# ---------------------------------------------------------------------- what each row honours

def _never(q: Any, k: Any, v: Any, call: Call) -> None:
    return None


def _explicit_blockers(q: Any, k: Any, v: Any, call: Call) -> list[str]:
    """The blockwise path's (and any path's but the reference's) blockers."""
    return option_blockers(call.options, dropout_mask_given=call.dropout_mask is not None)


# The library's CPU kernel takes the band as two ints (left, right) and keeps it
# structural; it has no chunks, and declines a chunked call: ``"auto"`` passes it by
# (the blockwise path skips the blocks outside each chunk), an explicit ``"fused"`` runs
# on XLA's kernel, the chunks a dense mask.
CHUNK_KERNEL_DECLINES = "chunk={chunk}: the library's CPU kernel has no chunked attention"


def _fused_blockers(q: Any, k: Any, v: Any, call: Call, *, kernel_has_sinks: bool) -> list[str]:
    lacks = fused_blockers(call.options, float64=q.dtype == jnp.float64,
                           sinks_given=not kernel_has_sinks and call.sinks is not None)
    return option_blockers(call.options, dropout_mask_given=call.dropout_mask is not None,
                           draws_dropout=FUSED_DRAWS_DROPOUT, lacks=lacks)



def _kernel_declines(q: Any, k: Any, v: Any, call: Call) -> str | None:
    """The library's CPU kernel, asked without building it (``_cpu_fused.declines``)."""
    if call.options.chunk is not None:
        return CHUNK_KERNEL_DECLINES.format(chunk=call.options.chunk)
    return _cpu_fused.declines(q, mask=call.mask, bias=call.bias, segments=call.segments, offset=call.offset,
                               implementation=call.options.implementation, few_rows=few_rows(q))


def _blockwise_declines(q: Any, k: Any, v: Any, call: Call) -> str | None:
    """On CPU, ``"auto"`` gives a call of few query rows to the explicit math."""
    if call.options.implementation == "auto" and few_rows(q) and not _explicit_blockers(q, k, v, call):
        return (f"{q.shape[-2]} query rows (at most {FEW_QUERY_ROWS}, as a decode step has): "
                "the explicit math is faster on CPU")
    return None


def _plain(q: Any, k: Any, v: Any, call: Call) -> bool:
    """Whether the fused path hands its kernel no dense mask, bias or lengths: none
    given, and no band made dense (``_canonical.structure``)."""
    if any(a is not None for a in (call.mask, call.segments, call.bias, call.kv_lengths)):
        return False
    offset, causal, window = call.offset, call.options.causal, call.options.window
    static = offset if isinstance(offset, int) else None
    origin = call.chunk_origin
    if band_chunk(q.shape[-2], k.shape[-2], static, call.options, 0,
                  origin if isinstance(origin, int) else None) is not None:
        return False
    if static is not None and window is None and not (causal and offset):
        return True
    return band_reach(q.shape[-2], k.shape[-2], static, call.options) == (None, None)


# ---------------------------------------------------------------------- what each row runs
# q, k and v as given (in ``call.options.layout``), ``shaped_q`` q's (..., H, T, D) shape.

def _run_kernel(q: Array, k: Array, v: Array, shaped_q: Any, call: Call, kernel: str, *, scale: float,
                precision: Any, rng: Array | None) -> Array:
    s = structure(shaped_q, k, v, call, structural=True, layout=call.options.layout, reads_to_lengths=True)
    return _cpu_fused.attend(q, s.k, s.v, call, scale=scale, few_rows=kernel == "cpu-decode")


def _run_fused(q: Array, k: Array, v: Array, shaped_q: Any, call: Call, kernel: str, *, scale: float,
               precision: Any, rng: Array | None) -> Array:
    s = structure(shaped_q, k, v, call, structural=False, layout=call.options.layout)
    return _fused.attend(q, s.k, s.v, mask=s.mask, causal=s.causal, kv_lengths=call.kv_lengths, scale=scale,
                         precision=precision, kernel=kernel, bias=call.bias, layout=call.options.layout)


def _heads_first(run: Any) -> Any:
    """An explicit path on (..., H, S, D): ``"bshd"`` transposed once in and once out
    (returned weights stay (..., H, T, S))."""
    def wrapped(q: Array, k: Array, v: Array, shaped_q: Any, call: Call, kernel: str, **kw: Any) -> Any:
        if call.options.layout == "bhsd":
            return run(q, k, v, call, **kw)
        q, k, v = (jnp.swapaxes(t, -3, -2) for t in (q, k, v))
        result = run(q, k, v, call, **kw)
        if isinstance(result, tuple):
            return jnp.swapaxes(result[0], -3, -2), result[1]
        return jnp.swapaxes(result, -3, -2)
    return wrapped


def _repeated(k: Array, v: Array, groups: int) -> tuple[Array, Array]:
    """The explicit paths repeat each key/value head for its group of queries."""
    if groups > 1:
        return jnp.repeat(k, groups, axis=-3), jnp.repeat(v, groups, axis=-3)
    return k, v


@_heads_first
def _run_blockwise(q: Array, k: Array, v: Array, call: Call, *, scale: float, precision: Any,
                   rng: Array | None) -> Array:
    s = structure(q, k, v, call, structural=True)
    k, v = _repeated(s.k, s.v, s.groups)
    return _blockwise.blockwise(q, k, v, s, call, scale=scale, precision=precision,
                                plan=blockwise_plan(q.shape[-2], k.shape[-2]))


@_heads_first
def _run_reference(q: Array, k: Array, v: Array, call: Call, *, scale: float, precision: Any,
                   rng: Array | None) -> Array | tuple[Array, Array]:
    """The reference math: the weights (``attention_weights``), dropout, the values mixed."""
    s = structure(q, k, v, call, structural=False)
    k, v = _repeated(s.k, s.v, s.groups)
    o = call.options
    weights = _reference.attention_weights(
        q, k, mask=_reference.reference_mask(s.mask, call.kv_lengths, k.shape[-2], q.ndim), causal=s.causal,
        scale=scale, mask_strategy=o.mask_strategy, normalization=o.normalization, precision=precision,
        bias=call.bias, softcap=o.softcap, sinks=call.sinks,
        score_mod=positioned(o.score_mod, call.offset), mask_mod=positioned(o.mask_mod, call.offset),
    )
    weights = _reference.dropout_weights(weights, o.dropout_rate, deterministic=not o.training, rng=rng,
                                         dropout_mask=call.dropout_mask)
    return _reference.mix(weights, v, precision, o.return_weights)


def _has_mods(call: Call) -> bool:
    return call.options.score_mod is not None or call.options.mask_mod is not None


def _flex_blockers(q: Any, k: Any, v: Any, call: Call) -> list[str]:
    return mod_blockers(call.options, rank=len(q.shape), sinks_given=call.sinks is not None,
                        dropout_mask_given=call.dropout_mask is not None)


@_heads_first
def _run_flex(q: Array, k: Array, v: Array, call: Call, *, scale: float, precision: Any,
              rng: Array | None) -> Array:
    return _flex.run_call(q, k, v, call, scale=scale)


# ---------------------------------------------------------------------- the rows

def _blockwise_kernel(q: Any, k: Any, v: Any, call: Call) -> str:
    return "blockwise" if blockwise_plan(q.shape[-2], k.shape[-2])[1] is None else "blockwise-tiled"


def _kernel_basis(q: Any, k: Any, v: Any, call: Call) -> str:
    """What decides whether ``"auto"`` takes the library's kernel for a call it fits: the
    measurement cached for this build, or ``$TWIN_ATTENTION_CPU_AUTO``
    (``_cpu_kernel.auto_basis``, asked without building or measuring)."""
    if call.options.chunk is not None or _cpu_fused.fits(q, mask=call.mask, bias=call.bias, segments=call.segments,
                                                          offset=call.offset) is not None:
        return ""
    return _cpu_kernel.auto_basis(few_rows(q))


CPU_KERNEL = PathEntry(
    "fused", declines=_kernel_declines,
    blockers=lambda q, k, v, call: _fused_blockers(q, k, v, call, kernel_has_sinks=True),
    kernel=lambda q, k, v, call: "cpu-decode" if few_rows(q) else "cpu-kernel", run=_run_kernel,
    basis=_kernel_basis,
)
XLA_FUSED = PathEntry(  # jax.nn.dot_product_attention (cuDNN or XLA) or splash
    "fused", declines=_never, blockers=lambda q, k, v, call: _fused_blockers(q, k, v, call, kernel_has_sinks=False),
    kernel=lambda q, k, v, call: _fused.kernel_for(q, k, v, plain=_plain(q, k, v, call)), run=_run_fused,
)
BLOCKWISE = PathEntry("blockwise", declines=_blockwise_declines, blockers=_explicit_blockers,
                      kernel=_blockwise_kernel, run=_run_blockwise)
# A module's mods that stand for no named option: query blocks over the key blocks they
# leave visible (``_flex``); an explicit path cannot ask for it ("auto" alone takes it).
FLEX = PathEntry("flex", declines=_never, blockers=_flex_blockers,
                 kernel=lambda q, k, v, call: "flex-blocks", run=_run_flex, applies=_has_mods)
REFERENCE = PathEntry("reference", declines=_never, blockers=lambda q, k, v, call: [],
                      kernel=lambda q, k, v, call: "reference", run=_run_reference)

# XLA's fused kernel on CPU is the explicit math fused by XLA: "auto" passes it by there.
_CPU_TABLE = (CPU_KERNEL, XLA_FUSED._replace(auto=False), BLOCKWISE, FLEX, REFERENCE)
_ACCELERATOR_TABLE = (XLA_FUSED, BLOCKWISE, FLEX, REFERENCE)


def table(backend: str | None = None) -> tuple[PathEntry, ...]:
    """The rows of ``backend`` (None: JAX's default), in the order ``"auto"`` tries them."""
    return _CPU_TABLE if (backend or jax.default_backend()) == "cpu" else _ACCELERATOR_TABLE


# ---------------------------------------------------------------------- auto's races on CPU

def _run_row(row: PathEntry, q: Array, k: Array, v: Array, call: Call) -> Any:
    """``row`` run on a checked call, as ``functional.attend`` runs the row it routes to."""
    shaped = heads_first(q, k, v, call.options.layout)
    scale = _reference.resolve_scale(call.options.scale, shaped[0].shape[-1])
    return row.run(q, k, v, shaped[0], call, row.kernel(*shaped, call), scale=scale, precision="highest", rng=None)


def _needs_kernel(call: Call, q: Any, k: Any, v: Any, kernel: str) -> None:
    """RuntimeError unless the table gives this explicit ``"fused"`` call the library's
    ``kernel`` (the row and kernel ``functional.route`` names)."""
    shaped = heads_first(q, k, v, call.options.layout)
    runs = walk(table(), *shaped, call)[0].kernel(*shaped, call)
    if runs != kernel:
        raise RuntimeError(f"auto's measurement needs the CPU kernel, and implementation='fused' runs {runs}")


def races(full_call: tuple[int, int, int, int],
          few_rows_call: tuple[int, int, int, int]) -> dict[str, tuple[dict[str, Callable[..., Any]], tuple[Any, ...]]]:
    """The two races of ``"auto"``'s measurement on CPU (``_cpu_measure``): for each, its
    sides, jitted, and the arguments they run on; the rows of this table that ``auto``
    decides between, run as ``functional.attend`` runs them.

    ``"full"``: a causal layer's forward + backward (``jax.value_and_grad`` of the
    output's sum with respect to x and the four weights) at ``full_call`` (B, S, H, D)
    float32, layout ``"bshd"``: x projected to q, k and v, the core, the output projected
    again, the kernel (``CPU_KERNEL`` and the kernel's matrix product, ``project`` on
    ``"fused"``) against the blockwise path (``BLOCKWISE`` and XLA's dot).
    ``"few_rows"``: a decode step at ``few_rows_call`` (B, H, S, D), one query row per
    head over S keys with ``kv_lengths``, forward only: ``CPU_KERNEL``'s forward for few
    rows against the explicit math (``REFERENCE``).  RuntimeError where an explicit
    ``"fused"`` would not run the library's kernel (it is not loaded, or the backend is
    not the CPU)."""
    rng = np.random.default_rng(0)
    b, seq, h, d = full_call
    x = jnp.asarray(rng.standard_normal((b, seq, h * d)), jnp.float32)
    weights = tuple(jnp.asarray(rng.standard_normal((h * d, h * d)) / math.sqrt(h * d), jnp.float32)
                    for _ in range(4))
    q = jax.ShapeDtypeStruct((b, seq, h, d), jnp.float32)
    causal = {"causal": True, "layout": "bshd"}
    _needs_kernel(canonicalise(q, q, q, call_options(**causal, implementation="fused")), q, q, q, "cpu-kernel")

    def step(row: PathEntry, implementation: str) -> Callable[..., Any]:
        def loss(x_: Any, wq: Any, wk: Any, wv: Any, wo: Any) -> Any:
            # a module's work: the projections on the path's product, the attention core
            qkv = [project(x_, w, implementation=implementation).reshape(b, seq, h, d) for w in (wq, wk, wv)]
            call = canonicalise(*qkv, call_options(**causal, implementation=implementation))
            out = _run_row(row, *qkv, call)
            return jnp.sum(project(out.reshape(b, seq, h * d), wo, implementation=implementation))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

    batch, heads, keys, width = few_rows_call
    q1 = jnp.asarray(rng.standard_normal((batch, heads, 1, width)), jnp.float32)
    k1, v1 = (jnp.asarray(rng.standard_normal((batch, heads, keys, width)), jnp.float32) for _ in range(2))
    lengths = jnp.full((batch,), keys, jnp.int32)
    _needs_kernel(canonicalise(q1, k1, v1, call_options(implementation="fused"), kv_lengths=lengths), q1, k1, v1,
                  "cpu-decode")

    def decode(row: PathEntry, implementation: str) -> Callable[..., Any]:
        def attend(q_: Any, k_: Any, v_: Any, n_: Any) -> Any:
            return _run_row(row, q_, k_, v_, canonicalise(q_, k_, v_, call_options(implementation=implementation),
                                                          kv_lengths=n_))
        return jax.jit(attend)

    return {
        "full": ({"kernel": step(CPU_KERNEL, "fused"), "blockwise": step(BLOCKWISE, "blockwise")}, (x, *weights)),
        "few_rows": ({"kernel": decode(CPU_KERNEL, "fused"), "reference": decode(REFERENCE, "reference")},
                     (q1, k1, v1, lengths)),
    }


_cpu_measure.use_races(races)
