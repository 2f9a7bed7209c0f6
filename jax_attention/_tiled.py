"""The blockwise path for long sequences: ``lax.fori_loop``s over query blocks and, in
each, over the (rows, keys) tiles in its reach, with the online softmax
(``_online_softmax``).  The largest buffer is one tile: memory O(T * Dv + S * D) for
any S.  ``_blockwise`` chooses this form from ``_paths.LONG_SEQUENCE`` keys on.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec.geometry import key_range_traced, reach, visible, within_length
from jax_attention import _online_softmax
from jax_attention._canonical import Operands, compute_dtype
from jax_attention._reference import adjust
from jax_attention.masks import _and_masks as combine_masks


class FlashStatic(NamedTuple):
    """The static (hashable) structure of one blockwise slice; ``tile`` (rows, keys)
    selects the loops (this module's), None the unrolled blocks of ``block`` rows
    (``_blockwise``'s)."""

    block: int
    tile: tuple[int, int] | None
    backward_tile: tuple[int, int] | None
    causal: bool
    offset: int
    window: tuple[int | None, int | None] | None
    scale: float
    softcap: float | None
    precision: Any
    q_len: int
    kv_len: int
    chunk: int | None = None


def _tile_ranges(st: FlashStatic, r0: Array) -> tuple[Array, Array, Array, Array]:
    """For the query rows [r0, r0 + rows): the key tiles [first, last) within reach
    (``key_range_traced``), and within them [inner_first, inner_last), the tiles that
    every row of the block sees whole, which need no band."""
    rows, keys = st.tile  # type: ignore[misc]
    r1 = jnp.minimum(r0 + rows, st.q_len)
    lo, hi = key_range_traced(r0, r1, st.kv_len, st.offset, st, clip=jnp.clip)
    seen_lo, seen_hi = key_range_traced(r0, r1, st.kv_len, st.offset, st, clip=jnp.clip, every=True)
    empty = hi == lo
    first = lo // keys
    last = jnp.where(empty, first, -(-hi // keys))
    inner_first = jnp.where(empty, first, jnp.clip(-(-seen_lo // keys), first, last))
    inner_last = jnp.where(empty, first, jnp.clip(seen_hi // keys, inner_first, last))
    return first, inner_first, inner_last, last


def _tile_of(a: Array | None, r0: Array, c0: Array, rows: int, keys: int) -> Array | None:
    """The (rows, keys) tile at (r0, c0) of a (T or 1, S or 1) mask or bias (padded to
    whole tiles); a size-1 (broadcast) dimension stays size 1."""
    if a is None:
        return None
    zero = jnp.zeros((), jnp.int32)
    start = (r0 if a.shape[0] > 1 else zero, c0 if a.shape[1] > 1 else zero)
    return jax.lax.dynamic_slice(a, start, (rows if a.shape[0] > 1 else 1, keys if a.shape[1] > 1 else 1))


def _tile_logits(st: FlashStatic, q_b: Array, k_t: Array, v_t: Array, ops: Operands, r0: Array, c0: Array,
                 edge: bool) -> tuple[Array, Array, float, Array, Array]:
    """One tile of a slice whose bias and mask (padded, ``_tiled_operands``) and key
    count ``ops`` holds: (unscaled scores s, logits z with hidden keys at -inf, z's
    scale, k_t, v_t); as ``_blockwise``'s blocks.  An ``edge`` tile (one that some row sees only in
    part, or that reaches past S) gets the band, and its keys and values outside the
    block's reach are zeroed first, so that a NaN stored there stays out, as on the
    unrolled path, which never reads them."""
    rows, keys = st.tile  # type: ignore[misc]
    cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, keys), 1)
    allowed = _tile_of(ops.mask, r0, c0, rows, keys)
    if ops.lengths is not None:
        allowed = combine_masks(allowed, within_length(cols, ops.lengths))
    if edge:
        left, right = reach(st)
        position = r0 + st.offset + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)  # the rows' key positions
        band = jnp.broadcast_to(within_length(cols, st.kv_len), (rows, keys))
        seen = visible(cols, position, left, right, st.chunk)
        if seen is not None:
            band = band & seen
        allowed = combine_masks(allowed, band)
        in_reach = band.any(axis=0)[:, None]  # (keys, 1): seen by some row of the block
        k_t, v_t = jnp.where(in_reach, k_t, 0.0), jnp.where(in_reach, v_t, 0.0)
    raw = jnp.matmul(q_b, k_t.T, precision=st.precision)  # (rows, keys)
    if ops.bias is not None or st.softcap is not None:
        z, z_scale = adjust(raw * st.scale, _tile_of(ops.bias, r0, c0, rows, keys), st.softcap), 1.0
    else:
        z, z_scale = raw, st.scale
    if allowed is not None:
        z = jnp.where(allowed, z, -jnp.inf)
    return raw, z, z_scale, k_t, v_t


def _pad_to(a: Array, size: int, axis: int, value: Any = 0, *, broadcast: bool = True) -> Array:
    """``a`` padded with ``value`` to ``size`` along ``axis``.  With ``broadcast`` (a mask or a
    bias) a size-1 axis broadcasts and stays; without (q, k, v and per-row statistics) it
    is one row like any other: a single query (a decoding step) is padded to the tile."""
    if a.shape[axis] == size or (broadcast and a.shape[axis] == 1):
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths, constant_values=value)


def _tiled_operands(st: FlashStatic, q: Array, k: Array, v: Array,
                    ops: Operands) -> tuple[Array, Array, Array, Operands]:
    """q, k, v in the compute dtype, and ``ops`` with its bias (in the compute dtype)
    and mask, padded to whole tiles."""
    rows, keys = st.tile  # type: ignore[misc]
    t_pad, s_pad = -(-st.q_len // rows) * rows, -(-st.kv_len // keys) * keys
    ct = compute_dtype(q.dtype)
    q_p = _pad_to(q.astype(ct), t_pad, 0, broadcast=False)
    k_p, v_p = (_pad_to(t.astype(ct), s_pad, 0, broadcast=False) for t in (k, v))
    bias, mask = ops.bias, ops.mask
    if bias is not None:
        bias = _pad_to(_pad_to(bias.astype(ct), t_pad, 0), s_pad, 1)
    if mask is not None:
        mask = _pad_to(_pad_to(mask, t_pad, 0, False), s_pad, 1, False)
    return q_p, k_p, v_p, ops._replace(bias=bias, mask=mask)


def _key_tiles(st: FlashStatic, r0: Array, body: Any, carry: Any) -> Any:
    """``body(edge)`` over the key tiles in reach of the rows from r0: the edge tiles
    (with the band) before and after the inner ones that every row sees whole."""
    first, inner_first, inner_last, last = _tile_ranges(st, r0)
    carry = jax.lax.fori_loop(first, inner_first, body(True), carry)
    carry = jax.lax.fori_loop(inner_first, inner_last, body(False), carry)
    return jax.lax.fori_loop(inner_last, last, body(True), carry)


def tiled_forward(st: FlashStatic, q: Array, k: Array, v: Array,
                  ops: Operands) -> tuple[Array, tuple[Array, Array, Array]]:
    """The blockwise forward of one slice for long sequences: a ``fori_loop`` over query
    blocks, and in each a loop over the key tiles in reach with the online softmax (the
    output rescaled when the row maximum grows).  ``ops`` holds the slice's bias and mask
    (T or 1, S or 1), its key count () and its sink logit (), as ``_blockwise``'s
    ``_flash_forward`` takes them.  The band is applied only to the edge tiles; the sink
    logit joins each row's normaliser at the end (``_online_softmax.finish``).  (out in
    v's dtype, (out, row max, row sum) in the compute dtype)."""
    rows, keys = st.tile  # type: ignore[misc]
    q_p, k_p, v_p, ops = _tiled_operands(st, q, k, v, ops)
    ct, dv = q_p.dtype, v.shape[-1]
    z_scale = 1.0 if ops.bias is not None or st.softcap is not None else st.scale  # as ``_tile_logits``'s

    def query_block(i: Array, done: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        r0 = (i * rows).astype(jnp.int32)
        q_b = jax.lax.dynamic_slice_in_dim(q_p, r0, rows)

        def step(edge: bool) -> Any:
            def body(t: Array, carry: _online_softmax.State) -> _online_softmax.State:
                c0 = (t * keys).astype(jnp.int32)
                k_t, v_t = jax.lax.dynamic_slice_in_dim(k_p, c0, keys), jax.lax.dynamic_slice_in_dim(v_p, c0, keys)
                _, z, z_scale, _, v_t = _tile_logits(st, q_b, k_t, v_t, ops, r0, c0, edge)
                return _online_softmax.step(carry, z, z_scale, lambda p: jnp.matmul(p, v_t, precision=st.precision))
            return body

        carry = (jnp.full((rows, 1), -jnp.inf, ct), jnp.zeros((rows, 1), ct), jnp.zeros((rows, dv), ct))
        m, total, acc = _key_tiles(st, r0, step, carry)
        out_b, max_b, sum_b = _online_softmax.finish(m, total, acc, z_scale, ops.sinks)
        out, row_max, row_sum = done
        out = jax.lax.dynamic_update_slice_in_dim(out, out_b, r0, 0)
        row_max = jax.lax.dynamic_update_slice_in_dim(row_max, max_b, r0, 0)
        row_sum = jax.lax.dynamic_update_slice_in_dim(row_sum, sum_b, r0, 0)
        return out, row_max, row_sum

    t_pad = q_p.shape[0]
    done = (jnp.zeros((t_pad, dv), ct), jnp.zeros((t_pad, 1), ct), jnp.zeros((t_pad, 1), ct))
    out, row_max, row_sum = jax.lax.fori_loop(0, t_pad // rows, query_block, done)
    out, row_max, row_sum = out[: st.q_len], row_max[: st.q_len], row_sum[: st.q_len]
    return out.astype(v.dtype), (out, row_max, row_sum)


def tiled_backward(st: FlashStatic, residuals: Any, d_out: Array) -> tuple[Any, ...]:
    """The blockwise backward of one slice for long sequences, in the forward's loops:
    each tile's weights are recomputed from the saved row maximum and sum; dq is summed
    over a block's tiles, dk, dv (and a bias's gradient) are added into their tiles in
    place.  ``residuals`` are ``_blockwise._slice_backward``'s: q, k, v, the slice's
    operands and its (out, row max, row sum)."""
    q, k, v, ops, out_c, row_max, row_sum = residuals
    st = st._replace(tile=st.backward_tile)  # its own tile shape: the stats are per row, not per tile
    rows, keys = st.tile  # type: ignore[misc]
    q_p, k_p, v_p, ops_p = _tiled_operands(st, q, k, v, ops)
    ct, t_pad = q_p.dtype, q_p.shape[0]
    do = d_out.astype(ct)
    delta = _pad_to((do * out_c).sum(axis=-1, keepdims=True), t_pad, 0, broadcast=False)
    do, row_max, row_sum = (_pad_to(t, t_pad, 0, broadcast=False) for t in (do, row_max, row_sum))

    def query_block(i: Array, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        r0 = (i * rows).astype(jnp.int32)
        q_b, do_b, delta_b, m = (jax.lax.dynamic_slice_in_dim(a, r0, rows) for a in (q_p, do, delta, row_max))
        total = jax.lax.dynamic_slice_in_dim(row_sum, r0, rows)
        inv_total = 1.0 / jnp.where(total == 0, 1.0, total)

        def step(edge: bool) -> Any:
            def body(t: Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
                dq_b, dk, dv, d_bias = carry
                c0 = (t * keys).astype(jnp.int32)
                k_t, v_t = jax.lax.dynamic_slice_in_dim(k_p, c0, keys), jax.lax.dynamic_slice_in_dim(v_p, c0, keys)
                raw, z, z_scale, k_t, v_t = _tile_logits(st, q_b, k_t, v_t, ops_p, r0, c0, edge)
                p = _online_softmax.probabilities(z, m, z_scale) * inv_total  # the forward's weights
                dv = _add_tile(dv, jnp.matmul(p.T, do_b, precision=st.precision), c0)
                g = p * (jnp.matmul(do_b, v_t.T, precision=st.precision) - delta_b)  # w.r.t. z * z_scale
                if d_bias is not None:
                    d_bias = _add_bias_tile(d_bias, g, r0, c0)
                if st.softcap is not None:  # z = cap(s * scale) + bias
                    g = g * (1.0 - jnp.tanh(raw * st.scale / st.softcap) ** 2)
                ds = g * st.scale
                dq_b = dq_b + jnp.matmul(ds, k_t, precision=st.precision)
                dk = _add_tile(dk, jnp.matmul(ds.T, q_b, precision=st.precision), c0)
                return dq_b, dk, dv, d_bias
            return body

        dq, dk, dv, d_bias = grads
        carry = (jnp.zeros((rows, q_p.shape[-1]), ct), dk, dv, d_bias)
        dq_b, dk, dv, d_bias = _key_tiles(st, r0, step, carry)
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_b, r0, 0), dk, dv, d_bias

    grads = (jnp.zeros(q_p.shape, ct), jnp.zeros(k_p.shape, ct), jnp.zeros(v_p.shape, ct),
             None if ops_p.bias is None else jnp.zeros(ops_p.bias.shape, ct))
    dq, dk, dv, d_bias = jax.lax.fori_loop(0, t_pad // rows, query_block, grads)
    if d_bias is not None:
        d_bias = d_bias[: ops.bias.shape[0], : ops.bias.shape[1]]
    return dq[: st.q_len].astype(q.dtype), dk[: st.kv_len].astype(k.dtype), dv[: st.kv_len].astype(v.dtype), d_bias


def _add_tile(total: Array, g: Array, c0: Array) -> Array:
    """total[c0 : c0 + len(g)] += g, in place."""
    current = jax.lax.dynamic_slice_in_dim(total, c0, g.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(total, current + g, c0, 0)


def _add_bias_tile(total: Array, g: Array, r0: Array, c0: Array) -> Array:
    """Adds a tile's gradient into a (T or 1, S or 1) bias gradient at (r0, c0), summed
    over the bias's broadcast (size-1) dimensions."""
    if total.shape[0] == 1:
        g, r0 = g.sum(axis=0, keepdims=True), jnp.int32(0)
    if total.shape[1] == 1:
        g, c0 = g.sum(axis=1, keepdims=True), jnp.int32(0)
    current = jax.lax.dynamic_slice(total, (r0, c0), g.shape)
    return jax.lax.dynamic_update_slice(total, current + g, (r0, c0))
