"""An independent oracle for gradients: finite differences, not the code under test.

The matrix compares each twin's gradients with the same computation in float64; that
cannot see a gradient that is wrong in the same way in float64.  Here, at small sizes:

* directional derivatives: for random directions u over every input and parameter, the
  central difference (L(theta + eps u) - L(theta - eps u)) / 2 eps of the float64 NumPy
  loop oracle (``reference.py``, which shares no code with either framework) is compared
  with <grad L, u> from each framework's autograd, where L = sum(out * cotangent).  Every
  variant, with a mask that leaves a row fully masked, on every path it runs; every path
  of both functional cores with q_len != kv_len, causal, masks and ``kv_lengths``.
  float64 (JAX in ``jax.enable_x64``), except the fused paths, which refuse float64 by
  design: they are checked in float32 with a float32 tolerance.
* ``torch.autograd.gradcheck`` (numerical Jacobian against the analytic one, float64) on
  PyTorch's functional core on every path that runs in float64, and on the modules.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from parity_tests.cases import IMPLEMENTATIONS, VARIANTS, make_mask
from tests.support import needs_both, tiered

pytestmark = needs_both

EPS = 1e-6
# |<grad, u> - finite difference| <= RTOL * (sum |grad_i u_i| + |finite difference|):
# float64 autograd against float64 differences (their own error is ~1e-10 here), and
# float32 autograd (the fused paths) against the same float64 differences.
RTOL = {"float64": 1e-9, "float32": 1e-6}  # measured 5.0e-11 and 8.4e-8
SEQ, BATCH = 4, 2


def _dtype_for(path: str) -> str:
    return "float32" if path == "fused" else "float64"


def _within(ad: float, fd: float, magnitude: float, dtype: str) -> tuple[bool, float]:
    error = abs(ad - fd) / max(magnitude + abs(fd), 1e-300)
    return error <= RTOL[dtype], error


# --------------------------------------------------------------------------- modules


# Each variant on one path, every path on about a quarter of the variants (every variant's
# gradients on every path against the float64 reference: the matrix, test_matrix.py);
# every variant on every path with --exhaustive.
MODULE_CASES = tiered("variant_id,implementation", list(VARIANTS), IMPLEMENTATIONS, strength=0,
                      valid=lambda row: "implementation" not in row or "variant_id" not in row
                      or VARIANTS[row["variant_id"]].runs_on(row["implementation"]))


@pytest.mark.parametrize(("variant_id", "implementation"), MODULE_CASES)
def test_module_gradients_match_finite_differences_of_the_oracle(variant_id: str, implementation: str) -> None:
    import jax
    import torch

    import torch_attention
    from parity_tests import assert_parity, reference, to_flax
    from torch_attention.interop import torch_state_dict

    spec = VARIANTS[variant_id]
    heads = 2 if spec.multihead else 1
    config = spec.config(heads)
    dtype = _dtype_for(implementation)
    rng = np.random.default_rng(17)
    x = spec.make_inputs(rng, (BATCH, SEQ)).astype(dtype)
    mask = make_mask("fully-masked", BATCH, heads, SEQ, rng)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        pt = getattr(torch_attention, spec.cls)(**config).to(getattr(torch, dtype)).eval()
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(pt).items()}
    out, _ = reference.forward(spec.cls, config, params, x, mask)
    cot = rng.uniform(0.5, 1.5, out.shape).astype(np.float32)  # exact in every dtype used
    with jax.enable_x64(dtype == "float64"):
        report = assert_parity(pt, to_flax(pt), x, mask=mask, implementation=implementation, cotangent=cot)

    def loss(t: float, u_x: np.ndarray, u_p: dict[str, np.ndarray]) -> float:
        moved = {k: v + t * u_p[k] for k, v in params.items()}
        o, _ = reference.forward(spec.cls, config, moved, x.astype(np.float64) + t * u_x, mask)
        return math.fsum((o * cot).ravel())

    for _ in range(2):  # two random directions over x and every parameter
        u_x = rng.standard_normal(x.shape)
        u_p = {k: rng.standard_normal(v.shape) for k, v in params.items()}
        fd = (loss(EPS, u_x, u_p) - loss(-EPS, u_x, u_p)) / (2 * EPS)
        for side, got in (("torch", report.torch_results), ("flax", report.flax_results)):
            terms = [got["grad input[0]"] * u_x] + [got[f"grad {k}"] * u for k, u in u_p.items()]
            ad = math.fsum(float(t.sum()) for t in terms)
            magnitude = math.fsum(float(np.abs(t).sum()) for t in terms)
            ok, error = _within(ad, fd, magnitude, dtype)
            assert ok, f"{side} {implementation} {dtype}: <grad, u> = {ad!r}, finite difference {fd!r} " \
                       f"(relative error {error:.2e})"


@pytest.mark.parametrize("variant_id", ["sa2", "mha"])
@pytest.mark.parametrize("implementation", ["reference", "blockwise", "auto"])
def test_torch_module_gradcheck(variant_id: str, implementation: str) -> None:
    """gradcheck w.r.t. the input of a float64 module, with a mask that leaves rows
    fully masked (gradients there are zero, not NaN)."""
    import torch

    import torch_attention

    spec = VARIANTS[variant_id]
    heads = 2 if spec.multihead else 1
    config = {**spec.config(heads), "d_in": 16}
    rng = np.random.default_rng(23)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        module = getattr(torch_attention, spec.cls)(**config).to(torch.float64).eval()
    x = torch.tensor(rng.standard_normal((BATCH, 3, 16)), requires_grad=True)
    mask = torch.tensor(make_mask("fully-masked", BATCH, heads, 3, rng))
    assert torch.autograd.gradcheck(
        lambda x: module(x, mask, implementation=implementation), (x,), eps=1e-6, atol=1e-8, rtol=1e-6
    )


# --------------------------------------------------------------------------- functional cores

# (q_len, kv_len, causal, mask kind, kv_lengths): causal alignment with fewer and with
# more queries than keys, masks with a fully masked row, an example without any key.
FN_SETTINGS = {
    "T3-S5-causal-random-lengths": (3, 5, True, "random", [5, 2]),
    "T5-S3-causal-fully-masked": (5, 3, True, "fully-masked", None),
    "T4-S6-padding-empty": (4, 6, False, "padding", [4, 0]),
}


def _fn_inputs(name: str) -> tuple[Any, ...]:
    q_len, kv_len, causal, kind, lengths = FN_SETTINGS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q = rng.standard_normal((BATCH, 1, q_len, 3))
    k = rng.standard_normal((BATCH, 1, kv_len, 3))
    v = rng.standard_normal((BATCH, 1, kv_len, 3))
    mask = make_mask(kind, BATCH, 1, q_len, rng, kv_len=kv_len)
    return q, k, v, mask, causal, None if lengths is None else np.array(lengths)


def _oracle_mask(mask: Any, lengths: Any, shape: tuple[int, ...]) -> np.ndarray:
    full = np.ones(shape, dtype=bool) if mask is None else np.broadcast_to(mask, shape).copy()
    if lengths is not None:
        full &= (np.arange(shape[-1])[None, :] < lengths[:, None])[:, None, None, :]
    return full


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("setting", list(FN_SETTINGS))
def test_functional_gradients_match_finite_differences_of_the_oracle(setting: str, implementation: str) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf
    from parity_tests import reference
    from parity_tests.harness import full_precision

    q, k, v, mask, causal, lengths = _fn_inputs(setting)
    dtype = _dtype_for(implementation)
    q, k, v = (a.astype(dtype).astype(np.float64) for a in (q, k, v))  # what the frameworks see
    scale = 1.0 / math.sqrt(q.shape[-1])
    oracle_mask = _oracle_mask(mask, lengths, (*q.shape[:-1], k.shape[-2]))
    rng = np.random.default_rng(29)
    cot = rng.uniform(0.5, 1.5, (*q.shape[:-1], v.shape[-1])).astype(np.float32).astype(np.float64)

    with full_precision():
        qt, kt, vt = (torch.tensor(a, dtype=getattr(torch, dtype), requires_grad=True) for a in (q, k, v))
        out = tf.dot_product_attention(
            qt, kt, vt, mask=None if mask is None else torch.tensor(mask), causal=causal,
            kv_lengths=None if lengths is None else torch.tensor(lengths), implementation=implementation)
        (out.double() * torch.tensor(cot)).sum().backward()
        torch_grads = [t.grad.double().numpy() for t in (qt, kt, vt)]
        with jax.enable_x64(dtype == "float64"):
            jdt = getattr(jnp, dtype)

            def loss(q: Any, k: Any, v: Any) -> Any:
                o = jf.dot_product_attention(
                    q, k, v, mask=None if mask is None else jnp.asarray(mask), causal=causal,
                    kv_lengths=None if lengths is None else jnp.asarray(lengths, jnp.int32),
                    implementation=implementation)
                return jnp.sum(o.astype(jdt) * jnp.asarray(cot, jdt))

            gradient = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            jax_grads = [np.asarray(g, np.float64) for g in gradient(*(jnp.asarray(a, jdt) for a in (q, k, v)))]

    def oracle_loss(t: float, us: list[np.ndarray]) -> float:
        o, _ = reference.attention(q + t * us[0], k + t * us[1], v + t * us[2], scale=scale,
                                   mask=oracle_mask, causal=causal)
        return math.fsum((o * cot).ravel())

    for _ in range(3):
        us = [rng.standard_normal(a.shape) for a in (q, k, v)]
        fd = (oracle_loss(EPS, us) - oracle_loss(-EPS, us)) / (2 * EPS)
        for side, grads in (("torch", torch_grads), ("jax", jax_grads)):
            ad = math.fsum(float((g * u).sum()) for g, u in zip(grads, us, strict=True))
            magnitude = math.fsum(float(np.abs(g * u).sum()) for g, u in zip(grads, us, strict=True))
            ok, error = _within(ad, fd, magnitude, dtype)
            assert ok, f"{side} {implementation} {dtype}: <grad, u> = {ad!r}, finite difference {fd!r} " \
                       f"(relative error {error:.2e})"


@pytest.mark.parametrize("implementation", ["reference", "blockwise", "auto"])
@pytest.mark.parametrize("setting", list(FN_SETTINGS))
def test_torch_functional_gradcheck(setting: str, implementation: str) -> None:
    import torch

    import torch_attention.functional as tf

    q, k, v, mask, causal, lengths = _fn_inputs(setting)
    inputs = tuple(torch.tensor(a, requires_grad=True) for a in (q, k, v))

    def attend(q: Any, k: Any, v: Any) -> Any:
        return tf.dot_product_attention(
            q, k, v, mask=None if mask is None else torch.tensor(mask), causal=causal,
            kv_lengths=None if lengths is None else torch.tensor(lengths), implementation=implementation)

    assert torch.autograd.gradcheck(attend, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_the_fused_paths_refuse_float64_so_they_are_checked_in_float32() -> None:
    """Why the fused cases above run in float32 (DESIGN: float64 never goes through a
    kernel that computes in float32)."""
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    q = np.random.default_rng(0).standard_normal((1, 1, 3, 4))
    with pytest.raises(ValueError, match=r"implementation='fused' cannot honour float64"):
        tf.dot_product_attention(*(torch.tensor(q),) * 3, implementation="fused")
    with jax.enable_x64(True), pytest.raises(ValueError, match=r"implementation='fused' cannot honour float64"):
        jf.dot_product_attention(*(jnp.asarray(q),) * 3, implementation="fused")
