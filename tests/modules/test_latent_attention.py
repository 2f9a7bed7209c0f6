"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), ``MultiHeadLatentAttention`` in both
twins: Hugging Face's parameter names and shapes; both twins against the float64 oracle and
each other (outputs, input and parameter gradients) on every path, with masks, padding and
positions beyond 400, for a DeepSeek-V3-like configuration (low-rank queries, interleaved
YaRN) and a V2-Lite-like one (one q_proj); against ``transformers``' ``DeepseekV3Attention``
with the same weights; the absorbed form; the latent cache (what it holds, its bytes a
token, decoding equal to the full forward, one compilation, refused calls leave it as it
was); bit-exact round trips; one error text for a bad option in all three places."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

from attention_spec.rope import RopeConfig
from parity_tests.tolerances import GRAD_ORACLE, GRAD_PARITY, ORACLE, PARITY
from tests.support import constructor_errors, needs_both, needs_torch, quick_only, random_x, tiered

D_IN, HEADS, B, T = 16, 4, 2, 9
FIRST = 480  # positions from here on: where RoPE's errors show
V3_ROPE = RopeConfig(theta=10000.0, layout="interleaved", scaling="yarn", factor=4.0,
                     original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0, mscale=0.707,
                     mscale_all_dim=0.707)
# DeepSeek-V3-like: queries through a low-rank pair, interleaved YaRN (the scale's mscale)
V3: dict[str, Any] = {"d_in": D_IN, "num_heads": HEADS, "kv_lora_rank": 12, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4,
      "v_head_dim": 5, "q_lora_rank": 10, "rope": V3_ROPE}
# DeepSeek-V2-Lite-like: one q_proj, Llama's rope layout, biases
V2_LITE: dict[str, Any] = {"d_in": D_IN, "num_heads": HEADS, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 6,
           "v_head_dim": 7, "q_lora_rank": None, "attention_bias": True, "rope": RopeConfig(theta=10000.0)}
CONFIGS: dict[str, dict[str, Any]] = {"v3": V3, "v2lite": V2_LITE}
PATHS = ("reference", "blockwise", "fused", "auto")


def _positions(batch: int = B, seq: int = T, first: int = FIRST) -> np.ndarray:
    """Integers (batch, seq) from ``first`` on, example b shifted by 7b."""
    return (first + 7 * np.arange(batch)[:, None] + np.arange(seq)[None]).astype(np.int64)


def _pair(config: dict[str, Any], seed: int = 0) -> tuple[Any, Any]:
    """(torch module, its Flax twin) with the same weights, the RMSNorms' weights drawn too."""
    import torch

    import torch_attention
    from parity_tests import to_flax

    torch.manual_seed(seed)
    module = torch_attention.MultiHeadLatentAttention(**config).eval()
    with torch.no_grad():
        for name, _ in module.spec.latent_norms():
            getattr(module, name).weight.uniform_(0.5, 1.5)
    return module, to_flax(module)


def _calls(positions: np.ndarray, **kwargs: Any) -> tuple[Any, Any]:
    """(torch_call, flax_call) for ``check_parity``: our modules at ``positions``."""
    import jax.numpy as jnp
    import torch

    def torch_call(module: Any, *inputs: Any, **kw: Any) -> Any:
        return module(*inputs, positions=torch.from_numpy(positions), **kwargs, **kw)

    def flax_call(module: Any, *inputs: Any, **kw: Any) -> Any:
        return module(*inputs, positions=jnp.asarray(positions), **kwargs, **kw)

    return torch_call, flax_call


def _np(t: Any) -> np.ndarray:
    """A copy of a torch tensor or a JAX array as NumPy."""
    return np.array(t.detach().numpy() if hasattr(t, "detach") else t)


def _mask(kind: str) -> np.ndarray | None:
    """A bool mask (True = may attend) broadcastable to (B, H, T, T)."""
    rng = np.random.default_rng(3)
    padding = (np.arange(T)[None, :] < np.array([T, 5])[:, None])[:, None, None, :]
    return {"none": None, "padding": padding, "random": rng.random((B, HEADS, T, T)) < 0.7}[kind]


# --------------------------------------------------------------------------- the layer


@needs_both
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameters_are_hugging_face_s(name: str) -> None:
    """Names and shapes as ``DeepseekV3Attention``'s (a ``from_hf`` is a copy by name), the
    weight map's in both twins."""
    from flax import nnx

    from attention_spec.interop.conversion import rules_for

    config = CONFIGS[name]
    torch_m, flax_m = _pair(config)
    q_width = HEADS * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
    kv_width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    up_width = HEADS * (config["qk_nope_head_dim"] + config["v_head_dim"])
    want = {"kv_a_proj_with_mqa.weight": (kv_width, D_IN), "kv_a_layernorm.weight": (config["kv_lora_rank"],),
            "kv_b_proj.weight": (up_width, config["kv_lora_rank"]), "o_proj.weight": (D_IN, HEADS * config["v_head_dim"])}
    if config["q_lora_rank"] is None:
        want |= {"q_proj.weight": (q_width, D_IN), "kv_a_proj_with_mqa.bias": (kv_width,), "o_proj.bias": (D_IN,)}
    else:
        rank = config["q_lora_rank"]
        want |= {"q_a_proj.weight": (rank, D_IN), "q_a_layernorm.weight": (rank,), "q_b_proj.weight": (q_width, rank)}
    assert {k: tuple(v.shape) for k, v in torch_m.state_dict().items()} == want
    rules = rules_for("MultiHeadLatentAttention", torch_m.config)
    flax_params = {tuple(p): v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(flax_m, nnx.Param))}
    assert {r.flax_path: r.flax_shape for r in rules} == flax_params


def _oracle_checks(torch_m: Any, x: np.ndarray, mask: Any, report: Any, positions: np.ndarray,
                   weights: bool) -> list[Any]:
    """Both twins' outputs (and weights) against the float64 oracle, their gradients against
    the same module's float64 autograd on the reference path."""
    import copy

    import torch

    from parity_tests import reference
    from parity_tests.harness import compare, run_torch
    from torch_attention.interop import torch_state_dict

    params = {k: v.astype(np.float64) for k, v in torch_state_dict(torch_m).items()}
    torch_call, _ = _calls(positions)
    out64, weights64 = reference.forward("MultiHeadLatentAttention", torch_m.config, params, x.astype(np.float64),
                                         mask, positions=positions)
    m64 = copy.deepcopy(torch_m).to(torch.float64)
    grads64 = run_torch(m64, [x.astype(np.float64)], mask=mask, grads=True, implementation="reference",
                        call=torch_call)
    findings = []
    for side, got in (("torch", report.torch_results), ("flax", report.flax_results)):
        findings.append(compare(f"{side} output vs oracle", got["output"], out64, ORACLE["float32"]))
        if weights:
            findings.append(compare(f"{side} weights vs oracle", got["attention weights"], weights64,
                                    ORACLE["float32"]))
        findings += [compare(f"{side} {n} vs float64", got[n], g, GRAD_ORACLE["float32"])
                     for n, g in grads64.items() if n.startswith("grad")]
    return findings


@needs_both
# two coverings of (config, path, mask) by default (8 cases, each config on three paths,
# each mask on two or three), every pair with --exhaustive: the parity matrix
# (tests/harness/test_matrix.py) holds every path and every mask of a V3-like latent
# variant against the float64 references, test_from_hf_latent.py both configurations on
# every path against the native layer
@pytest.mark.parametrize("name,path,mask", tiered("name,path,mask", list(CONFIGS), PATHS, ["none", "padding", "random"],
                                                  strength=1))
def test_every_path_matches_the_oracle_and_the_twin(name: str, path: str, mask: str) -> None:
    """Outputs, input and parameter gradients, twin against twin and each against the
    float64 oracle, at positions from 480 on; the attention weights on the reference path."""
    from parity_tests import check_parity

    torch_m, flax_m = _pair(CONFIGS[name], seed=1)
    x = random_x((B, T, D_IN), seed=2)
    torch_call, flax_call = _calls(_positions())
    weights = path == "reference"
    report = check_parity(torch_m, flax_m, x, mask=_mask(mask), implementation=path, weights=weights,
                          torch_call=torch_call, flax_call=flax_call)
    assert report.ok, report.message()
    assert any(f.name == "grad kv_b_proj.weight" for f in report.findings)
    findings = _oracle_checks(torch_m, x, _mask(mask), report, _positions(), weights)
    assert findings and all(f.ok for f in findings), "\n".join(f.describe() for f in findings if not f.ok)


@needs_both
@pytest.mark.parametrize("path", quick_only(PATHS, 1))
def test_padding_by_lengths_window_and_bias(path: str) -> None:
    """kv_lengths, a causal window and an additive bias, with the absorbed form too: the
    twins agree, and equal the oracle given the same as one mask and bias."""
    from parity_tests import check_parity, reference
    from torch_attention.interop import torch_state_dict

    config = {**V3, "window": (4, None)}
    torch_m, flax_m = _pair(config, seed=4)
    x = random_x((B, T, D_IN), seed=5)
    bias = np.random.default_rng(6).standard_normal((1, HEADS, T, T)).astype(np.float32)
    lengths = np.array([T, 6])
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(torch_m).items()}
    padding = (np.arange(T)[None, :] < lengths[:, None])[:, None, None, :]
    want = reference.forward("MultiHeadLatentAttention", torch_m.config, params, x.astype(np.float64), padding,
                             bias=bias, positions=_positions())[0]
    for absorb in (False, True):
        torch_call, flax_call = _calls(_positions(), kv_lengths=lengths, bias=bias, absorb=absorb)
        report = check_parity(torch_m, flax_m, x, implementation=path, torch_call=torch_call, flax_call=flax_call)
        assert report.ok, report.message()
        tol = ORACLE["float32"]
        for got in (report.torch_results["output"], report.flax_results["output"]):
            np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)


@needs_both
@pytest.mark.parametrize("path", quick_only(PATHS, 2))
def test_packed_sequences_attend_as_each_sequence_alone(path: str) -> None:
    """segment_ids: two sequences packed in one row (positions restarting at each) give
    each sequence's own output, in both twins and both forms."""
    import jax.numpy as jnp
    import torch

    torch_m, flax_m = _pair(V3, seed=26)
    x = random_x((1, T, D_IN), seed=27)
    cut = 4
    segments = (np.arange(T) >= cut).astype(np.int32)[None]
    positions = np.concatenate((np.arange(cut), np.arange(T - cut)))[None] + FIRST
    alone = np.concatenate([_np(torch_m(torch.from_numpy(x[:, a:b]), positions=torch.from_numpy(positions[:, a:b])))
                            for a, b in ((0, cut), (cut, T))], axis=1)
    tol = PARITY["float32"]
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, jnp.asarray)):
        for absorb in (False, True):
            got = module(wrap(x), segment_ids=wrap(segments), positions=wrap(positions), absorb=absorb,
                         implementation=path)
            np.testing.assert_allclose(_np(got), alone, rtol=tol.rtol, atol=tol.atol)


@needs_both
@pytest.mark.parametrize("path", quick_only(["reference", "auto"], 1))
def test_dropout_in_training_mode(path: str) -> None:
    """Training mode with a shared dropout keep-mask: the twins agree, outputs and every
    gradient, in both forms (dropout acts on the weights, before the value half of
    ``kv_b_proj`` in the absorbed form)."""
    from parity_tests import check_parity, to_flax

    torch_m, _ = _pair({**V3, "dropout": 0.2}, seed=19)
    flax_m = to_flax(torch_m.train())  # the twin in training mode too
    x = random_x((B, T, D_IN), seed=20)
    keep = np.random.default_rng(21).random((B, HEADS, T, T)) < 0.8
    for absorb in (False, True):
        torch_call, flax_call = _calls(_positions(), absorb=absorb)
        report = check_parity(torch_m, flax_m, x, training=True, dropout_mask=keep, implementation=path,
                              torch_call=torch_call, flax_call=flax_call)
        assert report.ok, report.message()


@needs_torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_absorbed_form_equals_the_expanded_one_in_float64(name: str) -> None:
    """Outputs, weights and every gradient (input and parameters) of the two forms, float64,
    within float64's tolerance: the same function, computed in another order."""
    import torch

    torch_m, _ = _pair(CONFIGS[name], seed=22)
    torch_m = torch_m.double()
    x = torch.from_numpy(random_x((B, T, D_IN), seed=23).astype(np.float64))
    positions = torch.from_numpy(_positions())
    results = []
    for absorb in (False, True):
        xg = x.clone().requires_grad_(True)
        out, weights = torch_m(xg, positions=positions, absorb=absorb, return_weights=True)
        grads = torch.autograd.grad(out.square().sum(), [xg, *torch_m.parameters()])
        results.append([out, weights, *grads])
    tol = GRAD_PARITY["float64"]
    for expanded, absorbed in zip(*results, strict=True):
        scale = expanded.abs().max().item()
        assert (expanded - absorbed).abs().max().item() <= tol.atol + tol.rtol * scale


@needs_both
@pytest.mark.slow
def test_unbatched_input_and_weights_through_the_cache() -> None:
    """An unbatched (T, d_in) x is the batched call's example; a cached call with
    return_weights gives (B, H, T, max_len) weights, zeros past the fill, equal to the full
    forward's last rows (both twins)."""
    import jax.numpy as jnp
    import torch

    torch_m, flax_m = _pair(V2_LITE, seed=24)
    x = random_x((B, 6, D_IN), seed=25)
    full, full_weights = torch_m(torch.from_numpy(x), return_weights=True)
    tol = PARITY["float32"]
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, jnp.asarray)):
        np.testing.assert_allclose(_np(module(wrap(x[1]))), _np(full)[1], rtol=tol.rtol, atol=tol.atol)
        cache = module.init_cache(B, 8)
        _, cache = module(wrap(x[:, :5]), cache=cache)
        out, weights, cache = module(wrap(x[:, 5:]), cache=cache, return_weights=True)
        assert tuple(weights.shape) == (B, HEADS, 1, 8) and not _np(weights)[..., 6:].any()
        np.testing.assert_allclose(_np(weights)[..., :6], _np(full_weights)[:, :, 5:], rtol=tol.rtol, atol=tol.atol)
        np.testing.assert_allclose(_np(out), _np(full)[:, 5:], rtol=tol.rtol, atol=tol.atol)


@needs_both
def test_softcap_is_refused_by_the_fused_path_by_name() -> None:
    """A path that cannot honour an option refuses it, naming it, before any work."""
    import jax.numpy as jnp
    import torch

    torch_m, flax_m = _pair({**V2_LITE, "softcap": 30.0})
    x = random_x((B, T, D_IN))
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, jnp.asarray)):
        with pytest.raises(ValueError, match="softcap"):
            module(wrap(x), implementation="fused")


# --------------------------------------------------------------------------- transformers


def _hf_layer(name: str, seed: int) -> tuple[Any, Any, Any]:
    """(transformers' DeepseekV3Attention, its rotary embedding, our torch module with its
    weights copied by name; the rope frequencies transformers' own float32 buffer)."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    import torch_attention
    from attention_spec.rope import rope_from_hf

    ours = CONFIGS[name]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if name == "v3":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    hf_config = DeepseekV3Config(
        hidden_size=D_IN, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=ours["q_lora_rank"],
        kv_lora_rank=ours["kv_lora_rank"], qk_nope_head_dim=ours["qk_nope_head_dim"],
        qk_rope_head_dim=ours["qk_rope_head_dim"], v_head_dim=ours["v_head_dim"], rope_interleave=name == "v3",
        attention_bias=ours.get("attention_bias", False), max_position_embeddings=256, rope_parameters=rope,
    )
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = DeepseekV3Attention(hf_config, layer_idx=0).eval()
    with torch.no_grad():
        for norm in (hf.kv_a_layernorm, hf.q_a_layernorm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    rotary = DeepseekV3RotaryEmbedding(hf_config)
    rope_config = dataclasses.replace(rope_from_hf(hf_config), inv_freq=tuple(rotary.inv_freq.tolist()))
    assert rope_config.layout == ours["rope"].layout and rope_config.scaling == ours["rope"].scaling
    module = torch_attention.MultiHeadLatentAttention(**{**ours, "rope": rope_config}).eval()
    module.load_state_dict({k: v for k, v in hf.state_dict().items()})  # a plain copy, by name
    return hf, rotary, module


@needs_both
# v2lite by default; v3 with --exhaustive (both configurations against the native layer
# on every path by default: test_from_hf_latent.py)
@pytest.mark.parametrize("name", ["v2lite", pytest.param("v3", marks=(pytest.mark.slow, pytest.mark.exhaustive))])
def test_both_twins_match_transformers_deepseek_v3_attention(name: str) -> None:
    """Outputs and input gradients at positions from 480 on, with a padding mask, within the
    float32 parity tolerance: both twins, the absorbed form too."""
    import jax
    import jax.numpy as jnp
    import torch

    from parity_tests import to_flax

    hf, rotary, torch_m = _hf_layer(name, seed=7)
    flax_m = to_flax(torch_m)
    x = random_x((B, T, D_IN), seed=8)
    cot = random_x((B, T, D_IN), seed=9)
    allowed = np.tril(np.ones((T, T), bool))[None, None] & (np.arange(T) < np.array([[T], [6]]))[:, None, None, :]
    positions = _positions()
    xt = torch.from_numpy(x).requires_grad_(True)
    cos, sin = rotary(xt, torch.from_numpy(positions))
    additive = torch.from_numpy(np.where(allowed, 0.0, -np.inf).astype(np.float32))
    want = hf(xt, (cos, sin), additive)[0]
    (want_grad,) = torch.autograd.grad((want * torch.from_numpy(cot)).sum(), xt)
    rows = np.broadcast_to(allowed[:, 0].any(-1), (B, T))  # every query sees a key here
    assert rows.all()
    for absorb in (False, True):
        xt = torch.from_numpy(x).requires_grad_(True)
        got = torch_m(xt, torch.from_numpy(allowed), positions=torch.from_numpy(positions), absorb=absorb)
        (got_grad,) = torch.autograd.grad((got * torch.from_numpy(cot)).sum(), xt)

        def loss(xj: Any, absorb: bool = absorb) -> Any:
            out = flax_m(xj, jnp.asarray(allowed), positions=jnp.asarray(positions), absorb=absorb)
            return (out * jnp.asarray(cot)).sum(), out

        # jitted: one program, where eagerly each primitive of the forward and of its
        # transpose is compiled on its own (some 200, 10 s); the same computation
        (_, flax_out), flax_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(x))
        tol, grad_tol = PARITY["float32"], GRAD_PARITY["float32"]
        for out, grad in ((got.detach().numpy(), got_grad.numpy()), (np.asarray(flax_out), np.asarray(flax_grad))):
            np.testing.assert_allclose(out, want.detach().numpy(), rtol=tol.rtol, atol=tol.atol)
            scale = np.abs(want_grad.numpy()).max()
            assert np.abs(grad - want_grad.numpy()).max() <= grad_tol.atol + grad_tol.rtol * scale


# --------------------------------------------------------------------------- the latent cache


@needs_both
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cache_holds_the_latent_and_the_rope_key(dtype: str) -> None:
    """init_cache holds (kv_lora_rank + qk_rope_head_dim) numbers a token, not 2 x heads x
    head_dim: its bytes a token, reported by both twins."""
    import jax.numpy as jnp
    import torch

    torch_m, flax_m = _pair(V3)
    per_token = (V3["kv_lora_rank"] + V3["qk_rope_head_dim"]) * (4 if dtype == "float32" else 2)
    for module, cache_dtype in ((torch_m, getattr(torch, dtype)), (flax_m, getattr(jnp, dtype))):
        cache = module.init_cache(3, 20, dtype=cache_dtype)
        assert tuple(cache.key.shape) == (3, 1, 20, V3["kv_lora_rank"])
        assert tuple(cache.value.shape) == (3, 1, 20, V3["qk_rope_head_dim"])
        assert module.cache_bytes_per_token(cache) == per_token
    # what multi-head attention with these heads would hold: keys and values of every head
    assert per_token < 2 * HEADS * (V3["qk_nope_head_dim"] + V3["qk_rope_head_dim"]) * (4 if dtype == "float32" else 2)


def _decode_in_steps(module: Any, x: Any, positions: Any, absorb: bool) -> tuple[list[Any], Any]:
    """x (B, T, d_in) through a latent cache of T + 2: a prompt of 4, two single tokens, a
    chunk of 3; (the steps' outputs, the cache)."""
    cache, steps = module.init_cache(B, T + 2), []
    for start, stop in ((0, 4), (4, 5), (5, 6), (6, T)):
        out, cache = module(x[:, start:stop], cache=cache, positions=positions[:, start:stop], absorb=absorb)
        steps.append(out)
    return steps, cache


@needs_both
# v3 expanded and v2lite absorbed by default, the other two with --exhaustive: v3 absorbed
# decodes in test_the_flax_decode_step_compiles_once, v2lite expanded in the unbatched
# and padded-prompt tests (and a chunk into a filled cache here in both forms)
@pytest.mark.parametrize("name,absorb", tiered("name,absorb", list(CONFIGS), [False, True], strength=0))
def test_decoding_equals_the_full_forward(name: str, absorb: bool) -> None:
    """A prompt, then single steps and a chunk, through the latent cache (keys and values
    rebuilt from it, or absorbed) equal the full causal forward, positions from 480 on, in
    both twins; torch's gradients through the steps equal the full forward's."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    torch_m, flax_m = _pair(CONFIGS[name], seed=10)
    x, positions = random_x((B, T, D_IN), seed=11), _positions()
    full = torch_m(torch.from_numpy(x), positions=torch.from_numpy(positions)).detach().numpy()
    tol = PARITY["float32"]
    # Flax's steps in one jitted program, the cache threaded through them traced as a
    # jitted decode step has it: eagerly, each primitive of a step of a new shape was
    # compiled on its own (10-20 s a configuration). The eager cached calls are in the
    # unbatched, padded-prompt and refused-call tests.
    flax_decode = nnx.jit(_decode_in_steps, static_argnames="absorb")
    for module, decode, wrap in ((torch_m, _decode_in_steps, torch.from_numpy), (flax_m, flax_decode, jnp.asarray)):
        steps, cache = decode(module, wrap(x), wrap(positions), absorb=absorb)
        np.testing.assert_allclose(np.concatenate([_np(s) for s in steps], axis=1), full, rtol=tol.rtol, atol=tol.atol)
        assert _np(cache.lengths).tolist() == [T, T]


@needs_both
@pytest.mark.slow
def test_a_padded_prompt_decodes_as_each_example_alone() -> None:
    """kv_lengths with a cache: example 1's prompt has 3 valid tokens of 5; its next step
    sits at its own fill, as if decoded alone (both twins, both forms)."""
    import jax.numpy as jnp
    import torch

    torch_m, flax_m = _pair(V2_LITE, seed=12)
    x = random_x((B, 6, D_IN), seed=13)
    alone = torch_m(torch.from_numpy(np.concatenate((x[1:, :3], x[1:, 5:6]), axis=1))).detach().numpy()
    tol = PARITY["float32"]
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, jnp.asarray)):
        for absorb in (False, True):
            cache = module.init_cache(B, 8)
            _, cache = module(wrap(x[:, :5]), cache=cache, kv_lengths=wrap(np.array([5, 3])), absorb=absorb)
            out, cache = module(wrap(x[:, 5:6]), cache=cache, absorb=absorb)
            got = _np(out)
            np.testing.assert_allclose(got[1, 0], alone[0, -1], rtol=tol.rtol, atol=tol.atol)
            assert _np(cache.lengths).tolist() == [6, 4]


@needs_both
def test_the_flax_decode_step_compiles_once() -> None:
    """Under nnx.jit, fixed max_len shapes: every single-token step reuses one trace."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    torch_m, flax_m = _pair(V3, seed=14)
    traces: list[int] = []

    @nnx.jit(static_argnames="absorb")
    def step(module: Any, x: Any, cache: Any, positions: Any, absorb: bool) -> Any:
        traces.append(1)
        return module(x, cache=cache, positions=positions, absorb=absorb)

    x, positions = random_x((B, 5, D_IN), seed=15), _positions(seq=5)
    # the twin's full forward, as test_decoding_equals_the_full_forward's (the Flax one,
    # eager, compiled some 50 primitives for this alone)
    full = _np(torch_m(torch.from_numpy(x), positions=torch.from_numpy(positions)))
    tol = PARITY["float32"]
    for count, absorb in enumerate((False, True), start=1):
        cache = flax_m.init_cache(B, 5)
        outs = []
        for t in range(5):
            out, cache = step(flax_m, jnp.asarray(x[:, t:t + 1]), cache, jnp.asarray(positions[:, t:t + 1]), absorb)
            outs.append(np.asarray(out))
        assert len(traces) == count  # one trace for each form, whatever the step
        np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=tol.rtol, atol=tol.atol)


@needs_both
@pytest.mark.slow
def test_a_refused_call_leaves_the_cache_as_it_was() -> None:
    """Every check before any work: a bad mask, a path that refuses, no room, a cache of
    another shape; the cache's latent, rope key and fill are unchanged after each."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    torch_m, flax_m = _pair({**V3, "softcap": 20.0}, seed=16)
    x = random_x((B, 3, D_IN), seed=17)
    # the prompt that fills the cache: Flax's jitted, one program where an eager call
    # compiled some 100 primitives (the refused calls, the test, are eager)
    flax_prompt = nnx.jit(lambda module, x, cache: module(x, cache=cache))
    for module, prompt, wrap in ((torch_m, lambda m, x, cache: m(x, cache=cache), torch.from_numpy),
                                 (flax_m, flax_prompt, jnp.asarray)):
        _, cache = prompt(module, wrap(x[:, :2]), module.init_cache(B, 4))
        before = [_np(t) for t in cache]
        bad_calls = (
            ({"cache": cache, "mask": wrap(np.ones((B, HEADS, 1, 3), bool))}, ValueError, "mask"),
            ({"cache": cache, "implementation": "fused"}, ValueError, "softcap"),
            ({"cache": module.init_cache(B + 1, 4)}, ValueError, "the cache does not fit this call"),
        )
        for kwargs, error, text in bad_calls:
            with pytest.raises(error, match=text):
                module(wrap(x[:, :1]), **kwargs)
        with pytest.raises(ValueError, match=re.escape("the KV cache holds 2 of max_len=4 positions and cannot take 3")):
            module(wrap(x), cache=cache)
        assert all(np.array_equal(_np(a), b) for a, b in zip(cache, before, strict=True))


# --------------------------------------------------------------------------- conversion and errors


@needs_both
@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trips_are_bit_exact(name: str) -> None:
    from parity_tests import to_flax, to_torch

    torch_m, _ = _pair(CONFIGS[name], seed=18)
    back = to_torch(to_flax(torch_m))
    assert back.config == torch_m.config
    for key, value in torch_m.state_dict().items():
        assert np.array_equal(back.state_dict()[key].numpy(), value.numpy()), key


BAD_OPTIONS = [
    ({**V3, "kv_lora_rank": 0}, "kv_lora_rank must be >= 1; got 0"),
    ({**V3, "q_lora_rank": 2.5}, "q_lora_rank must be an int; got float 2.5"),
    ({**V3, "v_head_dim": "5"}, "v_head_dim must be an int; got str '5'"),
    ({**V3, "norm_eps": 0.0}, "norm_eps must be a positive finite float; got 0.0"),
    ({**V3, "attention_bias": 1}, "attention_bias must be a bool; got int 1"),
    ({**V3, "rope": RopeConfig(rotary_dim=6)}, "rope rotary_dim must be <= head_dim 4; got 6"),
]


@needs_both
@pytest.mark.parametrize(("options", "text"), BAD_OPTIONS)
def test_a_bad_option_has_one_error_text(options: dict[str, Any], text: str) -> None:
    """The registry, the torch and the Flax constructors raise the same error."""
    found = constructor_errors(options, "MultiHeadLatentAttention")
    assert len(set(found)) == 1, found
    assert found[0][1] == text


@needs_both
def test_a_bad_call_has_one_error_text() -> None:
    """Cross-attention is refused (the keys come from x's own latent), as positions
    without rope and a non-bool absorb, the same text in both twins."""
    import jax.numpy as jnp
    import torch

    from attention_spec.latent import LATENT_CONTEXT_MESSAGE

    torch_m, flax_m = _pair(V3)
    plain_t, plain_f = _pair({**V3, "rope": None})
    x = random_x((B, T, D_IN))
    for module, plain, wrap in ((torch_m, plain_t, torch.from_numpy), (flax_m, plain_f, jnp.asarray)):
        with pytest.raises(ValueError, match=re.escape(LATENT_CONTEXT_MESSAGE)):
            module(wrap(x), context=wrap(x))
        with pytest.raises(TypeError, match=re.escape("absorb must be a bool; got int 1")):
            module(wrap(x), absorb=1)
        with pytest.raises(ValueError, match="positions= needs a module built with rope="):
            plain(wrap(x), positions=wrap(_positions()))
