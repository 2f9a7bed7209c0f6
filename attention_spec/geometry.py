"""Which keys a query sees: the one place that says it, read by every path of both twins.

A query at key position ``p`` (query ``i`` sits at ``p = i + offset``) sees key ``j`` when

    - left <= j - p <= right     (``reach``: ``window`` and ``causal``; None is unbounded), and
    - j < length                 (``kv_lengths``: the example's number of valid keys).

Everything else a call may block (a dense mask, segment ids, a ``-inf`` bias) is a mask
on top.  The functions here are index arithmetic, written once for three kinds of number:

    - Python ints, for the static structure of a call (``key_range``: which blocks the
      blockwise paths compute at all, the parameters of the CPU kernel);
    - traced integers (``key_range_traced``: JAX's tiled loops, whose block start is
      a loop variable), with the framework's ``clip`` passed in;
    - arrays of positions (``visible``: the band of a mask, an edge tile, a ring's
      chunks), with the comparisons that every array library overloads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class Band(Protocol):
    """What bounds the keys a query sees, read by every function here: ``causal`` and
    ``window`` (a call's ``CallOptions``, a path's static structure, or ``Reach``)."""

    @property
    def causal(self) -> bool: ...

    @property
    def window(self) -> tuple[int | None, int | None] | None: ...


class Reach(NamedTuple):
    """A ``Band`` from its two values."""

    causal: bool = False
    window: tuple[int | None, int | None] | None = None


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


def _clip(x: int, lo: int, hi: int) -> int:
    return max(lo, min(x, hi))


def key_range_traced(
    r0: Any, r1: Any, kv_len: int, offset: Any, band: Band, *, clip: Callable[[Any, Any, Any], Any] = _clip, every: bool = False,
) -> tuple[Any, Any]:
    """The keys [lo, hi) that some query of rows r0 .. r1 - 1 sees (``every``: that every
    one of them sees), 0 <= lo <= hi <= kv_len, an empty range where there are none.
    ``r0``, ``r1`` and ``offset`` may be traced integers, with ``clip`` the framework's
    (``jnp.clip``); Python ints by default."""
    left, right = reach(band)
    first, last = (r1 - 1, r0) if every else (r0, r1 - 1)  # the rows that bound each side
    lo = 0 if left is None else clip(first + offset - left, 0, kv_len)
    hi = kv_len if right is None else clip(last + offset + right + 1, 0, kv_len)
    return lo, clip(hi, lo, kv_len)


def key_range(r0: int, r1: int, kv_len: int, offset: int, band: Band) -> tuple[int, int]:
    """The keys [lo, hi) that queries r0 .. r1 - 1 (at key positions + offset) can see
    under ``band``: the blockwise paths of both twins never compute the
    blocks outside; hi == lo where no query of the block sees a key."""
    return key_range_traced(r0, r1, kv_len, offset, band)


def visible(lag: Any, left: int | None, right: int | None) -> Any:
    """bool array: ``left`` and ``right`` hold for ``lag`` = key position - query position
    (an array of any framework; None where neither side bounds it)."""
    seen = None
    if right is not None:
        seen = lag <= right
    if left is not None:
        seen = lag >= -left if seen is None else seen & (lag >= -left)
    return seen


def within_length(key_positions: Any, length: Any) -> Any:
    """bool array: the keys before ``length`` (per example, broadcast by the caller)."""
    return key_positions < length
