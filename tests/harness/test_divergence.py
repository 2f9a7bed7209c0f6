"""``locate_divergence`` on a small multi-block model written twice (PyTorch and Flax NNX:
embedding -> blocks of [LayerNorm, this library's MultiHeadAttention with rope, LayerNorm,
MLP with a custom activation] -> LayerNorm -> head), weights copied: a faithful port is
clean forward and backward, and each planted bug is located at its innermost module,
forward or backward as the bug is."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

import jax_attention as ja
import torch_attention as ta
from attention_spec.rope import RopeConfig
from parity_tests import copy_params, locate_divergence, to_flax
from parity_tests.tolerances import PARITY

D, HEADS, VOCAB, CONTEXT, BLOCKS = 16, 2, 32, 32, 3
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 12))


# --------------------------------------------------------------------------- the activation

def _quick_gelu_np(x: Any, sigmoid: Callable[[Any], Any]) -> Any:
    return x * sigmoid(1.702 * x)


class _WrongGradTorch(torch.autograd.Function):
    """x * sigmoid(1.702 x), right forward; backward forgets the product rule's x * s' term."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _quick_gelu_np(x, torch.sigmoid)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(1.702 * x)


@jax.custom_vjp
def _wrong_grad_jax(x: jax.Array) -> jax.Array:
    return _quick_gelu_np(x, jax.nn.sigmoid)


def _wrong_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _wrong_grad_jax(x), x


def _wrong_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return (g * jax.nn.sigmoid(1.702 * x),)  # the same mistake as the torch one


_wrong_grad_jax.defvjp(_wrong_fwd, _wrong_bwd)


class TorchAct(nn.Module):
    def __init__(self, wrong_grad: bool = False) -> None:
        super().__init__()
        self.wrong_grad = wrong_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WrongGradTorch.apply(x) if self.wrong_grad else _quick_gelu_np(x, torch.sigmoid)


class FlaxAct(nnx.Module):
    def __init__(self, wrong_grad: bool = False) -> None:
        self.wrong_grad = wrong_grad

    def __call__(self, x: jax.Array) -> jax.Array:
        return _wrong_grad_jax(x) if self.wrong_grad else _quick_gelu_np(x, jax.nn.sigmoid)


# --------------------------------------------------------------------------- the model, twice

class TorchBlock(nn.Module):
    def __init__(self, wrong_grad: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D, eps=1e-5)
        self.attn = ta.MultiHeadAttention(D, D, CONTEXT, 0.0, HEADS, rope=RopeConfig(layout="half"))
        self.ln2 = nn.LayerNorm(D, eps=1e-5)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(D, 4 * D), "act": TorchAct(wrong_grad),
                                  "fc2": nn.Linear(4 * D, D)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = self.mlp["fc2"](self.mlp["act"](self.mlp["fc1"](self.ln2(x))))
        return x + h


class TorchModel(nn.Module):
    def __init__(self, wrong_grad_block: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(TorchBlock(i == wrong_grad_block) for i in range(BLOCKS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class FlaxMLP(nnx.Module):
    def __init__(self, wrong_grad: bool, rngs: nnx.Rngs) -> None:
        self.fc1 = nnx.Linear(D, 4 * D, rngs=rngs)
        self.act = FlaxAct(wrong_grad)
        self.fc2 = nnx.Linear(4 * D, D, rngs=rngs)


class FlaxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, ln2_eps: float = 1e-5, layout: str = "half",
                 wrong_grad: bool = False) -> None:
        self.ln1 = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
        self.attn = ja.MultiHeadAttention(D, D, CONTEXT, 0.0, HEADS, rope=RopeConfig(layout=layout), rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, epsilon=ln2_eps, rngs=rngs)
        self.mlp = FlaxMLP(wrong_grad, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp.fc2(self.mlp.act(self.mlp.fc1(self.ln2(x))))


class FlaxHead(nnx.Module):
    """The head; ``as_dict`` returns {"logits": ...} instead of the array (a port whose
    submodule's output has another structure than the original's)."""

    def __init__(self, as_dict: bool, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)
        self.as_dict = as_dict

    def __call__(self, x: jax.Array) -> Any:
        y = x @ self.linear.kernel[...]
        return {"logits": y} if self.as_dict else y


class FlaxModel(nnx.Module):
    def __init__(self, blocks: list[dict[str, Any]] | None = None, *, names: str = "blocks",
                 head_dict: bool = False) -> None:
        rngs = nnx.Rngs(0)
        options = blocks or [{} for _ in range(BLOCKS)]
        self.emb = nnx.Embed(VOCAB, D, rngs=rngs)
        setattr(self, names, nnx.List([FlaxBlock(rngs, **o) for o in options]))
        self.names = names
        self.ln_f = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
        self.head = FlaxHead(head_dict, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.emb(tokens)
        for block in getattr(self, self.names):
            x = block(x)
        y = self.head(self.ln_f(x))
        return y["logits"] if isinstance(y, dict) else y


def _copy_norm(t: Any, f: Any) -> None:
    f.scale[...] = jnp.asarray(t.weight.detach().numpy())
    f.bias[...] = jnp.asarray(t.bias.detach().numpy())


def _copy_linear(t: Any, f: Any) -> None:
    f.kernel[...] = jnp.asarray(t.weight.detach().numpy().T)
    if t.bias is not None:
        f.bias[...] = jnp.asarray(t.bias.detach().numpy())


def port(torch_model: Any, flax_model: Any) -> Any:
    """Every weight of the torch model copied into the Flax one (a faithful port)."""
    flax_model.emb.embedding[...] = jnp.asarray(torch_model.emb.weight.detach().numpy())
    for t, f in zip(torch_model.blocks, getattr(flax_model, flax_model.names), strict=True):
        _copy_norm(t.ln1, f.ln1)
        _copy_norm(t.ln2, f.ln2)
        copy_params(t.attn, f.attn)
        _copy_linear(t.mlp["fc1"], f.mlp.fc1)
        _copy_linear(t.mlp["fc2"], f.mlp.fc2)
    _copy_norm(torch_model.ln_f, flax_model.ln_f)
    _copy_linear(torch_model.head, flax_model.head.linear)
    return flax_model


def _block_options(index: int, **planted: Any) -> list[dict[str, Any]]:
    return [planted if i == index else {} for i in range(BLOCKS)]


# --------------------------------------------------------------------------- the tests

def test_a_faithful_port_is_clean_forward_and_backward() -> None:
    torch_model = TorchModel()
    report = locate_divergence(torch_model, port(torch_model, FlaxModel()), TOKENS)
    assert report.ok and report.first is None and report.backward_checked, str(report)
    assert not report.torch_only and not report.flax_only
    names = [p.torch_name for p in report.pairs]
    # the projections and the rotation, computed inside the attention module, are seen in both
    for sub in ("W_query", "W_key", "W_value", "rope", "out_proj"):
        assert f"blocks.1.attn.{sub}" in names
    tol = PARITY["float32"].rtol
    assert max(p.output.max_rel for p in report.pairs) < tol
    assert max(p.input_cotangent.max_rel for p in report.pairs if p.input_cotangent.ok is not None) < tol
    assert "no divergence" in str(report)


def _located(flax_model: FlaxModel, torch_model: TorchModel | None = None, **kwargs: Any) -> Any:
    torch_model = torch_model or TorchModel()
    report = locate_divergence(torch_model, port(torch_model, flax_model), TOKENS, **kwargs)
    assert not report.ok and report.first is not None, str(report)
    return report


def test_a_wrong_layernorm_epsilon_is_located_at_that_norm() -> None:
    report = _located(FlaxModel(_block_options(1, ln2_eps=1e-3)))
    first = report.first
    assert (first.torch_name, first.flax_path, first.direction) == ("blocks.1.ln2", ("blocks", 1, "ln2"), "forward")
    assert first.max_rel > PARITY["float32"].rtol


def _nudged(flax_model: Any, pick: Callable[[Any], Any], index: tuple[int, int]) -> Any:
    param = pick(flax_model)
    param[...] = param[...].at[index].add(1e-3)
    return flax_model


def test_one_weight_nudged_by_1e3_is_located_at_its_projection() -> None:
    torch_model = TorchModel()
    flax_model = port(torch_model, FlaxModel())
    _nudged(flax_model, lambda m: m.blocks[0].attn.W_key.kernel, (3, 5))
    report = locate_divergence(torch_model, flax_model, TOKENS)
    assert report.first is not None, str(report)
    assert (report.first.torch_name, report.first.direction) == ("blocks.0.attn.W_key", "forward"), str(report)


def test_a_transposed_square_weight_is_located_at_its_projection() -> None:
    torch_model: Any = TorchModel()
    flax_model = port(torch_model, FlaxModel())
    flax_model.blocks[2].attn.out_proj.kernel[...] = jnp.asarray(torch_model.blocks[2].attn.out_proj.weight.detach().numpy())
    report = locate_divergence(torch_model, flax_model, TOKENS)
    assert report.first is not None, str(report)
    assert (report.first.torch_name, report.first.direction) == ("blocks.2.attn.out_proj", "forward"), str(report)


def test_a_swapped_rotary_layout_is_located_at_that_rotation() -> None:
    report = _located(FlaxModel(_block_options(1, layout="interleaved")))
    assert (report.first.torch_name, report.first.flax_path) == ("blocks.1.attn.rope", ("blocks", 1, "attn", "rope"))
    assert report.first.direction == "forward"


@pytest.mark.parametrize("side", ["flax", "torch"])
def test_a_wrong_gradient_activation_is_located_backward(side: str) -> None:
    # right forward, wrong backward (a custom_vjp on the Flax side, an autograd.Function
    # on the PyTorch side): the forward pass agrees everywhere, the backward does not
    block = 2 if side == "flax" else 0
    flax_model = FlaxModel(_block_options(block, wrong_grad=True) if side == "flax" else None)
    report = _located(flax_model, TorchModel(wrong_grad_block=block if side == "torch" else None))
    assert all(p.output.ok for p in report.pairs)
    first = report.first
    assert (first.torch_name, first.flax_path) == (f"blocks.{block}.mlp.act", ("blocks", block, "mlp", "act"))
    assert first.direction == "backward" and first.max_rel > 1e-2


def test_outputs_of_different_structures_are_reported_not_raised() -> None:
    report = _located(FlaxModel(head_dict=True), backward=False)
    first = report.first
    assert (first.torch_name, first.direction, first.max_rel) == ("head", "forward", float("inf"))
    assert "structures differ" in first.note and "logits" in first.note
    assert "structures differ" in str(report)


def test_module_map_pairs_other_names() -> None:
    torch_model = TorchModel()
    flax_model = port(torch_model, FlaxModel(names="layers"))
    unmapped = locate_divergence(torch_model, flax_model, TOKENS, backward=False)
    assert any(name.startswith("blocks.1.attn") for name in unmapped.torch_only)
    assert any(name.startswith("layers.1.attn") for name in unmapped.flax_only)
    _nudged(flax_model, lambda m: m.layers[1].mlp.fc1.kernel, (2, 7))
    report = locate_divergence(torch_model, flax_model, TOKENS, module_map={"blocks": "layers"})
    assert not report.torch_only and not report.flax_only
    assert report.first is not None and report.first.direction == "forward"
    assert (report.first.torch_name, report.first.flax_path) == ("blocks.1.mlp.fc1", ("layers", 1, "mlp", "fc1"))


def test_the_table_marks_the_first_and_the_plot_is_written(tmp_path: Path) -> None:
    plot = tmp_path / "divergence.png"
    report = _located(FlaxModel(_block_options(0, ln2_eps=1e-3)), plot=plot)
    lines = str(report).splitlines()
    assert lines[0].startswith("first divergence forward at blocks.0.ln2")
    marked = [line for line in lines if line.lstrip().startswith(">>")]
    assert len(marked) == 1 and "ln2" in marked[0] and marked[0].endswith("<- first")
    assert len([line for line in lines if "!" in line]) > 1  # what follows the bug fails too
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _TorchLoop(nn.Module):
    """One layer applied three times (a loop, or tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.tanh(self.layer(x))
        return x


class _FlaxLayer(nnx.Module):
    """A Linear that goes wrong at its second call only (a per-call state bug)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.calls = 0

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls += 1
        return self.linear(x) + (1e-3 if self.calls == 2 else 0.0)


class _FlaxLoop(nnx.Module):
    def __init__(self) -> None:
        self.layer = _FlaxLayer(nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(3):
            x = jnp.tanh(self.layer(x))
        return x


def test_a_module_called_several_times_is_compared_call_by_call() -> None:
    torch_model, flax_model = _TorchLoop(), _FlaxLoop()
    _copy_linear(torch_model.layer, flax_model.layer.linear)
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    report = locate_divergence(torch_model, flax_model, x, backward=False)
    assert [(p.torch_name, p.call) for p in report.pairs] == [("", 0), ("layer", 0), ("layer", 1), ("layer", 2)]
    assert report.first is not None and (report.first.torch_name, report.first.call) == ("layer", 1)
    assert report.pairs[1].output.ok and not report.pairs[3].inputs.ok


def test_qk_norms_are_seen_as_submodules_and_located() -> None:
    torch.manual_seed(0)
    pt = ta.MultiHeadAttention(8, 8, 16, 0.0, 2, qk_norm="rms").eval()
    fx = to_flax(pt)
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    clean = locate_divergence(pt, fx, x)
    assert clean.ok, str(clean)
    assert [p.torch_name for p in clean.pairs] == ["", "W_query", "q_norm", "W_key", "k_norm", "W_value", "out_proj"]
    fx.k_norm.scale[...] = fx.k_norm.scale[...].at[1].multiply(1.01)
    report = locate_divergence(pt, fx, x)
    assert report.first is not None and (report.first.torch_name, report.first.direction) == ("k_norm", "forward")


# --------------------------------------------------------------------------- boundary mismatches: Gemma 2

def _gemma2() -> Any:
    """A tiny ``transformers`` Gemma 2 (width 64: its embedding scales by sqrt(64) = 8
    inside ``Gemma2TextScaledWordEmbedding``), every weight random, its ``1 + w`` norms
    near 1."""
    import transformers

    from parity_tests.causal_lm import randomise

    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256, pad_token_id=2,
        use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(config).float().eval()
    randomise(hf, 0, norm_mean=0.0)
    return hf


class _GemmaNorm(nnx.Module):
    def __init__(self, width: int, eps: float) -> None:
        self.scale, self.eps = nnx.Param(jnp.zeros((width,), jnp.float32)), eps

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return y * (1.0 + self.scale[...]).reshape((1,) * (x.ndim - 1) + (-1,))  # ranks explicit


class _GemmaMLP(nnx.Module):
    def __init__(self, width: int, inner: int, rngs: nnx.Rngs) -> None:
        self.gate_proj = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(inner, width, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class _GemmaLayer(nnx.Module):
    def __init__(self, hf_layer: Any, c: Any, rngs: nnx.Rngs) -> None:
        from torch_attention.interop import from_hf

        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, _GemmaNorm(c.hidden_size, c.rms_norm_eps))
        self.self_attn = to_flax(from_hf(hf_layer.self_attn))  # its window, its soft cap, its scale
        self.mlp = _GemmaMLP(c.hidden_size, c.intermediate_size, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        attended = self.self_attn(self.input_layernorm(x), positions=positions, return_weights=True)[0]
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _Gemma2Model(nnx.Module):
    def __init__(self, hf: Any, scale_inside: bool) -> None:
        from parity_tests.causal_lm import PaddedEmbed

        c, rngs = hf.config, nnx.Rngs(0)
        self.embed_tokens = PaddedEmbed(c.vocab_size, c.hidden_size, c.pad_token_id, rngs,
                                        scale=c.hidden_size ** 0.5 if scale_inside else None)
        self.layers = nnx.List([_GemmaLayer(layer, c, rngs) for layer in hf.model.layers])
        self.norm = _GemmaNorm(c.hidden_size, c.rms_norm_eps)


class _Gemma2ForCausalLM(nnx.Module):
    """Gemma 2 in Flax NNX, named as Hugging Face's; ``scale_inside=False`` is the
    newcomer's port: the embedding unscaled and the hidden states scaled after it."""

    def __init__(self, hf: Any, scale_inside: bool) -> None:
        self.model = _Gemma2Model(hf, scale_inside)
        self.scale_after = None if scale_inside else hf.config.hidden_size ** 0.5
        self.cap = hf.config.final_logit_softcapping

    def __call__(self, ids: jax.Array) -> dict[str, jax.Array]:
        x = self.model.embed_tokens(ids)
        if self.scale_after is not None:
            x = x * jnp.float32(self.scale_after)
        positions = jnp.arange(ids.shape[1])[None]
        for layer in self.model.layers:
            x = layer(x, positions)
        logits = self.model.embed_tokens.attend(self.model.norm(x))
        return {"logits": jnp.tanh(logits / self.cap) * self.cap}  # shaped as Hugging Face's output


def _gemma2_port(hf: Any, scale_inside: bool) -> Any:
    from parity_tests import infer_param_map

    flax = _Gemma2ForCausalLM(hf, scale_inside)
    copy_params(hf, flax, infer_param_map(hf, flax))
    return flax


@pytest.fixture(scope="module")
def gemma2() -> tuple[Any, Any]:
    """(Hugging Face's Gemma 2, the port scaling after its embedding)."""
    hf = _gemma2()
    return hf, _gemma2_port(hf, scale_inside=False)


def _gemma_locate(hf: Any, flax: Any, **kwargs: Any) -> Any:
    return locate_divergence(hf, flax, TOKENS, torch_call=lambda m, x: m(input_ids=x).logits,
                             flax_call=lambda m, x: m(x)["logits"], **kwargs)


def test_a_scale_moved_out_of_the_embedding_is_a_boundary_mismatch_not_a_divergence(gemma2: tuple[Any, Any]) -> None:
    """Issue 56: a correct Gemma 2 port that scales by sqrt(hidden) after its embedding,
    where ``Gemma2TextScaledWordEmbedding`` scales inside, was reported diverging at
    ``model.embed_tokens`` (7.0 relative) and hid every bug behind it.  It is a boundary
    mismatch now, its factor named, searched past: nothing diverges forward or backward
    (the scale moved scales that output's cotangent too, which is searched past as well).
    The port that scales inside the module has no mismatch at all."""
    hf, after = gemma2
    report = _gemma_locate(hf, after)
    assert report.ok and report.first is None and report.backward_checked, str(report)
    [boundary] = report.boundaries
    assert (boundary.torch_name, boundary.flax_path) == ("model.embed_tokens", ("model", "embed_tokens"))
    assert boundary.factor == pytest.approx(8.0, rel=1e-6)
    embed = next(p for p in report.pairs if p.torch_name == "model.embed_tokens")
    assert embed.output.max_rel == pytest.approx(7.0, rel=1e-6)  # what the newcomer saw
    text = str(report)
    assert text.splitlines()[0].endswith("but for 1 boundary mismatch (below)"), text
    assert "model.embed_tokens: the PyTorch module's output is the Flax module's times 8 (sqrt(64))" in text
    assert "must compute what the original's module of its name computes" in text
    assert any(re.match(r"\s*~~\s+model\.embed_tokens\s.*<- boundary$", line) for line in text.splitlines()), text
    right = _gemma_locate(hf, _gemma2_port(hf, scale_inside=True), backward=False)
    assert right.ok and not right.boundaries, str(right)


def test_a_bug_behind_a_boundary_mismatch_is_still_named(gemma2: tuple[Any, Any]) -> None:
    """The same port with a norm's epsilon planted wrong in layer 1: the first divergence
    is that norm, forward, and the embedding's mismatch is still reported beside it."""
    hf, after = gemma2
    norm = after.model.layers[1].post_feedforward_layernorm
    saved, norm.eps = norm.eps, 1e-1
    try:
        report = _gemma_locate(hf, after)
    finally:
        norm.eps = saved
    first = report.first
    assert first is not None and (first.torch_name, first.direction) == (
        "model.layers.1.post_feedforward_layernorm", "forward"), str(report)
    assert [b.torch_name for b in report.boundaries] == ["model.embed_tokens"], str(report)


class _HalfEmbed(nnx.Module):
    """An embedding that returns half the lookup (its model doubles it after)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, D)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0) * 0.5


class _ScaledAfter(FlaxModel):
    """The small model's port with its embedding's work split otherwise: ``emb`` halves,
    the model doubles after it (the same numbers out)."""

    def __init__(self, blocks: list[dict[str, Any]] | None = None) -> None:
        super().__init__(blocks)
        self.emb = _HalfEmbed(nnx.Rngs(0))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.emb(tokens) * 2.0
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_a_scale_split_across_modules_is_searched_past_in_a_small_model() -> None:
    """The small model's port whose embedding halves and whose model doubles after it: a
    boundary mismatch at ``emb`` (factor 2), nothing diverging; with a norm's epsilon
    planted wrong in block 1, that norm is named, the mismatch still reported."""
    torch_model = TorchModel()
    clean = locate_divergence(torch_model, port(torch_model, _ScaledAfter()), TOKENS, backward=False)
    assert clean.ok and [(b.torch_name, b.factor) for b in clean.boundaries] == [("emb", 2.0)], str(clean)
    assert "emb: the PyTorch module's output is the Flax module's times 2:" in str(clean)
    report = locate_divergence(torch_model, port(torch_model, _ScaledAfter(_block_options(1, ln2_eps=1e-3))), TOKENS)
    assert report.first is not None and (report.first.torch_name, report.first.direction) == ("blocks.1.ln2", "forward")
    assert [b.torch_name for b in report.boundaries] == ["emb"], str(report)


def test_a_constant_factor_that_is_not_undone_is_the_divergence() -> None:
    """A scale planted wrong (a qk-norm's weight times 1.01: that norm's output is the
    other's times a constant) is not undone within the attention layer around it: it is
    the divergence, named with its factor, not a boundary mismatch."""
    torch.manual_seed(0)
    pt = ta.MultiHeadAttention(8, 8, 16, 0.0, 2, qk_norm="rms").eval()
    fx = to_flax(pt)
    fx.k_norm.scale[...] = fx.k_norm.scale[...] * 1.01
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    report = locate_divergence(pt, fx, x)
    first = report.first
    assert first is not None and (first.torch_name, first.direction) == ("k_norm", "forward"), str(report)
    assert "times 0.9901, not undone within (root)" in first.note and not report.boundaries


def test_the_twins_of_a_sparse_layer_tied_by_rounding_agree_and_a_wrong_indexer_rope_is_its_choice() -> None:
    """Our sparse attention (DSA) in both twins, one module each (no model around it): scores
    made to tie within float32 rounding (the indexer's keys all its LayerNorm's bias but
    for a part 1e-7 as large) choose otherwise in the two frameworks, reported as ties, the
    Flax twin run on the PyTorch twin's choice agreeing at every pair; the Flax indexer's
    rope turned in the other layout is the divergence, at the module's choice of keys."""
    import dataclasses

    from tests.modules.test_sparse_attention import CONFIG, B, T, _torch_module

    x = np.random.default_rng(1).standard_normal((B, T, 32)).astype(np.float32)
    tied = _torch_module({**CONFIG, "rope": None})
    with torch.no_grad():
        tied.indexer.k_norm.weight.fill_(1e-7)
        tied.indexer.k_norm.bias.uniform_(0.5, 1.0)
    report = locate_divergence(tied, to_flax(tied), x, backward=False)
    (choice,) = report.selections
    assert report.ok and choice.ties_only and choice.agreeing.ok, str(report)
    assert {"indexer.wq_b", "indexer.wk", "indexer.weights_proj"} <= {p.torch_name for p in report.pairs if p.output.ok}
    module = _torch_module(CONFIG)
    bugged = to_flax(module)
    object.__setattr__(bugged, "spec", dataclasses.replace(bugged.spec, index_rope_layout="interleaved"))
    wrong = locate_divergence(module, bugged, x, backward=False)
    assert wrong.first is not None and (wrong.first.torch_name, wrong.first.direction) == ("", "selection"), str(wrong)
    assert wrong.selections[0].report.divergent and "DIVERGES" in str(wrong), str(wrong)
