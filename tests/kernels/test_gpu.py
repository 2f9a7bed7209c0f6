"""On an NVIDIA GPU: both functional cores on every path (``reference``, ``fused``,
``blockwise``, ``auto``) in float32, bfloat16 and float16, forward and gradients w.r.t.
q, k, v (and the bias), against PyTorch's reference path in float64 on the CPU (itself
checked against the float64 loop oracle and central differences elsewhere).

The settings are the ones GPU kernels treat specially: cuDNN / FlashAttention head
widths (64, 80, 128, 256, and 36 and 264, which cuDNN refuses), causal with q_len != kv_len (top-left aligned), padding given
as lengths (cuDNN's sequence lengths in JAX), dense masks with a fully masked row, an
additive bias, a value width other than the key width, and lengths that are not
multiples of the kernels' tiles; and the options added since the first GPU run: grouped
key/value heads, attention sinks (gradient included; ``fused`` refuses them by name on a
GPU, as cuDNN and SDPA have no sink, so that path is left out of the sinks setting) and
``layout="bshd"`` (tokens before heads, as cuDNN takes them).

Skipped where no CUDA device is visible to the framework under test (CI has none);
``bash benchmarks/gpu_session.sh check`` runs it on a lent GPU.  ``python -m
tests.kernels.test_gpu`` prints every case's error as a fraction of its tolerance.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np
import pytest

from parity_tests.tolerances import GRAD_ORACLE, ORACLE
from tests.support import HAS_JAX, HAS_TORCH


def _torch_cuda() -> bool:
    if not HAS_TORCH:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _jax_gpu() -> bool:
    if not HAS_JAX:
        return False
    import jax

    return jax.default_backend() == "gpu"


class GpuCase(NamedTuple):
    framework: str  # "torch" or "jax"
    implementation: str
    dtype: str
    head_dim: int
    setting: str

    @property
    def id(self) -> str:
        return f"{self.framework}-{self.implementation}-{self.dtype}-d{self.head_dim}-{self.setting}"


# setting -> (q_len, kv_len, causal, what else)
SETTINGS: dict[str, tuple[int, int, bool, str]] = {
    "plain": (256, 256, False, ""),
    "causal": (256, 256, True, ""),
    "causal-cross": (100, 160, True, ""),
    "odd-causal": (77, 77, True, ""),
    "lengths": (192, 192, False, "lengths"),
    "lengths-causal": (192, 192, True, "lengths"),
    "mask": (128, 144, False, "mask"),
    "bias": (128, 128, False, "bias"),
    "bias-causal-mask": (128, 128, True, "bias+mask"),
    "value-width": (128, 128, True, "dv"),
    "gqa": (128, 128, True, "gqa"),
    "sinks": (128, 128, True, "sinks"),
    "bshd": (192, 192, True, "bshd+lengths"),
}
# The (path, setting) pairs left out: no GPU kernel has a sink (refused by name).
REFUSED = {("fused", "sinks")}
PATHS = ("reference", "fused", "blockwise", "auto")
DTYPES = ("float32", "bfloat16", "float16")


def gpu_cases() -> list[GpuCase]:
    cases = []
    for fw, path, dtype, setting in itertools.product(("torch", "jax"), PATHS, DTYPES, SETTINGS):
        if (path, setting) in REFUSED:
            continue
        widths = (64, 128) if path in ("fused", "auto") else (64,)
        cases += [GpuCase(fw, path, dtype, d, setting) for d in widths]
    for fw, dtype, d, setting in itertools.product(("torch", "jax"), DTYPES, (36, 80, 256, 264), ("causal", "lengths", "odd-causal")):
        cases.append(GpuCase(fw, "fused", dtype, d, setting))
    return cases


CASES = gpu_cases()
BATCH, HEADS = 2, 4


def case_inputs(case: GpuCase, seed: int = 0) -> dict[str, Any]:
    """float32 NumPy inputs already rounded to the case's dtype (so the float64 reference
    sees the numbers the GPU sees), and the options."""
    import ml_dtypes

    q_len, kv_len, causal, extra = SETTINGS[case.setting]
    rng = np.random.default_rng(seed)
    dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[case.dtype]

    def rounded(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(dt).astype(np.float32)

    dv = case.head_dim // 2 if extra == "dv" else case.head_dim
    kv_heads = HEADS // 2 if extra == "gqa" else HEADS
    out: dict[str, Any] = {
        "q": rounded(BATCH, HEADS, q_len, case.head_dim, scale=1.5),
        "k": rounded(BATCH, kv_heads, kv_len, case.head_dim, scale=1.5),
        "v": rounded(BATCH, kv_heads, kv_len, dv),
        "causal": causal,
        "mask": None,
        "kv_lengths": None,
        "bias": None,
        "sinks": rounded(HEADS, scale=2.0) if extra == "sinks" else None,
        "layout": "bshd" if "bshd" in extra else "bhsd",
        "cotangent": rng.uniform(0.5, 1.5, (BATCH, HEADS, q_len, dv)).astype(np.float32),
    }
    if "lengths" in extra:
        out["kv_lengths"] = np.array([kv_len, 37], dtype=np.int32)
    if "mask" in extra:
        mask = rng.random((BATCH, HEADS, q_len, kv_len)) < 0.7
        mask[:, :, 5] = False  # one query row per (b, h) that sees nothing
        out["mask"] = mask
    if "bias" in extra:
        out["bias"] = rounded(1, HEADS, q_len, kv_len)
    return out


def _leaf_names(inputs: dict[str, Any]) -> list[str]:
    """The differentiated inputs, in the order of the gradients returned."""
    return ["q", "k", "v"] + [n for n in ("bias", "sinks") if inputs[n] is not None]


def _to_layout(name: str, array: Any, layout: str) -> Any:
    """q, k, v (B, H, S, D) as the call's layout takes them ((B, S, H, D) for "bshd")."""
    return array.swapaxes(1, 2) if layout == "bshd" and name in ("q", "k", "v") else array


def _reference(inputs: dict[str, Any]) -> tuple[np.ndarray, list[np.ndarray]]:
    """PyTorch's reference path in float64 on the CPU: output and gradients of
    sum(out * cotangent) w.r.t. q, k, v (and bias)."""
    import torch

    from torch_attention.functional import dot_product_attention

    names = _leaf_names(inputs)
    leaves = {n: torch.tensor(inputs[n], dtype=torch.float64, requires_grad=True) for n in names}
    out = dot_product_attention(
        leaves["q"], leaves["k"], leaves["v"], causal=inputs["causal"], implementation="reference",
        mask=None if inputs["mask"] is None else torch.from_numpy(inputs["mask"]),
        kv_lengths=inputs["kv_lengths"], bias=leaves.get("bias"), sinks=leaves.get("sinks"),
    )
    assert isinstance(out, torch.Tensor)
    (out * torch.from_numpy(inputs["cotangent"]).double()).sum().backward()
    return out.detach().numpy(), [leaves[n].grad.numpy() for n in names]  # type: ignore[union-attr]


def _torch_run(case: GpuCase, inputs: dict[str, Any], device: str = "cuda") -> tuple[np.ndarray, list[np.ndarray]]:
    import torch

    from torch_attention.functional import dot_product_attention

    dtype, layout = getattr(torch, case.dtype), inputs["layout"]
    names = _leaf_names(inputs)
    leaves = {n: torch.tensor(_to_layout(n, inputs[n], layout).copy(), dtype=dtype, device=device,
                              requires_grad=True) for n in names}
    out = dot_product_attention(
        leaves["q"], leaves["k"], leaves["v"], causal=inputs["causal"], implementation=case.implementation,
        mask=None if inputs["mask"] is None else torch.from_numpy(inputs["mask"]).to(device),
        kv_lengths=inputs["kv_lengths"], bias=leaves.get("bias"), sinks=leaves.get("sinks"), layout=layout,
    )
    assert isinstance(out, torch.Tensor) and out.device.type == device and out.dtype == dtype
    cotangent = torch.from_numpy(_to_layout("q", inputs["cotangent"], layout).copy()).to(device)
    (out.float() * cotangent).sum().backward()
    grads = [_to_layout(n, leaves[n].grad.float().cpu().numpy(), layout) for n in names]  # type: ignore[union-attr]
    return _to_layout("q", out.detach().float().cpu().numpy(), layout), grads


def _jax_run(case: GpuCase, inputs: dict[str, Any], platform: str = "gpu") -> tuple[np.ndarray, list[np.ndarray]]:
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    dtype, layout = getattr(jnp, case.dtype), inputs["layout"]
    names = _leaf_names(inputs)
    leaves = {n: jnp.asarray(_to_layout(n, inputs[n], layout), dtype=dtype) for n in names}
    mask = None if inputs["mask"] is None else jnp.asarray(inputs["mask"])
    cot = jnp.asarray(_to_layout("q", inputs["cotangent"], layout))

    @jax.jit
    def run(leaves: dict[str, Any]) -> Any:
        out = dot_product_attention(
            leaves["q"], leaves["k"], leaves["v"], causal=inputs["causal"], mask=mask,
            kv_lengths=inputs["kv_lengths"], bias=leaves.get("bias"), sinks=leaves.get("sinks"), layout=layout,
            implementation=case.implementation,
        )
        return out

    out, vjp = jax.vjp(run, leaves)
    assert out.dtype == dtype and next(iter(out.devices())).platform == platform
    (grads,) = vjp(cot.astype(dtype))
    return (_to_layout("q", np.asarray(out.astype(jnp.float32)), layout),
            [_to_layout(n, np.asarray(grads[n].astype(jnp.float32)), layout) for n in names])


def gpu_errors(case: GpuCase, seed: int = 0) -> dict[str, float]:
    """Each compared quantity's error as a fraction of its tolerance (<= 1 passes):
    ``out`` elementwise (ORACLE), each gradient normwise (GRAD_ORACLE)."""
    inputs = case_inputs(case, seed)
    ref_out, ref_grads = _reference(inputs)
    out, grads = (_torch_run if case.framework == "torch" else _jax_run)(case, inputs)
    errors = {}
    tol = ORACLE[case.dtype]
    assert np.all(np.isfinite(out)), "non-finite output"
    errors["out"] = float(np.max(np.abs(out - ref_out) / (tol.atol + tol.rtol * np.abs(ref_out))))
    gtol = GRAD_ORACLE[case.dtype]
    for name, g, r in zip(_leaf_names(inputs), grads, ref_grads, strict=True):
        # The cotangent is float32 in the reference, but the frameworks see it in the
        # input dtype under JAX; the difference is one rounding, well inside gtol.
        assert np.all(np.isfinite(g)), f"non-finite gradient w.r.t. {name}"
        scale = float(np.max(np.abs(r))) or 1.0
        errors[f"grad_{name}"] = float(np.max(np.abs(g - r)) / (gtol.atol + gtol.rtol * scale))
    return errors


def _params() -> list[Any]:
    """The cases of each framework that sees a GPU; one skipped entry for each that does not."""
    params = []
    for fw, available, name in (("torch", _torch_cuda(), "PyTorch"), ("jax", _jax_gpu(), "JAX")):
        if available:
            params += [pytest.param(c, id=c.id) for c in CASES if c.framework == fw]
        else:
            params.append(pytest.param(None, id=f"{fw}-no-gpu",
                                       marks=pytest.mark.skip(reason=f"no CUDA device visible to {name}")))
    return params


@pytest.mark.parametrize("case", _params())
def test_gpu_case(case: GpuCase, record_property: Any) -> None:
    errors = gpu_errors(case)
    for name, value in errors.items():
        record_property(name, f"{value:.4g}")
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= 1.0, f"{worst}: {errors[worst]:.3g} x its tolerance ({errors})"


def test_gpu_cases_cover_every_path_and_dtype() -> None:
    """The table itself (runs everywhere): every path, dtype and setting, both frameworks."""
    seen = {(c.framework, c.implementation, c.dtype, c.setting) for c in CASES}
    for key in itertools.product(("torch", "jax"), PATHS, DTYPES, SETTINGS):
        assert (key[1], key[3]) in REFUSED or key in seen, key
    assert len({c.id for c in CASES}) == len(CASES)


if __name__ == "__main__":  # one line per case as it finishes: errors / tolerance
    import sys
    import time

    # arguments: words that a case's id must all contain, and "shard=I/N" for every Nth case
    words = [a for a in sys.argv[1:] if not a.startswith("shard=")]
    shard = next((a[6:] for a in sys.argv[1:] if a.startswith("shard=")), "0/1")
    index, count = (int(n) for n in shard.split("/"))
    failed = 0
    chosen = [c for c in CASES if all(w in c.id for w in words)]
    for c in chosen[index::count]:
        if (c.framework == "torch" and not _torch_cuda()) or (c.framework == "jax" and not _jax_gpu()):
            continue
        start = time.perf_counter()
        try:
            e = gpu_errors(c)
            worst, detail = max(e.values()), " ".join(f"{k}={v:.3f}" for k, v in e.items())
        except Exception as exc:  # noqa: BLE001 - a report, not a test
            worst, detail = float("inf"), f"{type(exc).__name__}: {str(exc)[:300]}"
        failed += worst > 1
        flag = "FAIL" if worst > 1 else "ok"
        print(f"{flag:4s} {worst:8.3f} {time.perf_counter() - start:5.1f}s {c.id:44s} {detail}", flush=True)
    print(f"{failed} over tolerance", flush=True)
