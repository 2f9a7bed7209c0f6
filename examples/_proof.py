"""What both ported examples share: the four proofs through ``parity_tests`` (logits,
gradients, ten AdamW steps, ``locate_divergence``); the random init that sets every weight
is ``parity_tests.causal_lm.randomise`` (re-exported here).

A model is given as a ``Port``: the Hugging Face model, its Flax NNX port, the parameter
map between them (``attention_spec.interop.specs.Rule``s) and the two calls
``(model, ids, attention_mask) -> logits``.  Token ids travel through the training harness
as float32 (it casts every batch to the parameters' dtype): ids below 2**24 are exact
there, and each call turns them back into integers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity_tests import (
    DivergenceReport,
    ParityReport,
    TrainingReport,
    check_parity,
    check_training_parity,
    locate_divergence,
)
from parity_tests.causal_lm import next_token_losses, randomise

__all__ = ["ExactZero", "Port", "left_padding", "locate", "prove_logits_and_grads", "prove_training", "randomise",
           "summary", "tokens"]

# AdamW, the same hyper-parameters on both sides (torch.optim.AdamW and optax.adamw).
# eps = 1e-6, not torch's 1e-8: Adam's step is lr * g / (|g| + eps) elementwise, and
# among the thousands of elements of a whole model's gradient some sit near 1e-8, where
# a rounding difference of 1e-10 between the frameworks moves the step by 1% of lr.
# Measured on the GPT-2 example, ten steps, worst parameter relative to its scale
# (2026-11-26): with init std 0.2, eps = 1e-8 drifted to 1.4e-4 (c_fc.weight, past
# TRAINING_PARITY's 5e-5) and eps = 1e-6 to 1.4e-5; with the init used now (std
# width ** -0.5), eps = 1e-8 gives 1.0e-4 (within the tolerance, whose atol adds to it,
# by 1.3x) and eps = 1e-6 2.2e-5.  Without ``ExactZero`` GPT-2's key bias alone drifts by
# 1.5e-3 of its scale at eps = 1e-8 in the first step (init std 0.2).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-6, 0.1
STEPS = 10


@dataclass
class Port:
    """A Hugging Face model, its Flax port and how to compare them."""

    hf: Any
    flax: Any
    rules: list[Any]
    torch_call: Callable[..., Any]  # (hf model, ids (B, T), attention_mask (B, T) or None) -> logits
    flax_call: Callable[..., Any]  # (flax model, ids, attention_mask or None) -> logits


def tokens(vocab: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """Random token ids (batch, seq), int64."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq), dtype=np.int64)


def left_padding(batch: int, seq: int, pads: Sequence[int]) -> np.ndarray:
    """Hugging Face's attention_mask (batch, seq), int64: 0 for the first ``pads[b]``
    positions of row b (left padding), 1 for its tokens."""
    mask = np.ones((batch, seq), dtype=np.int64)
    for b, n in enumerate(pads):
        mask[b, :n] = 0
    return mask


def prove_logits_and_grads(port: Port, ids: np.ndarray, attention_mask: np.ndarray | None) -> ParityReport:
    """``check_parity`` of the logits and of the gradient of ``sum(logits * R)`` with
    respect to every parameter (``R`` the harness's fixed cotangent, zero at padded
    rows), carried through the rules to the Hugging Face names.  Padded query rows are
    left out (``rows=``): one that may see no key is zeros in ours and an average of
    the values in Hugging Face's layers, and it feeds no real token."""
    inputs = [ids] if attention_mask is None else [ids, attention_mask]
    rows = None if attention_mask is None else attention_mask.astype(bool)
    return check_parity(port.hf, port.flax, *inputs, param_map=port.rules, rows=rows,
                        torch_call=lambda m, *xs: port.torch_call(m, *xs),
                        flax_call=lambda m, *xs: port.flax_call(m, *xs))


@dataclass(frozen=True)
class ExactZero:
    """A gradient that is zero in exact arithmetic, set to zero on both sides before the
    optimiser sees it: ``torch_name[where]`` and the Flax parameter at ``flax_path``.
    GPT-2's key bias adds the same number to every score of a query, which the softmax
    cancels: its computed gradient is rounding noise (~1e-7 of the others), different in
    each framework, and Adam divides each gradient by its own RMS, so that noise becomes
    steps of size ``lr`` with arbitrary signs (``parity_tests/training.py`` says so)."""

    torch_name: str
    where: slice
    flax_path: tuple[Any, ...]


def _optimizer(torch_model: Any, exact_zeros: Sequence[ExactZero]) -> Any:
    """``"adamw"`` (matched by the harness) or, with ``exact_zeros``, the same AdamW on
    both sides after the zeroing: ``torch.optim.AdamW`` with a step pre-hook, and
    ``optax.chain(masked set_to_zero, optax.adamw)`` with the harness's settings."""
    if not exact_zeros:
        return "adamw"
    import jax
    import optax
    import torch

    names = [n for n, p in torch_model.named_parameters() if p.requires_grad]
    where = {names.index(z.torch_name): z.where for z in exact_zeros}
    flax_paths = {z.flax_path for z in exact_zeros}

    def torch_factory(params: Any) -> Any:
        params = list(params)
        optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

        def zero(*_: Any) -> None:
            for i, part in where.items():
                params[i].grad[part] = 0.0

        optimizer.register_step_pre_hook(zero)
        return optimizer

    def key(k: Any) -> Any:
        return getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))

    def zeroed(path: Any) -> bool:
        keys = tuple(map(key, path))
        return (keys[:-1] if keys[-1] == "value" else keys) in flax_paths  # an nnx.Param's array is its .value

    def mask(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(lambda path, _: zeroed(path), params)

    adamw = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, eps_root=0.0, weight_decay=WEIGHT_DECAY)
    return torch_factory, optax.chain(optax.masked(optax.set_to_zero(), mask), adamw)


def prove_training(port: Port, batches: Sequence[tuple[np.ndarray, np.ndarray]],
                   attention_mask: np.ndarray | None, exact_zeros: Sequence[ExactZero] = ()) -> TrainingReport:
    """Ten AdamW steps side by side (``check_training_parity``): the loss before each
    step and every parameter after it, within ``tolerances.TRAINING_PARITY``.  A batch
    is (ids, next ids), both (B, T); padded rows neither train nor count (``rows=``)."""
    mask = None if attention_mask is None else attention_mask.astype(bool)

    def torch_call(m: Any, x: Any, mask: Any = None) -> Any:
        return port.torch_call(m, x.long(), None if mask is None else mask.long())

    def flax_call(m: Any, x: Any, mask: Any = None) -> Any:
        return port.flax_call(m, x.astype("int32"), None if mask is None else mask.astype("int32"))

    as_float = [(x.astype(np.float32), y.astype(np.float32)) for x, y in batches]
    return check_training_parity(port.hf, port.flax, as_float, loss=next_token_losses(),
                                 optimizer=_optimizer(port.hf, exact_zeros),
                                 steps=STEPS, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                 mask=mask, rows=mask, param_map=port.rules,
                                 torch_call=torch_call, flax_call=flax_call)


def locate(port: Port, ids: np.ndarray) -> DivergenceReport:
    """``locate_divergence`` on unpadded ids (its modules are compared at every row,
    and a padded row differs by convention), forward and backward; Hugging Face's
    attention children are paired with ours by ``locate_divergence`` itself."""
    return locate_divergence(port.hf, port.flax, ids,
                             torch_call=lambda m, x: port.torch_call(m, x, None),
                             flax_call=lambda m, x: port.flax_call(m, x, None))


def summary(name: str, parity: ParityReport, training: TrainingReport, divergence: DivergenceReport) -> str:
    """A short report: the worst logits and gradient errors, the training trajectory's
    worst, and where (if anywhere) the port parts from the original."""
    logits = [f for f in parity.findings if not f.name.startswith("grad ")]
    grads = [f for f in parity.findings if f.name.startswith("grad ")]
    losses = [s.findings[0] for s in training.steps]
    lines = [
        f"{name}: {parity.message()}",
        f"  logits      max abs {max(f.max_abs for f in logits):.2e}, max rel to scale {max(f.max_rel for f in logits):.2e}",
        f"  gradients   {len(grads)} parameters, max rel to scale {max(f.max_rel for f in grads):.2e}",
        f"  training    {training.message()}",
        f"              losses {training.steps[0].torch_loss:.4f} -> {training.steps[-1].torch_loss:.4f}, "
        f"max abs loss difference {max(f.max_abs for f in losses):.2e}",
        f"  divergence  {'ok: no module parts' if divergence.ok else str(divergence.first)}",
    ]
    return "\n".join(lines)
