"""Every variant, in each framework on its own, against the float64 loop oracle.

The Flax modules are checked with their own initial weights (not copied from PyTorch),
so a bug shared by a conversion and a module cannot hide here.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention_spec.registry import REGISTRY, variant
from parity_tests import reference
from parity_tests.cases import VARIANTS, make_mask
from parity_tests.tolerances import FLOAT32_ORACLE_RELATIVE
from tests.support import needs_jax, needs_torch, tiered

SHAPES = [(2, 6, 2), (1, 5, 4), (3, 1, 1)]  # (batch, seq, heads)
MASKS = ["none", "random", "fully-masked", "padding"]


def relative_error(got, expected):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(got - expected)) / max(np.max(np.abs(expected)), 1e-30))


def problem(variant_id, batch, seq, heads, mask_kind, seed=0):
    rng = np.random.default_rng(seed)
    spec = VARIANTS[variant_id]
    config = spec.config(heads if spec.multihead else 1)
    x = (rng.standard_normal((batch, seq, 16)) * spec.input_scale).astype(np.float32)
    mask = make_mask(mask_kind, batch, heads if spec.multihead else 1, seq, rng)
    return spec, config, x, mask


def _valid(row):
    """A single-head variant takes the shapes of one head, and the first shape (its heads
    argument is ignored there)."""
    spec = VARIANTS.get(row.get("variant", ""))
    return spec is None or "shape" not in row or spec.multihead or row["shape"][2] == 1 or row["shape"] == SHAPES[0]


# One covering of (variant, shape, mask): every variant with its own initial weights
# (what this file adds), every shape and mask with several variants; the matrix
# (test_matrix.py) runs every pair of variant, batch, length, heads and mask against the
# float64 reference, on converted weights. A second covering, the pairs, then the full
# product, with --exhaustive.
PARAMS = [
    pytest.param(p.values[0], *p.values[1], p.values[2], id=f"{p.values[0]}-b{p.values[1][0]}-T{p.values[1][1]}"
                 f"-h{p.values[1][2]}-{p.values[2]}", marks=p.marks)
    for p in tiered("variant,shape,mask", list(VARIANTS), SHAPES, MASKS, valid=_valid, strength=0)
]


@needs_torch
@pytest.mark.parametrize("variant,batch,seq,heads,mask_kind", PARAMS)
def test_torch_against_oracle(variant, batch, seq, heads, mask_kind):
    import torch

    import torch_attention
    from torch_attention.interop import torch_state_dict

    spec, config, x, mask = problem(variant, batch, seq, heads, mask_kind)
    torch.manual_seed(7)
    module = getattr(torch_attention, spec.cls)(**config).eval()
    t_mask = None if mask is None else torch.from_numpy(mask)
    out, weights = module(torch.from_numpy(x), t_mask, return_weights=True)
    params = torch_state_dict(module)
    out64, weights64 = reference.forward(spec.cls, config, params, x, mask)
    assert relative_error(out.detach().numpy(), out64) <= FLOAT32_ORACLE_RELATIVE
    assert relative_error(weights.detach().numpy(), weights64) <= FLOAT32_ORACLE_RELATIVE
    assert np.isfinite(out.detach().numpy()).all()


@needs_jax
@pytest.mark.parametrize("variant,batch,seq,heads,mask_kind", PARAMS)
def test_flax_against_oracle(variant, batch, seq, heads, mask_kind):
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention
    from jax_attention.interop import torch_state_dict

    spec, config, x, mask = problem(variant, batch, seq, heads, mask_kind)
    module = getattr(jax_attention, spec.cls)(**config, rngs=nnx.Rngs(7))
    module.eval()
    out, weights = module(jnp.asarray(x), None if mask is None else jnp.asarray(mask), return_weights=True)
    params = torch_state_dict(module)
    out64, weights64 = reference.forward(spec.cls, config, params, x, mask)
    assert relative_error(out, out64) <= FLOAT32_ORACLE_RELATIVE
    assert relative_error(weights, weights64) <= FLOAT32_ORACLE_RELATIVE
    assert np.isfinite(np.asarray(out)).all()


def test_oracle_matches_hand_computation():
    """Two keys, one query, by hand: scores [1, 0] * 0.5 -> softmax [e^.5, 1] / (e^.5 + 1)."""
    q = np.array([[1.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0]])
    v = np.array([[2.0], [4.0]])
    out, weights = reference.attention(q, k, v, scale=0.5)
    w0 = np.exp(0.5) / (np.exp(0.5) + 1.0)
    np.testing.assert_allclose(weights, [[w0, 1 - w0]], rtol=1e-15)
    np.testing.assert_allclose(out, [[2 * w0 + 4 * (1 - w0)]], rtol=1e-15)
    out, weights = reference.attention(q, k, v, scale=0.5, mask=np.array([[False, False]]))
    assert (out == 0).all() and (weights == 0).all()  # nothing to attend to


@needs_torch
@pytest.mark.parametrize("name", list(REGISTRY))
def test_oracle_defaults_are_the_registry_s(name):
    """Given only a variant's required constructor arguments, the oracle fills in the same
    defaults (causal, scale, qkv_bias, out_proj, ...) as the registry, hence the modules."""
    import torch

    import torch_attention
    from torch_attention.interop import torch_state_dict

    sizes = {"d_in": 4, "d_out": 4, "head_size": 4, "context_length": 6, "dropout": 0.0, "num_heads": 2,
             "kv_lora_rank": 3, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3}  # latent's
    required = {k: sizes[k] for k in variant(name).required}
    torch.manual_seed(3)
    module = getattr(torch_attention, name)(**required).eval()
    x = np.random.default_rng(3).standard_normal((2, 5, 4)).astype(np.float32) * 0.5
    out = module(torch.from_numpy(x)).detach().numpy()
    out64, _ = reference.forward(name, required, torch_state_dict(module), x)
    assert relative_error(out, out64) <= FLOAT32_ORACLE_RELATIVE
