"""The parity harness: move weights between the twins, run both, compare.

``to_flax`` / ``to_torch`` build a module's twin from its own ``config`` and copy the
weights through the declared map (``attention_spec.interop.conversion``).  ``check_parity``
runs a PyTorch module and a Flax module on the same inputs, in the same mode and on the
same path (``implementation=``), and compares outputs, attention weights (when asked,
``weights=True``) and gradients with respect to every input and every parameter;
``assert_parity`` raises on the first failure with the worst element named.  Both work on
any pair (a user's own modules, Hugging Face's, PyTorch's or Flax's own) with a
``param_map`` (a name-to-path mapping or ``attention_spec.interop.specs.Rule``s: packed q/k/v,
reshapes, transposes) and ``torch_call`` / ``flax_call`` to adapt call signatures and
outputs, and ``rows=`` to compare only some query rows (padding left out);
``copy_params`` copies the weights through the same map.  Neither changes a global flag: the
full-precision matmuls they need are set in a context (``full_precision``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_spec.interop.conversion import VARIANTS, as_numpy, module_rules
from attention_spec.interop.delta import DELTA_LAYERS, delta_config, is_delta_layer
from attention_spec.interop.specs import (
    Rule,
    apply_specs,
    check_specs,
    path_text,
    rules_from_mapping,
    spec_shapes,
)
from parity_tests.tolerances import GRAD_PARITY, PARITY, Tolerance

__all__ = [
    "Finding",
    "ParityError",
    "ParityReport",
    "assert_parity",
    "check_parity",
    "compare",
    "copy_params",
    "full_precision",
    "run_flax",
    "run_torch",
    "to_flax",
    "to_torch",
]



def jax_jit_lazy(fun: Any = None, **jit_kwargs: Any) -> Any:
    """``jax.jit`` applied on first call, so that importing the harness needs no JAX."""
    if fun is None:
        return functools.partial(jax_jit_lazy, **jit_kwargs)
    compiled: list[Any] = []

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            import jax

            compiled.append(jax.jit(fun, **jit_kwargs))
        return compiled[0](*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------- dtypes

def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def jax_dtype(name: str) -> Any:
    import jax.numpy as jnp

    return getattr(jnp, name)


def module_dtype(module: Any, inputs: Sequence[Any] = ()) -> str:
    """The parameter dtype name of a module of either framework; for a module without
    parameters, the dtype of its first floating-point input (float32 if none)."""
    if hasattr(module, "parameters"):  # torch
        params = list(module.parameters())
        if params:
            return str(params[0].dtype).removeprefix("torch.")
    else:
        from flax import nnx

        leaves = [v[...] for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
        if leaves:
            return str(leaves[0].dtype)
    floats = [as_numpy(x).dtype.name for x in inputs if _is_float(x)]
    return floats[0] if floats else "float32"


# --------------------------------------------------------------------------- conversion

def to_flax(torch_module: Any, *, rngs: Any = None) -> Any:
    """The Flax NNX twin of one of our PyTorch modules, with its weights copied exactly.

    The twin has the same class name and constructor config, parameters in the same dtype,
    and the same train/eval mode.  Raises ValueError if the class has no twin.
    """
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention

    name = type(torch_module).__name__
    cls = _twin_class(jax_attention, name)
    dtype = jax_dtype(module_dtype(torch_module))
    # PyTorch has one dtype for storage and computation: it is Flax's param_dtype (dtype,
    # the computation dtype, left at None follows it).
    key = "param_dtype" if _takes(cls.__init__, "param_dtype") else "dtype"
    kwargs = {key: dtype} if _takes(cls.__init__, key) else {}
    config = _twin_config(torch_module)
    if is_delta_layer(torch_module):  # parameters alone (no dropout): built abstract, no random draw compiled
        twin = nnx.eval_shape(lambda: cls(**config, **kwargs, rngs=nnx.Rngs(0)))
        for _, variable in nnx.iter_graph(twin):
            if isinstance(variable, nnx.Param):  # zeros, then ours below
                abstract = variable.get_value()
                variable.set_value(jnp.asarray(np.zeros(abstract.shape, abstract.dtype)))
    else:
        twin = cls(**config, **kwargs, rngs=rngs if rngs is not None else nnx.Rngs(0))
    jax_attention.interop.load_torch_state_dict(twin, torch_module.state_dict())
    twin.set_attributes(deterministic=not torch_module.training, raise_if_not_found=False)
    return twin


def to_torch(flax_module: Any) -> Any:
    """The PyTorch twin of one of our Flax NNX modules, with its weights copied exactly.

    Same class name, constructor config, parameter dtype and train/eval mode.
    """
    import torch_attention
    from jax_attention.interop import flax_arrays

    name = type(flax_module).__name__
    cls = _twin_class(torch_attention, name)
    # The Flax module's parameter dtype (param_dtype, its storage) is PyTorch's dtype;
    # PyTorch cannot store in one dtype and compute in another.
    dtype = module_dtype(flax_module)
    compute = getattr(flax_module, "dtype", None)
    if compute is not None and _dtype_name(compute) != dtype:
        raise ValueError(
            f"the Flax {name} stores its parameters in {dtype} (param_dtype) but computes in "
            f"{_dtype_name(compute)} (dtype); a PyTorch module has one dtype for both: "
            "build the Flax module with dtype=None or dtype=param_dtype"
        )
    kwargs = {"dtype": torch_dtype(dtype)} if _takes(cls.__init__, "dtype") else {}
    twin = cls(**_twin_config(flax_module), **kwargs)
    torch_attention.interop.load_flax_arrays(twin, flax_arrays(flax_module))
    twin.train(not _flax_deterministic(flax_module))
    return twin


def _twin_config(module: Any) -> dict[str, Any]:
    """The keywords that build ``module``'s twin: its portable config, or a
    linear-attention layer's sizes (``attention_spec.interop.delta``)."""
    return delta_config(module) if is_delta_layer(module) else portable_config(module.config)


def portable_config(config: dict[str, Any]) -> dict[str, Any]:
    """A module's constructor keywords for its twin in the other framework: a library mod
    (``score_mod``, ``mask_mod``) over NumPy copies of its arrays (``mods.portable``).  A
    function of the user's own, given as the mod or as a part of a library combinator
    (``and_masks``, ``or_masks``, ``chain``, at any depth), raises ValueError naming it and
    where it sits, before anything is built: it is written in one framework's operations."""
    from attention_spec.mods import portable

    for role in ("score_mod", "mask_mod"):
        own = _own_functions(config.get(role), role)
        if own and own[0][0] != role:  # one given directly: mods.portable's own text
            shown = ", ".join(f"at {where} ({_function_name(fn)})" for where, fn in own)
            raise ValueError(
                f"{role} holds a function of its own {shown}, written in one framework's operations: it "
                "cannot move to the other; build it from attention_spec.mods")
    return {name: portable(name, value) if name in ("score_mod", "mask_mod") else value
            for name, value in config.items()}


def _function_name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", type(fn).__name__))


def _own_functions(mod: Any, where: str) -> list[tuple[str, Any]]:
    """(where, function) for each callable inside ``mod`` that is not a library mod:
    ``mod`` itself, or a part of a combinator (``parts``), or the mod a library mod wraps
    (a dataclass field holding a callable), walked at any depth."""
    import dataclasses

    from attention_spec.mods import Mod

    if mod is None:
        return []
    if not isinstance(mod, Mod):
        return [(where, mod)] if callable(mod) else []
    found: list[tuple[str, Any]] = []
    for slot in dataclasses.fields(mod):
        value = getattr(mod, slot.name)
        if isinstance(value, (tuple, list)):
            for i, part in enumerate(value):
                if isinstance(part, Mod) or callable(part):
                    found += _own_functions(part, f"{where}.{slot.name}[{i}]")
        elif isinstance(value, Mod) or (callable(value) and not _is_array_like(value)):
            found += _own_functions(value, f"{where}.{slot.name}")
    return found


def _is_array_like(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _dtype_name(dtype: Any) -> str:
    import jax.numpy as jnp

    return jnp.dtype(dtype).name


def _takes(function: Any, name: str) -> bool:
    """Whether ``function`` has a parameter called ``name`` (or takes ``**kwargs``)."""
    parameters = inspect.signature(function).parameters
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _flax_deterministic(module: Any) -> bool:
    from flax import nnx

    flags = [m.deterministic for _, m in nnx.iter_graph(module) if isinstance(m, nnx.Dropout)]
    return all(flags) if flags else True


def _twin_class(package: Any, name: str) -> Any:
    if name not in VARIANTS and name not in DELTA_LAYERS and name != "CompressedAttention":  # DeepSeek-V4's
        raise ValueError(
            f"{name} is not one of this library's modules ({', '.join(VARIANTS)}); "
            "for your own modules pass param_map= to check_parity / assert_parity"
        )
    return getattr(package, name)


# --------------------------------------------------------------------------- findings

@dataclass(frozen=True)
class Finding:
    """One compared tensor: its worst element and whether it is within tolerance."""

    name: str
    ok: bool
    max_abs: float
    max_rel: float  # max|a - b| / max(max|b|, atol): relative to the tensor's scale
    index: tuple[int, ...]
    torch_value: float
    flax_value: float
    rtol: float
    atol: float
    shape: tuple[int, ...] = ()
    labels: tuple[str, str] = ("torch", "flax")
    # The smallest t for which rtol = atol = t would pass: what tolerances are measured by.
    needed: float = 0.0
    # How many times its allowance the worst element's error is: max |a - b| / (atol +
    # rtol * magnitude), above 1 fails; how findings are ranked (``describe`` says it).
    tolerance_used: float = 0.0
    # How many query rows (``rows=``) this tensor was compared without.
    rows_left_out: int = 0

    def describe(self) -> str:
        a, b = self.labels
        left_out = f"; {self.rows_left_out} query rows left out" if self.rows_left_out else ""
        times = f", {self.tolerance_used:.3g}x its allowance" if self.tolerance_used > 1 else ""
        return (
            f"{self.name}{list(self.index)}: {a} {self.torch_value!r} vs {b} {self.flax_value!r} "
            f"(abs err {self.max_abs:.3g}, rel err {self.max_rel:.3g}; "
            f"tolerance rtol={self.rtol:g}, atol={self.atol:g}{times}{left_out})"
        )


@dataclass
class ParityReport:
    """Everything ``check_parity`` compared; ``ok`` if every finding is within tolerance."""

    findings: list[Finding] = field(default_factory=list)
    torch_results: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    flax_results: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    # rows=: how many of how many (batch x seq) query rows were left out of the comparison
    rows_left_out: int = 0
    rows_total: int = 0
    # where the failures lie, when that points to rows=: said after them
    hint: str = ""

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]

    @property
    def worst(self) -> Finding | None:
        return max(self.failures or self.findings, key=lambda f: f.tolerance_used, default=None)

    def message(self) -> str:
        rows = f" ({self.rows_left_out} of {self.rows_total} query rows left out)" if self.rows_left_out else ""
        if self.ok:
            return f"parity holds for {len(self.findings)} tensors{rows}"
        lines = [f"parity fails for {len(self.failures)} of {len(self.findings)} tensors{rows}; worst:"]
        lines += ["  " + f.describe() for f in sorted(self.failures, key=lambda f: -f.tolerance_used)]
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)


class ParityError(AssertionError):
    def __init__(self, report: ParityReport) -> None:
        super().__init__(report.message())
        self.report = report


def compare(
    name: str, torch_value: Any, flax_value: Any, tol: Tolerance, labels: tuple[str, str] = ("torch", "flax"),
    *, where: Any = None, rows_left_out: int = 0,
) -> Finding:
    """Compares two arrays elementwise: ``|a - b| <= atol + rtol * |b|`` (or, for a
    normwise tolerance, ``rtol * max|b|``).  ``where``: a bool array broadcastable to
    their shape; only the elements where it is True are compared (and give the scale of
    a normwise tolerance); the finding's index is still one into the whole array.
    ``rows_left_out`` is recorded in the finding (how many query rows ``where`` left out)."""
    a = np.asarray(as_numpy(torch_value), dtype=np.float64)
    b = np.asarray(as_numpy(flax_value), dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"{name}: torch gives shape {a.shape} but flax gives shape {b.shape}")
    keep = None if where is None else np.broadcast_to(np.asarray(where, dtype=bool), a.shape)
    if a.size == 0 or (keep is not None and not keep.any()):
        return Finding(name, True, 0.0, 0.0, (), 0.0, 0.0, tol.rtol, tol.atol, a.shape, labels,
                       rows_left_out=rows_left_out)
    if keep is not None:  # left-out elements: equal zeros, which neither fail nor set a scale
        a, b = np.where(keep, a, 0.0), np.where(keep, b, 0.0)
    diff = np.abs(a - b)
    nan = np.isnan(a) != np.isnan(b)
    diff = np.where(np.isnan(a) & np.isnan(b), 0.0, np.where(nan, np.inf, diff))
    finite_b = np.abs(b[np.isfinite(b)])
    magnitude = (finite_b.max() if finite_b.size else 0.0) if tol.normwise else np.abs(b)
    excess = diff - (tol.atol + tol.rtol * magnitude)
    needed = float(np.max(diff / (1.0 + magnitude)))
    tolerance_used = float(np.max(diff / np.maximum(tol.atol + tol.rtol * magnitude, 1e-300)))
    ranked = np.where(np.isnan(excess), np.inf, excess)
    flat = int(np.nanargmax(ranked if keep is None else np.where(keep, ranked, -np.inf)))
    index = tuple(int(i) for i in np.unravel_index(flat, a.shape))
    # A tensor that is zero in exact arithmetic (the gradient of a key bias, say) has no
    # scale of its own; atol stands in for it there.
    scale = max(float(np.nanmax(np.abs(b))) if np.isfinite(b).any() else 0.0, tol.atol)
    max_abs = float(np.max(diff))
    return Finding(
        name=name,
        ok=bool(np.all(excess <= 0)),
        max_abs=max_abs,
        max_rel=max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf")),
        index=index,
        torch_value=float(a[index]),
        flax_value=float(b[index]),
        rtol=tol.rtol,
        atol=tol.atol,
        shape=a.shape,
        labels=labels,
        needed=needed,
        tolerance_used=tolerance_used,
        rows_left_out=rows_left_out,
    )


# --------------------------------------------------------------------------- running

def _is_ours(module: Any) -> bool:
    return type(module).__name__ in VARIANTS and hasattr(module, "config")


def _has_dropout_arg(module: Any) -> bool:
    """Whether the variant has dropout (and so takes ``deterministic=`` / ``dropout_mask=``),
    as the variant registry declares it."""
    from attention_spec.registry import variant

    return variant(type(module).__name__).has_dropout


def _split_outputs(result: Any, ours: bool, weights: bool) -> dict[str, Any]:
    if ours and weights:  # called with return_weights=True
        return {"output": result[0], "attention weights": result[1]}
    if isinstance(result, (tuple, list)):
        return {f"output[{i}]": r for i, r in enumerate(result)}
    return {"output": result}


def _call_kwargs(module: Any, implementation: str | None, weights: bool) -> dict[str, Any]:
    """The keywords that choose what one of our modules computes: ``return_weights`` only
    when weights are compared (asking for them sends every module down the reference
    path), ``implementation`` only when one is asked for (None: the module's own)."""
    if not _is_ours(module):
        return {}
    kwargs: dict[str, Any] = {"return_weights": True} if weights else {}
    if implementation is not None:  # the per-call override every module's call takes
        kwargs["implementation"] = implementation
    return kwargs


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """float32 matmuls at full precision in both frameworks for the duration: JAX's
    default matmul precision "highest" (a context, so jit caches stay apart) and PyTorch's
    TF32 off.  Every flag is put back as it was found, also on error."""
    import importlib.util

    with contextlib.ExitStack() as stack:
        if importlib.util.find_spec("jax") is not None:
            import jax

            stack.enter_context(jax.default_matmul_precision("highest"))
        if importlib.util.find_spec("torch") is not None:
            import torch

            saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                     torch.get_float32_matmul_precision())

            def restore() -> None:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
                torch.set_float32_matmul_precision(saved[2])

            stack.callback(restore)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
        yield


def run_torch(
    module: Any,
    inputs: Sequence[np.ndarray],
    *,
    mask: np.ndarray | None = None,
    dropout_mask: np.ndarray | None = None,
    training: bool = False,
    grads: bool = True,
    cotangent: np.ndarray | None = None,
    param_names: Sequence[str] | None = None,
    implementation: str | None = None,
    weights: bool = False,
    call: Any = None,
    rows: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Runs a PyTorch module; returns outputs and gradients (of ``sum(out * cotangent)``
    with respect to every float input and the named parameters) as NumPy arrays.
    ``implementation``, ``weights``, ``call`` (``torch_call``) and ``rows`` (the cotangent
    is zero at the rows it leaves out) as in ``check_parity``."""
    import torch

    dtype = torch_dtype(module_dtype(module, inputs))
    xs = [
        torch.tensor(x, dtype=dtype, requires_grad=grads) if np.issubdtype(x.dtype, np.floating)
        else torch.tensor(x)
        for x in (_numpy_source(x) for x in inputs)
    ]
    kwargs: dict[str, Any] = {}
    if mask is not None:
        kwargs["mask"] = torch.tensor(np.asarray(mask, dtype=bool))
    kwargs.update(_call_kwargs(module, implementation, weights))
    if dropout_mask is not None:
        kwargs["dropout_mask"] = torch.tensor(np.asarray(dropout_mask, dtype=bool))
    was_training = module.training
    module.train(training)
    params = dict(module.named_parameters())
    for p in params.values():
        p.grad = None
    try:
        returned = module(*xs, **kwargs) if call is None else call(module, *xs, **kwargs)
        outputs = _split_outputs(returned, _is_ours(module), weights)
    finally:
        module.train(was_training)
    result = {name: as_numpy(value) for name, value in outputs.items()}
    if grads:
        primary = next(iter(outputs.values()))
        cot = torch.tensor(_cotangent(cotangent, tuple(primary.shape), rows), dtype=torch.float32)
        (primary.float() * cot).sum().backward()
        for i, x in enumerate(xs):
            if x.requires_grad:
                result[f"grad input[{i}]"] = as_numpy(x.grad)
        for name in param_names if param_names is not None else params:
            grad = params[name].grad
            result[f"grad {name}"] = as_numpy(grad if grad is not None else torch.zeros_like(params[name]))
    return result


def run_flax(
    module: Any,
    inputs: Sequence[np.ndarray],
    *,
    mask: np.ndarray | None = None,
    dropout_mask: np.ndarray | None = None,
    training: bool = False,
    grads: bool = True,
    cotangent: np.ndarray | None = None,
    param_paths: Mapping[str, tuple[Any, ...]] | None = None,
    transposed: Mapping[str, bool] | None = None,
    implementation: str | None = None,
    weights: bool = False,
    call: Any = None,
    rows: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Runs a Flax NNX module like ``run_torch``; parameter gradients are reported under
    the names of ``param_paths`` (transposed when ``transposed`` says so).  ``call`` is
    ``flax_call`` of ``check_parity``; it runs inside ``jax.jit``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    dtype = jax_dtype(module_dtype(module, inputs))
    xs = [jnp.asarray(_numpy_source(x)).astype(dtype) if _is_float(x) else jnp.asarray(x) for x in inputs]
    kwargs: dict[str, Any] = {}
    if mask is not None:
        kwargs["mask"] = jnp.asarray(np.asarray(mask, dtype=bool))
    ours = _is_ours(module)
    kwargs.update(_call_kwargs(module, implementation, weights))
    if dropout_mask is not None:
        kwargs["dropout_mask"] = jnp.asarray(np.asarray(dropout_mask, dtype=bool))
    restore = None
    if ours and _has_dropout_arg(module):
        kwargs["deterministic"] = not training
    else:
        restore = _flax_deterministic(module)
        module.set_attributes(deterministic=not training, raise_if_not_found=False)
    float_positions = tuple(i for i, x in enumerate(inputs) if _is_float(x))
    split_weights = ours and weights
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    arrays = {k: v for k, v in kwargs.items() if hasattr(v, "shape")}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    try:
        if not grads:
            cot = jnp.zeros((), jnp.float32)  # no gradient is taken
        elif cotangent is not None:  # its shape is checked against the output's while tracing
            cot = jnp.asarray(_cotangent(cotangent, np.shape(cotangent), rows))
        else:  # the output's shape, from a trace of the forward alone
            primary_shape = jax.eval_shape(
                lambda p, xs_, a: _flax_call(graphdef, p, rest, xs_, a, static, split_weights, call)[0],
                params, xs, arrays
            ).shape
            cot = jnp.asarray(_cotangent(None, tuple(primary_shape), rows))
        outputs, gradients = _flax_run(
            graphdef, params, rest, xs, arrays, cot, static=static, ours=split_weights,
            float_positions=float_positions if grads else None, call=call,
        )
        result = {name: as_numpy(value) for name, value in outputs.items()}
        if grads:
            param_grads, input_grads = gradients
            for pos, g in zip(float_positions, input_grads, strict=True):
                result[f"grad input[{pos}]"] = as_numpy(g)
            flat = {tuple(p): v for p, v in nnx.to_flat_state(param_grads)}
            paths = param_paths if param_paths is not None else {"/".join(map(str, p)): p for p in flat}
            for name, path in paths.items():
                g = as_numpy(flat[tuple(path)][...])
                result[f"grad {name}"] = g.T if transposed and transposed.get(name) else g
    finally:
        if restore is not None:
            module.set_attributes(deterministic=restore, raise_if_not_found=False)
    return result


def _flax_call(graphdef: Any, params: Any, rest: Any, xs: Any, arrays: Any, static: Any, ours: bool,
               call: Any = None) -> Any:
    from flax import nnx

    module = nnx.merge(graphdef, params, rest)
    result = module(*xs, **arrays, **dict(static)) if call is None else call(module, *xs, **arrays, **dict(static))
    outputs = _split_outputs(result, ours, ours)
    return next(iter(outputs.values())), outputs


@functools.partial(jax_jit_lazy, static_argnames=("graphdef", "static", "ours", "float_positions", "call"))
def _flax_run(graphdef: Any, params: Any, rest: Any, xs: Any, arrays: Any, cot: Any, *,
              static: Any, ours: bool, float_positions: tuple[int, ...] | None, call: Any = None) -> Any:
    """Outputs and (optionally) gradients of ``sum(primary * cot)``, jitted once per
    module structure, shapes and options and reused across cases that share them."""
    import jax
    import jax.numpy as jnp

    if float_positions is None:
        return _flax_call(graphdef, params, rest, xs, arrays, static, ours, call)[1], None

    def loss(params: Any, float_xs: Any) -> Any:
        call_xs = list(xs)
        for pos, fx in zip(float_positions, float_xs, strict=True):
            call_xs[pos] = fx
        primary, outputs = _flax_call(graphdef, params, rest, call_xs, arrays, static, ours, call)
        if primary.shape != cot.shape:
            raise ValueError(f"the cotangent has shape {tuple(cot.shape)} but flax's first output has shape "
                             f"{tuple(primary.shape)} (check_parity takes it from torch's first output)")
        return jnp.sum(primary.astype(jnp.float32) * cot), outputs

    float_xs = [xs[i] for i in float_positions]
    (_, outputs), gradients = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, float_xs)
    return outputs, gradients


def _numpy_source(x: Any) -> np.ndarray:
    """An input as a NumPy array that both frameworks accept, at its full precision
    (bfloat16, which NumPy lacks, goes through float32 exactly)."""
    array = as_numpy(x)
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def _is_float(x: Any) -> bool:
    return np.issubdtype(as_numpy(x).dtype, np.floating) or as_numpy(x).dtype.name == "bfloat16"


def _cotangent(cotangent: np.ndarray | None, shape: Any, rows: np.ndarray | None = None) -> np.ndarray:
    """The cotangent of the first output: the given one, or a fixed varied one; zero at
    the query rows that ``rows`` leaves out, so that they add nothing to any gradient."""
    if cotangent is not None:
        cot = np.asarray(cotangent, dtype=np.float32)
    else:
        # Fixed and varied (not all ones), so a wrong permutation of outputs cannot cancel
        # under the sum; positive, so a bias gradient (a plain sum of it) does not cancel.
        cot = np.random.default_rng(1234).uniform(0.5, 1.5, tuple(shape)).astype(np.float32)
    if rows is None:
        return cot
    keep = _row_mask("the first output", tuple(shape), rows, output=True)
    return np.where(keep, cot, np.float32(0.0)).astype(np.float32)


# --------------------------------------------------------------------------- rows

def _check_rows(rows: Any, inputs: Sequence[np.ndarray]) -> np.ndarray | None:
    """``rows=`` as a bool NumPy array (batch, seq) matching the first input's two
    leading axes; None stays None.  Raises ValueError otherwise, or if no row is kept."""
    if rows is None:
        return None
    array = as_numpy(rows)
    expected = tuple(inputs[0].shape[:2]) if inputs and np.ndim(inputs[0]) >= 2 else None
    if array.dtype != np.bool_ or array.ndim != 2 or (expected is not None and array.shape != expected):
        want = f"(batch, seq) = {expected}" if expected is not None else "(batch, seq)"
        raise ValueError(
            f"rows= is a bool array {want}, the first input's two leading axes, of the query rows to "
            f"compare (True = compare); got {array.dtype} of shape {array.shape}"
        )
    if not array.any():
        raise ValueError("rows= leaves out every query row: nothing would be compared")
    return array


def _row_axes(shape: tuple[int, ...], rows_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The axes of a tensor that are (batch, query): axes 0 and 2 of a rank-4 tensor
    shaped like attention weights, (batch, heads, seq, keys); otherwise the two leading
    axes when they are (batch, seq); None when the tensor has no such axes."""
    b, t = rows_shape
    if len(shape) == 4 and (shape[0], shape[2]) == (b, t):
        return (0, 2)
    if len(shape) >= 2 and (shape[0], shape[1]) == (b, t):
        return (0, 1)
    return None


def _row_mask(name: str, shape: tuple[int, ...], rows: np.ndarray, *, output: bool) -> np.ndarray | None:
    """``rows`` (batch, seq) as a bool array broadcastable to a tensor of ``shape``, True
    where it is compared.  An output without (batch, seq) axes raises ValueError (it
    cannot be compared at the rows); any other tensor without them is compared whole
    (None)."""
    axes = _row_axes(shape, rows.shape)
    if axes is None:
        if output:
            raise ValueError(
                f"rows= {rows.shape} cannot be applied to {name} of shape {shape}: an output is "
                "compared at the rows when it is shaped (batch, seq, ...) or, like attention "
                "weights, (batch, heads, seq, keys); pass torch_call / flax_call that return such outputs"
            )
        return None
    index = [None] * len(shape)
    index[axes[0]], index[axes[1]] = slice(None), slice(None)
    return rows[tuple(index)]


def _tolerance_of(name: str, dtype: str, rtol: float | None, atol: float | None) -> Tolerance:
    default = (GRAD_PARITY if name.startswith("grad") else PARITY)[dtype]
    return default._replace(rtol=default.rtol if rtol is None else rtol, atol=default.atol if atol is None else atol)


def _row_ranges(rows: np.ndarray) -> str:
    """The True entries of a (batch, seq) array as runs: ``example 1: rows 0-36``."""
    parts = []
    for b, row in enumerate(rows):
        edges = np.flatnonzero(np.diff(np.concatenate(([0], row.astype(np.int8), [0]))))
        runs = [f"{s}" if e - s == 1 else f"{s}-{e - 1}" for s, e in zip(edges[::2], edges[1::2], strict=True)]
        if runs:
            parts.append(f"example {b}: rows {', '.join(runs[:4])}{', ...' if len(runs) > 4 else ''}")
    return "; ".join(parts)


def _rows_hint(report: ParityReport, inputs: Sequence[Any], mask: np.ndarray | None, dtype: str,
               rtol: float | None, atol: float | None) -> str:
    """Where the failing outputs of a comparison without ``rows=`` differ, when that is in
    some query rows only (of outputs shaped (batch, seq, ...) as the first input): a row
    that sees no key (left padding) is zeros in ours and something else elsewhere (an
    average of the values in Hugging Face's layers), by convention.  Said for certain
    where ``mask`` leaves those rows without a key; without a mask, only where the rows
    look like padding (a run at the start or the end of each example, at most half the
    rows); "" when nothing points there."""
    first = next((np.shape(x) for x in inputs if np.ndim(x) >= 2), None)
    if first is None:
        return ""
    batch, seq = first[:2]
    failing = np.zeros((batch, seq), dtype=bool)
    for finding in report.failures:
        name = finding.name
        if name.startswith("grad "):
            continue  # the outputs' rows say it: a differing row moves every gradient it reaches
        a, b = (np.asarray(r[name], dtype=np.float64) for r in (report.torch_results, report.flax_results))
        axes = _row_axes(a.shape, (batch, seq))
        if axes is None:
            return ""  # a failing tensor without rows: not a matter of rows
        tol = _tolerance_of(name, dtype, rtol, atol)
        scale = np.nanmax(np.abs(b)) if tol.normwise else np.abs(b)
        bad = ~(np.abs(a - b) <= tol.atol + tol.rtol * scale)  # NaN counts as bad
        other = tuple(i for i in range(a.ndim) if i not in axes)
        failing |= np.moveaxis(bad, axes, (0, 1)).any(axis=tuple(range(2, a.ndim))) if other else bad
    if not failing.any() or failing.all():
        return ""

    def padding_like(row: np.ndarray) -> bool:  # a run at the start (left padding) or at the end (right)
        n = int(row.sum())
        return not row[n:].any() or not row[: row.size - n].any()

    known = mask is not None and np.ndim(mask) == 4
    if not known and (2 * failing.sum() > failing.size or not all(padding_like(row) for row in failing)):
        return ""  # scattered rows: nothing points to padding
    where = (f"the outputs differ in {int(failing.sum())} of {failing.size} query rows ({_row_ranges(failing)}) "
             "and nowhere else")
    if mask is not None and np.ndim(mask) == 4:
        sees = np.broadcast_to(np.asarray(mask, dtype=bool), (batch, np.shape(mask)[1], seq, np.shape(mask)[3]))
        keyless = ~sees.any(axis=-1).any(axis=1)
        if (failing & ~keyless).any():
            return ""  # rows that see keys differ: not a matter of padding
        return (f"{where}, every one a row the mask leaves without a key: such a row is zeros in ours and "
                "something else by another library's convention; pass rows= (bool (batch, seq), True = "
                "compare) to leave them out")
    return (f"{where}: if they are rows that see no key (left padding), such a row is zeros in ours and "
            "something else by another library's convention (an average of the values in Hugging Face's "
            "layers); pass rows= (bool (batch, seq), True = compare) to leave them out")


def _compare_results(t: Mapping[str, np.ndarray], f: Mapping[str, np.ndarray], dtype: str,
                     rtol: float | None, atol: float | None, rows: np.ndarray | None) -> list[Finding]:
    """Every tensor both runs gave, compared at the dtype's tolerance (``rtol`` / ``atol``
    overriding it); with ``rows``, outputs and input gradients at those query rows only."""
    findings = []
    left_out = 0 if rows is None else int(rows.size - rows.sum())
    for name in t:
        if name not in f:
            raise ValueError(f"torch returned {name} but flax did not (flax gave {sorted(f)})")
        tol = _tolerance_of(name, dtype, rtol, atol)
        where = None
        if rows is not None and (not name.startswith("grad ") or name.startswith("grad input[")):
            where = _row_mask(name, np.shape(t[name]), rows, output=not name.startswith("grad "))
        findings.append(compare(name, t[name], f[name], tol, where=where,
                                rows_left_out=left_out if where is not None else 0))
    return findings


# --------------------------------------------------------------------------- parity

def _as_rules(param_map: Any) -> list[Rule]:
    """``param_map`` as ``Rule``s: a ``Rule``, a list of them, or the mapping form
    {torch name: flax path or (flax path, transpose)}."""
    if isinstance(param_map, Rule):
        return [param_map]
    if isinstance(param_map, Mapping):
        return rules_from_mapping(param_map)
    if isinstance(param_map, (list, tuple)):
        return check_specs(param_map)
    raise TypeError(
        "param_map is a mapping {torch name: flax path or (flax path, transpose)}, a Rule or a list of "
        f"Rules (attention_spec.interop.specs); got {type(param_map).__name__}"
    )


def flax_param_shapes(flax_module: Any) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """{path: shape} of every ``nnx.Param`` of a Flax NNX module."""
    from flax import nnx

    return {tuple(p): tuple(v[...].shape) for p, v in nnx.to_flat_state(nnx.state(flax_module, nnx.Param))}


def _resolve_param_map(torch_module: Any, flax_module: Any, param_map: Any) -> list[Rule]:
    """The conversion rules between the two modules, checked against both (see
    ``resolve_rules``)."""
    return resolve_rules(torch_module, flax_param_shapes(flax_module), param_map)


def _declared_rules(torch_module: Any, flax_shapes: Mapping[tuple[Any, ...], Any]) -> list[Rule]:
    """This library's declared rules for the module, under the one prefix that a Linen
    model holding it (``nnx.bridge.to_linen``) puts before every path, if there is one."""
    rules = module_rules(torch_module)
    paths = [p for r in rules for p in r.flax_paths]
    if paths and not all(p in flax_shapes for p in paths):
        prefixes = {fp[: len(fp) - len(p)] for fp in flax_shapes for p in paths
                    if len(fp) >= len(p) and fp[len(fp) - len(p):] == p}
        found = [q for q in prefixes if all((*q, *p) in flax_shapes for p in paths)]
        if len(found) == 1:
            rules = [r.under(found[0]) for r in rules]
    return rules


def resolve_rules(
    torch_module: Any, flax_shapes: Mapping[tuple[Any, ...], tuple[int, ...]], param_map: Any, *,
    trainable_only: bool = False,
) -> list[Rule]:
    """The conversion rules between a PyTorch module's parameters (its trainable ones with
    ``trainable_only``) and Flax parameters of the given shapes: every parameter of each
    side in exactly one rule, every shape carried through the rule's steps to the other
    side's shape.  ``param_map`` None means this library's declared rules; a Linen model
    that holds the module (``nnx.bridge.to_linen``) keeps them under one prefix, which is
    found.  Raises one ValueError listing every problem."""
    torch_params = {n: p for n, p in torch_module.named_parameters() if p.requires_grad or not trainable_only}
    kind = "trainable parameter" if trainable_only else "parameter"
    if param_map is None:
        if not _is_ours(torch_module) and not is_delta_layer(torch_module):
            raise ValueError(
                f"{type(torch_module).__name__} is not one of this library's modules: "
                "pass param_map={torch name: flax path or (flax path, transpose)} or a list of "
                "attention_spec.interop.specs.Rule"
            )
        rules = _declared_rules(torch_module, flax_shapes)
    else:
        rules = _as_rules(param_map)
    names = [n for r in rules for n in r.torch_names]
    mapped = [p for r in rules for p in r.flax_paths]
    problems = [f"  PyTorch has no {kind} {n!r}" for n in names if n not in torch_params]
    problems += [f"  Flax has no parameter {path_text(p)!r}" for p in mapped if p not in flax_shapes]
    problems += [f"  PyTorch parameter {n!r} is not in the map" for n in torch_params if n not in set(names)]
    problems += [f"  Flax parameter {path_text(p)!r} is not in the map" for p in flax_shapes if p not in set(mapped)]
    for rule in rules:
        if not all(n in torch_params for n in rule.torch_names) or not all(p in flax_shapes for p in rule.flax_paths):
            continue
        t_shapes = {n: tuple(torch_params[n].shape) for n in rule.torch_names}
        f_shapes = {p: tuple(flax_shapes[p]) for p in rule.flax_paths}
        try:
            got = spec_shapes(t_shapes, [rule], "to_flax")
        except ValueError as err:
            problems += err.args[0].splitlines()[1:]
            continue
        if got != f_shapes:
            source = ", ".join(f"{n!r} {s}" for n, s in t_shapes.items())
            target = ", ".join(f"{path_text(p)!r} {s}" for p, s in f_shapes.items())
            gives = ", ".join(str(got[p]) for p in rule.flax_paths)
            steps = f" (through {', '.join(map(repr, rule.steps))}, which gives {gives})" if rule.steps else ""
            problems.append(f"  {source} does not match {target}{steps}")
    if problems:
        raise ValueError("the parameter map (param_map) does not match the two modules:\n" + "\n".join(problems))
    return rules


def copy_params(torch_module: Any, flax_module: Any, param_map: Any = None, *, to: str = "flax") -> None:
    """Copies every parameter from one module to the other through ``param_map`` (as in
    ``check_parity``; None for this library's modules), exactly.  ``to="flax"``: PyTorch
    -> Flax; ``to="torch"``: Flax -> PyTorch.  Everything is checked (names, shapes through
    every step) before anything is written; raises ValueError otherwise."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    if to not in ("flax", "torch"):
        raise ValueError(f"to must be 'flax' or 'torch'; got {to!r}")
    rules = _resolve_param_map(torch_module, flax_module, param_map)
    torch_params = dict(torch_module.named_parameters())
    flax_params = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(flax_module, nnx.Param))}
    if to == "flax":
        converted = apply_specs({n: as_numpy(p) for n, p in torch_params.items()}, rules, "to_flax")
        for path, array in converted.items():
            node = flax_module
            for key in path[:-1]:
                node = node[key] if isinstance(key, int) else getattr(node, key)
            variable = getattr(node, path[-1]) if isinstance(path[-1], str) else node[path[-1]]
            variable[...] = jnp.asarray(_numpy_source(array)).astype(flax_params[path][...].dtype)
    else:
        arrays = apply_specs({p: as_numpy(v[...]) for p, v in flax_params.items()}, rules, "to_torch")
        with torch.no_grad():
            for name, array in arrays.items():
                param = torch_params[name]
                param.copy_(torch.from_numpy(np.array(_numpy_source(array))).to(param.dtype))


def _check_pair(torch_module: Any, flax_module: Any) -> None:
    t_name, f_name = type(torch_module).__name__, type(flax_module).__name__
    # Only a pair of this library's modules has a declared correspondence to check; any
    # other pair (one side a user's or a native module) is matched by its param_map.
    if _is_ours(torch_module) and _is_ours(flax_module):
        if t_name != f_name:
            raise ValueError(f"the modules are different variants: torch {t_name} vs flax {f_name}")
        diff = {k: (torch_module.config.get(k), flax_module.config.get(k))
                for k in set(torch_module.config) | set(flax_module.config)
                if torch_module.config.get(k) != flax_module.config.get(k)}
        if diff:
            text = ", ".join(f"{k}: torch {a!r} vs flax {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(f"the {t_name} modules have different configurations: {text}")
        t_dtype, f_dtype = module_dtype(torch_module), module_dtype(flax_module)
        if t_dtype != f_dtype:
            raise ValueError(f"the modules have different parameter dtypes: torch {t_dtype} vs flax {f_dtype}")


def check_parity(
    torch_module: Any,
    flax_module: Any,
    *inputs: Any,
    mask: Any = None,
    grads: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    param_map: Any = None,
    training: bool = False,
    dropout_mask: Any = None,
    cotangent: Any = None,
    implementation: str | None = None,
    weights: bool = False,
    torch_call: Any = None,
    flax_call: Any = None,
    rows: Any = None,
) -> ParityReport:
    """Runs both modules on the same inputs in the same mode and compares everything.

    Args:
      inputs: arrays (NumPy, torch or JAX); float inputs are cast to each module's dtype.
      mask: bool, True = may attend (our modules) -- passed as ``mask=``.
      grads: also compare gradients of ``sum(out * cotangent)`` with respect to every
        float input and every parameter (matched by the declared map or ``param_map``).
      rtol, atol: override the dtype's tolerance (``tolerances.PARITY``).
      param_map: for any other pair: {torch parameter name: flax path} where a path is
        a tuple or "a/b/c", or (path, transpose) for a Linear-style weight; or a list of
        ``attention_spec.interop.specs.Rule`` (packed q/k/v, reshapes, any transposition).  Every
        parameter of both modules must be in it; each Flax gradient is carried through
        the rules back to the PyTorch names and layouts (a packed weight's gradient is
        the packing of the three kernels' gradients) and compared there.
      torch_call, flax_call: ``(module, *inputs, **kwargs) -> output`` to call a module
        whose signature or output is not ours, e.g. Hugging Face's
        ``lambda m, x, mask=None: m(x, attention_mask=additive(mask))[0]``.  ``inputs``
        are that framework's arrays (float inputs in the module's dtype, tracked for
        gradients); ``kwargs`` are the keywords the harness would pass the module itself:
        ``mask=`` (bool, True = may attend) when a mask is given, ``dropout_mask=``,
        and for this library's modules ``deterministic=``, ``implementation=``,
        ``return_weights=``.  The output is an array or a tuple/list of arrays, all
        compared (``output[i]``); gradients are of ``sum(first * cotangent)``.
        ``flax_call`` runs inside ``jax.jit``: it must be traceable.  Default: the module
        called as ``module(*inputs, **kwargs)``.
      training: run both in training mode; dropout then needs ``dropout_mask`` (bool,
        True = keep), which both frameworks apply identically.
      implementation: the path both modules compute on for this call ("reference",
        "fused", "blockwise", "auto"); None = each module's own configuration.  The
        modules are not changed.
      weights: also compare the attention weights (``return_weights=True``).  Off by
        default because only the reference path materialises them: asking for them would
        move a module off the path under test.  With an explicit "fused" or "blockwise"
        the modules raise ValueError, naming the option.
      rows: bool ``(batch, seq)``, True = compare this query row; None (the default)
        compares every row.  For rows that differ by convention and mean nothing, such as
        a padded query that may attend to no key (zeros here, an average of the values in
        Hugging Face's layers): outputs are compared at the kept rows only (an output
        ``(batch, seq, ...)`` on its two leading axes; a rank-4 one shaped like attention
        weights, ``(batch, heads, seq, keys)``, on axes 0 and 2; any other output shape
        raises ValueError), the cotangent is zero at the left-out rows so that they add
        nothing to any gradient, and input gradients shaped ``(batch, seq, ...)`` are
        compared at the kept rows (other input gradients and parameter gradients whole).
        ``(batch, seq)`` must be the first input's two leading axes.  The report and its
        findings say how many rows were left out.

    Both runs happen in ``full_precision()`` (JAX matmul precision "highest", PyTorch
    TF32 off); the global flags are as they were afterwards.

    Returns a ``ParityReport`` (raises nothing on mismatch; see ``assert_parity``).
    Raises ValueError for modules that cannot be compared (different variants, configs,
    dtypes, a param_map naming parameters that do not exist), for ``implementation`` or
    ``weights=True`` with modules that are not this library's, and whatever the modules
    raise for their inputs.
    """
    _check_pair(torch_module, flax_module)
    foreign = [m for m in (torch_module, flax_module) if not _is_ours(m)]
    if (implementation is not None or weights) and foreign:
        raise ValueError(
            "implementation= and weights= apply to this library's modules only; "
            f"{type(foreign[0]).__name__} returns what it returns, and every output is compared"
        )
    for what, call in (("torch_call", torch_call), ("flax_call", flax_call)):
        if call is not None and not callable(call):
            raise TypeError(f"{what} must be a callable (module, *inputs, **kwargs) -> output; got {call!r}")
    rules = _resolve_param_map(torch_module, flax_module, param_map)
    flax_names = {f"flax:{path_text(p)}": p for r in rules for p in r.flax_paths}
    if training and dropout_mask is None and _is_ours(torch_module) and torch_module.config.get("dropout", 0.0) > 0:
        raise ValueError(
            "training mode with dropout > 0 needs dropout_mask= (bool, True = keep): "
            "the two frameworks cannot share a random stream"
        )
    np_inputs = [as_numpy(x) for x in inputs]
    np_rows = _check_rows(rows, np_inputs)
    np_mask = None if mask is None else as_numpy(mask)
    np_keep = None if dropout_mask is None else as_numpy(dropout_mask)
    common = {"mask": np_mask, "dropout_mask": np_keep, "training": training, "grads": grads,
              "cotangent": None if cotangent is None else as_numpy(cotangent),
              "implementation": implementation, "weights": weights, "rows": np_rows}
    with full_precision():
        t = run_torch(torch_module, np_inputs, param_names=[n for r in rules for n in r.torch_names],
                      call=torch_call, **common)
        if grads and cotangent is None:
            # the cotangent torch took, from its first output's shape: Flax then needs no
            # trace of its own forward to learn the shape (a tenth of a case's time)
            common["cotangent"] = _cotangent(None, next(iter(t.values())).shape, np_rows)
        f = run_flax(flax_module, np_inputs, param_paths=flax_names, call=flax_call, **common)
    if grads:
        # the Flax gradients, carried through the same rules back to PyTorch's names and
        # layouts: every step only moves elements, so it moves a gradient as it moves its weight
        flax_grads = {path: f.pop(f"grad {name}") for name, path in flax_names.items()}
        f.update({f"grad {n}": g for n, g in apply_specs(flax_grads, rules, "to_torch").items()})
    dtype = module_dtype(torch_module, np_inputs)
    report = ParityReport(torch_results=t, flax_results=f)
    if np_rows is not None:
        report.rows_left_out, report.rows_total = int(np_rows.size - np_rows.sum()), int(np_rows.size)
    report.findings.extend(_compare_results(t, f, dtype, rtol, atol, np_rows))
    if np_rows is None and not report.ok:
        report.hint = _rows_hint(report, np_inputs, np_mask, dtype, rtol, atol)
    return report


def assert_parity(
    torch_module: Any,
    flax_module: Any,
    *inputs: Any,
    mask: Any = None,
    grads: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    param_map: Any = None,
    training: bool = False,
    dropout_mask: Any = None,
    cotangent: Any = None,
    implementation: str | None = None,
    weights: bool = False,
    torch_call: Any = None,
    flax_call: Any = None,
    rows: Any = None,
) -> ParityReport:
    """As ``check_parity``, but raises ``ParityError`` (an AssertionError) on any
    mismatch, naming the worst element: tensor, index, both values, errors, tolerance."""
    report = check_parity(
        torch_module, flax_module, *inputs, mask=mask, grads=grads, rtol=rtol, atol=atol,
        param_map=param_map, training=training, dropout_mask=dropout_mask, cotangent=cotangent,
        implementation=implementation, weights=weights, torch_call=torch_call, flax_call=flax_call, rows=rows,
    )
    if not report.ok:
        raise ParityError(report)
    return report


