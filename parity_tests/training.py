"""Training-step parity: the same batches, loss and optimiser in both frameworks, the
parameters compared after every step.

``check_training_parity(torch_module, flax_module, batches, ...)`` trains a copy of each
module, PyTorch with ``torch.optim`` and Flax with the matching ``optax`` transformation,
and compares every parameter through the declared weight map (or ``param_map=``) after
every step; ``assert_training_parity`` raises ``TrainingParityError`` (an
``AssertionError``) naming the first step that drifts past the tolerance, the parameter,
its worst element and both values.  Output parity says that the port computes the same
function; this says that training it gives the same model.

How the optimisers are matched (PyTorch's update, written out; optax's is the same
arithmetic, with the same defaults made explicit on both sides):

- ``"sgd"``: ``torch.optim.SGD(lr, momentum, weight_decay, nesterov)`` against
  ``optax.chain(optax.add_decayed_weights(wd), optax.sgd(lr, momentum, nesterov))``.
  PyTorch's weight decay is L2 added to the gradient before the momentum buffer, as
  ``add_decayed_weights`` placed before ``sgd``; PyTorch's first buffer is the gradient
  itself and optax's trace starts at zero, so ``g + m * 0`` is the same first step.
  Dampening is 0 (PyTorch's default; optax has none).
- ``"adam"``: ``torch.optim.Adam(lr, betas, eps, weight_decay)`` against
  ``optax.chain(optax.add_decayed_weights(wd), optax.adam(lr, b1, b2, eps, eps_root=0))``.
  Both bias-correct both moments and add ``eps`` *outside* the square root,
  ``m̂ / (sqrt(v̂) + eps)``: optax's ``eps`` is that epsilon, its ``eps_root`` (inside the
  root) must be 0.  PyTorch Adam's ``weight_decay`` is L2 on the gradient, so it goes
  before the moments.
- ``"adamw"``: ``torch.optim.AdamW(lr, betas, eps, weight_decay)`` against
  ``optax.adamw(lr, b1, b2, eps, eps_root=0, weight_decay=wd)``.  Decoupled decay in
  both, and scaled by the learning rate in both: PyTorch multiplies the parameter by
  ``1 - lr * wd``, optax adds ``wd * p`` to the Adam direction before scaling by ``-lr``.
  The defaults differ (PyTorch 1e-2, optax 1e-4): here ``weight_decay`` defaults to 0.0
  for every optimiser and is passed to both explicitly.
- Or your own pair: ``optimizer=(torch_factory, optax_transformation)`` where
  ``torch_factory(params) -> torch.optim.Optimizer``; the run then proves that the two
  agree (or finds the step where they do not).

Decisions:

- No gradient, no step.  A PyTorch parameter that a step gives no gradient at all (None:
  computed under ``no_grad``, as ``transformers``' DSA indexer is) is skipped by its
  optimiser, weight decay included; JAX gives it a zero gradient, which optax's AdamW
  would still decay, so the Flax side's update of that parameter is dropped that step.
- Copies.  Neither module passed in is changed: PyTorch trains a ``copy.deepcopy``, Flax
  works on its split parameter state functionally.  The trained pair is returned in the
  report (``report.torch_module``, ``report.flax_module``; for a Linen model
  ``report.flax_variables``).
- Eval mode by default (``training=False``): dropout off, so the trajectory is that of a
  deterministic function.  ``training=True`` with one of this library's modules whose
  ``dropout > 0`` needs ``dropout_masks=`` (one bool keep-mask per step, True = keep),
  which both frameworks apply identically; without them it raises ValueError (the
  frameworks cannot share a random stream).  For a pair of your own modules in training
  mode, randomness is yours to rule out.
- The loss: ``"mse"`` (the mean of ``(output - target) ** 2`` over every element) or a
  pair ``(torch_loss, flax_loss)``, each ``loss(output, target) -> scalar``.  A batch is
  an input array or ``(input, target)``; a batch without a target trains ``"mse"``
  towards zeros (a callable pair receives ``target=None``).  A module returning a tuple
  is trained on its first element.
- A module whose call is not ``module(x, mask=..., ...)`` (a Hugging Face layer with its
  mask and positions) is trained through ``torch_call`` / ``flax_call``,
  ``(module, x, **kwargs) -> output``; ``rows=`` (bool ``(batch, seq)``) builds the loss
  from those query rows only, so that padded rows train neither model.
- A Linen model (for example one that holds our NNX module through
  ``flax.nnx.bridge.to_linen``) is accepted as the Flax side with its variables,
  ``flax_variables=model.init(...)``: only the ``"params"`` collection is trained, and
  paths in ``param_map`` are paths inside it.
- The Flax step (forward, gradient, optax update) is one ``jax.jit`` over the parameter
  pytree; only parameters are trained and carried from step to step (Flax state that is
  not a parameter, such as batch statistics or RNG counters, stays as it was given, while
  PyTorch updates its buffers as usual: a module with such state is not for this check).  Both frameworks run in ``full_precision()`` for the whole run; no global flag
  is changed.

A caveat the tests met: Adam divides each gradient by its own running RMS, so a gradient
that is zero in exact arithmetic (the key projection's bias, which adds the same number
to every score of a query) is rounding noise of 1e-9 that Adam turns into steps of size
``lr`` with an arbitrary sign, different in each framework.  Such a parameter diverges
by about ``lr`` per step though both ports are right; train without it (``qkv_bias=False``)
or compare with SGD.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_spec.interop.conversion import as_numpy
from attention_spec.interop.specs import apply_specs
from parity_tests.harness import (
    Finding,
    _check_pair,
    _check_rows,
    _is_ours,
    compare,
    full_precision,
    module_dtype,
    resolve_rules,
)
from parity_tests.tolerances import TRAINING_PARITY, Tolerance

__all__ = [
    "StepRecord",
    "TrainingParityError",
    "TrainingReport",
    "assert_training_parity",
    "check_training_parity",
    "plot_trajectory",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
LOSSES = ("mse",)


# --------------------------------------------------------------------------- report

@dataclass
class StepRecord:
    """One training step: both losses (before the update) and every parameter compared
    after it; ``max_abs`` / ``max_rel`` are the largest over all parameters (``max_rel``
    relative to each parameter's largest magnitude)."""

    step: int  # 1-based
    torch_loss: float
    flax_loss: float
    findings: list[Finding]  # "loss" first, then each parameter under its PyTorch name

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def parameters(self) -> list[Finding]:
        """The parameter findings (the loss left out)."""
        return [f for f in self.findings if f.name != "loss"]

    @property
    def max_abs(self) -> float:
        return max((f.max_abs for f in self.parameters), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((f.max_rel for f in self.parameters), default=0.0)

    @property
    def worst(self) -> Finding | None:
        failures = [f for f in self.findings if not f.ok]
        return max(failures or self.findings, key=lambda f: f.tolerance_used, default=None)


@dataclass
class TrainingReport:
    """The trajectory of a training-parity run, and the trained copies."""

    optimizer: str
    steps: list[StepRecord] = field(default_factory=list)
    torch_module: Any = field(default=None, repr=False)
    flax_module: Any = field(default=None, repr=False)
    flax_variables: Any = field(default=None, repr=False)  # Linen models only

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    @property
    def first_failure(self) -> StepRecord | None:
        return next((s for s in self.steps if not s.ok), None)

    @property
    def max_abs(self) -> list[float]:
        """The largest absolute parameter divergence after each step."""
        return [s.max_abs for s in self.steps]

    @property
    def max_rel(self) -> list[float]:
        """The largest divergence relative to the parameter's scale after each step."""
        return [s.max_rel for s in self.steps]

    def table(self) -> str:
        lines = [f"{'step':>4}  {'torch loss':>13}  {'flax loss':>13}  {'max abs':>9}  {'max rel':>9}  worst"]
        for s in self.steps:
            worst = s.worst
            lines.append(
                f"{s.step:>4}  {s.torch_loss:>13.7g}  {s.flax_loss:>13.7g}  {s.max_abs:>9.2e}  "
                f"{s.max_rel:>9.2e}  {worst.name if worst else '-'}{'' if s.ok else '  FAIL'}"
            )
        return "\n".join(lines)

    def message(self) -> str:
        n = len(self.steps)
        bad = self.first_failure
        if bad is None:
            worst = max(self.max_rel, default=0.0)
            return (f"training parity holds for {n} {self.optimizer} steps "
                    f"(largest parameter divergence {max(self.max_abs, default=0.0):.3g} abs, "
                    f"{worst:.3g} relative to scale)")
        failures = sorted((f for f in bad.findings if not f.ok), key=lambda f: -f.tolerance_used)
        lines = [f"training parity fails at step {bad.step} of {n} ({self.optimizer}): "
                 f"{len(failures)} of {len(bad.findings)} tensors drift past the tolerance; worst:"]
        lines += ["  " + f.describe() for f in failures]
        lines += ["trajectory:", self.table()]
        return "\n".join(lines)


class TrainingParityError(AssertionError):
    def __init__(self, report: TrainingReport) -> None:
        super().__init__(report.message())
        self.report = report


# --------------------------------------------------------------------------- helpers

def _is_linen(module: Any) -> bool:
    try:
        from flax import linen
    except ImportError:  # pragma: no cover - flax ships linen
        return False
    return isinstance(module, linen.Module)


def _split_batch(batch: Any) -> tuple[np.ndarray, np.ndarray | None]:
    if isinstance(batch, (tuple, list)):
        if len(batch) != 2:
            raise ValueError(f"a batch is an input array or (input, target); got a sequence of {len(batch)}")
        return as_numpy(batch[0]), None if batch[1] is None else as_numpy(batch[1])
    return as_numpy(batch), None


def _source(array: np.ndarray) -> np.ndarray:
    """An array both frameworks take at its full precision (bfloat16, which NumPy lacks,
    goes through float32 exactly); cast to the modules' dtype by each framework."""
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def _first(output: Any) -> Any:
    return output[0] if isinstance(output, (tuple, list)) else output


def _kept_rows(output: Any, target: Any, rows: Any) -> tuple[Any, Any]:
    """The output and target at the query rows that ``rows`` (batch, seq) keeps, as
    ``(kept rows, ...)`` arrays (boolean indexing, which both frameworks share); both
    as they are without ``rows``."""
    if rows is None:
        return output, target
    if tuple(output.shape[:2]) != tuple(rows.shape):
        raise ValueError(
            f"rows= {tuple(rows.shape)} cannot be applied to an output of shape {tuple(output.shape)}: "
            "the output must be shaped (batch, seq, ...)"
        )
    return output[rows], None if target is None else target[rows]


def _check_calls(torch_call: Any, flax_call: Any) -> None:
    for what, call in (("torch_call", torch_call), ("flax_call", flax_call)):
        if call is not None and not callable(call):
            raise TypeError(f"{what} must be a callable (module, x, **kwargs) -> output; got {call!r}")


def _check_training_rows(rows: Any, batches: Sequence[Any]) -> np.ndarray | None:
    """``rows=`` as a bool array (batch, seq) that matches every batch's input; None
    stays None."""
    if rows is None:
        return None
    shapes = {tuple(_split_batch(b)[0].shape[:2]) for b in batches}
    first = _split_batch(batches[0])[0]
    array = _check_rows(rows, [first])
    if len(shapes) > 1:
        raise ValueError(f"rows= applies to every batch, but the batches have (batch, seq) {sorted(shapes)}")
    return array


def _flat_params(tree: Any) -> dict[tuple[Any, ...], Any]:
    """{path: array} of a Linen params pytree (nested dicts)."""
    out: dict[tuple[Any, ...], Any] = {}

    def walk(node: Any, prefix: tuple[Any, ...]) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*prefix, k))
        else:
            out[prefix] = node

    walk(tree, ())
    return out


def _optimizers(
    optimizer: Any, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
    momentum: float, nesterov: bool,
) -> tuple[str, Callable[[Any], Any], Any]:
    """(name, torch factory params -> Optimizer, optax transformation), matched."""
    import optax
    import torch

    if isinstance(optimizer, tuple):
        if len(optimizer) != 2 or not callable(optimizer[0]):
            raise TypeError("optimizer= is 'sgd', 'adam', 'adamw' or a pair (torch_factory, optax_transformation)")
        return "custom", optimizer[0], optimizer[1]
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(map(repr, OPTIMIZERS))} or a pair; got {optimizer!r}")
    if optimizer != "sgd" and (momentum or nesterov):
        raise ValueError(f"momentum= and nesterov= are SGD's; {optimizer} has betas=")
    if nesterov and not momentum:
        raise ValueError("nesterov=True needs momentum > 0 (as torch.optim.SGD requires)")
    b1, b2 = betas
    decay = [optax.add_decayed_weights(weight_decay)] if weight_decay else []
    if optimizer == "sgd":
        def torch_sgd(params: Any) -> Any:
            return torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=0.0,
                                   weight_decay=weight_decay, nesterov=nesterov)
        return "sgd", torch_sgd, optax.chain(*decay, optax.sgd(lr, momentum=momentum or None, nesterov=nesterov))
    if optimizer == "adam":
        def torch_adam(params: Any) -> Any:
            return torch.optim.Adam(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay)
        return "adam", torch_adam, optax.chain(*decay, optax.adam(lr, b1=b1, b2=b2, eps=eps, eps_root=0.0))

    def torch_adamw(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay)
    return "adamw", torch_adamw, optax.adamw(lr, b1=b1, b2=b2, eps=eps, eps_root=0.0, weight_decay=weight_decay)


def _losses(loss: Any) -> tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]]:
    if isinstance(loss, tuple):
        if len(loss) != 2 or not all(callable(f) for f in loss):
            raise TypeError("loss= is 'mse' or a pair of callables (torch_loss, flax_loss)")
        return loss
    if loss != "mse":
        raise ValueError(f"loss must be one of {', '.join(map(repr, LOSSES))} or a pair of callables; got {loss!r}")

    def torch_mse(out: Any, target: Any) -> Any:
        return (out if target is None else out - target).pow(2).mean()

    def flax_mse(out: Any, target: Any) -> Any:
        import jax.numpy as jnp

        return jnp.mean(jnp.square(out if target is None else out - target))

    return torch_mse, flax_mse


# --------------------------------------------------------------------------- checks

def _check_steps(batches: Sequence[Any], steps: int | None) -> int:
    """The number of steps to run: ``steps``, or one per batch."""
    if not batches:
        raise ValueError("batches is empty: give at least one input array or (input, target)")
    n_steps = len(batches) if steps is None else int(steps)
    if n_steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    return n_steps


def _check_modules(
    torch_module: Any, flax_module: Any, *, linen: bool, flax_variables: Any, training: bool,
    dropout_masks: Sequence[Any] | None, n_steps: int, implementation: str | None,
) -> bool:
    """Refuses a pair that cannot be trained side by side: a Linen module without its
    variables (or variables for an NNX module), dropout in training mode without masks (or
    too few), ``implementation=`` for modules that are not this library's, and, as
    ``check_parity`` refuses them, different variants, configurations or parameter dtypes
    of this library's modules.  Returns whether the PyTorch module is one of this
    library's with dropout > 0."""
    if linen and flax_variables is None:
        raise ValueError("a Linen flax_module needs flax_variables= (what model.init returned)")
    if not linen and flax_variables is not None:
        raise ValueError("flax_variables= is for a Linen flax_module; an NNX module holds its own")
    ours = _is_ours(torch_module)
    has_dropout = ours and float(torch_module.config.get("dropout", 0.0) or 0.0) > 0
    if training and has_dropout and dropout_masks is None:
        raise ValueError(
            "training mode with dropout > 0 needs dropout_masks= (one bool keep-mask per step, "
            "True = keep): the two frameworks cannot share a random stream"
        )
    if dropout_masks is not None:
        if not training:
            raise ValueError("dropout_masks= applies in training mode only: pass training=True")
        if len(dropout_masks) < n_steps:
            raise ValueError(f"dropout_masks has {len(dropout_masks)} masks for {n_steps} steps: give one per step")
    if implementation is not None and not ours:
        raise ValueError("implementation= applies to this library's modules only")
    if not linen:
        _check_pair(torch_module, flax_module)
    return has_dropout


def _check_dtypes(torch_module: Any, flax_params: Mapping[tuple[Any, ...], Any]) -> str:
    """The parameter dtype both sides share (any pair, Linen included); raises ValueError
    if they differ."""
    dtype = module_dtype(torch_module)
    flax_dtype = str(np.asarray(next(iter(flax_params.values()))).dtype) if flax_params else dtype
    if flax_dtype != dtype:
        raise ValueError(f"the modules have different parameter dtypes: torch {dtype} vs flax {flax_dtype}")
    return dtype


def _training_tolerance(dtype: str, rtol: float | None, atol: float | None) -> Tolerance:
    """``tolerances.TRAINING_PARITY`` for the dtype (normwise), with ``rtol`` / ``atol``
    overriding it; a dtype without a measured tolerance needs both."""
    if dtype not in TRAINING_PARITY and (rtol is None or atol is None):
        raise ValueError(
            f"no training tolerance is measured for {dtype} (only for {', '.join(TRAINING_PARITY)}): "
            "pass rtol= and atol="
        )
    default = TRAINING_PARITY.get(dtype, Tolerance(0.0, 0.0, normwise=True))
    return default._replace(rtol=default.rtol if rtol is None else rtol, atol=default.atol if atol is None else atol)


def _static_kwargs(ours: bool, linen: bool, has_dropout: bool, training: bool,
                   implementation: str | None) -> dict[str, Any]:
    """The keywords every call of this library's modules gets: the path
    (``implementation=``) and, for an NNX module with dropout, ``deterministic=``."""
    static: dict[str, Any] = {}
    if ours:
        if implementation is not None:
            static["implementation"] = implementation
        if not linen and has_dropout:
            static["deterministic"] = not training
    return static


# --------------------------------------------------------------------------- the two steppers

class _TorchStepper:
    """A copy of the PyTorch module in the requested mode, and its optimiser over the
    copy's trainable parameters."""

    def __init__(self, torch_module: Any, factory: Callable[[Any], Any],
                 loss: Callable[[Any, Any], Any], training: bool, dtype: str, *,
                 call: Callable[..., Any] | None = None, rows: np.ndarray | None = None) -> None:
        import torch

        self.module = copy.deepcopy(torch_module)
        self.module.train(training)
        self.optimizer = factory([p for p in self.module.parameters() if p.requires_grad])
        self.loss = loss
        self.dtype = getattr(torch, dtype)
        self.call = call
        self.rows = None if rows is None else torch.from_numpy(rows)
        self.untouched: set[str] = set()  # the parameters the last step gave no gradient

    def step(self, x: np.ndarray, target: np.ndarray | None, kwargs: dict[str, Any]) -> float:
        """One step (gradient, optimiser update) on a batch; returns the loss before it."""
        import torch

        x_t = torch.tensor(x, dtype=self.dtype)
        target_t = None if target is None else torch.tensor(target, dtype=self.dtype)
        self.optimizer.zero_grad(set_to_none=True)
        output = self.module(x_t, **kwargs) if self.call is None else self.call(self.module, x_t, **kwargs)
        value = self.loss(*_kept_rows(_first(output), target_t, self.rows))
        value.backward()
        # no gradient at all (None: computed under no_grad, transformers' DSA indexer): the
        # optimiser leaves the parameter alone, weight decay included
        self.untouched = {n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None}
        self.optimizer.step()
        return float(value.detach())

    def parameters(self) -> dict[str, Any]:
        """The copy's parameters by name, as they are now."""
        return {name: p.detach() for name, p in self.module.named_parameters()}


class _FlaxStepper:
    """The Flax module as a pure function of its parameter pytree (NNX split, or a Linen
    model's ``"params"`` collection), and the optax state that trains it: one step is a
    single ``jax.jit`` of forward, gradient and update.  Only the parameters change."""

    def __init__(self, flax_module: Any, flax_variables: Any, linen: bool, *,
                 call: Callable[..., Any] | None = None, rows: np.ndarray | None = None) -> None:
        self.module = flax_module
        self.linen = linen
        self.call = call
        self.rows = rows
        if linen:
            from flax.core import unfreeze

            variables = unfreeze(flax_variables)
            self.params: Any = variables["params"]
            self.others = {k: v for k, v in variables.items() if k != "params"}
        else:
            from flax import nnx

            graphdef, params, rest = nnx.split(flax_module, nnx.Param, ...)
            self.graphdef: Any = graphdef
            self.params = params
            self.rest: Any = rest
        self.tx: Any = None
        self.dtype: Any = None
        self.opt_state: Any = None
        self._step: Any = None

    def apply(self, params: Any, x: Any, kwargs: dict[str, Any]) -> Any:
        """The module's output with these parameters (through ``flax_call`` if given)."""
        call = self.call
        if self.linen:
            variables = {**self.others, "params": params}
            if call is None:
                return self.module.apply(variables, x, **kwargs)
            return self.module.apply(variables, x, method=lambda m, x_, **kw: call(m, x_, **kw), **kwargs)
        from flax import nnx

        module = nnx.merge(self.graphdef, params, self.rest)
        return module(x, **kwargs) if call is None else call(module, x, **kwargs)

    def flat(self) -> dict[tuple[Any, ...], Any]:
        """{path: array} of the parameters as they are now."""
        if self.linen:
            return _flat_params(self.params)
        from flax import nnx

        return {tuple(p): v[...] for p, v in nnx.to_flat_state(self.params)}

    def compile(self, tx: Any, loss: Callable[[Any, Any], Any], static: dict[str, Any], dtype: str) -> None:
        """The jitted step, with ``static`` keywords passed to every call."""
        import jax
        import jax.numpy as jnp
        import optax

        def flax_step(params: Any, opt_state: Any, x: Any, target: Any, arrays: dict[str, Any], moving: Any) -> Any:
            def objective(p: Any) -> Any:
                return loss(*_kept_rows(_first(self.apply(p, x, {**arrays, **static})), target, self.rows))

            value, grads = jax.value_and_grad(objective)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            updates = jax.tree.map(lambda u, m: u * m.astype(u.dtype), updates, moving)
            return optax.apply_updates(params, updates), opt_state, value

        self.tx = tx
        self.dtype = getattr(jnp, dtype)
        self._step = jax.jit(flax_step)

    def step(self, x: np.ndarray, target: np.ndarray | None, arrays: dict[str, Any],
             frozen: set[tuple[Any, ...]] | frozenset[tuple[Any, ...]] = frozenset()) -> float:
        """One step on a batch (the optimiser state made on the first), the parameters at
        ``frozen`` paths left as they are (PyTorch's side gave them no gradient: its
        optimiser skips them, where optax would decay them); returns the loss before it."""
        import jax
        import jax.numpy as jnp

        if self.opt_state is None:
            self.opt_state = self.tx.init(self.params)
        x_j = jnp.asarray(x).astype(self.dtype)
        target_j = None if target is None else jnp.asarray(target).astype(self.dtype)

        def path(keys: Any) -> tuple[Any, ...]:  # a key path as flat() names it (no ``.value``)
            return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in keys if hasattr(k, "key") or hasattr(k, "idx"))

        moving = jax.tree_util.tree_map_with_path(lambda keys, _: jnp.asarray(path(keys) not in frozen), self.params)
        self.params, self.opt_state, value = self._step(self.params, self.opt_state, x_j, target_j, arrays, moving)
        return float(value)

    def store(self, report: TrainingReport, deterministic: bool | None) -> None:
        """The trained model into the report: the Linen variables, or the NNX module
        (with ``deterministic`` set on its dropout, unless None)."""
        if self.linen:
            report.flax_variables = {**self.others, "params": self.params}
            return
        from flax import nnx

        trained = nnx.merge(self.graphdef, self.params, self.rest)
        if deterministic is not None:
            trained.set_attributes(deterministic=deterministic, raise_if_not_found=False)
        report.flax_module = trained


# --------------------------------------------------------------------------- the run

def _step_keywords(static: dict[str, Any], mask: np.ndarray | None,
                   keep: np.ndarray | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The PyTorch call's keywords and the arrays the jitted Flax step is given: the same
    ``mask=`` and ``dropout_mask=`` to both."""
    import jax.numpy as jnp
    import torch

    t_kwargs: dict[str, Any] = dict(static)
    t_kwargs.pop("deterministic", None)
    f_arrays: dict[str, Any] = {}
    if mask is not None:
        t_kwargs["mask"], f_arrays["mask"] = torch.tensor(mask), jnp.asarray(mask)
    if keep is not None:
        t_kwargs["dropout_mask"], f_arrays["dropout_mask"] = torch.tensor(keep), jnp.asarray(keep)
    return t_kwargs, f_arrays


def _compare_step(step: int, torch_side: _TorchStepper, flax_side: _FlaxStepper, losses: tuple[float, float],
                  rules: Sequence[Any], tol: Tolerance) -> StepRecord:
    """Both losses (elementwise) and every parameter (normwise) after one step; the Flax
    parameters are carried through the rules into PyTorch's names and layouts."""
    t_value, f_value = losses
    findings = [compare("loss", t_value, f_value, tol._replace(normwise=False))]
    flat = flax_side.flat()
    as_torch = apply_specs({p: np.asarray(flat[p]) for r in rules for p in r.flax_paths}, rules, "to_torch")
    t_params = torch_side.parameters()
    for t_name in (n for r in rules for n in r.torch_names):
        findings.append(compare(t_name, t_params[t_name], as_torch[t_name], tol))
    return StepRecord(step, t_value, f_value, findings)


def _train(
    torch_side: _TorchStepper, flax_side: _FlaxStepper, batches: Sequence[Any], n_steps: int, *,
    static: dict[str, Any], mask: Any, dropout_masks: Sequence[Any] | None, rules: Sequence[Any],
    tol: Tolerance, name: str,
) -> TrainingReport:
    """The loop: step ``k`` trains both sides on ``batches[k % len(batches)]`` (and its
    dropout mask), then compares them; all in ``full_precision()``."""
    report = TrainingReport(optimizer=name)
    mask_np = None if mask is None else np.asarray(as_numpy(mask), dtype=bool)
    with full_precision():
        for k in range(n_steps):
            x_np, target_np = _split_batch(batches[k % len(batches)])
            keep = None if dropout_masks is None else np.asarray(as_numpy(dropout_masks[k]), dtype=bool)
            t_kwargs, f_arrays = _step_keywords(static, mask_np, keep)
            x_src, tgt_src = _source(x_np), None if target_np is None else _source(target_np)
            t_value = torch_side.step(x_src, tgt_src, t_kwargs)
            frozen = {p for r in rules if r.torch_names and all(n in torch_side.untouched for n in r.torch_names)
                      for p in r.flax_paths}
            f_value = flax_side.step(x_src, tgt_src, f_arrays, frozen)
            report.steps.append(_compare_step(k + 1, torch_side, flax_side, (t_value, f_value), rules, tol))
    return report


# --------------------------------------------------------------------------- the entry points

def check_training_parity(
    torch_module: Any,
    flax_module: Any,
    batches: Sequence[Any],
    *,
    loss: str | tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]] = "mse",
    optimizer: str | tuple[Callable[[Any], Any], Any] = "sgd",
    steps: int | None = None,
    lr: float = 1e-2,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    nesterov: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    mask: Any = None,
    param_map: Any = None,
    flax_variables: Any = None,
    training: bool = False,
    dropout_masks: Sequence[Any] | None = None,
    implementation: str | None = None,
    plot: str | None = None,
    torch_call: Callable[..., Any] | None = None,
    flax_call: Callable[..., Any] | None = None,
    rows: Any = None,
) -> TrainingReport:
    """Trains copies of both modules side by side and compares their parameters after
    every step.

    Args:
      torch_module: a ``torch.nn.Module`` (this library's, or your own with ``param_map``).
      flax_module: a Flax NNX module, or a Linen module with ``flax_variables``.
      batches: a sequence of batches, each an input array ``(B, T, d_in)`` (NumPy, torch
        or JAX) or ``(input, target)`` with the target shaped like the output; cast to
        the modules' parameter dtype.  Step ``k`` uses ``batches[k % len(batches)]``.
      loss: ``"mse"`` or ``(torch_loss, flax_loss)``, each ``(output, target) -> scalar``.
      optimizer: ``"sgd"``, ``"adam"``, ``"adamw"`` (matched as the module docstring
        says) or ``(torch_factory, optax_transformation)``, whose own settings then
        stand (``lr`` and the other hyper-parameters below are not used).
      steps: how many steps (default ``len(batches)``).
      lr, betas, eps, weight_decay, momentum, nesterov: the hyper-parameters, given to
        both optimisers.
      rtol, atol: override ``tolerances.TRAINING_PARITY`` for the dtype; a parameter
        passes when ``|torch - flax| <= atol + rtol * max|flax|`` (normwise).
      mask: bool, True = may attend, passed as ``mask=`` to both modules at every step.
      param_map: {torch name: flax path or (flax path, transpose)}, or a list of
        ``attention_spec.interop.specs.Rule`` (packed q/k/v, reshapes, any transposition), as for
        ``check_parity``; default: the declared weight map of this library's modules.
        Each Flax parameter is carried through the rules into PyTorch's names and
        layouts after every step and compared there.
      flax_variables: the variables of a Linen ``flax_module`` (``model.init(...)``).
      training: run in training mode (eval by default); dropout > 0 then needs
        ``dropout_masks``: one bool keep-mask per step (True = keep), shaped like the
        attention weights (B, H, T, S).
      implementation: the path both of this library's modules compute on (None = own).
      plot: write a PNG of the divergence per step (log scale) to this path.
      torch_call, flax_call: ``(module, x, **kwargs) -> output`` to call a module whose
        signature is not ours at every step, e.g. a Hugging Face layer with its mask and
        positions; ``kwargs`` are what the harness would pass the module itself (``mask=``,
        ``dropout_mask=``, and for this library's modules ``implementation=`` and
        ``deterministic=``).  ``flax_call`` runs inside ``jax.jit``; for a Linen model it
        receives the bound model.  Default: ``module(x, **kwargs)``.
      rows: bool ``(batch, seq)`` (the same for every batch), True = this query row
        counts: the loss sees only the kept rows of the output and target, as
        ``(kept rows, ...)`` arrays (``"mse"`` is then their mean), so that padded rows
        do not train either model.  None (the default): every row.

    Returns a ``TrainingReport`` (raises nothing on divergence; see
    ``assert_training_parity``).  The modules passed in are not changed.

    Raises ValueError / TypeError for an unknown loss or optimiser, SGD options given to
    Adam, a parameter map that does not cover both modules, training mode with dropout
    but no ``dropout_masks`` (or too few), a Linen module without ``flax_variables``, and
    whatever the modules raise for their inputs.
    """
    n_steps = _check_steps(batches, steps)
    _check_calls(torch_call, flax_call)
    np_rows = _check_training_rows(rows, batches)
    name, torch_factory, tx = _optimizers(optimizer, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          momentum=momentum, nesterov=nesterov)
    torch_loss, flax_loss = _losses(loss)
    linen = _is_linen(flax_module)
    has_dropout = _check_modules(torch_module, flax_module, linen=linen, flax_variables=flax_variables,
                                 training=training, dropout_masks=dropout_masks, n_steps=n_steps,
                                 implementation=implementation)
    flax_side = _FlaxStepper(flax_module, flax_variables, linen, call=flax_call, rows=np_rows)
    flat0 = flax_side.flat()
    rules = resolve_rules(torch_module, {p: tuple(np.shape(v)) for p, v in flat0.items()}, param_map,
                          trainable_only=True)
    dtype = _check_dtypes(torch_module, flat0)
    static = _static_kwargs(_is_ours(torch_module), linen, has_dropout, training, implementation)
    flax_side.compile(tx, flax_loss, static, dtype)
    torch_side = _TorchStepper(torch_module, torch_factory, torch_loss, training, dtype,
                               call=torch_call, rows=np_rows)
    tol = _training_tolerance(dtype, rtol, atol)

    report = _train(torch_side, flax_side, batches, n_steps, static=static, mask=mask,
                    dropout_masks=dropout_masks, rules=rules, tol=tol, name=name)
    report.torch_module = torch_side.module
    flax_side.store(report, deterministic=not training if has_dropout else None)
    if plot is not None:
        plot_trajectory(report, plot, tolerance=tol)
    return report


def assert_training_parity(
    torch_module: Any, flax_module: Any, batches: Sequence[Any], **kwargs: Any
) -> TrainingReport:
    """As ``check_training_parity`` (same keywords), but raises ``TrainingParityError``
    (an AssertionError) when any step drifts past the tolerance, naming the first such
    step, the parameter, its worst element and both values, and printing the trajectory."""
    report = check_training_parity(torch_module, flax_module, batches, **kwargs)
    if not report.ok:
        raise TrainingParityError(report)
    return report


def plot_trajectory(report: TrainingReport, path: str, *, tolerance: Tolerance | None = None) -> None:
    """A PNG at ``path``: the largest parameter divergence after each step, absolute and
    relative to scale, on a log scale (zeros drawn at 1e-16).  Uses matplotlib's Agg
    canvas directly, so no global backend is selected."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    floor = 1e-16
    steps = [s.step for s in report.steps]
    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, [max(v, floor) for v in report.max_abs], marker="o", label="max abs")
    ax.plot(steps, [max(v, floor) for v in report.max_rel], marker="s", label="max rel (to scale)")
    if tolerance is not None and tolerance.rtol > 0:
        ax.axhline(tolerance.rtol, color="red", linestyle="--", label=f"tolerance: rtol {tolerance.rtol:g}")
    bad = report.first_failure
    if bad is not None:
        ax.axvline(bad.step, color="red", alpha=0.4, label=f"first failure: step {bad.step}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("parameter divergence")
    ax.set_title(f"training parity, {report.optimizer}: torch vs flax")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# --------------------------------------------------------------------------- command line

_DEMO_VARIANTS = {
    "MultiHeadAttention": {"d_in": 8, "d_out": 8, "context_length": 16, "dropout": 0.0, "num_heads": 2},
    "CausalAttention": {"d_in": 8, "d_out": 8, "context_length": 16, "dropout": 0.0},
    "SelfAttention_v2": {"d_in": 8, "d_out": 8},
}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m parity_tests.training [--variant NAME] [--optimizer sgd|adam|adamw]
    [--steps N] [--lr LR] [--momentum M] [--weight-decay WD] [--plot PATH]``: trains one of
    this library's modules (float32, batches (2, 6, 8), targets from a second module of
    the same variant) both ways and prints the trajectory; exit status 1 past the
    tolerance."""
    import argparse

    import torch

    import torch_attention
    from parity_tests.harness import to_flax

    parser = argparse.ArgumentParser(prog="python -m parity_tests.training", description=main.__doc__)
    parser.add_argument("--variant", choices=sorted(_DEMO_VARIANTS), default="MultiHeadAttention")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=None, help="default: 0.5 for sgd, 1e-2 for adam/adamw")
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of the divergence per step")
    args = parser.parse_args(argv)

    cls = getattr(torch_attention, args.variant)
    torch.manual_seed(0)
    student = cls(**_DEMO_VARIANTS[args.variant]).eval()
    torch.manual_seed(1)
    teacher = cls(**_DEMO_VARIANTS[args.variant]).eval()
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        x = rng.standard_normal((2, 6, 8)).astype(np.float32)
        with torch.no_grad():
            batches.append((x, teacher(torch.from_numpy(x)).numpy()))
    lr = args.lr if args.lr is not None else (0.5 if args.optimizer == "sgd" else 1e-2)
    report = check_training_parity(
        student, to_flax(student), batches, optimizer=args.optimizer, steps=args.steps, lr=lr,
        momentum=args.momentum, weight_decay=args.weight_decay, plot=args.plot,
    )
    print(report.table())
    print(report.message().splitlines()[0] if not report.ok else report.message())
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
