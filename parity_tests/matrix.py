"""Runs one case of the parity matrix: build, convert, compare twin against twin and each
twin against the float64 references.  Shared by the tests and the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity_tests import reference
from parity_tests.cases import Case
from parity_tests.harness import (
    Finding,
    check_parity,
    compare,
    run_torch,
    to_flax,
    to_torch,
    torch_dtype,
)
from parity_tests.tolerances import GRAD_ORACLE, ORACLE


@dataclass
class CaseResult:
    case: Case
    parity: list[Finding] = field(default_factory=list)  # torch vs flax
    oracle: list[Finding] = field(default_factory=list)  # each vs float64 (names say which)

    @property
    def findings(self) -> list[Finding]:
        return self.parity + self.oracle

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

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
        torch.manual_seed(case.seed)
        src = getattr(torch_attention, cls_name)(**case.config)
        src = src.to(torch_dtype(case.dtype)).eval()
        return src, to_flax(src)
    import jax.numpy as jnp

    kwargs = {} if cls_name == "SimplifiedAttention" else {"dtype": getattr(jnp, case.dtype)}
    src = getattr(jax_attention, cls_name)(**case.config, **kwargs, rngs=nnx.Rngs(case.seed % 2**31))
    src.eval()
    return to_torch(src), src


def run_case(case: Case, *, grads: bool = True) -> CaseResult:
    from torch_attention.interop import torch_state_dict

    torch_m, flax_m = build_pair(case)
    x, mask = case.inputs()
    x = _in_dtype(x, case.dtype)  # so that a module without parameters runs in it too
    result = CaseResult(case)
    report = check_parity(torch_m, flax_m, x, mask=mask, grads=grads)
    result.parity = report.findings

    # The float64 references see exactly the inputs and weights the twins saw.
    x_seen = x.astype(np.float64)
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(torch_m).items()}
    out64, weights64 = reference.forward(case.spec.cls, case.config, params, x_seen, mask)
    t, f = report.torch_results, report.flax_results
    tol = ORACLE[case.dtype]
    for side, got in (("torch", t), ("flax", f)):
        labels = (side, "oracle")
        result.oracle.append(compare(f"{side} output vs oracle", got["output"], out64, tol, labels))
        result.oracle.append(
            compare(f"{side} weights vs oracle", got["attention weights"], weights64, tol, labels))
    if grads:
        ref = _torch_float64_grads(torch_m, x_seen, mask)
        grad_tol = GRAD_ORACLE[case.dtype]
        for side, got in (("torch", t), ("flax", f)):
            for name, value in ref.items():
                if name.startswith("grad"):
                    result.oracle.append(compare(f"{side} {name} vs float64", got[name], value, grad_tol,
                                                 (side, "float64")))
    return result


def _in_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to ``dtype`` as a NumPy array (bfloat16 from ml_dtypes, which jax brings)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def _torch_float64_grads(torch_m: Any, x: np.ndarray, mask: Any) -> dict[str, np.ndarray]:
    """Gradients of the same module and loss in float64: the reference for gradients."""
    import copy

    import torch

    m64 = copy.deepcopy(torch_m).to(torch.float64)
    return run_torch(m64, [x.astype(np.float64)], mask=mask, grads=True)
