"""Attention sinks in the modules (gpt-oss): ``MultiHeadAttention(..., sinks=True)`` holds a
parameter ``sinks`` of shape (num_heads,), each head's logit in every softmax's
denominator.  Both twins, the weight map, the one error text of a bad option, every path
against the float64 oracle (outputs, input and parameter gradients, the sinks' own),
decoding with a cache, and the native exports that cannot express it."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from attention_spec.interop.conversion import flax_shapes, rules_for, torch_shapes
from attention_spec.rope import RopeConfig
from parity_tests.tolerances import GRAD_ORACLE, ORACLE, PARITY
from tests.support import constructor_errors, needs_both, random_x

D_IN = 32
BASE: dict[str, Any] = {"d_in": D_IN, "d_out": D_IN, "context_length": None, "dropout": 0.0, "num_heads": 4,
                        "num_kv_heads": 2, "sinks": True}
# gpt-oss's layer, small: grouped heads, biases, a causal sliding window, YaRN rope, sinks
GPT_OSS: dict[str, Any] = {**BASE, "qkv_bias": True, "causal": True, "window": (3, 0),
                           "rope": RopeConfig(theta=150000.0, scaling="yarn", factor=32.0,
                                              original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0)}
IMPLEMENTATIONS = ("reference", "blockwise", "fused", "auto")


def _pair(config: dict[str, Any], seed: int = 0) -> tuple[Any, Any]:
    """(torch, flax) twins with the same weights, the sinks drawn from N(0, 2^2) so that
    each head's sink matters (they start at zeros)."""
    import torch

    import torch_attention
    from parity_tests import to_flax

    torch.manual_seed(seed)
    module = torch_attention.MultiHeadAttention(**config).eval()
    with torch.no_grad():
        module.sinks.copy_(torch.randn(module.sinks.shape) * 2.0)
    return module, to_flax(module)


def _positions(batch: int = 2, seq: int = 6) -> np.ndarray:
    return 480 + 7 * np.arange(batch)[:, None] + np.arange(seq)[None]


# --------------------------------------------------------------------------- the declaration


def test_the_weight_map_declares_one_sink_per_head() -> None:
    rules = rules_for("MultiHeadAttention", BASE)
    assert torch_shapes(rules)["sinks"] == (4,)
    assert flax_shapes(rules)[("sinks",)] == (4,)
    assert "sinks" not in torch_shapes(rules_for("MultiHeadAttention", {**BASE, "sinks": False}))


@needs_both
@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        ({"sinks": 1}, TypeError, "sinks must be a bool; got int 1"),
        ({"sinks": "yes"}, TypeError, "sinks must be a bool; got str 'yes'"),
    ],
)
def test_both_twins_refuse_bad_options_with_one_text(options: dict[str, Any], error: type, text: str) -> None:
    assert constructor_errors({**BASE, **options}) == [(error, text)] * 3


def test_other_variants_have_no_sinks() -> None:
    from attention_spec.registry import AttentionConfig

    with pytest.raises(ValueError, match=re.escape("CausalAttention has no option 'sinks'")):
        AttentionConfig("CausalAttention", d_in=4, d_out=4, context_length=4, sinks=True)


@needs_both
def test_twins_start_with_zero_sinks() -> None:
    from flax import nnx

    import jax_attention
    import torch_attention

    torch_m = torch_attention.MultiHeadAttention(**BASE)
    flax_m = jax_attention.MultiHeadAttention(**BASE, rngs=nnx.Rngs(0))
    assert torch_m.sinks.shape == (4,) and not torch_m.sinks.any()
    assert flax_m.sinks[...].shape == (4,) and not np.asarray(flax_m.sinks[...]).any()


# --------------------------------------------------------------------------- numbers


def _oracle(module: Any, config: dict[str, Any], x: np.ndarray, mask: Any, positions: Any = None) -> np.ndarray:
    from parity_tests import reference
    from torch_attention.interop import torch_state_dict

    params = {k: v.astype(np.float64) for k, v in torch_state_dict(module).items()}
    return reference.forward("MultiHeadAttention", config, params, x.astype(np.float64), mask,
                             positions=positions)[0]


def _calls(positions: np.ndarray | None) -> dict[str, Any]:
    if positions is None:
        return {}
    import jax.numpy as jnp
    import torch

    return {"torch_call": lambda m, *xs, **kw: m(*xs, positions=torch.from_numpy(positions), **kw),
            "flax_call": lambda m, *xs, **kw: m(*xs, positions=jnp.asarray(positions), **kw)}


@needs_both
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", ["gqa", "gpt-oss"])
def test_parity_and_oracle_on_every_path(name: str, implementation: str) -> None:
    """Twin against twin (outputs, input and parameter gradients, the sinks' included) and
    each twin against the float64 oracle, with padding and a row that sees nothing, on
    each path; PyTorch's "fused" (SDPA) refuses sinks by name, and the JAX twin's either
    refuses so or computes them on the library's CPU kernel."""
    from parity_tests import check_parity

    config = BASE if name == "gqa" else GPT_OSS
    positions = None if name == "gqa" else _positions()
    torch_m, flax_m = _pair(config, seed=1)
    x = random_x((2, 6, D_IN), seed=2)
    mask = np.ones((2, 1, 6, 6), dtype=bool)
    mask[1, ..., 4:] = False  # the second example has 4 tokens
    mask[0, :, 2] = False  # a query of the first sees nothing: zeros, its weight all on the sink
    want = _oracle(torch_m, config, x, mask, positions)
    np.testing.assert_allclose(want[0, 2], torch_m.out_proj.bias.detach().numpy(), atol=1e-7)  # the blind row
    if implementation == "fused":
        _fused(torch_m, flax_m, x, mask, positions, want)
        return
    report = check_parity(torch_m, flax_m, x, mask=mask, implementation=implementation, **_calls(positions))
    assert report.ok, report
    assert {"output", "grad input[0]", "grad sinks"} <= {f.name for f in report.findings}
    tol = ORACLE["float32"]
    for got in (report.torch_results["output"], report.flax_results["output"]):
        np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    without = _oracle(torch_m, {**config, "sinks": False}, x, mask, positions)
    assert not np.allclose(want, without, atol=1e-3)  # the sinks change the output


def _fused(torch_m: Any, flax_m: Any, x: np.ndarray, mask: np.ndarray, positions: Any, want: np.ndarray) -> None:
    import torch

    kwargs = {} if positions is None else {"positions": positions}
    with pytest.raises(ValueError, match=re.escape("sinks (the fused kernel has no attention sinks)")):
        torch_m(torch.from_numpy(x), mask=torch.from_numpy(mask), implementation="fused",
                **{k: torch.from_numpy(v) for k, v in kwargs.items()})
    try:
        got = np.asarray(flax_m(x, mask=mask, implementation="fused", **kwargs))
    except ValueError as err:
        assert "sinks" in str(err)
        return
    tol = ORACLE["float32"]
    np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)


@needs_both
def test_the_sinks_gradient_is_the_oracles_finite_difference() -> None:
    """d loss / d sinks of both twins (reference path) against central differences of the
    float64 oracle."""
    import torch
    from flax import nnx

    torch_m, flax_m = _pair(GPT_OSS, seed=3)
    x, positions = random_x((2, 6, D_IN), seed=4), _positions()
    cot = random_x((2, 6, D_IN), seed=5).astype(np.float64)
    out = torch_m(torch.from_numpy(x), positions=torch.from_numpy(positions), implementation="reference")
    (out * torch.from_numpy(cot).float()).sum().backward()
    torch_grad = torch_m.sinks.grad.numpy()

    def loss(module: Any) -> Any:
        return (module(x, positions=positions, implementation="reference") * cot).sum()

    flax_grad = np.asarray(nnx.grad(loss)(flax_m)["sinks"][...])
    from parity_tests import reference
    from torch_attention.interop import torch_state_dict

    params = {k: v.astype(np.float64) for k, v in torch_state_dict(torch_m).items()}
    base, fd = params["sinks"], np.zeros(4)
    for h in range(base.size):  # central differences in float64: the step is exact
        step = np.zeros_like(base)
        step[h] = 1e-6
        values = [(reference.forward("MultiHeadAttention", GPT_OSS, {**params, "sinks": base + sign * step},
                                     x.astype(np.float64), None, positions=positions)[0] * cot).sum()
                  for sign in (1, -1)]
        fd[h] = (values[0] - values[1]) / 2e-6
    assert np.abs(fd).max() > 1e-2
    tol = GRAD_ORACLE["float32"]
    for got in (torch_grad, flax_grad):
        np.testing.assert_allclose(got, fd, rtol=tol.rtol, atol=tol.atol)


@needs_both
@pytest.mark.slow  # the quick tier shows this feature in another test
def test_decoding_with_the_cache_equals_the_full_forward() -> None:
    """gpt-oss's layer decodes a prompt then single steps as its full causal forward, in
    both twins (the window and the rope positions follow the cache)."""
    import torch

    torch_m, flax_m = _pair(GPT_OSS, seed=6)
    x = random_x((2, 7, D_IN), seed=7)
    full = torch_m(torch.from_numpy(x)).detach().numpy()
    tol = PARITY["float32"]
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, np.asarray)):
        cache = module.init_cache(2, 7)
        steps = []
        for start, stop in ((0, 3), (3, 4), (4, 7)):
            out, cache = module(wrap(x[:, start:stop]), cache=cache)
            steps.append(np.asarray(out.detach() if isinstance(out, torch.Tensor) else out))
        np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=tol.rtol, atol=tol.atol)


@needs_both
def test_round_trips_are_bit_exact() -> None:
    from parity_tests import to_flax, to_torch

    torch_m, _ = _pair(GPT_OSS, seed=8)
    back = to_torch(to_flax(torch_m))
    for name, value in torch_m.state_dict().items():
        assert np.array_equal(back.state_dict()[name].numpy(), value.numpy()), name


@needs_both
def test_the_native_exports_refuse_sinks() -> None:
    """nn.MultiheadAttention and Flax's attention have no sinks: an export is refused,
    naming them."""
    from jax_attention import interop as jax_interop
    from torch_attention import interop as torch_interop

    config = {**BASE, "num_kv_heads": None}
    torch_m, flax_m = _pair(config)
    text = "sinks=True ({} cannot express it; only sinks=False converts)"
    with pytest.raises(ValueError, match=re.escape(text.format("nn.MultiheadAttention"))):
        torch_interop.to_nn_multihead(torch_m)
    with pytest.raises(ValueError, match=re.escape(text.format("nnx.MultiHeadAttention"))):
        jax_interop.to_nnx_multihead(flax_m)
