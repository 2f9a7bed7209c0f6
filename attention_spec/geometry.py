"""Which keys a query sees: the one place that says it, read by every path of both twins.

A query at key position ``p`` (query ``i`` sits at ``p = i + offset``) sees key ``j`` when

    - left <= j - p <= right     (``reach``: ``window`` and ``causal``; None is unbounded),
    - (j - o) // C == (p - o) // C
                                 (``chunk`` C: chunked local attention, Llama 4's
                                  ``attention_chunk_size``, counted from the example's
                                  chunk origin o, the key position of its token 0 (0 unless
                                  told: ``chunk_origin``); key positions o .. o + C - 1 are
                                  one chunk, o + C .. o + 2C - 1 the next; None: no chunks), and
    - j < length                 (``kv_lengths``: the example's number of valid keys).

The band depends on the lag ``j - p`` alone; a chunk on both absolute positions, so
``visible`` takes the two positions, not their difference.  A module counts chunks at
its ``positions=``: the origin is where each example's positions start (``chunk_origin``:
a left-padded row's first real token, as ``transformers`` counts Llama 4's chunks, its
``chunked_overlay``).  An origin known only at run time (per example, traced) makes the
chunks a dense mask; the blocks a path computes are then those of the window any origin
allows (``unanchored``): a chunk of C spans at most C - 1 keys on either side.

Everything else a call may block (a dense mask, segment ids, a ``-inf`` bias) is a mask
on top.  The functions here are index arithmetic, written once for three kinds of number:

    - Python ints, for the static structure of a call (``key_range``: which blocks the
      blockwise paths compute at all, the parameters of the CPU kernel);
    - traced integers (``key_range_traced``: JAX's tiled loops, whose block start is
      a loop variable), with the framework's ``clip`` passed in;
    - arrays of positions (``visible``: the band of a mask, an edge tile, a ring's
      shards), with the comparisons and the floor division that every array library
      overloads (``//`` floors in Python, NumPy, JAX and PyTorch alike).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class Band(Protocol):
    """What bounds the keys a query sees, read by every function here: ``causal``,
    ``window`` and ``chunk`` (a call's ``CallOptions``, a path's static structure, or
    ``Reach``)."""

    @property
    def causal(self) -> bool: ...

    @property
    def window(self) -> tuple[int | None, int | None] | None: ...

    @property
    def chunk(self) -> int | None: ...


class Reach(NamedTuple):
    """A ``Band`` from its values."""

    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    chunk: int | None = None


def reach(band: Band) -> tuple[int | None, int | None]:
    """(left, right): a query at key position p sees keys p - left .. p + right (None:
    unbounded on that side); ``band.causal`` caps ``right`` at 0."""
    left, right = band.window if band.window is not None else (None, None)
    if band.causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def band_reach(q_len: int, kv_len: int, offset: int | None, band: Band) -> tuple[int | None, int | None]:
    """``reach``, with a side that hides no key of this (q_len x kv_len) block dropped
    (None): one decoded query at the end, say, needs no band at all.  ``offset`` None
    (it differs per example) keeps both sides."""
    left, right = reach(band)
    if offset is not None:
        if right is not None and offset + right >= kv_len - 1:
            right = None
        if left is not None and q_len - 1 + offset - left <= 0:
            left = None
    return left, right


def band_chunk(q_len: int, kv_len: int, offset: int | None, band: Band, start: int = 0,
               origin: int | None = 0) -> int | None:
    """``band.chunk``, or None where it hides no key of this (q_len x kv_len) block: its
    keys (at key positions start .. start + kv_len - 1) and its queries (at offset ..
    offset + q_len - 1) all in one chunk, counted from ``origin``.  ``offset`` or
    ``origin`` None (it differs per example) keeps it."""
    c = band.chunk
    if c is not None and offset is not None and origin is not None:
        start, offset = start - origin, offset - origin
        if start // c == (start + kv_len - 1) // c == offset // c == (offset + q_len - 1) // c:
            return None
    return c


def check_chunk_origin(shape: tuple[int, ...] | None, dtype: str, batch: int, chunk: int | None) -> None:
    """``chunk_origin``: the key position where each example's chunks start counting (its
    token 0: a left-padded row's first real token), an int (``shape`` None) or integers
    of shape () or (batch,); only with ``chunk``."""
    if chunk is None:
        raise ValueError("chunk_origin is where chunk='s chunks start; it needs chunk")
    if dtype == "bool" or not dtype.startswith(("int", "uint")):
        raise TypeError(f"chunk_origin must hold integers (the key position of each example's token 0); "
                        f"got {'dtype ' + dtype if shape is not None else dtype}")
    if shape is not None and shape not in ((), (batch,)):
        raise ValueError(f"chunk_origin must be an int or have shape (batch,) = ({batch},); got shape {shape}")


def bounded(band: Band) -> bool:
    """Whether ``band`` bounds the keys at all (causal, a window or chunks)."""
    return band.causal or band.window is not None or band.chunk is not None


def _clip(x: int, lo: int, hi: int) -> int:
    return max(lo, min(x, hi))


def key_range_traced(
    r0: Any, r1: Any, kv_len: int, offset: Any, band: Band, *, clip: Callable[[Any, Any, Any], Any] = _clip, every: bool = False,
) -> tuple[Any, Any]:
    """The keys [lo, hi) that some query of rows r0 .. r1 - 1 sees (``every``: that every
    one of them sees), 0 <= lo <= hi <= kv_len, an empty range where there are none.
    ``r0``, ``r1`` and ``offset`` may be traced integers, with ``clip`` the framework's
    (``jnp.clip``); Python ints by default.  A chunk C narrows it to the chunks of the
    rows' positions (``every``: the one chunk they share, empty where they span two)."""
    left, right = reach(band)
    first, last = (r1 - 1, r0) if every else (r0, r1 - 1)  # the rows that bound each side
    lo = 0 if left is None else clip(first + offset - left, 0, kv_len)
    hi = kv_len if right is None else clip(last + offset + right + 1, 0, kv_len)
    if band.chunk is not None:  # keys of the chunks of the first .. the last row's position
        c = band.chunk
        lo = clip(((first + offset) // c) * c, lo, kv_len)
        hi = clip(((last + offset) // c + 1) * c, 0, hi)
    return lo, clip(hi, lo, kv_len)


def key_range(r0: int, r1: int, kv_len: int, offset: int, band: Band) -> tuple[int, int]:
    """The keys [lo, hi) that queries r0 .. r1 - 1 (at key positions + offset) can see
    under ``band``: the blockwise paths of both twins never compute the
    blocks outside; hi == lo where no query of the block sees a key."""
    return key_range_traced(r0, r1, kv_len, offset, band)


def visible(keys: Any, queries: Any, left: int | None, right: int | None, chunk: int | None = None,
            origin: Any = 0) -> Any:
    """bool array, ``keys`` and ``queries`` (key positions, arrays of any framework)
    broadcast together: ``left`` and ``right`` hold for the lag ``keys - queries``, and
    (``chunk``) the key lies in the query's chunk, the chunks counted from ``origin`` (an
    int, or an array broadcast with the two: each example's chunk origin); None where
    nothing bounds it."""
    seen = None
    if left is not None or right is not None:
        lag = keys - queries
        if right is not None:
            seen = lag <= right
        if left is not None:
            seen = lag >= -left if seen is None else seen & (lag >= -left)
    if chunk is not None:
        if not (isinstance(origin, int) and origin == 0):  # (origin 0: the slots' own arithmetic)
            keys, queries = keys - origin, queries - origin
        same = (keys // chunk) == (queries // chunk)
        seen = same if seen is None else seen & same
    return seen


def unanchored(band: Band) -> Reach:
    """``band`` with its chunk replaced by the window that a chunk of C allows at any
    origin, ``(C - 1, C - 1)`` within the band's own: what a path may skip when the chunks'
    origin differs per example (the chunks themselves then a dense mask, ``visible``)."""
    if band.chunk is None:
        return Reach(band.causal, band.window)
    c = band.chunk - 1
    left, right = band.window if band.window is not None else (None, None)
    return Reach(band.causal, (c if left is None else min(left, c), c if right is None else min(right, c)))


def chunk_origin(positions: Any, start: Any, furthest: Callable[[Any], tuple[Any, Any]]) -> Any:
    """Each example's chunk origin from its queries' ``positions`` (B, T) (or (1, T)),
    query i at key position ``start + i`` (``start`` an int or (B,)): the key position of
    its position 0, read at its furthest position, ``start + i - positions[b, i]`` for the
    last i where ``positions[b]`` is largest.  A module counts its chunks at its
    positions so: its tokens numbered one per key position from there (a left-padded row
    from its first real token, as ``generate`` numbers them: its last token is its
    furthest; its pads, whatever positions they hold up to the row's largest, hide no key
    and change nothing).  ``furthest(positions)`` is the framework's ``(max, the last
    argmax)`` over the last axis."""
    largest, at = furthest(positions)
    return start + at - largest


def within_length(key_positions: Any, length: Any) -> Any:
    """bool array: the keys before ``length`` (per example, broadcast by the caller)."""
    return key_positions < length
