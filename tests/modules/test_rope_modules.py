"""Rotary position embeddings in ``MultiHeadAttention`` (``rope=``, ``positions=``), both
twins: the float64 oracle at positions beyond 400, twin against twin (gradients
included), decoding through a KV cache against the full forward, jit, the shared error
texts (raised before any work), ``transformers``' LlamaAttention with the same weights;
and ``apply_rope``'s ``inv_freq=`` override against ``transformers``' own rotary
embedding, bit for bit."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from attention_spec.rope import RopeConfig
from parity_tests.tolerances import GRAD_PARITY, ORACLE, PARITY
from tests.support import needs_both, needs_jax, needs_torch

D_IN = 32
ROPE = RopeConfig(theta=10000.0, partial_rotary_factor=0.5)
BASE: dict[str, Any] = {"d_in": D_IN, "d_out": D_IN, "context_length": None, "dropout": 0.0, "num_heads": 4,
                        "num_kv_heads": 2, "head_dim": 16, "out_bias": False}
ROPES = {
    "half-partial": ROPE,
    "interleaved": RopeConfig(theta=500.0, layout="interleaved"),
    "llama3": RopeConfig(scaling="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=64),
}


def _pair(rope: RopeConfig | None = ROPE, seed: int = 0, **extra: Any) -> tuple[Any, Any]:
    import torch

    import torch_attention
    from parity_tests import to_flax

    torch.manual_seed(seed)
    module = torch_attention.MultiHeadAttention(**{**BASE, **extra}, rope=rope).eval()
    return module, to_flax(module)


def _x(shape: tuple[int, ...] = (2, 6, D_IN), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _positions(batch: int = 2, seq: int = 6) -> np.ndarray:
    """Positions beyond 400, neither contiguous nor the same for every example."""
    return np.stack([400 + 7 * b + np.arange(seq) * (b + 1) ** 2 for b in range(batch)]).astype(np.int64)


# --------------------------------------------------------------------------- options


@needs_both
def test_the_default_is_today_s_module_and_rope_is_static() -> None:
    import torch

    import torch_attention

    torch.manual_seed(0)
    plain = torch_attention.MultiHeadAttention(**BASE)
    assert plain.config["rope"] is None and plain.spec.rope is None
    module, flax_m = _pair()
    assert module.config["rope"] == flax_m.config["rope"] == ROPE
    hash(flax_m.spec)  # static under nnx.jit
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in plain.named_parameters()]


@needs_both
def test_a_rotary_dimension_that_does_not_fit_the_heads_is_refused_by_both() -> None:
    from flax import nnx

    import jax_attention
    import torch_attention

    texts = []
    for build in (lambda **k: torch_attention.MultiHeadAttention(**k),
                  lambda **k: jax_attention.MultiHeadAttention(**k, rngs=nnx.Rngs(0))):
        with pytest.raises(ValueError) as err:
            build(**BASE, rope=RopeConfig(rotary_dim=18))
        texts.append(str(err.value))
        with pytest.raises(TypeError, match="rope must be a RopeConfig"):
            build(**BASE, rope={"theta": 10000.0})
    assert texts[0] == texts[1] == "rope rotary_dim must be <= head_dim 16; got 18"


# --------------------------------------------------------------------------- numbers


def _oracle(module: Any, x: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
    from parity_tests import reference

    params = {k: v.detach().double().numpy() for k, v in module.state_dict().items()}
    return reference.forward("MultiHeadAttention", module.config, params, x.astype(np.float64),
                             positions=positions)[0]


@needs_both
@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("implementation", ["reference", "fused", "blockwise", "auto"])
def test_oracle_and_twin_at_positions_beyond_400(name: str, implementation: str) -> None:
    """Both twins against the float64 oracle at positions 400.. (per example, gapped),
    and twin against twin for the input gradient."""
    import jax
    import torch

    module, flax_m = _pair(ROPES[name], seed=1, implementation=implementation)
    x, pos = _x(seed=2), _positions()
    want = _oracle(module, x, pos)
    tol, gtol = ORACLE["float32"], GRAD_PARITY["float32"]
    xt = torch.from_numpy(x).requires_grad_(True)
    got_t = module(xt, positions=torch.from_numpy(pos))
    cot = _x(seed=3)
    (got_t * torch.from_numpy(cot)).sum().backward()
    got_f = flax_m(x, positions=pos)
    grad_f = jax.grad(lambda x_: (flax_m(x_, positions=pos) * cot).sum())(x)
    for got in (got_t.detach().numpy(), np.asarray(got_f)):
        np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    assert xt.grad is not None
    scale = np.abs(xt.grad.numpy()).max()
    assert np.abs(np.asarray(grad_f) - xt.grad.numpy()).max() <= gtol.atol + gtol.rtol * scale
    # RoPE is relative: without positions (0..T-1) the output differs at these gapped ones
    assert not np.allclose(module(torch.from_numpy(x)).detach().numpy(), want, rtol=tol.rtol, atol=tol.atol)


@needs_both
def test_unbatched_and_shared_positions() -> None:
    import torch

    module, flax_m = _pair()
    x, pos = _x(seed=4), _positions()[:1]
    want = _oracle(module, x, pos)  # (1, T): shared by every example
    tol = ORACLE["float32"]
    np.testing.assert_allclose(module(torch.from_numpy(x), positions=torch.from_numpy(pos)).detach().numpy(),
                               want, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(np.asarray(flax_m(x, positions=pos)), want, rtol=tol.rtol, atol=tol.atol)
    one = module(torch.from_numpy(x[0]), positions=torch.from_numpy(pos[0])).detach().numpy()
    np.testing.assert_allclose(one, want[0], rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(np.asarray(flax_m(x[0], positions=pos[0])), want[0], rtol=tol.rtol, atol=tol.atol)


@needs_both
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.slow  # the quick tier shows this feature in another test
def test_decoding_with_the_cache_equals_the_full_forward(explicit: bool) -> None:
    """A prompt of 3 tokens then single steps through a cache: the positions continue
    from each example's fill (or are given: the same numbers), in both twins."""
    import torch

    torch_m, flax_m = _pair(seed=5)
    x = _x(seed=6)
    steps = np.arange(6)[None].repeat(2, 0)
    full = torch_m(torch.from_numpy(x)).detach().numpy()
    tol = PARITY["float32"]
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, np.asarray)):
        cache = module.init_cache(2, 8)
        outs = []
        for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6)):
            extra = {"positions": wrap(steps[:, start:stop])} if explicit else {}
            out, cache = module(wrap(x[:, start:stop]), cache=cache, **extra)
            outs.append(np.asarray(out.detach() if isinstance(out, torch.Tensor) else out))
        np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=tol.rtol, atol=tol.atol)


@needs_both
def test_a_padded_prompt_continues_from_each_example_s_fill() -> None:
    """Example 1's prompt has 2 valid tokens of 3: its next token sits at position 2, and
    gives the full forward of its 3 real tokens."""
    import torch

    torch_m, flax_m = _pair(seed=7)
    x = _x((2, 4, D_IN), seed=8)
    real = np.concatenate([x[1:, :2], x[1:, 3:4]], axis=1)  # example 1's tokens, padding dropped
    want = torch_m(torch.from_numpy(real)).detach().numpy()[0, -1]
    tol = PARITY["float32"]
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, np.asarray)):
        cache = module.init_cache(2, 6)
        _, cache = module(wrap(x[:, :3]), cache=cache, kv_lengths=wrap(np.array([3, 2])))
        out, cache = module(wrap(x[:, 3:4]), cache=cache)
        out = np.asarray(out.detach() if isinstance(out, torch.Tensor) else out)
        np.testing.assert_allclose(out[1, 0], want, rtol=tol.rtol, atol=tol.atol)


@needs_jax
def test_under_nnx_jit_positions_are_traced() -> None:
    from flax import nnx

    import jax_attention

    module = jax_attention.MultiHeadAttention(**BASE, rope=ROPE, rngs=nnx.Rngs(0))
    x, pos = _x(seed=9), _positions()

    @nnx.jit
    def step(m: Any, x: Any, pos: Any) -> Any:
        return m(x, positions=pos)

    np.testing.assert_allclose(np.asarray(step(module, x, pos)), np.asarray(module(x, positions=pos)),
                               rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(step(module, x, pos + 5)), np.asarray(module(x, positions=pos + 5)),
                               rtol=2e-6, atol=2e-6)

    @nnx.jit
    def decode(m: Any, x: Any, cache: Any) -> Any:  # the positions follow the traced fill
        return m(x, cache=cache)

    cache, outs = module.init_cache(2, 8), []
    for start, stop in ((0, 3), (3, 4), (4, 6)):
        out, cache = decode(module, x[:, start:stop], cache)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(module(x)),
                               rtol=PARITY["float32"].rtol, atol=PARITY["float32"].atol)


# --------------------------------------------------------------------------- errors


def _call_errors(module: Any, wrap: Any, x: np.ndarray, cache: Any, **kwargs: Any) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as err:
        module(wrap(x), cache=cache, **kwargs)
    return type(err.value), str(err.value)


@needs_both
@pytest.mark.parametrize(
    ("rope", "kwargs", "error", "text"),
    [
        (None, {"positions": np.zeros((2, 2), np.int64)}, ValueError,
         "positions= needs a module built with rope= (rotary position embeddings); this one has none"),
        (ROPE, {"positions": np.zeros((2, 3), np.int64)}, ValueError,
         "positions must have shape (2, 2) or (1, 2) (x's leading dimensions); got shape (2, 3)"),
        (ROPE, {"positions": np.zeros((2,), np.int64)}, ValueError,
         "positions must have shape (2, 2) or (1, 2) (x's leading dimensions); got shape (2,)"),
        (ROPE, {"positions": np.zeros((2, 2), np.float32)}, TypeError,
         "rope positions must be integers; got dtype float32"),
    ],
)
def test_bad_positions_one_text_before_any_work(rope: Any, kwargs: dict[str, Any], error: type, text: str) -> None:
    """Both twins raise the same text, and the cache is left as it was."""
    import torch

    torch_m, flax_m = _pair(rope)
    x = _x((2, 2, D_IN))
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, np.asarray)):
        cache = module.init_cache(2, 4)
        before = [np.array(np.asarray(t)) for t in cache]
        got = _call_errors(module, wrap, x, cache, **{k: wrap(v) for k, v in kwargs.items()})
        assert got == (error, text)
        assert all(np.array_equal(np.asarray(a), b) for a, b in zip(cache, before, strict=True))


@needs_both
def test_rope_refuses_cross_attention() -> None:
    import torch

    from attention_spec.rope import ROPE_WITH_CONTEXT

    torch_m, flax_m = _pair()
    x = _x((2, 2, D_IN))
    for module, wrap in ((torch_m, torch.from_numpy), (flax_m, np.asarray)):
        with pytest.raises(ValueError, match=re.escape(ROPE_WITH_CONTEXT)):
            module(wrap(x), context=wrap(_x((2, 5, D_IN))))


# --------------------------------------------------------------------------- transformers


@needs_torch
def test_apply_rope_with_transformers_inv_freq_is_bit_for_bit() -> None:
    """transformers computes inv_freq in float32 arithmetic (a few ulps from ours); with
    its buffer passed as ``inv_freq=``, torch's apply_rope is its apply_rotary_pos_emb,
    bit for bit, at positions 400..1500; the JAX twin agrees within float32 parity."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from torch_attention.functional import apply_rope

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, rope_theta=10000.0)
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(400, 1501)[None]
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, positions.shape[1], 32, generator=gen), torch.randn(1, 2, positions.shape[1], 32,
                                                                                  generator=gen)
    cos, sin = rotary(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    buffer = rotary.inv_freq
    assert torch.equal(apply_rope(q, positions, RopeConfig(), inv_freq=buffer), want_q)
    assert torch.equal(apply_rope(k, positions, RopeConfig(), inv_freq=buffer), want_k)
    assert not torch.equal(apply_rope(q, positions, RopeConfig()), want_q)  # why the override exists
    try:
        from jax_attention.functional import apply_rope as apply_rope_jax
    except ImportError:
        return
    got = np.asarray(apply_rope_jax(q.numpy(), positions.numpy(), RopeConfig(), inv_freq=buffer.numpy()))
    np.testing.assert_allclose(got, want_q.numpy(), rtol=PARITY["float32"].rtol, atol=PARITY["float32"].atol)


@needs_both
def test_inv_freq_of_the_wrong_shape_or_dtype_one_text() -> None:
    import torch

    from jax_attention.functional import apply_rope as apply_jax
    from torch_attention.functional import apply_rope as apply_torch

    x, pos = np.zeros((1, 1, 3, 8), np.float32), np.arange(3)[None]
    for apply, wrap in ((apply_torch, torch.from_numpy), (apply_jax, np.asarray)):
        with pytest.raises(ValueError, match=re.escape("rope inv_freq must have shape (rotary_dim / 2,) = (4,); "
                                                       "got shape (3,)")):
            apply(wrap(x), wrap(pos), RopeConfig(), inv_freq=wrap(np.ones(3, np.float32)))
        with pytest.raises(TypeError, match="rope inv_freq must be floating point; got dtype int32"):
            apply(wrap(x), wrap(pos), RopeConfig(), inv_freq=wrap(np.ones(4, np.int32)))


@needs_torch
@needs_both
def test_llama_attention_with_the_same_weights_at_positions_beyond_400() -> None:
    """``transformers``' LlamaAttention (grouped heads, head_dim, no biases) with our
    weights at positions 400..400+T and a causal mask: both twins give its output, and its
    input gradient, within float32 parity: its rotary embedding keeps its own frequencies
    (computed in float32 arithmetic, a few ulps from ours: well inside the tolerance at
    these positions; ``apply_rope(..., inv_freq=)`` takes such a buffer where bits
    matter)."""
    import jax
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from attention_spec.rope import rope_from_hf

    config = LlamaConfig(hidden_size=D_IN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         attention_bias=False, attention_dropout=0.0, rope_theta=10000.0)
    config._attn_implementation = "eager"
    torch.manual_seed(6)
    llama = LlamaAttention(config, layer_idx=0).eval()
    rotary = LlamaRotaryEmbedding(config)
    rope = rope_from_hf(config)
    assert rope == RopeConfig(theta=10000.0)
    ours, flax_m = _pair(rope)
    ours.load_state_dict({"W_query.weight": llama.q_proj.weight, "W_key.weight": llama.k_proj.weight,
                          "W_value.weight": llama.v_proj.weight, "out_proj.weight": llama.o_proj.weight})
    from parity_tests import to_flax

    flax_m = to_flax(ours)
    x = torch.from_numpy(_x(seed=7)).requires_grad_(True)
    t = x.shape[1]
    positions = torch.arange(400, 400 + t)[None]
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    want = llama(x, position_embeddings=rotary(x, positions), attention_mask=causal)[0]
    cot = _x(seed=8)
    (want * torch.from_numpy(cot)).sum().backward()
    x_ours = x.detach().clone().requires_grad_(True)
    got = ours(x_ours, positions=positions)
    (got * torch.from_numpy(cot)).sum().backward()
    tol, gtol = PARITY["float32"], GRAD_PARITY["float32"]
    assert torch.allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    assert x.grad is not None and x_ours.grad is not None
    assert torch.allclose(x_ours.grad, x.grad, rtol=tol.rtol, atol=tol.atol)
    xs, pos = x.detach().numpy(), positions.numpy()
    np.testing.assert_allclose(np.asarray(flax_m(xs, positions=pos)), want.detach().numpy(),
                               rtol=tol.rtol, atol=tol.atol)
    grad_f = np.asarray(jax.grad(lambda x_: (flax_m(x_, positions=pos) * cot).sum())(xs))
    assert np.abs(grad_f - x.grad.numpy()).max() <= gtol.atol + gtol.rtol * np.abs(x.grad.numpy()).max()


@needs_torch
@needs_both
def test_a_ports_own_inv_freq_in_the_config_turns_as_llama_does_at_position_1500() -> None:
    """``RopeConfig(inv_freq=...)`` with transformers' own float32 frequencies (Llama 3's
    theta): the module's rotation of q and k is transformers' bit for bit at positions
    1490..1497, where the float64 formula rounded once is up to 1e-3 away; the whole layer
    (reference path) is then closer to LlamaAttention than without them.  The frequencies
    are configuration: the Flax twin (``to_flax``) turns by them too, and a module cast to
    bfloat16 keeps them whole."""
    import copy
    import dataclasses

    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from attention_spec.rope import rope_from_hf
    from parity_tests import to_flax
    from torch_attention.functional import apply_rope

    config = LlamaConfig(hidden_size=D_IN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         attention_bias=False, attention_dropout=0.0, rope_theta=500000.0)
    config._attn_implementation = "eager"
    torch.manual_seed(6)
    llama = LlamaAttention(config, layer_idx=0).eval()
    rotary = LlamaRotaryEmbedding(config)
    rope = dataclasses.replace(rope_from_hf(config), inv_freq=tuple(rotary.inv_freq.tolist()))
    weights = {"W_query.weight": llama.q_proj.weight * 4, "W_key.weight": llama.k_proj.weight * 4,
               "W_value.weight": llama.v_proj.weight, "out_proj.weight": llama.o_proj.weight}
    with torch.no_grad():
        llama.q_proj.weight.mul_(4)
        llama.k_proj.weight.mul_(4)
    ours, _ = _pair(rope, causal=False, implementation="reference")
    plain, _ = _pair(rope_from_hf(config), causal=False, implementation="reference")
    for m in (ours, plain):
        m.load_state_dict(weights)
    x = torch.from_numpy(_x(seed=7))
    positions = torch.arange(1490, 1490 + x.shape[1])[None]
    with torch.no_grad():
        q = llama.q_proj(x).view(2, -1, 4, 16).transpose(1, 2)
        cos, sin = rotary(x, positions)
        want_q = apply_rotary_pos_emb(q, q, cos, sin)[0]
        assert torch.equal(apply_rope(q, positions, ours.spec.rope), want_q)
        assert (apply_rope(q, positions, plain.spec.rope) - want_q).abs().max() > 1e-5
        want = llama(x, position_embeddings=(cos, sin), attention_mask=None)[0]
        error = (ours(x, positions=positions) - want).abs().max()
        assert error < (plain(x, positions=positions) - want).abs().max()
        assert copy.deepcopy(ours).to(torch.bfloat16).spec.rope.inv_freq == rope.inv_freq
    tol = PARITY["float32"]
    assert error <= tol.atol + tol.rtol * want.abs().max()
    flax_m = to_flax(ours)
    assert flax_m.spec.rope == rope
    np.testing.assert_allclose(np.asarray(flax_m(x.numpy(), positions=positions.numpy())), want.numpy(),
                               rtol=tol.rtol, atol=tol.atol)


def test_inv_freq_in_the_config_is_checked() -> None:
    """The frequencies of a RopeConfig: numbers >= 0 (0: a pair that never turns, as
    proportional rope's), rotary_dim / 2 of them, not
    with a scaling that follows the sequence length; the attention factor stays yarn's."""
    from attention_spec.rope import inv_freq

    with pytest.raises(ValueError, match=re.escape("rope inv_freq needs rotary_dim / 2 = 8 entries; got 3")):
        inv_freq(RopeConfig(inv_freq=(1.0, 0.5, 0.25)), 16)
    with pytest.raises(ValueError, match="rope inv_freq entries must be a finite number >= 0"):
        RopeConfig(inv_freq=(1.0, -0.5))
    assert RopeConfig(inv_freq=(1.0, 0.0)).inv_freq == (1.0, 0.0)
    with pytest.raises(ValueError, match="rope inv_freq cannot be fixed with scaling 'dynamic'"):
        RopeConfig(scaling="dynamic", factor=2.0, original_max_position_embeddings=8, inv_freq=(1.0,) * 8)
    yarn = RopeConfig(scaling="yarn", factor=4.0, original_max_position_embeddings=64)
    freqs, factor = inv_freq(yarn, 16)
    fixed = RopeConfig(scaling="yarn", factor=4.0, original_max_position_embeddings=64,
                       inv_freq=np.float32(freqs).tolist())
    got, got_factor = inv_freq(fixed, 16)
    assert got_factor == factor and np.array_equal(got, np.float32(freqs).astype(np.float64))


@needs_both
def test_the_native_exports_refuse_rope() -> None:
    """nn.MultiheadAttention and Flax's attention have no rotary embedding: an export of a
    module built with rope= is refused, naming it."""
    from jax_attention import interop as jax_interop
    from torch_attention import interop as torch_interop

    torch_m, flax_m = _pair(num_kv_heads=None, head_dim=None, out_bias=True, causal=False)
    with pytest.raises(ValueError, match=re.escape("(nn.MultiheadAttention cannot express it; only rope=None")):
        torch_interop.to_nn_multihead(torch_m)
    with pytest.raises(ValueError, match=re.escape("(nnx.MultiHeadAttention cannot express it; only rope=None")):
        jax_interop.to_nnx_multihead(flax_m)


@needs_both
def test_with_qk_norm_the_norm_comes_first() -> None:
    """qk-norm then RoPE (Qwen3's order): both twins against the float64 oracle, which
    normalises the projections and then turns the heads."""
    import torch

    module, flax_m = _pair(seed=11, qk_norm="rms")
    with torch.no_grad():
        module.q_norm.weight.uniform_(0.5, 1.5)
        module.k_norm.weight.uniform_(0.5, 1.5)
    from parity_tests import to_flax

    flax_m = to_flax(module)
    x, pos = _x(seed=12), _positions()
    want = _oracle(module, x, pos)
    tol = ORACLE["float32"]
    np.testing.assert_allclose(module(torch.from_numpy(x), positions=torch.from_numpy(pos)).detach().numpy(),
                               want, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(np.asarray(flax_m(x, positions=pos)), want, rtol=tol.rtol, atol=tol.atol)
