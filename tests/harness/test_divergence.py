"""``locate_divergence`` on a small multi-block model written twice (PyTorch and Flax NNX:
embedding -> blocks of [LayerNorm, this library's MultiHeadAttention with rope, LayerNorm,
MLP with a custom activation] -> LayerNorm -> head), weights copied: a faithful port is
clean forward and backward, and each planted bug is located at its innermost module,
forward or backward as the bug is."""

from __future__ import annotations

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
