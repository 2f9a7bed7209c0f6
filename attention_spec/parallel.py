"""What the two ring attentions share: the layouts, the zigzag order, the checks and their
texts.  Framework-free (plain ints, shape tuples, dtype names, NumPy index arrays).

Also the ring's options beyond the layout: ``check_ring_rope`` (rope with global
positions needs self-attention; positions need rope).

A ring of N members (JAX devices along a mesh axis, or the ranks of a
``torch.distributed`` group) splits one sequence of S positions:

- ``layout="contiguous"``: member i holds positions [i * S/N, (i + 1) * S/N).
- ``layout="zigzag"``: the sequence is cut into 2N chunks of S/(2N) and member i holds
  chunks i and 2N-1-i, in that order.  Under a causal mask every member then does the
  same work at every step of the ring (a contiguous split leaves member 0 idle for
  most of it).  ``zigzag_order`` gives the permutation that lays a sequence out so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attention_spec.arrays import check_qkv

LAYOUTS = ("contiguous", "zigzag")

Shape = tuple[int, ...]


def check_layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        options = ", ".join(repr(a) for a in LAYOUTS)
        raise ValueError(f"layout must be one of {options}; got {layout!r}")
    return layout


def check_ring_sequence(seq_len: int, ring_size: int, layout: str) -> int:
    """Checks that a sequence of ``seq_len`` splits over a ring of ``ring_size`` in
    ``layout``; returns the length of one piece (S/N contiguous, S/(2N) zigzag)."""
    parts = ring_size if layout == "contiguous" else 2 * ring_size
    what = "the ring size" if layout == "contiguous" else "twice the ring size"
    if seq_len % parts:
        raise ValueError(
            f"ring attention with layout={layout!r} needs a sequence length divisible by {parts} "
            f"({what}); got sequence length {seq_len} over a ring of {ring_size}"
        )
    return seq_len // parts


def check_mesh_axis(axis_name: Any, mesh_axes: tuple[Any, ...]) -> None:
    if axis_name not in mesh_axes:
        raise ValueError(f"the mesh has no axis {axis_name!r} to run the ring over; its axes are {tuple(mesh_axes)}")


def check_ring_qkv(q: Shape, k: Shape, v: Shape, dtypes: tuple[str, str, str]) -> None:
    """q (B, H, T, D), k (B, Hkv, S, D) and v (B, Hkv, S, Dv), each sharded along its
    sequence: one B for all three; k and v may have fewer heads than q (grouped-query
    attention, Hkv dividing H; they travel the ring with Hkv heads) and another length
    than q (cross-attention, T != S)."""
    check_qkv(q, k, v, dtypes)
    if len(q) != 4:
        raise ValueError(
            "ring attention needs q of shape (B, H, T, D), k of shape (B, Hkv, S, D) and v of shape "
            f"(B, Hkv, S, Dv); got q {tuple(q)}, k {tuple(k)}, v {tuple(v)}"
        )


def zigzag_order(seq_len: int, ring_size: int) -> np.ndarray:
    """The positions of a sequence in zigzag order (int64, (S,)): ``x[..., order, :]`` lays
    it out so that member i's contiguous slice holds chunks i and 2N-1-i; ``np.argsort``
    of it undoes that.  Raises ``ValueError`` unless 2N divides S."""
    chunk = check_ring_sequence(seq_len, ring_size, "zigzag")
    chunks = np.arange(seq_len).reshape(2 * ring_size, chunk)
    members = [c for i in range(ring_size) for c in (i, 2 * ring_size - 1 - i)]
    return chunks[members].reshape(-1)


def piece_chunks(member: Any, ring_size: int, layout: str) -> tuple[Any, ...]:
    """The chunk indices that member ``member`` holds, in order: (i,) contiguous (chunks
    of S/N), (i, 2N-1-i) zigzag (chunks of S/(2N)).  ``member`` may be a traced integer
    (JAX's ``axis_index``)."""
    return (member,) if layout == "contiguous" else (member, 2 * ring_size - 1 - member)


def chunk_seen(q_chunk: Any, k_chunk: Any, q_piece: int, kv_piece: int) -> Any:
    """Whether a causal (top-left) mask lets query chunk ``q_chunk`` (of ``q_piece``
    positions) see anything of key chunk ``k_chunk`` (of ``kv_piece``): the chunk's first
    key comes no later than its last query.  The chunks may be traced integers (JAX)."""
    return k_chunk * kv_piece <= q_chunk * q_piece + q_piece - 1


def group_rows(t: Any, kv_heads: int) -> Any:
    """(B, H, T, X) -> (B, Hkv, G*T, X), any array with ``reshape``: the G = H / Hkv query
    heads that read one key/value head (head h reads h // G, as in ``functional``) stacked
    as rows, so that one matmul per key/value head serves its whole group (G = 1: a
    reshape that changes nothing)."""
    b, h, t_len, x = t.shape
    return t.reshape(b, kv_heads, (h // kv_heads) * t_len, x)


def ungroup_rows(t: Any, heads: int) -> Any:
    """(B, Hkv, G*T, X) -> (B, H, T, X): undoes ``group_rows``."""
    return t.reshape(t.shape[0], heads, -1, t.shape[-1])


RING_POSITIONS_WITHOUT_ROPE = (
    "ring attention takes positions only with rope= (they are the positions that rope turns q and k by)"
)


def check_ring_rope(q_len: int, kv_len: int, rope: Any, positions_given: bool) -> None:
    """``rope`` (a ``RopeConfig`` or None) and whether ``positions`` were given, for a ring
    over T = ``q_len`` queries and S = ``kv_len`` keys (the whole sequences).  rope turns
    q and k by the global position of their token, so it needs self-attention (T == S:
    one position per token); positions without rope turn nothing."""
    if rope is None:
        if positions_given:
            raise ValueError(RING_POSITIONS_WITHOUT_ROPE)
        return
    if q_len != kv_len:
        raise ValueError(
            "ring attention with rope needs self-attention (as many keys as queries: q and k are turned "
            f"by the positions of the same tokens); got {q_len} queries and {kv_len} keys"
        )


def layout_positions(seq_len: int, ring_size: int, layout: str) -> np.ndarray:
    """The global positions 0..S-1 of a sequence laid out for the ring (int64, (S,)):
    in order for ``"contiguous"``, in ``zigzag_order`` for ``"zigzag"``; member i's
    slice ``[i * S/N, (i + 1) * S/N)`` of it holds the positions of its own rows (the
    default positions by which rope turns them)."""
    return np.arange(seq_len) if layout == "contiguous" else zigzag_order(seq_len, ring_size)
