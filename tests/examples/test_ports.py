"""The whole-model examples (``examples/port_gpt2.py``, ``examples/port_llama.py``): a tiny
random ``transformers`` GPT-2 and Llama ported to Flax NNX through ``from_hf`` agree with
the originals at 512 positions (logits, every parameter's gradient, ten AdamW steps that
move the weights and lower the loss); ``locate_divergence`` finds nothing in a faithful
port, names the module of a nudged weight, and names the attention layer of a bug
between its projections (its output projection the earliest call that fails); a port that misses PyTorch's
``padding_idx`` is caught by the gradient check at that embedding row.  Each whole model
converts to one checkpoint file in one call (``parity_tests.convert.convert_model``), both
layouts, bit for bit, and a conversion that cannot be complete writes and removes nothing."""

from __future__ import annotations

import re
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


NUDGED = [  # (example, Hugging Face module, the Flax module of the port)
    ("gpt2", "transformer.h.1.mlp.c_fc", ("transformer", "h", 1, "mlp", "c_fc")),
    ("gpt2", "transformer.h.0.attn.c_proj", ("transformer", "h", 0, "attn", "out_proj")),
    ("llama", "model.layers.1.mlp.up_proj", ("model", "layers", 1, "mlp", "up_proj")),
    ("llama", "model.layers.1.self_attn.k_proj", ("model", "layers", 1, "self_attn", "W_key")),
]


def _nudge(port: Any, path: tuple[Any, ...], by: float = 1e-3) -> None:
    """One element of the kernel at ``path`` in the Flax port moved by ``by``."""
    import jax.numpy as jnp

    layer = port.flax
    for step in path:
        layer = layer[step] if isinstance(step, int) else getattr(layer, step)
    layer.kernel[...] = layer.kernel[...] + jnp.zeros_like(layer.kernel[...]).at[3, 5].set(by)


@pytest.mark.parametrize(("name", "module", "path"), NUDGED, ids=[m for _, m, _ in NUDGED])
def test_a_nudged_weight_is_located_at_its_module(name: str, module: str, path: tuple[Any, ...]) -> None:
    """The first divergence is that module, forward (the attention projections paired
    by ``locate_divergence`` itself, no ``module_map``)."""
    from examples._proof import locate

    example = _models()[name]
    port = example.make_port()
    _nudge(port, path)
    report = locate(port, _inputs(example)[0])
    assert report.first is not None, str(report)
    assert (report.first.torch_name, report.first.flax_path, report.first.direction) == (module, path, "forward"), \
        str(report)


def _wrong_key_kernel(port: Any) -> str:
    _nudge(port, ("transformer", "h", 1, "attn", "W_key"), by=0.1)
    return "transformer.h.1.attn"


def _wrong_scale(port: Any) -> str:
    import dataclasses

    attention = port.flax.model.layers[1].self_attn
    attention.spec = dataclasses.replace(attention.spec, scale=attention.spec.scale * 1.01)
    return "model.layers.1.self_attn"


@pytest.mark.parametrize(("name", "plant"), [("gpt2", _wrong_key_kernel), ("llama", _wrong_scale)],
                         ids=["gpt2-packed-key-weight", "llama-softmax-scale"])
def test_a_bug_between_the_projections_is_located_at_its_attention_layer(name: str, plant: Any) -> None:
    """A bug in the part of an attention layer that has no module paired on both sides:
    GPT-2's packed ``c_attn`` (q, k and v in one output, which no single module of ours
    computes) and the scores of either.  The attention layers are given different
    arrays (Hugging Face's additive mask and cos/sin, our bool mask and positions), so
    their first, the hidden states, is compared: ``report.first`` is that attention
    layer, and the earliest call whose output fails is its output projection, every
    call before it agreeing."""
    from examples._proof import locate

    example = _models()[name]
    port = example.make_port()
    expected = plant(port)
    report = locate(port, _inputs(example)[0])
    assert not report.ok
    failed = [pair for pair in report.pairs if pair.output.ok is False]
    earliest = min(failed, key=lambda pair: pair.exit_order)
    assert report.first is not None and report.first.torch_name == expected, str(report)
    assert earliest.torch_name == expected + (".c_proj" if name == "gpt2" else ".o_proj"), str(report)
    assert all(pair.output.ok for pair in report.pairs if pair.exit_order < earliest.exit_order), str(report)


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



# --------------------------------------------------------------------------- a whole model to one checkpoint file


def _flax_arrays(model: Any) -> dict[str, np.ndarray]:
    from flax import nnx

    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_a_whole_model_converts_to_one_checkpoint_file_in_one_call(case: tuple[ModuleType, Any], tmp_path: Any) -> None:
    """``convert_model(hf, port, OUT, to=...)``: the map derived from the two models, every
    parameter written bit for bit: ``to="flax"`` the Hugging Face weights in the port's
    layout (its paths, kernels; GPT-2's packed ``c_attn`` split in three), ``to="torch"``
    the port's weights under Hugging Face's names, which ``load_state_dict`` takes (GPT-2's
    tied head once, as PyTorch lists it)."""
    import torch

    from attention_spec.interop import files
    from parity_tests.convert import convert_model

    example, port = case
    written = convert_model(port.hf, port.flax, tmp_path / "flax.safetensors", to="flax")
    layout, arrays = files.read_arrays(tmp_path / "flax.safetensors")
    ours = _flax_arrays(port.flax)
    assert layout == "flax" and arrays.keys() == ours.keys() == written.keys()
    assert all(np.array_equal(arrays[k], ours[k]) and arrays[k].dtype == ours[k].dtype for k in ours)
    convert_model(port.hf, port.flax, tmp_path / "hf.pt", to="torch")
    layout, arrays = files.read_arrays(tmp_path / "hf.pt")
    assert layout == "torch" and arrays.keys() == {n for n, _ in port.hf.named_parameters()}
    fresh = example.hf_model(seed=1)
    missing, unexpected = fresh.load_state_dict({k: torch.from_numpy(a) for k, a in arrays.items()}, strict=False)
    assert not unexpected and set(missing) <= set(fresh.state_dict()) - {n for n, _ in fresh.named_parameters()}
    assert all(torch.equal(p, dict(port.hf.named_parameters())[n]) for n, p in fresh.named_parameters())


def test_convert_model_refuses_before_writing_anything(case: tuple[ModuleType, Any], tmp_path: Any) -> None:
    """A conversion that cannot be complete writes nothing and removes nothing: a port
    with a parameter the original lacks, a map that leaves one out, a directory where a
    file goes, a directory that is not our Orbax checkpoint, a layout the format cannot
    hold.  The file already there is unchanged and no temporary is left."""
    from flax import nnx

    from attention_spec.interop.files import CheckpointError
    from parity_tests.convert import convert_model

    _, port = case
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"theirs")
    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    (folder / "keep.txt").write_text("theirs")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    left_out = port.rules[-1].torch_names[0]
    with pytest.raises(ValueError, match=re.escape(left_out)):
        convert_model(port.hf, port.flax, out, param_map=port.rules[:-1])
    port.flax.extra = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    try:
        with pytest.raises(ValueError, match="Flax parameter 'extra/kernel' is paired with nothing"):
            convert_model(port.hf, port.flax, out, to="torch")
    finally:
        del port.flax.extra
    with pytest.raises(CheckpointError, match="it is a directory, and a safetensors checkpoint is a file"):
        convert_model(port.hf, port.flax, folder)
    with pytest.raises(CheckpointError, match="not an Orbax checkpoint written by twin-attention"):
        convert_model(port.hf, port.flax, folder, format="orbax")
    with pytest.raises(CheckpointError, match="a pt file holds torch layout, not flax"):
        convert_model(port.hf, port.flax, tmp_path / "model.pt", to="flax")
    with pytest.raises(ValueError, match="to must be 'flax' or 'torch'; got 'jax'"):
        convert_model(port.hf, port.flax, out, to="jax")
    assert out.read_bytes() == b"theirs" and (folder / "keep.txt").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
