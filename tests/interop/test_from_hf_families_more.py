"""``from_hf`` on the families it recognises by mechanism beyond ``tests/interop/test_from_hf.py``'s:
interleaved rotary pairs (Cohere's cos laid out interleaved, GLM's halves interleaved inside
``apply_rotary_pos_emb`` with a partial rotation, GPT-J's table of sines and cosines without
``inv_freq``), packed q/k/v found by a probe (GPTBigCode's multi-query ``c_attn``, Persimmon's
per-head ``query_key_value`` with a LayerNorm qk-norm), a layer without its model's config
(GPT-1's, causal by its own mask buffer), a pre-norm left to the caller (RoBERTa-PreLayerNorm's
``LayerNorm``), an output projection named ``Wo`` (ModernBERT decoder's, with its sliding
layers); and the families refused by the mechanism that stops them.

Each ported layer is called as its model calls it (the hidden states, rotary embeddings and
mask captured from the tiny model's own forward at positions 448..463) and compared with ours:
the outputs, the input gradient and every weight gradient (ours written back into the layer's
names and layouts by ``to_hf``) of ``sum(out * R)``.  The logits of whole models are the sweep's
(``tests/interop/test_hf_families.py``)."""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from typing import Any

import pytest

from tests.support import needs_both, needs_torch

POSITIONS = (448, 464)
PORTS = ("cohere", "glm", "gptj", "gpt_bigcode", "persimmon", "openai-gpt", "roberta-prelayernorm",
         "modernbert-decoder", "codegen", "bloom", "mpt", "mimo_v2_flash",
         # a qk-norm after rope (HunYuan), a norm of the merged heads (BitNet), a softplus gate per head
         # (Laguna), per element and with its own heads on layer 0 ("laguna-per-element")
         "hunyuan_v1_dense", "bitnet", "laguna", "laguna-per-element",
         # Beam's sigmoid gate_proj with a gate bias per head; its NoPE layer's scalable softmax ("beam-nope")
         "beam", "beam-nope")
# a port's model type and its config overrides, where its name is not its model type
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "beam-nope": ("beam", {"layer_types": ["full_attention", "sliding_attention"]}),
    "laguna-per-element": ("laguna", {"gating": "per-element", "num_attention_heads_per_layer": [2, 4]}),
}
# the ports whose round trip and Flax twin are checked here (to_hf bit-exact, hf_rules onto to_flax)
TWINNED = ("codegen", "bloom", "mpt", "mimo_v2_flash")
# layers that keep no config of their model: given it (layer.config) and their causality, as their refusal asks
GIVEN = ("bloom", "mpt", "gpt_neox_japanese")
# family -> (config overrides, the text its refusal must hold)
REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "dory": ({}, "a parameter no mechanism accounts for: `s_gate`"),
    "bloom": ({}, "the layer has no is_causal and no causal mask buffer: set layer.is_causal"),
    "mpt": ({}, "the layer has no is_causal and no causal mask buffer: set layer.is_causal"),
    "gpt_neox_japanese": ({}, "the layer keeps no config and takes position_embeddings: set layer.config"),
    "xglm": ({}, "self- or cross-attention by its caller"),
    "cohere": ({"use_qk_norm": True}, "a qk-norm with its own weight per head"),
}


def _model(model_type: str, **overrides: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.interop.test_hf_families import _tiny_config

    config = _tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()


def _first_layer(model: Any, given: bool = True) -> Any:
    """The first decoder layer's attention, its biases and norms drawn; given its model's
    config and causality where it keeps none (``GIVEN``)."""
    from tests.interop.test_hf_families import _mixers, _randomise

    _, _, layer = _mixers(model, int(model.config.num_hidden_layers))[0]
    _randomise(layer)
    if given and model.config.model_type in GIVEN:
        layer.config, layer.is_causal = model.config, True
    return layer


def _captured_call(model: Any, layer: Any) -> tuple[Any, dict[str, Any]]:
    """The hidden states and keywords the model gives ``layer`` at the test's positions."""
    import torch

    seen: dict[str, Any] = {}

    def keep(_m: Any, args: Any, kwargs: Any) -> None:
        seen.setdefault("args", args)
        seen.setdefault("kwargs", dict(kwargs))

    handle = layer.register_forward_pre_hook(keep, with_kwargs=True)
    ids = torch.randint(0, 64, (1, POSITIONS[1] - POSITIONS[0]), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.arange(*POSITIONS)[None])
    finally:
        handle.remove()
    args, kwargs = seen["args"], seen["kwargs"]
    x = args[0] if args else kwargs.pop("hidden_states")
    names = list(inspect.signature(layer.forward).parameters)[1:]  # GPT-1's mask comes second, Bloom's residual
    kwargs.update(dict(zip(names, args[1:], strict=False)))
    return x.detach(), kwargs


def _port(model_type: str) -> dict[str, Any]:
    """Ours and the native layer on the model's own call: outputs and gradients."""
    import torch

    from torch_attention._hf import _recognise
    from torch_attention.interop import from_hf, to_hf

    model_type, overrides = VARIANTS.get(model_type, (model_type, {}))
    model = _model(model_type, **overrides)
    layer = _first_layer(model)
    x, kwargs = _captured_call(model, layer)
    ours = from_hf(layer)
    not_ours = _recognise(layer, "test").not_ours
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))

    def run(fn: Any) -> tuple[Any, Any]:
        xi = x.clone().requires_grad_(True)
        out = fn(xi)
        out = out[0] if isinstance(out, tuple | list) else out
        (out * r).sum().backward()
        return out.detach(), xi.grad

    positions = torch.arange(*POSITIONS)[None]

    def mine(xi: Any) -> Any:
        inner = getattr(layer, not_ours)(xi) if not_ours else xi  # a pre-norm: the caller's
        at = ours.spec.rope is not None or ours.spec.query_scale is not None  # (Beam's NoPE layers scale q)
        out = ours(inner, positions=positions) if at else ours(inner)
        if "residual" in kwargs:  # Bloom's layer adds its decoder's residual: the caller's
            out = out + kwargs["residual"]
        return out + xi if not_ours else out

    layer.zero_grad()
    want, want_dx = run(lambda xi: layer(xi, **kwargs))
    theirs_grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    got, got_dx = run(mine)
    grads = copy.deepcopy(ours)
    with torch.no_grad():
        for p, g in zip(grads.parameters(), ours.parameters(), strict=True):
            p.copy_(g.grad)
    written = to_hf(grads, copy.deepcopy(layer))  # our gradients under the layer's names and layouts
    mine_grads = {n: p.detach() for n, p in written.named_parameters()
                  if not (not_ours and n.startswith(not_ours + "."))}
    return {"out": (got, want), "dx": (got_dx, want_dx), "ours": ours, "layer": layer,
            "grads": {n: (g, theirs_grads[n]) for n, g in mine_grads.items()}}


@pytest.fixture(scope="module")
def ports() -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {t: _port(t) for t in PORTS}


def _relative(got: Any, want: Any, floor: float = 1e-12) -> float:
    """The largest difference over the largest magnitude (at least ``floor``: a gradient that
    is 0 but for rounding, the key bias's, is measured against the layer's largest one)."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(floor))


@needs_torch
@pytest.mark.parametrize("model_type", PORTS)
def test_ours_computes_the_native_layer_at_positions_past_400_forward_and_backward(ports: Any,
                                                                                   model_type: str) -> None:
    port = ports[model_type]
    errors = {"out": _relative(*port["out"]), "dx": _relative(*port["dx"])}
    largest = max(float(want.abs().max()) for _, want in port["grads"].values())
    errors.update({f"d {name}": _relative(*pair, floor=1e-3 * largest) for name, pair in port["grads"].items()})
    assert port["grads"], "no weight gradient compared"
    assert {k: e for k, e in errors.items() if not e <= 1e-5} == {}


@needs_torch
def test_the_mechanisms_are_read_from_the_layers(ports: Any) -> None:
    from attention_spec.rope import rotary_dim

    specs = {t: p["ours"].spec for t, p in ports.items()}
    assert specs["cohere"].rope.layout == specs["glm"].rope.layout == specs["gptj"].rope.layout == "interleaved"
    assert rotary_dim(specs["glm"].rope, 8) == rotary_dim(specs["gptj"].rope, 8) == 4  # of head_dim 8
    assert specs["gptj"].rope.inv_freq == (1.0, 0.009999999776482582)  # 10000 ** -(2i / 4), in float32
    assert specs["gpt_bigcode"].kv_heads == 1  # multi-query c_attn: [q; k; v] of widths 32, 8, 8
    assert specs["persimmon"].qk_norm == "layer" and specs["persimmon"].rope.layout == "half"
    assert specs["openai-gpt"].causal and specs["openai-gpt"].rope is None
    assert specs["modernbert-decoder"].window is None  # layer 0 is global, ModernBERT's first of three
    assert specs["hunyuan_v1_dense"].qk_norm_position == "after_rope" and specs["hunyuan_v1_dense"].qk_norm == "rms"
    assert specs["bitnet"].out_norm == "rms" and specs["bitnet"].qk_norm is None
    assert specs["laguna"].output_gate_activation == "softplus" and specs["laguna"].output_gate_per_head
    assert specs["laguna"].fan_out("query") == 4 * (8 + 1)  # each head's 8 queries, then its g_proj row
    assert specs["beam"].output_gate_bias and specs["beam"].rope is not None and specs["beam"].window == (7, 0)
    assert specs["beam-nope"].rope is None and specs["beam-nope"].query_scale == (0.1, 2048, 1)
    assert specs["beam-nope"].query_scale_kind == "power"
    per_element = specs["laguna-per-element"]  # layer 0 with 2 heads of its own (num_attention_heads_per_layer)
    assert per_element.num_heads == 2 and not per_element.output_gate_per_head and per_element.fan_out("query") == 32
    assert specs["codegen"].rope.layout == "interleaved" and specs["codegen"].kv_heads == 4  # 4 shards of [q; v; k]
    assert (specs["mimo_v2_flash"].v_head_dim, specs["mimo_v2_flash"].v_scale) == (12, 0.707)


@needs_both
@pytest.mark.parametrize("model_type", TWINNED)
def test_to_hf_writes_the_layer_back_and_hf_rules_carry_it_onto_the_flax_twin(ports: Any, model_type: str) -> None:
    """to_hf(from_hf(layer)) into a fresh layer gives its parameters bit for bit; ``hf_rules``
    moves them onto ``to_flax(ours)``'s exactly (and back); the Flax twin computes the PyTorch
    one at the test's positions (float32: 1e-5 of the largest)."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    from attention_spec.interop.specs import apply_specs
    from parity_tests import to_flax
    from torch_attention._hf import hf_rules
    from torch_attention.interop import to_hf

    layer = _first_layer(_model(model_type))
    ours = ports[model_type]["ours"]
    fresh = copy.deepcopy(layer)
    with torch.no_grad():
        for p in fresh.parameters():
            p.normal_()
    theirs = {n: p.detach().numpy() for n, p in layer.named_parameters()}
    written = {n: p.detach().numpy() for n, p in to_hf(ours, fresh).named_parameters()}
    assert sorted(written) == sorted(theirs) and all(np.array_equal(written[n], theirs[n]) for n in theirs)
    twin = to_flax(ours)
    flat = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(twin, nnx.Param))}
    rules = hf_rules(layer)
    moved = apply_specs(theirs, rules, "to_flax")
    assert sorted(moved) == sorted(flat) and all(np.array_equal(moved[p], flat[p]) for p in flat)
    back = apply_specs(moved, rules, "to_torch")
    assert all(np.array_equal(back[n], theirs[n]) for n in theirs)
    x = np.random.default_rng(4).standard_normal((1, POSITIONS[1] - POSITIONS[0], 32)).astype(np.float32)
    positions = np.arange(*POSITIONS)[None]
    rope = ours.spec.rope is not None
    with torch.no_grad():
        want = ours(torch.from_numpy(x), **({"positions": torch.from_numpy(positions)} if rope else {})).numpy()
    got = np.asarray(twin(jnp.asarray(x), **({"positions": jnp.asarray(positions)} if rope else {})))
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-5


@needs_torch
def test_the_others_are_refused_naming_their_mechanism() -> None:
    from torch_attention.interop import from_hf

    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type, (overrides, _) in REFUSALS.items():
            layer = _first_layer(_model(model_type, **overrides), given=False)
            with pytest.raises(ValueError) as refused:
                from_hf(layer)
            got[model_type] = str(refused.value)
    assert {t: m for t, m in got.items() if REFUSALS[t][1] not in m} == {}


@needs_torch
@pytest.mark.parametrize("model_type", ["hunyuan_v1_dense", "bitnet", "laguna", "laguna-per-element", "beam"])
def test_to_hf_writes_the_weights_back_bit_for_bit_and_hf_rules_moves_them(ports: Any, model_type: str) -> None:
    """to_hf(from_hf(layer)) into a copy of the layer whose weights were changed gives the
    layer's own weights back, bit for bit (Laguna's g_proj split back from W_query's rows);
    ``hf_rules`` moves the layer's weights to what our declared map gives the Flax twin, and
    back, bit for bit; ``hf_children`` pairs the norms."""
    import numpy as np
    import torch

    from attention_spec.interop.conversion import rules_for
    from attention_spec.interop.specs import apply_specs
    from torch_attention._hf import hf_children, hf_rules
    from torch_attention.interop import to_hf

    port = ports[model_type]
    layer, ours = port["layer"], port["ours"]
    other = copy.deepcopy(layer)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    to_hf(ours, other)
    theirs = {n: p.detach() for n, p in layer.named_parameters()}
    written = {n: p.detach() for n, p in other.named_parameters()}
    assert sorted(written) == sorted(theirs) and [n for n in theirs if not torch.equal(written[n], theirs[n])] == []
    arrays = {n: v.numpy() for n, v in theirs.items()}
    moved = apply_specs(arrays, hf_rules(layer), "to_flax")
    twin = apply_specs({n: v.detach().numpy() for n, v in ours.state_dict().items()},
                       rules_for("MultiHeadAttention", ours.config), "to_flax")
    assert sorted(moved) == sorted(twin) and all(np.array_equal(moved[p], twin[p]) for p in twin)
    back = apply_specs(moved, hf_rules(layer), "to_torch")
    assert sorted(back) == sorted(arrays) and all(np.array_equal(back[n], arrays[n]) for n in arrays)
    children = hf_children(layer)
    spec = ours.spec
    if spec.qk_norm_position == "after_rope":
        assert children["query_layernorm"] == ("q_norm", "heads")
    if spec.out_norm is not None:
        assert children["attn_sub_norm"] == ("out_norm", None)
    if spec.output_gate:
        assert "q_proj" not in children and "g_proj" not in children and "gate_proj" not in children


@needs_both
@pytest.mark.parametrize("model_type", ["hunyuan_v1_dense", "laguna", "beam-nope"])
def test_the_flax_twin_of_the_port_computes_what_ours_does(ports: Any, model_type: str) -> None:
    """to_flax(from_hf(layer)) against from_hf(layer) at the test's positions: outputs and
    gradients (input and every parameter), twin against twin."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from parity_tests import check_parity, to_flax

    ours = ports[model_type]["ours"]
    positions = np.arange(*POSITIONS)[None]
    x = np.random.default_rng(3).standard_normal((1, POSITIONS[1] - POSITIONS[0], ours.spec.d_in)).astype(np.float32)
    report = check_parity(
        ours, to_flax(ours), x, implementation="auto",
        torch_call=lambda m, *a, **k: m(*a, positions=torch.from_numpy(positions), **k),
        flax_call=lambda m, *a, **k: m(*a, positions=jnp.asarray(positions), **k))
    assert report.ok, report


@needs_torch
def test_to_hf_refuses_the_new_options_by_name_where_the_layer_has_none() -> None:
    """A Qwen3 layer (a qk-norm before rope, no gate, no norm of the merged heads, no query
    scale): to_hf of ours with each of HunYuan's, BitNet's, Laguna's and Beam's options names
    it, and writes nothing."""
    import torch

    from torch_attention.interop import from_hf, to_hf
    from torch_attention.multihead import MultiHeadAttention

    layer = _first_layer(_model("qwen3"))
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    config = from_hf(layer).config
    gate = {"output_gate": True}
    for extra, named in (({"qk_norm_position": "after_rope"}, "qk_norm_position='after_rope'"),
                         ({"out_norm": "rms"}, "out_norm='rms'"),
                         ({**gate, "output_gate_activation": "softplus"}, "output_gate_activation='softplus'"),
                         ({**gate, "output_gate_per_head": True}, "output_gate_per_head=True"),
                         ({**gate, "output_gate_bias": True}, "output_gate_bias=True"),
                         ({"query_scale": (0.1, 2048, 1), "query_scale_kind": "power"}, "query_scale_kind='power'")):
        ours = MultiHeadAttention(**{**config, **extra})
        with pytest.raises(ValueError, match=re.escape(f"{named} where the layer has")):
            to_hf(ours, layer)
    assert all(torch.equal(p, before[n]) for n, p in layer.named_parameters())


@needs_both
def test_gpt_neox_japanese_ports_given_its_model_s_config_and_causality() -> None:
    """GPT-NeoX-Japanese's layer keeps neither its model's config (the rope's frequencies) nor
    whether it is causal (its model's mask): refused naming both (above). Given them
    (``layer.config = model.config``, ``layer.is_causal = True``, what its model does), it
    ports: its per-head ``query_key_value``, ``1 / norm_factor`` as the scale, and the last
    layer's ``dense_bias`` (returned apart, added by its decoder layer) as out_proj's bias. The
    model's logits with ours called as its decoder calls the layer ((out, None, None): no bias
    left to add) are transformers' at 448..511; to_hf writes each layer back bit for bit; the
    Flax twin computes the PyTorch one."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from torch import nn

    from parity_tests import to_flax
    from tests.interop.test_hf_families import _mixers, _randomise
    from torch_attention.interop import from_hf, to_hf

    model = _model("gpt_neox_japanese")
    mixers = _mixers(model, 2)
    for _, _, child in mixers:
        _randomise(child)
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(448, 512)[None]
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions).logits

    class Port(nn.Module):
        def __init__(self, ours: Any) -> None:
            super().__init__()
            self.ours = ours

        def forward(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            return self.ours(hidden_states, positions=positions), None, None

    biased = []
    for layer, name, child in mixers:
        child.config, child.is_causal = model.config, True
        ours = from_hf(child)
        biased.append(ours.spec.out_bias)
        fresh = copy.deepcopy(child)
        with torch.no_grad():
            for p in fresh.parameters():
                p.normal_()
        to_hf(ours, fresh)
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), child.parameters(), strict=True))
        x = np.random.default_rng(4).standard_normal((1, 16, 32)).astype(np.float32)
        with torch.no_grad():
            mine = ours(torch.from_numpy(x), positions=positions[:, :16]).numpy()
        twin = np.asarray(to_flax(ours)(jnp.asarray(x), positions=jnp.asarray(positions[:, :16].numpy())))
        assert float(np.abs(twin - mine).max() / np.abs(mine).max()) <= 1e-5
        setattr(layer, name, Port(ours))
    assert biased == [False, True]  # dense_bias on the last layer only
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=positions).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


@needs_torch
def test_alibi_slopes_are_transformers_own_for_any_number_of_heads() -> None:
    """The slopes from_hf gives ``alibi`` are those Bloom's ``_get_alibi_slopes`` and MPT's
    ``build_mpt_alibi_tensor`` build, bit for bit, for 1..12 heads (powers of two and not)
    (MPT's at ``alibi_bias_max`` 8: its model passes none from its config)."""
    import types

    import torch
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from torch_attention._hf import _alibi_slopes

    def bloom_like(hidden_states: Any, residual: Any, alibi: Any, attention_mask: Any) -> None: ...

    def mpt_like(hidden_states: Any, position_bias: Any, attention_mask: Any = None) -> None: ...

    for heads in range(1, 13):
        bloom = types.SimpleNamespace(num_heads=heads, forward=bloom_like)
        assert torch.equal(_alibi_slopes(bloom), _get_alibi_slopes(heads, torch.device("cpu"))), heads
        mpt = types.SimpleNamespace(n_heads=heads, forward=mpt_like)
        want = build_mpt_alibi_tensor(heads, 2)[:, 0, 0] * -1  # the bias at key S - 2: -slope
        assert torch.equal(_alibi_slopes(mpt), want), heads


@needs_torch
@pytest.mark.parametrize(("model_type", "overrides"), [
    ("bloom", {"n_head": 6, "hidden_size": 48}),
    ("mpt", {"n_heads": 6, "d_model": 48}),
])
def test_alibi_models_with_six_heads_give_transformers_logits(model_type: str, overrides: dict[str, Any]) -> None:
    """A tiny Bloom and MPT of 6 heads (slopes off the power of two; MPT's attn_config's
    alibi_bias_max 6, which its model ignores: 8),
    every attention ours (its layer given its model's config and causality), the residual
    Bloom's layer adds the caller's: the logits are transformers' (64 tokens, 1e-5 of the
    largest)."""
    import torch

    from tests.interop.test_hf_families import _AsHF, _mixers
    from torch_attention.interop import from_hf

    model = _model(model_type, **overrides)
    if model_type == "mpt":
        model.config.attn_config.alibi_bias_max = 6
        model = _model(model_type, **overrides, attn_config=model.config.attn_config)
    mixers = _mixers(model, 2)
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(1))
    for _, _, child in mixers:
        _randomise_here(child)
        child.config, child.is_causal = model.config, True
    with torch.no_grad():
        want = model(input_ids=ids).logits
    for layer, name, child in mixers:
        ours = from_hf(child)
        assert len(ours.spec.score_mod.slopes) == 6
        setattr(layer, name, _AsHF.wrap(ours, child, None))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


def _randomise_here(layer: Any) -> None:
    from tests.interop.test_hf_families import _randomise

    _randomise(layer)


@needs_torch
@pytest.mark.parametrize(("model_type", "change", "text"), [
    ("mimo_v2_flash", {"v_scale": 0.5}, "v_scale=0.5 where the layer has 0.707"),
    ("bloom", {"score_mod": None}, "score_mod=None where the layer has Alibi("),
])
def test_to_hf_refuses_a_module_that_would_not_compute_the_layer(ports: Any, model_type: str, change: dict[str, Any],
                                                                text: str) -> None:
    """to_hf refuses, naming the option, ours with another value scale (MiMo) or without the
    layer's ALiBi slopes (Bloom), before writing anything."""
    import torch

    from torch_attention import MultiHeadAttention
    from torch_attention.interop import to_hf

    ours = ports[model_type]["ours"]
    other = MultiHeadAttention(**{**ours.spec.options(), **change}).eval()
    other.load_state_dict(ours.state_dict())
    layer = _first_layer(_model(model_type))
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    with pytest.raises(ValueError, match=re.escape(text)):
        to_hf(other, layer)
    assert all(torch.equal(p, before[n]) for n, p in layer.named_parameters())
