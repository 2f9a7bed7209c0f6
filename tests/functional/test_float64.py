"""float64 parity: both twins in float64 agree with each other and with the loop oracle
to 1e-12, forward and gradients, on every path.  Runs in every session: JAX's 64-bit mode
is switched on for these tests only (``jax.enable_x64``); the ``x64`` nox session runs the
whole suite with ``JAX_ENABLE_X64=1``.

The reference path is compared with its attention weights; the other paths have none, so
there the outputs (and gradients) are compared.  float64 must never go through a kernel
that computes in float32: an explicit ``fused`` either keeps float64 accuracy or refuses,
naming float64 (DESIGN, "Precision").
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.cases import VARIANTS, make_mask
from tests.support import needs_both

pytestmark = needs_both

# Every variant once with a mask, on the paths that compute in float64 in turn (the
# reference path, which compares the weights too, the blockwise path, auto): what
# float64 proves is per variant (its module code keeps float64) and per path (its code
# keeps it); the fused path, which refuses float64 or keeps it, on the first variant
# that runs there; without a mask on the reference path every third variant. The
# matrix compares every variant's weights on the reference path in the other dtypes.
# The rest with --exhaustive.
PATHS = ("reference", "blockwise", "fused", "auto")
ROTATION = ("reference", "blockwise", "auto")
FIRST_ON_FUSED = next(v for v in VARIANTS if VARIANTS[v].runs_on("fused"))


def _tier(i: int, variant: str, impl: str, masked: bool) -> tuple[pytest.MarkDecorator, ...]:
    runnable = [p for p in ROTATION if VARIANTS[variant].runs_on(p)]
    if impl == "reference" and not masked and i % 3 == 0:
        return ()
    if masked and (impl == runnable[i % len(runnable)] or (impl == "fused" and variant == FIRST_ON_FUSED)):
        return ()
    return (pytest.mark.slow, pytest.mark.exhaustive)


PARAMS = [
    pytest.param(v, masked, impl, id=f"{v}-{'mask' if masked else 'nomask'}-{impl}", marks=_tier(i, v, impl, masked))
    for i, v in enumerate(VARIANTS)
    for impl in PATHS
    for masked in ((False, True) if impl == "reference" else (True,))
    if VARIANTS[v].runs_on(impl)
]


@pytest.mark.parametrize(("variant_id", "masked", "implementation"), PARAMS)
def test_float64_parity_and_oracle(variant_id, masked, implementation):
    import jax
    import torch

    import torch_attention
    from parity_tests import assert_parity, reference, to_flax
    from parity_tests.tolerances import ORACLE
    from torch_attention.interop import torch_state_dict

    spec = VARIANTS[variant_id]
    heads = 2 if spec.multihead else 1
    config = spec.config(heads)
    rng = np.random.default_rng(5)
    x = spec.make_inputs(rng, (2, 6))  # float64
    mask = make_mask("fully-masked", 2, heads, 6, rng) if masked else None
    torch.manual_seed(0)
    pt = getattr(torch_attention, spec.cls)(**config).to(torch.float64).eval()
    weights = implementation == "reference"
    with jax.enable_x64(True):
        fx = to_flax(pt)
        try:
            report = assert_parity(pt, fx, x, mask=mask, implementation=implementation, weights=weights)
        except ValueError as err:
            # the one refusal allowed here: a fused kernel that would compute in float32
            assert implementation == "fused" and "float64" in str(err), err
            return
    assert report.torch_results["output"].dtype == np.float64
    assert report.flax_results["output"].dtype == np.float64
    out64, weights64 = reference.forward(spec.cls, config, torch_state_dict(pt), x, mask)
    tol = ORACLE["float64"]
    for side in (report.torch_results, report.flax_results):
        np.testing.assert_allclose(side["output"], out64, rtol=tol.rtol, atol=tol.atol)
        if weights:
            np.testing.assert_allclose(side["attention weights"], weights64, rtol=tol.rtol, atol=tol.atol)
