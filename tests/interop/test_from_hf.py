"""``torch_attention.interop.from_hf`` / ``to_hf``: the attention layer of each supported
``transformers`` family against our ``MultiHeadAttention`` built from it and its Flax twin
(``parity_tests.to_flax``): a tiny random float32 layer, a batch of 2 with padding (left
padding for decoders), positions 480..511 for the rotary families, outputs, input
gradients and parameter gradients within float32 parity (``parity_tests.tolerances``),
only the rows of real tokens compared (a padded decoder query sees nothing: zeros here,
an average of the values there).  Hugging Face's masks are built with its own mask
functions (``transformers.masking_utils``), so the windows read from the configs are
proven against its definition.  Round trips are bit-exact; bad classes and mismatched
layers are refused by name, before anything is written."""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import GRAD_PARITY, PARITY
from tests.support import needs_both, needs_torch

HIDDEN, HEADS, KV_HEADS, SEQ, PAD = 32, 4, 2, 32, 5
FIRST_POSITION = 480  # positions 480..511: where float32 rounding of the frequencies shows


def _configs() -> dict[str, tuple[Callable[[], Any], str, int]]:
    """family -> (config factory, attention class path, layer_idx)."""
    import transformers as tf

    gqa = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    return {
        "gpt2": (lambda: tf.GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=2, scale_attn_by_inverse_layer_idx=True),
                 "gpt2.modeling_gpt2.GPT2Attention", 1),
        "llama": (lambda: tf.LlamaConfig(**gqa, head_dim=16), "llama.modeling_llama.LlamaAttention", 0),
        "mistral": (lambda: tf.MistralConfig(**gqa, head_dim=8, sliding_window=8),
                    "mistral.modeling_mistral.MistralAttention", 0),
        "qwen2": (lambda: tf.Qwen2Config(**gqa, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                         num_hidden_layers=2), "qwen2.modeling_qwen2.Qwen2Attention", 1),
        "qwen3": (lambda: tf.Qwen3Config(**gqa, head_dim=16), "qwen3.modeling_qwen3.Qwen3Attention", 0),
        "gemma": (lambda: tf.GemmaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=1,
                                         head_dim=16), "gemma.modeling_gemma.GemmaAttention", 0),
        "gemma2": (lambda: tf.Gemma2Config(**gqa, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                           sliding_window=8, num_hidden_layers=2),
                   "gemma2.modeling_gemma2.Gemma2Attention", 0),
        "gemma3-local": (_gemma3, "gemma3.modeling_gemma3.Gemma3Attention", 0),
        "gemma3-global": (_gemma3, "gemma3.modeling_gemma3.Gemma3Attention", 1),
        "gpt-neox": (lambda: tf.GPTNeoXConfig(hidden_size=HIDDEN, num_attention_heads=HEADS),
                     "gpt_neox.modeling_gpt_neox.GPTNeoXAttention", 0),
        "phi": (lambda: tf.PhiConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, qk_layernorm=True),
                "phi.modeling_phi.PhiAttention", 0),
        "phi3": (lambda: tf.Phi3Config(**gqa, sliding_window=8, pad_token_id=0),
                 "phi3.modeling_phi3.Phi3Attention", 0),
        "olmo2": (lambda: tf.Olmo2Config(**gqa), "olmo2.modeling_olmo2.Olmo2Attention", 0),
        "bert": (lambda: tf.BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=37),
                 "bert.modeling_bert.BertAttention", 0),
        "vit": (lambda: tf.ViTConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, qkv_bias=True),
                "vit.modeling_vit.ViTAttention", 0),
    }


def _gemma3() -> Any:
    """Local layers (0) with a window and theta 10000, global ones (1) with linear scaling."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
    )


FAMILIES = [
    "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3-local", "gemma3-global",
    "gpt-neox", "phi", "phi3", "olmo2", "bert", "vit",
]
ENCODERS = ("bert", "vit")
NO_ROPE = ("gpt2", "bert", "vit")


@dataclasses.dataclass
class Case:
    name: str
    layer: Any
    config: Any

    @property
    def rope(self) -> bool:
        return self.name not in NO_ROPE


def _class(path: str) -> Any:
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def _layer(name: str, seed: int = 0) -> Case:
    """A tiny random float32 layer in eval mode: every weight and bias drawn (no zero
    biases, no unit norms), norm weights near 1 (Gemma 3's near 0: its scale is 1 + w)."""
    import torch

    factory, path, layer_idx = _configs()[name]
    config = factory()
    config._attn_implementation = "eager"
    cls = _class(path)
    torch.manual_seed(seed)
    layer = cls(config) if name == "vit" else cls(config, layer_idx=layer_idx)
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            if "norm" in pname and pname.endswith("weight"):
                p.copy_((0.0 if name.startswith("gemma3") else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_((0.25 if pname.endswith("weight") else 0.1) * torch.randn_like(p))
    return Case(name, layer.eval(), config)


# --------------------------------------------------------------------------- running


def _tokens(name: str) -> np.ndarray:
    """(B, T) bool: the real tokens.  Decoders: example 1 left-padded by PAD; encoders:
    right-padded."""
    valid = np.ones((2, SEQ), bool)
    if name in ENCODERS:
        valid[1, SEQ - PAD:] = False
    else:
        valid[1, :PAD] = False
    return valid


def _hf_mask(case: Case, valid: np.ndarray) -> Any:
    """Hugging Face's additive (B, 1, T, T) mask from its own mask functions: causal, the
    layer's sliding window, padding."""
    import torch
    from transformers import masking_utils as mu

    attention = case.layer.self if case.name == "bert" else case.layer
    functions = [mu.padding_mask_function(torch.from_numpy(valid))]
    if getattr(attention, "is_causal", False):
        functions.append(mu.causal_mask_function)
    window = getattr(attention, "sliding_window", None)
    if window is None and case.name in ("mistral", "phi3"):
        window = case.config.sliding_window
    if window:
        functions.append(mu.sliding_window_overlay(window))
    b, q, k = (torch.arange(n)[(slice(None),) + (None,) * (3 - i)].reshape([-1 if j == i else 1 for j in range(4)])
               for i, n in ((0, 2), (2, SEQ), (3, SEQ)))
    allowed = mu.and_masks(*functions)(b, torch.zeros(()), q, k)
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _rotary(case: Case, x: Any, positions: Any) -> Any:
    module = sys.modules[type(case.layer).__module__]
    prefix = type(case.layer).__name__.removesuffix("Attention")
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(case.config)
    if case.name.startswith("gemma3"):
        return rotary(x, positions, case.layer.layer_type)
    return rotary(x, positions)


def _run_hf(case: Case, x: np.ndarray, positions: np.ndarray, valid: np.ndarray, cot: np.ndarray) -> dict[str, Any]:
    """Hugging Face's output, input gradient and parameter gradients (by its names).  BERT:
    the part ours covers, ``output.dense`` of the self-attention."""
    import torch

    xt = torch.from_numpy(x).requires_grad_(True)
    mask = _hf_mask(case, valid)
    layer = case.layer
    layer.zero_grad()
    if case.name == "bert":
        out = layer.output.dense(layer.self(xt, attention_mask=mask)[0])
    elif case.rope:
        out = layer(xt, position_embeddings=_rotary(case, xt, torch.from_numpy(positions)), attention_mask=mask)[0]
    else:
        out = layer(xt, attention_mask=mask)[0]
    (out * torch.from_numpy(cot)).sum().backward()
    grads = {n: p.grad.numpy().copy() for n, p in layer.named_parameters() if p.grad is not None}
    return {"output": out.detach().numpy(), "grad input": xt.grad.numpy(), "params": grads}


def _call(module: Any, x: Any, positions: Any, **kwargs: Any) -> Any:
    return module(x, positions=positions, **kwargs)


def _as_hf_grads(case: Case, ours: Any, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our parameter gradients (PyTorch names) under the layer's names and layouts: the
    same map as to_hf's, without Gemma 3's offset (d(1 + w)/dw = 1)."""
    from torch_attention import _hf
    from torch_attention.interop import load_torch_state_dict

    holder = copy.deepcopy(ours)
    load_torch_state_dict(holder, grads)
    family = dataclasses.replace(_hf._family(case.layer, "test"), norm_offset=False)
    options = _hf._options(case.layer, family)
    return {n: np.asarray(a) for n, a in _hf._hf_arrays(holder, family, options).items()}


def _compare(want: dict[str, Any], got: dict[str, Any], hf_grads: dict[str, np.ndarray], valid: np.ndarray,
             label: str) -> dict[str, float]:
    """Asserts the output (real rows) within PARITY, gradients within GRAD_PARITY; returns
    the largest absolute differences."""
    from parity_tests.harness import compare

    tol, gtol = PARITY["float32"], GRAD_PARITY["float32"]
    findings = [compare("output", got["output"], want["output"], tol, (label, "hf"), where=valid[..., None]),
                compare("grad input", got["grad input[0]"], want["grad input"], gtol, (label, "hf"))]
    assert set(hf_grads) == set(want["params"]), (sorted(hf_grads), sorted(want["params"]))
    findings += [compare(f"grad {n}", hf_grads[n], want["params"][n], gtol, (label, "hf")) for n in hf_grads]
    failures = [str(f) for f in findings if not f.ok]
    assert not failures, "\n".join(failures)
    return {"output": findings[0].max_abs, "grad input": findings[1].max_abs,
            "grad params": max(f.max_abs for f in findings[2:])}


def _parity(name: str, implementation: str = "auto", flax: bool = True) -> dict[str, dict[str, float]]:
    """from_hf(layer) and its Flax twin against the layer: outputs, input and parameter
    gradients; returns the largest differences by side."""
    from parity_tests.harness import run_flax, run_torch, to_flax
    from torch_attention.interop import from_hf, state_dict_from_flax

    case = _layer(name)
    ours = from_hf(case.layer)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, SEQ, HIDDEN)).astype(np.float32)
    valid = _tokens(name)
    positions = np.repeat(FIRST_POSITION + np.arange(SEQ)[None], 2, axis=0).astype(np.int64)
    cot = (rng.standard_normal((2, SEQ, HIDDEN)) * valid[..., None]).astype(np.float32)
    want = _run_hf(case, x, positions, valid, cot)
    run = {"inputs": [x, positions] if case.rope else [x], "mask": valid[:, None, None, :], "cotangent": cot,
           "rows": valid, "implementation": implementation, "call": _call if case.rope else None}
    got = run_torch(ours, **run)
    grads = {k.removeprefix("grad "): v for k, v in got.items() if k.startswith("grad ") and "input" not in k}
    errors = {"torch": _compare(want, got, _as_hf_grads(case, ours, grads), valid, "torch")}
    if flax:
        got_f = run_flax(to_flax(ours), **run)
        flat = {k.removeprefix("grad "): v for k, v in got_f.items() if k.startswith("grad ") and "input" not in k}
        grads_f = state_dict_from_flax(flat, "MultiHeadAttention", ours.config)
        errors["flax"] = _compare(want, got_f, _as_hf_grads(case, ours, grads_f), valid, "flax")
    return errors


# --------------------------------------------------------------------------- parity


@needs_both
@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_against_the_native_layer(name: str) -> None:
    errors = _parity(name)
    print(name, errors)


@needs_both
@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["reference", "blockwise", "fused"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3-local"])
def test_every_implementation(name: str, implementation: str) -> None:
    """Llama and two windowed families on every path ("auto" is the test above)."""
    print(name, implementation, _parity(name, implementation))
