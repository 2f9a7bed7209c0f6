"""attention_spec.planning.plan_call: the checks of one module call, framework-free.

NumPy stands in for a framework's array work (``CallOps``), so these tests show that the
plan needs no framework, and what it decides; the texts and the order of the errors for
both twins' modules are tested in ``test_errors.py`` and ``test_cache_and_call_checks.py``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
import pytest

from attention_spec.arrays import check_bias, dtype_name
from attention_spec.masks import check_kv_lengths_array, check_mask
from attention_spec.planning import CallOps, CallPlan, RouteFacts, fused_blockers, module_options, plan_call
from attention_spec.registry import make_config
from attention_spec.routing import resolve_implementation

D_IN, D_OUT, HEADS, KDIM = 6, 4, 2, 3


def _canonical(check: Any) -> Any:
    def canonical(a: Any, target: tuple[int, ...]) -> Any:
        if a is None:
            return None
        a = np.asarray(a)
        check(a.shape, dtype_name(a.dtype), target)
        return a.reshape((1,) * (len(target) - a.ndim) + a.shape)

    return canonical


def _kv_lengths(lengths: Any, batch: int, kv_len: int) -> Any:
    if lengths is None:
        return None
    lengths = np.asarray(lengths)
    check_kv_lengths_array(lengths.shape, lengths.dtype.name, batch)
    return np.broadcast_to(lengths.reshape(-1), (batch,))


OPS = CallOps(
    canonical_mask=_canonical(check_mask),
    canonical_bias=_canonical(check_bias),
    canonical_kv_lengths=_kv_lengths,
    as_array=np.asarray,
    cache_fields=lambda cache: None,
    check_cache_room=lambda cache, new, max_len: None,
    check_route=lambda spec, plan, facts: _check_route(spec, plan, facts),
)


def _check_route(spec: Any, plan: CallPlan, facts: RouteFacts, *, fused_has_sinks: bool = False) -> None:
    """A table-free twin's route check: the policy over a bare preference of paths, a
    fused kernel without dropout (and, unless ``fused_has_sinks``, without sinks)."""
    options = module_options(spec, training=facts.training, return_weights=facts.return_weights,
                             implementation=plan.implementation)
    resolve_implementation(
        plan.implementation, preference=(), return_weights=facts.return_weights,
        normalization=options.normalization, dropout_active=options.dropout_active,
        dropout_mask_given=facts.dropout_mask is not None, fused_draws_dropout=False,
        fused_blockers=fused_blockers(options, float64=facts.dtype == "float64",
                                      sinks_given=spec.sinks and not fused_has_sinks),
    )


def _spec(**overrides: Any) -> Any:
    options = {"d_in": D_IN, "d_out": D_OUT, "context_length": None, "dropout": 0.1, "num_heads": HEADS,
               "kdim": KDIM, "vdim": KDIM, **overrides}
    return make_config("MultiHeadAttention", options)


def test_a_cross_attention_call_is_planned_without_a_framework() -> None:
    x = np.zeros((2, 5, D_IN), np.float32)
    context = np.zeros((2, 7, KDIM), np.float32)
    mask = np.ones((5, 7), bool)
    plan = plan_call(_spec(), OPS, x, compute_dtype="float32", training=True, context=context, mask=mask,
                     kv_lengths=[7, 3], implementation="reference")
    assert isinstance(plan, CallPlan)
    decided = (plan.batched, plan.implementation, plan.batch, plan.seq, plan.kv_seq)
    assert decided == (True, "reference", 2, 5, 7)
    assert plan.keys is context and plan.values is context
    assert plan.mask.shape == (1, 1, 5, 7) and plan.bias is None
    assert plan.kv_lengths.tolist() == [7, 3]
    assert plan.segment_ids is None and plan.kv_segment_ids is None


def test_an_unbatched_call_keeps_the_input_rank() -> None:
    x = np.zeros((5, D_IN), np.float32)
    plan = plan_call(_spec(implementation="fused"), OPS, x, compute_dtype=None, training=False,
                     bias=np.zeros((5, 5), np.float32))
    assert (plan.batched, plan.implementation, plan.batch, plan.kv_seq) == (False, "fused", 1, 5)
    assert plan.bias.shape == (1, 5, 5)  # (heads, q_len, kv_len): the batch dimension is the twin's


def test_the_input_is_checked_before_the_mask_and_the_path() -> None:
    bad_x = np.zeros((5, D_IN + 1), np.float32)
    bad_mask = np.ones((3, 3), np.float32)
    with pytest.raises(ValueError, match=re.escape(f"but the module expects d_in={D_IN}")):
        plan_call(_spec(), OPS, bad_x, compute_dtype=None, training=True, mask=bad_mask,
                  implementation="fused", return_weights=True)
    x = np.zeros((5, D_IN), np.float32)
    with pytest.raises(TypeError, match="mask must be a bool array"):
        plan_call(_spec(), OPS, x, compute_dtype=None, training=True, mask=bad_mask,
                  implementation="fused", return_weights=True)
    refused = re.escape("implementation='fused' cannot honour return_weights=True")
    with pytest.raises(ValueError, match=refused):
        plan_call(_spec(), OPS, x, compute_dtype=None, training=True, implementation="fused",
                  return_weights=True)


def test_an_explicit_fused_path_refuses_sinks_unless_the_twin_takes_them_there() -> None:
    """Sinks: refused by name for a twin whose fused path has none (SDPA, XLA's kernel),
    planned for one whose does (the JAX twin's CPU kernel)."""
    x = np.zeros((2, 5, D_IN), np.float32)
    spec = _spec(sinks=True, kdim=None, vdim=None, dropout=0.0)
    with pytest.raises(ValueError, match=re.escape("cannot honour sinks (the fused kernel has no attention sinks)")):
        plan_call(spec, OPS, x, compute_dtype=None, training=False, implementation="fused")
    takes = OPS._replace(check_route=functools.partial(_check_route, fused_has_sinks=True))
    assert plan_call(spec, takes, x, compute_dtype=None, training=False, implementation="fused").implementation \
        == "fused"


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_an_explicit_path_is_refused_by_the_table_before_the_projections(fw: str) -> None:
    """The planner asks the twin's table of paths, on the call's shapes: an explicit
    ``"fused"`` with sinks runs where its row has them (JAX on CPU: the library's kernel,
    for a call it fits) and is refused by name, before any projection, where the row that
    takes the call has none (a dense mask, or a cached step's per-example offset, sends
    JAX's call to XLA's kernel; SDPA has none)."""
    pytest.importorskip("torch" if fw == "torch" else "flax")
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    mask = np.ones((2, 1, 3, 3), bool)
    options = {"d_in": 8, "d_out": 8, "context_length": None, "dropout": 0.0, "num_heads": 2, "sinks": True,
               "implementation": "fused"}
    if fw == "torch":
        import torch

        import torch_attention as lib
        module: Any = lib.MultiHeadAttention(**options)
        as_array: Any = torch.tensor
    else:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import jax_attention as lib
        module = lib.MultiHeadAttention(**options, rngs=nnx.Rngs(0))
        as_array = jnp.asarray
    projected = []
    original = type(module)._project
    module._project = lambda *args: projected.append(1) or original(module, *args)  # (the instance's seam)
    refused = re.escape("implementation='fused' cannot honour sinks (the fused kernel has no attention sinks)")
    calls = {"mask": lambda: module(as_array(x), as_array(mask)),
             "cached": lambda: module(as_array(x), cache=module.init_cache(2, 8))}
    if fw == "jax" and jax.default_backend() == "cpu":
        assert module(as_array(x)).shape == (2, 3, 8)  # the CPU kernel has sinks
        projected.clear()
    else:
        calls["plain"] = lambda: module(as_array(x))
    for name, call in calls.items():
        with pytest.raises(ValueError, match=refused):
            call()
        assert not projected, f"{fw} {name}: refused after the projections"


# --------------------------------------------------------------------------- checked once

def _count_checks() -> Any:
    """A profiler that counts the calls of every check function of ``attention_spec``
    (however a module imported it) made outside another check (a check's own helpers
    are part of it), and the counts: name -> calls."""
    import inspect
    import sys

    from attention_spec import arrays, masks, options

    checks = {fn.__code__: name for module in (arrays, masks, options)
              for name, fn in vars(module).items()
              if name.startswith("check_") and inspect.isfunction(fn) and fn.__module__ == module.__name__}
    counts: dict[str, int] = {}
    depth = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if frame.f_code not in checks:
            return
        if event == "call":
            if depth[0] == 0:
                counts[checks[frame.f_code]] = counts.get(checks[frame.f_code], 0) + 1
            depth[0] += 1
        elif event == "return":
            depth[0] -= 1

    return profile, counts, sys


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_a_module_call_checks_each_input_once(fw: str) -> None:
    """Each check of a module call runs once: the planner's (``plan_call``), not again in
    the functional core (the module hands it the checked call, ``functional.assemble``).
    A cached step too; the counts are of every ``check_*`` of ``attention_spec``."""
    pytest.importorskip("torch" if fw == "torch" else "flax")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 8)).astype(np.float32)
    mask = rng.random((2, 1, 6, 6)) < 0.8
    bias = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    options = {"d_in": 8, "d_out": 8, "context_length": 16, "dropout": 0.0, "num_heads": 4, "num_kv_heads": 2,
               "sinks": True, "softcap": 5.0, "window": (3, 0), "causal": False}
    if fw == "torch":
        import torch

        import torch_attention as lib
        module = lib.MultiHeadAttention(**options)
        as_array: Any = torch.tensor
    else:
        import jax.numpy as jnp
        from flax import nnx

        import jax_attention as lib
        module = lib.MultiHeadAttention(**options, rngs=nnx.Rngs(0))
        as_array = jnp.asarray
    calls = {  # each makes the call's inputs (a cache: init_cache checks its own) and returns the call
        "plain": lambda: lambda: module(as_array(x), as_array(mask), bias=as_array(bias), kv_lengths=[6, 4],
                                        segment_ids=as_array(np.array([[0] * 3 + [1] * 3] * 2))),
        "cached": lambda: functools.partial(module, as_array(x[:, :3]), kv_lengths=[3, 2],
                                            cache=module.init_cache(2, 8)),
    }
    for name, make in calls.items():
        make()()  # (first calls build what they build: the CPU kernel, compiled programs)
        run = make()
        profile, counts, sys = _count_checks()
        sys.setprofile(profile)
        try:
            run()
        finally:
            sys.setprofile(None)
        assert counts, "the profiler saw no check: it would pass on nothing"
        assert "check_mask" in counts or name == "cached"
        twice = {check: n for check, n in counts.items() if n > 1}
        assert not twice, f"{fw} {name} call: checked more than once: {twice}"
