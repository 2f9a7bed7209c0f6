"""Runs one case of the parity matrix: build, convert, compare twin against twin and each
twin against the float64 references, on the case's path.  Shared by the tests and the
report.

The references: outputs (and, on the reference path, attention weights) against the
NumPy loop oracle (``reference.py``) on the inputs and weights the twins saw; gradients
against the same computation in float64 through PyTorch's reference path, which
``test_gradient_oracle.py`` checks in turn against finite differences of the loop oracle.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity_tests import reference
from parity_tests.cases import Case, FunctionalCase
from parity_tests.harness import (
    Finding,
    _cotangent,
    check_parity,
    compare,
    full_precision,
    jax_jit_lazy,
    run_flax,
    run_torch,
    to_flax,
    to_torch,
    torch_dtype,
)
from parity_tests.tolerances import GRAD_ORACLE, GRAD_PARITY, ORACLE, PARITY


@dataclass
class CaseResult:
    case: Case | FunctionalCase
    parity: list[Finding] = field(default_factory=list)  # torch vs flax
    oracle: list[Finding] = field(default_factory=list)  # each vs float64 (names say which)
    # A refusal case: what each framework said (or a complaint that it did not refuse).
    refusals: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def findings(self) -> list[Finding]:
        return self.parity + self.oracle

    @property
    def ok(self) -> bool:
        return not self.problems and all(f.ok for f in self.findings)

    def worst(self, group: str = "all") -> tuple[float, float]:
        findings = {"parity": self.parity, "oracle": self.oracle, "all": self.findings}[group]
        return (max((f.max_abs for f in findings), default=0.0),
                max((f.max_rel for f in findings if "grad" not in f.name or f.max_abs > f.atol),
                    default=0.0))


def build_pair(case: Case) -> tuple[Any, Any]:
    """(torch module, flax module) with identical weights, in eval mode, in case.dtype;
    the source side is built with a seed and the other converted, as case.direction says."""
    import torch
    from flax import nnx

    import jax_attention
    import torch_attention

    cls_name = case.spec.cls
    if case.direction == "pt2fx":
        with torch.random.fork_rng():
            torch.manual_seed(case.seed)
            src = getattr(torch_attention, cls_name)(**case.config)
        src = src.to(torch_dtype(case.dtype)).eval()
        return src, to_flax(src)
    import inspect

    import jax.numpy as jnp

    cls = getattr(jax_attention, cls_name)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: getattr(jnp, case.dtype) for k in ("dtype", "param_dtype") if k in accepted}
    src = cls(**case.config, **kwargs, rngs=nnx.Rngs(case.seed % 2**31))
    src.eval()
    return to_torch(src), src


def run_case(case: Case | FunctionalCase, *, grads: bool = True) -> CaseResult:
    """One case: a functional case, a refusal case, or a module case on its path."""
    if isinstance(case, FunctionalCase):
        return run_functional_case(case, grads=grads)
    from torch_attention.interop import torch_state_dict

    torch_m, flax_m = build_pair(case)
    x, mask = case.inputs()
    x = _in_dtype(x, case.dtype)  # so that a module without parameters runs in it too
    result = CaseResult(case)
    if case.refusal is not None:
        return _expect_refusal(result, torch_m, flax_m, x, mask, case)
    positions = case.spec.positions(case.batch, case.seq)
    torch_call, flax_call = _calls_at(positions)
    report = check_parity(torch_m, flax_m, x, mask=mask, grads=grads, implementation=case.implementation,
                          weights=case.weights, torch_call=torch_call, flax_call=flax_call)
    result.parity = report.findings

    # The float64 references see exactly the inputs and weights the twins saw.
    x_seen = x.astype(np.float64)
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(torch_m).items()}
    out64, weights64 = reference.forward(case.spec.cls, case.config, params, x_seen, mask, positions=positions)
    t, f = report.torch_results, report.flax_results
    tol = ORACLE[case.dtype]
    for side, got in (("torch", t), ("flax", f)):
        labels = (side, "oracle")
        result.oracle.append(compare(f"{side} output vs oracle", got["output"], out64, tol, labels))
        if case.weights:
            result.oracle.append(
                compare(f"{side} weights vs oracle", got["attention weights"], weights64, tol, labels))
    if grads:
        ref = _torch_float64_grads(torch_m, x_seen, mask, torch_call)
        grad_tol = GRAD_ORACLE[case.dtype]
        for side, got in (("torch", t), ("flax", f)):
            for name, value in ref.items():
                if name.startswith("grad"):
                    result.oracle.append(compare(f"{side} {name} vs float64", got[name], value, grad_tol,
                                                 (side, "float64")))
    return result


def _expect_refusal(result: CaseResult, torch_m: Any, flax_m: Any, x: np.ndarray, mask: Any,
                    case: Case) -> CaseResult:
    """Each framework, asked to run the case's path, must raise ValueError naming the
    option it refuses (before computing anything); a framework that may honour it there
    (``Variant.may_honour``) either refuses so or runs, and its output then matches the
    float64 oracle."""
    option, implementation = case.refusal, case.implementation
    for side, run, module in (("torch", run_torch, torch_m), ("flax", run_flax, flax_m)):
        try:
            with full_precision():
                got = run(module, [x], mask=mask, grads=False, implementation=implementation)
        except ValueError as err:
            result.refusals[side] = str(err)
            if option is None or option not in str(err):
                result.problems.append(f"{side} refused implementation={implementation!r} without naming "
                                       f"{option}: {err}")
        else:
            if not case.spec.may_honour(side):
                result.problems.append(f"{side} ran implementation={implementation!r} with {option} "
                                       "instead of refusing it")
                continue
            from torch_attention.interop import torch_state_dict

            params = {k: v.astype(np.float64) for k, v in torch_state_dict(torch_m).items()}
            want = reference.forward(case.spec.cls, case.config, params, x.astype(np.float64), mask)[0]
            result.oracle.append(compare(f"{side} output vs oracle", got["output"], want, ORACLE[case.dtype],
                                         (side, "oracle")))
    return result


def _in_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to ``dtype`` as a NumPy array (bfloat16 from ml_dtypes, which jax brings)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def _torch_float64_grads(torch_m: Any, x: np.ndarray, mask: Any, call: Any = None) -> dict[str, np.ndarray]:
    """Gradients of the same module and loss in float64 on the reference path: the
    reference for gradients on every path."""
    import copy

    import torch

    m64 = copy.deepcopy(torch_m).to(torch.float64)
    return run_torch(m64, [x.astype(np.float64)], mask=mask, grads=True, implementation="reference", call=call)


def _calls_at(positions: np.ndarray | None) -> tuple[Any, Any]:
    """(torch_call, flax_call) that call our modules at ``positions`` (None: the default
    call of each)."""
    if positions is None:
        return None, None
    import jax.numpy as jnp
    import torch

    def torch_call(module: Any, *inputs: Any, **kwargs: Any) -> Any:
        return module(*inputs, positions=torch.from_numpy(positions), **kwargs)

    def flax_call(module: Any, *inputs: Any, **kwargs: Any) -> Any:
        return module(*inputs, positions=jnp.asarray(positions), **kwargs)

    return torch_call, flax_call


# --------------------------------------------------------------------------- functional cases

def functional_torch(case: FunctionalCase, q: np.ndarray, k: np.ndarray, v: np.ndarray, cot: np.ndarray, *,
                     dtype: str, implementation: str, grads: bool = True) -> dict[str, np.ndarray]:
    """``torch_attention.functional.dot_product_attention`` on the case's inputs in
    ``dtype``: the output and the gradients of ``sum(out * cot)`` w.r.t. q, k, v."""
    import torch

    from torch_attention.functional import dot_product_attention

    _, _, _, mask, lengths = case.inputs()
    bias = case.bias()
    structure = case.structure()
    tensors = [torch.tensor(a.astype(np.float64), dtype=torch_dtype(dtype), requires_grad=grads)
               for a in (q, k, v) + (() if bias is None else (_in_dtype(bias, dtype),))]
    out: Any = dot_product_attention(
        *tensors[:3], mask=None if mask is None else torch.tensor(mask), causal=case.causal,
        kv_lengths=None if lengths is None else torch.tensor(lengths), implementation=implementation,
        bias=None if bias is None else tensors[3], softcap=case.softcap,
        window=structure["window"], alignment=structure["alignment"],
        q_offset=None if structure["q_offset"] is None else torch.tensor(structure["q_offset"]),
        segment_ids=None if structure["segment_ids"] is None else torch.tensor(structure["segment_ids"]),
    )
    result = {"output": out.detach().float().numpy() if dtype != "float64" else out.detach().numpy()}
    if grads:
        (out.to(torch.float64) * torch.tensor(cot, dtype=torch.float64)).sum().backward()
        for name, t in zip(("q", "k", "v", "bias")[: len(tensors)], tensors, strict=True):
            assert t.grad is not None
            result[f"grad {name}"] = t.grad.to(torch.float64).numpy()
    return result


def functional_jax(case: FunctionalCase, q: np.ndarray, k: np.ndarray, v: np.ndarray, cot: np.ndarray, *,
                   dtype: str, implementation: str, grads: bool = True) -> dict[str, np.ndarray]:
    """``jax_attention.functional.dot_product_attention`` under ``jit``, as ``functional_torch``."""
    import jax.numpy as jnp

    _, _, _, mask, lengths = case.inputs()
    arrays = [jnp.asarray(a.astype(np.float32)).astype(getattr(jnp, dtype)) for a in (q, k, v)]
    if dtype == "float64":
        arrays = [jnp.asarray(a) for a in (q, k, v)]
    bias = case.bias()
    if bias is not None:
        arrays.append(jnp.asarray(np.asarray(_in_dtype(bias, dtype), np.float32)).astype(getattr(jnp, dtype)))
    wide = jnp.float64 if dtype == "float64" else jnp.float32
    structure = case.structure()
    # window and alignment are static (Python values, as causal); the per-example offsets
    # and the segment ids are traced arrays, as the mask
    out, gradients = _jax_functional_run(
        arrays, None if mask is None else jnp.asarray(mask),
        None if lengths is None else jnp.asarray(lengths, jnp.int32), jnp.asarray(cot, wide),
        causal=case.causal, implementation=implementation, grads=grads, softcap=case.softcap,
        window=structure["window"], alignment=structure["alignment"],
        q_offset=None if structure["q_offset"] is None else jnp.asarray(structure["q_offset"]),
        segment_ids=None if structure["segment_ids"] is None else jnp.asarray(structure["segment_ids"]),
    )
    result = {"output": np.asarray(out.astype(wide))}
    if grads:
        names = ("q", "k", "v", "bias")[: len(arrays)]
        result.update({f"grad {n}": np.asarray(g.astype(wide)) for n, g in zip(names, gradients, strict=True)})
    return result


@functools.partial(jax_jit_lazy, static_argnames=("causal", "implementation", "grads", "softcap", "window",
                                                  "alignment"))
def _jax_functional_run(arrays: Any, mask: Any, lengths: Any, cot: Any, *,
                        causal: bool, implementation: str, grads: bool, softcap: float | None = None,
                        window: tuple[int | None, int | None] | None = None, alignment: str = "top_left",
                        q_offset: Any = None, segment_ids: Any = None) -> Any:
    """``arrays``: [q, k, v] or [q, k, v, bias]; gradients w.r.t. each."""
    import jax

    from jax_attention.functional import dot_product_attention

    def attend(q: Any, k: Any, v: Any, bias: Any = None) -> Any:
        return dot_product_attention(q, k, v, mask=mask, causal=causal, kv_lengths=lengths,
                                     implementation=implementation, bias=bias, softcap=softcap,
                                     window=window, alignment=alignment, q_offset=q_offset,
                                     segment_ids=segment_ids)

    if not grads:
        return attend(*arrays), None
    out, pullback = jax.vjp(attend, *arrays)
    return out, pullback(cot.astype(out.dtype))


def run_functional_case(case: FunctionalCase, *, grads: bool = True) -> CaseResult:
    """Both functional cores on the case's path, in its dtype: twin against twin, each
    against the loop oracle (outputs) and against float64 reference-path autograd
    (gradients w.r.t. q, k and v).  The case's structure options (grouped heads, window,
    alignment or per-example offsets, segment ids) go to every call and to the oracle."""
    result = CaseResult(case)
    q, k, v, _, _ = case.inputs()
    q, k, v = (_in_dtype(a, case.dtype).astype(np.float64) for a in (q, k, v))  # as the twins see them
    out_shape = (*q.shape[:-1], v.shape[-1])
    cot = _cotangent(None, out_shape).astype(np.float64)
    common: dict[str, Any] = {"dtype": case.dtype, "implementation": case.implementation, "grads": grads}
    with full_precision():
        t = functional_torch(case, q, k, v, cot, **common)
        f = functional_jax(case, q, k, v, cot, **common)
        ref = functional_torch(case, q, k, v, cot, dtype="float64", implementation="reference", grads=grads)
    for name in t:
        tol = (GRAD_PARITY if name.startswith("grad") else PARITY)[case.dtype]
        result.parity.append(compare(name, t[name], f[name], tol))
    bias = case.bias()
    bias64 = None if bias is None else _in_dtype(bias, case.dtype).astype(np.float64)
    out64, _ = reference.attention(q, k, v, scale=1.0 / math.sqrt(q.shape[-1]), mask=case.oracle_mask(),
                                   causal=case.causal, bias=bias64, softcap=case.softcap,
                                   **case.oracle_structure())
    for side, got in (("torch", t), ("flax", f)):
        result.oracle.append(compare(f"{side} output vs oracle", got["output"], out64, ORACLE[case.dtype],
                                     (side, "oracle")))
        if grads:
            for name in ("grad q", "grad k", "grad v", "grad bias")[: 3 + (bias is not None)]:
                result.oracle.append(compare(f"{side} {name} vs float64", got[name], ref[name],
                                             GRAD_ORACLE[case.dtype], (side, "float64")))
    return result
