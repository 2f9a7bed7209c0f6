"""Sequence parallelism for JAX: ring attention over one axis of a device mesh.

Twin of ``torch_attention/parallel.py``; the layouts, the zigzag order and the error
texts are shared (``attention_spec.parallel``).

Dimension legend as ``functional``: B batch, H heads (Hkv key/value heads), T the whole
query sequence, S the whole key sequence (T = S for self-attention), D head_dim, Dv value
width; L = S / N (and T / N) is what one of the N devices of the ring holds.

How the ring works.  Each device keeps its L queries and starts with its own L keys and
values, packed as one (B, Hkv, L, D + Dv) array.  At each of N steps it attends its queries
to the chunk it holds, folding the scores into an online softmax (running maximum ``m``
of the unscaled scores s, running sum ``l`` of exp((s - m) * scale) and accumulator, in
float32, float64 for float64 inputs: the scale comes after the subtraction, as on every
path of ``functional``, so logits of 1e10 stay exact), then
passes the chunk to the next device with one ``jax.lax.ppermute``: N - 1 permutes in the
forward, and every device holds one foreign chunk at a time.  Causal masking and
``kv_lengths`` use the chunks' global positions (top-left aligned, as everywhere in this
library); a pair of chunks that the causal mask hides entirely is skipped with
``lax.cond``.  A query that may attend to nothing gets a zero row.

Attention sinks (``sinks``, (H,), gpt-oss): each row's sink logit joins its denominator
where the ring finalises its online softmax (``_with_sinks``), once, after the last
chunk.  RoPE (``rope``): q and k are turned by their tokens' global positions
(``attention_spec.parallel.layout_positions`` by default) before the ring; rope is
elementwise along the sequence, so each device turns its own rows and a chunk's keys
travel already turned.

The backward (``jax.custom_vjp``, flash-attention-2 style) keeps only the inputs, the
output and each row's m and l: it runs the ring again, recomputing each block's
probabilities, adding to dq locally and to dk/dv that travel with their chunk (k, v, dk and
dv side by side, one permute a step), and a last permute brings every dk/dv home: N
permutes in the backward.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import Mesh, PartitionSpec

from attention_spec import dtype_name
from attention_spec.arrays import check_sinks, host_array
from attention_spec.geometry import Reach, reach, visible, within_length
from attention_spec.options import check_chunk
from attention_spec.parallel import (
    check_layout,
    check_mesh_axis,
    check_ring_qkv,
    check_ring_rope,
    check_ring_sequence,
    chunk_seen,
    group_rows,
    layout_positions,
    piece_chunks,
    ungroup_rows,
    zigzag_order,
)
from attention_spec.rope import RopeConfig, check_rope, check_rope_call
from jax_attention import _online_softmax, functional
from jax_attention._canonical import Operands, canonical_chunk_origin, float0

__all__ = ["from_zigzag", "ring_attention", "to_zigzag"]

#: Keys per inner block: a chunk longer than this is folded in a ``lax.scan`` over blocks
#: of at most this many keys, so one step holds (L, 1024) scores, not (L, L).
KEY_BLOCK = 1024


def to_zigzag(x: Array, ring_size: int, axis: int = -2) -> Array:
    """Lays ``x``'s sequence ``axis`` (S) out in zigzag order for a ring of ``ring_size``:
    device i's contiguous slice then holds chunks i and 2N-1-i of S/(2N).  Raises
    ``ValueError`` unless 2N divides S."""
    return jnp.take(x, jnp.asarray(zigzag_order(x.shape[axis], ring_size)), axis=axis)


def from_zigzag(x: Array, ring_size: int, axis: int = -2) -> Array:
    """Undoes ``to_zigzag``: the sequence ``axis`` back in order."""
    order = zigzag_order(x.shape[axis], ring_size)
    return jnp.take(x, jnp.asarray(order.argsort()), axis=axis)


def ring_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mesh: Mesh,
    axis_name: str,
    causal: bool = False,
    kv_lengths: Any = None,
    scale: float | None = None,
    layout: str = "contiguous",
    sinks: Array | None = None,
    rope: RopeConfig | None = None,
    positions: Any = None,
    chunk: int | None = None,
    chunk_origin: Any = None,
) -> Array:
    """Attention over sequences sharded along ``mesh``'s ``axis_name``:
    q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) -> (B, H, T, Dv), sharded like q.
    Self-attention has T = S; cross-attention another key length (S is then split as T
    is).  With grouped heads (Hkv < H, dividing it; query head h reads key/value head
    h // (H / Hkv)) the keys and values travel with their Hkv heads.

    Equals ``functional.dot_product_attention`` on the whole sequences (its reference
    math, up to rounding), forward and gradients, with T and S split over the N devices
    of the axis: each holds T/N queries and S/N keys, and keys and values go around the
    ring.  The
    arrays may come in any sharding (``shard_map`` reshards them to
    ``PartitionSpec(None, None, axis_name, None)``); other mesh axes see them replicated.

    Args:
      causal: block the keys after each query (top-left aligned, by global position).
      kv_lengths: valid keys per example (an int, ints or an integer array of shape () or
        (B,), each in [0, S]); keys at global positions >= the length are ignored.
        A query that may attend to nothing gets zeros, with zero gradients.
      scale: None = 1/sqrt(D); a float as given.
      layout: ``"contiguous"`` (device i holds positions [iS/N, (i+1)S/N)) or
        ``"zigzag"``: q, k and v (and the output) are in ``to_zigzag`` order, device i
        holding chunks i and 2N-1-i of S/(2N), which balances the causal work;
        ``kv_lengths`` still counts positions of the original order.
      sinks: attention sinks (gpt-oss), float (H,): one logit per query head in the units
        of the scaled scores, in each row's softmax denominator (see
        ``functional.dot_product_attention``); differentiable (replicated on the mesh).
      rope: a ``RopeConfig``: q and k are turned (``functional.apply_rope``) by the global
        positions of their tokens, by default 0..T-1 of the original order (in zigzag,
        ``to_zigzag`` of it: each device's rows have their two chunks' positions).
        Self-attention only (T == S).
      positions: with ``rope``, integers (B, T) or (1, T), in the order of q (the
        layout's); replaces the default.  An array, or a list or NumPy array (checked as
        given).
      chunk: chunked local attention (``check_chunk``): a query sees only the keys of
        its own chunk of ``chunk`` global positions (of the original order), with
        ``causal`` too where given.
      chunk_origin: where the chunks start counting, the global position of each
        example's token 0 (a left-padded row's first real token): an int or integers
        (B,), as ``functional.dot_product_attention``'s (replicated on the mesh); None: 0.

    Raises ``ValueError`` (the same texts as the PyTorch twin where they overlap) for a
    layout that is not one of the two, a mesh without ``axis_name``, q/k/v that are not
    (B, H or Hkv, T or S, D) with one B and Hkv dividing H, a sequence that N (zigzag:
    2N) does not divide, bad ``kv_lengths``, sinks that are not (H,) (``check_sinks``),
    rope with T != S or positions without rope (``check_ring_rope``), or positions that
    are not (B, T) (``check_rope_call``); ``TypeError`` for mixed or non-float dtypes,
    non-float sinks or non-integer positions.
    """
    check_layout(layout)
    chunk = check_chunk(chunk)
    check_mesh_axis(axis_name, tuple(mesh.axis_names))
    check_ring_qkv(tuple(q.shape), tuple(k.shape), tuple(v.shape),
                   (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype)))
    batch, _, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    ring_size = int(mesh.shape[axis_name])
    q_piece = check_ring_sequence(q_len, ring_size, layout)
    kv_piece = check_ring_sequence(kv_len, ring_size, layout)
    lengths = functional.canonical_kv_lengths(kv_lengths, batch, kv_len)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        check_sinks(tuple(sinks.shape), dtype_name(sinks.dtype), tuple(q.shape), "softmax")
    check_ring_rope(q_len, kv_len, rope, positions is not None)
    origin = canonical_chunk_origin(chunk_origin, chunk, tuple(q.shape))
    if rope is not None:
        q, k = _turned(q, k, rope, positions, ring_size, layout)
    anchored = not (isinstance(origin, int) and origin == 0)  # chunks from an origin per example
    ring = _Ring(axis_name, ring_size, layout, q_piece, kv_piece, causal, lengths is not None,
                 functional.resolve_scale(scale, head_dim), sinks is not None, chunk, anchored)
    sharded, replicated = PartitionSpec(None, None, axis_name, None), PartitionSpec()
    local = _shard_map(
        _ring_function(ring), mesh=mesh, in_specs=(sharded, sharded, sharded, replicated, replicated),
        out_specs=sharded,
    )
    ops = Operands(lengths=jnp.zeros((batch,), jnp.int32) if lengths is None else lengths, sinks=sinks)
    return local(q, k, v, ops, jnp.broadcast_to(jnp.asarray(origin, jnp.int32), (batch,)))


def _turned(q: Array, k: Array, rope: RopeConfig, positions: Any, ring_size: int, layout: str) -> tuple[Array, Array]:
    """q and k (B, H or Hkv, T, D), in the layout's order, turned by rope at their tokens'
    global positions: ``positions`` (B or 1, T) in that order, or by default the layout's
    order of 0..T-1.  Elementwise along the sequence: on sharded arrays each device turns
    its own rows.  The positions are checked (``check_rope_call``) before any work."""
    check_rope(rope)
    if positions is None:
        positions = layout_positions(q.shape[2], ring_size, layout)[None]  # (1, T), in q's order
    elif not isinstance(positions, jax.Array):
        positions = host_array("rope positions", positions)
    check_rope_call(tuple(q.shape), tuple(positions.shape), dtype_name(positions.dtype))
    positions = jnp.asarray(positions)
    return functional.apply_rope(q, positions, rope), functional.apply_rope(k, positions, rope)


def _shard_map(f: Any, *, mesh: Mesh, in_specs: Any, out_specs: Any) -> Any:
    # The per-device code branches on the device's ring position (lax.cond), which the
    # replication checker cannot follow: it is off.
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # jax < 0.7

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


class _Ring(NamedTuple):
    """The static description of one ring call (hashable: one ``custom_vjp`` per ring)."""

    axis_name: str
    size: int  # N
    layout: str
    q_piece: int  # query positions per piece: T/N contiguous, T/(2N) zigzag
    kv_piece: int  # key positions per piece: S/N contiguous, S/(2N) zigzag
    causal: bool
    padded: bool  # kv_lengths given
    scale: float
    has_sinks: bool  # sinks given (else the function's operands hold none)
    chunk: int | None = None  # chunked local attention: the chunk's width in global positions
    anchored: bool = False  # the chunks counted from each example's origin (else from 0)


@functools.lru_cache(maxsize=64)
def _ring_function(ring: _Ring) -> Any:
    """The per-device function (q, k, v, ops, origin) -> out of one ring, with its
    backward; ``ops`` holds int32 ``lengths`` (B,) (zeros where the ring is not
    ``padded``) and the ``sinks`` (H,), None where the ring ``has_sinks`` not; ``origin``
    int32 (B,), where each example's chunks start (read where the ring is ``anchored``).
    The operands' cotangent is an ``Operands``: none for the lengths, and for the sinks
    this device's rows' share: ``shard_map`` sums the cotangents of a replicated input
    over the devices."""

    @jax.custom_vjp
    def attend(q: Array, k: Array, v: Array, ops: Operands, origin: Array) -> Array:
        return _forward(ring, q, k, v, ops, origin)[0]

    def forward(q: Array, k: Array, v: Array, ops: Operands, origin: Array) -> tuple[Array, tuple[Any, ...]]:
        out, stats = _forward(ring, q, k, v, ops, origin)
        return out, (q, k, v, ops, origin, out, stats)

    def backward(residuals: tuple[Any, ...], d_out: Array) -> tuple[Any, ...]:
        q, k, v, ops, origin, out, stats = residuals
        dq, dk, dv = _backward(ring, q, k, v, cast(Array, ops.lengths), origin, out, stats, d_out)
        d_sinks = _sink_grad(ring, ops, out, stats, d_out) if ring.has_sinks else None
        return dq, dk, dv, Operands(lengths=float0(ops.lengths), sinks=d_sinks), float0(origin)

    attend.defvjp(forward, backward)
    return attend


def _next(ring: _Ring) -> list[tuple[int, int]]:
    return [(i, (i + 1) % ring.size) for i in range(ring.size)]


def _positions(chunk: Any, piece: int) -> Array:
    return chunk * piece + jnp.arange(piece)  # (piece,), global positions


def _pieces(t: Array, piece: int) -> list[Array]:
    """(B, H, L, ...) -> the device's pieces along the sequence (one, or two for zigzag)."""
    return [t[:, :, i * piece : (i + 1) * piece] for i in range(t.shape[2] // piece)]


def _key_blocks(n: int) -> int:
    """The largest number of keys <= KEY_BLOCK that divides a piece of n keys."""
    return next(b for b in range(min(n, KEY_BLOCK), 0, -1) if n % b == 0)


def _allowed(ring: _Ring, q_pos: Array, k_pos: Array, lengths: Array, origin: Array) -> Array | None:
    """(B or 1, 1, Tq, Tk) bool, True = may attend, from global positions (None: all),
    the chunks counted from ``origin`` (B,) where the ring is ``anchored``."""
    allowed = None
    if ring.causal or ring.chunk is not None:  # the keys within reach of each query (``attention_spec.geometry``)
        left, right = reach(Reach(causal=ring.causal))
        if ring.anchored:
            allowed = visible(k_pos[None, None, None, :], q_pos[None, None, :, None], left, right, ring.chunk,
                              origin[:, None, None, None])
        else:
            allowed = visible(k_pos[None, :], q_pos[:, None], left, right, ring.chunk)[None, None]
    if ring.padded:
        valid = within_length(k_pos[None, :], lengths[:, None])[:, None, None, :]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def _unless_hidden(ring: _Ring, q_chunk: Any, k_chunk: Any, update: Any, carry: Any) -> Any:
    """``update(carry)``, or ``carry`` as it is where the causal mask hides key chunk
    ``k_chunk`` from query chunk ``q_chunk`` entirely (its first key comes after the
    chunk's last query): a device-dependent branch, not a mask."""
    if not ring.causal:
        return update(carry)
    seen = chunk_seen(q_chunk, k_chunk, ring.q_piece, ring.kv_piece)
    return jax.lax.cond(seen, update, lambda unchanged: unchanged, carry)


def _without_padding(ring: _Ring, kv: Array, me: Array, lengths: Array) -> Array:
    """kv (B, Hkv, L, D + Dv) with the keys and values past ``lengths`` set to 0: padding that
    holds NaN or Inf never reaches an output or a gradient (as in ``functional``)."""
    if not ring.padded:
        return kv
    chunks = piece_chunks(me, ring.size, ring.layout)
    positions = jnp.concatenate([_positions(c, ring.kv_piece) for c in chunks])  # (L,)
    valid = within_length(positions[None, :], lengths[:, None])[:, None, :, None]  # (B, 1, L, 1)
    return jnp.where(valid, kv, jnp.zeros((), kv.dtype))


def _split_blocks(t: Array, block: int) -> Array:
    """(B, H, n, X) -> (n / block, B, H, block, X), for a scan over key blocks."""
    b, h, n, x = t.shape
    return t.reshape(b, h, n // block, block, x).transpose(2, 0, 1, 3, 4)


def _mm(a: Array, b: Array) -> Array:
    return jnp.matmul(a, b, precision="highest")


def _scores(q: Array, k: Array) -> Array:
    """(B, H, Tq, Tk) unscaled scores of q (B, H, Tq, D) against k (B, Hkv, Tk, D).  The
    softmax exponentiates ``(s - max) * scale`` with the maximum of these, as every path
    of ``functional`` does: XLA fuses ``s * scale - max`` into one instruction whose
    rounding differs from the maximum's, which turns logits of 1e10 into inf and NaN."""
    return ungroup_rows(_mm(group_rows(q, k.shape[1]), jnp.swapaxes(k, -2, -1)), q.shape[1])


def _forward(ring: _Ring, q: Array, k: Array, v: Array, ops: Operands, origin: Array
             ) -> tuple[Array, tuple[Array, Array]]:
    """One device's forward, ``ops`` as ``_ring_function`` takes them: out (B, H, L, Dv)
    in v's dtype, and the row statistics (B, H, L) in the compute dtype: the maximum of
    the unscaled scores (0 for a row with nothing to attend to) and the sum of
    exp((s - max) * scale) (0 there), the sinks folded into both (``_with_sinks``).  Kept apart, not as one log-sum-exp: at logits of
    1e10 the sum's logarithm is below the maximum's float32 spacing and would be lost."""
    ct = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    width = k.shape[-1]
    me = jax.lax.axis_index(ring.axis_name)
    q_chunks = piece_chunks(me, ring.size, ring.layout)
    queries = _pieces(q.astype(ct), ring.q_piece)
    batch, heads = q.shape[:2]
    states = [
        (jnp.full((batch, heads, ring.q_piece), -jnp.inf, ct), jnp.zeros((batch, heads, ring.q_piece), ct),
         jnp.zeros((batch, heads, ring.q_piece, v.shape[-1]), ct))
        for _ in queries
    ]
    lengths = cast(Array, ops.lengths)  # always given: zeros where the ring is not padded
    kv = _without_padding(ring, jnp.concatenate([k, v], axis=-1), me, lengths)  # one permute per step
    for step in range(ring.size):
        k_chunks = piece_chunks((me - step) % ring.size, ring.size, ring.layout)
        for a, (q_a, q_chunk) in enumerate(zip(queries, q_chunks, strict=True)):
            for kv_b, k_chunk in zip(_pieces(kv.astype(ct), ring.kv_piece), k_chunks, strict=True):
                update = functools.partial(_fold, ring, q=q_a, kv=kv_b, width=width,
                                           q_pos=_positions(q_chunk, ring.q_piece),
                                           k_pos=_positions(k_chunk, ring.kv_piece), lengths=lengths,
                                           origin=origin)
                states[a] = _unless_hidden(ring, q_chunk, k_chunk, update, states[a])
        if step < ring.size - 1:
            kv = jax.lax.ppermute(kv, ring.axis_name, _next(ring))
    outs, maxes, sums = [], [], []
    for state in states:
        m, row_sum, acc = state
        if ring.has_sinks:
            m, row_sum, acc = _with_sinks(state, cast(Array, ops.sinks).astype(ct)[None, :, None], ring.scale)
        live = row_sum > 0
        outs.append(acc / jnp.where(live, row_sum, 1.0)[..., None])
        maxes.append(jnp.where(live, m, 0.0))
        sums.append(row_sum)
    stats = (jnp.concatenate(maxes, axis=2), jnp.concatenate(sums, axis=2))
    return jnp.concatenate(outs, axis=2).astype(v.dtype), stats


def _with_sinks(state: tuple[Array, Array, Array], sink: Array, scale: float) -> tuple[Array, Array, Array]:
    """The finished online-softmax state (m, l, acc) of rows (B, H, Tq) with each head's
    sink logit ``sink`` (1, H, 1), in the units of the scaled scores, joined to the sum as a
    key with no value.  The maximum m (of the unscaled scores) stays where the row's
    largest scaled score reaches the sink (its subtraction exact at any logit size), and
    becomes sink / scale where the sink is larger; a row that saw nothing gets m =
    sink / scale, l = 1 and acc = 0 (a zero row)."""
    m, row_sum, acc = state
    m_new = jnp.where(m * scale >= sink, m, sink / scale)
    rescale = jnp.exp((m - m_new) * scale)  # 1 where m stays, 0 for a row that saw nothing
    return m_new, row_sum * rescale + jnp.exp(sink - m_new * scale), acc * rescale[..., None]


def _sink_grad(ring: _Ring, ops: Operands, out: Array, stats: tuple[Array, Array], d_out: Array) -> Array:
    """This device's share of d loss / d sinks (``ops.sinks``, (H,)): -sum over its rows
    of p_sink * rowsum(dO * O), p_sink = exp(sink - m * scale) / l from the forward's
    statistics (the sink's weight); ``shard_map`` sums the shares over the devices."""
    row_max, row_sum = stats
    ct = row_max.dtype
    sinks = cast(Array, ops.sinks)  # called only where the ring has sinks
    p_sink = jnp.exp(sinks.astype(ct)[None, :, None] - row_max * ring.scale) / row_sum  # l > 0 with sinks
    delta = (d_out.astype(ct) * out.astype(ct)).sum(axis=-1)
    return -(p_sink * delta).sum(axis=(0, 2)).astype(sinks.dtype)


def _fold(
    ring: _Ring, state: tuple[Array, Array, Array], *, q: Array, kv: Array, width: int, q_pos: Array,
    k_pos: Array, lengths: Array, origin: Array,
) -> tuple[Array, Array, Array]:
    """Online softmax: the state (m, l, acc) of queries q (B, H, Tq, D) after also seeing
    the keys and values kv (B, Hkv, Tk, D + Dv) at global positions ``k_pos``."""
    block = _key_blocks(kv.shape[2])

    def one_block(carry: tuple[Array, Array, Array], xs: tuple[Array, Array]) -> Any:
        m, row_sum, acc = carry
        kv_blk, pos = xs
        scores = _scores(q, kv_blk[..., :width])  # unscaled: m is their maximum
        allowed = _allowed(ring, q_pos, pos, lengths, origin)
        if allowed is not None:
            scores = jnp.where(allowed, scores, -jnp.inf)

        def mix(p: Array) -> Array:
            return ungroup_rows(_mm(group_rows(p, kv_blk.shape[1]), kv_blk[..., width:]), p.shape[1])

        # the library's online-softmax step; its row statistics keep a trailing axis
        m, row_sum, acc = _online_softmax.step((m[..., None], row_sum[..., None], acc), scores, ring.scale, mix)
        return (m[..., 0], row_sum[..., 0], acc), None

    state, _ = jax.lax.scan(one_block, state, (_split_blocks(kv, block), k_pos.reshape(-1, block)))
    return state


def _backward(
    ring: _Ring, q: Array, k: Array, v: Array, lengths: Array, origin: Array, out: Array,
    stats: tuple[Array, Array], d_out: Array,
) -> tuple[Array, Array, Array]:
    """One device's backward: dq, dk, dv for its own q, k, v (in their dtypes), from the
    forward's row statistics (maximum, sum)."""
    row_max, row_sum = stats
    ct = row_max.dtype
    inv_sum = 1.0 / jnp.where(row_sum > 0, row_sum, 1.0)
    width = k.shape[-1]
    me = jax.lax.axis_index(ring.axis_name)
    q_chunks = piece_chunks(me, ring.size, ring.layout)
    d_out = d_out.astype(ct)
    delta = (d_out * out.astype(ct)).sum(axis=-1)  # (B, H, L): rowsum(dO * O)
    rows = list(zip(*(_pieces(t, ring.q_piece)
                      for t in (q.astype(ct), d_out, row_max[..., None], inv_sum[..., None], delta[..., None])),
                    strict=True))
    d_queries = [jnp.zeros_like(r[0]) for r in rows]
    kv = _without_padding(ring, jnp.concatenate([k, v], axis=-1), me, lengths).astype(ct)
    d_kv = jnp.zeros_like(kv)  # travels with its chunk
    for step in range(ring.size):
        k_chunks = piece_chunks((me - step) % ring.size, ring.size, ring.layout)
        kv_pieces, dkv_pieces = _pieces(kv, ring.kv_piece), _pieces(d_kv, ring.kv_piece)
        for a, (row, q_chunk) in enumerate(zip(rows, q_chunks, strict=True)):
            for b, k_chunk in enumerate(k_chunks):
                update = functools.partial(_grads, ring, row=row, kv=kv_pieces[b], width=width,
                                           q_pos=_positions(q_chunk, ring.q_piece),
                                           k_pos=_positions(k_chunk, ring.kv_piece), lengths=lengths,
                                           origin=origin)
                d_queries[a], dkv_pieces[b] = _unless_hidden(
                    ring, q_chunk, k_chunk, update, (d_queries[a], dkv_pieces[b])
                )
        d_kv = jnp.concatenate(dkv_pieces, axis=2)
        if step < ring.size - 1:  # one permute: k, v, dk and dv side by side
            moved = jax.lax.ppermute(jnp.concatenate([kv, d_kv], axis=-1), ring.axis_name, _next(ring))
            kv, d_kv = jnp.split(moved, 2, axis=-1)
    # After N - 1 moves this device holds the dk/dv of the next device's chunk: send it home.
    d_kv = jax.lax.ppermute(d_kv, ring.axis_name, _next(ring))
    dq = jnp.concatenate(d_queries, axis=2)
    return dq.astype(q.dtype), d_kv[..., :width].astype(k.dtype), d_kv[..., width:].astype(v.dtype)


def _grads(
    ring: _Ring, grads: tuple[Array, Array], *, row: tuple[Array, ...], kv: Array, width: int,
    q_pos: Array, k_pos: Array, lengths: Array, origin: Array,
) -> tuple[Array, Array]:
    """``grads`` = (dq (B, H, Tq, D), d_kv (B, Hkv, Tk, D + Dv)), each plus the part from
    queries ``row`` (q, dO, row max, 1 / row sum, delta) attending to kv (B, Hkv, Tk, D + Dv),
    the probabilities recomputed as the forward formed them."""
    dq, d_kv = grads
    q, d_out, row_max, inv_sum, delta = row
    block = _key_blocks(kv.shape[2])

    def one_block(dq: Array, xs: tuple[Array, Array]) -> tuple[Array, Array]:
        kv_blk, pos = xs
        k_blk, v_blk = kv_blk[..., :width], kv_blk[..., width:]
        scores = _scores(q, k_blk)  # (B, H, Tq, block), unscaled
        allowed = _allowed(ring, q_pos, pos, lengths, origin)
        if allowed is not None:
            scores = jnp.where(allowed, scores, -jnp.inf)
        p = _online_softmax.probabilities(scores, row_max, ring.scale) * inv_sum
        kv_heads, heads = kv_blk.shape[1], q.shape[1]  # a group's rows sum into its key/value head
        dv = _mm(jnp.swapaxes(group_rows(p, kv_heads), -2, -1), group_rows(d_out, kv_heads))
        d_p = ungroup_rows(_mm(group_rows(d_out, kv_heads), jnp.swapaxes(v_blk, -2, -1)), heads)
        ds = p * (d_p - delta) * ring.scale
        dq = dq + ungroup_rows(_mm(group_rows(ds, kv_heads), k_blk), heads)
        dk = _mm(jnp.swapaxes(group_rows(ds, kv_heads), -2, -1), group_rows(q, kv_heads))
        return dq, jnp.concatenate([dk, dv], axis=-1)

    dq, d_blocks = jax.lax.scan(one_block, dq, (_split_blocks(kv, block), k_pos.reshape(-1, block)))
    b, h, n, x = d_kv.shape
    return dq, d_kv + d_blocks.transpose(1, 2, 0, 3, 4).reshape(b, h, n, x)

