"""qk-norm of ``MultiHeadAttention``: ``qk_norm="rms"`` / ``"layer"`` normalises the
projected queries and keys (``q_norm``, ``k_norm``) per head (``qk_norm_scope="head"``:
Qwen3, Phi's ``qk_layernorm``) or across heads (``"all"``: OLMo 2), in both twins: the
parameters and the weight map, round trips bit for bit, parity twin against twin and
against the float64 oracle on every path (the norms' gradients included), the matrix
variants, the shared error texts, and ``transformers``' Qwen3, OLMo 2 and Phi attention
with the same weights (positions all zero: the rotation is the identity)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from attention_spec.interop.conversion import flax_shapes, rules_for, torch_shapes
from parity_tests.cases import IMPLEMENTATIONS, Case
from parity_tests.tolerances import ORACLE, PARITY
from tests.support import constructor_errors, needs_both, needs_jax, needs_torch, random_x, tiered

D_IN = 32
BASE = {"d_in": D_IN, "d_out": D_IN, "context_length": 16, "dropout": 0.0, "num_heads": 4}
# name: (extra options, {norm parameter: shape})
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, tuple[int, ...]]]] = {
    # Qwen3: RMSNorm of each head's 8 features, grouped heads
    "rms-head": ({"qk_norm": "rms", "num_kv_heads": 2}, {"q_norm.weight": (8,), "k_norm.weight": (8,)}),
    # OLMo 2: RMSNorm across all heads, k_norm as wide as the (grouped) key projection
    "rms-all": ({"qk_norm": "rms", "qk_norm_scope": "all", "num_kv_heads": 2, "qk_norm_eps": 1e-5},
                {"q_norm.weight": (32,), "k_norm.weight": (16,)}),
    # Phi's qk_layernorm: LayerNorm of each head, with bias, heads of a free width
    "layer-head": ({"qk_norm": "layer", "head_dim": 12, "qkv_bias": True},
                   {"q_norm.weight": (12,), "q_norm.bias": (12,), "k_norm.weight": (12,), "k_norm.bias": (12,)}),
    "layer-all": ({"qk_norm": "layer", "qk_norm_scope": "all"},
                  {"q_norm.weight": (32,), "q_norm.bias": (32,), "k_norm.weight": (32,), "k_norm.bias": (32,)}),
    # Gemma 3: RMSNorm of each head scaled by 1 + weight (the weights start at zeros)
    "rms-offset": ({"qk_norm": "rms", "qk_norm_offset": 1.0, "num_kv_heads": 2},
                   {"q_norm.weight": (8,), "k_norm.weight": (8,)}),
}


def _config(name: str) -> dict[str, Any]:
    return {**BASE, **CONFIGS[name][0]}


def _randomise(module: Any, seed: int) -> None:
    """Random norm weights and biases (they start at ones and zeros), so that the map and
    the gradients are tested on values that tell the parameters apart."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        spec = getattr(module, "spec", None)  # ours, or a Hugging Face layer (scale = weight)
        centre = 1.0 - (spec.qk_norm_offset if spec is not None else 0.0)  # the scales near 1
        for name, p in module.named_parameters():
            if "_norm." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (centre if name.endswith("weight") else 0.0))


def _pair(name: str, seed: int = 0) -> tuple[Any, Any]:
    import torch

    import torch_attention
    from parity_tests import to_flax

    torch.manual_seed(seed)
    module = torch_attention.MultiHeadAttention(**_config(name)).eval()
    _randomise(module, seed)
    return module, to_flax(module)


def _x(shape: tuple[int, ...] = (2, 6, D_IN), seed: int = 0) -> np.ndarray:
    return random_x(shape, seed)


# --------------------------------------------------------------------------- the declaration


@pytest.mark.parametrize("name", CONFIGS)
def test_the_weight_map_declares_the_norms(name: str) -> None:
    rules = rules_for("MultiHeadAttention", _config(name))
    shapes = torch_shapes(rules)
    assert {k: v for k, v in shapes.items() if "_norm." in k} == CONFIGS[name][1]
    flax = {p: s for p, s in flax_shapes(rules).items() if p[0] in ("q_norm", "k_norm")}
    assert flax == {(k.split(".")[0], "scale" if k.endswith("weight") else "bias"): v
                    for k, v in CONFIGS[name][1].items()}


def test_defaults_are_today_s_module() -> None:
    from attention_spec.registry import make_config

    spec = make_config("MultiHeadAttention", BASE)
    assert (spec.qk_norm, spec.qk_norm_scope, spec.qk_norm_eps, spec.qk_norms()) == (None, "head", 1e-6, ())
    assert not any("norm" in k for k in torch_shapes(rules_for("MultiHeadAttention", spec)))
    assert spec.options()["qk_norm"] is None


@needs_both
@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        ({"qk_norm": "gemma"}, ValueError, "qk_norm must be one of None, 'rms', 'layer'; got 'gemma'"),
        ({"qk_norm": True}, ValueError, "qk_norm must be one of None, 'rms', 'layer'; got True"),
        ({"qk_norm": "rms", "qk_norm_scope": "heads"}, ValueError,
         "qk_norm_scope must be one of 'head', 'all'; got 'heads'"),
        ({"qk_norm": "rms", "qk_norm_eps": 0.0}, ValueError, "qk_norm_eps must be a positive finite float; got 0.0"),
        ({"qk_norm_eps": "1e-6"}, ValueError, "qk_norm_eps must be a positive finite float; got '1e-6'"),
        ({"qk_norm": "rms", "qk_norm_offset": float("nan")}, ValueError, "qk_norm_offset must be a finite float; got nan"),
        ({"qk_norm_offset": 1.0}, ValueError, "qk_norm_offset=1.0 needs qk_norm ('rms' or 'layer')"),
    ],
)
def test_both_twins_refuse_bad_options_with_one_text(options: dict[str, Any], error: type, text: str) -> None:
    assert constructor_errors({**BASE, **options}) == [(error, text)] * 3


def test_other_variants_have_no_qk_norm() -> None:
    from attention_spec.registry import AttentionConfig

    with pytest.raises(ValueError, match=re.escape("CausalAttention has no option 'qk_norm'")):
        AttentionConfig("CausalAttention", d_in=4, d_out=4, qk_norm="rms")


# --------------------------------------------------------------------------- both twins


@needs_both
@pytest.mark.parametrize("name", CONFIGS)
def test_twins_have_the_same_parameters_and_round_trips_are_bit_exact(name: str) -> None:
    from flax import nnx

    import jax_attention
    from jax_attention.interop import torch_state_dict as flax_as_torch
    from parity_tests import to_torch
    from torch_attention.interop import torch_state_dict

    torch_m, flax_m = _pair(name, seed=3)
    fresh = jax_attention.MultiHeadAttention(**_config(name), rngs=nnx.Rngs(0))
    assert {k: v.shape for k, v in flax_as_torch(fresh).items()} == \
        {k: tuple(v.shape) for k, v in torch_m.state_dict().items()}
    one = 1.0 - fresh.spec.qk_norm_offset  # the weight that scales by 1
    for k, v in flax_as_torch(fresh).items():  # norms start as PyTorch's: scale 1, bias zeros
        if "_norm." in k:
            assert np.array_equal(v, np.full(v.shape, one if k.endswith("weight") else 0.0, np.float32)), k
    assert torch_m.config == flax_m.config == fresh.config
    original = torch_state_dict(torch_m)
    for arrays in (flax_as_torch(flax_m), torch_state_dict(to_torch(flax_m))):
        assert arrays.keys() == original.keys()
        for key, value in original.items():
            assert arrays[key].dtype == value.dtype and np.array_equal(arrays[key], value), key


@needs_both
# each configuration on two paths, every path on several; the rest with --exhaustive
@pytest.mark.parametrize("name,implementation", tiered("name,implementation", list(CONFIGS), IMPLEMENTATIONS, strength=1))
def test_parity_and_oracle_on_every_path(name: str, implementation: str) -> None:
    """Twin against twin (outputs, input and parameter gradients, the norms' included) and
    each twin against the float64 oracle, with a padding mask, on each path."""
    from parity_tests import check_parity, reference
    from torch_attention.interop import torch_state_dict

    torch_m, flax_m = _pair(name, seed=1)
    x = _x(seed=2)
    mask = np.ones((2, 1, 1, 6), dtype=bool)
    mask[1, ..., 4:] = False  # the second example has 4 tokens
    report = check_parity(torch_m, flax_m, x, mask=mask, implementation=implementation)
    assert report.ok, report
    names = {f.name for f in report.findings}
    assert {"output", "grad input[0]", "grad q_norm.weight", "grad k_norm.weight"} <= names
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(torch_m).items()}
    want, _ = reference.forward("MultiHeadAttention", _config(name), params, x.astype(np.float64), mask)
    without, _ = reference.forward("MultiHeadAttention", BASE | {k: v for k, v in _config(name).items()
                                                                  if not k.startswith("qk_norm")},
                                   {k: v for k, v in params.items() if "_norm." not in k}, x, mask)
    assert not np.allclose(want, without, atol=1e-3)  # the norms change the output
    tol = ORACLE["float32"]
    for got in (report.torch_results["output"], report.flax_results["output"]):
        assert np.allclose(got, want, rtol=tol.rtol, atol=tol.atol)


@needs_both
@pytest.mark.parametrize("name", ["rms-head", "layer-all"])
@pytest.mark.slow  # the quick tier shows this feature in another test
def test_decoding_with_the_cache_equals_the_full_forward(name: str) -> None:
    """Keys are normalised before they enter the cache: a prompt then single steps give
    the full causal forward's outputs, in both twins."""
    import torch

    torch_m, flax_m = _pair(name, seed=13)
    x = _x(seed=14)
    full = torch_m(torch.from_numpy(x)).detach().numpy()
    tol = PARITY["float32"]
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, np.asarray)):
        cache = module.init_cache(2, 6)
        steps = []
        for start, stop in ((0, 3), (3, 4), (4, 6)):
            out, cache = module(wrap(x[:, start:stop]), cache=cache)
            steps.append(np.asarray(out.detach() if isinstance(out, torch.Tensor) else out))
        assert np.allclose(np.concatenate(steps, axis=1), full, rtol=tol.rtol, atol=tol.atol)


@needs_jax
@pytest.mark.parametrize("name", ["rms-all", "layer-head"])
def test_flax_under_jit_equals_eager(name: str) -> None:
    """The options are static under ``nnx.jit``; the norms' scale and bias are traced."""
    from flax import nnx

    import jax_attention

    module = jax_attention.MultiHeadAttention(**_config(name), rngs=nnx.Rngs(5))
    rng = np.random.default_rng(7)
    for norm in (module.q_norm, module.k_norm):
        norm.scale[...] = rng.standard_normal(norm.scale.shape).astype(np.float32)
    x = _x(seed=6)
    eager = np.asarray(module(x))
    jitted = np.asarray(nnx.jit(lambda m, inputs: m(inputs))(module, x))
    tol = PARITY["float32"]
    assert np.allclose(jitted, eager, rtol=tol.rtol, atol=tol.atol)
    module.q_norm.scale[...] = module.q_norm.scale[...] * 2.0  # a traced parameter: the next call sees it
    assert not np.allclose(np.asarray(nnx.jit(lambda m, inputs: m(inputs))(module, x)), eager, atol=1e-4)


@needs_both
# Every path once (the matrix, test_matrix.py, runs both variants on every path in its
# own shapes); both variants on every path with --exhaustive.
@pytest.mark.parametrize("variant,implementation", tiered(
    "variant,implementation", ["mha-qknorm-rms-gqa", "mha-qknorm-layer-all"], IMPLEMENTATIONS, strength=0))
def test_the_matrix_variants_on_every_path(variant: str, implementation: str) -> None:
    from parity_tests.matrix import run_case

    case = Case(variant, 2, 4, 6, "causal+padding", "float32", "pt2fx", implementation)
    result = run_case(case)
    assert result.ok, "\n".join(result.problems + [f.describe() for f in result.findings if not f.ok])
    names = [f.name for f in result.findings]
    assert "grad input[0]" in names and "flax grad input[0] vs float64" in names


# --------------------------------------------------------------------------- transformers' attention


def _against_hf(hf: Any, names: dict[str, str], options: dict[str, Any], rotary: int, seed: int) -> None:
    """``hf`` (a transformers attention, eager) and both twins with its weights (HF name ->
    ours): outputs and the gradients of the input and of the norms' weights, causal,
    every position 0 (cos 1, sin 0: the rotation is the identity)."""
    import torch

    import jax_attention
    import torch_attention
    from jax_attention.interop import load_torch_state_dict
    from parity_tests import check_parity

    _randomise(hf, seed)
    hf.eval()
    ours = torch_attention.MultiHeadAttention(**options).eval()
    ours.load_state_dict({names.get(k.split(".")[0], k.split(".")[0]) + "." + k.split(".")[1]: v
                          for k, v in hf.state_dict().items()})
    from flax import nnx

    flax_m = jax_attention.MultiHeadAttention(**options, rngs=nnx.Rngs(0))
    load_torch_state_dict(flax_m, ours.state_dict())
    x = torch.from_numpy(_x(seed=seed)).requires_grad_(True)
    t = x.shape[1]
    cos, sin = torch.ones(1, t, rotary), torch.zeros(1, t, rotary)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    want = hf(x, position_embeddings=(cos, sin), attention_mask=causal)[0]
    cot = torch.from_numpy(_x(seed=seed + 1))
    (want * cot).sum().backward()
    x_ours = x.detach().clone().requires_grad_(True)
    got = ours(x_ours)
    (got * cot).sum().backward()
    tol = PARITY["float32"]
    assert torch.allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    assert x.grad is not None and x_ours.grad is not None
    assert torch.allclose(x_ours.grad, x.grad, rtol=tol.rtol, atol=tol.atol)
    hf_params = dict(hf.named_parameters())
    for hf_name, ours_name in names.items():
        if ours_name.endswith("_norm"):
            for part in ("weight", "bias"):
                if f"{hf_name}.{part}" in hf_params:
                    mine = dict(ours.named_parameters())[f"{ours_name}.{part}"].grad
                    theirs = hf_params[f"{hf_name}.{part}"].grad
                    assert mine is not None and theirs is not None
                    assert torch.allclose(mine, theirs, rtol=tol.rtol, atol=tol.atol), (ours_name, part)
    report = check_parity(ours, flax_m, x.detach().numpy())
    assert report.ok, report


_QKVO = {"q_proj": "W_query", "k_proj": "W_key", "v_proj": "W_value", "o_proj": "out_proj"}


@needs_torch
@needs_both
@needs_both
def test_gemma_offset_scales_by_one_plus_the_weight_computed_by_hand() -> None:
    """``qk_norm_offset=1.0`` (Gemma 3): each head normalised, then times ``1 + w``.  By
    hand, heads of 4: [3, 4, 0, 0] has RMS 2.5, so [1.2, 1.6, 0, 0]; [1, 1, 1, 1] stays;
    w = [0.5, -0.25, 2, 0] scales by [1.5, 0.75, 3, 1].  Both twins (the quick tier's
    check that the offset is applied: a mutation dropping it passed the quick tier before)."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import jax_attention
    import torch_attention

    options = {"d_in": 8, "d_out": 8, "context_length": 4, "dropout": 0.0, "num_heads": 2, "qk_norm": "rms",
               "qk_norm_offset": 1.0}
    w = np.array([0.5, -0.25, 2.0, 0.0], np.float32)
    t = np.array([[[3, 4, 0, 0, 1, 1, 1, 1]]], np.float32)  # (B, T, heads * head_dim)
    want = np.array([[[1.8, 1.2, 0, 0, 1.5, 0.75, 3, 1]]], np.float32)
    pt = torch_attention.MultiHeadAttention(**options)
    with torch.no_grad():
        pt.q_norm.weight.copy_(torch.from_numpy(w))
        got_torch = pt._normalise_qk("query", torch.from_numpy(t)).numpy()
    fx = jax_attention.MultiHeadAttention(**options, rngs=nnx.Rngs(0))
    fx.q_norm.scale[...] = jnp.asarray(w)
    got_flax = np.asarray(fx._normalise_qk("query", jnp.asarray(t)))
    for got in (got_torch, got_flax):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_qwen3_attention_per_head_rms_norm() -> None:
    import torch
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    config = Qwen3Config(hidden_size=D_IN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         attention_bias=False, attention_dropout=0.0, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    torch.manual_seed(20)
    hf = Qwen3Attention(config, layer_idx=0)
    options = {**BASE, "num_kv_heads": 2, "head_dim": 16, "out_bias": False, "qk_norm": "rms"}
    _against_hf(hf, {**_QKVO, "q_norm": "q_norm", "k_norm": "k_norm"}, options, 16, seed=21)


@needs_torch
@needs_both
def test_olmo2_attention_rms_norm_across_heads() -> None:
    import torch
    from transformers import Olmo2Config
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention

    config = Olmo2Config(hidden_size=D_IN, num_attention_heads=4, num_key_value_heads=2,
                         attention_bias=False, attention_dropout=0.0, rms_norm_eps=1e-5)
    config._attn_implementation = "eager"
    torch.manual_seed(22)
    hf = Olmo2Attention(config, layer_idx=0)
    options = {**BASE, "num_kv_heads": 2, "out_bias": False, "qk_norm": "rms", "qk_norm_scope": "all",
               "qk_norm_eps": 1e-5}
    _against_hf(hf, {**_QKVO, "q_norm": "q_norm", "k_norm": "k_norm"}, options, 8, seed=23)


@needs_torch
@needs_both
def test_phi_attention_qk_layernorm() -> None:
    import torch
    from transformers import PhiConfig
    from transformers.models.phi.modeling_phi import PhiAttention

    config = PhiConfig(hidden_size=D_IN, num_attention_heads=4, num_key_value_heads=4, qk_layernorm=True,
                       attention_dropout=0.0, layer_norm_eps=1e-5)
    config._attn_implementation = "eager"
    torch.manual_seed(24)
    hf = PhiAttention(config, layer_idx=0)
    rotary = int(8 * config.rope_parameters["partial_rotary_factor"])
    options = {**BASE, "qkv_bias": True, "qk_norm": "layer", "qk_norm_eps": 1e-5}
    names = {"q_proj": "W_query", "k_proj": "W_key", "v_proj": "W_value", "dense": "out_proj",
             "q_layernorm": "q_norm", "k_layernorm": "k_norm"}
    _against_hf(hf, names, options, rotary, seed=25)


# --------------------------------------------------------------------------- native modules


@needs_torch
def test_nn_multihead_refuses_qk_norm() -> None:
    import torch_attention
    from torch_attention.interop import to_nn_multihead

    module = torch_attention.MultiHeadAttention(**{**BASE, "causal": False, "qk_norm": "rms"})
    with pytest.raises(ValueError, match=re.escape("qk_norm='rms' (nn.MultiheadAttention cannot express it")):
        to_nn_multihead(module)


@needs_jax
def test_nnx_multihead_refuses_qk_norm_other_than_normalize_qk() -> None:
    """Flax's normalize_qk is a LayerNorm without bias of each head: qk_norm="layer" goes out
    as it (tests/interop/test_probe_exporters.py), an RMSNorm is refused by name."""
    from flax import nnx

    import jax_attention
    from jax_attention.interop import to_nnx_multihead

    module = jax_attention.MultiHeadAttention(**{**BASE, "causal": False, "qk_norm": "rms"}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape("qk_norm='rms' (nnx.MultiHeadAttention's normalize_qk is a "
                                                   "LayerNorm without bias of each head")):
        to_nnx_multihead(module)
