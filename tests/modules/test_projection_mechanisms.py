"""2026's projection-level mechanisms on ``MultiHeadAttention``, both twins.

``qk_norm_weight=False``: a weightless RMS qk-norm (nanochat's ``NanoChatRMSNorm``, Llama
4's ``Llama4TextL2Norm``), no parameter.  ``v_norm="rms"``: Gemma 4's weightless value
norm per head.  ``values_from_keys=True``: Gemma 4's ``attention_k_eq_v``, no ``W_value``,
the values are W_key's output before k-norm and rope.  ``query_scale=QueryScale(beta,
floor, offset)``: the queries at position p times ``1 + beta log1p(floor((p + offset) /
floor))`` after rope and qk-norm (Llama 4's temperature tuning on its NoPE layers,
Ministral 3's ``llama_4_scaling_beta``).

Here: numbers by hand (tiny arange weights), the float64 oracle on every path (which norms
after rope, where the families do: the twins norm before, the same to rounding), twin
against twin with gradients, cached decoding against the whole sequence (Flax jitted),
the exporters' refusals by name, and transformers' own Gemma4TextAttention,
Llama4TextAttention (a NoPE layer with temperature tuning, a rope layer with its L2 norm),
Ministral3Attention and NanoChatAttention at positions past 400.  The matrix runs
``mha-k-eq-v-qscale``; bad values are in the error table (``tests/modules/test_errors.py``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import ORACLE, PARITY
from tests.support import decode_in_steps, mha_oracle, needs_both, needs_torch, random_x, small_mha_pair

PATHS = ("reference", "fused", "blockwise", "auto")
# Positions past Llama 4's floor_scale (8192), where its scale is no longer 1.
FAR = 8189 + np.arange(5)[None] + 7 * np.arange(2)[:, None]
# Gemma 4's global layer; a Llama 4 NoPE layer (weightless norm, temperature tuning); a
# rope layer with all four (Ministral 3's offset 0).
GEMMA4: dict[str, Any] = {"values_from_keys": True, "v_norm": "rms", "qk_norm": "rms", "num_kv_heads": 2}
NOPE: dict[str, Any] = {"qk_norm": "rms", "qk_norm_weight": False, "query_scale": (0.1, 8192, 1), "rope": None}
ALL: dict[str, Any] = {**GEMMA4, "qk_norm_weight": False, "query_scale": (0.5, 8192, 0)}


def _x(batch: int = 2, seq: int = 5, width: int = 16, seed: int = 0) -> np.ndarray:
    return random_x((batch, seq, width), seed)


def _pair(**options: Any) -> tuple[Any, Any]:
    """A torch MultiHeadAttention (eval, d_in 16, 4 heads of 4) and its Flax twin."""
    return small_mha_pair(5, **options)


_oracle = mha_oracle


def _set(m: Any, **weights: Any) -> None:
    import torch

    with torch.no_grad():
        for name, w in weights.items():
            getattr(m, name).weight.copy_(torch.as_tensor(w, dtype=torch.float32))


# --------------------------------------------------------------------------- by hand


@needs_both
def test_weightless_qk_norm_by_hand() -> None:
    """One head of 2, W_query = W_key = [[0, 1], [2, 3]], W_value = I: x0 = [1, 0] gives
    q0 = k0 = [0, 2] -> [0, sqrt 2]; x1 = [0, 1] gives [1, 3] -> [1, 3] / sqrt 5.  Causal:
    out0 = v0 = [1, 0]; query 1 scores 3 / sqrt 5 and sqrt 2, so out1 = softmax of them.
    No q_norm or k_norm parameter."""
    import jax.numpy as jnp
    import torch

    import torch_attention
    from parity_tests import to_flax

    m = torch_attention.MultiHeadAttention(2, 2, None, 0.0, 1, False, out_proj=False, qk_norm="rms",
                                           qk_norm_weight=False, qk_norm_eps=1e-12)
    assert list(m.state_dict()) == ["W_query.weight", "W_key.weight", "W_value.weight"]
    _set(m, W_query=np.arange(4.0).reshape(2, 2), W_key=np.arange(4.0).reshape(2, 2), W_value=np.eye(2))
    w = np.exp([3 / math.sqrt(5), math.sqrt(2)])
    want = np.array([[[1.0, 0.0], w / w.sum()]])
    x = np.eye(2, dtype=np.float32)[None]
    np.testing.assert_allclose(m(torch.from_numpy(x)).detach().numpy(), want, rtol=1e-6)
    flax_m = to_flax(m)
    assert "q_norm" not in vars(flax_m) and "k_norm" not in vars(flax_m)
    np.testing.assert_allclose(np.asarray(flax_m(jnp.asarray(x))), want, rtol=1e-6)


@needs_both
def test_values_from_keys_and_v_norm_by_hand() -> None:
    """No W_value.  W_query = 0 (every key weighs the same), W_key = [[0, 1], [2, 3]]:
    k0 = [0, 2], k1 = [1, 3] are the values, out1 = their mean [0.5, 2.5], though k_norm
    (weight 5) scales the keys: the values are taken before it.  With v_norm each value
    is RMS-normed first: v0 = [0, sqrt 2], v1 = [1, 3] / sqrt 5."""
    import jax.numpy as jnp
    import torch

    import torch_attention
    from parity_tests import to_flax

    x = np.eye(2, dtype=np.float32)[None]
    v0, v1 = np.array([0.0, math.sqrt(2)]), np.array([1.0, 3.0]) / math.sqrt(5)
    for v_norm, want in ((None, [[0.0, 2.0], [0.5, 2.5]]), ("rms", [v0, (v0 + v1) / 2])):
        m = torch_attention.MultiHeadAttention(2, 2, None, 0.0, 1, False, out_proj=False, values_from_keys=True,
                                               v_norm=v_norm, qk_norm="rms", qk_norm_eps=1e-12)
        assert m.W_value is None and "W_value.weight" not in m.state_dict()
        _set(m, W_query=np.zeros((2, 2)), W_key=np.arange(4.0).reshape(2, 2), k_norm=np.full(2, 5.0))
        np.testing.assert_allclose(m(torch.from_numpy(x)).detach().numpy(), [want], rtol=1e-6, atol=1e-7)
        flax_m = to_flax(m)
        assert getattr(flax_m, "W_value", None) is None
        np.testing.assert_allclose(np.asarray(flax_m(jnp.asarray(x))), [want], rtol=1e-6, atol=1e-7)


@needs_both
def test_query_scale_by_hand() -> None:
    """The factor at positions 8190..8194 and 16383, 16384: Llama 4's (offset 1, floor
    8192): 1 until p + 1 reaches 8192, then 1 + beta ln 2, at 16383 1 + beta ln 3;
    Ministral 3's (offset 0): 1 through 8191.  Both twins, k untouched, integer floors."""
    import jax.numpy as jnp
    import torch

    from attention_spec.options import QueryScale
    from jax_attention._qk import scale_queries as jax_scale
    from torch_attention._qk import scale_queries as torch_scale

    positions = np.array([[8190, 8191, 8192, 8193, 8194, 16383, 16384]])
    b = 0.1
    ln2, ln3 = b * math.log(2), b * math.log(3)
    for scale, want in ((QueryScale(b, 8192, 1), [1, 1 + ln2, 1 + ln2, 1 + ln2, 1 + ln2, 1 + ln3, 1 + ln3]),
                        (QueryScale(b, 8192, 0), [1, 1, 1 + ln2, 1 + ln2, 1 + ln2, 1 + ln2, 1 + ln3])):
        q = np.ones((1, 2, 7, 4), np.float32)
        got_t, k_t = torch_scale(scale, torch.from_numpy(q), torch.from_numpy(q), torch.from_numpy(positions))
        got_f, k_f = jax_scale(scale, jnp.asarray(q), jnp.asarray(q), jnp.asarray(positions))
        for got in (got_t.numpy(), np.asarray(got_f)):
            np.testing.assert_allclose(got[0, 1, :, 2], want, rtol=1e-7)
        assert (k_t.numpy() == 1).all() and (np.asarray(k_f) == 1).all()
        # a cache's fills, 8190 and 16382, are the positions of the step's first query
        got, _ = torch_scale(scale, torch.from_numpy(q[:, :, :2]), torch.from_numpy(q[:, :, :2]), None,
                             torch.tensor([8190]))
        np.testing.assert_allclose(got[0, 0, :, 0].numpy(), want[:2], rtol=1e-7)


# --------------------------------------------------------------------------- oracle and twins


@needs_both
def test_every_path_against_the_oracle() -> None:
    """Gemma 4's global layer, a Llama 4 NoPE layer and all four with rope, at positions
    past 8192: the PyTorch twin on every path against the float64 oracle, which norms a
    weightless qk-norm after rope, as the families do (the rotation keeps the norm:
    norming first differs by rounding only); the Flax twin (eager, ``auto``) on the NoPE
    layer (the twin test below and the matrix's ``mha-k-eq-v-qscale``, on every path,
    hold it to the rest)."""
    import jax.numpy as jnp
    import torch

    x = _x()
    tol = ORACLE["float32"]
    for options in (GEMMA4, NOPE, ALL):
        torch_m, flax_m = _pair(**options)
        want = _oracle(torch_m, x, FAR)
        for path in PATHS:
            got_t = torch_m(torch.from_numpy(x), positions=torch.from_numpy(FAR), implementation=path)
            np.testing.assert_allclose(got_t.detach().numpy(), want, rtol=tol.rtol, atol=tol.atol, err_msg=path)
        if options is NOPE:
            got_f = flax_m(jnp.asarray(x), positions=jnp.asarray(FAR))
            np.testing.assert_allclose(np.asarray(got_f), want, rtol=tol.rtol, atol=tol.atol)


@needs_both
def test_twin_against_twin_with_gradients() -> None:
    """All four mechanisms with rope at positions past 8192: outputs and the gradients of
    the input and of every parameter, PyTorch twin against Flax twin."""
    import jax.numpy as jnp
    import torch

    from parity_tests import check_parity

    torch_m, flax_m = _pair(**ALL)
    report = check_parity(
        torch_m, flax_m, _x(seed=2), implementation="auto",
        torch_call=lambda m, *a, **k: m(*a, positions=torch.from_numpy(FAR), **k),
        flax_call=lambda m, *a, **k: m(*a, positions=jnp.asarray(FAR), **k))
    assert report.ok, report


# --------------------------------------------------------------------------- cached decoding


@needs_both
def test_cached_decoding_equals_the_whole_sequence() -> None:
    """A prompt of 3 then one token at a time equals the whole sequence (query scale
    floor 2: it changes every other step; the cache holds the normed values, taken from
    the keys): the PyTorch twin with rope and without (a NoPE layer's scale at the
    cache's fill), the Flax twin with rope (jitted steps)."""
    import torch

    x = _x(2, 7, seed=4)
    tol = PARITY["float32"]
    for options in ({**NOPE, "query_scale": (0.5, 2, 0)}, {**ALL, "query_scale": (0.5, 2, 1)}):
        torch_m, flax_m = _pair(**options)
        whole = torch_m(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(decode_in_steps(torch_m, x, 3, 8), whole, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(decode_in_steps(flax_m, x, 3, 8), whole, rtol=tol.rtol, atol=tol.atol)


# --------------------------------------------------------------------------- exporters


@needs_both
def test_exporters_refuse_them_by_name() -> None:
    """nn.MultiheadAttention, nnx.MultiHeadAttention and Linen's module express none of
    them: each exporter names the option."""
    from flax import nnx

    import jax_attention
    import torch_attention
    from attention_spec.options import QueryScale
    from jax_attention import interop as jax_interop
    from torch_attention import interop as torch_interop

    cases = (("qk_norm_weight", False, True), ("v_norm", "rms", None), ("values_from_keys", True, False),
             ("query_scale", QueryScale(0.1, 4, 1), None))
    for option, value, default in cases:
        extra = {option: value, **({"qk_norm": "rms"} if option == "qk_norm_weight" else {})}
        text = f"{option}={value!r} (%s cannot express it; only {option}={default!r} converts)"
        ours = torch_attention.MultiHeadAttention(8, 8, None, 0.0, 2, True, causal=False, **extra)
        with pytest.raises(ValueError, match=re.escape(text % "nn.MultiheadAttention")):
            torch_interop.to_nn_multihead(ours)
        flax_ours = jax_attention.MultiHeadAttention(8, 8, None, 0.0, 2, True, causal=False, rngs=nnx.Rngs(0),
                                                     **extra)
        for export, target in ((jax_interop.to_nnx_multihead, "nnx.MultiHeadAttention"),
                               (jax_interop.to_linen_multihead, "Linen MultiHeadDotProductAttention")):
            with pytest.raises(ValueError, match=re.escape(f"{option}={value!r} ({target}")):
                export(flax_ours)


# --------------------------------------------------------------------------- transformers' layers


def _randomise(layer: Any, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)


_QKVO = {"q_proj": "W_query", "k_proj": "W_key", "v_proj": "W_value", "o_proj": "out_proj",
         "q_norm": "q_norm", "k_norm": "k_norm"}


def _ours(hf: Any, options: dict[str, Any], permute: Any = None) -> Any:
    """Ours (eval) with ``hf``'s weights by name as they are (``permute``: rows of q/k)."""
    import torch_attention

    ours = torch_attention.MultiHeadAttention(**options).eval()
    state = {f"{_QKVO[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in hf.state_dict().items()}
    if permute is not None:
        state = {k: v[permute] if k.split(".")[0] in ("W_query", "W_key") else v for k, v in state.items()}
    ours.load_state_dict(state)
    return ours


def _compare(ours: Any, want: Any, x: np.ndarray, positions: np.ndarray | None, x_hf: Any) -> None:
    """ours (the PyTorch twin; the Flax twin equals it, tested above) against ``want`` =
    hf(x_hf): outputs and the input's gradient."""
    import torch

    cot = torch.from_numpy(np.random.default_rng(1).standard_normal(want.shape).astype(np.float32))
    (want * cot).sum().backward()
    x_ours = torch.from_numpy(x).requires_grad_(True)
    at = None if positions is None else torch.from_numpy(positions)
    got = ours(x_ours, positions=at)
    (got * cot).sum().backward()
    tol = PARITY["float32"]
    torch.testing.assert_close(got, want, rtol=tol.rtol, atol=tol.atol)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=tol.rtol, atol=tol.atol)


def _ported(hf: Any, want: Any, x: np.ndarray, positions: np.ndarray | None, **options: Any) -> None:
    """``from_hf(hf)`` maps the mechanism (``options`` among its config) and computes ``want``."""
    import torch

    from torch_attention.interop import from_hf

    ours = from_hf(hf)
    assert {k: ours.config[k] for k in options} == options
    got = ours(torch.from_numpy(x), positions=None if positions is None else torch.from_numpy(positions))
    tol = PARITY["float32"]
    torch.testing.assert_close(got, want.detach(), rtol=tol.rtol, atol=tol.atol)


def _causal(seq: int) -> Any:
    import torch

    return torch.full((seq, seq), float("-inf")).triu(1)[None, None]


POSITIONS = 401 + np.arange(6)[None] + 8 * np.arange(2)[:, None]


@needs_both
def test_gemma4_global_attention() -> None:
    """Gemma 4's full-attention layer (``attention_k_eq_v``: no v_proj; its v_norm; its
    own head width 8 and one key/value head, the sliding layers' 4 and 2; scaling 1)."""
    import torch
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextAttention, Gemma4TextRotaryEmbedding

    from attention_spec.rope import RopeConfig

    config = Gemma4TextConfig(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, global_head_dim=8,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=2, num_kv_shared_layers=0,
        layer_types=["sliding_attention", "full_attention"], vocab_size=32, hidden_size_per_layer_input=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        attn_implementation="eager")
    hf = Gemma4TextAttention(config, layer_idx=1)
    assert hf.v_proj is None and hf.head_dim == 8
    _randomise(hf, 21)
    hf.eval()
    x = _x(2, 6, seed=21)
    cos, sin = Gemma4TextRotaryEmbedding(config)(torch.from_numpy(x), torch.from_numpy(POSITIONS), "full_attention")
    x_hf = torch.from_numpy(x).requires_grad_(True)
    want = hf(x_hf, (cos, sin), _causal(6), {})[0]
    ours = _ours(hf, {"d_in": 16, "d_out": 16, "context_length": None, "dropout": 0.0, "num_heads": 4,
                      "qkv_bias": False, "num_kv_heads": 1, "head_dim": 8, "out_bias": False, "scale": 1.0,
                      "qk_norm": "rms", "qk_norm_eps": config.rms_norm_eps, "v_norm": "rms",
                      "values_from_keys": True, "rope": RopeConfig(theta=10000.0)})
    _compare(ours, want, x, POSITIONS, x_hf)
    _ported(hf, want, x, POSITIONS, values_from_keys=True, v_norm="rms", num_kv_heads=1, head_dim=8, scale=1.0)
    from torch_attention.interop import to_hf

    again = to_hf(ours, Gemma4TextAttention(config, layer_idx=1))  # no W_value, no v_proj: the rest one to one
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), again.state_dict().values(), strict=True))


@needs_torch
def test_gemma4_global_layer_with_its_proportional_rope() -> None:
    """Gemma 4's default global rope (``"proportional"``, partial_rotary_factor 0.25): the
    whole head turns in halves, its first quarter of pairs at theta ** (-2i / head_dim),
    the rest at frequency 0.  ``rope_from_hf`` gives transformers' frequencies (to float32
    rounding), and ``from_hf`` ports the layer (outputs past 400 within parity)."""
    import torch
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextAttention, Gemma4TextRotaryEmbedding

    from attention_spec.rope import rope_from_hf

    config = Gemma4TextConfig(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, global_head_dim=16,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=2, num_kv_shared_layers=0,
        layer_types=["sliding_attention", "full_attention"], vocab_size=32, hidden_size_per_layer_input=0,
        attn_implementation="eager")
    assert config.rope_parameters["full_attention"]["rope_type"] == "proportional"
    rotary = Gemma4TextRotaryEmbedding(config)
    theirs = rotary.full_attention_inv_freq.double().numpy()
    rope = rope_from_hf(config, "full_attention")
    assert rope.rotary_dim is None and rope.inv_freq is not None and rope.inv_freq[2:] == (0.0,) * 6
    np.testing.assert_allclose(rope.inv_freq, theirs, rtol=1e-7, atol=0)
    hf = Gemma4TextAttention(config, layer_idx=1)
    _randomise(hf, 23)
    hf.eval()
    x = _x(2, 6, seed=23)
    cos, sin = rotary(torch.from_numpy(x), torch.from_numpy(POSITIONS), "full_attention")
    want = hf(torch.from_numpy(x), (cos, sin), _causal(6), {})[0]
    _ported(hf, want, x, POSITIONS, head_dim=16, values_from_keys=True)


@needs_both
def test_to_hf_refuses_them_by_name_where_the_layer_has_none() -> None:
    """A Llama layer has none of them: to_hf names each (nothing written)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    import torch_attention
    from torch_attention.interop import from_hf, to_hf

    layer = LlamaAttention(LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                       num_hidden_layers=1, attn_implementation="eager"), 0)
    base = from_hf(layer).config
    for extra, text in (({"values_from_keys": True}, "values_from_keys=True where the layer has False"),
                        ({"v_norm": "rms"}, "v_norm='rms' where the layer has None"),
                        ({"qk_norm": "rms", "qk_norm_weight": False}, "qk_norm_weight=False where the layer has True"),
                        ({"query_scale": (0.1, 16, 0)}, "query_scale=QueryScale(beta=0.1, floor=16, offset=0) where")):
        with pytest.raises(ValueError, match=re.escape(text)):
            to_hf(torch_attention.MultiHeadAttention(**{**base, **extra}), layer)


@needs_both
def test_llama4_nope_layer_with_temperature_tuning() -> None:
    """Llama 4's NoPE layer scales its queries by log1p(floor((p + 1) / floor_scale)) *
    attn_scale + 1 at the cache's positions: 6 tokens after a cache of 409 (floor_scale
    64: 1 + 0.5 ln 7 at 409..414), ours at positions 409..414."""
    import torch
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    config = Llama4TextConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                              num_hidden_layers=1, no_rope_layers=[0], floor_scale=64, attn_scale=0.5,
                              attention_chunk_size=None,
                              attn_temperature_tuning=True, use_qk_norm=True, attn_implementation="eager")
    hf = Llama4TextAttention(config, layer_idx=0)
    assert not hf.use_rope and not hasattr(hf, "qk_norm")
    _randomise(hf, 22)
    hf.eval()
    class Filled:  # the cache's fill is all the layer reads of it here (no keys before)
        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 409

        def update(self, k: Any, v: Any, layer_idx: int, kwargs: Any = None) -> tuple[Any, Any]:
            return k, v

    x = _x(2, 6, seed=22)
    x_hf = torch.from_numpy(x).requires_grad_(True)
    want = hf(x_hf, None, _causal(6), cache=Filled())[0]
    ours = _ours(hf, {"d_in": 16, "d_out": 16, "context_length": None, "dropout": 0.0, "num_heads": 4,
                      "qkv_bias": False, "num_kv_heads": 2, "head_dim": 4, "out_bias": False,
                      "query_scale": (config.attn_scale, config.floor_scale, 1)})
    _compare(ours, want, x, 409 + np.arange(6)[None], x_hf)
    _ported(hf, want, x, 409 + np.arange(6)[None], query_scale=(0.5, 64, 1), rope=None)


@needs_both
def test_llama4_rope_layer_with_its_l2_norm() -> None:
    """Llama 4's rope layer: interleaved pairs (complex), then its weightless L2Norm
    (an RMS norm) of q and k after rope; ours norms before rope (the same to rounding)."""
    import torch
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

    from attention_spec.rope import RopeConfig

    config = Llama4TextConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                              num_hidden_layers=1, no_rope_layers=[1], use_qk_norm=True, attention_chunk_size=None,
                              rope_parameters={
                                  "rope_type": "default", "rope_theta": 10000.0}, attn_implementation="eager")
    hf = Llama4TextAttention(config, layer_idx=0)
    assert hf.use_rope and hasattr(hf, "qk_norm")
    _randomise(hf, 23)
    hf.eval()
    x = _x(2, 6, seed=23)
    rotary = Llama4TextRotaryEmbedding(config)
    freqs = rotary(torch.from_numpy(x), torch.from_numpy(POSITIONS))
    x_hf = torch.from_numpy(x).requires_grad_(True)
    want = hf(x_hf, freqs, _causal(6))[0]
    ours = _ours(hf, {"d_in": 16, "d_out": 16, "context_length": None, "dropout": 0.0, "num_heads": 4,
                      "qkv_bias": False, "num_kv_heads": 2, "head_dim": 4, "out_bias": False, "qk_norm": "rms",
                      "qk_norm_weight": False, "qk_norm_eps": config.rms_norm_eps,
                      "rope": RopeConfig(theta=10000.0, layout="interleaved")})
    _compare(ours, want, x, POSITIONS, x_hf)
    _ported(hf, want, x, POSITIONS, qk_norm="rms", qk_norm_weight=False)  # (its freqs_cis: interleaved pairs)


@needs_both
def test_ministral3_llama_4_scaling_beta(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ministral 3: queries times 1 + beta * log(1 + floor(p / original_max_position_embeddings))
    after rope (16 here: every position past 400 scaled).  from_hf checks its port again
    past the floor: a scale read wrong (Llama 4's offset 1 here) is refused, naming it."""
    import torch
    from transformers import Ministral3Config
    from transformers.models.ministral3.modeling_ministral3 import (
        Ministral3Attention,
        Ministral3RotaryEmbedding,
    )

    from attention_spec.rope import RopeConfig

    config = Ministral3Config(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                              num_hidden_layers=1, attn_implementation="eager", rope_parameters={
                                  "rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.3,
                                  "original_max_position_embeddings": 16})
    hf = Ministral3Attention(config, layer_idx=0)
    _randomise(hf, 24)
    hf.eval()
    x = _x(2, 6, seed=24)
    positions = torch.from_numpy(POSITIONS)
    cos, sin = Ministral3RotaryEmbedding(config)(torch.from_numpy(x), positions)
    x_hf = torch.from_numpy(x).requires_grad_(True)
    want = hf(x_hf, (cos, sin), _causal(6), position_ids=positions)[0]
    ours = _ours(hf, {"d_in": 16, "d_out": 16, "context_length": None, "dropout": 0.0, "num_heads": 4,
                      "qkv_bias": False, "num_kv_heads": 2, "head_dim": 4, "out_bias": False,
                      "query_scale": (0.3, 16, 0), "rope": RopeConfig(theta=10000.0)})
    _compare(ours, want, x, POSITIONS, x_hf)
    _ported(hf, want, x, POSITIONS, query_scale=(0.3, 16, 0))
    from torch_attention import _hf

    monkeypatch.setattr(_hf, "_query_scale", lambda *_: (0.3, 16, 1))
    with pytest.raises(ValueError, match=re.escape("with query_scale=(0.3, 16, 1) from its config, at positions 30..")):
        _hf.from_hf(hf)


@needs_both
def test_nanochat_attention() -> None:
    """nanochat: rope, then its weightless RMSNorm of q and k.  Its ``rotate_half`` is
    ``cat(x2, -x1)`` (a turn by -angle): the two halves of each head's q and k rows
    swapped turn as ours does (the scores see both swapped alike)."""
    import torch
    from transformers import NanoChatConfig
    from transformers.models.nanochat.modeling_nanochat import NanoChatAttention, NanoChatRotaryEmbedding

    from attention_spec.rope import RopeConfig

    config = NanoChatConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                            attn_implementation="eager", rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 10000.0})
    hf = NanoChatAttention(config, layer_idx=0)
    _randomise(hf, 25)
    hf.eval()
    x = _x(2, 6, seed=25)
    cos, sin = NanoChatRotaryEmbedding(config)(torch.from_numpy(x), torch.from_numpy(POSITIONS))
    x_hf = torch.from_numpy(x).requires_grad_(True)
    want = hf(x_hf, (cos, sin), _causal(6))[0]
    swap = (np.arange(16).reshape(4, 2, 2)[:, ::-1]).reshape(-1).copy()  # each head's halves swapped
    ours = _ours(hf, {"d_in": 16, "d_out": 16, "context_length": None, "dropout": 0.0, "num_heads": 4,
                      "qkv_bias": False, "out_bias": False, "qk_norm": "rms", "qk_norm_weight": False,
                      "qk_norm_eps": config.rms_norm_eps, "rope": RopeConfig(theta=10000.0)},
                 permute=torch.from_numpy(swap))
    _compare(ours, want, x, POSITIONS, x_hf)
    try:  # its weightless norm maps; its turn by -angle is rope's (refused by name until from_hf maps it)
        _ported(hf, want, x, POSITIONS, qk_norm="rms", qk_norm_weight=False)
    except ValueError as refused:
        assert "rotary layout" in str(refused) and "without a weight" not in str(refused), refused


@needs_both
def test_latent_attention_query_scale_and_mistral4() -> None:
    """MultiHeadLatentAttention's query_scale (Mistral 4: the whole query, nope and rope
    parts, after rope): the oracle, plain and absorbed, the Flax twin, a cached decode
    (floor 2), and transformers' Mistral4Attention through from_hf at positions past 400
    (original_max_position_embeddings 16)."""
    import jax.numpy as jnp
    import torch
    from transformers import Mistral4Config
    from transformers.models.mistral4.modeling_mistral4 import Mistral4Attention, Mistral4RotaryEmbedding

    import torch_attention
    from attention_spec.rope import RopeConfig
    from parity_tests import reference, to_flax
    from torch_attention.interop import from_hf

    torch.manual_seed(6)
    m = torch_attention.MultiHeadLatentAttention(16, 2, 8, 4, 4, 4, q_lora_rank=6, query_scale=(0.3, 2, 0),
                                                 rope=RopeConfig(theta=10000.0, layout="interleaved")).eval()
    x = _x(2, 5, seed=6)
    params = {k: v.detach().double().numpy() for k, v in m.state_dict().items()}
    want = reference.forward("MultiHeadLatentAttention", m.config, params, x.astype(np.float64), positions=FAR)[0]
    tol = ORACLE["float32"]
    for absorb in (False, True):
        got = m(torch.from_numpy(x), positions=torch.from_numpy(FAR), absorb=absorb).detach().numpy()
        np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    got_f = to_flax(m)(jnp.asarray(x), positions=jnp.asarray(FAR))
    np.testing.assert_allclose(np.asarray(got_f), want, rtol=tol.rtol, atol=tol.atol)
    whole = m(torch.from_numpy(x)).detach().numpy()
    cache = m.init_cache(2, 8)
    out, cache = m(torch.from_numpy(x[:, :3]), cache=cache)
    outs = [out.detach().numpy()]
    for t in (3, 4):
        out, cache = m(torch.from_numpy(x[:, t:t + 1]), cache=cache)
        outs.append(out.detach().numpy())
    np.testing.assert_allclose(np.concatenate(outs, 1), whole, rtol=PARITY["float32"].rtol, atol=PARITY["float32"].atol)

    config = Mistral4Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=6, kv_lora_rank=8,
                            qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, head_dim=4, num_hidden_layers=1,
                            attn_implementation="eager", rope_parameters={
                                "rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                "original_max_position_embeddings": 16})
    hf = Mistral4Attention(config, layer_idx=0)
    _randomise(hf, 26)
    hf.eval()
    positions = torch.from_numpy(POSITIONS)
    x = _x(2, 6, seed=26)
    with torch.no_grad():
        cos_sin = Mistral4RotaryEmbedding(config)(torch.from_numpy(x), positions)
        want_hf = hf(torch.from_numpy(x), cos_sin, _causal(6), position_ids=positions)[0]
    ours = from_hf(hf)
    assert ours.config["query_scale"] == (config.rope_parameters["llama_4_scaling_beta"], 16, 0)
    got = ours(torch.from_numpy(x), positions=positions)
    torch.testing.assert_close(got.detach(), want_hf, rtol=PARITY["float32"].rtol, atol=PARITY["float32"].atol)
