"""The whole-model examples (``examples/port_gpt2.py``, ``examples/port_llama.py``): a tiny
random ``transformers`` GPT-2 and Llama ported to Flax NNX through ``from_hf`` agree with
the originals at 512 positions (logits, every parameter's gradient, ten AdamW steps that
move the weights and lower the loss), ``locate_divergence`` finds nothing in a faithful
port and points at the module of a planted bug, and a port that misses PyTorch's
``padding_idx`` is caught by the gradient check at that embedding row."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both
pytest.importorskip("transformers")

SEQ = 512


def _models() -> dict[str, ModuleType]:
    from examples import port_gpt2, port_llama

    return {"gpt2": port_gpt2, "llama": port_llama}


def _inputs(example: ModuleType) -> tuple[np.ndarray, np.ndarray | None]:
    """The example's own proof inputs: ids (2, 512), and Llama's left-padded mask."""
    from examples._proof import left_padding, tokens

    ids = tokens(example.VOCAB, example.BATCH, example.SEQ, seed=0)
    pads = getattr(example, "PADS", None)
    return ids, None if pads is None else left_padding(example.BATCH, example.SEQ, pads)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def case(request: pytest.FixtureRequest) -> tuple[ModuleType, Any]:
    example = _models()[request.param]
    return example, example.make_port()


def test_the_examples_use_our_attention_at_512_positions(case: tuple[ModuleType, Any]) -> None:
    import jax_attention as ja

    example, port = case
    assert example.SEQ == SEQ and port.hf.config.max_position_embeddings >= SEQ
    assert port.hf.config._attn_implementation == "eager"
    layers = port.flax.transformer.h if example.__name__.endswith("gpt2") else port.flax.model.layers
    attentions = [getattr(layer, "attn", getattr(layer, "self_attn", None)) for layer in layers]
    assert attentions and all(isinstance(a, ja.MultiHeadAttention) for a in attentions)


def test_logits_and_every_gradient_agree(case: tuple[ModuleType, Any]) -> None:
    from examples._proof import prove_logits_and_grads

    example, port = case
    ids, mask = _inputs(example)
    report = prove_logits_and_grads(port, ids, mask)
    assert report.ok, report.message()
    grads = {f.name.removeprefix("grad ") for f in report.findings if f.name.startswith("grad ")}
    assert grads == {n for n, _ in port.hf.named_parameters()}  # every parameter, by its HF name
    if mask is not None:
        assert report.rows_left_out == int((mask == 0).sum()) > 0


def test_ten_adamw_steps_agree_and_train(case: tuple[ModuleType, Any]) -> None:
    """~15 s each on 2 cores."""
    from examples._proof import STEPS, prove_training

    example, port = case
    _, mask = _inputs(example)
    zeros = example.exact_zeros(port.hf) if hasattr(example, "exact_zeros") else ()
    report = prove_training(port, example.batches(STEPS), mask, zeros)
    assert report.ok, report.message()
    assert len(report.steps) == STEPS == 10
    assert report.steps[-1].torch_loss < report.steps[0].torch_loss - 0.1  # it learned something
    moved = report.torch_module.state_dict()
    assert any(not np.allclose(moved[n].numpy(), p.detach().numpy()) for n, p in port.hf.named_parameters())


def test_a_faithful_port_shows_no_divergence(case: tuple[ModuleType, Any]) -> None:
    from examples._proof import locate

    example, port = case
    report = locate(port, _inputs(example)[0])
    assert report.ok and report.backward_checked, str(report)
    compared = {pair.torch_name for pair in report.pairs if pair.output.ok}
    prefix = "transformer.h" if example.__name__.endswith("gpt2") else "model.layers"
    attention = "attn" if example.__name__.endswith("gpt2") else "self_attn"
    assert {f"{prefix}.1.{attention}", f"{prefix}.1.mlp", "lm_head"} <= compared


@pytest.mark.parametrize(("name", "module"), [("gpt2", "transformer.h.1.mlp.c_fc"),
                                              ("llama", "model.layers.1.mlp.up_proj")])
def test_a_nudged_weight_is_located_at_its_module(name: str, module: str) -> None:
    """One kernel element of the Flax port moved by 1e-3: the first divergence is that
    module, forward."""
    import jax.numpy as jnp

    from examples._proof import locate

    example = _models()[name]
    port = example.make_port()
    path = [int(p) if p.isdigit() else p for p in module.split(".")]
    layer = port.flax
    for step in path:
        layer = layer[step] if isinstance(step, int) else getattr(layer, step)
    layer.kernel[...] = layer.kernel[...] + jnp.zeros_like(layer.kernel[...]).at[3, 5].set(1e-3)
    report = locate(port, _inputs(example)[0])
    assert report.first is not None, str(report)
    assert (report.first.torch_name, report.first.direction) == (module, "forward"), str(report)
    assert report.first.flax_path == tuple(path)


def test_a_port_without_padding_idx_fails_at_that_embedding_row() -> None:
    """Llama's ``nn.Embedding(padding_idx=pad_token_id)`` gives its padding row no
    gradient; a port whose embedding lacks that agrees forward and fails the gradient
    check there, and only there."""
    from examples import port_llama
    from examples._proof import prove_logits_and_grads

    port = port_llama.make_port()
    port.flax.model.embed_tokens.padding_idx = -1  # no row frozen: plain nnx.Embed's gradient
    ids, mask = _inputs(port_llama)
    report = prove_logits_and_grads(port, ids, mask)
    assert [f.name for f in report.failures] == ["grad model.embed_tokens.weight"], report.message()
    assert report.failures[0].index[0] == port.hf.config.pad_token_id


@pytest.mark.parametrize(("name", "module"), [("gpt2", "transformer.h.1.attn"), ("llama", "model.layers.1.self_attn")])
def test_a_bug_inside_an_attention_layer_shows_first_at_that_layer_s_output(name: str, module: str) -> None:
    """A nudged key kernel inside our attention: the port diverges, and the earliest call
    whose output fails is that attention layer.  ``report.first`` cannot name it: Hugging
    Face's layer is given other arrays than ours (its mask, rotary tables, positions), so
    the pair's inputs are not compared (docs/porting.md says so)."""
    import jax.numpy as jnp

    from examples._proof import locate

    example = _models()[name]
    port = example.make_port()
    layer = port.flax.transformer.h[1].attn if name == "gpt2" else port.flax.model.layers[1].self_attn
    layer.W_key.kernel[...] = layer.W_key.kernel[...] + jnp.zeros_like(layer.W_key.kernel[...]).at[3, 5].set(1e-3)
    report = locate(port, _inputs(example)[0])
    assert not report.ok, str(report)
    failed = [pair for pair in report.pairs if pair.output.ok is False]
    assert min(failed, key=lambda pair: pair.exit_order).torch_name == module, str(report)
