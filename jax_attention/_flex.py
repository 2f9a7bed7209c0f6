"""``flex_attention`` for JAX: PyTorch's flex_attention (score and mask mods, block-sparse
block masks) on the library's math, forward and backward.  ``torch_attention/_flex.py``
is its twin; the mods are ``attention_spec.mods``'s, the checks and the block plan
``attention_spec.flex``'s.

One (example, query head) slice at a time (``jax.lax.map``: plain 2-d products, which
XLA's CPU backend runs 2.3x faster than one batched product per query block), and per
query block of ``BLOCK_SIZE`` rows, only the key blocks that the block mask marks
non-empty are computed: their scores in the compute dtype (float32 for half precision;
float64 stays), ``score_mod`` applied with index arrays, the mask mod on partial blocks
only, the library's stable softmax (``_reference.softmax``), then weights @ v.  Each
query block is a ``jax.checkpoint``: the backward recomputes its scores, so no (L, S)
array is kept for it, and gradients reach q, k, v and the arrays the mods capture.
Beyond PyTorch's: attention sinks (the library's softmax with the slice's sink, the lse
with the sink's term) and dropout on the weights (an explicit keep-mask, or one drawn in
each block from the rng folded with the slice's and the block's numbers, ``_Dropout``: the
checkpoint's recomputation draws the same), the PyTorch twin's numbers and error texts.

Up to ``UNROLLED_BLOCKS`` query blocks are unrolled, each over exactly its own key
blocks; a longer sequence runs its blocks in at most ``LOOPS`` loops (``_looped``), each
over the key blocks the most of its blocks need, so that its compile time stays that of a
short one (2.1-2.4 s at S=4096 and 8192, where unrolled blocks took 5.6 and 11.2 s).

The block plan is read on the host where the block mask's tables are concrete (made by
``create_block_mask`` outside a trace, or closed over by a jitted function).  Tables
that are traced (a ``BlockMask`` passed into ``jax.jit`` as an argument, or made inside
one from traced arrays) cannot say which blocks to skip: every block is computed, each
masked by the tables' block kinds and the mask mod (the same numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from attention_spec import flex as spec
from attention_spec import mods as library
from attention_spec.arrays import dtype_name, host_array
from attention_spec.flex import DEFAULT_BLOCK, BlockMask
from attention_spec.flex_answers import check_mask_answer
from jax_attention._canonical import compute_dtype, expand_to
from jax_attention._reference import dropout_weights, resolve_scale, softmax

# Up to this many query blocks are unrolled, each over exactly its own key blocks; beyond,
# the blocks run in at most LOOPS loops (``_looped``), each over as many key blocks as the
# most of its blocks need, so that a long sequence compiles in about the time of a short
# one.  Measured before the loops (B1 H2 D64, causal, an ALiBi mod, forward + backward
# under jit): compiling took 5.6 s at S=4096 (32 blocks) and 10.8 s at S=8192 (64).
UNROLLED_BLOCKS = 16
LOOPS = 8


jax.tree_util.register_dataclass(
    BlockMask, data_fields=["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"],
    meta_fields=["BLOCK_SIZE", "mask_mod", "seq_lengths", "made_for"])


class _Structure:
    """A library mod's pytree structure: equal for mods of one class and settings (the
    arrays are the leaves); keeps one such mod to rebuild from."""

    def __init__(self, mod: library.Mod) -> None:
        self.mod, self.key = mod, mod.static_key()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Structure) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


for _cls in library.MOD_CLASSES:  # library mods are pytrees: their arrays can be traced, differentiated
    jax.tree_util.register_pytree_node(
        _cls, lambda m: (m.arrays, _Structure(m)), lambda s, arrays: s.mod.with_arrays(arrays))


def _host(tables: tuple[Any, Any, Any, Any]) -> tuple[Any, Any, Any, Any]:
    """A block mask's concrete tables as NumPy arrays (None kept)."""
    a, b, c, d = (None if t is None else np.asarray(t) for t in tables)
    return a, b, c, d


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def create_block_mask(mask_mod: Callable[..., Any], B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,  # noqa: N803
                      BLOCK_SIZE: int | tuple[int, int] = 128) -> BlockMask:  # noqa: N803
    """The block mask of ``mask_mod`` (b, h, q_idx, kv_idx) -> bool (True = may attend) for
    B x H x Q_LEN x KV_LEN (B or H None: 1, broadcast over the call's), in blocks of
    ``BLOCK_SIZE`` (an int, or (query block, key block)): which key blocks of each query
    block are partial, full or empty.  PyTorch's ``create_block_mask`` (its tables
    exactly), without ``device``.

    ``mask_mod`` runs on NumPy index arrays, one query block at a time (no (L, S) mask
    is made whole), so the tables are NumPy (concrete) wherever the mod's captured arrays
    are; a mod over traced arrays (inside ``jax.jit``) gives traced tables, and the call
    then computes every block.  Raises TypeError / ValueError (bad sizes)."""
    b_, h_, q_len, kv_len, (bq, bkv) = spec.check_block_mask_args(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE)
    n_kv = -(-kv_len // bkv)
    b = np.arange(b_).reshape(b_, 1, 1, 1)
    h = np.arange(h_).reshape(1, h_, 1, 1)
    kv = np.arange(kv_len).reshape(1, 1, 1, kv_len)
    sums = []
    for start in range(0, q_len, bq):
        rows = np.arange(start, min(start + bq, q_len)).reshape(1, 1, -1, 1)
        m = _answer("create_block_mask", mask_mod(b, h, rows, kv), (b_, h_, rows.shape[2], kv_len))
        xp = jnp if _is_traced(m) else np
        m = xp.broadcast_to(m if xp is jnp else np.asarray(m), (b_, h_, rows.shape[2], kv_len))
        # padded to whole blocks with False, as PyTorch pads: a ragged block is never full
        m = xp.pad(m, ((0, 0), (0, 0), (0, bq - m.shape[2]), (0, n_kv * bkv - kv_len)))
        sums.append(m.reshape(b_, h_, bq, n_kv, bkv).sum(axis=(2, 4)))
    xp = jnp if any(_is_traced(s) for s in sums) else np
    counts = xp.stack(sums, axis=2)  # (B', H', n_q, n_kv): visible keys per block
    full = counts == bq * bkv
    partial = (counts > 0) & ~full
    order = spec.ordered_blocks if xp is np else _ordered_traced
    (num, indices), (full_num, full_indices) = order(partial), order(full)
    return BlockMask(num, indices, full_num, full_indices, BLOCK_SIZE=(bq, bkv), mask_mod=mask_mod,
                     seq_lengths=(q_len, kv_len), made_for=mask_mod)


def _answer(where: str, answer: Any, want: tuple[int, ...]) -> Any:
    """A mask mod's answer, checked (``attention_spec.flex_answers``: a bool array that
    broadcasts to ``want``, the text the PyTorch twin gives): a JAX array as it is,
    any other that is no JAX array as a NumPy array (``True`` too)."""
    answer = answer if isinstance(answer, jax.Array) else np.asarray(answer)
    check_mask_answer(where, dtype_name(answer.dtype), answer.shape, want)
    return answer


def _ordered_traced(dense: Array) -> tuple[Array, Array]:
    """``spec.ordered_blocks`` for traced arrays."""
    dense = dense.astype(jnp.int32)
    return dense.sum(axis=-1).astype(jnp.int32), jnp.argsort(-dense, axis=-1, stable=True).astype(jnp.int32)


def _dense_traced(num: Array, indices: Array, n_kv: int) -> Array:
    """``spec.dense_blocks`` for traced arrays: bool (B', H', n_q, n_kv)."""
    # explicit ranks throughout: the library runs under jax_numpy_rank_promotion="raise"
    listed = jnp.arange(indices.shape[-1]).reshape(1, 1, 1, -1) < num[..., None]  # (B', H', n_q, n)
    hits = (indices[..., None] == jnp.arange(n_kv).reshape(1, 1, 1, 1, n_kv)) & listed[..., None]
    return hits.any(axis=-2)  # (B', H', n_q, n_kv)


def extras(query: Array, key: Array, *, sinks: Any, dropout_rate: Any, deterministic: Any, dropout_mask: Any,
           rng: Any) -> spec.FlexExtras:
    """``flex_attention``'s sinks and dropout checked (``attention_spec.flex.check_flex_extras``,
    the PyTorch twin's texts), sinks and keep-mask as JAX arrays (a keep-mask given as a
    list or NumPy array is checked as given).  Raises TypeError / ValueError (dropout in
    training mode without ``rng`` or a keep-mask among them: JAX has no global stream)."""
    if rng is not None and not hasattr(rng, "dtype"):
        raise TypeError(f"flex_attention: rng must be a JAX random key or None; got {type(rng).__name__}")
    if sinks is not None and not isinstance(sinks, jax.Array):
        sinks = host_array("sinks", sinks)
    if dropout_mask is not None and not isinstance(dropout_mask, jax.Array):
        dropout_mask = host_array("dropout_mask", dropout_mask)
    found = spec.check_flex_extras(query, key, sinks=sinks, dropout_rate=dropout_rate,
                                   mode=("deterministic", deterministic), dropout_mask=dropout_mask,
                                   rng=("an rng key", rng is not None))
    return found._replace(sinks=None if sinks is None else jnp.asarray(sinks),
                          keep=None if found.keep is None else jnp.asarray(found.keep))


def flex_attention(query: Array, key: Array, value: Array, score_mod: Callable[..., Any] | None = None,
                   block_mask: BlockMask | None = None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, *, sinks: Array | None = None, dropout_rate: float = 0.0,
                   deterministic: bool = True, rng: Array | None = None,
                   dropout_mask: Any = None) -> Array | tuple[Array, Array]:
    """Attention with a score mod and a block-sparse mask: query (B, Hq, L, E), key
    (B, Hkv, S, E), value (B, Hkv, S, Ev) -> (B, Hq, L, Ev) in the inputs' dtype, with
    ``return_lse`` also lse (B, Hq, L) in the compute dtype (float32, float64 for
    float64): the natural log of each row's sum of exp(modded scores), -inf for a row
    that sees no key (its output row is zeros).  PyTorch's ``flex_attention``.

    Args:
      score_mod: ``(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled scores
        ``scale * q.k`` (``attention_spec.mods``: vectorised, elementwise).  A score it
        makes -inf blocks its key.  ``h`` is the query head.
      block_mask: ``create_block_mask``'s; None: every key visible.  Its ``mask_mod``
        (True = may attend) decides the keys of partial blocks; empty blocks are skipped.
        Closed over (concrete), it skips blocks under ``jax.jit`` too; traced, every
        block is computed and masked.
      scale: None = 1/sqrt(E); a float as given.
      enable_gqa: k and v may have Hkv heads dividing Hq; query head h reads kv head
        h // (Hq // Hkv).  Without it Hq must equal Hkv.
      sinks: None or a float array (Hq,): attention sinks (gpt-oss), one logit per query
        head in every softmax's denominator, in the units of the modded scores: a row's
        weights are exp(s_j - lse) with lse = log(sum_j exp(s_j) + exp(sink)), so they sum
        to less than 1, and ``return_lse`` returns that lse (the sink's term included: a
        row that sees no key has output zeros and lse = its sink).  Differentiable.
      dropout_rate, deterministic, rng, dropout_mask: dropout on the weights (training,
        ``deterministic=False``, only; survivors scaled by 1/(1 - rate));
        ``dropout_mask`` (bool, True = keep, broadcastable to (B, Hq, L, S)) replaces the
        draw, as in ``dot_product_attention``; without it the keep-mask is drawn per
        (example, query head, query block) from ``rng`` folded with their numbers, and the
        backward (each block's recomputation) draws the same.  The lse is the softmax's,
        before dropout.

    Differentiable (``jax.grad``) in q, k, v, sinks and the arrays the mods capture, one
    query block recomputed at a time; works under ``jax.jit`` and ``jax.vmap``.

    Raises:
      ValueError / TypeError: shapes, dtypes, scale, mods, a block mask, sinks or dropout
        that do not fit (``attention_spec.flex``'s texts, the PyTorch twin's), before any
        computation.
    """
    groups, scale = spec.check_flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa)
    found = extras(query, key, sinks=sinks, dropout_rate=dropout_rate, deterministic=deterministic,
                   dropout_mask=dropout_mask, rng=rng)
    plan, mask_mod, flags = _plan(query, key, block_mask)
    batch, heads, q_len, dim = query.shape
    kv_len, v_dim = key.shape[2], value.shape[3]
    scale = resolve_scale(scale, dim)
    ct = compute_dtype(query.dtype)
    if groups > 1:  # each query head's key/value head, as its own slice (the blockwise path's repeat)
        key, value = jnp.repeat(key, groups, axis=1), jnp.repeat(value, groups, axis=1)
    drop = _Dropout(found.rate, rng if found.drawn else None)

    def one_slice(operands: tuple[Any, ...]) -> tuple[Array, Array]:
        """Slice s, (example s // Hq, query head s % Hq): q (L, E), k (S, E), v (S, Ev), its
        sink (or None) and keep-mask (L, S) (or None) -> out (L, Ev), lse (L,): its query
        blocks in turn, each a ``jax.checkpoint``."""
        index, q, k, v, sink, keep = operands
        b, h = (index // heads).reshape(1, 1, 1, 1), (index % heads).reshape(1, 1, 1, 1)  # as the mods take them
        outs, lses = [], []
        for number, (qb, traced) in enumerate(zip(plan, flags, strict=True)):
            rows = qb.stop - qb.start
            if not qb.runs:  # every key blocked: zeros, lse -inf (with sinks: the sink's)
                outs.append(jnp.zeros((rows, v_dim), value.dtype))
                lses.append(jnp.full((rows,), -jnp.inf, ct) if sink is None else jnp.broadcast_to(
                    jnp.where(sink == -jnp.inf, -jnp.inf, sink), (rows,)))  # a sink of -inf: none, no gradient
                continue
            block = _query_block(qb, score_mod, mask_mod, traced, scale, ct, b, h, drop)
            kept = drop.of_block(index, number, keep, qb.start, rows)
            out, lse = jax.checkpoint(block)(q[qb.start:qb.stop], k, v, sink, kept)
            outs.append(out.astype(value.dtype))
            lses.append(lse)
        return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0),
                lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=0))

    if len(plan) > UNROLLED_BLOCKS:  # a long sequence: its query blocks in a few loops
        one_slice = _looped(query, key, block_mask, score_mod, scale, ct, heads, value.dtype, drop)

    # One slice at a time: plain 2-d products, which XLA's CPU backend ran 2.3x faster than
    # the same work as one batched product per query block (B1 H8 S2048 D64, forward).
    sink_s = None if found.sinks is None else jnp.tile(found.sinks.astype(ct), batch)  # slice b * Hq + h: sinks[h]
    keep_s = None
    if found.keep is not None:  # (B * Hq, L, S): each slice's keep-mask
        keep_s = jnp.broadcast_to(expand_to(found.keep, 4), (batch, heads, q_len, kv_len)).reshape(
            batch * heads, q_len, kv_len)
    slices = (jnp.arange(batch * heads, dtype=jnp.int32), query.reshape(batch * heads, q_len, dim),
              key.reshape(batch * heads, *key.shape[2:]), value.reshape(batch * heads, *value.shape[2:]),
              sink_s, keep_s)
    out_s, lse_s = jax.lax.map(one_slice, slices)
    out = out_s.reshape(batch, heads, q_len, v_dim)
    if not return_lse:
        return out
    return out, lse_s.reshape(batch, heads, q_len)


class _Dropout(NamedTuple):
    """A call's dropout on the flex path: off (``rate`` 0), an explicit keep-mask (the
    slices carry their (L, S) part), or drawn from ``rng``: each (slice, query block) its
    key, ``rng`` folded with the slice's and the block's numbers, from which the block
    draws its keep-mask inside its ``jax.checkpoint`` (so the recomputation for the
    backward draws the same, and no (L, S) mask is made or kept)."""

    rate: float
    rng: Array | None

    def of_block(self, index: Array, number: Any, keep: Array | None, start: Any, rows: Any) -> Array | None:
        """What query block ``number`` of slice ``index`` draws from (its key) or reads (its
        ``rows`` rows of the slice's keep-mask ``keep`` (L, S) from ``start``, an int or,
        in the loops, traced), None without dropout."""
        if self.rate == 0.0:
            return None
        if self.rng is not None:
            return jax.random.fold_in(jax.random.fold_in(self.rng, index), number)
        assert keep is not None
        if isinstance(start, int):
            return keep[start:start + rows]
        return jax.lax.dynamic_slice_in_dim(keep, start, rows, axis=0)

    def apply(self, weights: Array, kept: Array | None, columns: Any) -> Array:
        """``dropout_weights`` of a block's weights (rows, n) with its keep-mask: drawn
        from the key ``kept`` (Bernoulli(1 - rate), (rows, n)), or its rows of the slice's
        keep-mask (rows, S) at the block's key ``columns`` (a (start, stop) span or
        positions)."""
        if kept is None:
            return weights
        if self.rng is not None:
            mask = jax.random.bernoulli(kept, 1.0 - self.rate, weights.shape)
        elif isinstance(columns, tuple):
            mask = kept[:, columns[0]:columns[1]]
        else:
            mask = jnp.take(kept, columns, axis=1)
        return dropout_weights(weights, self.rate, deterministic=False, dropout_mask=mask)


def run_call(q: Array, k: Array, v: Array, call: Any, *, scale: float) -> Array:
    """The flex path of a module's call whose mods stand for no named option (a row of
    ``_paths``): the call's options and arrays and the module's mods as one score mod and
    one mask mod (``attention_spec.flex.call_mods``), the mask mod's block mask (for the
    examples and heads it reads, ``attention_spec.flex.mask_reads``; concrete where the mods
    capture no traced array, so blocks are skipped under ``jit`` too), then
    ``flex_attention``, with the call's sinks and its explicit dropout mask (dropout drawn
    without one never comes here: ``attention_spec.flex.mod_blockers``).  q (B, H, T, D),
    k and v (B, Hkv, S, D)."""
    score_mod, mask_mod = spec.call_mods(call.options, offset=call.offset, mask=call.mask, bias=call.bias,
                                         lengths=call.kv_lengths, segments=call.segments,
                                         chunk_origin=call.chunk_origin)
    block_mask = None
    if mask_mod is not None:
        block_mask = _call_block_mask(mask_mod, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out = flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa=q.shape[1] != k.shape[1],
                         sinks=call.sinks, dropout_rate=call.options.dropout_rate, deterministic=not call.options.training,
                         dropout_mask=call.dropout_mask)
    assert not isinstance(out, tuple)
    return out


def _call_block_mask(mask_mod: Any, batch: int, heads: int, q_len: int, kv_len: int) -> BlockMask:
    """A module call's block mask: ``mask_mod``'s, for the examples and heads it reads.
    Where it captures traced arrays (a call's mask or lengths under ``jit``), the blocks
    are those that its untraced part (``attention_spec.flex.untraced_part``: the causal
    band, a window, the module's own mods) leaves non-empty, each partial (the whole mask
    mod decides its keys), so that a causal call still skips half of them."""
    def made(mod: Any) -> BlockMask:
        reads_b, reads_h = spec.mask_reads(mod)
        return create_block_mask(mod, batch if reads_b else 1, heads if reads_h else 1, q_len, kv_len,
                                 BLOCK_SIZE=DEFAULT_BLOCK)

    known = spec.untraced_part(mask_mod, _is_traced)
    if known is mask_mod or known is None:
        return made(mask_mod)
    outline = made(known)
    if any(_is_traced(t) for t in outline.tables()):  # a function of the user's own over traced arrays
        return made(mask_mod)
    n_kv = -(-kv_len // DEFAULT_BLOCK)
    num, indices, full_num, full_indices = _host(outline.tables())
    some = spec.dense_blocks(num, indices, n_kv) | spec.dense_blocks(full_num, full_indices, n_kv)
    num, indices = spec.ordered_blocks(some)
    return BlockMask(num, indices, None, None, BLOCK_SIZE=outline.BLOCK_SIZE, mask_mod=mask_mod,
                     seq_lengths=(q_len, kv_len))


def _dense_tables(q_len: int, kv_len: int, block_mask: BlockMask | None) -> tuple[Any, Any, tuple[int, int]]:
    """(partial, full): bool (B', H', n_q, n_kv), which key blocks of each query block are
    partial and which full for each (b, h), NumPy where the tables are concrete; and the
    block size.  No block mask: every block full, in blocks of ``DEFAULT_BLOCK``."""
    if block_mask is None:
        n_q, n_kv = -(-q_len // DEFAULT_BLOCK), -(-kv_len // DEFAULT_BLOCK)
        return (np.zeros((1, 1, n_q, n_kv), bool), np.ones((1, 1, n_q, n_kv), bool),
                (DEFAULT_BLOCK, DEFAULT_BLOCK))
    bq, bkv = block_mask.BLOCK_SIZE
    n_kv = -(-kv_len // bkv)
    tables = block_mask.tables()
    full_given = tables[2] is not None and tables[3] is not None
    if not any(_is_traced(t) for t in tables):
        num, idx, full_num, full_idx = _host(tables)
        partial = spec.dense_blocks(num, idx, n_kv)
        full = spec.dense_blocks(full_num, full_idx, n_kv) & ~partial if full_given else np.zeros_like(partial)
        return partial, full, (bq, bkv)
    traced = _dense_traced(tables[0], tables[1], n_kv)
    traced_full = _dense_traced(tables[2], tables[3], n_kv) & ~traced if full_given else jnp.zeros_like(traced)
    return traced, traced_full, (bq, bkv)


def _looped(query: Array, key: Array, block_mask: BlockMask | None, score_mod: Callable[..., Any] | None,
            scale: float, ct: Any, heads: int, out_dtype: Any, drop: _Dropout) -> Callable[..., tuple[Array, Array]]:
    """``flex_attention``'s function of one slice for many query blocks: the blocks sorted
    by how many key blocks they need and split into at most ``LOOPS`` groups, each group
    one ``jax.lax.map`` (a ``jax.checkpoint`` per block) over the key blocks the most of
    its blocks need (the others' extra blocks masked: the causal mask computes about 1/16
    more than the unrolled blocks); where the tables are traced, one loop over every key
    block.  The numbers are the unrolled blocks' (up to the order of a sum's terms): the
    same scores, mods, mask and softmax per key, sinks and dropout (a drawn keep-mask
    per (slice, query block), as theirs, other bits)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    partial, full, (bq, bkv) = _dense_tables(q_len, kv_len, block_mask)
    mask_mod = None if block_mask is None else block_mask.mask_mod
    n_q, n_kv = partial.shape[2], partial.shape[3]
    if isinstance(partial, np.ndarray) and isinstance(full, np.ndarray):
        needed: np.ndarray = np.asarray((partial | full).any(axis=(0, 1)))  # (n_q, n_kv): some (b, h) computes it
        order = np.argsort(needed.sum(axis=-1), kind="stable")
        groups = [g for g in np.array_split(order, min(LOOPS, n_q)) if len(g)]
        lists = []
        for group in groups:
            width = max(1, int(needed[group].sum(axis=-1).max()))
            rows = [np.flatnonzero(needed[i]) for i in group]
            lists.append(np.stack([np.pad(r, (0, width - len(r)), constant_values=-1) for r in rows]).astype(np.int32))
    else:  # traced tables: every key block, masked by their kinds
        order = np.arange(n_q)
        groups = [order]
        lists = [np.tile(np.arange(n_kv, dtype=np.int32), (n_q, 1))]
    inverse = np.argsort(np.concatenate(groups))

    def one_slice(operands: tuple[Any, ...]) -> tuple[Array, Array]:
        index, q, k, v, sink, keep = operands
        b, h = (index // heads).reshape(1, 1, 1, 1), (index % heads).reshape(1, 1, 1, 1)
        padded = jnp.pad(q, ((0, n_q * bq - q_len), (0, 0)))  # whole blocks; the extra rows see no key
        if keep is not None:
            keep = jnp.pad(keep, ((0, n_q * bq - q_len), (0, 0)))

        def of_slice(table: Any) -> Array:  # (B', H', n_q, n_kv) -> this slice's (n_q, n_kv)
            table = jnp.asarray(table)
            return table[b[0, 0, 0, 0] if table.shape[0] > 1 else 0, h[0, 0, 0, 0] if table.shape[1] > 1 else 0]

        part_rows, full_rows = of_slice(partial), of_slice(full)

        def block(i: Array, blocks: Array) -> tuple[Array, Array]:
            """Query block i over key blocks ``blocks`` (C,) (-1: none) -> (out (bq, Ev), lse (bq,))."""
            start = i * bq
            rows = jax.lax.dynamic_slice_in_dim(padded, start, bq, axis=0)
            live = blocks >= 0
            kept = jnp.maximum(blocks, 0)
            positions = (kept[:, None] * bkv + jnp.arange(bkv, dtype=jnp.int32)[None]).reshape(-1)  # (W,)
            valid = (live[:, None] & (positions.reshape(-1, bkv) < kv_len)).reshape(-1)
            positions = jnp.minimum(positions, kv_len - 1)
            kk, vv = jnp.take(k, positions, axis=0), jnp.take(v, positions, axis=0)
            n = positions.shape[0]
            scores = jnp.matmul(rows.astype(ct), kk.astype(ct).T, precision="highest") * scale  # (bq, W)
            q_idx = (start + jnp.arange(bq, dtype=jnp.int32)).reshape(1, 1, bq, 1)
            kv_idx = positions.reshape(1, 1, 1, n)
            # each key's block kind, (1, 1, 1, W) (explicit ranks: the library runs under
            # jax_numpy_rank_promotion="raise")
            is_full = jnp.repeat(full_rows[i][kept] & live, bkv).reshape(1, 1, 1, n)
            is_partial = jnp.repeat(part_rows[i][kept] & live, bkv).reshape(1, 1, 1, n)
            visible = is_full
            if mask_mod is not None:
                visible = visible | (is_partial & _asked(mask_mod, b, h, q_idx, kv_idx, (bq, n)))
            visible = visible & valid.reshape(1, 1, 1, n) & (q_idx < q_len)  # whole blocks: the extra rows see none
            mask = jnp.broadcast_to(visible, (1, 1, bq, n)).reshape(bq, n)
            if score_mod is not None:
                modded = score_mod(scores.reshape(1, 1, bq, n), b, h, q_idx, kv_idx)
                scores = jnp.broadcast_to(modded, (1, 1, bq, n)).reshape(bq, n).astype(ct)
                mask = mask & (scores != -jnp.inf)  # a score the mod makes -inf blocks its key
            weights = drop.apply(_softmax(scores, mask, sink), drop.of_block(index, i, keep, start, bq), positions)
            out = jnp.matmul(weights, vv.astype(ct), precision="highest").astype(out_dtype)
            return out, _sunk_lse(scores, mask, sink)

        step = jax.checkpoint(lambda xs: block(*xs))
        outs, lses = [], []
        for group, blocks in zip(groups, lists, strict=True):
            out, lse = jax.lax.map(step, (jnp.asarray(group, jnp.int32), jnp.asarray(blocks)))
            outs.append(out)
            lses.append(lse)
        out = jnp.take(jnp.concatenate(outs, axis=0), inverse, axis=0)  # (n_q, bq, Ev), in block order
        lse = jnp.take(jnp.concatenate(lses, axis=0), inverse, axis=0)
        return out.reshape(n_q * bq, -1)[:q_len], lse.reshape(n_q * bq)[:q_len]

    return one_slice


def _plan(query: Array, key: Array, block_mask: BlockMask | None) -> tuple[
        tuple[spec.QueryBlock, ...], Callable[..., Any] | None, list[tuple[Array, Array] | None]]:
    """(the query blocks and their key runs, the mask mod, and per query block the
    traced tables' kinds of its keys (full, partial), bool (B', H', 1, S), or None where
    the tables are concrete)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if block_mask is None:
        plan = spec.plan_without_mask(q_len, kv_len, DEFAULT_BLOCK)
        return plan, None, [None] * len(plan)
    tables = block_mask.tables()
    bq, bkv = block_mask.BLOCK_SIZE
    if not any(_is_traced(t) for t in tables):
        plan = spec.plan_blocks(*_host(tables), (bq, bkv), (q_len, kv_len))
        return plan, block_mask.mask_mod, [None] * len(plan)
    partial, full, _ = _dense_tables(q_len, kv_len, block_mask)  # (B', H', n_q, n_kv), traced

    def keys(kind: Array, i: int) -> Array:  # (B', H', 1, S): the kind of each key's block
        return jnp.repeat(kind[:, :, i], bkv, axis=-1)[:, :, None, :kv_len]

    plan = tuple(spec.QueryBlock(start, min(start + bq, q_len), (spec.KeyRun(0, kv_len, "traced"),))
                 for start in range(0, q_len, bq))
    return plan, block_mask.mask_mod, [(keys(full, i), keys(partial, i)) for i in range(len(plan))]


def _query_block(qb: spec.QueryBlock, score_mod: Callable[..., Any] | None, mask_mod: Callable[..., Any] | None,
                 flags: tuple[Array, Array] | None, scale: float, ct: Any, b: Array, h: Array,
                 drop: _Dropout) -> Callable[..., Any]:
    """The function of one query block of one slice (example ``b``, query head ``h``, each
    (1, 1, 1, 1)): (q (rows, E), k (S, E), v (S, Ev), the slice's sink () or None, its
    keep-mask's rows or key (``_Dropout.of_block``) or None) -> (out (rows, Ev) in the
    compute dtype, lse (rows,)).  The mods see what they see in the PyTorch twin, index
    arrays of rank 4 (q_idx (1, 1, rows, 1), kv_idx (1, 1, 1, n)) and scores (1, 1, rows, n)."""
    span, positions = qb.span, qb.key_positions

    def block(q: Array, k: Array, v: Array, sink: Array | None, kept: Any) -> tuple[Array, Array]:
        rows = q.shape[0]
        if span is not None:
            k, v = k[span[0]:span[1]], v[span[0]:span[1]]
        else:
            k, v = jnp.take(k, positions, axis=0), jnp.take(v, positions, axis=0)
        n = k.shape[0]
        scores = jnp.matmul(q.astype(ct), k.astype(ct).T, precision="highest") * scale  # (rows, n)
        q_idx = jnp.arange(qb.start, qb.stop, dtype=jnp.int32).reshape(1, 1, rows, 1)
        mask = _mask(qb, mask_mod, flags, b, h, q_idx, scores.shape)
        if score_mod is not None:
            kv_idx = jnp.asarray(positions, jnp.int32).reshape(1, 1, 1, n)
            modded = score_mod(scores.reshape(1, 1, rows, n), b, h, q_idx, kv_idx)
            scores = jnp.broadcast_to(modded, (1, 1, rows, n)).reshape(rows, n).astype(ct)
            finite = scores != -jnp.inf  # a score the mod makes -inf blocks its key
            mask = finite if mask is None else mask & finite
        weights = drop.apply(_softmax(scores, mask, sink), kept, span if span is not None else positions)
        return jnp.matmul(weights, v.astype(ct), precision="highest"), _sunk_lse(scores, mask, sink)

    return block


def _softmax(scores: Array, mask: Array | None, sink: Array | None) -> Array:
    """The library's softmax (``_reference.softmax``) of one slice's block (rows, n), with
    its head's ``sink`` () in the denominator where given."""
    if sink is None:
        return softmax(scores, mask)
    return softmax(scores[None], None if mask is None else mask[None], sinks=sink.reshape(1))[0]


def _sunk_lse(scores: Array, mask: Array | None, sink: Array | None) -> Array:
    """``_lse``, with a ``sink`` () joining the sum: log(sum_j exp(s_j) + exp(sink)), the
    sink for a row that sees no key.  A sink of -inf is no sink: the keys' lse as it is
    (``logaddexp`` of two -inf would give NaN gradients)."""
    lse = _lse(scores, mask)
    if sink is None:
        return lse
    none = sink == -jnp.inf
    return jnp.where(none, lse, jnp.logaddexp(lse, jnp.where(none, 0.0, sink)))


def _mask(qb: spec.QueryBlock, mask_mod: Callable[..., Any] | None, flags: tuple[Array, Array] | None,
          b: Array, h: Array, q_idx: Array, shape: tuple[int, ...]) -> Array | None:
    """A slice's block mask (True = may attend), (rows, n): None where every key computed is
    in a full block.  Tables made for one example or head (B' or H' of 1) serve every one."""
    if all(r.kind == "full" for r in qb.runs):
        return None

    def of_slice(table: Any) -> Array:  # (B', H', 1, keys) -> (1, 1, 1, keys): this slice's row
        table = jnp.asarray(table)
        row = table[b[0, 0, 0, 0] if table.shape[0] > 1 else 0, h[0, 0, 0, 0] if table.shape[1] > 1 else 0]
        return row.reshape(1, 1, *row.shape)

    pieces = []
    for run in qb.runs:
        width = (shape[0], run.stop - run.start)
        if run.kind == "full":
            pieces.append(jnp.ones(width, bool))
            continue
        kv_idx = jnp.arange(run.start, run.stop, dtype=jnp.int32).reshape(1, 1, 1, -1)
        if run.kind == "traced":  # every key block, masked by the traced tables' kinds
            assert flags is not None
            piece = of_slice(flags[0]) | (of_slice(flags[1]) & _asked(mask_mod, b, h, q_idx, kv_idx, width))
        elif run.kind == "partial":
            piece = _asked(mask_mod, b, h, q_idx, kv_idx, width)
        else:  # mixed: the kinds differ by (b, h)
            assert run.full is not None
            piece = of_slice(run.full)
            if run.partial is not None:
                piece = piece | (of_slice(run.partial) & _asked(mask_mod, b, h, q_idx, kv_idx, width))
        pieces.append(jnp.broadcast_to(piece, (1, 1, *width)).reshape(width))  # a mod's rank-4 answer
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)


def _asked(mask_mod: Callable[..., Any] | None, b: Array, h: Array, q_idx: Array, kv_idx: Array,
           width: tuple[int, int]) -> Array:
    """The mask mod's answer for one slice's (rows, keys) ``width``, checked (``_answer``):
    bool, broadcasting to (1, 1, rows, keys)."""
    assert mask_mod is not None
    return _answer("flex_attention", mask_mod(b, h, q_idx, kv_idx), (1, 1, *width))


def _lse(scores: Array, mask: Array | None) -> Array:
    """log(sum(exp(scores))) over the keys ``mask`` lets through (B, Hq, rows); -inf for a
    row that sees none (with zero gradients)."""
    if mask is None:
        return jax.nn.logsumexp(scores, axis=-1)
    live = jnp.broadcast_to(mask, scores.shape).any(axis=-1)
    kept = jnp.where(mask, scores, -jnp.inf)
    return jnp.where(live, jax.nn.logsumexp(jnp.where(live[..., None], kept, 0.0), axis=-1), -jnp.inf)


def blocks_computed(block_mask: BlockMask | None, q_len: int, kv_len: int) -> int:
    """How many (query block, key block) pairs a call over this block mask computes (for
    the tests: block skipping is real).  Without a block mask every pair, in blocks of
    ``DEFAULT_BLOCK``."""
    if block_mask is None:
        return -(-q_len // DEFAULT_BLOCK) * -(-kv_len // DEFAULT_BLOCK)
    plan = spec.plan_blocks(*_host(block_mask.tables()), block_mask.BLOCK_SIZE, (q_len, kv_len))
    return spec.blocks_computed(plan, block_mask.BLOCK_SIZE)
