"""float64 parity: both twins in float64 agree with each other and with the loop oracle
to 1e-12, forward and gradients.  Runs in every session: JAX's 64-bit mode is switched on
for these tests only (``jax.enable_x64``); the ``x64`` nox session runs the whole suite
with ``JAX_ENABLE_X64=1``."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.cases import VARIANTS, make_mask
from parity_tests.conftest import needs_both

pytestmark = needs_both


@pytest.mark.parametrize("variant_id", list(VARIANTS))
@pytest.mark.parametrize("masked", [False, True])
def test_float64_parity_and_oracle(variant_id, masked):
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
    x = rng.standard_normal((2, 6, 16)) * spec.input_scale  # float64
    mask = make_mask("fully-masked", 2, heads, 6, rng) if masked else None
    torch.manual_seed(0)
    pt = getattr(torch_attention, spec.cls)(**config).to(torch.float64).eval()
    with jax.enable_x64(True):
        fx = to_flax(pt)
        report = assert_parity(pt, fx, x, mask=mask)
    assert report.torch_results["output"].dtype == np.float64
    assert report.flax_results["output"].dtype == np.float64
    out64, weights64 = reference.forward(spec.cls, config, torch_state_dict(pt), x, mask)
    tol = ORACLE["float64"]
    for side in (report.torch_results, report.flax_results):
        np.testing.assert_allclose(side["output"], out64, rtol=tol.rtol, atol=tol.atol)
        np.testing.assert_allclose(side["attention weights"], weights64, rtol=tol.rtol, atol=tol.atol)
