"""The blockwise path: the reference math one block of queries at a time, never the
whole (T, S) scores, with FlashAttention's backward (a ``jax.custom_vjp``).  Below
``_paths.LONG_SEQUENCE`` keys its query blocks are unrolled (static shapes, here);
from it on the loops of ``_tiled`` walk (rows, keys) tiles.  ``functional.route``
chooses the form (``_paths.blockwise_plan``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import Array

from attention_spec.geometry import key_range, within_length
from jax_attention import _online_softmax
from jax_attention._canonical import Call, Operands, Structure, band, compute_dtype, float0
from jax_attention._reference import Precision, adjust
from jax_attention._tiled import FlashStatic, tiled_backward, tiled_forward
from jax_attention.masks import _and_masks as combine_masks

Plan = tuple[int, tuple[int, int] | None, tuple[int, int] | None]  # (query block, forward tile, backward tile)


def _part(a: Array | None, r0: int, r1: int, lo: int, hi: int) -> Array | None:
    """Rows [r0, r1) and keys [lo, hi) of a (T or 1, S or 1) mask or bias; a size-1
    (broadcast) dimension stays size 1."""
    if a is None:
        return None
    rows = slice(r0, r1) if a.shape[0] > 1 else slice(None)
    cols = slice(lo, hi) if a.shape[1] > 1 else slice(None)
    return a[rows, cols]


def _flash_blocks(st: FlashStatic):  # type: ignore[no-untyped-def]
    """(r0, r1, lo, hi) of every query block with keys in reach, and the empty ones."""
    for r0 in range(0, st.q_len, st.block):
        r1 = min(r0 + st.block, st.q_len)
        lo, hi = key_range(r0, r1, st.kv_len, st.offset, st)
        yield r0, r1, lo, hi


def _flash_logits(st: FlashStatic, q_c: Array, k_c: Array, ops: Operands, r0: int, r1: int, lo: int,
                  hi: int) -> tuple[Array, Array, float, Array | None]:
    """One block of one slice, whose bias, mask and key count ``ops`` holds
    (``_flash_forward``): (unscaled scores s, logits z, z's scale, allowed keys or None);
    the softmax is over ``z * z_scale``, the library's stable form (see ``_unnormalized``)."""
    raw = jnp.matmul(q_c[r0:r1], k_c[lo:hi].T, precision=st.precision)  # (r1 - r0, hi - lo)
    if ops.bias is not None or st.softcap is not None:
        part = _part(ops.bias, r0, r1, lo, hi)
        z, z_scale = adjust(raw * st.scale, part, st.softcap), 1.0
    else:
        z, z_scale = raw, st.scale
    allowed = _part(ops.mask, r0, r1, lo, hi)
    if ops.lengths is not None:
        allowed = combine_masks(allowed, within_length(jnp.arange(lo, hi), ops.lengths)[None, :])
    allowed = combine_masks(allowed, band(r1 - r0, hi - lo, r0 + st.offset, st, 2, start=lo))
    if allowed is not None:
        allowed = jnp.broadcast_to(allowed, z.shape)
    return raw, z, z_scale, allowed


def _flash_forward(st: FlashStatic, q: Array, k: Array, v: Array,
                   ops: Operands) -> tuple[Array, tuple[Array, Array, Array]]:
    """(out in v's dtype, (out, row max, row sum) in the compute dtype) of one slice;
    ``ops`` holds the slice's bias and mask (T or 1, S or 1), its key count () and its
    sink logit () (``_online_softmax.finish``), each None where the call has none."""
    if st.tile is not None:
        return tiled_forward(st, q, k, v, ops)
    ct = compute_dtype(q.dtype)
    q_c, k_c, v_c = q.astype(ct), k.astype(ct), v.astype(ct)
    outs, maxes, sums = [], [], []
    for r0, r1, lo, hi in _flash_blocks(st):
        if hi == lo:  # nothing within reach: zero rows
            outs.append(jnp.zeros((r1 - r0, v.shape[-1]), ct))
            maxes.append(jnp.zeros((r1 - r0, 1), ct))
            sums.append(jnp.zeros((r1 - r0, 1), ct))
            continue
        _, z, z_scale, allowed = _flash_logits(st, q_c, k_c, ops, r0, r1, lo, hi)
        if allowed is not None:
            z = jnp.where(allowed, z, -jnp.inf)
        mix = functools.partial(_mix, v_c[lo:hi], st.precision)
        # the online softmax's step from the empty state: the whole block at once
        state = _online_softmax.step(None, z, z_scale, mix)
        out, row_max, row_sum = _online_softmax.finish(*state, z_scale, ops.sinks)  # an empty row: max 0
        outs.append(out)
        maxes.append(row_max)
        sums.append(row_sum)
    out = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    row_max = jnp.concatenate(maxes, axis=0) if len(maxes) > 1 else maxes[0]
    row_sum = jnp.concatenate(sums, axis=0) if len(sums) > 1 else sums[0]
    return out.astype(v.dtype), (out, row_max, row_sum)


def _mix(values: Array, precision: Any, p: Array) -> Array:
    return jnp.matmul(p, values, precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: FlashStatic, q: Array, k: Array, v: Array, ops: Operands) -> Array:
    """The blockwise path over N (T, D) x (S, D) x (S, Dv) slices, with FlashAttention's
    backward.  ``ops`` holds the slices' operands, each None where the call has none:
    ``bias`` (N or 1, T or 1, S or 1) float, differentiable; ``mask`` bool of the same
    kind (a leading 1: one for every slice); ``lengths`` (N,) key counts; ``sinks`` (N,)
    each slice's sink logit in the compute dtype, differentiable.  The structure
    (causal, window, offset, blocks) is in ``st``."""
    return _slices_forward(st, q, k, v, ops, vectorised=_vectorised(st))[0]


def _per_slice(ops: Operands, **batched: Array) -> tuple[dict[str, Array], Operands]:
    """(the arrays that differ per slice, by name: ``batched`` and those of ``ops``'s
    fields; the bias and mask shared by every slice, as an ``Operands``).
    ``_slice_operands`` puts one slice's back together."""
    bias, mask = ops.bias, ops.mask
    shared = Operands(bias=bias[0] if bias is not None and bias.shape[0] == 1 else None,
                      mask=mask[0] if mask is not None and mask.shape[0] == 1 else None)
    for name, a, common in (("bias", bias, shared.bias), ("mask", mask, shared.mask),
                            ("lengths", ops.lengths, None), ("sinks", ops.sinks, None)):
        if a is not None and common is None:
            batched[name] = a
    return batched, shared


def _slice_operands(t: dict[str, Array], shared: Operands) -> Operands:
    """One slice's operands: its rows of ``_per_slice``'s arrays ``t``, or the ``shared``
    bias and mask."""
    return Operands(t.get("bias", shared.bias), t.get("mask", shared.mask), t.get("lengths"), t.get("sinks"))


def _one_block(st: FlashStatic) -> bool:
    """Whether each slice is a single unrolled block (S <= 128 by default): too little
    work for a ``lax.map`` / ``lax.scan`` step, so such slices run vectorised (``vmap``),
    forward and backward.  Measured on the 2-core CPU (causal, head width 64, float32):
    the core's forward + backward took 0.77-0.89x the time at B32 H4 S128 and B64 H4 S64,
    MultiHeadAttention's 0.95-0.97x at B32 H4 S128 (Zen 4).  The forward alone took
    1.05-1.08x then; vectorised, MultiHeadAttention's forward now takes 0.93-1.00x the
    time at B32 H4 S128 and 0.84-0.87x at B64 H4 S64 (Zen 5, two processes each, natively
    and in the AVX2 build).  The scores of every slice then exist at once, (N, T, S) with
    S at most a block: twice q's size at head width 64, as in training."""
    return st.tile is None and st.q_len <= st.block


def _vectorised(st: FlashStatic) -> bool:
    """Whether the slices run vectorised (``vmap``) rather than one at a time
    (``lax.map``): the loops, and single blocks (``_one_block``)."""
    return st.tile is not None or _one_block(st)


def _slices_forward(st: FlashStatic, q: Array, k: Array, v: Array, ops: Operands, *,
                    vectorised: bool) -> tuple[Array, Any]:
    """``_flash_forward`` over the slices, vectorised (``vmap``) or one at a time (``lax.map``).
    The loops (``st.tile``) always run vectorised: 1/1.2 the time of one slice at a time
    at S=16384, B1 H4.  Unrolled blocks one slice at a time are plain 2-d products, which
    XLA's CPU backend ran about 1.6x faster than the same products batched at B4 H8 S1024
    (benchmarks/profile_cpu.py), except for a single block (``_one_block``)."""
    xs, shared = _per_slice(ops, q=q, k=k, v=v)

    def one(t: dict[str, Array]) -> tuple[Array, tuple[Array, Array, Array]]:
        return _flash_forward(st, t["q"], t["k"], t["v"], _slice_operands(t, shared))

    out, (out_c, row_max, row_sum) = jax.vmap(one)(xs) if vectorised else jax.lax.map(one, xs)
    return out, (q, k, v, ops, out_c, row_max, row_sum)


def _flash_fwd(st: FlashStatic, q: Array, k: Array, v: Array, ops: Operands) -> tuple[Array, Any]:
    return _slices_forward(st, q, k, v, ops, vectorised=_vectorised(st))


def _flash_bwd(st: FlashStatic, residuals: Any, d_out: Array) -> tuple[Any, ...]:
    """One slice at a time (a ``lax.scan``, the gradient of a shared bias summed in its
    carry; for the loops too: vectorised, their backward took 1.2x longer at S=16384,
    B1 H4), except single-block slices, which run vectorised (``_one_block``).  The
    cotangent of the operands is an ``Operands``: the bias's and the sinks' gradients,
    none for the mask and the key counts."""
    q, k, v, ops, out_c, row_max, row_sum = residuals
    # the sinks' gradient is taken whole (``_sinks_gradient``), not slice by slice
    xs, shared = _per_slice(ops._replace(sinks=None), q=q, k=k, v=v, out_c=out_c, row_max=row_max,
                            row_sum=row_sum, d_out=d_out)
    d_sinks = None if ops.sinks is None else _sinks_gradient(st, ops, out_c, row_max, row_sum, d_out)

    def one(t: dict[str, Array]) -> tuple[Any, ...]:
        part = (t["q"], t["k"], t["v"], _slice_operands(t, shared), t["out_c"], t["row_max"], t["row_sum"])
        return _slice_backward(st, part, t["d_out"])

    if _one_block(st):
        dq, dk, dv, d_bias = jax.vmap(one)(xs)
        if shared.bias is not None:  # (N, T or 1, S or 1): one block each, summed
            d_bias = d_bias.sum(axis=0, keepdims=True)
    else:
        def step(d_shared_bias: Array | None, t: dict[str, Array]) -> tuple[Array | None, tuple[Any, ...]]:
            dq, dk, dv, d_bias = one(t)
            if d_shared_bias is not None:
                d_shared_bias, d_bias = d_shared_bias + d_bias, None
            return d_shared_bias, (dq, dk, dv, d_bias)

        start = None if shared.bias is None else jnp.zeros(shared.bias.shape, compute_dtype(shared.bias.dtype))
        d_shared_bias, (dq, dk, dv, d_bias) = jax.lax.scan(step, start, xs)
        if d_shared_bias is not None:
            d_bias = d_shared_bias[None]
    if d_bias is not None:
        d_bias = d_bias.astype(ops.bias.dtype)
    return dq, dk, dv, Operands(d_bias, float0(ops.mask), float0(ops.lengths), d_sinks)


def _sinks_gradient(st: FlashStatic, ops: Operands, out_c: Array, row_max: Array, row_sum: Array,
                    d_out: Array) -> Array:
    """(N,): the gradient of each slice's sink (``ops.sinks``, (N,)), a logit with no
    value: ``-sum_t p_sink(t) * rowsum(d_out * out)(t)`` (the softmax's backward on its
    logit, whose value gradient is 0).  The saved maximum is of z, whose scale is 1 where
    a bias (``ops.bias``) or soft-cap is applied to the scaled scores (``_flash_logits``)."""
    z_scale = 1.0 if st.softcap is not None or ops.bias is not None else st.scale
    delta = (d_out.astype(out_c.dtype) * out_c).sum(axis=-1, keepdims=True)  # (N, T, 1)
    sinks = cast(Array, ops.sinks)  # called only with sinks
    p_sink = _online_softmax.sink_probability(row_max, row_sum, z_scale, sinks[:, None, None])
    return -(p_sink * delta).sum(axis=(1, 2))


def _slice_backward(st: FlashStatic, residuals: Any, d_out: Array) -> tuple[Any, ...]:
    """(dq, dk, dv, d_bias) of one slice, from ``residuals`` (q, k, v, the slice's
    operands as ``_flash_forward`` takes them, and its (out, row max, row sum)).  Recomputes each block's weights
    from the saved row maximum and sum:
    p = exp((z - max) * z_scale) / sum, then the softmax's backward
    g = p * (d_out @ v^T - rowsum(d_out * out)) on the logits, carried back through
    the soft-cap and the scale to q and k; the bias gets g itself."""
    if st.backward_tile is not None:
        return tiled_backward(st, residuals, d_out)
    q, k, v, ops, out_c, row_max, row_sum = residuals
    ct = compute_dtype(q.dtype)
    q_c, k_c, v_c = q.astype(ct), k.astype(ct), v.astype(ct)
    do = d_out.astype(ct)
    delta = (do * out_c).sum(axis=-1, keepdims=True)  # (T, 1)
    dq = [jnp.zeros((0, q.shape[-1]), ct)]
    dk_t = jnp.zeros(k_c.shape[::-1], ct)  # dk and dv transposed: see the products below
    dv_t = jnp.zeros(v_c.shape[::-1], ct)
    d_bias = None if ops.bias is None else jnp.zeros(ops.bias.shape, ct)
    for r0, r1, lo, hi in _flash_blocks(st):
        if hi == lo:
            dq.append(jnp.zeros((r1 - r0, q.shape[-1]), ct))
            continue
        raw, z, z_scale, allowed = _flash_logits(st, q_c, k_c, ops, r0, r1, lo, hi)
        if allowed is not None:
            z = jnp.where(allowed, z, -jnp.inf)
        m, total = row_max[r0:r1], row_sum[r0:r1]
        p = _online_softmax.probabilities(z, m, z_scale) / jnp.where(total == 0, 1.0, total)  # the forward's weights
        do_b = do[r0:r1]
        # dv and dk as (width, keys) products, do^T @ p and q^T @ ds: XLA's CPU backend runs
        # p^T @ do, which transposes the large operand, at about half the rate.
        dv_t = dv_t.at[:, lo:hi].add(jnp.matmul(do_b.T, p, precision=st.precision))
        dp = jnp.matmul(do_b, v_c[lo:hi].T, precision=st.precision)
        g = p * (dp - delta[r0:r1])  # gradient of the loss w.r.t. the logits z * z_scale
        if ops.bias is not None or st.softcap is not None:  # z = cap(s * scale) + bias, z_scale = 1
            if d_bias is not None:
                d_bias = _add_part(d_bias, g, r0, r1, lo, hi)
            if st.softcap is not None:
                g = g * (1.0 - jnp.tanh(raw * st.scale / st.softcap) ** 2)
            ds = g * st.scale
        else:  # z = s, z_scale = scale
            ds = g * st.scale
        dq.append(jnp.matmul(ds, k_c[lo:hi], precision=st.precision))
        dk_t = dk_t.at[:, lo:hi].add(jnp.matmul(q_c[r0:r1].T, ds, precision=st.precision))
    dq_all = jnp.concatenate(dq, axis=0)
    return dq_all.astype(q.dtype), dk_t.T.astype(k.dtype), dv_t.T.astype(v.dtype), d_bias


def _add_part(total: Array, g: Array, r0: int, r1: int, lo: int, hi: int) -> Array:
    """Adds a block's (r1 - r0, hi - lo) gradient into a (T or 1, S or 1) bias gradient,
    summing over the bias's broadcast (size-1) dimensions."""
    if total.shape[0] == 1:
        g = g.sum(axis=0, keepdims=True)
    if total.shape[1] == 1:
        g = g.sum(axis=1, keepdims=True)
    rows = slice(r0, r1) if total.shape[0] > 1 else slice(None)
    cols = slice(lo, hi) if total.shape[1] > 1 else slice(None)
    return total.at[rows, cols].add(g)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise(q: Array, k: Array, v: Array, s: Structure, call: Call, *, scale: float, precision: Precision,
              plan: Plan) -> Array:
    """The reference math one block of queries at a time.  A causal block of rows
    [r0, r1) needs only the keys [0, r1): the hidden upper triangle is never computed,
    and at most (block, S) scores exist at once.  Likewise a ``window`` (and a causal
    mask aligned at key ``offset``, and a ``chunk``) restricts each block to the keys
    [lo, hi) within its reach (``key_range``); the blocks outside are skipped.

    Two forms, chosen by shape (``plan``, from ``_paths.blockwise_plan``):
    below ``_paths.LONG_SEQUENCE`` keys, the loop over query blocks is unrolled (static shapes)
    and each block's scores against all keys in its reach exist at once; from it on,
    ``lax.fori_loop``s walk (rows, keys) tiles with FlashAttention's online softmax
    (``_tiled``), so that the largest buffer is one tile.  Rows are normalised
    as in the reference path, except that the division by the row sum is applied to the
    (block, Dv) output instead of the (block, S) weights: one pass less over the scores,
    the same value up to rounding.  The gradient is FlashAttention's (``_flash``, a
    ``jax.custom_vjp``): the forward keeps only each row's maximum and sum, and the
    backward recomputes each block's scores from them, skipping the same blocks;
    training memory is O(T * D) per slice, never a (T, S) array.
    The structure (mask, causal, offset, window, chunk) is ``s``'s (``_canonical.structure``: a
    mask of q's rank); lengths, bias, soft-cap and sinks are the call's.  Sinks (H,), in
    the compute dtype, join each row's normaliser when the row is finished (``_online_softmax.finish``); the
    backward gives them their gradient."""
    lead, q_len, kv_len = q.shape[:-2], q.shape[-2], k.shape[-2]
    batch = math.prod(lead)
    block, tile, backward_tile = plan

    def slices(a: Array | None) -> Array | None:  # (..., T or 1, S or 1) -> (BH or 1, T or 1, S or 1)
        if a is None or all(d == 1 for d in a.shape[:-2]):  # None, or one for every slice
            return None if a is None else a.reshape(1, *a.shape[-2:])
        return jnp.broadcast_to(a, (*lead, *a.shape[-2:])).reshape(batch, *a.shape[-2:])

    kv_lengths, sinks = call.kv_lengths, call.sinks
    lengths = None
    if kv_lengths is not None:  # (B,) -> one length per (batch, head) slice
        per_slice = kv_lengths.reshape((-1,) + (1,) * (len(lead) - 1))
        lengths = jnp.broadcast_to(per_slice, lead).reshape(batch)
    static = FlashStatic(block, tile, backward_tile, s.causal, s.offset, s.window, scale, call.options.softcap,
                         precision, q_len, kv_len, s.chunk)
    q_s, k_s, v_s = (t.reshape(batch, *t.shape[-2:]) for t in (q, k, v))
    if sinks is not None:  # (H,) -> one logit per (batch, head) slice
        sinks = jnp.broadcast_to(sinks, lead).reshape(batch)
    ops = Operands(bias=slices(call.bias), mask=slices(s.mask), lengths=lengths, sinks=sinks)
    out = _flash(static, q_s, k_s, v_s, ops)  # (BH, T, Dv)
    return out.reshape(*lead, q_len, v.shape[-1])
