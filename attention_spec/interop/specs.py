"""The weight map: how one set of named parameters becomes another, both ways, exactly.

One rule type serves every conversion in the library: the twins' declared map
(``attention_spec.interop.conversion``: ``W_query.weight`` (out, in) <-> ``W_query/kernel``
(in, out)), the native importers' maps (``attention_spec.interop.packing``: a packed q/k/v
weight, Flax's head-shaped kernels), the checkpoint files (``attention_spec.interop.files``)
and any pair of modules in the harness (``param_map``).  A ``Rule`` says, for one group of
parameters, which PyTorch names (``torch``) become which Flax paths (``flax``) through
which ``steps``, and, where they are declared, the PyTorch-side shapes
(``torch_shapes``; the Flax-side ones follow through the steps).  The steps are written
in the PyTorch -> Flax direction and every one has an exact inverse, so the same rules
convert both ways (``apply_specs(arrays, rules, "to_flax" | "to_torch")``).

Steps (each acts on the list of arrays a rule carries, in order):

* ``Transpose(axes=None)``: every array transposed (None: all axes reversed, a Linear
  weight (out, in) <-> kernel (in, out)).
* ``SplitAxis(axis, sizes)`` / ``MergeAxes(axis, sizes)``: the reshapes real checkpoints
  use; one axis becomes ``sizes`` (one entry may be -1) and back, e.g. a kernel
  (in, heads*head_dim) <-> (in, heads, head_dim): ``SplitAxis(1, (heads, -1))``.
* ``Split(axis, parts=3)`` / ``Concat(axis, parts=3)``: one array into ``parts`` equal
  pieces along ``axis`` and back (a packed bias (3*d,) <-> three (d,)).
* ``Sections(axis, sizes)`` / ``Joined(axis, sizes)``: one array into pieces of widths
  ``sizes`` and back (Qwen3.5's ``in_proj_qkv``: q, k and v rows of unequal widths).
* ``SplitQKV(layout)`` / ``JoinQKV(layout)``: a packed q/k/v weight in ``layout``
  ``"in_out"`` (d_in, 3*d_out) (GPT-2's ``Conv1D``) or ``"out_in"`` (3*d_out, d_in)
  (``nn.Linear``, ``in_proj_weight``) <-> three (d_out, d_in) weights in PyTorch's
  layout, through ``attention_spec.interop.qkv.split_qkv`` / ``join_qkv``; with
  ``packing="per_head"`` (GPT-NeoX) or ``"grouped"`` (Phi-3) and the heads, packed by
  heads, and with ``bias=True`` the packed bias.

Every step permutes elements (no arithmetic), so round trips are bit-exact, and a
gradient moves through the same rules as its parameter.  Prefixes (``module.``,
``transformer.h.0.attn.``) are stripped or added on the PyTorch side by ``prefix=``.

Framework-free: NumPy only (``as_numpy``, from ``attention_spec.interop.numpy_arrays`` and
named here too, reads torch tensors and JAX arrays without importing either).  Everything
is validated before any array is produced: a malformed rule raises ValueError/TypeError
when it is built; ``apply_specs`` checks names (missing, unexpected, without the prefix)
and shapes through every step for all rules, and raises one ValueError listing every
problem, before converting anything; a declared map's converters
(``attention_spec.interop.conversion``) check names and shapes with ``check_complete``
first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import numpy as np

from attention_spec.interop.numpy_arrays import (
    Path,
    as_numpy,
    check_complete,
    check_float_arrays,
    flatten_paths,
)
from attention_spec.interop.qkv import (
    UNHEADED,
    _heads_words,
    _packing_heads,
    check_layout,
    check_packing,
    join_qkv,
    split_qkv,
)

__all__ = [
    "Concat",
    "DIRECTIONS",
    "JoinQKV",
    "Joined",
    "MergeAxes",
    "Rule",
    "Sections",
    "Split",
    "SplitAxis",
    "SplitQKV",
    "Step",
    "Transpose",
    "add_prefix",
    "apply_specs",
    "as_numpy",
    "check_complete",
    "check_float_arrays",
    "check_specs",
    "flatten_paths",
    "linear_rules",
    "packed_qkv_rules",
    "path_text",
    "rules_from_mapping",
    "run_rules",
    "spec_shapes",
    "strip_prefix",
]

Shape = tuple[int, ...]
DIRECTIONS = ("to_flax", "to_torch")


class Step(Protocol):
    def shapes(self, shapes: list[Shape]) -> list[Shape]: ...

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]: ...

    def inverse(self) -> Step: ...


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {value!r}")
    return int(value)


def _axis(axis: Any, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise ValueError(f"{what}: axis {axis} is out of range for rank {rank}")
    return axis % rank


def _one(shapes: list[Shape], what: str) -> Shape:
    if len(shapes) != 1:
        raise ValueError(f"{what} takes one array; the rule carries {len(shapes)} here")
    return shapes[0]


@dataclass(frozen=True)
class Transpose:
    """Every array's axes permuted by ``axes`` (None: reversed)."""

    axes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.axes is not None:
            axes = tuple(_int("Transpose axes", a) for a in self.axes)
            if sorted(axes) != list(range(len(axes))):
                raise ValueError(f"Transpose axes must be a permutation of 0..{len(axes) - 1}; got {axes}")
            object.__setattr__(self, "axes", axes)

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        out = []
        for s in shapes:
            if self.axes is None:
                out.append(s[::-1])
            elif len(self.axes) != len(s):
                raise ValueError(f"Transpose{self.axes} needs rank {len(self.axes)}; got shape {s}")
            else:
                out.append(tuple(s[a] for a in self.axes))
        return out

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.transpose(a, self.axes) for a in arrays]

    def inverse(self) -> Transpose:
        return self if self.axes is None else Transpose(tuple(int(i) for i in np.argsort(self.axes)))


def _sizes(sizes: Any, what: str) -> tuple[int, ...]:
    sizes = tuple(_int(f"{what} sizes", s) for s in sizes)
    if len(sizes) < 2 or sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"{what} sizes must be two or more positive ints, at most one -1; got {sizes}")
    return sizes


def _resolve(sizes: tuple[int, ...], length: int, what: str) -> tuple[int, ...]:
    known = int(np.prod([s for s in sizes if s != -1]))
    if (-1 in sizes and length % known) or (-1 not in sizes and known != length):
        raise ValueError(f"{what}: an axis of length {length} cannot be split into {sizes}")
    return tuple(length // known if s == -1 else s for s in sizes)


@dataclass(frozen=True)
class SplitAxis:
    """A reshape: axis ``axis`` becomes ``len(sizes)`` axes of ``sizes`` (one may be -1)."""

    axis: int
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _int("SplitAxis axis", self.axis))
        object.__setattr__(self, "sizes", _sizes(self.sizes, "SplitAxis"))

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        out = []
        for s in shapes:
            a = _axis(self.axis, len(s), f"SplitAxis on shape {s}")
            out.append((*s[:a], *_resolve(self.sizes, s[a], f"SplitAxis on shape {s}"), *s[a + 1:]))
        return out

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [a.reshape(s) for a, s in zip(arrays, self.shapes([a.shape for a in arrays]), strict=True)]

    def inverse(self) -> MergeAxes:
        return MergeAxes(self.axis, self.sizes)


@dataclass(frozen=True)
class MergeAxes:
    """A reshape: the ``len(sizes)`` axes from ``axis`` on, which must be ``sizes``, become one."""

    axis: int
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _int("MergeAxes axis", self.axis))
        object.__setattr__(self, "sizes", _sizes(self.sizes, "MergeAxes"))

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        out = []
        n = len(self.sizes)
        for s in shapes:
            what = f"MergeAxes{(self.axis, self.sizes)} on shape {s}"
            if len(s) < n:
                raise ValueError(f"{what}: needs rank {n} or more")
            a = _axis(self.axis, len(s) - n + 1, what)
            got = s[a:a + n]
            if any(want not in (-1, have) for want, have in zip(self.sizes, got, strict=True)):
                raise ValueError(f"{what}: axes {a}..{a + n - 1} are {got}, expected {self.sizes}")
            out.append((*s[:a], int(np.prod(got)), *s[a + n:]))
        return out

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [a.reshape(s) for a, s in zip(arrays, self.shapes([a.shape for a in arrays]), strict=True)]

    def inverse(self) -> SplitAxis:
        return SplitAxis(self.axis, self.sizes)


def _parts(parts: Any, what: str) -> int:
    parts = _int(f"{what} parts", parts)
    if parts < 2:
        raise ValueError(f"{what} parts must be at least 2; got {parts}")
    return parts


@dataclass(frozen=True)
class Split:
    """One array into ``parts`` equal pieces along ``axis`` (in order)."""

    axis: int
    parts: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _int("Split axis", self.axis))
        object.__setattr__(self, "parts", _parts(self.parts, "Split"))

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        s = _one(shapes, "Split")
        a = _axis(self.axis, len(s), f"Split on shape {s}")
        if s[a] % self.parts or s[a] == 0:
            raise ValueError(f"Split: axis {a} of shape {s} is not divisible into {self.parts} equal parts")
        piece = (*s[:a], s[a] // self.parts, *s[a + 1:])
        return [piece] * self.parts

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.array(p) for p in np.split(arrays[0], self.parts, axis=self.axis)]

    def inverse(self) -> Concat:
        return Concat(self.axis, self.parts)


@dataclass(frozen=True)
class Concat:
    """``parts`` arrays of the same shape joined along ``axis`` (in order)."""

    axis: int
    parts: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _int("Concat axis", self.axis))
        object.__setattr__(self, "parts", _parts(self.parts, "Concat"))

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        if len(shapes) != self.parts or len(set(shapes)) != 1:
            raise ValueError(f"Concat needs {self.parts} arrays of one shape; got {shapes}")
        s = shapes[0]
        a = _axis(self.axis, len(s), f"Concat on shape {s}")
        return [(*s[:a], s[a] * self.parts, *s[a + 1:])]

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.concatenate(arrays, axis=self.axis)]

    def inverse(self) -> Split:
        return Split(self.axis, self.parts)


@dataclass(frozen=True)
class Sections:
    """One array into pieces of the given ``sizes`` along ``axis`` (in order; unequal
    widths allowed: Qwen3.5's q | k | v rows)."""

    axis: int
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _int("Sections axis", self.axis))
        sizes = tuple(_int("Sections sizes", s) for s in self.sizes)
        if len(sizes) < 2 or any(s < 1 for s in sizes):
            raise ValueError(f"Sections sizes must be two or more positive ints; got {sizes}")
        object.__setattr__(self, "sizes", sizes)

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        s = _one(shapes, "Sections")
        a = _axis(self.axis, len(s), f"Sections on shape {s}")
        if s[a] != sum(self.sizes):
            raise ValueError(f"Sections: axis {a} of shape {s} is not {' + '.join(map(str, self.sizes))}")
        return [(*s[:a], n, *s[a + 1:]) for n in self.sizes]

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.array(p) for p in np.split(arrays[0], np.cumsum(self.sizes)[:-1], axis=self.axis)]

    def inverse(self) -> Joined:
        return Joined(self.axis, self.sizes)


@dataclass(frozen=True)
class Joined:
    """``len(sizes)`` arrays, of widths ``sizes`` along ``axis``, joined along it (in order)."""

    axis: int
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        Sections(self.axis, self.sizes)  # the same checks
        object.__setattr__(self, "axis", int(self.axis))
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        if len(shapes) != len(self.sizes):
            raise ValueError(f"Joined needs {len(self.sizes)} arrays; got {shapes}")
        a = _axis(self.axis, len(shapes[0]), f"Joined on shape {shapes[0]}")
        rest = {(*s[:a], *s[a + 1:]) for s in shapes}
        if len(rest) != 1 or any(len(s) != len(shapes[0]) or s[a] != n for s, n in zip(shapes, self.sizes, strict=True)):
            raise ValueError(f"Joined{(self.axis, self.sizes)} cannot join shapes {shapes}")
        s = shapes[0]
        return [(*s[:a], sum(self.sizes), *s[a + 1:])]

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.concatenate(arrays, axis=self.axis)]

    def inverse(self) -> Sections:
        return Sections(self.axis, self.sizes)


def _qkv_fields(step: Any) -> str:
    """A q/k/v step's repr: its layout and only the fields away from their defaults."""
    extra = [f"{name}={getattr(step, name)!r}" for name, default in
             (("packing", "thirds"), ("num_heads", None), ("num_kv_heads", None), ("bias", False))
             if getattr(step, name) != default]
    return f"{type(step).__name__}({', '.join([f'layout={step.layout!r}', *extra])})"


def _qkv_check(step: Any) -> None:
    check_layout(step.layout)
    check_packing(step.packing)
    _packing_heads(step.packing, step.num_heads, step.num_kv_heads)


def _qkv_rows(step: Any, packed: int, shape: Shape) -> tuple[int, int, int]:
    """The query, key and value widths of a packed width (of an array of ``shape``) under
    the step's packing."""
    if step.packing in UNHEADED:
        if packed == 0 or packed % 3:
            raise ValueError(f"{step!r}: the packed width of shape {shape} is not divisible by 3")
        return (packed // 3,) * 3
    heads = _packing_heads(step.packing, step.num_heads, step.num_kv_heads)
    assert heads is not None  # a by-heads packing
    h, hkv = heads
    words, multiple = _heads_words(step.packing, heads)
    if packed == 0 or packed % multiple:
        raise ValueError(f"{step!r}: the packed width of shape {shape} must be {words}")
    head_dim = packed // multiple
    return h * head_dim, hkv * head_dim, hkv * head_dim


@dataclass(frozen=True, repr=False)
class SplitQKV:
    """A packed q/k/v weight (``layout`` "in_out": (d_in, packed); "out_in": (packed,
    d_in)) -> query, key, value weights, each (width, d_in) (PyTorch's layout); with
    ``bias=True`` a packed bias (packed,) -> three biases.  ``packing`` as
    ``attention_spec.interop.packing`` names it: ``"thirds"`` (GPT-2's ``c_attn``), ``"per_head"``
    (GPT-NeoX's ``query_key_value``, with ``num_heads``) or ``"grouped"`` (Phi-3's
    ``qkv_proj``, with ``num_heads`` and ``num_kv_heads``)."""

    layout: str
    packing: str = "thirds"
    num_heads: int | None = None
    num_kv_heads: int | None = None
    bias: bool = False

    def __post_init__(self) -> None:
        _qkv_check(self)

    def __repr__(self) -> str:
        return _qkv_fields(self)

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        s = _one(shapes, "SplitQKV")
        if self.bias:
            if len(s) != 1:
                raise ValueError(f"{self!r} needs a rank-1 packed bias; got shape {s}")
            return [(w,) for w in _qkv_rows(self, s[0], s)]
        if len(s) != 2:
            raise ValueError(f"{self!r} needs a rank-2 packed weight; got shape {s}")
        packed, d_in = (s[1], s[0]) if self.layout == "in_out" else s
        return [(w, d_in) for w in _qkv_rows(self, packed, s)]

    def _heads(self) -> dict[str, Any]:
        return {"packing": self.packing, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads}

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        roles = ("query", "key", "value")
        if self.bias:  # the bias's rows are the (out, in) weight's rows: split it as a (packed, 1) weight
            parts = split_qkv(arrays[0][:, None], layout="out_in", **self._heads())
            return [parts[role][0][:, 0] for role in roles]
        parts = split_qkv(arrays[0], layout=self.layout, **self._heads())
        return [parts[role][0] for role in roles]

    def inverse(self) -> JoinQKV:
        return JoinQKV(self.layout, self.packing, self.num_heads, self.num_kv_heads, self.bias)


@dataclass(frozen=True, repr=False)
class JoinQKV:
    """Query, key, value weights (width, d_in) -> one packed weight in ``layout`` (with
    ``bias=True``: three biases -> one packed bias), packed as ``SplitQKV`` says."""

    layout: str
    packing: str = "thirds"
    num_heads: int | None = None
    num_kv_heads: int | None = None
    bias: bool = False

    def __post_init__(self) -> None:
        _qkv_check(self)

    def __repr__(self) -> str:
        return _qkv_fields(self)

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        rank = 1 if self.bias else 2
        if len(shapes) != 3 or any(len(s) != rank for s in shapes) or len({s[1:] for s in shapes}) != 1:
            what = "three (width,) biases" if self.bias else "three (width, d_in) weights of one d_in"
            raise ValueError(f"{self!r} needs {what}; got {shapes}")
        packed = sum(s[0] for s in shapes)
        if tuple(s[0] for s in shapes) != _qkv_rows(self, packed, (packed,)):
            raise ValueError(f"{self!r}: the widths {[s[0] for s in shapes]} do not fit its packing")
        if self.bias:
            return [(packed,)]
        d_in = shapes[0][1]
        return [(d_in, packed) if self.layout == "in_out" else (packed, d_in)]

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        heads: dict[str, Any] = {"packing": self.packing, "num_heads": self.num_heads,
                                 "num_kv_heads": self.num_kv_heads}
        if self.bias:
            query, key, value = (a[:, None] for a in arrays)
            packed, _ = join_qkv(query, key, value, layout="out_in", **heads)
            return [packed[:, 0]]
        return [join_qkv(arrays[0], arrays[1], arrays[2], layout=self.layout, **heads)[0]]

    def inverse(self) -> SplitQKV:
        return SplitQKV(self.layout, self.packing, self.num_heads, self.num_kv_heads, self.bias)


STEP_TYPES = (Transpose, SplitAxis, MergeAxes, Split, Concat, SplitQKV, JoinQKV, Sections, Joined)
AnyStep = Transpose | SplitAxis | MergeAxes | Split | Concat | SplitQKV | JoinQKV | Sections | Joined


def _path(value: Any) -> Path:
    if isinstance(value, str):
        if not value:
            raise ValueError("a Flax path must not be empty")
        return tuple(int(p) if p.isdigit() else p for p in value.split("/"))
    if isinstance(value, tuple) and value and all(isinstance(p, (str, int)) for p in value):
        return value
    raise TypeError(f"a Flax path is a 'a/b/c' string or a tuple of str/int keys; got {value!r}")


def path_text(path: Path) -> str:
    return "/".join(str(p) for p in path)


def _arity(n: int, step: Any) -> int:
    if isinstance(step, Sections):
        return len(step.sizes)
    if isinstance(step, Joined):
        return 1
    if isinstance(step, (Split, SplitQKV)):
        return 3 if isinstance(step, SplitQKV) else step.parts
    if isinstance(step, (Concat, JoinQKV)):
        return 1
    return n


def _takes(n: int, step: Any) -> bool:
    if isinstance(step, Sections):
        return n == 1
    if isinstance(step, Joined):
        return n == len(step.sizes)
    if isinstance(step, (Split, SplitQKV)):
        return n == 1
    if isinstance(step, Concat):
        return n == step.parts
    if isinstance(step, JoinQKV):
        return n == 3
    return True


@dataclass(frozen=True)
class Rule:
    """PyTorch names ``torch`` become Flax paths ``flax`` through ``steps``.

    torch: one name (str) or a list of names (joined by a step).
    flax: one path ("a/0/b" or a tuple of keys) or a list of paths (split by a step).
    steps: written PyTorch -> Flax; each has an exact inverse for the other direction.
    torch_shapes: the shape of each PyTorch array where the map declares it (a twin's
      declared map does, from its config; a ``param_map`` need not), else None.  The Flax
      shapes (``flax_shapes``) are these run through the steps.

    A rule of one name and one path reads as one parameter: ``torch_name``,
    ``flax_path``, ``torch_shape``, ``flax_shape`` and ``transpose`` (whether its only
    step is a full transpose, a Linear weight (out, in) <-> kernel (in, out)).

    Raises TypeError/ValueError when built if a name or path is malformed, a step is not
    one of the step types, the steps do not turn ``len(torch)`` arrays into
    ``len(flax)`` (a Split needs one array, a Concat its ``parts``), or the declared
    shapes are not one per name or do not go through the steps.
    """

    torch: Any
    flax: Any
    steps: tuple[AnyStep, ...] = field(default=())
    torch_shapes: Any = None

    def __post_init__(self) -> None:
        torch_names = (self.torch,) if isinstance(self.torch, str) else self.torch
        if not isinstance(torch_names, (list, tuple)) or not torch_names or \
                not all(isinstance(n, str) and n for n in torch_names):
            raise TypeError(f"Rule torch= is a PyTorch name or a list of them; got {self.torch!r}")
        several = isinstance(self.flax, tuple) and bool(self.flax) and all(isinstance(p, tuple) for p in self.flax)
        # a tuple of tuples is the normalised form of several paths (as dataclasses.replace passes it back)
        flax_paths = list(self.flax) if several else [self.flax] if isinstance(self.flax, (str, tuple)) else self.flax
        if not isinstance(flax_paths, list) or not flax_paths:
            raise TypeError(f"Rule flax= is a path (a 'a/b' string or a tuple) or a list of paths; got {self.flax!r}")
        paths = tuple(_path(p) for p in flax_paths)
        steps = tuple(self.steps) if isinstance(self.steps, (list, tuple)) else (self.steps,)
        for step in steps:
            if not isinstance(step, STEP_TYPES):
                raise TypeError(f"Rule step {step!r} is not one of {', '.join(t.__name__ for t in STEP_TYPES)}")
        n = len(torch_names)
        for step in steps:
            if not _takes(n, step):
                raise ValueError(f"Rule {list(torch_names)} -> {[path_text(p) for p in paths]}: step {step!r} "
                                 f"cannot take the {n} array(s) it is given")
            n = _arity(n, step)
        if n != len(paths):
            raise ValueError(f"Rule {list(torch_names)} -> {[path_text(p) for p in paths]}: the steps give {n} "
                             f"array(s) for {len(paths)} Flax path(s)")
        if len(set(torch_names)) != len(torch_names) or len(set(paths)) != len(paths):
            raise ValueError(f"Rule {list(torch_names)} -> {[path_text(p) for p in paths]} names something twice")
        object.__setattr__(self, "torch", tuple(torch_names))
        object.__setattr__(self, "flax", paths)
        object.__setattr__(self, "steps", steps)
        if self.torch_shapes is not None:
            self._declare_shapes()

    def _declare_shapes(self) -> None:
        shapes = tuple(tuple(_int("Rule torch_shapes", d) for d in s) for s in self.torch_shapes)
        if len(shapes) != len(self.torch):
            raise ValueError(f"Rule {self.describe()}: torch_shapes {shapes} must give one shape per PyTorch name")
        try:
            _run_shapes(self, list(shapes), "to_flax")
        except ValueError as err:
            raise ValueError(f"Rule {self.describe()}: the declared torch_shapes {shapes} do not fit: {err}") from None
        object.__setattr__(self, "torch_shapes", shapes)

    @property
    def torch_names(self) -> tuple[str, ...]:
        return tuple(self.torch)

    @property
    def flax_paths(self) -> tuple[Path, ...]:
        return tuple(self.flax)

    @property
    def flax_shapes(self) -> tuple[Shape, ...] | None:
        """The declared shapes run through the steps (None if none are declared)."""
        if self.torch_shapes is None:
            return None
        return tuple(_run_shapes(self, list(self.torch_shapes), "to_flax"))

    @property
    def torch_name(self) -> str:
        """The one PyTorch name of a one-parameter rule."""
        return str(_single(self.torch, "PyTorch name", self))

    @property
    def flax_path(self) -> Path:
        """The one Flax path of a one-parameter rule."""
        return tuple(_single(self.flax, "Flax path", self))

    @property
    def torch_shape(self) -> Shape:
        """The declared shape of a one-parameter rule's PyTorch array."""
        return tuple(_single(self.torch_shapes or (), "declared PyTorch shape", self))

    @property
    def flax_shape(self) -> Shape:
        """The declared shape of a one-parameter rule's Flax array."""
        return tuple(_single(self.flax_shapes or (), "declared Flax shape", self))

    @property
    def transpose(self) -> bool:
        """Whether the only step is a full transpose (a Linear weight <-> kernel)."""
        return self.steps == (Transpose(),)

    def steps_for(self, direction: str) -> list[AnyStep]:
        """The steps in the order they run ``direction`` ("to_flax" or "to_torch")."""
        return list(self.steps) if direction == "to_flax" else [s.inverse() for s in reversed(self.steps)]

    def under(self, flax_prefix: Path) -> Rule:
        """The same rule with every Flax path under ``flax_prefix`` (a model holding the
        module at that path)."""
        return replace(self, flax=tuple((*flax_prefix, *p) for p in self.flax))

    def describe(self) -> str:
        steps = f" via {', '.join(map(repr, self.steps))}" if self.steps else ""
        return f"{', '.join(map(repr, self.torch))} -> {', '.join(repr(path_text(p)) for p in self.flax)}{steps}"


def _single(items: Sequence[Any], what: str, rule: Rule) -> Any:
    if len(items) != 1:
        raise ValueError(f"the rule {rule.describe()} has {len(items)} of {what}, not one")
    return items[0]


def check_specs(rules: Iterable[Rule]) -> list[Rule]:
    """The rules as a list, after checking that each is a ``Rule`` and that no PyTorch
    name or Flax path appears in two rules; else TypeError/ValueError."""
    rules = list(rules) if not isinstance(rules, Rule) else [rules]
    bad = [r for r in rules if not isinstance(r, Rule)]
    if bad:
        raise TypeError(f"specs must be Rule objects; got {bad[0]!r}")
    seen_t: dict[str, Rule] = {}
    seen_f: dict[Path, Rule] = {}
    problems = []
    for r in rules:
        for n in r.torch_names:
            if n in seen_t:
                problems.append(f"  PyTorch name {n!r} is in two rules")
            seen_t[n] = r
        for p in r.flax_paths:
            if p in seen_f:
                problems.append(f"  Flax path {path_text(p)!r} is in two rules")
            seen_f[p] = r
    if problems:
        raise ValueError("the conversion specs are ambiguous:\n" + "\n".join(problems))
    return rules


def _direction(direction: Any) -> Literal["to_flax", "to_torch"]:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'to_flax' or 'to_torch'; got {direction!r}")
    return direction  # type: ignore[no-any-return]


def _run_shapes(rule: Rule, shapes: list[Shape], direction: str) -> list[Shape]:
    for step in rule.steps_for(direction):
        shapes = step.shapes(shapes)
    return shapes


def spec_shapes(
    shapes: Mapping[Any, Sequence[int]], rules: Iterable[Rule], direction: str
) -> dict[Any, Shape]:
    """The shapes ``apply_specs`` would produce from arrays of ``shapes`` (same keys), with
    the same checks, without any array."""
    rules = check_specs(rules)
    direction = _direction(direction)
    out: dict[Any, Shape] = {}
    problems = []
    for rule in rules:
        src = rule.torch_names if direction == "to_flax" else rule.flax_paths
        dst = rule.flax_paths if direction == "to_flax" else rule.torch_names
        if any(k not in shapes for k in src):
            continue
        try:
            result = _run_shapes(rule, [tuple(int(d) for d in shapes[k]) for k in src], direction)
        except ValueError as err:
            problems.append(f"  {rule.describe()}: {err}")
            continue
        out.update(zip(dst, result, strict=True))
    if problems:
        raise ValueError("the conversion specs do not fit the arrays:\n" + "\n".join(problems))
    return out


def strip_prefix(arrays: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """{name without ``prefix``: value}; ValueError naming every key that lacks it."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {prefix!r}")
    lacking = [k for k in arrays if not (isinstance(k, str) and k.startswith(prefix))]
    if lacking:
        raise ValueError(f"these names do not start with the prefix {prefix!r}: {', '.join(map(repr, lacking))}")
    return {k[len(prefix):]: v for k, v in arrays.items()}


def add_prefix(arrays: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """{``prefix`` + name: value}."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {prefix!r}")
    return {prefix + k: v for k, v in arrays.items()}


def apply_specs(
    arrays: Mapping[Any, Any],
    rules: Iterable[Rule],
    direction: str,
    *,
    prefix: str = "",
    expected: Mapping[Any, Sequence[int]] | None = None,
) -> dict[Any, np.ndarray]:
    """Converts a whole set of arrays through ``rules``.

    direction "to_flax": ``arrays`` is {PyTorch name: array} (a state dict; every name
      must start with ``prefix``, which is stripped); returns {Flax path tuple: array}.
    direction "to_torch": ``arrays`` is {Flax path (tuple or "a/b"): array}; returns
      {``prefix`` + PyTorch name: array}.
    expected: optional {output key: shape} (paths as tuples or "a/b") that the result
      must match exactly (no key missing or extra, every shape equal).

    Every input key must be in exactly one rule and every rule's inputs present; shapes
    are run through every step first.  All problems are raised together as one
    ValueError before any array is converted.  The result holds fresh NumPy arrays (no
    views of the input) in the input's dtypes.
    """
    rules = check_specs(rules)
    direction = _direction(direction)
    if direction == "to_flax":
        given: dict[Any, Any] = strip_prefix(arrays, prefix)
        wanted: list[Any] = [n for r in rules for n in r.torch_names]
    else:
        given = {_path(k): v for k, v in arrays.items()}
        wanted = [p for r in rules for p in r.flax_paths]
    problems = [f"  missing: {_key(k)}" for k in wanted if k not in given]
    problems += [f"  not in any rule: {_key(k)}" for k in given if k not in set(wanted)]
    np_arrays = {k: as_numpy(v) for k, v in given.items()}
    try:
        shapes = spec_shapes({k: a.shape for k, a in np_arrays.items()}, rules, direction)
    except ValueError as err:
        problems += str(err).splitlines()[1:]
        shapes = {}
    if expected is not None and not problems:
        want = {(_path(k) if direction == "to_flax" else k): tuple(s) for k, s in expected.items()}
        got = {k if direction == "to_flax" else prefix + k: s for k, s in shapes.items()}
        problems += [f"  the result lacks {_key(k)} {s}" for k, s in want.items() if k not in got]
        problems += [f"  the result has {_key(k)} {s}, which is not expected" for k, s in got.items() if k not in want]
        problems += [f"  {_key(k)} would be {got[k]} but {want[k]} is expected" for k in want
                     if k in got and got[k] != want[k]]
    if problems:
        raise ValueError(f"cannot convert {direction.replace('_', ' ')}:\n" + "\n".join(problems))
    converted = run_rules(np_arrays, rules, direction)
    return {(k if direction == "to_flax" else prefix + k): np.array(v) for k, v in converted.items()}


def run_rules(arrays: Mapping[Any, np.ndarray], rules: Sequence[Rule], direction: str) -> dict[Any, np.ndarray]:
    """Every rule's arrays through its steps, in the rules' order: {Flax path: array}
    ("to_flax", from {PyTorch name: array}) or {PyTorch name: array} ("to_torch", from
    {Flax path tuple: array}).  Checks nothing (the callers check names and shapes
    first); an array that no step changes is returned as it was given, a transposed one
    as a view."""
    out: dict[Any, np.ndarray] = {}
    for rule in rules:
        src = rule.torch_names if direction == "to_flax" else rule.flax_paths
        dst = rule.flax_paths if direction == "to_flax" else rule.torch_names
        values = [arrays[k] for k in src]
        for step in rule.steps_for(direction):
            values = step.apply(values)
        out.update(zip(dst, values, strict=True))
    return out


def _key(key: Any) -> str:
    return repr(key) if isinstance(key, str) else repr(path_text(key))


# ------------------------------------------------------------------ common rule sets


def linear_rules(
    torch_prefix: str, flax_prefix: str | Path, *, bias: bool = True, shape: tuple[int, int] | None = None
) -> list[Rule]:
    """An ``nn.Linear`` (``weight`` (out, in), ``bias``) <-> an ``nnx.Linear`` (``kernel``
    (in, out), ``bias``).  ``shape``: the weight's (out, in), to declare the shapes."""
    base = _path(flax_prefix)
    weight_shape = None if shape is None else (tuple(shape),)
    rules = [Rule(f"{torch_prefix}.weight", (*base, "kernel"), (Transpose(),), weight_shape)]
    if bias:
        rules.append(Rule(f"{torch_prefix}.bias", (*base, "bias"), (), None if shape is None else ((shape[0],),)))
    return rules


def rules_from_mapping(mapping: Mapping[str, Any]) -> list[Rule]:
    """The mapping form of a map, {PyTorch name: Flax path or (Flax path, transpose)},
    as rules (checked as ``check_specs``)."""
    rules = []
    for name, target in mapping.items():
        transpose = isinstance(target, tuple) and len(target) == 2 and isinstance(target[1], bool)
        path = target[0] if transpose else target
        rules.append(Rule(name, path, (Transpose(),) if transpose and target[1] else ()))
    return check_specs(rules)


def packed_qkv_rules(
    weight: str,
    kernels: Sequence[str | Path],
    *,
    layout: str,
    bias: str | None = None,
    biases: Sequence[str | Path] | None = None,
    packing: str = "thirds",
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> list[Rule]:
    """A packed q/k/v weight (and bias) <-> three Flax kernels (in, out) (and biases), in
    the order query, key, value.  ``layout`` as ``SplitQKV``: "in_out" for GPT-2's
    ``c_attn.weight`` (d_in, 3*d_out), "out_in" for ``nn.Linear(d, 3*d)`` and
    ``in_proj_weight`` (3*d_out, d_in); ``packing`` and the heads as ``SplitQKV`` takes
    them (GPT-NeoX's ``"per_head"``, Phi-3's ``"grouped"``)."""
    check_layout(layout)
    if len(kernels) != 3 or (biases is not None and len(biases) != 3):
        raise ValueError("packed q/k/v needs three kernels (and three biases): query, key, value")
    if (bias is None) != (biases is None):
        raise ValueError("give both bias= (the packed bias) and biases= (the three Flax biases), or neither")
    rules = [Rule(weight, list(kernels), (SplitQKV(layout, packing, num_heads, num_kv_heads), Transpose()))]
    if bias is not None and biases is not None:
        split = Split(0, 3) if packing == "thirds" else SplitQKV(layout, packing, num_heads, num_kv_heads, bias=True)
        rules.append(Rule(bias, list(biases), (split,)))
    return rules
