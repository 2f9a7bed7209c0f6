"""Whole ``transformers`` models ported to Flax NNX with nothing written by hand but the
model's skeleton: Qwen3 (qk-norm over each head) and DeepSeek-V3 (latent attention, dense
layers), each through ``examples.port_llama``'s decoder with ``to_flax(from_hf(layer))``
per attention layer, and Gemma 3 (sliding and global layers, ``1 + w`` norms, a tied
head) through a skeleton of its own here.  ``infer_param_map`` derives the weight map (``copy_params`` and
``check_causal_lm_parity`` take it); ``locate_divergence`` pairs Hugging Face's attention children
with ours (``q_proj`` with ``W_query``; ``q_norm`` seen as (B, T, H, D) with ours as
(B, T, H * D); ``kv_b_proj`` with a unit axis) and finds nothing, forward and backward,
with no ``module_map``; a norm's epsilon planted wrong in layer 1 is named there.  Also
the map's refusals (unpaired parameters, both sides; a tie the port does not keep) and
``locate_divergence``'s handling of in-place ops and of layouts it does not know."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both
pytest.importorskip("transformers")

import torch  # noqa: E402
from flax import nnx  # noqa: E402
from torch import nn  # noqa: E402

from parity_tests import check_parity, copy_params, infer_param_map, locate_divergence  # noqa: E402

VOCAB, WIDTH, SEQ = 96, 64, 48


def _config(family: str) -> Any:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
                  pad_token_id=2, use_cache=False)
    if family == "qwen3":
        config = transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=16)
    else:  # every layer dense (first_k_dense_replace), q through its low-rank path
        config = transformers.DeepseekV3Config(**common, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                                               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                               first_k_dense_replace=2, moe_intermediate_size=32,
                                               n_routed_experts=4, num_experts_per_tok=2)
    config._attn_implementation = "eager"
    return config


def _hf(family: str) -> Any:
    import transformers

    from examples._proof import randomise

    cls = transformers.Qwen3ForCausalLM if family == "qwen3" else transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = cls(_config(family)).float().eval()
    randomise(model, 0, std=WIDTH ** -0.5)
    return model


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v3"])
def port(request: Any) -> tuple[Any, Any, list[Any]]:
    """(the Hugging Face model, its Flax port with the weights copied, the derived map)."""
    from examples.port_llama import LlamaForCausalLM

    hf = _hf(request.param)
    flax = LlamaForCausalLM(hf, nnx.Rngs(0))
    rules = infer_param_map(hf, flax)
    copy_params(hf, flax, rules)
    return hf, flax, rules


def _ids(seq: int = SEQ) -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, seq), dtype=np.int64)


LONG = 512  # the proofs of a whole port: positions past 400, where rope's float32 errors show


def _torch_call(m: Any, ids: Any) -> Any:
    return m(input_ids=ids).logits


def _flax_call(m: Any, ids: Any) -> Any:
    return m(ids)["logits"]


def test_left_padding_without_rows_points_to_rows(port: tuple[Any, Any, list[Any]]) -> None:
    """Issue 40: ``check_parity`` on a left-padded batch without ``rows=`` said "fails for
    26 of 26 tensors" and a bare ``tolerance_used=286332``.  The message now says where the
    failures lie (the padded rows, which see no key: an average of the values in Hugging
    Face's layers, zeros in ours) and points to ``rows=``; each failure says how many times
    its allowance it is.  With ``rows=`` it holds."""
    hf, flax, rules = port
    if "q_norm" not in dict(hf.model.layers[0].self_attn.named_children()):
        return  # the rows are the harness's: one family shows them
    ids, mask = _ids(), np.ones((2, SEQ), np.int64)
    mask[1, :5] = 0

    def torch_call(m: Any, ids: Any, mask: Any) -> Any:
        return m(input_ids=ids, attention_mask=mask).logits

    def flax_call(m: Any, ids: Any, mask: Any) -> Any:
        return m(ids, mask)["logits"]

    calls = dict(param_map=rules, torch_call=torch_call, flax_call=flax_call, grads=False)
    report = check_parity(hf, flax, ids, mask, **calls)
    assert not report.ok
    text = report.message()
    assert "the outputs differ in 5 of 96 query rows (example 1: rows 0-4) and nowhere else" in text, text
    assert "pass rows=" in text and "x its allowance" in text
    assert check_parity(hf, flax, ids, mask, rows=mask.astype(bool), **calls).ok


def test_one_call_proves_the_port_and_names_a_planted_bug(port: tuple[Any, Any, list[Any]]) -> None:
    """Issue 40, deliverable 3: ``check_causal_lm_parity`` on a left-padded batch of 512: logits
    at the real rows and every parameter's gradient, three AdamW steps, four greedy tokens
    decoded with one KV cache per layer (``examples.port_llama.greedy``: a key mask as long
    as the cache, ``generate``'s positions) against the sequence recomputed each step.
    With a norm's epsilon planted wrong in layer 1 it fails and names that norm."""
    from examples.port_llama import greedy
    from parity_tests import check_causal_lm_parity

    hf, flax, rules = port
    ids, mask = _ids(LONG), np.ones((2, LONG), np.int64)
    mask[1, :37] = 0
    report = check_causal_lm_parity(hf, flax, ids, mask, param_map=rules, steps=3, decode_steps=4, flax_decode=greedy)
    assert report.ok and report.divergence is None, report.message()
    assert report.logits.rows_left_out == 37 and len(report.training.steps) == 3 and report.tokens_agree
    # the derived map carried every parameter's gradient, the attention's to our modules
    grads = [f for f in report.logits.findings if f.name.startswith("grad ") and not f.name.startswith("grad input[")]
    assert len(grads) == len(list(hf.parameters()))
    attention = [r for r in rules if ".self_attn." in r.torch_names[0]]
    assert attention and all(r.flax_paths[0][:4] == ("model", "layers", int(r.torch_names[0].split(".")[2]),
                                                      "self_attn") for r in attention)
    assert [f.name for f in report.decoding] == [f"decode step {s} logits" for s in range(4)]
    if "q_norm" not in dict(hf.model.layers[0].self_attn.named_children()):
        return  # one planted bug is enough: Qwen3's
    norm = flax.model.layers[1].post_attention_layernorm
    saved, norm.epsilon = norm.epsilon, 1e-2
    try:
        broken = check_causal_lm_parity(hf, flax, ids, mask, param_map=rules, steps=0)
    finally:
        norm.epsilon = saved
    assert not broken.ok and broken.divergence is not None and broken.divergence.first is not None
    assert broken.divergence.first.torch_name == "model.layers.1.post_attention_layernorm"
    assert "where: first divergence forward at model.layers.1.post_attention_layernorm" in broken.message()
    with pytest.raises(ValueError, match="decode_steps needs flax_decode="):
        check_causal_lm_parity(hf, flax, ids, mask, decode_steps=2)
    with pytest.raises(ValueError, match=r"attention_mask must have the ids' shape \(2, 512\); got \(2, 511\)"):
        check_causal_lm_parity(hf, flax, ids, mask[:, 1:])


def test_a_whole_port_is_ok_forward_and_backward_without_a_module_map(port: tuple[Any, Any, list[Any]]) -> None:
    hf, flax, _ = port
    report = locate_divergence(hf, flax, _ids(), torch_call=_torch_call, flax_call=_flax_call)
    assert report.ok and report.backward_checked and not report.backward_note, str(report)
    # every module of Hugging Face's paired, the rotary embedding (ours turns q and k inside) aside
    assert report.torch_only == ["model.rotary_emb (call 0)"]
    assert sorted(report.flax_only) == ["model.layers.0.self_attn.rope", "model.layers.1.self_attn.rope"]
    names = {p.torch_name for p in report.pairs}
    children = ({"q_proj", "q_norm", "k_norm", "o_proj"} if "q_norm" in dict(hf.model.layers[0].self_attn.named_children())
                else {"q_a_proj", "q_a_layernorm", "kv_a_layernorm", "kv_b_proj", "o_proj"})
    assert {f"model.layers.1.self_attn.{c}" for c in children} <= names
    compared = [p for p in report.pairs if p.torch_name.startswith("model.layers.1.self_attn.")]
    assert all(p.output.ok and p.input_cotangent.ok for p in compared), str(report)


def test_a_norm_epsilon_planted_in_layer_1_is_named_there(port: tuple[Any, Any, list[Any]]) -> None:
    hf, flax, _ = port
    norm = flax.model.layers[1].post_attention_layernorm
    saved = norm.epsilon
    norm.epsilon = 1e-2
    try:
        report = locate_divergence(hf, flax, _ids(), torch_call=_torch_call, flax_call=_flax_call)
    finally:
        norm.epsilon = saved
    first = report.first
    assert first is not None and (first.torch_name, first.direction) == \
        ("model.layers.1.post_attention_layernorm", "forward"), str(report)
    assert first.flax_path == ("model", "layers", 1, "post_attention_layernorm")
    assert report.backward_note.startswith("backward not checked: the forward parts at "
                                           "model.layers.1.post_attention_layernorm")
    assert report.backward_note in str(report).splitlines()[1]


def test_gpt2s_packed_conv1d_and_tied_weights_are_derived() -> None:
    """GPT-2: a packed ``c_attn`` split in three (``SplitQKV`` on Conv1D's (in, out)), the
    output ``c_proj`` and the MLP's Conv1D weights untransposed, the head tied to the
    embedding (the port ties it too: no rule for ``lm_head``)."""
    from attention_spec.interop.specs import SplitQKV, Transpose
    from examples import port_gpt2

    hf = port_gpt2.hf_model()
    rules = {r.torch_names[0]: r for r in infer_param_map(hf, port_gpt2.port(hf))}
    attn = ("transformer", "h", 1, "attn")
    packed = rules["transformer.h.1.attn.c_attn.weight"]
    assert packed.steps == (SplitQKV("in_out"), Transpose())
    assert packed.flax_paths == tuple((*attn, w, "kernel") for w in ("W_query", "W_key", "W_value"))
    assert rules["transformer.h.1.attn.c_attn.bias"].flax_paths == tuple((*attn, w, "bias")
                                                                          for w in ("W_query", "W_key", "W_value"))
    assert rules["transformer.h.1.attn.c_proj.weight"].steps == ()
    assert rules["transformer.h.1.attn.c_proj.weight"].flax_paths == ((*attn, "out_proj", "kernel"),)
    assert rules["transformer.h.1.mlp.c_fc.weight"].steps == ()
    assert rules["transformer.wte.weight"].flax_paths == (("transformer", "wte", "embedding"),)
    assert not any(name.startswith("lm_head") for name in rules)
    assert len(rules) == len(list(hf.parameters()))


# --------------------------------------------------------------------------- Gemma 3


class _GemmaNorm(nnx.Module):
    """Gemma's RMSNorm: in float32, times ``1 + scale``, rounded once."""

    def __init__(self, width: int, eps: float) -> None:
        import jax.numpy as jnp

        self.scale, self.eps = nnx.Param(jnp.zeros((width,), jnp.float32)), eps

    def __call__(self, x: Any) -> Any:
        import jax
        import jax.numpy as jnp

        y = x.astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        scale = (1.0 + self.scale[...]).reshape((1,) * (y.ndim - 1) + (-1,))  # ranks explicit: tests raise
        return (y * scale).astype(x.dtype)


class _GemmaMLP(nnx.Module):
    def __init__(self, width: int, inner: int) -> None:
        rngs = nnx.Rngs(0)
        self.gate_proj = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(inner, width, use_bias=False, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        import jax

        return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class _GemmaLayer(nnx.Module):
    """Gemma 3's sandwich: norms before and after the attention and the MLP."""

    def __init__(self, hf_layer: Any, c: Any) -> None:
        from parity_tests import to_flax
        from torch_attention.interop import from_hf

        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, _GemmaNorm(c.hidden_size, c.rms_norm_eps))
        self.self_attn = to_flax(from_hf(hf_layer.self_attn))  # its window or not, its rope, 1 + w qk-norms
        self.mlp = _GemmaMLP(c.hidden_size, c.intermediate_size)

    def __call__(self, x: Any, mask: Any, positions: Any) -> Any:
        attended = self.self_attn(self.input_layernorm(x), mask, positions=positions, return_weights=True)[0]
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _GemmaEmbed(nnx.Module):
    """Gemma's embedding, scaled by sqrt(width), with PyTorch's ``padding_idx``: the pad
    row gets no gradient through the lookup (the proof found it: 256 apart at that row
    without), though it does through the tied output head, its transpose."""

    def __init__(self, vocab: int, width: int, padding_idx: int) -> None:
        import jax.numpy as jnp

        self.embedding, self.width = nnx.Param(jnp.zeros((vocab, width), jnp.float32)), width
        self.padding_idx = padding_idx

    def __call__(self, ids: Any) -> Any:
        import jax
        import jax.numpy as jnp

        table = self.embedding[...]
        frozen = (jnp.arange(table.shape[0]) == self.padding_idx)[:, None]
        looked_up = jnp.take(jnp.where(frozen, jax.lax.stop_gradient(table), table), ids, axis=0)
        return looked_up * jnp.float32(self.width ** 0.5)


class _GemmaModel(nnx.Module):
    def __init__(self, hf: Any) -> None:
        c = hf.config
        self.embed_tokens = _GemmaEmbed(c.vocab_size, c.hidden_size, c.pad_token_id)
        self.layers = nnx.List([_GemmaLayer(layer, c) for layer in hf.model.layers])
        self.norm = _GemmaNorm(c.hidden_size, c.rms_norm_eps)


class _Gemma3ForCausalLM(nnx.Module):
    def __init__(self, hf: Any) -> None:
        self.model = _GemmaModel(hf)

    def __call__(self, ids: Any, attention_mask: Any = None) -> Any:
        import jax.numpy as jnp

        mask = None if attention_mask is None else jnp.asarray(attention_mask)[:, None, None, :].astype(bool)
        x, positions = self.model.embed_tokens(ids), jnp.arange(ids.shape[1])[None]
        for layer in self.model.layers:
            x = layer(x, mask, positions)
        return {"logits": self.model.norm(x) @ self.model.embed_tokens.embedding[...].T}


def test_a_whole_gemma3_port_with_sliding_and_global_layers_and_a_tied_head() -> None:
    """Gemma 3 (a local layer with a window of 8 and rope theta 1e4, a global one with
    linear scaling; ``1 + w`` norms, qk-norms in (B, H, T, D); the head tied to the
    scaled embedding): the derived map (no rule for the tied head, the port ties it too),
    logits and gradients at the real rows of a left-padded batch and two AdamW steps in one
    call, and ``locate_divergence`` clean forward and backward with no ``module_map``."""
    import transformers

    from examples._proof import randomise
    from parity_tests import check_causal_lm_parity

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024, pad_token_id=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config).float().eval()
    randomise(hf, 0, std=WIDTH ** -0.5)
    with torch.no_grad():  # Gemma's norms scale by 1 + w: w near 0 (randomise draws near 1), unit scale
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    flax = _Gemma3ForCausalLM(hf)
    rules = infer_param_map(hf, flax)
    assert not any(r.torch_names[0].startswith("lm_head") for r in rules)
    copy_params(hf, flax, rules)
    ids, mask = _ids(LONG), np.ones((2, LONG), np.int64)
    mask[1, :37] = 0
    report = check_causal_lm_parity(hf, flax, ids, mask, param_map=rules, steps=2)
    assert report.ok, report.message()
    where = locate_divergence(hf, flax, ids, torch_call=_torch_call, flax_call=_flax_call)
    assert where.ok and where.backward_checked, str(where)


def test_generate_positions_count_real_tokens_only() -> None:
    from parity_tests.causal_lm import generate_positions

    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(generate_positions(mask), [[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]])


# --------------------------------------------------------------------------- refusals


class _TorchTiny(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight


class _FlaxTiny(nnx.Module):
    def __init__(self, head: bool = True, extra: bool = False) -> None:
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(10, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        if head:
            self.head = nnx.Linear(4, 10, use_bias=False, rngs=rngs)
        if extra:
            self.gate = nnx.Linear(4, 4, rngs=rngs)


def test_a_map_that_cannot_pair_everything_names_both_sides_and_maps_nothing() -> None:
    rules = infer_param_map(_TorchTiny(), _FlaxTiny())
    assert {r.torch_names[0]: r.flax_paths[0] for r in rules} == {
        "embed.weight": ("embed", "embedding"), "norm.weight": ("norm", "scale"), "norm.bias": ("norm", "bias"),
        "head.weight": ("head", "kernel")}
    with pytest.raises(ValueError) as err:
        infer_param_map(_TorchTiny(), _FlaxTiny(head=False, extra=True))
    text = str(err.value)
    assert "PyTorch parameter 'head.weight' is paired with nothing" in text
    assert "Flax parameter 'gate/kernel' is paired with nothing" in text
    assert "Flax parameter 'gate/bias' is paired with nothing" in text


def test_a_tie_is_kept_only_where_the_port_ties_too() -> None:
    tied = _TorchTiny(tie=True)
    assert [r.torch_names[0] for r in infer_param_map(tied, _FlaxTiny(head=False))] == [
        "embed.weight", "norm.weight", "norm.bias"]
    with pytest.raises(ValueError, match="PyTorch ties 'head.weight' to 'embed.weight', but the Flax head has "
                                         "parameters of its own"):
        infer_param_map(tied, _FlaxTiny())
    with pytest.raises(TypeError, match="infer_param_map takes a PyTorch nn.Module and a Flax nnx.Module"):
        infer_param_map(_FlaxTiny(), tied)


# --------------------------------------------------------------------------- in place and layouts


class _TorchInPlace(nn.Module):
    """fc -> ReLU(inplace=True) -> out, and a residual added in place between modules."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.act, self.out = nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(self.act(self.fc(x)))
        h += x  # writes out's output after it was recorded
        return h


class _FlaxInPlace(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.fc, self.out = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)
        self.act = _Relu()

    def __call__(self, x: Any) -> Any:
        return self.out(self.act(self.fc(x))) + x


class _Relu(nnx.Module):
    def __call__(self, x: Any) -> Any:
        import jax

        return jax.nn.relu(x)


def test_in_place_ops_on_the_torch_side_give_no_false_alarm() -> None:
    pt, fx = _TorchInPlace(), _FlaxInPlace()
    copy_params(pt, fx, infer_param_map(pt, fx))
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    report = locate_divergence(pt, fx, x)
    assert report.ok and report.backward_checked, str(report)
    act = next(p for p in report.pairs if p.torch_name == "act")
    assert act.input_cotangent.ok  # the ReLU's own backward: its input's cotangent, not its output's
    out = next(p for p in report.pairs if p.torch_name == "out")
    assert out.output_cotangent.ok is None and "wrote this output in place" in out.output_cotangent.note
    assert "n/c" in str(report)


def test_layouts_are_aligned_by_shape_and_declaration_never_by_values() -> None:
    from parity_tests.divergence import _aligned, _compare_arrays
    from parity_tests.tolerances import PARITY

    ours = np.arange(2 * 5 * 3 * 4, dtype=np.float32).reshape(2, 5, 12)  # (B, T, H * D)
    bthd = ours.reshape(2, 5, 3, 4)
    bhtd = bthd.transpose(0, 2, 1, 3)
    assert np.array_equal(_aligned(bthd, ours.shape, None), ours)
    assert _aligned(bhtd, ours.shape, None) is None  # heads first only where declared
    assert np.array_equal(_aligned(bhtd, ours.shape, "heads"), ours)
    assert np.array_equal(_aligned(ours[:, None], ours.shape, None), ours)  # a unit axis
    assert _aligned(ours[:, :4], ours.shape, None) is None
    unknown = _compare_arrays([("output", ours.reshape(2, 12, 5), ours)], PARITY, None, None)
    assert unknown.ok is None and "not compared" in unknown.note and "(2, 12, 5)" in unknown.note
    smaller = _compare_arrays([("output", ours[:, :4], ours)], PARITY, None, None)
    assert smaller.ok is False and smaller.max_rel == float("inf")
