"""Free widths of ``MultiHeadAttention``: ``head_dim=`` (heads need not split ``d_out``),
``out_features=`` (the width ``out_proj`` maps to) and ``out_bias=`` (``out_proj``
without bias), in both twins: parameters and shapes, the KV cache, the weight map's round
trips, parity twin against twin and against the float64 oracle on every path (gradients
included), the shared error texts, and Llama's attention from ``transformers`` with the
same weights (positions all zero: the rotation is the identity)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from attention_spec.interop.conversion import rules_for, torch_shapes
from parity_tests.cases import IMPLEMENTATIONS, Case
from parity_tests.tolerances import ORACLE, PARITY
from tests.support import constructor_errors, needs_both, needs_jax, needs_torch, random_x, tiered

D_IN = 40
BASE = {"d_in": D_IN, "d_out": D_IN, "context_length": 16, "dropout": 0.0, "num_heads": 4}
# name: (extra options, {parameter: shape}, output width)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, tuple[int, ...]], int]] = {
    # Gemma: heads x head_dim (4 x 16 = 64) != hidden (40); out_proj 64 -> 40
    "gemma-like": (
        {"head_dim": 16, "qkv_bias": True},
        {"W_query.weight": (64, 40), "W_query.bias": (64,), "W_key.weight": (64, 40), "W_key.bias": (64,),
         "W_value.weight": (64, 40), "W_value.bias": (64,), "out_proj.weight": (40, 64), "out_proj.bias": (40,)},
        40,
    ),
    # Llama with grouped heads and head_dim given: no bias anywhere
    "llama-like": (
        {"head_dim": 16, "num_kv_heads": 2, "out_bias": False},
        {"W_query.weight": (64, 40), "W_key.weight": (32, 40), "W_value.weight": (32, 40),
         "out_proj.weight": (40, 64)},
        40,
    ),
    # head_dim left to d_out // num_heads, out_proj to a width of its own
    "out-features": (
        {"out_features": 24, "qkv_bias": True, "out_bias": False},
        {"W_query.weight": (40, 40), "W_query.bias": (40,), "W_key.weight": (40, 40), "W_key.bias": (40,),
         "W_value.weight": (40, 40), "W_value.bias": (40,), "out_proj.weight": (24, 40)},
        24,
    ),
    # every option at once: d_out = 30 is no multiple of 4 heads
    "all": (
        {"d_out": 30, "head_dim": 8, "num_kv_heads": 1, "out_features": 12, "out_bias": False},
        {"W_query.weight": (32, 40), "W_key.weight": (8, 40), "W_value.weight": (8, 40),
         "out_proj.weight": (12, 32)},
        12,
    ),
}


def _config(name: str) -> dict[str, Any]:
    return {**BASE, **CONFIGS[name][0]}


def _pair(name: str, seed: int = 0) -> tuple[Any, Any]:
    import torch

    import torch_attention
    from parity_tests import to_flax

    torch.manual_seed(seed)
    module = torch_attention.MultiHeadAttention(**_config(name)).eval()
    return module, to_flax(module)


def _x(shape: tuple[int, ...] = (2, 6, D_IN), seed: int = 0) -> np.ndarray:
    return random_x(shape, seed)


# --------------------------------------------------------------------------- the declaration


@pytest.mark.parametrize("name", CONFIGS)
def test_the_weight_map_declares_the_widths(name: str) -> None:
    rules = rules_for("MultiHeadAttention", _config(name))
    assert torch_shapes(rules) == CONFIGS[name][1]


def test_defaults_are_today_s_module() -> None:
    from attention_spec.registry import make_config

    spec = make_config("MultiHeadAttention", {**BASE, "d_out": 8, "num_heads": 2})
    assert (spec.head_dim, spec.width, spec.fan_out("out"), spec.out_bias) == (4, 8, 8, True)
    assert spec.options()["head_dim"] is None and spec.options()["out_features"] is None
    assert torch_shapes(rules_for("MultiHeadAttention", spec))["out_proj.bias"] == (8,)
    # head_dim given equal to d_out // num_heads: the same module
    same = make_config("MultiHeadAttention", {**BASE, "d_out": 8, "num_heads": 2, "head_dim": 4})
    assert rules_for("MultiHeadAttention", same) == rules_for("MultiHeadAttention", spec)


@needs_both
@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        ({"head_dim": 0}, ValueError, "head_dim must be >= 1; got 0"),
        ({"head_dim": 2.0}, TypeError, "head_dim must be an int; got float 2.0"),
        ({"out_features": 0}, ValueError, "out_features must be >= 1; got 0"),
        ({"out_bias": 1}, TypeError, "out_bias must be a bool; got int 1"),
        ({"d_out": 30}, ValueError, "d_out must be divisible by num_heads; got d_out=30, num_heads=4"),
        ({"out_proj": False, "out_features": 24}, ValueError,
         "out_features is the width out_proj maps to, and out_proj=False has none; got out_features=24 "
         "(without out_proj the output is the merged heads, d_out wide)"),
        ({"out_proj": False, "head_dim": 16}, ValueError,
         "with out_proj=False the output is the merged heads: num_heads * head_dim must equal d_out; "
         "got num_heads=4, head_dim=16, d_out=40"),
    ],
)
def test_both_twins_refuse_bad_widths_with_one_text(options: dict[str, Any], error: type, text: str) -> None:
    assert constructor_errors({**BASE, **options}) == [(error, text)] * 3


@needs_both
def test_other_variants_have_no_free_widths() -> None:
    from attention_spec.registry import AttentionConfig

    with pytest.raises(ValueError, match=re.escape("CausalAttention has no option 'head_dim'")):
        AttentionConfig("CausalAttention", d_in=4, d_out=4, head_dim_option=2)
    with pytest.raises(ValueError, match=re.escape("CausalAttention has no option 'out_bias'")):
        AttentionConfig("CausalAttention", d_in=4, d_out=4, out_bias=True)


# --------------------------------------------------------------------------- both twins


@needs_both
@pytest.mark.parametrize("name", CONFIGS)
def test_twins_have_the_same_parameters_shapes_and_cache(name: str) -> None:
    import torch
    from flax import nnx

    import jax_attention
    from jax_attention.interop import torch_state_dict as flax_as_torch

    config = _config(name)
    torch_m, _ = _pair(name)
    flax_m = jax_attention.MultiHeadAttention(**config, rngs=nnx.Rngs(0))
    expected = CONFIGS[name][1]
    assert {k: tuple(v.shape) for k, v in torch_m.state_dict().items()} == expected
    assert {k: v.shape for k, v in flax_as_torch(flax_m).items()} == expected
    assert torch_m.config == flax_m.config == config | {k: v for k, v in flax_m.config.items() if k not in config}
    x = _x((3, 5, D_IN))
    out_width = CONFIGS[name][2]
    assert tuple(torch_m(torch.from_numpy(x)).shape) == np.shape(flax_m(x)) == (3, 5, out_width)
    assert tuple(torch_m(torch.from_numpy(x[0])).shape) == np.shape(flax_m(x[0])) == (5, out_width)
    spec = torch_m.spec
    want = (2, spec.kv_heads, 7, spec.head_dim)
    for cache in (torch_m.init_cache(2, 7), flax_m.init_cache(2, 7)):
        assert tuple(cache.key.shape) == tuple(cache.value.shape) == want
    assert torch_m.head_dim == flax_m.head_dim == spec.head_dim


@needs_both
@pytest.mark.parametrize("name", ["llama-like", "all"])
@pytest.mark.slow  # the quick tier shows this feature in another test
def test_decoding_with_the_cache_equals_the_full_forward(name: str) -> None:
    """A prompt of 3 tokens then 3 single steps, through a cache of head_dim-wide keys
    and values, give the full causal forward's outputs, in both twins."""
    import torch

    torch_m, flax_m = _pair(name, seed=13)
    x = _x(seed=14)
    full = torch_m(torch.from_numpy(x)).detach().numpy()
    tol = PARITY["float32"]
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, np.asarray)):
        cache = module.init_cache(2, 6)
        steps = []
        for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6)):
            out, cache = module(wrap(x[:, start:stop]), cache=cache)
            steps.append(np.asarray(out.detach() if isinstance(out, torch.Tensor) else out))
        assert np.allclose(np.concatenate(steps, axis=1), full, rtol=tol.rtol, atol=tol.atol)


@needs_both
@pytest.mark.parametrize("name", CONFIGS)
def test_round_trips_are_bit_exact(name: str) -> None:
    from jax_attention.interop import torch_state_dict as flax_as_torch
    from parity_tests import to_torch
    from torch_attention.interop import torch_state_dict

    torch_m, flax_m = _pair(name, seed=3)
    back = to_torch(flax_m)
    original = torch_state_dict(torch_m)
    for arrays in (flax_as_torch(flax_m), torch_state_dict(back)):
        assert arrays.keys() == original.keys()
        for key, value in original.items():
            assert arrays[key].dtype == value.dtype and np.array_equal(arrays[key], value), key


@needs_both
# Each width config on one path, each path with one config (the matrix, test_matrix.py,
# runs the free-width variants, head_dim with grouped heads and out_features without
# out_proj's bias, on every path: both twins, gradients, float64); every config on every
# path with --exhaustive.
@pytest.mark.parametrize("name,implementation", tiered("name,implementation", list(CONFIGS), IMPLEMENTATIONS,
                                                       strength=0))
def test_parity_and_oracle_on_every_path(name: str, implementation: str) -> None:
    """Twin against twin (outputs, input and parameter gradients) and each twin against
    the float64 oracle, with a padding mask, on each path."""
    from parity_tests import check_parity, reference
    from torch_attention.interop import torch_state_dict

    torch_m, flax_m = _pair(name, seed=1)
    x = _x(seed=2)
    mask = np.ones((2, 1, 1, 6), dtype=bool)
    mask[1, ..., 4:] = False  # the second example has 4 tokens
    report = check_parity(torch_m, flax_m, x, mask=mask, implementation=implementation)
    assert report.ok, report
    assert {"output", "grad input[0]"} <= {f.name for f in report.findings}
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(torch_m).items()}
    want, _ = reference.forward("MultiHeadAttention", _config(name), params, x.astype(np.float64), mask)
    tol = ORACLE["float32"]
    for got in (report.torch_results["output"], report.flax_results["output"]):
        assert np.allclose(got, want, rtol=tol.rtol, atol=tol.atol)


@needs_both
# Every path once (the matrix, test_matrix.py, runs both variants on every path in its
# own shapes); both variants on every path with --exhaustive.
@pytest.mark.parametrize("variant,implementation", tiered(
    "variant,implementation", ["mha-headdim-gqa", "mha-outwidth-nobias"], IMPLEMENTATIONS, strength=0))
def test_the_matrix_variants_on_every_path(variant: str, implementation: str) -> None:
    """The parity matrix's free-width variants, at 4 heads (2 key/value heads for the
    grouped one), run as the matrix runs them: both twins, gradients, the oracle."""
    from parity_tests.matrix import run_case

    case = Case(variant, 2, 4, 6, "causal+padding", "float32", "pt2fx", implementation)
    result = run_case(case)
    assert result.ok, "\n".join(result.problems + [f.describe() for f in result.findings if not f.ok])
    names = [f.name for f in result.findings]
    assert "grad input[0]" in names and "flax grad input[0] vs float64" in names


# --------------------------------------------------------------------------- independent references


def _numpy_forward(params: dict[str, np.ndarray], x: np.ndarray, heads: int, kv_heads: int,
                   head_dim: int) -> np.ndarray:
    """Causal grouped-query attention written out in float64 NumPy, heads of ``head_dim``."""
    x = x.astype(np.float64)
    p = {k: v.astype(np.float64) for k, v in params.items()}

    def project(name: str, n: int) -> np.ndarray:
        y = x @ p[f"{name}.weight"].T + p.get(f"{name}.bias", 0.0)
        return y.reshape(*x.shape[:-1], n, head_dim).swapaxes(-2, -3)  # (B, n, T, D)

    q, k, v = project("W_query", heads), project("W_key", kv_heads), project("W_value", kv_heads)
    k, v = (np.repeat(t, heads // kv_heads, axis=-3) for t in (k, v))
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(head_dim)
    t = x.shape[-2]
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    merged = (weights @ v).swapaxes(-2, -3).reshape(*x.shape[:-1], heads * head_dim)
    return merged @ p["out_proj.weight"].T + p.get("out_proj.bias", 0.0)


@needs_both
@pytest.mark.parametrize("name", ["gemma-like", "llama-like", "all"])
def test_a_numpy_forward_written_out(name: str) -> None:
    import torch

    from torch_attention.interop import torch_state_dict

    torch_m, flax_m = _pair(name, seed=4)
    spec = torch_m.spec
    x = _x(seed=5)
    want = _numpy_forward(torch_state_dict(torch_m), x, spec.num_heads, spec.kv_heads, spec.head_dim)
    tol = ORACLE["float32"]
    assert np.allclose(torch_m(torch.from_numpy(x)).detach().numpy(), want, rtol=tol.rtol, atol=tol.atol)
    assert np.allclose(np.asarray(flax_m(x)), want, rtol=tol.rtol, atol=tol.atol)


@needs_torch
@needs_both
def test_llama_attention_with_the_same_weights() -> None:
    """``transformers``' LlamaAttention (grouped heads, head_dim * heads != hidden, no
    biases) with our weights, every position 0 (cos 1, sin 0: RoPE is the identity) and
    a causal mask: both twins give its output, and its input gradient."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    from parity_tests import check_parity

    config = LlamaConfig(hidden_size=D_IN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         attention_bias=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(6)
    llama = LlamaAttention(config, layer_idx=0).eval()
    ours, flax_m = _pair("llama-like")
    ours.load_state_dict({"W_query.weight": llama.q_proj.weight, "W_key.weight": llama.k_proj.weight,
                          "W_value.weight": llama.v_proj.weight, "out_proj.weight": llama.o_proj.weight})
    from jax_attention.interop import load_torch_state_dict

    load_torch_state_dict(flax_m, ours.state_dict())
    x = torch.from_numpy(_x(seed=7)).requires_grad_(True)
    t = x.shape[1]
    cos, sin = torch.ones(1, t, 16), torch.zeros(1, t, 16)  # position 0 everywhere
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    want = llama(x, position_embeddings=(cos, sin), attention_mask=causal)[0]
    cot = torch.from_numpy(_x(seed=8))
    (want * cot).sum().backward()
    x_ours = x.detach().clone().requires_grad_(True)
    got = ours(x_ours)
    (got * cot).sum().backward()
    tol = PARITY["float32"]
    assert torch.allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    assert x.grad is not None and x_ours.grad is not None
    assert torch.allclose(x_ours.grad, x.grad, rtol=tol.rtol, atol=tol.atol)
    report = check_parity(ours, flax_m, x.detach().numpy())
    assert report.ok, report


# --------------------------------------------------------------------------- native modules


@needs_torch
def test_nn_multihead_takes_a_bias_free_module_and_refuses_free_widths() -> None:
    import torch

    import torch_attention
    from torch_attention.interop import to_nn_multihead

    torch.manual_seed(9)
    ours = torch_attention.MultiHeadAttention(**{**BASE, "causal": False, "out_bias": False}).eval()
    native = to_nn_multihead(ours)
    assert native.out_proj.bias is None and native.in_proj_bias is None
    x = torch.from_numpy(_x(seed=10))
    tol = PARITY["float32"]
    assert torch.allclose(native(x, x, x, need_weights=False)[0], ours(x), rtol=tol.rtol, atol=tol.atol)
    for options, problem in (
        ({"head_dim": 16}, "head_dim=16, out_features=40 with d_out=40"),
        ({"out_features": 24}, "head_dim=10, out_features=24 with d_out=40"),
        ({"qkv_bias": True, "out_bias": False}, "out_bias=False with qkv_bias=True"),
    ):
        module = torch_attention.MultiHeadAttention(**{**BASE, "causal": False, **options})
        with pytest.raises(ValueError, match=re.escape(problem)):
            to_nn_multihead(module)


@needs_jax
@pytest.mark.parametrize("name", ["gemma-like", "out-features"])
def test_nnx_multihead_takes_free_widths(name: str) -> None:
    """Flax's own attention has qkv_features and out_features: the export is exact (a
    zero output bias where ours has none)."""
    from flax import nnx

    import jax_attention
    from jax_attention.interop import to_nnx_multihead

    ours = jax_attention.MultiHeadAttention(**{**_config(name), "causal": False}, rngs=nnx.Rngs(11))
    native = to_nnx_multihead(ours)
    assert (native.qkv_features, native.out_features) == (ours.spec.width, CONFIGS[name][2])
    x = _x(seed=12)
    tol = PARITY["float32"]
    assert np.allclose(np.asarray(native(x)), np.asarray(ours(x)), rtol=tol.rtol, atol=tol.atol)
