"""HunYuan's qk-norm after rope, Laguna's softplus gate per head and BitNet's norm of the
merged heads on ``MultiHeadAttention``, both twins.

``qk_norm_position="after_rope"``: the qk-norm (with its weight) runs on the turned q and k,
not on the projections; a weighted norm does not commute with the rotation, so the two
placements differ (checked).  ``output_gate_activation="softplus"`` and
``output_gate_per_head=True``: ``W_query`` has ``head_dim + 1`` rows a head (its queries,
then one gate value), the merged heads times ``softplus(gate)`` (float32 at least).
``out_norm="rms"``: an RMSNorm with a weight (``out_norm``) of the merged heads, after the
gate, before ``out_proj``.

Here: numbers by hand, every path of each twin against the float64 oracle, twin against
twin with gradients, finite differences of the oracle, cached decoding against the whole
sequence, the exporters' refusals by name.  Transformers' layers (HunYuan, BitNet, Laguna)
are in ``tests/interop/test_from_hf_families_more.py``; bad values in the error table.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import ORACLE, PARITY
from tests.support import (assert_input_gradient_matches_finite_differences, assert_paths_and_twin, decode_in_steps,
                           mha_oracle, needs_both, random_x)

PATHS = ("reference", "fused", "blockwise", "auto")
# HunYuan's qk-norm after rope with Laguna's softplus gate per head and BitNet's out_norm, grouped heads
HEADS_GATE: dict[str, Any] = {"num_kv_heads": 2, "qk_norm": "rms", "qk_norm_position": "after_rope",
                              "output_gate": True, "output_gate_activation": "softplus",
                              "output_gate_per_head": True, "out_norm": "rms"}
# a LayerNorm over all heads after rope, a softplus gate per feature (Laguna's "per-element");
# Beam's sigmoid gate with a bias per head and its scalable softmax (here (1 + (p + 1) / 16) ** 0.5)
ALL_FEATURES: dict[str, Any] = {"qk_norm": "layer", "qk_norm_scope": "all", "qk_norm_position": "after_rope",
                                "output_gate": True, "output_gate_activation": "softplus"}
BEAM: dict[str, Any] = {"num_kv_heads": 2, "qk_norm": "rms", "output_gate": True, "output_gate_bias": True,
                        "query_scale": (0.5, 16, 1), "query_scale_kind": "power"}


def _pair(seed: int = 3, **options: Any) -> tuple[Any, Any]:
    """A torch MultiHeadAttention (eval, d_in 16, 4 heads of 4, half of each turning) with
    its norms' weights drawn (a norm of weight 1 commutes with rope), and its Flax twin."""
    import torch

    import torch_attention
    from attention_spec.rope import RopeConfig
    from parity_tests import to_flax

    torch.manual_seed(seed)
    module = torch_attention.MultiHeadAttention(16, 16, None, 0.0, 4, True, **options,
                                                rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.5)).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name == "gate_bias":  # (gate_bias starts at zeros)
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.5 * torch.randn_like(p))
    return module, to_flax(module)


def _positions(batch: int = 2, seq: int = 5) -> np.ndarray:
    return 401 + np.arange(seq)[None] + 7 * np.arange(batch)[:, None]


# --------------------------------------------------------------------------- by hand


@needs_both
def test_a_softplus_gate_per_head_and_the_out_norm_by_hand() -> None:
    """One head of 2: W_query = arange(6).reshape(3, 2), rows [q0, q1, g] (the head's
    queries, then its one gate value), W_key = W_value = I, no out_proj.  One token x =
    [1, 2]: v = [1, 2], gate = 4 + 10 = 14, out = v * softplus(14).  With ``out_norm`` (its
    weight [2, 3]): out / rms(out) * [2, 3] = [1, 2] / sqrt(2.5) * [2, 3] (the gate's scale
    cancels, but for the epsilon)."""
    import jax.numpy as jnp
    import torch

    import torch_attention
    from parity_tests import to_flax

    gated = dict(output_gate=True, output_gate_activation="softplus", output_gate_per_head=True)
    x = np.array([[[1.0, 2.0]]], np.float32)
    for extra, want in (({}, np.array([1.0, 2.0]) * math.log1p(math.exp(14.0))),
                        ({"out_norm": "rms", "qk_norm_eps": 1e-12}, np.array([2.0, 6.0]) / math.sqrt(2.5))):
        m = torch_attention.MultiHeadAttention(2, 2, None, 0.0, 1, False, out_proj=False, **gated, **extra)
        with torch.no_grad():
            m.W_query.weight.copy_(torch.arange(6.0).reshape(3, 2))
            m.W_key.weight.copy_(torch.eye(2))
            m.W_value.weight.copy_(torch.eye(2))
            if extra:
                m.out_norm.weight.copy_(torch.tensor([2.0, 3.0]))
        assert tuple(m.W_query.weight.shape) == (3, 2)
        np.testing.assert_allclose(m(torch.from_numpy(x)).detach().numpy()[0, 0], want, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(to_flax(m)(jnp.asarray(x)))[0, 0], want, rtol=1e-6)


@needs_both
def test_the_qk_norm_after_rope_is_not_the_one_before() -> None:
    """With drawn weights the two placements differ (by far more than rounding), and each
    twin follows the oracle of its own placement."""
    import dataclasses

    import torch

    import torch_attention

    after, after_flax = _pair(qk_norm="rms", qk_norm_position="after_rope")
    before = torch_attention.MultiHeadAttention(**{**after.config, "qk_norm_position": "before_rope"}).eval()
    before.load_state_dict(after.state_dict())
    x, positions = random_x((2, 5, 16), 0), _positions()
    want_after, want_before = mha_oracle(after, x, positions), mha_oracle(before, x, positions)
    assert np.abs(want_after - want_before).max() > 1e-2 * np.abs(want_after).max()
    tol = ORACLE["float32"]
    for module, want in ((after, want_after), (before, want_before)):
        got = module(torch.from_numpy(x), positions=torch.from_numpy(positions)).detach().numpy()
        np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(np.asarray(after_flax(x, positions=positions)), want_after, rtol=tol.rtol, atol=tol.atol)
    assert dataclasses.replace(after.spec, qk_norm_position="before_rope") == before.spec


# --------------------------------------------------------------------------- oracle and twin


@needs_both
@pytest.mark.parametrize(("options", "paths"), [(HEADS_GATE, PATHS), (ALL_FEATURES, ("auto",)), (BEAM, ("auto",))],
                         ids=["heads-gate-outnorm", "all-features", "beam"])
def test_every_path_against_the_oracle_and_the_twin(options: dict[str, Any], paths: tuple[str, ...]) -> None:
    """Each twin's output on every path (the second configuration: ``auto``) against the
    float64 oracle at positions past 400; output and gradients (input and every
    parameter) twin against twin on ``auto``."""
    torch_m, flax_m = _pair(**options)
    x, positions = random_x((2, 5, 16), 0), _positions()
    want = mha_oracle(torch_m, x, positions)
    assert_paths_and_twin(torch_m, flax_m, x, positions, want, paths)


@needs_both
def test_gradients_against_finite_differences_of_the_oracle() -> None:
    """d sum(out * cot) / dx of the torch twin in float64 against central differences of
    the float64 oracle, every mechanism at once."""
    import copy

    torch_m, _ = _pair(**HEADS_GATE)
    m64 = copy.deepcopy(torch_m).double()
    x = random_x((1, 3, 16), 5).astype(np.float64)
    positions = np.arange(401, 404)[None]
    assert_input_gradient_matches_finite_differences(m64, x, lambda m, x: mha_oracle(m, x, positions),
                                                     positions=positions)


@needs_both
def test_cached_decoding_equals_the_whole_sequence() -> None:
    """A prompt of 3 then one token at a time, each twin (Flax: jitted steps), equals the
    whole sequence's forward: the cache holds keys normed after their turn, each step's
    gate is its own."""
    import torch

    torch_m, flax_m = _pair(**HEADS_GATE)
    x = random_x((2, 7, 16), 4)
    whole = torch_m(torch.from_numpy(x)).detach().numpy()
    tol = PARITY["float32"]
    np.testing.assert_allclose(decode_in_steps(torch_m, x, 3, 12), whole, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(decode_in_steps(flax_m, x, 3, 12), whole, rtol=tol.rtol, atol=tol.atol)


@needs_both
def test_the_parameters_and_the_exporters() -> None:
    """``out_norm`` is one (num_heads * head_dim,) weight under one name in both twins
    (PyTorch ``out_norm.weight``, Flax ``("out_norm", "scale")``), moved by the declared map
    both ways (``gate_bias`` too); the native exporters name each option they cannot express."""
    import re

    import torch
    from flax import nnx

    import jax_attention
    import torch_attention
    from jax_attention import interop as jax_interop
    from parity_tests import to_torch
    from torch_attention import interop as torch_interop

    torch_m, flax_m = _pair(**HEADS_GATE)
    assert tuple(torch_m.out_norm.weight.shape) == tuple(flax_m.out_norm.scale.shape) == (16,)
    np.testing.assert_array_equal(np.asarray(flax_m.out_norm.scale[...]), torch_m.out_norm.weight.detach().numpy())
    assert tuple(torch_m.W_query.weight.shape) == (4 * (4 + 1), 16)  # each head's 4 queries, then its gate value
    for options in (HEADS_GATE, BEAM):  # to_torch(to_flax(m)) is m, bit for bit (out_norm, gate_bias included)
        module, twin = _pair(**options)
        back, mine = to_torch(twin).state_dict(), module.state_dict()
        assert sorted(back) == sorted(mine) and all(torch.equal(back[k], mine[k]) for k in mine)
    for option, value, needs in (("qk_norm_position", "after_rope", {"qk_norm": "rms"}),
                                 ("output_gate_activation", "softplus", {"output_gate": True}),
                                 ("out_norm", "rms", {})):
        ours = torch_attention.MultiHeadAttention(8, 8, None, 0.0, 2, True, causal=False, **needs, **{option: value})
        with pytest.raises(ValueError, match=re.escape(f"{option}={value!r}")):
            torch_interop.to_nn_multihead(ours)
        flax_ours = jax_attention.MultiHeadAttention(8, 8, None, 0.0, 2, True, causal=False, rngs=nnx.Rngs(0),
                                                     **needs, **{option: value})
        with pytest.raises(ValueError, match=re.escape(f"{option}={value!r}")):
            jax_interop.to_nnx_multihead(flax_ours)


@needs_both
def test_a_power_query_scale_by_hand_and_the_gate_bias_by_head() -> None:
    """``query_scale=QueryScale(beta, floor, offset)`` with ``query_scale_kind="power"`` multiplies the queries at p by
    ``(1 + (p + offset) / floor) ** beta``: with a zero query and key every score is 0 but
    for a scaled query of ones at p = 15 (offset 1, floor 16, beta 1: a factor 2), checked
    through the scores' softmax; ``gate_bias`` is one (num_heads,) parameter in both twins
    and moves each head's gate (a head's bias of +inf-like 30 opens it, -30 shuts it)."""
    import jax.numpy as jnp
    import torch

    import torch_attention
    from attention_spec.options import QueryScale
    from parity_tests import to_flax

    m = torch_attention.MultiHeadAttention(2, 2, None, 0.0, 1, False, out_proj=False,
                                           query_scale=QueryScale(1.0, 16, 1), query_scale_kind="power").eval()
    with torch.no_grad():
        m.W_query.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))  # q = [x0, 0]
        m.W_key.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))  # k = [x0, 0]
        m.W_value.weight.copy_(torch.eye(2))
    x = np.array([[[0.0, 1.0], [1.0, 0.0]]], np.float32)  # key 0: k = 0, v = [0, 1]; key 1: k = 1, v = [1, 0]
    positions = np.array([[14, 15]])
    score = 2.0 / math.sqrt(2.0)  # query 1 (p = 15): q = 2 * [1, 0], its own key [1, 0], scale 1 / sqrt(2)
    w = 1.0 / (1.0 + math.exp(-score))  # softmax over the scores [0, score]: key 1's weight
    want = np.array([[[0.0, 1.0], [w, 1.0 - w]]])
    np.testing.assert_allclose(m(torch.from_numpy(x), positions=torch.from_numpy(positions)).detach().numpy(), want,
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(to_flax(m)(jnp.asarray(x), positions=jnp.asarray(positions))), want,
                               rtol=1e-6)
    gated = torch_attention.MultiHeadAttention(4, 4, None, 0.0, 2, False, out_proj=False, output_gate=True,
                                               output_gate_bias=True).eval()
    with torch.no_grad():
        gated.gate_bias.copy_(torch.tensor([30.0, -30.0]))
    flax_gated = to_flax(gated)
    assert tuple(gated.gate_bias.shape) == tuple(flax_gated.gate_bias[...].shape) == (2,)
    x = random_x((1, 3, 4), 2)
    for out in (gated(torch.from_numpy(x)).detach().numpy(), np.asarray(flax_gated(jnp.asarray(x)))):
        assert np.abs(out[..., 2:]).max() < 1e-9 < np.abs(out[..., :2]).min()  # head 1 shut, head 0 open
