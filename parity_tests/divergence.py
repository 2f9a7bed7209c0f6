"""Find the layer that is wrong: ``locate_divergence`` runs a PyTorch model and its Flax
NNX port once each, records every submodule call in both, pairs the calls by name and
names the innermost module where the two part: forward (its inputs agree, its output does
not) or, when every forward output agrees, backward (its output cotangent agrees, the
cotangent it hands back to its inputs does not).  A pair whose output is the other's
times a constant, or whose inputs already differ while the models' outputs agree, is a
boundary mismatch (``Boundary``: the work split otherwise between the modules, Gemma's
embedding scale applied after the module instead of inside it), reported and searched
past, so that a bug behind it is still named.

How the calls are recorded.  PyTorch: a forward pre-hook and a forward hook on every
submodule (``named_modules``).  Flax NNX: ``nnx.capture`` records outputs only, and only
of methods a class defines itself (not an inherited ``__call__``), so each module class
of the model gets its ``__call__`` wrapped for the duration, recording only the model's
own instances (``nnx.capture`` patches classes in the same way); the classes are put back
afterwards, also on error.  This library's attention modules compute their projections
through ``functional.linear`` rather than by calling their ``nn.Linear`` / ``nnx.Linear``
children, so those calls fire no hook: the module's ``_linear``, ``_rotate`` and
``_normalise_qk`` are wrapped on the instance, which records ``W_query``, ``W_key``,
``W_value``, ``out_proj``, ``rope`` (the rotation of q and k) and the qk-norms as
submodules of the attention module in both twins, without changing a number.  (These
are private methods of ``torch_attention/_base.py`` and ``jax_attention/_base.py``, the
same names and signatures in both; ``tests/harness/test_divergence.py`` fails if they
change.)

How backward is localised.  The cotangent that reaches a module's output, and the one it
hands back to its inputs (through this module alone, not through a residual that also
reads them), are gradients of one scalar, ``sum(output * R)`` for a fixed random ``R``
per output array of the model.  PyTorch: every recorded input and output array that
autograd tracks is replaced, as the module receives or returns it, by an identity view
(``view_as``), and ``torch.autograd.grad`` differentiates the scalar with respect to
those views: a module's input view is read by that module alone, through a copy (so that
an in-place op in the module, ``nn.ReLU(inplace=True)``, writes the copy, not the view);
an output view written in place after its module returned it (``h += x`` between
modules) is noticed by its version counter, and that cotangent is not compared.  JAX: a second forward
adds a zero array to every inexact input leaf as the module receives it and to every
output leaf as it returns it (``x + 0`` is ``x``), and ``jax.grad`` differentiates the
scalar with respect to those zeros.  Both are the same quantities, so the twins'
cotangents compare leaf for leaf.

Sparse attention (DSA).  Each sparse layer's choice of keys is recorded in both models
(this library's ``_choose`` in either twin, wrapped on the instance; ``transformers``'
indexer by a hook, its scores read from the ``topk`` call its forward makes), and the Flax
model's layers run on the PyTorch model's choice, so that a tie within the scores'
rounding, which two correct implementations break differently, changes no number compared
after it; the choices are compared apart from the numbers (``SelectionFinding``,
``parity_tests.selection.compare_selections``), and one that differs beyond the rounding
is the divergence, at that layer, unless a module that returned before it diverges.

The models run eagerly (no ``jax.jit``, so that each call can be recorded) in
``full_precision()``; put both in the mode to compare (``eval()`` for no dropout) first.
For backward the Flax model runs a second time, under ``jax.grad``: it must call the same
modules on arrays of the same shapes again, and write no ``nnx.Variable`` as it runs
(batch statistics in training mode, a cache held in the module).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_spec.interop.numpy_arrays import as_numpy
from parity_tests.harness import _is_float, _numpy_source, compare, full_precision, module_dtype
from parity_tests.tolerances import GRAD_PARITY, PARITY, Tolerance

__all__ = ["Boundary", "Divergence", "DivergenceReport", "ModulePair", "SelectionFinding", "compare_choices",
           "locate_divergence", "same_choices"]

Path = tuple[str, ...]  # a leaf's place in a pytree: keys and indices as text


# --------------------------------------------------------------------------- results

@dataclass(frozen=True)
class Error:
    """One side of one module pair compared: ``ok`` (None: nothing comparable), the
    largest error relative to each array's scale (``max|a - b| / max|b|``), and why it
    failed when it failed for a reason other than the numbers (structure, shape)."""

    ok: bool | None
    max_rel: float = 0.0
    note: str = ""

    def text(self) -> str:
        if self.ok is None:
            return "n/c" if self.note else "-"  # not comparable (the note says why), or nothing to compare
        mark = "" if self.ok else " !"
        structural = self.note and self.max_rel == float("inf")  # not numbers: shapes, structure
        return ("struct" if structural else f"{self.max_rel:.1e}" + ("*" if self.note else "")) + mark


NOT_COMPARED = Error(None)


@dataclass
class ModulePair:
    """One call of one module in both frameworks: its names, its place in the call tree
    (``depth``; ``parent``, the pair index of the enclosing call) and its errors: forward
    ``inputs`` and ``output``, backward ``output_cotangent`` and ``input_cotangent``."""

    torch_name: str
    flax_path: tuple[Any, ...]
    call: int  # the how-manieth call of this module (tied weights, loops), from 0
    depth: int
    parent: int | None
    exit_order: int  # when the call returned, among all recorded calls
    inputs: Error = NOT_COMPARED
    output: Error = NOT_COMPARED
    output_cotangent: Error = NOT_COMPARED
    input_cotangent: Error = NOT_COMPARED
    output_factor: float | None = None  # a failing output that is the Flax one's times this (PyTorch / Flax)


@dataclass(frozen=True)
class Boundary:
    """A module pair that computes something else in each framework while the port as a
    whole need not be wrong: the work is split differently between the modules.  Either
    ``factor`` is set, the PyTorch module's output being the Flax module's times it (a
    scale applied inside Hugging Face's module and after the port's: Gemma's
    ``Gemma2TextScaledWordEmbedding``), or the pair's inputs already differ while the
    model's outputs agree.  ``locate_divergence`` reports it and searches on past it; the
    port is right only where each named module computes what the module of that name in
    the original computes (move the work into the module)."""

    torch_name: str
    flax_path: tuple[Any, ...]
    call: int
    factor: float | None
    why: str


@dataclass(frozen=True)
class Divergence:
    """Where the twins part: the innermost module whose inputs agree and whose output does
    not (``direction="forward"``), or whose output cotangent agrees and whose input
    cotangent does not (``"backward"``), or a sparse attention layer whose indexer chose
    other keys than the other side's beyond the scores' rounding (``"selection"``: a tie
    is not one; ``SelectionFinding``); ``max_rel`` is the error that fails there (for a
    selection: the scores' largest difference relative to their largest magnitude)."""

    torch_name: str
    flax_path: tuple[Any, ...]
    call: int
    direction: str
    max_rel: float
    note: str = ""


@dataclass(frozen=True)
class SelectionFinding:
    """One sparse attention layer's choices of keys compared (``parity_tests.selection``):
    the layer (PyTorch name, Flax path, call), ``report`` (which queries chose different
    keys, by how many, the margin at the k-th key against the scores' rounding; None: only
    one side chose, or the choices' shapes differ, ``note`` says which), ``score_rel``
    (the scores' largest difference relative to their largest magnitude) and the layer's
    output at the queries whose choice agrees (``agreeing``).  The Flax model runs on the
    PyTorch model's choice (``locate_divergence(same_selection=True)``), so every row of
    the layer, and every module after it, compares at the normal tolerance; at the
    agreeing queries that choice was the Flax layer's own too.  ``at``: how many PyTorch
    module calls had returned when the choice was made."""

    torch_name: str
    flax_path: tuple[Any, ...]
    call: int
    report: Any = None  # parity_tests.selection.SelectionReport
    score_rel: float = 0.0
    agreeing: Error = NOT_COMPARED
    at: int = 0
    note: str = ""

    @property
    def differs(self) -> bool:
        """Whether the two choices differ (or could not be compared)."""
        return self.report is None or bool(self.report.differences)

    @property
    def ok(self) -> bool:
        """No difference beyond the scores' rounding (ties go either way), the scores
        within their rounding, and the output at the agreeing queries within tolerance."""
        return self.report is not None and self.report.ok and self.agreeing.ok is not False

    @property
    def ties_only(self) -> bool:
        """The choices differ, every difference a tie within the scores' rounding."""
        return self.differs and self.ok

    def text(self) -> str:
        name = f"{self.torch_name or '(root)'}{f' (call {self.call})' if self.call else ''}"
        if self.report is None:
            return f"{name}: {self.note}"
        report = self.report
        what = report.summary().splitlines()[0]
        if self.ties_only:
            what += ": ties, both right"
        elif not self.ok and report.divergent:
            what += ": DIVERGES"
        if self.agreeing.ok is not None:
            kept = report.queries - len(report.differences)
            verdict = "agrees" if self.agreeing.ok else "DIFFERS"
            what += (f"; at the {kept} queries whose choice agrees the layer's output {verdict} "
                     f"(max rel err {self.agreeing.max_rel:.1e})")
        shown = [f"    {line.strip()}" for line in report.summary().splitlines()[1:4]]
        more = len(report.differences) - len(shown)
        return "\n".join([f"  {name}: {what}", *shown, *([f"    ... {more} more"] if more > 0 else [])])


@dataclass
class DivergenceReport:
    """Every module pair in execution order, the first divergence (None: the twins agree
    at every pair compared), and the calls that only one framework made."""

    pairs: list[ModulePair]
    first: Divergence | None
    backward_checked: bool
    torch_only: list[str] = field(default_factory=list)
    flax_only: list[str] = field(default_factory=list)
    backward_note: str = ""  # why backward was not checked, when it was not
    boundaries: list[Boundary] = field(default_factory=list)  # modules split otherwise, searched past
    selections: list[SelectionFinding] = field(default_factory=list)  # sparse attention's choices of keys

    @property
    def ok(self) -> bool:
        return self.first is None

    def __str__(self) -> str:
        return _table(self)


# --------------------------------------------------------------------------- pytrees

def _key_text(path: Sequence[Any]) -> Path:
    """A pytree key path of either framework as text: dict keys, indices, attribute names."""
    parts = []
    for key in path:
        part = next((getattr(key, a) for a in ("key", "idx", "name") if hasattr(key, a)), key)
        parts.append(str(part))
    return tuple(parts)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _call_tree(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """A call's arguments as one pytree: positional ones, then keywords in name order, so
    that ``f(x, mask)`` in one framework lines up with ``f(x, mask=mask)`` in the other."""
    return (tuple(args), dict(sorted(kwargs.items())))


class _Tree:
    """Flattening and rebuilding of one framework's pytrees (torch's ``_pytree``, JAX's
    ``tree_util``), so that the recorder is written once."""

    def __init__(self, framework: str) -> None:
        if framework == "torch":
            import torch
            import torch.utils._pytree as pytree

            self._flatten: Any = pytree.tree_flatten_with_path
            self._unflatten: Any = pytree.tree_unflatten
            self.array_types: tuple[type, ...] = (torch.Tensor,)
        else:
            import jax
            from flax import nnx

            # a module or a variable passed as an argument is not taken apart
            not_apart = (nnx.Module, nnx.Variable)
            self._flatten = functools.partial(jax.tree_util.tree_flatten_with_path,
                                              is_leaf=lambda x: isinstance(x, not_apart))
            self._unflatten = lambda leaves, spec: jax.tree_util.tree_unflatten(spec, leaves)
            self.array_types = (jax.Array, np.ndarray)

    def is_array(self, leaf: Any) -> bool:
        return isinstance(leaf, self.array_types)

    def flatten(self, tree: Any) -> tuple[list[tuple[Path, Any]], Any]:
        pairs, spec = self._flatten(tree)
        return [(_key_text(p), leaf) for p, leaf in pairs], spec

    def unflatten(self, leaves: list[Any], spec: Any) -> Any:
        return self._unflatten(leaves, spec)


# --------------------------------------------------------------------------- recording

@dataclass
class _Record:
    """One module call as one framework saw it: inputs (every array leaf, positional) and
    outputs (array leaves with their paths) as NumPy; for backward, per array leaf, the
    handle that its cotangent is taken through (None: not differentiable), then the
    cotangents themselves."""

    name: tuple[Any, ...]
    parent: int | None
    depth: int
    exit_order: int = -1
    inputs: list[np.ndarray] = field(default_factory=list)
    outputs: list[tuple[Path, np.ndarray]] = field(default_factory=list)
    in_nodes: list[Any] = field(default_factory=list)
    out_nodes: list[Any] = field(default_factory=list)
    in_cots: list[np.ndarray | None] = field(default_factory=list)
    out_cots: list[np.ndarray | None] = field(default_factory=list)
    in_versions: list[int | None] = field(default_factory=list)  # torch: each node's version when marked
    out_versions: list[int | None] = field(default_factory=list)
    overwritten: bool = False  # torch: an output written in place after the module returned it


@dataclass
class _Selection:
    """One sparse attention layer's choice of keys as one framework made it (its own, even
    where it then ran on a forced one): the layer's name, the how-manieth call, how many
    module calls had returned before it (``at``), the choice (B, T, S) bool and the scores
    it chose by (-inf at the keys hidden from a query)."""

    name: tuple[Any, ...]
    call: int
    at: int
    chosen: np.ndarray
    scores: np.ndarray


class _Recorder:
    """The call stack of one run: ``enter`` when a module receives its arguments and
    ``exit`` when it returns, each giving back the arguments / output to use instead
    (``_mark``: the same values, made traceable for the cotangents)."""

    def __init__(self, framework: str, keep_values: bool) -> None:
        self.tree = _Tree(framework)
        self.records: list[_Record] = []
        self.keep_values = keep_values
        self._stack: list[int] = []
        self._exits = 0
        self.selections: list[_Selection] = []  # sparse attention's choices of keys, in call order
        self.forced: Mapping[str, Sequence[np.ndarray]] = {}  # {layer: the choice to run on, per call}

    def enter(self, name: tuple[Any, ...], tree: Any) -> Any:
        index = len(self.records)
        self.records.append(_Record(name, self._stack[-1] if self._stack else None, len(self._stack)))
        self._stack.append(index)
        return self._through(index, "in", tree)

    def exit(self, tree: Any) -> Any:
        index = self._stack.pop()
        self.records[index].exit_order = self._exits
        self._exits += 1
        return self._through(index, "out", tree)

    def around(self, name: tuple[Any, ...], inputs: tuple[Any, ...], run: Callable[[tuple[Any, ...]], Any]) -> Any:
        """``run(inputs)`` recorded as a call of a module named ``name``."""
        marked, _ = self.enter(name, (inputs, {}))
        return self.exit(run(marked))

    def _through(self, index: int, side: str, tree: Any) -> Any:
        leaves, spec = self.tree.flatten(tree)
        arrays = [(path, leaf) for path, leaf in leaves if self.tree.is_array(leaf)]
        record = self.records[index]
        if self.keep_values and side == "in":
            record.inputs = [self._value(leaf) for _, leaf in arrays]
        elif self.keep_values:
            record.outputs = [(path, self._value(leaf)) for path, leaf in arrays]
        marked = self._mark(index, side, [leaf for _, leaf in arrays])
        if all(m is a for m, (_, a) in zip(marked, arrays, strict=True)):
            return tree  # nothing to trace: the very objects go on (a container rebuilt is another object)
        new = iter(marked)
        return self.tree.unflatten([next(new) if self.tree.is_array(leaf) else leaf for _, leaf in leaves], spec)

    def _value(self, leaf: Any) -> np.ndarray:
        return np.array(as_numpy(leaf), copy=True)  # a copy: torch may write the tensor later

    def _mark(self, index: int, side: str, arrays: list[Any]) -> list[Any]:
        raise NotImplementedError


class _TorchRecorder(_Recorder):
    """PyTorch: each tracked float leaf becomes an identity view, read by its module alone
    (an input) or by everything downstream (an output), for ``torch.autograd.grad``."""

    def __init__(self, track: bool) -> None:
        super().__init__("torch", keep_values=True)
        self.track = track

    def _mark(self, index: int, side: str, arrays: list[Any]) -> list[Any]:
        import torch

        nodes = [a.view_as(a) if self.track and isinstance(a, torch.Tensor) and a.requires_grad else None
                 for a in arrays]
        record = self.records[index]
        versions = [None if n is None else n._version for n in nodes]
        if side == "in":
            record.in_nodes, record.in_versions = nodes, versions
            # the module gets a copy: an in-place op in it (``nn.ReLU(inplace=True)``) then
            # writes the copy, and the input's cotangent stays that of the input
            return [a if n is None else n.clone() for a, n in zip(arrays, nodes, strict=True)]
        record.out_nodes, record.out_versions = nodes, versions
        return [a if n is None else n for a, n in zip(arrays, nodes, strict=True)]


class _FlaxRecorder(_Recorder):
    """Flax: without ``deltas``, records values and the shape and dtype of every inexact
    leaf; with them (a second run, under ``jax.grad``), adds each call's zeros to its
    leaves, in the order the first run recorded them."""

    def __init__(self, deltas: list[Any] | None = None) -> None:
        super().__init__("jax", keep_values=deltas is None)
        self.deltas = deltas

    def _mark(self, index: int, side: str, arrays: list[Any]) -> list[Any]:
        import jax.numpy as jnp

        if self.deltas is None:
            specs = [(a.shape, a.dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else None for a in arrays]
            record = self.records[index]
            record.in_nodes, record.out_nodes = (specs, record.out_nodes) if side == "in" else (record.in_nodes, specs)
            return arrays
        zeros = self.deltas[index][0 if side == "in" else 1] if index < len(self.deltas) else None
        if zeros is None or len(zeros) != len(arrays):
            raise RuntimeError("the Flax model called its modules differently the second time it ran "
                               f"(call {index}, {self.records[index].name}): locate_divergence needs a "
                               "model that calls the same modules on the same arrays every time")
        return [a if z is None else a + z for a, z in zip(arrays, zeros, strict=True)]


# --------------------------------------------------------------------------- installing

def _instrument_attention(module: Any, name: tuple[Any, ...], recorder: _Recorder) -> list[str]:
    """This library's attention module (either twin): its projections, rotation and
    qk-norms recorded as the submodules ``W_query`` ... ``out_proj``, ``rope`` and the
    norms' names, by wrapping ``_linear`` / ``_rotate`` / ``_normalise_qk`` on the
    instance.  Returns the attributes set, for ``_uninstrument``."""
    from attention_spec.latent import indexer_layers

    spec = module.spec
    linear, rotate, normalise = module._linear, module._rotate, module._normalise_qk
    rms = getattr(module, "_rms", None)  # latent attention's own RMSNorms, by name
    indexer = getattr(module, "indexer", None)  # sparse attention's, its projections named as transformers'
    indexed = [] if indexer is None else [n for n, kind, _, _ in indexer_layers(spec) if kind == "linear"]

    def _linear(layer: Any, inputs: Any, implementation: str) -> Any:
        child = next(((p.name,) for p in spec.declaration.projections if getattr(module, p.name, None) is layer),
                     next((("indexer", n) for n in indexed if getattr(indexer, n) is layer), None))
        if child is None:  # not one of the declared projections: not a submodule to name
            return linear(layer, inputs, implementation)
        return recorder.around((*name, *child), (inputs,), lambda xs: linear(layer, xs[0], implementation))

    def _rotate(q: Any, k: Any, positions: Any, start: Any = None) -> Any:
        if spec.rope is None:
            return rotate(q, k, positions, start)
        return recorder.around((*name, "rope"), (q, k), lambda xs: rotate(xs[0], xs[1], positions, start))

    def _normalise_qk(role: str, t: Any) -> Any:
        norm = next((n for n, r, _ in spec.qk_norms() if r == role), None)
        if norm is None:
            return normalise(role, t)
        return recorder.around((*name, norm), (t,), lambda xs: normalise(role, xs[0]))

    def _rms(norm: str, t: Any) -> Any:
        return recorder.around((*name, norm), (t,), lambda xs: rms(norm, xs[0]))

    wrappers = {"_linear": _linear, "_rotate": _rotate, "_normalise_qk": _normalise_qk}
    if rms is not None:
        wrappers["_rms"] = _rms
    if indexer is not None:
        wrappers["_choose"] = _choosing(module._choose, name, recorder)
    for attribute, function in wrappers.items():
        object.__setattr__(module, attribute, function)
    return list(wrappers)


def _choosing(choose: Any, name: tuple[Any, ...], recorder: _Recorder) -> Any:
    """Sparse attention's ``_choose`` (either twin), its choice recorded (``_Selection``)
    and, where the recorder holds one for this layer and call (``forced``: the other
    framework's), replaced by that one of the same shape: the layer then attends to the
    keys the other side chose, so that its outputs, and everything after them, compare at
    the normal tolerance whatever the choices (a tie within the scores' rounding goes
    either way)."""
    calls = [0]

    def _choose(call: Any, q: Any, iq: Any, ik: Any, w: Any, **extra: Any) -> Any:
        scores, chosen = choose(call, q, iq, ik, w, **extra)
        k, calls[0] = calls[0], calls[0] + 1
        if recorder.keep_values:
            recorder.selections.append(_Selection(name, k, recorder._exits, np.array(as_numpy(chosen), bool),
                                                  np.array(as_numpy(scores), np.float64)))
        forced = recorder.forced.get(_dotted(name), ())
        if k < len(forced) and forced[k].shape == tuple(chosen.shape):
            chosen = _like(chosen, forced[k])
        return scores, chosen

    return _choose


def _like(template: Any, values: np.ndarray) -> Any:
    """``values`` as an array of ``template``'s framework (and device)."""
    if type(template).__module__.startswith("torch"):
        import torch

        return torch.as_tensor(values, device=template.device)
    import jax.numpy as jnp

    return jnp.asarray(values)


def _uninstrument(instrumented: list[tuple[Any, list[str]]]) -> None:
    for module, attributes in instrumented:
        for attribute in attributes:
            object.__delattr__(module, attribute)


@contextlib.contextmanager
def _torch_hooks(model: Any, recorder: _Recorder) -> Iterator[None]:
    """A forward pre-hook and a forward hook on every submodule of a PyTorch model."""
    from torch_attention._base import AttentionModule

    handles: list[Any] = []
    instrumented: list[tuple[Any, list[str]]] = []

    def enter(name: tuple[str, ...], module: Any, args: Any, kwargs: Any) -> Any:
        new_args, new_kwargs = recorder.enter(name, _call_tree(args, kwargs))
        return tuple(new_args), new_kwargs

    try:
        for dotted, module in model.named_modules():
            name = tuple(dotted.split(".")) if dotted else ()
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, name=name: enter(name, m, a, k), with_kwargs=True))
            handles.append(module.register_forward_hook(
                lambda m, a, k, out: recorder.exit(out), with_kwargs=True))
            if isinstance(module, AttentionModule):
                instrumented.append((module, _instrument_attention(module, name, recorder)))
            elif type(module).__name__ in _HF_INDEXERS and name:
                handles += _hf_indexer_hooks(module, name, recorder)
        yield
    finally:
        for handle in handles:
            handle.remove()
        _uninstrument(instrumented)


# transformers' DSA indexers (``torch_attention._hf_latent``): each returns its top-k key
# indices (B, T, k) and keeps the scores it chose them by to itself
_HF_INDEXERS = ("DeepseekV32Indexer", "GlmMoeDsaIndexer")


def _hf_indexer_hooks(module: Any, name: tuple[str, ...], recorder: _Recorder) -> list[Any]:
    """A ``transformers`` indexer's choice recorded as its attention layer's (``name``
    without ``indexer``): the scores are the tensor its forward takes the top k of (a
    ``TorchFunctionMode`` for the duration of the forward sees that ``topk`` call), the
    choice its indices as bool (B, T, S).  Scores at the mask's finite minimum (an
    additive mask) count as hidden (-inf), and a hidden key it kept (a query that sees
    fewer than k keys) as not chosen."""
    import torch
    from torch.overrides import TorchFunctionMode

    class _Scores(TorchFunctionMode):
        seen: Any = None

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in (torch.topk, torch.Tensor.topk) and args:
                self.seen = args[0]
            return func(*args, **(kwargs or {}))

    modes: list[Any] = []
    calls = [0]

    def before(m: Any, args: Any) -> None:
        modes.append(_Scores())
        modes[-1].__enter__()

    def after(m: Any, args: Any, out: Any) -> None:
        mode = modes.pop()
        mode.__exit__(None, None, None)
        if mode.seen is None or not isinstance(out, torch.Tensor):
            return
        scores = np.array(as_numpy(mode.seen.detach().float()), np.float64)
        scores[scores <= -1e30] = -np.inf  # (float32's minimum, added by an additive mask)
        chosen = np.zeros(scores.shape, bool)
        np.put_along_axis(chosen, np.array(as_numpy(out)).astype(np.int64), True, axis=-1)
        k, calls[0] = calls[0], calls[0] + 1
        recorder.selections.append(_Selection(name[:-1], k, recorder._exits, chosen & np.isfinite(scores), scores))

    class _Cleanup:  # a forward that raised left its mode entered
        def remove(self) -> None:
            while modes:
                modes.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after), _Cleanup()]


def _own_call(cls: type) -> Any:
    """The ``__call__`` that instances of ``cls`` run (None: not callable): looked up in
    the class's MRO, never the metaclass's (whose ``__call__`` constructs instances)."""
    return next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)


def _recording_call(cls: type, run: Any, watched: Mapping[int, tuple[Any, ...]], recorder: _Recorder) -> Any:
    def recording_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = watched.get(id(self)) if type(self) is cls else None  # a subclass's super() call: not twice
        if name is None:
            return run(self, *args, **kwargs)
        new_args, new_kwargs = recorder.enter(name, _call_tree(args, kwargs))
        return recorder.exit(run(self, *new_args, **new_kwargs))

    return recording_call


@contextlib.contextmanager
def _flax_calls(model: Any, recorder: _Recorder) -> Iterator[None]:
    """Every call of every ``nnx.Module`` of a Flax model recorded: each module class's
    ``__call__`` wrapped for the duration (for this model's instances only)."""
    from flax import nnx

    from jax_attention._base import AttentionModule

    modules = list(nnx.iter_modules(model))
    watched = {id(m): tuple(path) for path, m in modules}
    classes = {type(m): _own_call(type(m)) for _, m in modules}
    saved = {cls: cls.__dict__.get("__call__") for cls, run in classes.items() if run is not None}
    instrumented: list[tuple[Any, list[str]]] = []
    try:
        for cls in saved:
            type.__setattr__(cls, "__call__", _recording_call(cls, classes[cls], watched, recorder))
        for path, module in modules:
            if isinstance(module, AttentionModule):
                instrumented.append((module, _instrument_attention(module, tuple(path), recorder)))
        yield
    finally:
        for cls, own in saved.items():
            if own is None:
                type.__delattr__(cls, "__call__")
            else:
                type.__setattr__(cls, "__call__", own)
        _uninstrument(instrumented)


# --------------------------------------------------------------------------- running

def _run_torch(model: Any, inputs: Sequence[Any], call: Any, track: bool) -> tuple[_TorchRecorder, Any]:
    """The PyTorch model run once, every call recorded; float inputs in the model's dtype
    (tracked by autograd when ``track``)."""
    import torch

    dtype = getattr(torch, module_dtype(model, [x for x in inputs if _is_array(x)]))
    device = next((p.device for p in model.parameters()), None)
    xs = [
        (torch.tensor(_numpy_source(x), dtype=dtype, device=device, requires_grad=track) if _is_float(x)
         else torch.as_tensor(as_numpy(x), device=device)) if _is_array(x) else x
        for x in inputs
    ]
    recorder = _TorchRecorder(track)
    with torch.set_grad_enabled(track), _torch_hooks(model, recorder):
        out = model(*xs) if call is None else call(model, *xs)
    return recorder, out


def _flax_inputs(model: Any, inputs: Sequence[Any]) -> list[Any]:
    import jax.numpy as jnp

    dtype = getattr(jnp, module_dtype(model, [x for x in inputs if _is_array(x)]))
    return [
        (jnp.asarray(_numpy_source(x)).astype(dtype) if _is_float(x) else jnp.asarray(as_numpy(x)))
        if _is_array(x) else x
        for x in inputs
    ]


def _run_flax(model: Any, xs: Sequence[Any], call: Any, deltas: list[Any] | None = None,
              forced: Mapping[str, Sequence[np.ndarray]] | None = None) -> tuple[_FlaxRecorder, Any]:
    recorder = _FlaxRecorder(deltas)
    recorder.forced = forced or {}
    with _flax_calls(model, recorder):
        out = model(*xs) if call is None else call(model, *xs)
    return recorder, out


def _outputs_agree(t_tree: _Tree, t_out: Any, f_tree: _Tree, f_out: Any, rtol: float | None,
                   atol: float | None) -> bool:
    """Whether the two models' outputs (what the calls return) agree at the forward tolerance."""
    def arrays(tree: _Tree, out: Any) -> list[tuple[Path, np.ndarray]]:
        leaves, _ = tree.flatten(out)
        return [(path, np.array(as_numpy(leaf), copy=True)) for path, leaf in leaves if tree.is_array(leaf)]

    return _compare_outputs(arrays(t_tree, t_out), arrays(f_tree, f_out), PARITY, rtol, atol).ok is True


def _projections(tree: _Tree, out: Any, seed: int) -> dict[Path, np.ndarray]:
    """The fixed random projection of the model's output: one standard normal array per
    float output leaf, by path; the scalar differentiated is ``sum(leaf * R)`` over them."""
    rng = np.random.default_rng(seed)
    leaves, _ = tree.flatten(out)
    return {path: rng.standard_normal(tuple(leaf.shape)) for path, leaf in leaves
            if _is_array(leaf) and _is_float(leaf)}


def _torch_cotangents(recorder: _TorchRecorder, out: Any, projections: Mapping[Path, np.ndarray]) -> None:
    """Every tracked leaf's cotangent, by ``torch.autograd.grad`` through its view."""
    import torch

    leaves, _ = recorder.tree.flatten(out)
    terms = []
    for path, leaf in leaves:
        if path in projections and leaf.requires_grad:
            acc = torch.float64 if leaf.dtype == torch.float64 else torch.float32
            terms.append((leaf.to(acc) * torch.as_tensor(projections[path], dtype=acc, device=leaf.device)).sum())
    nodes = [n for r in recorder.records for n in (*r.in_nodes, *r.out_nodes) if n is not None]
    grads = iter(torch.autograd.grad(sum(terms), nodes, allow_unused=True) if terms and nodes else [])

    def take(node: Any) -> np.ndarray | None:
        if node is None:
            return None
        grad = next(grads, None)
        return np.array(as_numpy(torch.zeros_like(node) if grad is None else grad))

    for record in recorder.records:
        # written in place after it was recorded (by code between modules, ``x += y``): its
        # cotangent is that of what it became, not of the output compared forward
        record.overwritten = any(n is not None and n._version != v
                                 for n, v in zip(record.out_nodes, record.out_versions, strict=True))
        record.in_cots = [take(n) for n in record.in_nodes]
        record.out_cots = [take(n) for n in record.out_nodes]


def _flax_cotangents(model: Any, xs: Sequence[Any], call: Any, recorder: _FlaxRecorder,
                     projections: Mapping[Path, np.ndarray]) -> None:
    """Every inexact leaf's cotangent: ``jax.grad`` of the same scalar with respect to
    zeros added to each leaf in a second run."""
    import jax
    import jax.numpy as jnp

    def zeros(specs: list[Any]) -> list[Any]:
        return [None if s is None else jnp.zeros(*s) for s in specs]

    deltas = [(zeros(r.in_nodes), zeros(r.out_nodes)) for r in recorder.records]

    def loss(deltas: list[Any]) -> Any:
        again, out = _run_flax(model, xs, call, deltas, recorder.forced)
        if len(again.records) != len(recorder.records):
            raise RuntimeError("the Flax model made a different number of module calls the second time it ran")
        leaves, _ = again.tree.flatten(out)
        total = jnp.zeros((), jnp.float32)
        for path, leaf in leaves:
            if path in projections:
                acc = jnp.float64 if leaf.dtype == jnp.float64 else jnp.float32
                total = total + jnp.sum(leaf.astype(acc) * jnp.asarray(projections[path], acc))
        return total

    grads = jax.jit(jax.grad(loss))(deltas)  # one program, not one per operation of the backward
    for record, (ins, outs) in zip(recorder.records, grads, strict=True):
        record.in_cots = [None if g is None else np.asarray(g) for g in ins]
        record.out_cots = [None if g is None else np.asarray(g) for g in outs]


# --------------------------------------------------------------------------- comparing

_EXACT = Tolerance(0.0, 0.0, normwise=True)


def _tolerance(table: Mapping[str, Tolerance], dtypes: Sequence[str], rtol: float | None,
               atol: float | None) -> Tolerance:
    """The harness's tolerance for the looser of two dtypes, made relative to the
    array's scale (normwise); exact for integers and booleans."""
    floats = [d for d in dtypes if d.startswith(("float", "bfloat", "complex"))]
    if not floats:
        return _EXACT
    missing = [d for d in floats if d not in table]
    if missing and (rtol is None or atol is None):
        raise ValueError(f"no parity tolerance for dtype {missing[0]}; pass rtol= and atol=")
    base = max((table[d] for d in floats if d in table), key=lambda t: t.rtol, default=Tolerance(0.0, 0.0))
    return Tolerance(base.rtol if rtol is None else rtol, base.atol if atol is None else atol, normwise=True)


def _splits(fine: Sequence[int], coarse: Sequence[int]) -> bool:
    """Whether ``fine`` is ``coarse`` with axes split into adjacent ones, unit axes left
    out: (B, T, H, D) of (B, T, H * D), (B, 1, S, r) of (B, S, r).  The same numbers then
    lie in the same order, and a reshape pairs them."""
    fine, coarse = [d for d in fine if d != 1], [d for d in coarse if d != 1]
    i = 0
    for d in coarse:
        p = 1
        while p < d and i < len(fine):
            p, i = p * fine[i], i + 1
        if p != d:
            return False
    return i == len(fine)


def _aligned(a: np.ndarray, shape: tuple[int, ...], layout: str | None) -> np.ndarray | None:
    """The PyTorch array in the Flax array's layout where the two hold the same numbers
    in layouts known here (None: not known): an axis split (or a unit axis) where the
    other has one axis, and for a module declared ``"heads"`` (a qk-norm over each head:
    ``torch_attention._hf.hf_children``) heads before positions, (B, H, T, D), where
    ours has (B, T, H * D).  Decided by shapes and the declaration, never by values."""
    if a.size != int(np.prod(shape)):
        return None
    candidates = [a, np.swapaxes(a, -3, -2)] if layout == "heads" and a.ndim >= 3 else [a]
    for c in candidates:
        if _splits(c.shape, shape) or _splits(shape, c.shape):
            return c.reshape(shape)
    return None


def _compare_arrays(items: Sequence[tuple[str, np.ndarray, np.ndarray]], table: Mapping[str, Tolerance],
                    rtol: float | None, atol: float | None, layout: str | None = None) -> Error:
    """Each pair of arrays at the tolerance of their dtypes, the PyTorch one first put in
    the Flax one's layout where they differ only in it (``_aligned``).  Arrays of as many
    elements in a layout not known here are not compared (said in the note: the search
    goes on); arrays of different sizes fail."""
    ok, worst, compared, notes = True, 0.0, 0, []
    for label, a, b in items:
        if a.shape != b.shape:
            aligned = _aligned(a, b.shape, layout)
            if aligned is None and a.size != b.size:
                return Error(False, float("inf"), f"{label}: torch shape {a.shape}, flax shape {b.shape}")
            if aligned is None:
                notes.append(f"{label} not compared: torch shape {a.shape}, flax shape {b.shape} "
                             "(as many numbers, in a layout not known here)")
                continue
            a = aligned
        finding = compare(label, a, b, _tolerance(table, (a.dtype.name, b.dtype.name), rtol, atol))
        ok, worst, compared = ok and finding.ok, max(worst, finding.max_rel), compared + 1
    if notes and not compared:
        return Error(None, 0.0, "; ".join(notes))
    return Error(ok, worst, "; ".join(notes))


def _paths_text(paths: Sequence[Path]) -> str:
    return "[" + ", ".join(".".join(p) or "<array>" for p in paths) + "]"


def _compare_outputs(t: Sequence[tuple[Path, Any]], f: Sequence[tuple[Path, Any]],
                     table: Mapping[str, Tolerance], rtol: float | None, atol: float | None,
                     layout: str | None = None) -> Error:
    """Outputs leaf by leaf, by path (in path order: JAX flattens a dict by sorted keys,
    PyTorch in insertion order); different structures are a divergence, reported."""
    t, f = sorted(t, key=lambda leaf: leaf[0]), sorted(f, key=lambda leaf: leaf[0])
    t_paths, f_paths = [p for p, _ in t], [p for p, _ in f]
    if t_paths != f_paths:
        return Error(False, float("inf"),
                     f"structures differ: torch {_paths_text(t_paths)}, flax {_paths_text(f_paths)}")
    items = [(".".join(p) or "output", a, b) for (p, a), (_, b) in zip(t, f, strict=True)
             if a is not None and b is not None]
    return _compare_arrays(items, table, rtol, atol, layout) if items or not t else NOT_COMPARED


def _shaped(leaves: Sequence[Any], shape: tuple[int, ...] | None) -> Any:
    """The first leaf of ``shape`` (None: no such leaf, or no shape asked for)."""
    return next((a for a in leaves if shape is not None and a is not None and np.shape(a) == shape), None)


def _compare_inputs(t: Sequence[Any], f: Sequence[Any], table: Mapping[str, Tolerance],
                    rtol: float | None, atol: float | None, stream: tuple[int, ...] | None = None,
                    layout: str | None = None) -> Error:
    """Inputs leaf by leaf, in order (positional arguments, then keywords by name).  Two
    versions given different arrays (Hugging Face's attention: an additive mask and the
    rope's cos and sin, as keywords; ours: x, a bool mask and positions) are compared on
    the input of the output's shape, ``stream`` (the hidden states), where each side has
    one (noted, ``*`` in the table): a bug in such a module's own code is then located
    at it, not at the module around it."""
    if len(t) != len(f):
        note = f"torch passes {len(t)} arrays, flax {len(f)}: the one shaped as the output compared"
        a, b = _shaped(t, stream), _shaped(f, stream)
        if a is not None and b is not None:
            hidden = _compare_arrays([("input", a, b)], table, rtol, atol)
            return Error(hidden.ok, hidden.max_rel, note)
        return Error(None, float("inf"), f"torch passes {len(t)} arrays, flax {len(f)}")
    items = [(f"input[{i}]", a, b) for i, (a, b) in enumerate(zip(t, f, strict=True))
             if a is not None and b is not None]
    return _compare_arrays(items, table, rtol, atol, layout) if items or not t else NOT_COMPARED


# --------------------------------------------------------------------------- pairing

def _dotted(name: Sequence[Any]) -> str:
    return ".".join(str(part) for part in name)


def _check_module_map(module_map: Mapping[str, Any] | None) -> dict[str, str]:
    """{torch name: flax path} as dotted text on both sides; a path is a tuple or
    ``"a/b/c"``.  Raises TypeError for anything else."""
    mapping: dict[str, str] = {}
    for torch_name, path in (module_map or {}).items():
        if not isinstance(torch_name, str) or not isinstance(path, str | tuple):
            raise TypeError(f"module_map maps a torch module name (str) to a flax path (a tuple or 'a/b/c'); "
                            f"got {torch_name!r}: {path!r}")
        mapping[torch_name] = path.replace("/", ".") if isinstance(path, str) else _dotted(path)
    return mapping


def _flax_key(torch_name: str, mapping: Mapping[str, str]) -> str:
    """The dotted Flax name paired with a torch name: the longest mapped prefix replaced
    (mapping ``"h"`` maps ``"h.0.attn"`` too), else the same name."""
    for prefix in sorted(mapping, key=len, reverse=True):
        if torch_name == prefix or (prefix and torch_name.startswith(prefix + ".")):
            return (mapping[prefix] + torch_name[len(prefix):]).strip(".")
    return torch_name


def _declared_pairs(torch_model: Any, flax_model: Any, mapping: Mapping[str, str]
                    ) -> tuple[dict[str, str], dict[str, str]]:
    """The children of every ``transformers`` attention layer that ``from_hf`` takes
    (``torch_attention._hf.recognises_hf_layer``: by mechanism, whatever its class), paired
    with ours where the Flax model holds one of our attention modules at the layer's place
    ({torch name: flax name}: ``q_proj`` with ``W_query`` ...), and the layouts declared
    for them ({torch name: layout}: the qk-norms' heads), from
    ``torch_attention._hf.hf_children``."""
    from flax import nnx

    from attention_spec.interop.delta import is_delta_layer
    from jax_attention._base import AttentionModule
    from torch_attention._hf import hf_children, recognises_hf_layer

    ours = {_dotted(path) for path, m in nnx.iter_modules(flax_model)
            if isinstance(m, AttentionModule) or is_delta_layer(m)}  # softmax and linear attention
    pairs: dict[str, str] = {}
    layouts: dict[str, str] = {}
    for name, module in torch_model.named_modules():
        flax_name = _flax_key(name, mapping)
        # any layer from_hf takes, recognised by what it holds and computes (not its class)
        if flax_name not in ours or not recognises_hf_layer(module):
            continue
        for theirs, (child, layout) in hf_children(module).items():
            torch_child = f"{name}.{theirs}" if name else theirs
            pairs[torch_child] = f"{flax_name}.{child}" if flax_name else child
            if layout is not None:
                layouts[torch_child] = layout
    return pairs, layouts


def _pair(torch_records: Sequence[_Record], flax_records: Sequence[_Record], mapping: Mapping[str, str]
          ) -> tuple[list[ModulePair], list[tuple[int, int]], list[str], list[str]]:
    """The k-th call of a torch module with the k-th call of its Flax module, in torch's
    execution order; the calls left over on either side, by name."""
    by_key: dict[str, list[int]] = {}
    for i, record in enumerate(flax_records):
        by_key.setdefault(_dotted(record.name), []).append(i)
    seen: dict[str, int] = {}
    pair_of: dict[int, int] = {}  # torch record -> pair
    pairs: list[ModulePair] = []
    matched: list[tuple[int, int]] = []
    torch_only: list[str] = []
    for ti, record in enumerate(torch_records):
        name = _dotted(record.name)
        k = seen[name] = seen.get(name, -1) + 1
        candidates = by_key.get(_flax_key(name, mapping), [])
        if k >= len(candidates):
            torch_only.append(f"{name or '(root)'} (call {k})")
            continue
        parent = record.parent
        while parent is not None and parent not in pair_of:
            parent = torch_records[parent].parent
        pair_of[ti] = len(pairs)
        fi = candidates[k]
        pairs.append(ModulePair(name, flax_records[fi].name, k, record.depth,
                                None if parent is None else pair_of[parent], record.exit_order))
        matched.append((ti, fi))
    used = {fi for _, fi in matched}
    flax_only = [f"{_dotted(r.name) or '(root)'}" for i, r in enumerate(flax_records) if i not in used]
    return pairs, matched, torch_only, flax_only


# --------------------------------------------------------------------------- locating

def _innermost(pairs: Sequence[ModulePair], candidates: Sequence[int]) -> list[int]:
    """The candidates that enclose no other candidate."""
    chosen, enclosing = set(candidates), set()
    for i in candidates:
        j = pairs[i].parent
        while j is not None:
            if j in chosen:
                enclosing.add(j)
            j = pairs[j].parent
    return [i for i in candidates if i not in enclosing]


def _divergence(pair: ModulePair, direction: str, error: Error, note: str = "") -> Divergence:
    return Divergence(pair.torch_name, pair.flax_path, pair.call, direction, error.max_rel,
                      "; ".join(n for n in (error.note, note) if n))


def _encloses(pairs: Sequence[ModulePair], outer: int, inner: int) -> bool:
    j = pairs[inner].parent
    while j is not None:
        if j == outer:
            return True
        j = pairs[j].parent
    return False


def _factor_text(factor: float) -> str:
    """A factor as a reader recognises it: 8 (sqrt(64)), 5.657 (sqrt(32)), 0.125 (1/sqrt(64))."""
    text = f"{factor:.4g}"
    size, over = (factor, "") if abs(factor) >= 1 else (1.0 / factor, "1/")
    square = round(size * size)
    if square >= 8 and abs(size * size - square) <= 1e-4 * square:  # sqrt(hidden_size): 8 and up
        return f"{text} ({over}sqrt({square}))"
    return text


def _boundaries(pairs: Sequence[ModulePair], model_agrees: bool) -> dict[int, Boundary]:
    """The pairs split otherwise (``Boundary``): a failing output that is the other's times
    a constant, and, while the model's outputs agree, inputs that already differ."""
    found: dict[int, Boundary] = {}
    for i, p in enumerate(pairs):
        if p.output.ok is False and p.output_factor is not None:
            why = (f"the PyTorch module's output is the Flax module's times {_factor_text(p.output_factor)}: the "
                   "port scales elsewhere (before or after this module) what the original scales inside it")
            found[i] = Boundary(p.torch_name, p.flax_path, p.call, p.output_factor, why)
        elif model_agrees and p.inputs.ok is False:
            why = "its inputs already differ while the model's outputs agree: the port splits the work otherwise"
            found[i] = Boundary(p.torch_name, p.flax_path, p.call, None, why)
    return found


def _first_forward(pairs: Sequence[ModulePair], boundaries: Mapping[int, Boundary]) -> Divergence | None:
    """The innermost module whose inputs agree and whose output does not, the earliest
    called, boundary mismatches searched past; but a mismatch by a constant factor inside
    that module is not undone within it: that mismatch is the divergence (a scale planted
    wrong).  Failing all that (the inputs differ wherever an output does), the first output
    that fails."""
    candidates = [i for i, p in enumerate(pairs)
                  if p.inputs.ok is True and p.output.ok is False and i not in boundaries]
    if candidates:
        chosen = min(_innermost(pairs, candidates))
        numeric = pairs[chosen].output.max_rel != float("inf")  # a structure that differs says nothing of a scale
        inside = [i for i in boundaries
                  if numeric and boundaries[i].factor is not None and _encloses(pairs, chosen, i)]
        if inside:
            pair = min((pairs[i] for i in inside), key=lambda p: p.exit_order)
            within = pairs[chosen].torch_name or "(root)"
            return _divergence(pair, "forward", pair.output,
                               f"its output is the other's times {_factor_text(pair.output_factor or 0.0)}, "
                               f"not undone within {within}")
        pair = pairs[chosen]
        return _divergence(pair, "forward", pair.output)
    failed = [p for i, p in enumerate(pairs) if p.output.ok is False and i not in boundaries]
    if not failed:
        return None
    pair = min(failed, key=lambda p: p.exit_order)
    return _divergence(pair, "forward", pair.output, "no module with agreeing inputs: its inputs differ too")


def _first_backward(pairs: Sequence[ModulePair], boundaries: Mapping[int, Boundary] | None = None
                    ) -> Divergence | None:
    """The innermost module whose output cotangent agrees and whose input cotangent does
    not, the one that backpropagation reaches first (the latest to return forward).  The
    cotangents of a forward boundary mismatch (``Boundary``) differ by construction (the
    scale the port moved scales them too): they are searched past."""
    skip = boundaries or {}
    candidates = [i for i, p in enumerate(pairs)
                  if p.output_cotangent.ok is True and p.input_cotangent.ok is False and i not in skip]
    if candidates:
        pair = max((pairs[i] for i in _innermost(pairs, candidates)), key=lambda p: p.exit_order)
        return _divergence(pair, "backward", pair.input_cotangent)
    failed = [p for i, p in enumerate(pairs)
              if (p.output_cotangent.ok is False or p.input_cotangent.ok is False) and i not in skip]
    if not failed:
        return None
    pair = max(failed, key=lambda p: p.exit_order)
    error = pair.output_cotangent if pair.output_cotangent.ok is False else pair.input_cotangent
    return _divergence(pair, "backward", error, "no module whose output cotangent agrees")


def _forward_errors(pairs: Sequence[ModulePair], matched: Sequence[tuple[int, int]], t: Sequence[_Record],
                    f: Sequence[_Record], rtol: float | None, atol: float | None,
                    layouts: Mapping[str, str]) -> None:
    for pair, (ti, fi) in zip(pairs, matched, strict=True):
        outputs, layout = t[ti].outputs, layouts.get(pair.torch_name)
        stream = np.shape(f[fi].outputs[0][1]) if f[fi].outputs and f[fi].outputs[0][1] is not None else None
        pair.inputs = _compare_inputs(t[ti].inputs, f[fi].inputs, PARITY, rtol, atol, stream, layout)
        pair.output = _compare_outputs(outputs, f[fi].outputs, PARITY, rtol, atol, layout)
        if pair.output.ok is False:
            pair.output_factor = _constant_factor(outputs, f[fi].outputs, rtol, atol, layout)


def _constant_factor(t: Sequence[tuple[Path, Any]], f: Sequence[tuple[Path, Any]], rtol: float | None,
                     atol: float | None, layout: str | None) -> float | None:
    """``c`` where the PyTorch outputs are the Flax ones times one constant (least squares
    over every float leaf, then each leaf checked at the forward tolerance, integer leaves
    equal); None otherwise."""
    t, f = sorted(t, key=lambda leaf: leaf[0]), sorted(f, key=lambda leaf: leaf[0])
    if not t or [p for p, _ in t] != [p for p, _ in f]:
        return None
    floats = []
    for (path, a), (_, b) in zip(t, f, strict=True):
        if a is None or b is None:
            return None
        if a.shape != b.shape:
            a = _aligned(a, b.shape, layout)
            if a is None:
                return None
        if not (np.issubdtype(a.dtype, np.inexact) and np.issubdtype(b.dtype, np.inexact)):
            if not np.array_equal(a, b):
                return None
            continue
        floats.append((".".join(path) or "output", a, b))
    if not floats:
        return None
    num = sum(float(np.sum(a.astype(np.float64) * b.astype(np.float64))) for _, a, b in floats)
    den = sum(float(np.sum(np.square(b.astype(np.float64)))) for _, _, b in floats)
    if not (den > 0 and np.isfinite(num) and np.isfinite(den)) or num == 0:
        return None
    factor = num / den
    scaled = [(label, a, (b.astype(np.float64) * factor).astype(b.dtype)) for label, a, b in floats]
    return factor if _compare_arrays(scaled, PARITY, rtol, atol).ok else None


_OVERWRITTEN = Error(None, 0.0, "not compared: PyTorch wrote this output in place after the module returned it, "
                                "so its cotangent is that of what it became")


def _backward_errors(pairs: Sequence[ModulePair], matched: Sequence[tuple[int, int]], t: Sequence[_Record],
                     f: Sequence[_Record], rtol: float | None, atol: float | None,
                     layouts: Mapping[str, str]) -> None:
    for pair, (ti, fi) in zip(pairs, matched, strict=True):
        layout = layouts.get(pair.torch_name)
        t_out = [(p, c) for (p, _), c in zip(t[ti].outputs, t[ti].out_cots, strict=True)]
        f_out = [(p, c) for (p, _), c in zip(f[fi].outputs, f[fi].out_cots, strict=True)]
        pair.output_cotangent = (_OVERWRITTEN if t[ti].overwritten
                                 else _compare_outputs(t_out, f_out, GRAD_PARITY, rtol, atol, layout))
        stream = np.shape(f[fi].outputs[0][1]) if f[fi].outputs and f[fi].outputs[0][1] is not None else None
        pair.input_cotangent = _compare_inputs(t[ti].in_cots, f[fi].in_cots, GRAD_PARITY, rtol, atol, stream, layout)


# --------------------------------------------------------------------------- selections

def _forced(selections: Sequence[_Selection], mapping: Mapping[str, str]) -> dict[str, list[np.ndarray]]:
    """The PyTorch model's choices, by the Flax layer that runs on them, call by call."""
    forced: dict[str, list[np.ndarray]] = {}
    for sel in selections:
        forced.setdefault(_flax_key(_dotted(sel.name), mapping), []).append(sel.chosen)
    return forced


def _agreeing_rows(rows: np.ndarray, t: Sequence[tuple[Path, Any]], f: Sequence[tuple[Path, Any]],
                   rtol: float | None, atol: float | None) -> Error:
    """A layer's first output (by path) of shape (B, T, ...) in both, at the ``rows``
    (B, T) only."""
    t, f = sorted(t, key=lambda leaf: leaf[0]), sorted(f, key=lambda leaf: leaf[0])
    for (_, a), (_, b) in zip(t, f, strict=False):
        if (a is not None and b is not None and a.shape == b.shape and a.shape[:2] == rows.shape
                and np.issubdtype(a.dtype, np.inexact)):
            return _compare_arrays([("output at the agreeing queries", a[rows], b[rows])], PARITY, rtol, atol)
    return NOT_COMPARED


def _selection_findings(t_rec: _Recorder, f_rec: _Recorder, mapping: Mapping[str, str],
                        pairs: Sequence[ModulePair], matched: Sequence[tuple[int, int]], rtol: float | None,
                        atol: float | None) -> list[SelectionFinding]:
    """Each sparse layer's two choices compared (``compare_selections``, at the layer's
    ``index_topk``: the number of keys the PyTorch side kept for a query that sees more),
    in the PyTorch model's order; a layer that chose on one side only is a finding
    without a report."""
    from parity_tests.selection import compare_selections

    flax = {(_dotted(s.name), s.call): s for s in f_rec.selections}
    pair_of = {(p.torch_name, p.call): i for i, p in enumerate(pairs)}
    findings, used = [], set()
    for sel in t_rec.selections:
        name = _dotted(sel.name)
        key = (_flax_key(name, mapping), sel.call)
        other = flax.get(key)
        path = tuple(key[0].split(".")) if key[0] else ()
        if other is None:
            findings.append(SelectionFinding(name, path, sel.call, at=sel.at,
                                             note="only the PyTorch model chose keys here (the Flax layer has no indexer)"))
            continue
        used.add(key)
        if other.chosen.shape != sel.chosen.shape:
            findings.append(SelectionFinding(name, other.name, sel.call, at=sel.at,
                                             note=f"the choices' shapes differ: torch {sel.chosen.shape}, "
                                                  f"flax {other.chosen.shape}"))
            continue
        visible = np.isfinite(sel.scores)
        topk = int(max(sel.chosen.sum(-1).max(initial=0), 1))
        report = compare_selections(sel.chosen, other.chosen, sel.scores, other.scores, topk)
        scale = float(np.abs(sel.scores[visible]).max(initial=0.0))
        agreeing = NOT_COMPARED
        index = pair_of.get((name, sel.call))
        if index is not None:
            ti, fi = matched[index]
            rows = ~(sel.chosen != other.chosen).any(-1)
            agreeing = _agreeing_rows(rows, t_rec.records[ti].outputs, f_rec.records[fi].outputs, rtol, atol)
        findings.append(SelectionFinding(name, other.name, sel.call, report,
                                         report.score_error / scale if scale > 0 else report.score_error,
                                         agreeing, sel.at))
    findings += [SelectionFinding("", s.name, s.call, at=s.at,
                                  note=f"only the Flax model chose keys at {_dotted(s.name) or '(root)'}")
                 for s in f_rec.selections if (_dotted(s.name), s.call) not in used]
    return findings


def _first_with_selections(first: Divergence | None, findings: Sequence[SelectionFinding],
                           pairs: Sequence[ModulePair]) -> Divergence | None:
    """The numeric first divergence, or a choice of keys that diverges (not a tie) where it
    was made before that module returned."""
    bad = [s for s in findings if not s.ok]
    if not bad:
        return first
    chosen = min(bad, key=lambda s: s.at)
    if first is not None:
        pair = next((p for p in pairs if (p.torch_name, p.call) == (first.torch_name, first.call)), None)
        if pair is not None and pair.exit_order < chosen.at:
            return first
    what = chosen.note if chosen.report is None else chosen.report.summary().splitlines()[0]
    return Divergence(chosen.torch_name, chosen.flax_path, chosen.call, "selection", chosen.score_rel,
                      f"the indexer chose other keys: {what}")


def _sparse_classes(flax_model: Any) -> set[type]:
    """The classes of the Flax model's sparse attention modules (``index_topk``)."""
    from flax import nnx

    from jax_attention._base import AttentionModule

    return {type(m) for _, m in nnx.iter_modules(flax_model)
            if isinstance(m, AttentionModule) and getattr(m.spec, "index_topk", None) is not None
            and hasattr(m, "_choose")}


def compare_choices(torch_model: Any, flax_model: Any, *inputs: Any, torch_call: Any = None, flax_call: Any = None,
                    module_map: Mapping[str, Any] | None = None) -> tuple[list[SelectionFinding], list[np.ndarray]]:
    """Every sparse attention layer's choice of keys in both models, once each, eagerly, as
    ``locate_divergence`` compares them (the Flax model on the PyTorch model's choices, so
    each layer's inputs agree): the findings, and the PyTorch model's choices in the order
    its layers made them (``same_choices``' argument).  Both empty where the PyTorch model
    chose none."""
    if not _sparse_classes(flax_model):  # (nothing to compare: no model run)
        return [], []
    mapping = _check_module_map(module_map)
    declared, _ = _declared_pairs(torch_model, flax_model, mapping)
    mapping = {**declared, **mapping}
    with full_precision():
        t_rec, _ = _run_torch(torch_model, inputs, torch_call, False)
        if not t_rec.selections:
            return [], []
        f_rec, _ = _run_flax(flax_model, _flax_inputs(flax_model, inputs), flax_call,
                             forced=_forced(t_rec.selections, mapping))
    return _selection_findings(t_rec, f_rec, mapping, [], [], None, None), [s.chosen for s in t_rec.selections]


@contextlib.contextmanager
def same_choices(flax_model: Any, choices: Sequence[np.ndarray]) -> Iterator[None]:
    """For the duration, the Flax model's sparse attention layers run on ``choices`` (bool
    (B, T, S) each, in the order the layers choose), whether called eagerly or traced
    (``jax.jit``, ``nnx.split``: the classes' ``_choose`` is wrapped, the k-th call of a
    run taking the k-th choice, counted afresh each run through the model); a choice of
    another shape is not used."""
    classes = _sparse_classes(flax_model)
    if not choices or not classes:
        yield
        return
    count = [0]
    saved = {cls: cls.__dict__.get("_choose") for cls in classes}

    def wrapped(cls: type) -> Any:
        choose = next(c.__dict__["_choose"] for c in cls.__mro__ if "_choose" in c.__dict__)

        def _choose(self: Any, *args: Any, **kwargs: Any) -> Any:
            scores, chosen = choose(self, *args, **kwargs)
            forced = choices[count[0] % len(choices)]
            count[0] += 1
            return scores, (_like(chosen, forced) if forced.shape == tuple(chosen.shape) else chosen)

        return _choose

    try:
        for cls in classes:
            type.__setattr__(cls, "_choose", wrapped(cls))
        yield
    finally:
        for cls, own in saved.items():
            if own is None:
                type.__delattr__(cls, "_choose")
            else:
                type.__setattr__(cls, "_choose", own)


# --------------------------------------------------------------------------- showing

def _headline(report: DivergenceReport) -> str:
    first = report.first
    unchecked = f"\n{report.backward_note}" if report.backward_note else ""
    if first is None:
        what = "forward and backward" if report.backward_checked else "forward"
        split = len(report.boundaries)
        but = f", but for {split} boundary mismatch{'es' if split > 1 else ''} (below)" if split else ""
        tied = sum(s.ties_only for s in report.selections)
        ties = (f"; {tied} sparse layer{'s' if tied > 1 else ''} chose other keys by ties within the scores' "
                "rounding (both right; the Flax model ran on PyTorch's choice: below)") if tied else ""
        return f"no divergence: {len(report.pairs)} module calls agree {what}{but}{ties}{unchecked}"
    call = f", call {first.call}" if first.call else ""
    note = f" ({first.note})" if first.note else ""
    if first.direction == "selection":
        return (f"first divergence: the choice of keys at {first.torch_name or '(root)'}{call} (flax "
                f"{first.flax_path}; sparse attention): scores max rel err {first.max_rel:.2e}{note}{unchecked}")
    return (f"first divergence {first.direction} at {first.torch_name or '(root)'}{call} "
            f"(flax {first.flax_path}): max rel err {first.max_rel:.2e}{note}{unchecked}")


def _is_first(report: DivergenceReport, pair: ModulePair) -> bool:
    first = report.first
    return first is not None and (pair.torch_name, pair.call) == (first.torch_name, first.call)


def _relative_name(pairs: Sequence[ModulePair], pair: ModulePair) -> str:
    """A module's name below the enclosing call's (``mlp.fc1`` inside ``blocks.0``)."""
    parent = "" if pair.parent is None else pairs[pair.parent].torch_name
    if parent and pair.torch_name.startswith(parent + "."):
        return pair.torch_name[len(parent) + 1:]
    return pair.torch_name or "(root)"


def _table(report: DivergenceReport) -> str:
    """The headline, then every module pair in execution order (indented by nesting)
    with its errors relative to scale (``!``: fails; ``-``: nothing to compare), the first
    divergence marked, the notes, and the calls that only one framework made."""
    names = [("  " * p.depth + _relative_name(report.pairs, p) + (f" #{p.call}" if p.call else ""))
             for p in report.pairs]
    width = max([len("module"), *map(len, names)])
    columns = ("inputs", "output", "d output", "d inputs")
    lines = [_headline(report), "", f"     {'module':<{width}}  " + "  ".join(f"{c:>10}" for c in columns)]
    notes = []
    split = {(b.torch_name, b.call) for b in report.boundaries}
    for pair, name in zip(report.pairs, names, strict=True):
        errors = (pair.inputs, pair.output, pair.output_cotangent, pair.input_cotangent)
        mark = ">>" if _is_first(report, pair) else "~~" if (pair.torch_name, pair.call) in split else "  "
        lines.append(f"  {mark} {name:<{width}}  " + "  ".join(f"{e.text():>10}" for e in errors)
                     + {">>": "   <- first", "~~": "   <- boundary"}.get(mark, ""))
        notes += [f"  {pair.torch_name or '(root)'}: {e.note}" for e in errors if e.note]
    if report.selections:
        lines += ["", "choices of keys (sparse attention; the Flax model ran on the PyTorch model's choice):"]
        lines += [s.text() for s in report.selections]
    if report.boundaries:
        lines += ["", "boundary mismatches (searched past; each module must compute what the original's module "
                  "of its name computes, Hugging Face's for a transformers model: move the work into it):"]
        lines += [f"  {b.torch_name or '(root)'}{f' (call {b.call})' if b.call else ''}: {b.why}"
                  for b in report.boundaries]
    if notes:
        lines += ["", "notes:", *notes]
    for side, calls in (("torch", report.torch_only), ("flax", report.flax_only)):
        if calls:
            lines += ["", f"only in {side} (not compared): " + ", ".join(calls)]
    return "\n".join(lines)


def _plot(report: DivergenceReport, path: Any, tolerances: tuple[float, float]) -> None:
    """Each module's error against its depth in the model (the order in which the outputs
    were produced), log scale: rounding that accumulates rises smoothly, a bug jumps."""
    from matplotlib.figure import Figure

    pairs = sorted(report.pairs, key=lambda p: p.exit_order)
    depth = np.arange(len(pairs))

    def series(errors: list[Error]) -> np.ndarray:
        values = np.array([e.max_rel if e.ok is not None else np.nan for e in errors], dtype=np.float64)
        return np.clip(values, 1e-17, 1e3)  # exact agreement and broken structure, on the plot

    figure = Figure(figsize=(9, 4.5))
    axes = figure.subplots()
    axes.semilogy(depth, series([p.output for p in pairs]), ".-", label="forward: output")
    if report.backward_checked:
        axes.semilogy(depth, series([p.input_cotangent for p in pairs]), ".-", label="backward: input cotangent")
    axes.axhline(tolerances[0], color="grey", linestyle="--", label=f"forward tolerance (rtol {tolerances[0]:g})")
    if report.backward_checked:
        axes.axhline(tolerances[1], color="grey", linestyle=":",
                     label=f"backward tolerance (rtol {tolerances[1]:g})")
    for x, pair in zip(depth, pairs, strict=True):
        if _is_first(report, pair) and report.first is not None:
            axes.semilogy([x], [min(max(report.first.max_rel, 1e-17), 1e3)], "o", color="red", markersize=9)
            axes.annotate(f"{pair.torch_name or '(root)'} ({report.first.direction})", (x, report.first.max_rel),
                          textcoords="offset points", xytext=(6, 6), color="red")
    axes.set_xlabel("module call, in the order the outputs were produced")
    axes.set_ylabel("max |torch - flax| / scale")
    first = report.first
    axes.set_title("no divergence" if first is None
                   else f"first divergence {first.direction} at {first.torch_name or '(root)'}")
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


# --------------------------------------------------------------------------- the entry point

def locate_divergence(
    torch_model: Any,
    flax_model: Any,
    *inputs: Any,
    torch_call: Any = None,
    flax_call: Any = None,
    module_map: Mapping[str, Any] | None = None,
    backward: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    plot: Any = None,
    seed: int = 0,
    same_selection: bool = True,
) -> DivergenceReport:
    """Where a PyTorch model and its Flax NNX port part, module by module.

    Args:
      inputs: arrays (NumPy, torch or JAX; float ones cast to each model's dtype) or other
        values, passed to both models as they are.
      torch_call, flax_call: ``(model, *inputs) -> output`` (default ``model(*inputs)``),
        run eagerly (no ``jax.jit``); the output may be any pytree (tuples, dicts, Hugging
        Face model outputs).
      module_map: {torch module name: flax path (a tuple or ``"a/b/c"``)} for modules named
        differently; a mapped name maps the names below it too (``{"h": "layers"}`` pairs
        ``h.0.attn`` with ``layers.0.attn``).  Unmapped names pair with the same path
        (``blocks.1.attn`` with ``("blocks", 1, "attn")``).  The children of a
        ``transformers`` attention layer that ``from_hf`` reads are paired with ours without
        it (``q_proj`` with ``W_query`` ...) wherever the Flax model holds one of our
        attention modules at the layer's place; the caller's names win.
      backward: when every forward output agrees, also compare the cotangents of every
        module's output and inputs for ``sum(output * R)``, ``R`` standard normal (``seed``).
      rtol, atol: override the harness's tolerances (``PARITY`` forward, ``GRAD_PARITY``
        backward, per dtype), both relative to each array's largest magnitude.
      plot: a path: the errors against depth drawn there (matplotlib).
      same_selection: sparse attention (DSA): the Flax model's layers run on the keys the
        PyTorch model's layers chose (our twin's or ``transformers``' indexer), each
        layer's own choice compared with it apart from the numbers (``selections``:
        ``parity_tests.selection.compare_selections``), so that a tie within the scores'
        rounding, which goes either way, changes no number compared after it.  A choice
        that differs beyond the rounding is the divergence (``direction="selection"``)
        where no module that returned before it diverges.  False: each side its own.

    Every call of every submodule is compared: a module called several times is paired
    call by call.  Inputs are compared leaf by leaf in order (positional arguments, then
    keywords by name), outputs by path; outputs of different structures, or arrays of
    different sizes, are a divergence, reported (not raised).  Arrays that hold the same
    numbers in another layout are compared in the Flax one's (``_aligned``: a split or unit
    axis; heads before positions where declared); as many numbers in a layout not known
    here are not compared (``n/c``, with a note) and the search goes on.  The models run
    in ``full_precision()``, in the mode they are in.

    A pair whose output is the other's times one constant (``factor``), or whose inputs
    already differ while the models' outputs agree, is a boundary mismatch (``Boundary``,
    in ``boundaries``), not a divergence: the search goes on past it, forward and backward,
    unless the factor is not undone within the innermost module around it whose inputs
    agree and whose output does not (then it is ``first``, the factor in its note).  Each
    Flax module must compute what the PyTorch module of its name computes.

    Returns a ``DivergenceReport``: ``first`` (None when nothing diverges: ``ok``), every
    module pair with its errors, ``boundaries``, ``selections`` (each sparse layer's
    choices of keys compared), ``backward_note`` (why backward was not
    checked, when it was not), ``str()`` a table.  Raises TypeError for a malformed
    ``module_map``, ValueError for a dtype without a tolerance (unless rtol and atol are
    given), and whatever the models raise.
    """
    mapping = _check_module_map(module_map)
    declared, layouts = _declared_pairs(torch_model, flax_model, mapping)
    mapping = {**declared, **mapping}  # the caller's names win
    with full_precision():
        t_rec, t_out = _run_torch(torch_model, inputs, torch_call, backward)
        xs = _flax_inputs(flax_model, inputs)
        forced = _forced(t_rec.selections, mapping) if same_selection else {}
        f_rec, f_out = _run_flax(flax_model, xs, flax_call, forced=forced)
        pairs, matched, torch_only, flax_only = _pair(t_rec.records, f_rec.records, mapping)
        _forward_errors(pairs, matched, t_rec.records, f_rec.records, rtol, atol, layouts)
        bounds = _boundaries(pairs, _outputs_agree(t_rec.tree, t_out, f_rec.tree, f_out, rtol, atol))
        selections = _selection_findings(t_rec, f_rec, mapping, pairs, matched, rtol, atol)
        first = _first_with_selections(_first_forward(pairs, bounds), selections, pairs)
        checked = backward and first is None
        if checked:
            projections = _projections(t_rec.tree, t_out, seed)
            _torch_cotangents(t_rec, t_out, projections)
            _flax_cotangents(flax_model, xs, flax_call, f_rec, projections)
            _backward_errors(pairs, matched, t_rec.records, f_rec.records, rtol, atol, layouts)
            first = _first_backward(pairs, bounds)
    if not backward:
        why = "backward not checked: backward=False"
    elif first is not None and first.direction in ("forward", "selection"):
        why = (f"backward not checked: the forward parts at {first.torch_name or '(root)'}, and every "
               "cotangent that reaches it would differ from there back")
    else:
        why = ""
    named = None if first is None else (first.torch_name, first.call)
    boundaries = [b for b in bounds.values() if (b.torch_name, b.call) != named]
    report = DivergenceReport(pairs, first, checked, torch_only, flax_only, why, boundaries, selections)
    if plot is not None:
        dtype = module_dtype(torch_model, [x for x in inputs if _is_array(x)])
        forward, gradient = (PARITY.get(dtype, PARITY["float32"]).rtol, GRAD_PARITY.get(dtype, GRAD_PARITY["float32"]).rtol)
        _plot(report, plot, (forward, gradient) if rtol is None else (rtol, rtol))
    return report
