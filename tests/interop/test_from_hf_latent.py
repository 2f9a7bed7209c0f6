"""``from_hf`` / ``to_hf`` for DeepSeek's multi-head latent attention: ``transformers``'
DeepseekV3Attention (q through a low-rank pair, interleaved YaRN rope with mscale) and
DeepseekV2Attention (one q projection, biases, complex rope pairs) against our
``MultiHeadLatentAttention`` built from them and its Flax twin: a batch of 2 with left
padding, positions 480.., outputs, input and parameter gradients within float32 parity
(the rows of real tokens), every path; round trips bit-exact; a layer that does not fit
is refused before anything is written; training steps of the twins in parity."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import GRAD_PARITY, PARITY
from tests.support import needs_both, needs_torch, random_x

HIDDEN, SEQ, PAD, FIRST_POSITION = 32, 12, 3, 480
WIDTHS = {"hidden_size": HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
          "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12}


def _layer(name: str, seed: int = 0, **changes: Any) -> tuple[Any, Any]:
    """(layer, its rotary embedding): a tiny random float32 DeepSeek layer, weights drawn
    N(0, 0.2^2) (norm weights near 1)."""
    import torch
    import transformers as tf
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    if name == "v3":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "mscale": 1.0,
                "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}
        config = tf.DeepseekV3Config(**{**WIDTHS, **changes}, q_lora_rank=24, rope_interleave=True,
                                     max_position_embeddings=2048, rope_parameters=yarn)
        attention, rotary = v3.DeepseekV3Attention, v3.DeepseekV3RotaryEmbedding
    else:
        config = tf.DeepseekV2Config(**{**WIDTHS, **changes}, q_lora_rank=None, attention_bias=True)
        attention, rotary = v2.DeepseekV2Attention, v2.DeepseekV2RotaryEmbedding
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            p.copy_((1.0 if "layernorm" in pname else 0.0) + 0.2 * torch.randn_like(p))
    return layer, rotary(config)


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x (2, T, hidden), the bool mask (causal, the second example left-padded), the
    positions, and which query rows are real tokens (B, T)."""
    x = random_x((2, SEQ, HIDDEN), seed=1)
    real = np.ones((2, SEQ), dtype=bool)
    real[1, :PAD] = False
    mask = np.tril(np.ones((SEQ, SEQ), dtype=bool))[None, None] & real[:, None, None, :]
    positions = np.broadcast_to(FIRST_POSITION + np.arange(SEQ), (2, SEQ)).copy()
    return x, mask, positions, real


def _native(layer: Any, rotary: Any, x: np.ndarray, mask: np.ndarray, positions: np.ndarray,
            cot: np.ndarray) -> dict[str, np.ndarray]:
    """The layer's output and gradients (input, every parameter) of sum(out * cot)."""
    import torch

    xt = torch.from_numpy(x).requires_grad_(True)
    # float32's lowest, as transformers' own masks: a padded row (which sees nothing) then
    # averages instead of giving NaN, and carries no gradient (its cotangent is 0)
    additive = torch.zeros(mask.shape).masked_fill(torch.from_numpy(~mask), torch.finfo(torch.float32).min)
    out = layer(xt, attention_mask=additive, position_embeddings=rotary(xt, torch.from_numpy(positions)))[0]
    layer.zero_grad()
    (out * torch.from_numpy(cot)).sum().backward()
    grads = {f"grad {n}": p.grad.numpy().copy() for n, p in layer.named_parameters()}
    return {"output": out.detach().numpy(), "grad input[0]": xt.grad.numpy(), **grads}


def _calls(positions: np.ndarray) -> dict[str, Any]:
    import jax.numpy as jnp
    import torch

    return {"torch_call": lambda m, *xs, **kw: m(*xs, positions=torch.from_numpy(positions), **kw),
            "flax_call": lambda m, *xs, **kw: m(*xs, positions=jnp.asarray(positions), **kw)}


@needs_both
@pytest.mark.parametrize("implementation", ["reference", "blockwise", "fused", "auto"])
@pytest.mark.parametrize("name", ["v3", "v2"])
@pytest.mark.slow  # the quick tier shows this feature in another test
def test_both_twins_are_the_native_layer_beyond_position_400(name: str, implementation: str) -> None:
    """Ours (from_hf) and its Flax twin against the native layer: outputs and the input
    gradient on the real rows, every parameter's gradient (the same names on both
    sides), within float32 parity."""
    from parity_tests import check_parity, to_flax
    from parity_tests.harness import compare
    from torch_attention.interop import from_hf

    layer, rotary = _layer(name)
    ours = from_hf(layer)
    flax_m = to_flax(ours)
    x, mask, positions, real = _inputs()
    cot = random_x((2, SEQ, HIDDEN), seed=2) * real[..., None]  # the padded rows carry no gradient
    want = _native(layer, rotary, x, mask, positions, cot)
    report = check_parity(ours, flax_m, x, mask=mask, cotangent=cot, rows=real, implementation=implementation,
                          **_calls(positions))
    assert report.ok, report
    rows = real[..., None]
    for side, got in (("torch", report.torch_results), ("flax", report.flax_results)):
        findings = [compare(f"{side} output", got["output"], want["output"], PARITY["float32"], where=rows)]
        findings += [compare(f"{side} {k}", got[k], v, GRAD_PARITY["float32"]) for k, v in want.items()
                     if k.startswith("grad")]
        failures = [f.describe() for f in findings if not f.ok]
        assert not failures, failures
    assert {"grad kv_b_proj.weight", "grad kv_a_layernorm.weight", "grad o_proj.weight"} <= set(want)


@needs_torch
@pytest.mark.parametrize("name", ["v3", "v2"])
def test_what_from_hf_reads(name: str) -> None:
    """The widths, the scale (YaRN's mscale squared for V3), the norms' eps, causal, and
    the rope: V3's interleaved YaRN, V2's complex pairs (interleaved), each with the
    layer's own float32 frequencies."""
    import math

    from torch_attention import MultiHeadLatentAttention
    from torch_attention.interop import from_hf

    layer, rotary = _layer(name)
    ours = from_hf(layer)
    assert isinstance(ours, MultiHeadLatentAttention) and not ours.training
    spec = ours.spec
    assert (spec.d_in, spec.num_heads, spec.kv_lora_rank, spec.v_head_dim) == (HIDDEN, 4, 16, 12)
    assert spec.q_lora_rank == (24 if name == "v3" else None) and spec.attention_bias is (name == "v2")
    assert spec.causal and spec.norm_eps == 1e-6 and spec.rope.layout == "interleaved"
    assert spec.rope.inv_freq == tuple(rotary.inv_freq.tolist())
    assert math.isclose(ours.softmax_scale, layer.scaling, rel_tol=0, abs_tol=0)
    if name == "v3":
        assert spec.rope.scaling == "yarn" and layer.scaling > 16 ** -0.5


@needs_torch
@pytest.mark.parametrize("name", ["v3", "v2"])
def test_round_trips_are_bit_exact(name: str) -> None:
    import torch

    from torch_attention.interop import from_hf, to_hf

    layer, _ = _layer(name)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    ours = from_hf(layer)
    other, _ = _layer(name, seed=5)
    assert to_hf(ours, other) is other
    for key, value in before.items():
        assert torch.equal(other.state_dict()[key], value), key
    again = from_hf(other)
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert again.config == ours.config


@needs_torch
def test_a_layer_that_does_not_fit_is_refused_and_keeps_its_weights() -> None:
    import torch

    import torch_attention
    from torch_attention.interop import from_hf, to_hf

    ours = from_hf(_layer("v3")[0])
    other, _ = _layer("v3", seed=3, kv_lora_rank=8)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape("kv_lora_rank=16 where the layer has 8")):
        to_hf(ours, other)
    with pytest.raises(ValueError, match=re.escape("q_lora_rank=24 where the layer has None")):
        to_hf(ours, _layer("v2")[0])
    mha = torch_attention.MultiHeadAttention(HIDDEN, HIDDEN, None, 0.0, 4)
    with pytest.raises(TypeError, match="to_hf takes torch_attention.MultiHeadLatentAttention for a "
                                        "DeepseekV3Attention; got MultiHeadAttention"):
        to_hf(mha, other)
    for key, value in before.items():
        assert torch.equal(other.state_dict()[key], value), key


@needs_both
def test_the_twins_train_in_parity() -> None:
    """Three AdamW steps of the ported layer and its Flax twin (positions 480..): every
    parameter after every step within the training tolerance."""
    from parity_tests import check_training_parity, to_flax
    from torch_attention.interop import from_hf

    ours = from_hf(_layer("v3")[0])
    x, mask, positions, _ = _inputs()
    batches = [(x, random_x((2, SEQ, HIDDEN), seed=s)) for s in (3, 4, 5)]
    report = check_training_parity(ours, to_flax(ours), batches, optimizer="adamw", lr=1e-3, mask=mask,
                                   **_calls(positions))
    assert report.ok, report
