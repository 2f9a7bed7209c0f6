"""Declarative conversion specs: how a real checkpoint's parameters become another's.

``attention_spec.conversion`` maps one name to one name, transposed or not.  Real
checkpoints need more: a packed q/k/v weight that is three kernels on the other side,
Flax's head-shaped kernels ``(in, heads, head_dim)``, a ``module.`` prefix left by DDP.
A ``Rule`` says, for one group of parameters, which PyTorch names (``torch``) become
which Flax paths (``flax``) through which ``steps``; the steps are written in the
PyTorch -> Flax direction and every one has an exact inverse, so the same rules convert
both ways (``apply_specs(arrays, rules, "to_flax" | "to_torch")``).

Steps (each acts on the list of arrays a rule carries, in order):

* ``Transpose(axes=None)``: every array transposed (None: all axes reversed, a Linear
  weight (out, in) <-> kernel (in, out)).
* ``SplitAxis(axis, sizes)`` / ``MergeAxes(axis, sizes)``: the reshapes real checkpoints
  use; one axis becomes ``sizes`` (one entry may be -1) and back, e.g. a kernel
  (in, heads*head_dim) <-> (in, heads, head_dim): ``SplitAxis(1, (heads, -1))``.
* ``Split(axis, parts=3)`` / ``Concat(axis, parts=3)``: one array into ``parts`` equal
  pieces along ``axis`` and back (a packed bias (3*d,) <-> three (d,)).
* ``SplitQKV(layout)`` / ``JoinQKV(layout)``: a packed q/k/v weight in ``layout``
  ``"in_out"`` (d_in, 3*d_out) (GPT-2's ``Conv1D``) or ``"out_in"`` (3*d_out, d_in)
  (``nn.Linear``, ``in_proj_weight``) <-> three (d_out, d_in) weights in PyTorch's
  layout, through ``attention_spec.packing.split_qkv`` / ``join_qkv``.

Every step permutes elements (no arithmetic), so round trips are bit-exact, and a
gradient moves through the same rules as its parameter.  Prefixes (``module.``,
``transformer.h.0.attn.``) are stripped or added on the PyTorch side by ``prefix=``.

Framework-free: NumPy only.  Everything is validated before any array is produced:
a malformed rule raises ValueError/TypeError when it is built; ``apply_specs`` checks
names (missing, unexpected, without the prefix) and shapes through every step for all
rules, and raises one ValueError listing every problem, before converting anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from attention_spec.conversion import as_numpy
from attention_spec.packing import check_layout, join_qkv, split_qkv

__all__ = [
    "Concat",
    "DIRECTIONS",
    "JoinQKV",
    "MergeAxes",
    "Rule",
    "Split",
    "SplitAxis",
    "SplitQKV",
    "Step",
    "Transpose",
    "add_prefix",
    "apply_specs",
    "check_specs",
    "linear_rules",
    "packed_qkv_rules",
    "path_text",
    "spec_shapes",
    "strip_prefix",
]

Path = tuple[Any, ...]
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
class SplitQKV:
    """A packed q/k/v weight (``layout`` "in_out": (d_in, 3*d_out); "out_in": (3*d_out,
    d_in)) -> query, key, value weights, each (d_out, d_in) (PyTorch's layout)."""

    layout: str

    def __post_init__(self) -> None:
        check_layout(self.layout)

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        s = _one(shapes, "SplitQKV")
        if len(s) != 2:
            raise ValueError(f"SplitQKV({self.layout!r}) needs a rank-2 packed weight; got shape {s}")
        packed, d_in = (s[1], s[0]) if self.layout == "in_out" else s
        if packed == 0 or packed % 3:
            raise ValueError(f"SplitQKV({self.layout!r}): the packed width of shape {s} is not divisible by 3")
        return [(packed // 3, d_in)] * 3

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        parts = split_qkv(arrays[0], layout=self.layout)
        return [parts[role][0] for role in ("query", "key", "value")]

    def inverse(self) -> JoinQKV:
        return JoinQKV(self.layout)


@dataclass(frozen=True)
class JoinQKV:
    """Query, key, value weights (d_out, d_in) -> one packed weight in ``layout``."""

    layout: str

    def __post_init__(self) -> None:
        check_layout(self.layout)

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        if len(shapes) != 3 or len(set(shapes)) != 1 or len(shapes[0]) != 2:
            raise ValueError(f"JoinQKV needs three (d_out, d_in) weights of one shape; got {shapes}")
        d_out, d_in = shapes[0]
        return [(d_in, 3 * d_out) if self.layout == "in_out" else (3 * d_out, d_in)]

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [join_qkv(arrays[0], arrays[1], arrays[2], layout=self.layout)[0]]

    def inverse(self) -> SplitQKV:
        return SplitQKV(self.layout)


STEP_TYPES = (Transpose, SplitAxis, MergeAxes, Split, Concat, SplitQKV, JoinQKV)
AnyStep = Transpose | SplitAxis | MergeAxes | Split | Concat | SplitQKV | JoinQKV


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
    if isinstance(step, (Split, SplitQKV)):
        return 3 if isinstance(step, SplitQKV) else step.parts
    if isinstance(step, (Concat, JoinQKV)):
        return 1
    return n


def _takes(n: int, step: Any) -> bool:
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

    Raises TypeError/ValueError when built if a name or path is malformed, a step is not
    one of the step types, or the steps do not turn ``len(torch)`` arrays into
    ``len(flax)`` (a Split needs one array, a Concat its ``parts``).
    """

    torch: Any
    flax: Any
    steps: tuple[AnyStep, ...] = field(default=())

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

    @property
    def torch_names(self) -> tuple[str, ...]:
        return tuple(self.torch)

    @property
    def flax_paths(self) -> tuple[Path, ...]:
        return tuple(self.flax)

    def describe(self) -> str:
        steps = f" via {', '.join(map(repr, self.steps))}" if self.steps else ""
        return f"{', '.join(map(repr, self.torch))} -> {', '.join(repr(path_text(p)) for p in self.flax)}{steps}"


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
    steps = rule.steps if direction == "to_flax" else [s.inverse() for s in reversed(rule.steps)]
    for step in steps:
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
    out: dict[Any, np.ndarray] = {}
    for rule in rules:
        src = rule.torch_names if direction == "to_flax" else rule.flax_paths
        dst = rule.flax_paths if direction == "to_flax" else tuple(prefix + n for n in rule.torch_names)
        values = [np_arrays[k] for k in src]
        steps = rule.steps if direction == "to_flax" else [s.inverse() for s in reversed(rule.steps)]
        for step in steps:
            values = step.apply(values)
        out.update({k: np.array(v) for k, v in zip(dst, values, strict=True)})
    return out


def _key(key: Any) -> str:
    return repr(key) if isinstance(key, str) else repr(path_text(key))


# ------------------------------------------------------------------ common rule sets


def linear_rules(torch_prefix: str, flax_prefix: str | Path, *, bias: bool = True) -> list[Rule]:
    """An ``nn.Linear`` (``weight`` (out, in), ``bias``) <-> an ``nnx.Linear`` (``kernel``
    (in, out), ``bias``)."""
    base = _path(flax_prefix)
    rules = [Rule(f"{torch_prefix}.weight", (*base, "kernel"), (Transpose(),))]
    if bias:
        rules.append(Rule(f"{torch_prefix}.bias", (*base, "bias")))
    return rules


def packed_qkv_rules(
    weight: str,
    kernels: Sequence[str | Path],
    *,
    layout: str,
    bias: str | None = None,
    biases: Sequence[str | Path] | None = None,
) -> list[Rule]:
    """A packed q/k/v weight (and bias) <-> three Flax kernels (in, out) (and biases), in
    the order query, key, value.  ``layout`` as ``SplitQKV``: "in_out" for GPT-2's
    ``c_attn.weight`` (d_in, 3*d_out), "out_in" for ``nn.Linear(d, 3*d)`` and
    ``in_proj_weight`` (3*d_out, d_in)."""
    check_layout(layout)
    if len(kernels) != 3 or (biases is not None and len(biases) != 3):
        raise ValueError("packed q/k/v needs three kernels (and three biases): query, key, value")
    if (bias is None) != (biases is None):
        raise ValueError("give both bias= (the packed bias) and biases= (the three Flax biases), or neither")
    rules = [Rule(weight, list(kernels), (SplitQKV(layout), Transpose()))]
    if bias is not None and biases is not None:
        rules.append(Rule(bias, list(biases), (Split(0, 3),)))
    return rules
