"""OLMo's ``clip_qkv`` and Qwen3-Next's output gate on ``MultiHeadAttention``, both twins.

``clip_qkv=c``: the q, k and v projections' outputs, biases added, clamped to [-c, c]
before qk-norm and rope, with ``torch.clamp``'s gradient (1 inside, the bounds included; 0
outside).  ``output_gate=True``: ``W_query`` has ``2 * num_heads * head_dim`` outputs,
each head's queries then its gate (Hugging Face's ``q_proj`` as it lies); the merged
heads times ``sigmoid(gate)`` before ``out_proj``.

Here: numbers computed by hand, the float64 oracle on every path (with the twins against
each other, gradients included), finite differences of the oracle, cached decoding against
the whole sequence (eager and, in Flax, a jitted step), the exporters' refusals by name,
and transformers' own ``Qwen3NextAttention`` and ``OlmoAttention`` at positions past 400.
The parity matrix runs ``mha-clip-qknorm`` and ``mha-gate-gqa``; bad values are in the
error table (``tests/modules/test_errors.py``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import PARITY
from tests.support import (
    assert_input_gradient_matches_finite_differences,
    assert_paths_and_twin,
    decode_in_steps,
    mha_oracle,
    needs_both,
    random_x,
    small_mha_pair,
)

PATHS = ("reference", "fused", "blockwise", "auto")
# Both mechanisms with grouped heads, a qk-norm that the clamp changes and partial rope:
# d_in 16, 4 heads of 8, 2 key/value heads.
BOTH: dict[str, Any] = {"num_kv_heads": 2, "clip_qkv": 0.6, "output_gate": True, "qk_norm": "rms"}


def _x(batch: int = 2, seq: int = 5, width: int = 16, seed: int = 0) -> np.ndarray:
    return random_x((batch, seq, width), seed)


def _pair(**options: Any) -> tuple[Any, Any]:
    """A torch MultiHeadAttention (eval, d_in 16, 4 heads) and its Flax twin, the same weights."""
    return small_mha_pair(3, **options)


_oracle = mha_oracle


# --------------------------------------------------------------------------- by hand


@needs_both
def test_clip_qkv_by_hand() -> None:
    """One head of 2, W = [[0, 1], [2, 3]] for q, k and v, clip_qkv=1: x0 = [1, 0]
    projects to [0, 2] -> [0, 1]; x1 = [0, 1] to [1, 3] -> [1, 1].  Causal: out0 = v0 =
    [0, 1]; query 1 scores q1.k0 / sqrt(2) = 1/sqrt(2) and q1.k1 / sqrt(2) = sqrt(2), so
    out1 = [sigmoid(1/sqrt(2)), 1].  (Unclipped, out0 would be [0, 2].)"""
    import jax.numpy as jnp
    import torch

    import torch_attention
    from parity_tests import to_flax

    m = torch_attention.MultiHeadAttention(2, 2, None, 0.0, 1, False, out_proj=False, clip_qkv=1.0)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            getattr(m, name).weight.copy_(torch.arange(4.0).reshape(2, 2))
    x = np.eye(2, dtype=np.float32)[None]
    want = np.array([[[0.0, 1.0], [1 / (1 + math.exp(-1 / math.sqrt(2))), 1.0]]])
    np.testing.assert_allclose(m(torch.from_numpy(x)).detach().numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(to_flax(m)(jnp.asarray(x))), want, rtol=1e-6)


@needs_both
def test_output_gate_by_hand() -> None:
    """Two heads of 1: W_query = arange(8).reshape(4, 2), rows [q0, g0, q1, g1] (each
    head's query, then its gate), W_key = W_value = I.  x0 = [1, 1]: one key, so out0 =
    v0 * sigmoid(gate) = [sigmoid(2 + 3), sigmoid(6 + 7)].  x1 = [1, -1]: head 0's keys
    are 1 and 1 (weights 1/2), value (1 + 1) / 2 = 1; head 1's query is 4 - 5 = -1, keys 1
    and -1, values 1 and -1: -tanh(1); both gates -1.  (Read as [queries; gates] instead,
    out0 would be [sigmoid(9), sigmoid(13)].)"""
    import jax.numpy as jnp
    import torch

    import torch_attention
    from parity_tests import to_flax

    m = torch_attention.MultiHeadAttention(2, 2, None, 0.0, 2, False, out_proj=False, output_gate=True)
    assert tuple(m.W_query.weight.shape) == (4, 2)
    with torch.no_grad():
        m.W_query.weight.copy_(torch.arange(8.0).reshape(4, 2))
        m.W_key.weight.copy_(torch.eye(2))
        m.W_value.weight.copy_(torch.eye(2))
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    want = np.array([[[sig(5), sig(13)], [sig(-1), -math.tanh(1) * sig(-1)]]])
    x = np.array([[[1.0, 1.0], [1.0, -1.0]]], np.float32)
    np.testing.assert_allclose(m(torch.from_numpy(x)).detach().numpy(), want, rtol=1e-6)
    flax_m = to_flax(m)
    assert flax_m.W_query.kernel[...].shape == (2, 4)
    np.testing.assert_allclose(np.asarray(flax_m(jnp.asarray(x))), want, rtol=1e-6)


@needs_both
def test_clamp_gradient_is_torch_clamps_in_both_twins() -> None:
    """1 inside [-c, c], the bounds included (``jnp.clip``'s gives 1/2 there), 0 outside."""
    import jax
    import jax.numpy as jnp
    import torch

    from jax_attention._projections import clip as jax_clip
    from torch_attention._projections import clip as torch_clip

    values = [-3.0, -2.0, 0.5, 2.0, 3.0]
    t = torch.tensor(values, requires_grad=True)
    torch_clip(t, 2.0).sum().backward()
    assert t.grad is not None
    want = [0.0, 1.0, 1.0, 1.0, 0.0]
    assert t.grad.tolist() == want
    assert np.asarray(jax.grad(lambda a: jax_clip(a, 2.0).sum())(jnp.asarray(values))).tolist() == want


# --------------------------------------------------------------------------- oracle and twins


@needs_both
def test_every_path_against_the_oracle_and_the_twin() -> None:
    """Both options with grouped heads, qk-norm and partial rope at positions past 400:
    each twin's output on every path against the float64 oracle; output and gradients
    (input and every parameter) twin against twin on ``auto`` (the matrix's
    ``mha-clip-qknorm`` and ``mha-gate-gqa`` run gradients on every path)."""
    torch_m, flax_m = _pair(**BOTH)
    x = _x()
    positions = 401 + np.arange(5)[None] + 7 * np.arange(2)[:, None]
    want = _oracle(torch_m, x, positions)
    assert_paths_and_twin(torch_m, flax_m, x, positions, want, PATHS)


@needs_both
def test_gradients_against_finite_differences_of_the_oracle() -> None:
    """d sum(out * cot) / dx of the torch twin in float64 against central differences of
    the float64 oracle (the clamp's gradient is zero outside: an element clipped moves
    nothing), and of the parameters of W_query (queries and gate) twin against twin."""
    import copy

    import torch

    torch_m, _ = _pair(**BOTH)
    m64 = copy.deepcopy(torch_m).double()
    x = _x(1, 3).astype(np.float64)
    assert_input_gradient_matches_finite_differences(m64, x, _oracle)
    # some of W_query's outputs are clipped (their rows get no gradient from them)
    with torch.no_grad():
        projected = m64.W_query(torch.from_numpy(x))
    assert bool((projected.abs() > BOTH["clip_qkv"]).any()) and bool((projected.abs() < BOTH["clip_qkv"]).any())


# --------------------------------------------------------------------------- cached decoding


@needs_both
def test_cached_decoding_equals_the_whole_sequence() -> None:
    """A prompt of 3 then one token at a time, each twin (Flax: jitted steps), equals the
    whole sequence's forward (the gate of each step is its own), grouped heads."""
    import torch

    torch_m, flax_m = _pair(**BOTH)
    x = _x(2, 7, seed=4)
    whole = torch_m(torch.from_numpy(x)).detach().numpy()
    tol = PARITY["float32"]
    np.testing.assert_allclose(decode_in_steps(torch_m, x, 3, 12), whole, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(decode_in_steps(flax_m, x, 3, 12), whole, rtol=tol.rtol, atol=tol.atol)


# --------------------------------------------------------------------------- exporters


@needs_both
def test_exporters_refuse_them_by_name() -> None:
    """nn.MultiheadAttention, nnx.MultiHeadAttention and Linen's module express neither:
    each exporter names the option (the allow-lists of ``attention_spec.interop.native``)."""
    import jax_attention
    import torch_attention
    from jax_attention import interop as jax_interop
    from torch_attention import interop as torch_interop

    for option, value in (("clip_qkv", 0.5), ("output_gate", True)):
        default = {"clip_qkv": None, "output_gate": False}[option]
        text = f"{option}={value!r} (%s cannot express it; only {option}={default!r} converts)"
        ours = torch_attention.MultiHeadAttention(8, 8, None, 0.0, 2, True, causal=False, **{option: value})
        with pytest.raises(ValueError, match=__import__("re").escape(text % "nn.MultiheadAttention")):
            torch_interop.to_nn_multihead(ours)
        from flax import nnx

        flax_ours = jax_attention.MultiHeadAttention(8, 8, None, 0.0, 2, True, causal=False, rngs=nnx.Rngs(0),
                                                     **{option: value})
        for export, target in ((jax_interop.to_nnx_multihead, "nnx.MultiHeadAttention"),
                               (jax_interop.to_linen_multihead, "Linen MultiHeadDotProductAttention")):
            with pytest.raises(ValueError, match=__import__("re").escape(f"{option}={value!r} ({target}")):
                export(flax_ours)


# --------------------------------------------------------------------------- transformers' layers


def _randomise(layer: Any, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)


def _against_hf(hf: Any, rotary: Any, options: dict[str, Any], names: dict[str, str], seed: int) -> None:
    """``hf`` (eager) and both twins with its weights copied by name as they are (HF ->
    ours): outputs at positions 401.. (example 1 at 409..), causal, and the gradients of
    the input and of every weight (the gate's rows of q_proj and W_query included)."""
    import jax.numpy as jnp
    import torch

    import torch_attention
    from attention_spec.rope import rope_from_hf
    from parity_tests import to_flax

    _randomise(hf, seed)
    hf.eval()
    ours = torch_attention.MultiHeadAttention(**options, rope=rope_from_hf(hf.config)).eval()
    hf_state = hf.state_dict()
    ours.load_state_dict({f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in hf_state.items()})
    x = _x(2, 6, seed=seed)
    positions = torch.from_numpy(401 + np.arange(6)[None] + 8 * np.arange(2)[:, None])
    cos, sin = rotary(torch.from_numpy(x), positions)
    causal = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    x_hf = torch.from_numpy(x).requires_grad_(True)
    want = hf(x_hf, position_embeddings=(cos, sin), attention_mask=causal)[0]
    cot = torch.from_numpy(_x(2, 6, seed=seed + 1))
    (want * cot).sum().backward()
    x_ours = torch.from_numpy(x).requires_grad_(True)
    got = ours(x_ours, positions=positions)
    (got * cot).sum().backward()
    tol = PARITY["float32"]
    torch.testing.assert_close(got, want, rtol=tol.rtol, atol=tol.atol)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=tol.rtol, atol=tol.atol)
    mine = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        ours_name = f"{names[name.split('.')[0]]}.{name.split('.')[1]}"
        torch.testing.assert_close(mine[ours_name].grad, p.grad, rtol=tol.rtol, atol=tol.atol, msg=ours_name)
    from flax import nnx

    flax_out = nnx.jit(lambda m, x, p: m(x, positions=p))(to_flax(ours), jnp.asarray(x), jnp.asarray(positions.numpy()))
    np.testing.assert_allclose(np.asarray(flax_out), want.detach().numpy(), rtol=tol.rtol, atol=tol.atol)


_QKVO = {"q_proj": "W_query", "k_proj": "W_key", "v_proj": "W_value", "o_proj": "out_proj"}


@needs_both
def test_qwen3_next_attention() -> None:
    """Qwen3-Next's full-attention layer: q_proj (queries and gate per head) is W_query as
    it is, 1 + w RMSNorms per head, a quarter of each head turning, grouped heads."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextAttention,
        Qwen3NextRotaryEmbedding,
    )

    config = Qwen3NextConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_hidden_layers=1, attn_implementation="eager")
    hf = Qwen3NextAttention(config, layer_idx=0)
    options = {"d_in": 16, "d_out": 16, "context_length": None, "dropout": 0.0, "num_heads": 4, "qkv_bias": False,
               "num_kv_heads": 2, "head_dim": 8, "out_bias": False, "output_gate": True, "qk_norm": "rms",
               "qk_norm_eps": config.rms_norm_eps, "qk_norm_offset": 1.0}
    _against_hf(hf, Qwen3NextRotaryEmbedding(config), options, {**_QKVO, "q_norm": "q_norm", "k_norm": "k_norm"},
                seed=11)


@needs_both
def test_olmo_attention_with_clip_qkv() -> None:
    """OLMo's layer with clip_qkv=0.5 (the projections, std about 1.6 here, mostly clipped)."""
    from transformers import OlmoConfig
    from transformers.models.olmo.modeling_olmo import OlmoAttention, OlmoRotaryEmbedding

    config = OlmoConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, clip_qkv=0.5,
                        num_hidden_layers=1, attention_bias=True, attn_implementation="eager")
    hf = OlmoAttention(config, layer_idx=0)
    options = {"d_in": 16, "d_out": 16, "context_length": None, "dropout": 0.0, "num_heads": 4, "qkv_bias": True,
               "num_kv_heads": 2, "clip_qkv": config.clip_qkv}
    _against_hf(hf, OlmoRotaryEmbedding(config), options, _QKVO, seed=12)
