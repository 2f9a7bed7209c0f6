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

    gqa: dict[str, Any] = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    return {
        "gpt2": (lambda: tf.GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=2, scale_attn_by_inverse_layer_idx=True),
                 "gpt2.modeling_gpt2.GPT2Attention", 1),
        "llama": (lambda: tf.LlamaConfig(**gqa, head_dim=16), "llama.modeling_llama.LlamaAttention", 0),
        # Llama's rotary embedding ignores partial_rotary_factor: its layer turns the whole head
        "llama-partial": (lambda: tf.LlamaConfig(**gqa, head_dim=16, partial_rotary_factor=0.5),
                          "llama.modeling_llama.LlamaAttention", 0),
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
        "gpt-oss": (lambda: tf.GptOssConfig(**gqa, head_dim=16, sliding_window=8, num_hidden_layers=2,
                                            layer_types=["sliding_attention", "full_attention"]),
                    "gpt_oss.modeling_gpt_oss.GptOssAttention", 0),
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
    "gpt-neox", "phi", "phi3", "olmo2", "bert", "vit", "gpt-oss",
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
    # (B, 1, T, T) by broadcasting: batch, query and key indices on their own axes
    b, q, k = torch.arange(2)[:, None, None, None], torch.arange(SEQ)[:, None], torch.arange(SEQ)
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
    assert xt.grad is not None
    return {"output": out.detach().numpy(), "grad input": xt.grad.numpy(), "params": grads}


def _call(module: Any, x: Any, positions: Any, **kwargs: Any) -> Any:
    return module(x, positions=positions, **kwargs)


def _as_hf_grads(case: Case, ours: Any, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our parameter gradients (PyTorch names) under the layer's names and layouts: the
    same map as to_hf's."""
    from torch_attention import _hf
    from torch_attention.interop import load_torch_state_dict

    holder = copy.deepcopy(ours)
    load_torch_state_dict(holder, grads)
    family = _hf._family(case.layer, "test")
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
def test_a_partial_rotary_factor_the_layer_ignores_is_ignored() -> None:
    """Issue 40, probe item 6: a ``LlamaConfig(partial_rotary_factor=0.5)``, whose layer
    turns the whole head (its rotary embedding has head_dim / 2 frequencies), failed in
    ``from_hf`` about an ``inv_freq`` the user never gave.  ``from_hf`` follows the layer's
    own rotary embedding: the whole head turns, and ours matches the layer (and its twin)."""
    from torch_attention.interop import from_hf

    rope = from_hf(_layer("llama-partial").layer).spec.rope
    assert (rope.rotary_dim, rope.partial_rotary_factor, len(rope.inv_freq)) == (None, None, 8)
    _parity("llama-partial")


@needs_both
@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_against_the_native_layer(name: str) -> None:
    """Output (real rows), input and parameter gradients of from_hf(layer) and of its Flax
    twin against the layer's own (the assertions are _compare's; -s prints the worst)."""
    errors = _parity(name)
    print(name, errors)


@needs_both
@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["reference", "blockwise", "fused"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3-local"])
def test_every_implementation(name: str, implementation: str) -> None:
    """Llama and two windowed families on every path ("auto" is the test above)."""
    print(name, implementation, _parity(name, implementation))


@needs_both
@pytest.mark.parametrize("name", FAMILIES)
def test_locate_divergence_finds_each_family_clean_with_no_module_map(name: str) -> None:
    """Issue 40: ``locate_divergence`` cried wolf on correct ports (Qwen3's qk-norms see
    (B, T, H, D), ours (B, T, H * D)).  Every family's layer, held at ``attn`` of a model
    and called as its model calls it, against ``to_flax(from_hf(layer))`` held there too:
    Hugging Face's children paired with ours without a ``module_map`` (``q_proj`` with
    ``W_query``; BERT's ``self.query``; the qk-norms in either head layout), nothing
    diverges forward or backward, and every pair of ours with a counterpart is compared."""
    import torch
    from flax import nnx

    from parity_tests import locate_divergence, to_flax
    from torch_attention.interop import from_hf

    case = _layer(name)
    valid = np.ones((2, SEQ), bool)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = case.layer

        def forward(self, x: Any, positions: Any) -> Any:
            mask = _hf_mask(case, valid)
            if name == "bert":
                return self.attn.output.dense(self.attn.self(x, attention_mask=mask)[0])
            if case.rope:
                return self.attn(x, position_embeddings=_rotary(case, x, positions), attention_mask=mask)
            return self.attn(x, attention_mask=mask)

    class Port(nnx.Module):
        def __init__(self) -> None:
            self.attn = to_flax(from_hf(case.layer))

        def __call__(self, x: Any, positions: Any) -> Any:
            if name == "bert":
                return self.attn(x)
            kwargs = {"positions": positions} if case.rope else {}
            return self.attn(x, return_weights=True, **kwargs)

    x = np.random.default_rng(3).standard_normal((2, SEQ, HIDDEN)).astype(np.float32)
    positions = np.repeat(FIRST_POSITION + np.arange(SEQ)[None], 2, axis=0).astype(np.int64)
    report = locate_divergence(Model(), Port(), x, positions)
    assert report.ok and report.backward_checked, str(report)
    unpaired = {"attn.rope"} | ({"attn.W_query", "attn.W_key", "attn.W_value"} if name in PACKED else set())
    unpaired |= {"attn"} if name == "bert" else set()  # BERT's model calls the layer's parts, not the layer
    assert set(report.flax_only) <= unpaired, str(report)
    compared = {p.flax_path[-1] for p in report.pairs if len(p.flax_path) == 2}
    assert {"out_proj"} <= compared and ({"W_query", "W_key", "W_value"} <= compared) == (name not in PACKED), \
        str(report)


PACKED = ("gpt2", "gpt-neox", "phi3")  # one q/k/v weight: no module of ours to pair with


@needs_both
@pytest.mark.parametrize("name", FAMILIES)
def test_hf_rules_carry_each_family_onto_its_flax_twin_bit_for_bit(name: str) -> None:
    """The weight map ``infer_param_map`` takes for a Hugging Face layer (``hf_rules``:
    its own names to our Flax paths; q/k/v packed in thirds, per head or in groups split
    by ``SplitQKV``) moves the layer's weights onto ``to_flax(from_hf(layer))``'s exactly,
    and back: every parameter of ours covered once."""
    from flax import nnx

    from attention_spec.interop.specs import apply_specs
    from parity_tests import to_flax
    from torch_attention._hf import hf_rules
    from torch_attention.interop import from_hf

    case = _layer(name)
    rules = hf_rules(case.layer)
    theirs = {n: p.detach().numpy() for n, p in case.layer.named_parameters()
              if name != "bert" or not n.startswith("output.LayerNorm")}
    twin = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(to_flax(from_hf(case.layer)), nnx.Param))}
    moved = apply_specs(theirs, rules, "to_flax")
    assert sorted(moved) == sorted(twin)
    for path, array in twin.items():
        np.testing.assert_array_equal(moved[path], array, err_msg=str(path))
    back = apply_specs(moved, rules, "to_torch")
    assert sorted(back) == sorted(theirs) and all(np.array_equal(back[n], theirs[n]) for n in theirs)


@needs_both
def test_bert_s_residual_and_layer_norm_stay_the_caller_s() -> None:
    """BertAttention is LayerNorm(dropout(dense(attn)) + x): ours is dense(attn); the
    caller adds x and applies ``layer.output.LayerNorm`` (eval: no dropout)."""
    import torch

    from torch_attention.interop import from_hf

    case = _layer("bert")
    ours = from_hf(case.layer)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((2, SEQ, HIDDEN)).astype(np.float32))
    valid = _tokens("bert")
    want = case.layer(x, attention_mask=_hf_mask(case, valid))[0]
    got = case.layer.output.LayerNorm(ours(x, torch.from_numpy(valid[:, None, None, :])) + x)
    tol = PARITY["float32"]
    torch.testing.assert_close(got, want, rtol=tol.rtol, atol=tol.atol)


@needs_torch
@pytest.mark.parametrize(("name", "ulps_apart"), [("llama", True), ("gemma3-local", True), ("gemma3-global", True),
                                                  ("gpt-neox", False), ("phi", False)])
def test_the_rotation_is_transformers_own_bit_for_bit(name: str, ulps_apart: bool) -> None:
    """from_hf copies the family's rotary frequencies (float32 arithmetic, a few ulps from
    the float64 formula): q turned by our apply_rope is transformers' own, bit for bit, at
    positions 480..511 and 1490 (partial rotary for GPT-NeoX and Phi: the turned part;
    their 2 and 4 frequencies happen to round alike both ways, the 8 of the others not)."""
    import dataclasses as dc

    import torch

    from torch_attention.functional import apply_rope
    from torch_attention.interop import from_hf

    case = _layer(name)
    rope = from_hf(case.layer).spec.rope
    head_dim = 16 if name != "gpt-neox" and name != "phi" else HIDDEN // HEADS
    positions = torch.cat([torch.arange(FIRST_POSITION, FIRST_POSITION + SEQ), torch.tensor([1490])])[None]
    q = torch.randn(1, HEADS, positions.shape[1], head_dim, generator=torch.Generator().manual_seed(3))
    cos, sin = _rotary(case, q.transpose(1, 2), positions)
    dim = cos.shape[-1]
    module = sys.modules[type(case.layer).__module__]
    turned = module.apply_rotary_pos_emb(q[..., :dim], q[..., :dim], cos, sin)[0]
    want = torch.cat([turned, q[..., dim:]], dim=-1)
    assert torch.equal(apply_rope(q, positions, rope), want)
    formula = apply_rope(q, positions, dc.replace(rope, inv_freq=None))
    assert torch.equal(formula, want) is not ulps_apart  # why the frequencies are copied


# --------------------------------------------------------------------------- round trips


def _state(module: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _bit_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, unequal




@needs_torch
@pytest.mark.parametrize("name", FAMILIES)
def test_round_trips_are_bit_exact(name: str) -> None:
    """HF -> ours -> HF and ours -> HF -> ours give every weight back bit for bit (Gemma 3's
    qk-norm weight included: ours scales by ``qk_norm_offset + weight`` as its RMSNorm)."""
    import torch

    from torch_attention.interop import from_hf, to_hf

    case = _layer(name)
    before = _state(case.layer)
    ours = from_hf(case.layer)
    assert ours.training is False and ours.state_dict()["W_query.weight"].dtype == torch.float32
    mine = _state(ours)
    other = _layer(name, seed=5).layer
    other_before = _state(other)
    assert to_hf(ours, other) is other
    back = _state(other)
    if name == "bert":  # its LayerNorm is not ours: to_hf leaves the other layer's as it was
        for key in ("output.LayerNorm.weight", "output.LayerNorm.bias"):
            assert torch.equal(back[key], other_before[key]) and not torch.equal(back[key], before[key])
            before[key] = back[key]
    if name.startswith("gemma3"):
        assert ours.spec.qk_norm_offset == 1.0
        assert torch.equal(mine["q_norm.weight"], before["q_norm.weight"])  # w itself, not 1 + w
    _bit_equal(back, before)
    again = from_hf(other)
    _bit_equal(_state(again), mine)
    assert again.config == ours.config


@needs_torch
def test_a_module_of_ours_round_trips_through_a_layer() -> None:
    """Ours (built and trained here, say) -> a Qwen3 layer -> ours: bit for bit, qk-norm
    included; and ours without the layer's inv_freq (the float64 formula) is accepted."""
    import dataclasses as dc

    import torch

    from torch_attention.interop import from_hf, to_hf

    case = _layer("qwen3")
    template = from_hf(case.layer)
    config = {**template.config, "rope": dc.replace(template.spec.rope, inv_freq=None)}
    torch.manual_seed(9)
    ours = type(template)(**config)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p))
    to_hf(ours, case.layer)
    back = from_hf(case.layer)
    _bit_equal(_state(back), _state(ours))


# --------------------------------------------------------------------------- errors


@needs_torch
def test_a_module_that_is_no_attention_layer_is_a_type_error_naming_what_it_holds() -> None:
    """from_hf recognises a layer by what it holds, not by its class: an MLP holds no
    q/k/v/o projections, and the error names the projections it knows and what it found."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from torch_attention import MultiHeadAttention
    from torch_attention.interop import from_hf, to_hf

    mlp = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=8))
    text = "takes the attention layer of a transformers model, with q/k/v/o projections under names it knows"
    with pytest.raises(TypeError, match=re.escape(f"from_hf {text}")) as err:
        from_hf(mlp)
    assert str(err.value).endswith("; got LlamaMLP, holding act_fn, down_proj, gate_proj, up_proj")
    with pytest.raises(TypeError, match=re.escape(f"to_hf {text}")):
        to_hf(MultiHeadAttention(HIDDEN, HIDDEN, None, 0.0, HEADS), mlp)
    with pytest.raises(TypeError, match=re.escape("takes the attention layer of a transformers model (an nn.Module")):
        from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="to_hf takes torch_attention.MultiHeadAttention; got MultiheadAttention"):
        to_hf(torch.nn.MultiheadAttention(HIDDEN, HEADS), _layer("llama").layer)  # type: ignore[arg-type]


@needs_torch
@pytest.mark.parametrize(("source", "target", "texts"), [
    ("llama", "mistral", ["window=None where the layer has (7, 0)"]),
    ("gemma2", "gemma", ["softcap=5.0 where the layer has None", "scale="]),
    ("qwen3", "llama", ["qk_norm='rms' where the layer has None"]),
    ("gemma3-local", "gemma3-global", ["rope=", "window=(7, 0) where the layer has None"]),
])
def test_to_hf_refuses_a_layer_that_does_not_fit_and_writes_nothing(source: str, target: str,
                                                                     texts: list[str]) -> None:
    from torch_attention.interop import from_hf, to_hf

    ours, layer = from_hf(_layer(source).layer), _layer(target, seed=3).layer
    before = _state(layer)
    with pytest.raises(ValueError, match=re.escape("to_hf: this MultiHeadAttention does not fit the ")) as err:
        to_hf(ours, layer)
    assert all(t in str(err.value) for t in texts), str(err.value)
    _bit_equal(_state(layer), before)


@needs_torch
def test_to_hf_refuses_other_geometry_and_writes_nothing() -> None:
    """Another head count, and another hidden size: named, nothing written."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    from torch_attention.interop import from_hf, to_hf

    ours = from_hf(_layer("llama").layer)
    for changes, text in (({"num_key_value_heads": HEADS}, "kv_heads=2 where the layer has 4"),
                          ({"hidden_size": 2 * HIDDEN}, "d_in=32 where the layer has 64")):
        fields: dict[str, Any] = {"hidden_size": HIDDEN, "num_attention_heads": HEADS,
                                  "num_key_value_heads": KV_HEADS, "head_dim": 16, **changes}
        layer = LlamaAttention(LlamaConfig(**fields), layer_idx=0)
        before = _state(layer)
        with pytest.raises(ValueError, match=re.escape(text)):
            to_hf(ours, layer)
        _bit_equal(_state(layer), before)


@needs_torch
@pytest.mark.parametrize(("option", "text"), [({"clip_qkv": 8.0}, "clip_qkv=8.0 where the layer has None"),
                                              ({"output_gate": True}, "output_gate=True where the layer has False")])
def test_to_hf_refuses_clip_qkv_and_an_output_gate_the_layer_has_not(option: dict[str, Any], text: str) -> None:
    """Ours with qkv clipping or an output gate onto a Llama layer (which has neither): the
    option is named before any weight is compared, nothing written."""
    import torch

    from torch_attention import MultiHeadAttention
    from torch_attention.interop import from_hf, to_hf

    layer = _layer("llama").layer
    options = {k: getattr(from_hf(layer).spec, k) for k in ("num_heads", "head_dim", "qkv_bias", "out_bias", "rope")}
    torch.manual_seed(0)
    ours = MultiHeadAttention(HIDDEN, HIDDEN, None, 0.0, options["num_heads"], num_kv_heads=KV_HEADS,
                              head_dim=options["head_dim"], qkv_bias=options["qkv_bias"],
                              out_bias=options["out_bias"], rope=options["rope"], **option)
    before = _state(layer)
    with pytest.raises(ValueError, match=re.escape(text)):
        to_hf(ours, layer)
    _bit_equal(_state(layer), before)

@needs_torch
def test_ours_with_other_frequencies_is_refused() -> None:
    import dataclasses as dc

    from torch_attention import MultiHeadAttention
    from torch_attention.interop import from_hf, to_hf

    case = _layer("llama")
    ours = from_hf(case.layer)
    rope = ours.spec.rope
    shifted = dc.replace(rope, inv_freq=tuple(f * 1.5 for f in rope.inv_freq))
    other = MultiHeadAttention(**{**ours.config, "rope": shifted})
    with pytest.raises(ValueError, match=re.escape("rope inv_freq: ours fixes frequencies other than")):
        to_hf(other, case.layer)


@needs_torch
def test_cross_attention_is_refused_by_name() -> None:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    from torch_attention.interop import from_hf

    layer = GPT2Attention(GPT2Config(n_embd=HIDDEN, n_head=HEADS), is_cross_attention=True, layer_idx=0)
    with pytest.raises(ValueError, match=re.escape("this GPT2Attention cannot be expressed as MultiHeadAttention: cross-attention")):
        from_hf(layer)


@needs_torch
def test_dropout_rate_mode_and_sinks_are_the_layer_s() -> None:
    """The attention weights' dropout rate and the train/eval mode come with the layer;
    gpt-oss's sinks become ours (``sinks=True``, its values)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    from torch_attention.interop import from_hf

    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, attention_dropout=0.125)
    ours = from_hf(LlamaAttention(config, layer_idx=0).train())
    assert ours.spec.dropout == 0.125 and ours.training
    oss = _layer("gpt-oss").layer
    ours = from_hf(oss)
    assert ours.spec.sinks and ours.spec.window == (7, 0)
    assert torch.equal(ours.state_dict()["sinks"], oss.sinks)


def _flint_layers() -> list[Any]:
    import transformers as tf
    from transformers.models.flint.modeling_flint import FlintAttention

    config = tf.FlintConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=8,
                            num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    config._attn_implementation = "eager"
    return [FlintAttention(config, i).eval() for i in range(2)]


@needs_torch
def test_a_layer_that_ignores_its_rotation_is_found_by_what_it_computes() -> None:
    """Flint's full-attention layers take ``position_embeddings`` and turn nothing by them
    (no family rule says so): the probe, the real (cos, sin) against the identity, finds it."""
    from torch_attention._hf import _probe_rotates
    from torch_attention.interop import from_hf

    sliding, full = _flint_layers()
    assert _probe_rotates(sliding, HIDDEN) and not _probe_rotates(full, HIDDEN)
    assert from_hf(sliding).spec.rope is not None and from_hf(full).spec.rope is None
    assert from_hf(sliding).spec.window == (7, 0) and from_hf(full).spec.window is None


@needs_torch
def test_a_port_the_rules_get_wrong_is_refused_by_the_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ours and the layer on one probe input must agree: a rule that misses a mechanism
    (here, the rotation probe made to say "no rope" on a Llama layer) is refused, not ported."""
    import torch_attention._hf as hf

    layer = _layer("llama").layer
    hf.from_hf(layer)
    monkeypatch.setattr(hf, "_probe_rotates", lambda *args: False)
    with pytest.raises(ValueError, match=r"the port does not compute what the LlamaAttention computes "
                                         r"\(max difference [0-9.e+-]+"):
        hf.from_hf(layer)


def _hf_layer(module: str, cls: str, config: Any, layer_idx: int = 0, seed: int = 0) -> Any:
    """``cls`` of ``transformers.models.<module>`` for ``config`` (eager), every weight drawn
    (std 0.4; norm weights 1 + that)."""
    import importlib

    import torch

    config._attn_implementation = "eager"
    layer = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)(config, layer_idx)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.4 * torch.randn(p.shape, generator=gen))
    return layer.eval()


def _against_layer(layer: Any, ours: Any, rotary: Any) -> None:
    """Ours against the layer at positions 401..406, causal."""
    import torch

    x = torch.sin(0.7 * torch.arange(2 * 6 * HIDDEN, dtype=torch.float32)).reshape(2, 6, HIDDEN)
    positions = torch.arange(401, 407)[None].repeat(2, 1)
    causal = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = layer(x, position_embeddings=rotary(x, positions), attention_mask=causal)[0]
        got = ours(x, positions=positions)
    tol = PARITY["float32"]
    torch.testing.assert_close(got, want, rtol=tol.rtol, atol=tol.atol)


@needs_torch
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_a_full_attention_layer_with_an_output_gate_ports(family: str) -> None:
    """Qwen3-Next's and Qwen3.5's full-attention layers: q_proj twice as wide (each head's
    queries, then its gate) is our output gate, W_query = q_proj as it is."""
    import transformers as tf

    from torch_attention.interop import from_hf

    names = {"qwen3_next": ("Qwen3NextConfig", "Qwen3NextAttention", "Qwen3NextRotaryEmbedding"),
             "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5Attention", "Qwen3_5TextRotaryEmbedding")}[family]
    config = getattr(tf, names[0])(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   head_dim=8, num_hidden_layers=2, layer_types=["full_attention"] * 2)
    layer = _hf_layer(family, names[1], config)
    ours = from_hf(layer)
    assert ours.spec.output_gate and ours.spec.qk_norm == "rms" and ours.spec.head_dim == 8
    w_query: Any = ours.W_query
    assert w_query.weight.shape == (2 * HEADS * 8, HIDDEN)
    _bit_equal({"w": w_query.weight.detach()}, {"w": layer.q_proj.weight.detach()})
    rotary = getattr(sys.modules[type(layer).__module__], names[2])(config)
    _against_layer(layer, ours, rotary)


@needs_torch
def test_olmo_s_clip_qkv_ports_and_a_clamp_after_the_qk_norm_is_refused() -> None:
    """OLMo clamps q, k and v as they leave their projections (ours: ``clip_qkv``);
    OLMoE clamps after its qk-norm: the self-check refuses it, naming clip_qkv."""
    import transformers as tf

    from torch_attention.interop import from_hf

    gqa: dict[str, Any] = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
                           "num_hidden_layers": 2, "clip_qkv": 0.5}
    layer = _hf_layer("olmo", "OlmoAttention", tf.OlmoConfig(**gqa, attention_bias=True))
    ours = from_hf(layer)
    assert ours.spec.clip_qkv == 0.5
    rotary = sys.modules[type(layer).__module__].OlmoRotaryEmbedding(layer.config)
    _against_layer(layer, ours, rotary)
    with pytest.raises(ValueError, match=r"does not compute what the OlmoeAttention computes .*clip_qkv=0.5"):
        from_hf(_hf_layer("olmoe", "OlmoeAttention", tf.OlmoeConfig(**gqa)))


def _afmoe(attention_bias: bool = False, seed: int = 0, layer_idx: int = 0) -> Any:
    """An AFMoE sliding (rope) layer: q_proj, k_proj, v_proj, o_proj, a sigmoid gate_proj of
    q_proj's width, per-head RMS qk-norms (window 16: wider than _against_layer's 6 tokens)."""
    import transformers as tf

    config = tf.AfmoeConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=8,
                            num_hidden_layers=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                            attention_bias=attention_bias)
    return _hf_layer("afmoe", "AfmoeAttention", config, layer_idx, seed=seed)


@needs_torch
def test_a_separate_sigmoid_gate_is_our_output_gate_interleaved_per_head() -> None:
    """AFMoE's ``gate_proj`` (``o_proj(attn * sigmoid(gate_proj(x)))``) is our output gate:
    W_query holds each head's q_proj rows, then its gate_proj rows (Qwen3-Next's q_proj
    order).  Ours computes the layer's output; to_hf splits the rows back bit for bit;
    ``hf_rules`` interleaves them into the Flax twin's kernel (what our declared map gives
    it from ours) and back, bit for bit."""
    import torch

    from attention_spec.interop.conversion import rules_for
    from attention_spec.interop.specs import apply_specs
    from torch_attention._hf import hf_children, hf_rules
    from torch_attention.interop import from_hf, to_hf

    layer = _afmoe()
    ours = from_hf(layer)
    assert ours.spec.output_gate and ours.spec.rope is not None and ours.spec.qk_norm == "rms"
    w_query = ours.W_query.weight.detach().reshape(HEADS, 16, HIDDEN)
    assert torch.equal(w_query[:, :8].reshape(-1, HIDDEN), layer.q_proj.weight.detach())
    assert torch.equal(w_query[:, 8:].reshape(-1, HIDDEN), layer.gate_proj.weight.detach())
    _against_layer(layer, ours, sys.modules[type(layer).__module__].AfmoeRotaryEmbedding(layer.config))
    other = _afmoe(seed=5)
    to_hf(ours, other)
    _bit_equal(_state(other), _state(layer))
    theirs = {n: p.detach().numpy() for n, p in layer.named_parameters()}
    rules = hf_rules(layer)
    moved = apply_specs(theirs, rules, "to_flax")
    twin = apply_specs({n: v.detach().numpy() for n, v in ours.state_dict().items()},
                       rules_for("MultiHeadAttention", ours.config), "to_flax")
    assert sorted(moved) == sorted(twin) and all(np.array_equal(moved[p], twin[p]) for p in twin)
    back = apply_specs(moved, rules, "to_torch")
    assert sorted(back) == sorted(theirs) and all(np.array_equal(back[n], theirs[n]) for n in theirs)
    assert "q_proj" not in hf_children(layer) and hf_children(layer)["k_proj"] == ("W_key", None)
    with pytest.raises(ValueError, match=r"an output gate `gate_proj` without a bias where q_proj has one"):
        from_hf(_afmoe(attention_bias=True))
    nope = _afmoe(layer_idx=1)  # its full-attention layers turn nothing (rope on the sliding ones only)
    gated = from_hf(nope)
    assert gated.spec.output_gate and gated.spec.rope is None and gated.spec.window is None
    x = torch.sin(0.7 * torch.arange(2 * 6 * HIDDEN, dtype=torch.float32)).reshape(2, 6, HIDDEN)
    causal = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = nope(x, position_embeddings=None, attention_mask=causal)[0]
        torch.testing.assert_close(gated(x), want, rtol=PARITY["float32"].rtol, atol=PARITY["float32"].atol)


def _nanochat(seed: int = 0) -> Any:
    import transformers as tf

    config = tf.NanoChatConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                               num_hidden_layers=2, attention_bias=True)  # (the biases' halves negated too)
    return _hf_layer("nanochat", "NanoChatAttention", config, seed=seed)


@needs_torch
def test_a_rotation_by_minus_the_angle_is_ours_with_each_head_s_second_half_negated() -> None:
    """nanochat's ``rotate_half`` is ``cat(x2, -x1)``: it turns the halves by -angle,
    ``D R D`` with ``D`` negating the second half.  Ours holds q_proj's and k_proj's rows
    with each head's second half negated (``D q``) and turns them by +angle: its turned q is
    nanochat's with the second half negated, bit for bit, and every score (each negated
    factor meeting a negated one) and the weightless RMS norm are nanochat's; the layer's
    output to float32 parity (it norms after rope, ours before).  to_hf negates back, bit
    for bit; ``hf_rules`` refuses by name (no step negates rows)."""
    import torch

    from torch_attention._hf import hf_children, hf_rules
    from torch_attention.functional import apply_rope
    from torch_attention.interop import from_hf, to_hf

    layer = _nanochat()
    ours = from_hf(layer)
    d = HIDDEN // HEADS
    sign = torch.ones(d)
    sign[d // 2:] = -1.0
    assert torch.equal(ours.W_query.weight.detach(), layer.q_proj.weight.detach() * sign.repeat(HEADS)[:, None])
    assert torch.equal(ours.W_key.weight.detach(), layer.k_proj.weight.detach() * sign.repeat(KV_HEADS)[:, None])
    assert torch.equal(ours.W_query.bias.detach(), layer.q_proj.bias.detach() * sign.repeat(HEADS))
    assert torch.equal(ours.W_value.bias.detach(), layer.v_proj.bias.detach())
    module = sys.modules[type(layer).__module__]
    rotary = module.NanoChatRotaryEmbedding(layer.config)
    positions = torch.arange(FIRST_POSITION, FIRST_POSITION + SEQ)[None]
    q = torch.randn(1, HEADS, SEQ, d, generator=torch.Generator().manual_seed(3))
    cos, sin = rotary(q.transpose(1, 2), positions)
    assert torch.equal(sign * apply_rope(sign * q, positions, ours.spec.rope),
                       module.apply_rotary_pos_emb(q, q, cos, sin)[0])
    _against_layer(layer, ours, rotary)
    other = _nanochat(seed=5)
    to_hf(ours, other)
    _bit_equal(_state(other), _state(layer))
    assert set(hf_children(layer)) == {"v_proj", "o_proj"}
    with pytest.raises(ValueError, match=r"hf_rules: the NanoChatAttention turns its halves the other way"):
        hf_rules(layer)
