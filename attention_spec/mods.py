"""Mods for ``flex_attention``, written once: one definition runs in PyTorch, JAX and NumPy.

A *mask mod* ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` of
example ``b`` and query head ``h`` may attend to key ``kv_idx`` (True = may attend, the
library's one polarity).  A *score mod* ``score_mod(score, b, h, q_idx, kv_idx) -> score``
changes a scaled score ``scale * q.k`` before the softmax.  These are PyTorch's
``flex_attention`` signatures.

Mods are called vectorised: the flex paths pass broadcastable integer index arrays,
b (B, 1, 1, 1), h (1, H, 1, 1) (the query head), q_idx (1, 1, T, 1) and kv_idx
(1, 1, 1, S), and the scores (B, H, T, S); the float64 oracle
(``parity_tests.reference.flex_attention``) passes NumPy scalars.  So a mod must be
elementwise and broadcast: operators (``==``, ``&``, ``+``, ...), indexing of an array it
captures by index arrays (``doc_ids[b, q_idx]``), and no Python ``if`` on an index, as
PyTorch's vmap-based semantics already require of a mod.

The library's mods are small frozen callables.  Each one says which named option of
``dot_product_attention`` it stands for (``options``: ``causal`` -> ``{"causal": True}``,
``sliding_window(l, r)`` -> ``{"window": (l, r)}``, ``softcap(c)`` -> ``{"softcap": c}``,
``documents`` -> ``{"segment_ids": ..., "kv_segment_ids": ...}``; None where there is none)
and which arrays it captures (``arrays``; ``with_arrays`` and ``map_arrays`` give the same
mod over other arrays: NumPy copies for the oracle, or a JAX pytree's leaves).  A captured
NumPy array (or list) is converted to the framework of the index arrays on each call, so a
mod built once over NumPy arrays runs in all three; give framework arrays (a torch
tensor with ``requires_grad``, a traced JAX array) for gradients to reach them.

Neither framework is imported here: the few functions a mod needs (``tanh``, ``where``)
are looked up from the type of their argument (a torch tensor: torch; a JAX array or
tracer: ``jax.numpy``; anything else: NumPy), among the modules already imported.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from attention_spec.options import check_softcap, check_window

__all__ = [
    "Indexed",
    "Mod",
    "alibi",
    "and_masks",
    "bias_table",
    "causal",
    "chain",
    "check_sizes",
    "documents",
    "noop_mask",
    "or_masks",
    "prefix_lm",
    "sliding_window",
    "softcap",
]


# --------------------------------------------------------------------------- the namespace


def _framework(x: Any) -> str:
    """``"torch"``, ``"jax"`` or ``"numpy"``: the framework an argument belongs to."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):  # tracers included
        return "jax"
    return "numpy"


def _tanh(x: Any) -> Any:
    kind = _framework(x)
    if kind == "torch":
        return sys.modules["torch"].tanh(x)
    if kind == "jax":
        return sys.modules["jax"].numpy.tanh(x)
    return np.tanh(x)


def _where(condition: Any, a: Any, b: Any) -> Any:
    """``where`` of the framework of ``condition``."""
    kind = _framework(condition)
    if kind == "torch":
        return sys.modules["torch"].where(condition, a, b)
    if kind == "jax":
        return sys.modules["jax"].numpy.where(condition, a, b)
    return np.where(condition, a, b)


def _like(array: Any, index: Any) -> Any:
    """A captured ``array`` in the framework of ``index``: a NumPy array becomes a torch
    tensor on the index's device or a JAX array; a framework's array stays as given."""
    if not isinstance(array, np.ndarray):
        return array
    kind = _framework(index)
    if kind == "torch":
        return sys.modules["torch"].as_tensor(array, device=index.device)
    if kind == "jax":
        # The dtype given: without it, a trace after switching jax.enable_x64 on reuses the
        # float32 constant of an earlier trace of the same NumPy array (jax 0.10).
        jax = sys.modules["jax"]
        return jax.numpy.asarray(array, dtype=jax.dtypes.canonicalize_dtype(array.dtype))
    return array


def _in_dtype_of(value: Any, score: Any) -> Any:
    """A captured array's values in the dtype of the framework's ``score`` (a float64
    NumPy array read in float32 scores: float32, as the JAX twin reads it without x64),
    so that both twins compute a mod in the scores' precision; NumPy scores (the float64
    oracle) and NumPy scalars keep what they are given."""
    kind = _framework(score)
    if kind == "torch" and value.dtype != score.dtype and value.is_floating_point():
        return value.to(score.dtype)
    if kind == "jax" and value.dtype != score.dtype and sys.modules["jax"].numpy.issubdtype(
            value.dtype, sys.modules["jax"].numpy.floating):
        return value.astype(score.dtype)
    return value


def _captured(value: Any) -> Any:
    """A captured array as kept: lists and tuples become NumPy arrays, NumPy and
    framework arrays are kept as given."""
    return np.asarray(value) if isinstance(value, (list, tuple)) else value


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.generic)


# --------------------------------------------------------------------------- sizes
# What a mod's captured arrays are indexed by, so that a call checks them against its
# sizes before any work (an array too short is an IndexError in PyTorch and NumPy, and a
# clamped index, silently another head's or example's entry, in JAX).

# index -> (what it is, the size's name)
_INDEXES = {"b": ("example", "B"), "h": ("query head", "H"), "q": ("query position", "Q_LEN"),
            "kv": ("key position", "KV_LEN")}


class Indexed(NamedTuple):
    """One captured array of a mod and what indexes it: ``axes`` one entry per axis,
    ``"b"``, ``"h"``, ``"q"``, ``"kv"`` (the example, the query head, the query and the key
    position) or None (an axis no index reads).  An axis of an index must have the call's
    size; ``broadcast``: or 1 (read at 0 for every index).  ``shift``: the query positions
    are ``q_idx + shift`` (a module's mod sees key positions), so a ``"q"`` axis must
    have at least ``Q_LEN + shift`` entries; None: a shift unknown here (traced), that
    axis unchecked.  ``hint``: what to do, added to the error."""

    label: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    broadcast: bool = False
    shift: int | None = 0
    hint: str = ""


def check_sizes(mod: Any, batch: int, heads: int, q_len: int, kv_len: int, *, where: str) -> None:
    """A mod's captured arrays (``mod.indexed()``; none for a function of the user's own,
    which this cannot see into) against a call's sizes B, H (query heads), Q_LEN, KV_LEN.
    Raises ValueError naming ``where`` (``"flex_attention: score_mod"``), the mod, the
    array, its shape and the size it needs: one text for both twins and the oracle."""
    if not isinstance(mod, Mod):
        return
    sizes = {"b": batch, "h": heads, "q": q_len, "kv": kv_len}
    for entry in mod.indexed():
        for axis, (index, n) in enumerate(zip(entry.axes, entry.shape, strict=False)):
            if index is None or (index == "q" and entry.shift is None):
                continue
            size = sizes[index]
            what, name = _INDEXES[index]
            if index == "q" and entry.shift:
                if n >= size + entry.shift or (entry.broadcast and n == 1):
                    continue
                want = f"at least {size + entry.shift} entries ({name}={size}, at key positions from {entry.shift})"
            else:
                if n == size or (entry.broadcast and n == 1):
                    continue
                want = f"{'1 or ' if entry.broadcast else ''}{size} entries ({name}={size})"
            raise ValueError(f"{where} {entry.label} has shape {entry.shape}: its axis {axis} is indexed by the "
                             f"{what}, so it must have {want}{entry.hint}")


def per_index(mod: Any, index: str) -> tuple[Indexed, ...]:
    """The captured arrays of a library mod that hold more than one entry along ``index``
    (``"b"``: the mod reads each example's; ``"h"``: each head's); none for a function of
    the user's own."""
    if not isinstance(mod, Mod):
        return ()
    return tuple(e for e in mod.indexed() if any(i == index and n > 1 for i, n in zip(e.axes, e.shape,
                                                                                      strict=False)))


# --------------------------------------------------------------------------- the base


@dataclass(frozen=True, eq=False)
class Mod:
    """A library mod: a frozen callable (a mask mod or a score mod, ``kind``).

    Two mods are equal when they are of one class with equal settings and the same
    captured array objects (``arrays``, compared by identity): a mod can be static data
    of a compiled function (the JAX twin's ``BlockMask`` keeps its ``mask_mod`` so)."""

    kind: ClassVar[str] = ""  # "mask" or "score"
    # The name the errors give it (its maker's).
    maker: ClassVar[str] = ""
    # The fields that may hold captured arrays (a field holding a Python int is a setting).
    _array_fields: ClassVar[tuple[str, ...]] = ()
    # What indexes each axis of each such field (``Indexed.axes``; a field not named here
    # is not checked).
    _axes: ClassVar[dict[str, tuple[str | None, ...]]] = {}
    # The fields whose arrays broadcast (an axis of 1 read at 0 for every index).
    _broadcast: ClassVar[tuple[str, ...]] = ()

    def indexed(self) -> tuple[Indexed, ...]:
        """Each captured array and what indexes its axes (``Indexed``), its parts' too:
        what ``check_sizes`` checks against a call's sizes."""
        return tuple(Indexed(f"{self.maker}: {f}", tuple(int(n) for n in v.shape), self._axes[f], f in self._broadcast)
                     for f in self._array_fields if f in self._axes and _is_array(v := getattr(self, f)))

    def check_sizes(self, batch: int, heads: int, q_len: int, kv_len: int, *, where: str) -> None:
        """This mod's captured arrays against a call's B, H, Q_LEN, KV_LEN
        (``check_sizes``).  Raises ValueError."""
        check_sizes(self, batch, heads, q_len, kv_len, where=where)

    @property
    def options(self) -> dict[str, Any] | None:
        """The named options of ``dot_product_attention`` that this mod stands for, or None
        where it stands for none (``route`` then keeps it on the flex path)."""
        return None

    @property
    def arrays(self) -> tuple[Any, ...]:
        """The arrays this mod captures, in a fixed order (its parts' in turn)."""
        return tuple(v for f in self._array_fields if _is_array(v := getattr(self, f)))

    def with_arrays(self, arrays: Sequence[Any]) -> Mod:
        """This mod over ``arrays`` instead (as many as ``arrays``, in its order)."""
        arrays = list(arrays)
        if len(arrays) != len(self.arrays):
            raise ValueError(f"{type(self).__name__} captures {len(self.arrays)} arrays; got {len(arrays)}")
        changes = {f: arrays.pop(0) for f in self._array_fields if _is_array(getattr(self, f))}
        return dataclasses.replace(self, **changes)

    def map_arrays(self, fn: Callable[[Any], Any]) -> Mod:
        """This mod with ``fn`` applied to each captured array (``np.asarray`` for the oracle)."""
        return self.with_arrays([fn(a) for a in self.arrays])

    def static_key(self) -> tuple[Any, ...]:
        """The class and the settings, without the arrays: what a compiled function over
        this mod depends on (the JAX twin's pytree structure)."""
        settings = tuple(
            (f.name, None if _is_array(v := getattr(self, f.name)) else v) for f in dataclasses.fields(self)
        )
        return (type(self), settings)

    def _key(self) -> tuple[Any, ...]:
        return (self.static_key(), tuple(id(a) for a in self.arrays))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mod) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# --------------------------------------------------------------------------- mask mods


@dataclass(frozen=True, eq=False)
class Causal(Mod):
    """Key at or before the query: ``q_idx >= kv_idx`` (top-left aligned)."""

    kind: ClassVar[str] = "mask"
    maker: ClassVar[str] = "causal"

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    @property
    def options(self) -> dict[str, Any]:
        return {"causal": True}


causal = Causal()


@dataclass(frozen=True, eq=False)
class Noop(Mod):
    """Every key: the mask mod of a block mask whose tables alone are the mask."""

    kind: ClassVar[str] = "mask"
    maker: ClassVar[str] = "noop_mask"

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx == q_idx) & (kv_idx == kv_idx)  # True, (1, 1, T, S) as a mod's answer broadcasts


# PyTorch's ``noop_mask``: what a ``BlockMask`` made without a mask mod applies (its partial
# blocks are then wholly visible).  It stands for no named option (``options`` None): with
# a block mask the tables are the mask, so such a call stays on the flex path, which reads them.
noop_mask = Noop()


@dataclass(frozen=True, eq=False)
class SlidingWindow(Mod):
    """Keys ``q_idx - left .. q_idx + right`` (inclusive)."""

    kind: ClassVar[str] = "mask"
    maker: ClassVar[str] = "sliding_window"
    left: int
    right: int = 0

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx - kv_idx <= self.left) & (kv_idx - q_idx <= self.right)

    @property
    def options(self) -> dict[str, Any]:
        return {"window": (self.left, self.right)}


def sliding_window(left: int, right: int = 0) -> SlidingWindow:
    """The mask mod of a sliding window: the query at position p sees keys p - left ..
    p + right (ints >= 0; ``right=0``: causal within the window).  Stands for
    ``window=(left, right)``.  Raises TypeError / ValueError (``check_window``'s texts)."""
    pair = check_window((left, right))
    if pair is None or pair[0] is None or pair[1] is None:
        raise TypeError(f"sliding_window takes two ints >= 0; got left={left!r}, right={right!r}")
    return SlidingWindow(pair[0], pair[1])


@dataclass(frozen=True, eq=False)
class PrefixLM(Mod):
    """Bidirectional within the prefix, causal after it."""

    kind: ClassVar[str] = "mask"
    maker: ClassVar[str] = "prefix_lm"
    _array_fields: ClassVar[tuple[str, ...]] = ("prefix_length",)
    _axes: ClassVar[dict[str, tuple[str | None, ...]]] = {"prefix_length": ("b",)}
    prefix_length: Any

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        prefix = self.prefix_length
        if _is_array(prefix):
            prefix = _like(prefix, b)[b]  # per example: (B, 1, 1, 1)
        return (kv_idx < prefix) | (q_idx >= kv_idx)


def prefix_lm(prefix_length: Any) -> PrefixLM:
    """The mask mod of a prefix LM: every query sees the keys of the prefix (positions
    below ``prefix_length``) and, after them, the keys up to its own position.
    ``prefix_length``: an int, or integers (B,) indexed by ``b`` (an array of any
    framework, or a list).  Stands for no named option (``options`` None)."""
    if isinstance(prefix_length, (bool, np.bool_)) or not (
        isinstance(prefix_length, (int, np.integer)) or _is_array(_captured(prefix_length))
    ):
        raise TypeError(f"prefix_lm takes an int or integers (B,); got {type(prefix_length).__name__}")
    if isinstance(prefix_length, np.integer):
        prefix_length = int(prefix_length)
    return PrefixLM(_captured(prefix_length))


@dataclass(frozen=True, eq=False)
class Documents(Mod):
    """Packed documents: a query sees only keys of its own document id."""

    kind: ClassVar[str] = "mask"
    maker: ClassVar[str] = "documents"
    _array_fields: ClassVar[tuple[str, ...]] = ("doc_ids", "kv_doc_ids")
    _axes: ClassVar[dict[str, tuple[str | None, ...]]] = {"doc_ids": ("b", "q"), "kv_doc_ids": ("b", "kv")}
    doc_ids: Any
    kv_doc_ids: Any = None

    def indexed(self) -> tuple[Indexed, ...]:
        found = super().indexed()
        if self.kv_doc_ids is None and _is_array(self.doc_ids):  # the keys' ids too
            found += (Indexed(f"{self.maker}: doc_ids", tuple(int(n) for n in self.doc_ids.shape), ("b", "kv"),
                              hint="; without kv_doc_ids the keys read doc_ids too: give kv_doc_ids (B, KV_LEN) "
                                   "for keys of another length than the queries"),)
        return found

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        ids = _like(self.doc_ids, b)
        kv_ids = ids if self.kv_doc_ids is None else _like(self.kv_doc_ids, b)
        return ids[b, q_idx] == kv_ids[b, kv_idx]

    @property
    def options(self) -> dict[str, Any]:
        return {"segment_ids": self.doc_ids, "kv_segment_ids": self.kv_doc_ids}


def documents(doc_ids: Any, kv_doc_ids: Any = None) -> Documents:
    """The mask mod of packed documents: ``doc_ids[b, q_idx] == kv_doc_ids[b, kv_idx]``,
    ``doc_ids`` integers (B, T) and ``kv_doc_ids`` (B, S) (None: ``doc_ids``, for T == S).
    Stands for ``segment_ids=doc_ids, kv_segment_ids=kv_doc_ids``."""
    doc_ids, kv_doc_ids = _captured(doc_ids), _captured(kv_doc_ids)
    for name, ids in (("doc_ids", doc_ids), ("kv_doc_ids", kv_doc_ids)):
        if ids is not None and (not _is_array(ids) or len(ids.shape) != 2):
            raise ValueError(f"documents: {name} must be integers of shape (B, length); got {_describe(ids)}")
    return Documents(doc_ids, kv_doc_ids)


def _describe(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if _is_array(value) else type(value).__name__


@dataclass(frozen=True, eq=False)
class _Combined(Mod):
    """Mods combined (their arrays: each part's in turn)."""

    parts: tuple[Callable[..., Any], ...] = ()

    def indexed(self) -> tuple[Indexed, ...]:
        """Each part's, named by its place (``and_masks part 2, documents: doc_ids``)."""
        found: list[Indexed] = []
        for i, part in enumerate(self.parts, 1):
            if isinstance(part, Mod):
                found += [e._replace(label=f"{self.maker} part {i}, {e.label}") for e in part.indexed()]
        return tuple(found)

    @property
    def arrays(self) -> tuple[Any, ...]:
        found: list[Any] = []
        for p in self.parts:
            if isinstance(p, Mod):
                found.extend(p.arrays)
        return tuple(found)

    def with_arrays(self, arrays: Sequence[Any]) -> Mod:
        arrays = list(arrays)
        if len(arrays) != len(self.arrays):
            raise ValueError(f"{type(self).__name__} captures {len(self.arrays)} arrays; got {len(arrays)}")
        parts = []
        for p in self.parts:
            if isinstance(p, Mod):
                n = len(p.arrays)
                parts.append(p.with_arrays(arrays[:n]))
                arrays = arrays[n:]
            else:
                parts.append(p)
        return dataclasses.replace(self, parts=tuple(parts))

    def static_key(self) -> tuple[Any, ...]:
        return (type(self), tuple(p.static_key() if isinstance(p, Mod) else p for p in self.parts))

    def _merged(self) -> dict[str, Any] | None:
        """The parts' options together, where each part has some and none contradicts
        another (one option set to two values)."""
        merged: dict[str, Any] = {}
        for p in self.parts:
            options = p.options if isinstance(p, Mod) else None
            if options is None:
                return None
            for name, value in options.items():
                if name in merged and not _same(merged[name], value):
                    return None
                merged[name] = value
        return merged


def _same(a: Any, b: Any) -> bool:
    return a is b if _is_array(a) or _is_array(b) else a == b


@dataclass(frozen=True, eq=False)
class AndMasks(_Combined):
    """Keys that every part lets through."""

    kind: ClassVar[str] = "mask"
    maker: ClassVar[str] = "and_masks"

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = b == b  # every key (no parts)
        for part in self.parts:
            result = result & part(b, h, q_idx, kv_idx)
        return result

    @property
    def options(self) -> dict[str, Any] | None:
        return self._merged()


@dataclass(frozen=True, eq=False)
class OrMasks(_Combined):
    """Keys that some part lets through."""

    kind: ClassVar[str] = "mask"
    maker: ClassVar[str] = "or_masks"

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = b != b  # no key (no parts)
        for part in self.parts:
            result = result | part(b, h, q_idx, kv_idx)
        return result

    @property
    def options(self) -> dict[str, Any] | None:
        return self.parts[0].options if len(self.parts) == 1 and isinstance(self.parts[0], Mod) else None


def _callables(name: str, mods: tuple[Any, ...]) -> tuple[Any, ...]:
    for m in mods:
        if not callable(m):
            raise TypeError(f"{name} takes callable mods; got {type(m).__name__}")
    return mods


def and_masks(*mask_mods: Callable[..., Any]) -> AndMasks:
    """The mask mod that lets a key through where every one of ``mask_mods`` does
    (none: every key).  Stands for the parts' options together, where each part has
    some and no two set one option to different values."""
    return AndMasks(_callables("and_masks", mask_mods))


def or_masks(*mask_mods: Callable[..., Any]) -> OrMasks:
    """The mask mod that lets a key through where any one of ``mask_mods`` does (none: no
    key).  Stands for no named option (one part: that part's)."""
    return OrMasks(_callables("or_masks", mask_mods))


# --------------------------------------------------------------------------- score mods


@dataclass(frozen=True, eq=False)
class Alibi(Mod):
    """ALiBi: ``score + slopes[h] * (kv_idx - q_idx)``."""

    kind: ClassVar[str] = "score"
    maker: ClassVar[str] = "alibi"
    _array_fields: ClassVar[tuple[str, ...]] = ("slopes",)
    _axes: ClassVar[dict[str, tuple[str | None, ...]]] = {"slopes": ("h",)}
    slopes: Any

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + _in_dtype_of(_like(self.slopes, h)[h], score) * (kv_idx - q_idx)


def alibi(slopes: Any) -> Alibi:
    """The score mod of ALiBi: ``score + slopes[h] * (kv_idx - q_idx)``, ``slopes`` (H,)
    per query head (differentiable where given as a framework's array).  Stands for no
    named option (it is a ``bias``, made dense)."""
    slopes = _captured(slopes)
    if not _is_array(slopes) or len(slopes.shape) != 1:
        raise ValueError(f"alibi: slopes must have shape (H,), one per query head; got {_describe(slopes)}")
    return Alibi(slopes)


@dataclass(frozen=True, eq=False)
class Softcap(Mod):
    """``cap * tanh(score / cap)``."""

    kind: ClassVar[str] = "score"
    maker: ClassVar[str] = "softcap"
    cap: float

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.cap * _tanh(score / self.cap)

    @property
    def options(self) -> dict[str, Any]:
        return {"softcap": self.cap}


def softcap(cap: float) -> Softcap:
    """The score mod of soft-capping (Gemma 2): ``cap * tanh(score / cap)``, ``cap > 0``.
    Stands for ``softcap=cap``.  Raises ValueError (``check_softcap``'s text)."""
    checked = check_softcap(cap)
    assert checked is not None
    return Softcap(checked)


@dataclass(frozen=True, eq=False)
class BiasTable(Mod):
    """A learned relative-position bias: ``score + table[h, m + clip(q_idx - kv_idx, -m, m)]``."""

    kind: ClassVar[str] = "score"
    maker: ClassVar[str] = "bias_table"
    _array_fields: ClassVar[tuple[str, ...]] = ("table",)
    _axes: ClassVar[dict[str, tuple[str | None, ...]]] = {"table": ("h", None)}
    table: Any

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        reach = (self.table.shape[-1] - 1) // 2  # m: the farthest distance with its own entry
        lag = q_idx - kv_idx
        lag = _where(lag > reach, reach, _where(lag < -reach, -reach, lag))
        return score + _in_dtype_of(_like(self.table, h)[h, lag + reach], score)


def bias_table(table: Any) -> BiasTable:
    """The score mod of a learned relative-position bias, ``table`` (H, 2m + 1) per query
    head: ``score + table[h, m + clip(q_idx - kv_idx, -m, m)]``.  Column m is the query's
    own position, m + d the key d positions before it, m - d the key d after it; keys
    farther than m share the last entry of their side (as T5's far buckets do).
    Differentiable where given as a framework's array.  Stands for no named option.
    Raises ValueError for a table that is not (H, odd width)."""
    table = _captured(table)
    if not _is_array(table) or len(table.shape) != 2 or table.shape[-1] % 2 != 1:
        raise ValueError(f"bias_table: table must have shape (H, 2m + 1), an odd width; got {_describe(table)}")
    return BiasTable(table)


@dataclass(frozen=True, eq=False)
class Chain(_Combined):
    """Score mods applied in turn."""

    kind: ClassVar[str] = "score"
    maker: ClassVar[str] = "chain"

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        for part in self.parts:
            score = part(score, b, h, q_idx, kv_idx)
        return score

    @property
    def options(self) -> dict[str, Any] | None:
        return self._merged()


def chain(*score_mods: Callable[..., Any]) -> Chain:
    """The score mod that applies ``score_mods`` in turn (the first one to the scaled
    score).  Stands for the parts' options together (e.g. ``chain(softcap(c))``:
    ``softcap=c``), where each part has some."""
    return Chain(_callables("chain", score_mods))


# --------------------------------------------------------------------------- a module's call
# A module built with ``score_mod=`` / ``mask_mod=`` that stand for no named option runs on
# the flex path (``attention_spec.flex.call_mods``): its own options and the call's arrays
# become these mods, and its mods see positions (``Positioned``).


def _at(array: Any, index: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """``array`` (B', H', T', S'), each of size 1 or the call's, at the index arrays (an
    axis of size 1 is read at 0 for every index: broadcast)."""
    array = _like(array, index)
    return array[tuple(i if n > 1 else 0 for i, n in zip((b, h, q_idx, kv_idx), array.shape, strict=True))]


def _concrete_max(array: Any) -> int | None:
    """The largest entry of an integer array, or None where it is traced (JAX) and
    unknown here."""
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(array, jax.core.Tracer):
        return None
    if hasattr(array, "detach"):  # a torch tensor
        array = array.detach().cpu()
    values = np.asarray(array)
    return int(values.max()) if values.size else 0


def _shifted(q_idx: Any, offset: Any, b: Any) -> Any:
    """The key positions of queries ``q_idx``: ``q_idx + offset`` (an int, or one per
    example, read at ``b``)."""
    if _is_array(offset):
        return q_idx + _like(offset, b)[b]
    return q_idx + offset if offset else q_idx


@dataclass(frozen=True, eq=False)
class Positioned(Mod):
    """A module's mod seen at positions: ``mod`` called with ``q_idx + offset`` (the
    query's key position: ``offset`` an int, or integers (B,) per example, a decode step's
    fill), so that ``causal`` means causal whatever the alignment."""

    maker: ClassVar[str] = "positioned"
    mod: Callable[..., Any] = causal
    offset: Any = 0

    @property
    def kind(self) -> str:  # type: ignore[override]
        return getattr(self.mod, "kind", "")

    def indexed(self) -> tuple[Indexed, ...]:
        """The offset (B,) where per example, and the mod's arrays at query positions
        shifted by the offset (its largest where it is concrete; unknown, unchecked,
        where traced)."""
        own: tuple[Indexed, ...] = ()
        shift: int | None = None if _is_array(self.offset) else int(self.offset)
        if _is_array(self.offset):
            own = (Indexed(f"{self.maker}: offset", tuple(int(n) for n in self.offset.shape), ("b",)),)
            shift = _concrete_max(self.offset)
        inner: tuple[Indexed, ...] = self.mod.indexed() if isinstance(self.mod, Mod) else ()
        return own + tuple(e._replace(shift=None if shift is None or e.shift is None else e.shift + shift)
                           for e in inner)

    def __call__(self, *args: Any) -> Any:
        if len(args) == 5:  # a score mod
            score, b, h, q_idx, kv_idx = args
            return self.mod(score, b, h, _shifted(q_idx, self.offset, b), kv_idx)
        b, h, q_idx, kv_idx = args
        return self.mod(b, h, _shifted(q_idx, self.offset, b), kv_idx)

    @property
    def arrays(self) -> tuple[Any, ...]:
        own = (self.offset,) if _is_array(self.offset) else ()
        return own + (self.mod.arrays if isinstance(self.mod, Mod) else ())

    def with_arrays(self, arrays: Sequence[Any]) -> Mod:
        arrays = list(arrays)
        if len(arrays) != len(self.arrays):
            raise ValueError(f"Positioned captures {len(self.arrays)} arrays; got {len(arrays)}")
        offset = arrays.pop(0) if _is_array(self.offset) else self.offset
        mod = self.mod.with_arrays(arrays) if isinstance(self.mod, Mod) else self.mod
        return Positioned(mod, offset)

    def static_key(self) -> tuple[Any, ...]:
        inner = self.mod.static_key() if isinstance(self.mod, Mod) else self.mod
        return (type(self), inner, None if _is_array(self.offset) else self.offset)


def positioned(mod: Callable[..., Any] | None, offset: Any) -> Callable[..., Any] | None:
    """``mod`` seen at positions ``q_idx + offset`` (``Positioned``); itself at offset 0."""
    if mod is None or (not _is_array(offset) and offset == 0):
        return mod
    return Positioned(mod, offset)


@dataclass(frozen=True, eq=False)
class CallMask(Mod):
    """The keys a module's call lets a query see, as a mask mod (the geometry's rule,
    ``attention_spec.geometry``): the band ``left <= kv_idx - (q_idx + offset) <= right``
    (None: unbounded), keys before ``lengths[b]``, a dense ``mask`` (B', H', T', S') and
    the same-segment mask ``segments`` (B, 1, T, S), each where the call has it, and
    (``chunk``) keys in the query's chunk of key positions, counted from ``chunk_origin``
    (an int, or one per example)."""

    kind: ClassVar[str] = "mask"
    maker: ClassVar[str] = "the call's mask"
    _array_fields: ClassVar[tuple[str, ...]] = ("offset", "lengths", "mask", "segments", "chunk_origin")
    _axes: ClassVar[dict[str, tuple[str | None, ...]]] = {"offset": ("b",), "lengths": ("b",),
                                                         "mask": ("b", "h", "q", "kv"),
                                                         "segments": ("b", "h", "q", "kv"),
                                                         "chunk_origin": ("b",)}
    _broadcast: ClassVar[tuple[str, ...]] = ("mask", "segments")
    offset: Any = 0
    left: int | None = None
    right: int | None = None
    lengths: Any = None
    mask: Any = None
    segments: Any = None
    chunk: int | None = None
    chunk_origin: Any = 0

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        from attention_spec.geometry import visible, within_length

        origin = _like(self.chunk_origin, b)[b] if _is_array(self.chunk_origin) else self.chunk_origin
        seen = visible(kv_idx, _shifted(q_idx, self.offset, b), self.left, self.right, self.chunk, origin)
        if self.lengths is not None:
            ok = within_length(kv_idx, _like(self.lengths, b)[b])
            seen = ok if seen is None else seen & ok
        for dense in (self.mask, self.segments):
            if dense is not None:
                ok = _at(dense, b, b, h, q_idx, kv_idx)
                seen = ok if seen is None else seen & ok
        return (kv_idx == kv_idx) if seen is None else seen


@dataclass(frozen=True, eq=False)
class CallScore(Mod):
    """A module call's own change of the scores, as a score mod, in the library's order:
    ``cap * tanh(score / cap)``, then ``+ bias`` (B', H', T', S')."""

    kind: ClassVar[str] = "score"
    maker: ClassVar[str] = "the call's scores"
    _array_fields: ClassVar[tuple[str, ...]] = ("bias",)
    _axes: ClassVar[dict[str, tuple[str | None, ...]]] = {"bias": ("b", "h", "q", "kv")}
    _broadcast: ClassVar[tuple[str, ...]] = ("bias",)
    cap: float | None = None
    bias: Any = None

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if self.cap is not None:
            score = self.cap * _tanh(score / self.cap)
        if self.bias is not None:
            score = score + _in_dtype_of(_at(self.bias, b, b, h, q_idx, kv_idx), score)
        return score


def portable(role: str, mod: Any) -> Any:
    """A module's ``score_mod`` / ``mask_mod`` ready for the other framework: a library
    mod over NumPy copies of its arrays (``map_arrays``); None as None.  Raises ValueError
    for a function of the user's own, which is written in one framework's operations."""
    if mod is None:
        return None
    if not isinstance(mod, Mod):
        raise ValueError(
            f"{role} is a function of its own ({getattr(mod, '__qualname__', type(mod).__name__)}), written in "
            f"one framework's operations: it cannot move to the other; build it from attention_spec.mods")
    return mod.map_arrays(_numpy)


def _numpy(array: Any) -> np.ndarray:
    if hasattr(array, "detach"):  # a torch tensor (a parameter included)
        array = array.detach().cpu()
    return np.asarray(array)


# Every class of library mod (the JAX twin registers each one as a pytree).
MOD_CLASSES: tuple[type[Mod], ...] = (Causal, Noop, SlidingWindow, PrefixLM, Documents, AndMasks, OrMasks, Alibi,
                                      Softcap, BiasTable, Chain, Positioned, CallMask, CallScore)
