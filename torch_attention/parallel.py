"""Sequence parallelism for PyTorch: ring attention over a ``torch.distributed`` group.

Twin of ``jax_attention/parallel.py``; the layouts, the zigzag order and the error texts
are shared (``attention_spec.parallel``).

Dimension legend as ``functional``: B batch, H heads (Hkv key/value heads), T the whole
query sequence, S the whole key sequence (T = S for self-attention), D head_dim, Dv value
width; L = S / N (and T / N) is what each of the N ranks of the group holds.

How the ring works.  Each rank keeps its L queries and starts with its own L keys and
values, packed as one (B, Hkv, L, D + Dv) tensor.  At each of N steps it attends its
queries to the chunk it holds, folding the scores into an online softmax (running maximum
m of the unscaled scores s, running sum of exp((s - m) * scale) and accumulator, in
float32, float64 for float64 inputs: the scale comes after the subtraction, as on every
path of ``functional`` and in the JAX twin), then
sends the chunk to the next rank and receives the previous rank's (point-to-point,
``batch_isend_irecv``; gloo on CPU): N - 1 exchanges in the forward, one foreign chunk
held at a time.  Causal masking and ``kv_lengths`` use the chunks' global positions
(top-left aligned); a pair of chunks that the causal mask hides entirely is skipped.
A query that may attend to nothing gets a zero row.

Attention sinks (``sinks``, (H,), gpt-oss): each row's sink logit joins its denominator
where the ring finalises its online softmax (``_with_sinks``), once, after the last
chunk.  RoPE (``rope``): q and k are turned on each rank, before the ring, by their
tokens' global positions (``attention_spec.parallel.layout_positions``), so a chunk's keys
travel already turned.

The backward (an ``autograd.Function``, flash-attention-2 style) keeps the inputs, the
output and each row's maximum and sum, runs the ring again recomputing each block's
probabilities, adds to dq locally and to dk/dv that travel with their chunk (one exchange a
step), and a last exchange brings every dk/dv home: N exchanges in the backward.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from attention_spec import dtype_name
from attention_spec.arrays import check_sinks, host_array
from attention_spec.geometry import Reach, reach, visible, within_length
from attention_spec.options import check_chunk
from attention_spec.parallel import (
    check_layout,
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
from attention_spec.rope import RopeConfig, check_rope, check_rope_call, needs_seq_len
from torch_attention import functional
from torch_attention._canonical import Operands, canonical_chunk_origin

__all__ = ["from_zigzag", "ring_attention", "to_zigzag"]

#: Keys per inner block (as the JAX twin): one step holds (L, 1024) scores, not (L, L).
KEY_BLOCK = 1024


def to_zigzag(x: Tensor, ring_size: int, dim: int = -2) -> Tensor:
    """Lays ``x``'s sequence ``dim`` (S) out in zigzag order for a ring of ``ring_size``:
    rank i's contiguous slice (``chunk(ring_size, dim)[i]``) then holds chunks i and
    2N-1-i of S/(2N).  Raises ``ValueError`` unless 2N divides S."""
    order = torch.from_numpy(zigzag_order(x.shape[dim], ring_size)).to(x.device)
    return x.index_select(dim, order)


def from_zigzag(x: Tensor, ring_size: int, dim: int = -2) -> Tensor:
    """Undoes ``to_zigzag``: the sequence ``dim`` back in order."""
    order = zigzag_order(x.shape[dim], ring_size)
    return x.index_select(dim, torch.from_numpy(order.argsort()).to(x.device))


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Any = None,
    causal: bool = False,
    kv_lengths: Any = None,
    scale: float | None = None,
    layout: str = "contiguous",
    sinks: Tensor | None = None,
    rope: RopeConfig | None = None,
    positions: Any = None,
    chunk: int | None = None,
    chunk_origin: Any = None,
) -> Tensor:
    """Attention over sequences split across the ranks of ``group`` (None: the default
    group): this rank's q (B, H, T/N, D), k (B, Hkv, S/N, D), v (B, Hkv, S/N, Dv) -> its
    output (B, H, T/N, Dv).  Self-attention has T = S; cross-attention another key
    length.  With grouped heads (Hkv < H, dividing it; query head h reads key/value head
    h // (H / Hkv)) the keys and values travel with their Hkv heads.

    Equals ``functional.dot_product_attention`` on the whole sequences (its reference
    math, up to rounding), forward and backward.  Every rank of the group must call it
    with the same options and shapes.

    Args:
      causal: block the keys after each query (top-left aligned, by global position).
      kv_lengths: valid keys per example over the whole sequence (an int, ints or an
        integer tensor of shape () or (B,), each in [0, S]), the same on every rank.
        A query that may attend to nothing gets zeros, with zero gradients.
      scale: None = 1/sqrt(D); a float as given.
      layout: ``"contiguous"`` (rank i holds positions [iL, (i+1)L)) or ``"zigzag"``
        (rank i holds chunks i and 2N-1-i of S/(2N), in that order:
        ``to_zigzag(x, N).chunk(N, dim=-2)[i]``), which balances the causal work.
      sinks: attention sinks (gpt-oss), float (H,), the same on every rank: one logit per
        query head in the units of the scaled scores, in each row's softmax denominator
        (see ``functional.dot_product_attention``); differentiable (its gradient is
        summed over the group: every rank gets the whole of it).
      rope: a ``RopeConfig``: q and k are turned (``functional.apply_rope``) by the global
        positions of their tokens before the ring, by default 0..T-1 of the original
        order (this rank's rows: ``attention_spec.parallel.layout_positions``, so in
        zigzag its two chunks' positions).  Self-attention only (T == S).
      positions: with ``rope``, integers (B, T/N) or (1, T/N): this rank's rows' positions,
        in the order of its q (the layout's); replaces the default.  A tensor, or a list or
        NumPy array (checked as given, then made a tensor on q's device).  The scalings that
        depend on the sequence length see the largest position over the group + 1.
      chunk: chunked local attention (``check_chunk``): a query sees only the keys of
        its own chunk of ``chunk`` global positions (of the original order), with
        ``causal`` too where given.
      chunk_origin: where the chunks start counting, the global position of each
        example's token 0 (a left-padded row's first real token): an int or integers
        (B,), as ``functional.dot_product_attention``'s (the same on every rank); None: 0.

    Raises ``ValueError`` (the same texts as the JAX twin where they overlap) for a
    layout that is not one of the two, q/k/v that are not (B, H or Hkv, T/N or S/N, D)
    with one B and Hkv dividing H, a zigzag T/N or S/N that is odd (2N must divide T and
    S), bad ``kv_lengths``, sinks that are not (H,) (``check_sinks``), rope with T != S
    or positions without rope (``check_ring_rope``), or positions that are not (B, T/N)
    (``check_rope_call``); ``TypeError`` for mixed or non-float dtypes, non-float sinks
    or non-integer positions.
    """
    check_layout(layout)
    chunk = check_chunk(chunk)
    check_ring_qkv(tuple(q.shape), tuple(k.shape), tuple(v.shape),
                   (dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype)))
    group = dist.group.WORLD if group is None else group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, _, q_local, head_dim = q.shape
    kv_local = k.shape[2]
    q_piece = check_ring_sequence(q_local * size, size, layout)
    kv_piece = check_ring_sequence(kv_local * size, size, layout)
    lengths = functional.canonical_kv_lengths(kv_lengths, batch, kv_local * size)
    lengths = None if lengths is None else lengths.to(q.device)
    if sinks is not None:
        sinks = (sinks if isinstance(sinks, Tensor) else torch.as_tensor(sinks)).to(q.device)
    positions = _check_extras(q, (q_local * size, kv_local * size), sinks, rope, positions)
    origin = canonical_chunk_origin(chunk_origin, chunk, tuple(q.shape), q.device)
    ring = _Ring(
        group, size, rank, dist.get_global_rank(group, (rank + 1) % size),
        dist.get_global_rank(group, (rank - 1) % size), layout, q_piece, kv_piece, causal,
        functional.resolve_scale(scale, head_dim), chunk,
        None if isinstance(origin, int) and origin == 0 else torch.as_tensor(origin, device=q.device).expand(batch),
    )
    if rope is not None:
        q, k = _turned(ring, q, k, rope, positions)
    return _RingAttention.apply(q, k, v, lengths, sinks, ring)


def _check_extras(
    q: Tensor, seq_lens: tuple[int, int], sinks: Tensor | None, rope: RopeConfig | None, positions: Any
) -> Tensor | None:
    """The checks of ``sinks``, ``rope`` and ``positions`` (the JAX twin's texts, in its
    order), before any work; ``seq_lens``: (T, S) of the whole sequences.  Returns the
    positions as a tensor on q's device (a list or NumPy array checked as given first)."""
    if sinks is not None:
        check_sinks(tuple(sinks.shape), dtype_name(sinks.dtype), tuple(q.shape), "softmax")
    check_ring_rope(*seq_lens, rope, positions is not None)
    if rope is None:
        return None
    check_rope(rope)
    if positions is None:
        return None
    if not isinstance(positions, Tensor):
        positions = host_array("rope positions", positions)
    check_rope_call(tuple(q.shape), tuple(positions.shape), dtype_name(positions.dtype))
    return torch.as_tensor(positions, device=q.device)


def _turned(ring: _Ring, q: Tensor, k: Tensor, rope: RopeConfig, positions: Tensor | None) -> tuple[Tensor, Tensor]:
    """q and k turned by rope at their tokens' global positions (``positions`` or the
    layout's default); the scalings that depend on the sequence length see the largest
    position over the group + 1, as ``apply_rope`` on the whole sequence would."""
    seq_len = q.shape[2] * ring.size
    if positions is None:
        everyone = torch.from_numpy(layout_positions(seq_len, ring.size, ring.layout)).to(q.device)
        positions = everyone.reshape(ring.size, -1)[ring.rank][None]  # (1, T/N): this rank's rows
    elif needs_seq_len(rope):
        largest = positions.max().reshape(1).to(torch.int64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ring.group)
        seq_len = int(largest) + 1
    positions = positions.to(q.device)
    return (functional.apply_rope(q, positions, rope, seq_len=seq_len),
            functional.apply_rope(k, positions, rope, seq_len=seq_len))


class _Ring(NamedTuple):
    """The static description of one ring call, as seen from this rank."""

    group: Any
    size: int  # N
    rank: int  # this rank's place in the group
    next: int  # global rank to send to
    prev: int  # global rank to receive from
    layout: str
    q_piece: int  # query positions per piece: T/N contiguous, T/(2N) zigzag
    kv_piece: int  # key positions per piece: S/N contiguous, S/(2N) zigzag
    causal: bool
    scale: float
    chunk: int | None = None  # chunked local attention: the chunk's width in global positions
    origin: Tensor | None = None  # (B,): where each example's chunks start (None: at 0)


class _RingAttention(torch.autograd.Function):
    """(q, k, v, lengths, sinks, ring) -> out; the backward runs the ring again."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None, sinks: Tensor | None, ring: _Ring
    ) -> Tensor:
        operands = Operands(lengths=lengths, sinks=sinks)
        with torch.no_grad():
            out, (row_max, row_sum) = _forward(ring, q, k, v, operands)
        ctx.save_for_backward(q, k, v, out, row_max, row_sum)
        ctx.ring, ctx.operands = ring, operands
        return out

    @staticmethod
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, row_max, row_sum = ctx.saved_tensors
        with torch.no_grad():
            dq, dk, dv = _backward(ctx.ring, q, k, v, ctx.operands, out, (row_max, row_sum), d_out)
            d_sinks = None
            if ctx.operands.sinks is not None and ctx.needs_input_grad[4]:
                d_sinks = _sink_grad(ctx.ring, ctx.operands, out, (row_max, row_sum), d_out)
        return dq, dk, dv, None, d_sinks, None


def _exchange(ring: _Ring, t: Tensor) -> Tensor:
    """Sends ``t`` to the next rank and returns what the previous rank sent (a ring of
    one sends to itself: ``t``, with no message, which gloo cannot send to its own rank)."""
    if ring.size == 1:
        return t
    t = t.contiguous()
    received = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, ring.next, ring.group), dist.P2POp(dist.irecv, received, ring.prev, ring.group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _positions(chunk: int, piece: int, device: Any) -> Tensor:
    return chunk * piece + torch.arange(piece, device=device)  # (piece,), global positions


def _pieces(t: Tensor, piece: int) -> list[Tensor]:
    """(B, H, L, ...) -> this rank's pieces along the sequence (one, or two for zigzag)."""
    return list(t.split(piece, dim=2))


def _key_blocks(n: int) -> int:
    """The largest number of keys <= KEY_BLOCK that divides a piece of n keys."""
    return next(b for b in range(min(n, KEY_BLOCK), 0, -1) if n % b == 0)


def _allowed(ring: _Ring, q_pos: Tensor, k_pos: Tensor, lengths: Tensor | None) -> Tensor | None:
    """(B or 1, 1, Tq, Tk) bool, True = may attend, from global positions (None: all),
    the chunks counted from the ring's ``origin`` (B,) where it has one."""
    allowed = None
    left, right = reach(Reach(ring.causal))
    if ring.origin is not None:  # ``attention_spec.geometry``, at each example's origin
        allowed = visible(k_pos[None, None, None, :], q_pos[None, None, :, None], left, right, ring.chunk,
                          ring.origin[:, None, None, None])
    elif left is not None or right is not None or ring.chunk is not None:  # ``attention_spec.geometry``
        allowed = visible(k_pos[None, :], q_pos[:, None], left, right, ring.chunk)[None, None]
    if lengths is not None:
        valid = within_length(k_pos[None, :], lengths[:, None])[:, None, None, :]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def _without_padding(ring: _Ring, kv: Tensor, lengths: Tensor | None) -> Tensor:
    """kv (B, Hkv, L, D + Dv) with the keys and values past ``lengths`` set to 0: padding that
    holds NaN or Inf never reaches an output or a gradient (as in ``functional``)."""
    if lengths is None:
        return kv
    chunks = piece_chunks(ring.rank, ring.size, ring.layout)
    positions = torch.cat([_positions(c, ring.kv_piece, kv.device) for c in chunks])  # (L,)
    valid = within_length(positions[None, :], lengths[:, None])[:, None, :, None]  # (B, 1, L, 1)
    return kv.masked_fill(~valid, 0.0)


def _hidden(ring: _Ring, q_chunk: int, k_chunk: int) -> bool:
    """Whether the causal mask hides key chunk ``k_chunk`` from query chunk ``q_chunk``
    entirely: its first key comes after the chunk's last query."""
    return ring.causal and not chunk_seen(q_chunk, k_chunk, ring.q_piece, ring.kv_piece)


def _forward(ring: _Ring, q: Tensor, k: Tensor, v: Tensor, operands: Operands) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """This rank's forward, with the call's key counts ``lengths`` (B,) and ``sinks`` (H,)
    from ``operands`` (None where absent): out (B, H, L, Dv) in v's dtype, and the row
    statistics (B, H, L) in the compute dtype: the maximum of the unscaled scores (0 for a
    row with nothing to attend to) and the sum of exp((s - max) * scale) (0 there), the
    sinks folded into both (``_with_sinks``).  Kept apart, not as one log-sum-exp: at logits of
    1e10 the sum's logarithm is below the maximum's float32 spacing and would be lost."""
    lengths, sinks = operands.lengths, operands.sinks
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    width = k.shape[-1]
    q_chunks = piece_chunks(ring.rank, ring.size, ring.layout)
    queries = _pieces(q.to(ct), ring.q_piece)
    batch, heads, piece = *q.shape[:2], ring.q_piece
    states = [
        (q.new_full((batch, heads, piece), -torch.inf, dtype=ct), q.new_zeros((batch, heads, piece), dtype=ct),
         q.new_zeros((batch, heads, piece, v.shape[-1]), dtype=ct))
        for _ in queries
    ]
    kv = _without_padding(ring, torch.cat([k, v], dim=-1), lengths)  # (B, Hkv, L, D + Dv): one exchange per step
    for step in range(ring.size):
        k_chunks = piece_chunks((ring.rank - step) % ring.size, ring.size, ring.layout)
        for a, (q_a, q_chunk) in enumerate(zip(queries, q_chunks, strict=True)):
            for kv_b, k_chunk in zip(_pieces(kv.to(ct), ring.kv_piece), k_chunks, strict=True):
                if not _hidden(ring, q_chunk, k_chunk):
                    states[a] = _fold(ring, states[a], q_a, kv_b, width, _positions(q_chunk, ring.q_piece, q.device),
                                      _positions(k_chunk, ring.kv_piece, q.device), lengths)
        if step < ring.size - 1:
            kv = _exchange(ring, kv)
    outs, maxes, sums = [], [], []
    for state in states:
        m, row_sum, acc = state if sinks is None else _with_sinks(state, sinks.to(ct)[None, :, None], ring.scale)
        live = row_sum > 0
        outs.append(acc / torch.where(live, row_sum, torch.ones_like(row_sum))[..., None])
        maxes.append(torch.where(live, m, torch.zeros_like(m)))
        sums.append(row_sum)
    return torch.cat(outs, dim=2).to(v.dtype), (torch.cat(maxes, dim=2), torch.cat(sums, dim=2))


def _with_sinks(state: tuple[Tensor, Tensor, Tensor], sink: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The finished online-softmax state (m, l, acc) of rows (B, H, Tq) with each head's
    sink logit ``sink`` (1, H, 1), in the units of the scaled scores, joined to the sum as a
    key with no value.  The maximum m (of the unscaled scores) stays where the row's
    largest scaled score reaches the sink (its subtraction exact at any logit size), and
    becomes sink / scale where the sink is larger; a row that saw nothing gets m =
    sink / scale, l = 1 and acc = 0 (a zero row)."""
    m, row_sum, acc = state
    m_new = torch.where(m * scale >= sink, m, sink / scale)
    rescale = torch.exp((m - m_new) * scale)  # 1 where m stays, 0 for a row that saw nothing
    return m_new, row_sum * rescale + torch.exp(sink - m_new * scale), acc * rescale[..., None]


def _sink_grad(ring: _Ring, operands: Operands, out: Tensor, stats: tuple[Tensor, Tensor], d_out: Tensor) -> Tensor:
    """d loss / d sinks (H,), the ``sinks`` of ``operands`` (not None): -sum over the
    group's rows of p_sink * rowsum(dO * O), p_sink = exp(sink - m * scale) / l from the
    forward's statistics (the sink's weight), summed over the group (all-reduce) so that
    every rank holds the whole gradient."""
    sinks = operands.sinks
    assert sinks is not None  # called only for a call with sinks
    row_max, row_sum = stats
    ct = row_max.dtype
    sink = sinks.to(ct)[None, :, None]
    p_sink = torch.exp(sink - row_max * ring.scale) / row_sum  # (B, H, L): l >= p's share > 0 with sinks
    delta = (d_out.to(ct) * out.to(ct)).sum(dim=-1)
    grad = -(p_sink * delta).sum(dim=(0, 2))
    dist.all_reduce(grad, group=ring.group)
    return grad.to(sinks.dtype)


def _fold(
    ring: _Ring, state: tuple[Tensor, Tensor, Tensor], q: Tensor, kv: Tensor, width: int, q_pos: Tensor,
    k_pos: Tensor, lengths: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Online softmax: the state (m, l, acc) of queries q (B, H, Tq, D) after also seeing
    the keys and values kv (B, Hkv, Tk, D + Dv) at global positions ``k_pos``."""
    m, row_sum, acc = state
    block = _key_blocks(kv.shape[2])
    for start in range(0, kv.shape[2], block):
        kv_blk, pos = kv[:, :, start : start + block], k_pos[start : start + block]
        kv_heads = kv_blk.shape[1]
        scores = torch.matmul(group_rows(q, kv_heads), kv_blk[..., :width].transpose(-2, -1))
        scores = ungroup_rows(scores, q.shape[1])  # unscaled: m is their maximum
        allowed = _allowed(ring, q_pos, pos, lengths)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -torch.inf)
        m_new = torch.maximum(m, scores.amax(dim=-1))
        shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # nothing yet: 0
        p = torch.exp((scores - shift[..., None]) * ring.scale)
        correction = torch.exp((m - shift) * ring.scale)
        row_sum = row_sum * correction + p.sum(dim=-1)
        mixed = ungroup_rows(torch.matmul(group_rows(p, kv_heads), kv_blk[..., width:]), p.shape[1])
        acc = acc * correction[..., None] + mixed
        m = m_new
    return m, row_sum, acc


def _backward(
    ring: _Ring, q: Tensor, k: Tensor, v: Tensor, operands: Operands, out: Tensor,
    stats: tuple[Tensor, Tensor], d_out: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's backward: dq, dk, dv for its own q, k, v (in their dtypes), from the
    forward's ``operands`` (the key counts ``lengths`` read; the sinks' part of the
    gradient is ``_sink_grad``'s) and row statistics (maximum, sum)."""
    lengths = operands.lengths
    row_max, row_sum = stats
    ct = row_max.dtype
    inv_sum = 1.0 / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    width = k.shape[-1]
    q_chunks = piece_chunks(ring.rank, ring.size, ring.layout)
    d_out = d_out.to(ct)
    delta = (d_out * out.to(ct)).sum(dim=-1)  # (B, H, L): rowsum(dO * O)
    rows = list(zip(*(_pieces(t, ring.q_piece)
                      for t in (q.to(ct), d_out, row_max[..., None], inv_sum[..., None], delta[..., None])),
                    strict=True))
    d_queries = [torch.zeros_like(r[0]) for r in rows]
    kv = _without_padding(ring, torch.cat([k, v], dim=-1), lengths).to(ct)
    d_kv = torch.zeros_like(kv)  # travels with its chunk
    for step in range(ring.size):
        k_chunks = piece_chunks((ring.rank - step) % ring.size, ring.size, ring.layout)
        kv_pieces, dkv_pieces = _pieces(kv, ring.kv_piece), _pieces(d_kv, ring.kv_piece)
        for a, (row, q_chunk) in enumerate(zip(rows, q_chunks, strict=True)):
            for b, k_chunk in enumerate(k_chunks):
                if not _hidden(ring, q_chunk, k_chunk):
                    _grads(ring, row, kv_pieces[b], width, _positions(q_chunk, ring.q_piece, q.device),
                           _positions(k_chunk, ring.kv_piece, q.device), lengths, d_queries[a], dkv_pieces[b])
        if step < ring.size - 1:  # one exchange: k, v, dk and dv side by side
            kv, d_kv = _exchange(ring, torch.cat([kv, d_kv], dim=-1)).split(kv.shape[-1], dim=-1)
    # After N - 1 moves this rank holds the dk/dv of the next rank's chunk: send it home.
    d_kv = _exchange(ring, d_kv)
    dq = torch.cat(d_queries, dim=2)
    return dq.to(q.dtype), d_kv[..., :width].to(k.dtype), d_kv[..., width:].to(v.dtype)


def _grads(
    ring: _Ring, row: tuple[Tensor, ...], kv: Tensor, width: int, q_pos: Tensor,
    k_pos: Tensor, lengths: Tensor | None, dq: Tensor, d_kv: Tensor,
) -> None:
    """Adds, in place, to dq (B, H, Tq, D) and d_kv (B, Hkv, Tk, D + Dv) the parts from
    queries ``row`` (q, dO, row max, 1 / row sum, delta) attending to kv (B, Hkv, Tk, D + Dv),
    the probabilities recomputed as the forward formed them.  ``d_kv`` is a view of the
    travelling dk/dv."""
    q, d_out, row_max, inv_sum, delta = row
    block = _key_blocks(kv.shape[2])
    for start in range(0, kv.shape[2], block):
        kv_blk, pos = kv[:, :, start : start + block], k_pos[start : start + block]
        k_blk, v_blk = kv_blk[..., :width], kv_blk[..., width:]
        kv_heads, heads = kv_blk.shape[1], q.shape[1]  # a group's rows sum into its key/value head
        scores = ungroup_rows(torch.matmul(group_rows(q, kv_heads), k_blk.transpose(-2, -1)), heads)
        allowed = _allowed(ring, q_pos, pos, lengths)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -torch.inf)
        p = torch.exp((scores - row_max) * ring.scale) * inv_sum
        d_p = ungroup_rows(torch.matmul(group_rows(d_out, kv_heads), v_blk.transpose(-2, -1)), heads)
        ds = p * (d_p - delta) * ring.scale
        dq += ungroup_rows(torch.matmul(group_rows(ds, kv_heads), k_blk), heads)
        d_kv[:, :, start : start + block, :width] += torch.matmul(group_rows(ds, kv_heads).transpose(-2, -1),
                                                                  group_rows(q, kv_heads))
        d_kv[:, :, start : start + block, width:] += torch.matmul(group_rows(p, kv_heads).transpose(-2, -1),
                                                                  group_rows(d_out, kv_heads))
