"""Packed q/k/v beyond ``[q; k; v]`` in thirds, and Hugging Face's ``sliding_window``.

``load_packed_qkv(..., packing=)`` against ``transformers``' own layers: GPT-NeoX's
``query_key_value`` (``packing="per_head"``: (heads, 3, head_dim) along the packed axis)
and Phi-3's ``qkv_proj`` (``packing="grouped"``: [q; k; v] with fewer key/value heads).
Our projections equal the layer's own q, k and v (split by the layer's own code), the whole
layer's output agrees within the float32 tolerance (rotation made the identity:
``cos = 1``, ``sin = 0``, so only the packing is tested), the old thirds split is shown
wrong, round trips (packed -> ours -> packed) are bit-exact in both twins, and a weight
that does not fit the packing asked for is refused with the same text by both twins.

``attention_spec.window_from_hf``: ``sliding_window=W`` is ``window=(W - 1, 0)``, proven
against ``transformers.masking_utils``' sliding-window mask function and against
Mistral's attention with the mask its model builds; ``(W, 0)`` is shown different.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import numpy as np
import pytest

from attention_spec import window_from_hf
from attention_spec.interop import packing
from attention_spec.registry import make_config
from parity_tests.tolerances import PARITY
from tests.support import needs_both

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jax_attention as ja  # noqa: E402
import torch_attention as ta  # noqa: E402
from jax_attention import interop as jinterop  # noqa: E402
from torch_attention import interop as tinterop  # noqa: E402

pytestmark = needs_both

B, T, E, HEADS, KV_HEADS = 2, 7, 16, 4, 2
TOL = PARITY["float32"]


def _close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL.rtol, atol=TOL.atol)


def _randomise(layer: Any) -> Any:
    """Weights of N(0, 0.4): HF's N(0, 0.02) makes attention nearly uniform, hiding a bad split."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0.0, 0.4)
    return layer.eval()


def _x() -> Any:
    return torch.from_numpy(np.random.default_rng(1).standard_normal((B, T, E)).astype(np.float32))


def _no_rotation(head_dim: int) -> tuple[Any, Any]:
    """(cos, sin) that rotate nothing, exactly: q * 1 + rotate_half(q) * 0 = q."""
    return torch.ones(B, T, head_dim), torch.zeros(B, T, head_dim)


def _causal_additive() -> Any:
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _neox() -> Any:
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

    config = GPTNeoXConfig(hidden_size=E, num_attention_heads=HEADS, intermediate_size=32, num_hidden_layers=1,
                           attention_bias=True, attention_dropout=0.0, attn_implementation="eager")
    return _randomise(GPTNeoXAttention(config, layer_idx=0))


def _phi3() -> Any:
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3Attention

    config = Phi3Config(hidden_size=E, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                        intermediate_size=32, num_hidden_layers=1, attention_dropout=0.0,
                        attn_implementation="eager")
    return _randomise(Phi3Attention(config, layer_idx=0))


def _neox_qkv(layer: Any, x: Any) -> tuple[Any, Any, Any]:
    """q, k, v (B, H, T, D) as GPTNeoXAttention.forward splits them."""
    qkv = layer.query_key_value(x).view(B, T, -1, 3 * layer.head_size).transpose(1, 2)
    return qkv.chunk(3, dim=-1)


def _phi3_qkv(layer: Any, x: Any) -> tuple[Any, Any, Any]:
    """q, k, v (B, heads, T, D) as Phi3Attention.forward splits them."""
    qkv = layer.qkv_proj(x)
    query_pos = layer.config.num_attention_heads * layer.head_dim
    kv = layer.num_key_value_heads * layer.head_dim
    parts = qkv[..., :query_pos], qkv[..., query_pos:query_pos + kv], qkv[..., query_pos + kv:]
    return tuple(p.view(B, T, -1, layer.head_dim).transpose(1, 2) for p in parts)


def _ours_qkv(module: Any, x: Any) -> tuple[Any, ...]:
    heads = (module.spec.num_heads, module.spec.kv_heads, module.spec.kv_heads)
    projs = (module.W_query, module.W_key, module.W_value)
    return tuple(p(x).view(B, T, h, -1).transpose(1, 2) for p, h in zip(projs, heads, strict=True))


def _torch_module(kv_heads: int | None = None, qkv_bias: bool = True) -> Any:
    return ta.MultiHeadAttention(E, E, None, 0.0, HEADS, qkv_bias=qkv_bias, num_kv_heads=kv_heads, causal=True).eval()


def _flax_module(kv_heads: int | None = None, qkv_bias: bool = True) -> Any:
    return ja.MultiHeadAttention(E, E, None, 0.0, HEADS, qkv_bias=qkv_bias, num_kv_heads=kv_heads, causal=True,
                                 rngs=nnx.Rngs(0))


# ------------------------------------------------------------------ framework-free split and join


CASES = {  # packing: (heads, packed width), d_in = 5
    "thirds": ({}, 3 * 8),
    "per_head": ({"num_heads": 4}, 3 * 8),
    "grouped": ({"num_heads": 4, "num_kv_heads": 2}, 8 + 2 * 4),
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("layout", packing.PACKED_LAYOUTS)
@pytest.mark.parametrize("kind", list(CASES))
def test_split_join_round_trips_bit_exact(kind: str, layout: str, dtype: str) -> None:
    heads, width = CASES[kind]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((width, 5) if layout == "out_in" else (5, width)).astype(dtype)
    b = rng.standard_normal(width).astype(dtype)
    parts = packing.split_qkv(w, b, layout=layout, packing=kind, **heads)
    kv = 4 if kind == "grouped" else 8
    assert [p[0].shape for p in parts.values()] == [(8, 5), (kv, 5), (kv, 5)]
    w2, b2 = packing.join_qkv(*(parts[r][0] for r in packing.ROLES), [parts[r][1] for r in packing.ROLES],
                              layout=layout, packing=kind, **heads)
    for got, want in ((w2, w), (b2, b)):
        assert got is not None and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, strict=True)


def test_per_head_and_grouped_rows() -> None:
    """Which packed rows each role takes, written out by hand."""
    w = np.arange(12, dtype=np.float64)[:, None]  # row r holds r; d_in = 1
    per_head = packing.split_qkv(w, layout="out_in", packing="per_head", num_heads=2)  # head_dim 2
    assert {r: p[0].ravel().tolist() for r, p in per_head.items()} == {
        "query": [0, 1, 6, 7], "key": [2, 3, 8, 9], "value": [4, 5, 10, 11]}
    grouped = packing.split_qkv(w, layout="out_in", packing="grouped", num_heads=2, num_kv_heads=1)
    assert {r: p[0].ravel().tolist() for r, p in grouped.items()} == {
        "query": [0, 1, 2, 3, 4, 5], "key": [6, 7, 8], "value": [9, 10, 11]}
    thirds = packing.split_qkv(w, layout="out_in")  # the default is today's split
    assert thirds["key"][0].ravel().tolist() == [4, 5, 6, 7]
    codegen = packing.split_qkv(np.arange(24, dtype=np.float64)[:, None], layout="out_in", packing="codegen")
    assert {r: p[0].ravel().tolist() for r, p in codegen.items()} == {  # 4 shards of [q; v; k], 2 rows each
        "query": [0, 1, 6, 7, 12, 13, 18, 19], "key": [4, 5, 10, 11, 16, 17, 22, 23],
        "value": [2, 3, 8, 9, 14, 15, 20, 21]}
    back, _ = packing.join_qkv(*(codegen[r][0] for r in ("query", "key", "value")), layout="out_in", packing="codegen")
    assert back.ravel().tolist() == list(range(24))


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda w: packing.split_qkv(w, layout="out_in", packing="heads"), "packing must be 'thirds'"),
        (lambda w: packing.split_qkv(w, layout="out_in", packing="per_head"), "packing='per_head' needs num_heads"),
        (lambda w: packing.split_qkv(w, layout="out_in", packing="grouped", num_heads=4),
         "packing='grouped' needs num_kv_heads"),
        (lambda w: packing.split_qkv(w, layout="out_in", packing="grouped", num_heads=4, num_kv_heads=3),
         "num_heads must be a multiple of num_kv_heads; got num_heads=4, num_kv_heads=3"),
        (lambda w: packing.split_qkv(w, layout="out_in", packing="per_head", num_heads=4, num_kv_heads=2),
         "packing='per_head' holds one query, key and value head at a time"),
        (lambda w: packing.split_qkv(w, layout="out_in", packing="per_head", num_heads=5),
         "the packed q/k/v weight (24, 5) does not fit packing='per_head': its packed width along axis 0 "
         "((packed, d_in) for layout='out_in') must be 3*num_heads*head_dim = 15*head_dim (num_heads=5); got 24"),
        (lambda w: packing.split_qkv(w.T, layout="in_out", packing="grouped", num_heads=5, num_kv_heads=1),
         "the packed q/k/v weight (5, 24) does not fit packing='grouped': its packed width along axis 1 "
         "((d_in, packed) for layout='in_out') must be (num_heads + 2*num_kv_heads)*head_dim = 7*head_dim"),
        (lambda w: packing.split_qkv(w, np.zeros(12, np.float32), layout="out_in", packing="grouped",
                                     num_heads=4, num_kv_heads=2), "the packed q/k/v bias must have shape (24,)"),
        (lambda w: packing.join_qkv(w[:8], w[:8], w[:4], layout="out_in", packing="grouped", num_heads=4,
                                    num_kv_heads=2),
         "the query, key and value weights do not fit packing='grouped' (num_heads=4, num_kv_heads=2): "
         "expected (num_heads*head_dim, d_in), then (num_kv_heads*head_dim, d_in) twice, (8, 5), (4, 5), (4, 5); "
         "got (8, 5), (8, 5), (4, 5)"),
        (lambda w: packing.join_qkv(w[:6], w[:6], w[:6], layout="out_in", packing="per_head", num_heads=4),
         "do not fit packing='per_head': d_out must be num_heads*head_dim with num_heads=4"),
        (lambda w: packing.split_qkv(w[:18], layout="out_in", packing="codegen"),
         "packing='codegen' packs 4 shards, each [q; v; k] of d_out/4 rows, so d_out must be a multiple of 4; "
         "got d_out=6"),
    ],
    ids=["name", "per-head-heads", "grouped-kv", "grouped-divides", "per-head-grouped", "per-head-width",
         "grouped-width", "bias", "join-grouped", "join-per-head", "codegen-shards"],
)
def test_split_and_join_refuse(call: Any, pattern: str) -> None:
    w = np.zeros((24, 5), np.float32)
    with pytest.raises(ValueError, match=re.escape(pattern)):
        call(w)


# ------------------------------------------------------------------ GPT-NeoX: packing="per_head"


def test_neox_projections_and_output_match_the_layer() -> None:
    layer = _neox()
    x = _x()
    ours = tinterop.load_packed_qkv(_torch_module(), layer.query_key_value.weight, layer.query_key_value.bias,
                                    layout="out_in", packing="per_head", out_weight=layer.dense.weight,
                                    out_bias=layer.dense.bias)
    with torch.no_grad():
        for got, want in zip(_ours_qkv(ours, x), _neox_qkv(layer, x), strict=True):
            _close(got, want)
        want, _ = layer(x, _causal_additive(), position_embeddings=_no_rotation(layer.head_size))
        _close(ours(x), want)
        # the split of today's default, [q; k; v] in thirds, is wrong for this checkpoint, silently
        thirds = tinterop.load_packed_qkv(_torch_module(), layer.query_key_value.weight,
                                          layer.query_key_value.bias, layout="out_in",
                                          out_weight=layer.dense.weight, out_bias=layer.dense.bias)
        assert (thirds(x) - want).abs().max() > 0.1
    flax_port = jinterop.load_packed_qkv(_flax_module(), layer.query_key_value.weight.detach().numpy(),
                                         layer.query_key_value.bias.detach().numpy(), layout="out_in",
                                         packing="per_head", out_weight=layer.dense.weight.detach().numpy(),
                                         out_bias=layer.dense.bias.detach().numpy())
    _close(flax_port(jnp.asarray(x.numpy())), want)


# ------------------------------------------------------------------ Phi-3: packing="grouped"


def test_phi3_projections_and_output_match_the_layer() -> None:
    layer = _phi3()
    x = _x()
    ours = tinterop.load_packed_qkv(_torch_module(KV_HEADS, qkv_bias=False), layer.qkv_proj.weight,
                                    layout="out_in", packing="grouped", out_weight=layer.o_proj.weight)
    assert torch.equal(ours.out_proj.bias, torch.zeros(E))  # Phi-3's o_proj has no bias
    with torch.no_grad():
        for got, want in zip(_ours_qkv(ours, x), _phi3_qkv(layer, x), strict=True):
            _close(got, want)
        want, _ = layer(x, _no_rotation(layer.head_dim), _causal_additive())
        _close(ours(x), want)
    flax_port = jinterop.load_packed_qkv(_flax_module(KV_HEADS, qkv_bias=False),
                                         layer.qkv_proj.weight.detach().numpy(), layout="out_in",
                                         packing="grouped", out_weight=layer.o_proj.weight.detach().numpy())
    _close(flax_port(jnp.asarray(x.numpy())), want)


# ------------------------------------------------------------------ both: round trips, refusals


@pytest.mark.parametrize("layout", packing.PACKED_LAYOUTS)
@pytest.mark.parametrize("family", ["neox", "phi3"])
def test_round_trip_is_bit_exact_in_both_twins(family: str, layout: str) -> None:
    if family == "neox":
        layer, kind, kv = _neox(), "per_head", None
        weight, bias = layer.query_key_value.weight.detach().numpy(), layer.query_key_value.bias.detach().numpy()
    else:
        layer, kind, kv = _phi3(), "grouped", KV_HEADS
        weight, bias = layer.qkv_proj.weight.detach().numpy(), None
    packed = weight.T if layout == "in_out" else weight
    for module, interop in ((_torch_module(kv, bias is not None), tinterop),
                            (_flax_module(kv, bias is not None), jinterop)):
        interop.load_packed_qkv(module, packed, bias, layout=layout, packing=kind)
        back = packing.pack_state_dict(module.spec, interop.torch_state_dict(module), layout=layout, packing=kind)
        np.testing.assert_array_equal(back["qkv_weight"], packed, strict=True)
        if bias is not None:
            np.testing.assert_array_equal(back["qkv_bias"], bias, strict=True)
        else:
            assert back["qkv_bias"] is None


NEOX_W, PHI3_W = (3 * E, E), (E + 2 * (E // HEADS) * KV_HEADS, E)  # (48, 16), (32, 16)


@pytest.mark.parametrize(
    ("kv_heads", "shape", "kwargs", "pattern"),
    [
        # GPT-NeoX's weight given as (in, out) with layout="out_in"'s partner: the wrong orientation
        (None, NEOX_W[::-1], {"layout": "out_in", "packing": "per_head"},
         "the packed q/k/v weight (16, 48) does not fit packing='per_head' (layout='out_in') for the module: "
         "expected (48, 16), a packed width of 3*num_heads*head_dim = 12*head_dim (num_heads=4) with "
         "head_dim=4, and d_in=16"),
        # Phi-3's weight into a module without grouped heads
        (None, PHI3_W, {"layout": "out_in", "packing": "grouped"},
         "the packed q/k/v weight (32, 16) does not fit packing='grouped' (layout='out_in') for the module: "
         "expected (48, 16), a packed width of (num_heads + 2*num_kv_heads)*head_dim = 12*head_dim "
         "(num_heads=4, num_kv_heads=4) with head_dim=4, and d_in=16"),
        # Phi-3's weight with today's default: the message names the packing to use, not divisibility by 3
        (KV_HEADS, PHI3_W, {"layout": "out_in"},
         "packing='thirds' splits q/k/v into three equal blocks, but the module has grouped-query heads "
         "(num_heads=4, num_kv_heads=2: key and value are narrower than query); pass packing='grouped' for "
         "[q; k; v] of widths 16, 8, 8 (Phi-3's qkv_proj)"),
        (KV_HEADS, NEOX_W, {"layout": "out_in", "packing": "per_head"},
         "packing='per_head' holds one query, key and value head at a time, so key/value heads cannot be "
         "grouped; got num_heads=4, num_kv_heads=2"),
        (None, NEOX_W, {"layout": "out_in", "packing": "neox"}, "packing must be 'thirds'"),
    ],
    ids=["neox-orientation", "phi3-into-mha", "phi3-as-thirds", "per-head-into-gqa", "unknown"],
)
def test_refusals_are_the_same_in_both_twins(kv_heads: int | None, shape: tuple[int, int], kwargs: Any,
                                             pattern: str) -> None:
    weight = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    messages = []
    for module, interop in ((_torch_module(kv_heads, False), tinterop), (_flax_module(kv_heads, False), jinterop)):
        before = {k: np.array(v) for k, v in interop.torch_state_dict(module).items()}
        with pytest.raises(ValueError, match=re.escape(pattern)) as error:
            interop.load_packed_qkv(module, weight, **kwargs)
        messages.append(str(error.value))
        after = interop.torch_state_dict(module)
        assert all(np.array_equal(np.asarray(after[k]), v) for k, v in before.items())  # nothing written
    assert messages[0] == messages[1]
    if kv_heads is not None:  # pack_state_dict refuses the same way
        module = _torch_module(kv_heads, False)
        with pytest.raises(ValueError, match=re.escape(pattern)):
            packing.pack_state_dict(module.spec, module.state_dict(), **kwargs)


def test_thirds_is_still_the_default() -> None:
    """Without packing=, today's split: the same arrays as packing='thirds'."""
    config = make_config("MultiHeadAttention", {"d_in": E, "d_out": E, "context_length": None, "dropout": 0.0,
                                                "num_heads": HEADS, "qkv_bias": True})
    w = np.random.default_rng(3).standard_normal((3 * E, E)).astype(np.float32)
    b = np.random.default_rng(4).standard_normal(3 * E).astype(np.float32)
    default = packing.packed_state_dict(config, w, b, layout="out_in")
    thirds = packing.packed_state_dict(config, w, b, layout="out_in", packing="thirds")
    assert default.keys() == thirds.keys()
    assert all(np.array_equal(default[k], thirds[k]) for k in default)
    np.testing.assert_array_equal(default["W_key.weight"], w[E:2 * E], strict=True)


# ------------------------------------------------------------------ sliding_window=W -> window=(W-1, 0)


def test_window_from_hf_values_and_refusals() -> None:
    assert window_from_hf(None) is None and window_from_hf(0) is None
    assert window_from_hf(1) == (0, 0) and window_from_hf(4096) == (4095, 0)
    with pytest.raises(TypeError, match="sliding_window must be an int >= 0 or None; got bool True"):
        window_from_hf(True)
    with pytest.raises(TypeError, match="got float 4.0"):
        window_from_hf(4.0)
    with pytest.raises(ValueError, match="sliding_window must be an int >= 0 or None; got -1"):
        window_from_hf(-1)


def _seen(framework: str, window: Any) -> np.ndarray:
    """Which keys each query sees, (T, T), read from the attention weights of one twin."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 1, T, 4)).astype(np.float32) for _ in range(3))
    if framework == "torch":
        _, weights = ta.dot_product_attention(*map(torch.from_numpy, (q, k, v)), window=window, return_weights=True)
        return weights.numpy()[0, 0] > 0
    _, weights = ja.dot_product_attention(*map(jnp.asarray, (q, k, v)), window=window, return_weights=True)
    return np.asarray(weights)[0, 0] > 0


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("sliding_window", [1, 2, 3, T - 1, T, T + 2])
def test_window_is_transformers_sliding_window_mask(sliding_window: int, framework: str) -> None:
    masking_utils = pytest.importorskip("transformers.masking_utils")
    mask_function = masking_utils.sliding_window_causal_mask_function(sliding_window)
    idx = torch.arange(T)
    hf = mask_function(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :]).numpy()
    assert hf.shape == (T, T)
    np.testing.assert_array_equal(_seen(framework, window_from_hf(sliding_window)), hf)
    if sliding_window < T:  # (W, 0) lets one key more in
        assert not np.array_equal(_seen(framework, (sliding_window, 0)), hf)


def test_window_matches_mistral_attention() -> None:
    """Mistral's attention layer with the mask its model builds for sliding_window=3."""
    from transformers import MistralConfig, masking_utils
    from transformers.models.mistral.modeling_mistral import MistralAttention

    width = 3
    config = MistralConfig(hidden_size=E, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=E // HEADS,
                           intermediate_size=32, num_hidden_layers=1, sliding_window=width,
                           attn_implementation="eager")
    layer = _randomise(MistralAttention(config, layer_idx=0))
    x = _x()
    parameters = inspect.signature(masking_utils.create_sliding_window_causal_mask).parameters
    no_cache = {"cache": None} if "cache" in parameters else {"past_key_values": None}
    try:
        mask = masking_utils.create_sliding_window_causal_mask(
            config=config, inputs_embeds=x, attention_mask=None, position_ids=torch.arange(T)[None].expand(B, -1),
            **no_cache)
    except TypeError as error:  # another signature in another version
        pytest.skip(f"create_sliding_window_causal_mask has another signature here: {error}")
    weights = [getattr(layer, f"{r}_proj").weight for r in "qkv"]
    packed, _ = packing.join_qkv(*(w.detach().numpy() for w in weights), layout="out_in", packing="grouped",
                                 num_heads=HEADS, num_kv_heads=KV_HEADS)
    with torch.no_grad():
        want, _ = layer(x, _no_rotation(E // HEADS), mask)
        outputs = {}
        for window in (window_from_hf(width), (width, 0)):
            ours = ta.MultiHeadAttention(E, E, None, 0.0, HEADS, num_kv_heads=KV_HEADS, causal=True,
                                         window=window).eval()
            tinterop.load_packed_qkv(ours, packed, layout="out_in", packing="grouped",
                                     out_weight=layer.o_proj.weight)
            outputs[window] = ours(x)
    _close(outputs[(width - 1, 0)], want)
    assert (outputs[(width, 0)] - want).abs().max() > 1e-2


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_softcap_scale_and_kv_heads_match_gemma2(framework: str) -> None:
    """The table's rows for Gemma 2: attn_logit_softcapping=c -> softcap=c,
    query_pre_attn_scalar=s -> scale=s**-0.5, num_key_value_heads -> num_kv_heads (repeat_kv),
    through Gemma 2's own eager attention function."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    head_dim, cap, scalar = 4, 2.0, 24.0
    rng = np.random.default_rng(6)
    q = rng.standard_normal((B, HEADS, T, head_dim)).astype(np.float32) * 3  # large scores: the cap bites
    k, v = (rng.standard_normal((B, KV_HEADS, T, head_dim)).astype(np.float32) for _ in range(2))
    layer = SimpleNamespace(head_dim=head_dim, num_key_value_groups=HEADS // KV_HEADS, training=False)
    want, _ = eager_attention_forward(layer, *map(torch.from_numpy, (q, k, v)), _causal_additive(),
                                      scaling=scalar**-0.5, softcap=cap)
    want = want.transpose(1, 2)  # HF returns (B, T, heads, head_dim)
    options = {"causal": True, "scale": scalar**-0.5, "softcap": cap}
    if framework == "torch":
        got = ta.dot_product_attention(*map(torch.from_numpy, (q, k, v)), **options)
    else:
        got = ja.dot_product_attention(*map(jnp.asarray, (q, k, v)), **options)
    _close(got, want)
    uncapped = ta.dot_product_attention(*map(torch.from_numpy, (q, k, v)), causal=True, scale=scalar**-0.5)
    assert (uncapped - want).abs().max() > 1e-2  # the cap changed the answer: it was honoured
