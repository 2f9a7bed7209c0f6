"""attention_spec.planning.plan_call: the checks of one module call, framework-free.

NumPy stands in for a framework's array work (``CallOps``), so these tests show that the
plan needs no framework, and what it decides; the texts and the order of the errors for
both twins' modules are tested in ``test_errors.py`` and ``test_cache_and_call_checks.py``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from attention_spec.arrays import check_bias, dtype_name
from attention_spec.masks import check_kv_lengths_array, check_mask
from attention_spec.planning import CallOps, CallPlan, plan_call
from attention_spec.registry import make_config

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
    fused_draws_dropout=False,
    fused_takes_sinks=lambda: False,
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
    takes = OPS._replace(fused_takes_sinks=lambda: True)
    assert plan_call(spec, takes, x, compute_dtype=None, training=False, implementation="fused").implementation \
        == "fused"
