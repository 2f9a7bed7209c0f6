"""A module's configuration as JSON and back (``attention_spec.config_json``), rope included.

Issue 55, item 7: ``json.dumps(from_hf(layer).config)`` failed on the ``RopeConfig`` (and
would on the window's tuple), so a ported layer's configuration could not be written down
for ``python -m parity_tests.convert --config``.  Here: module -> JSON -> module gives the
same config and the same outputs, bit for bit, in both twins; the CLI takes the text of a
layer with rope (its own float32 frequencies) and writes the arrays a module rebuilt from
that text loads; a rope of each scaling survives the trip; what has no JSON form is refused
by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attention_spec.config_json import config_from_json, config_to_json
from attention_spec.rope import RopeConfig, rope_from_mapping, rope_to_mapping
from tests.support import needs_both

HIDDEN, HEADS, KV_HEADS = 32, 4, 2

ROPES = {
    "default": RopeConfig(),
    "partial": RopeConfig(theta=20000.0, partial_rotary_factor=0.5),
    "interleaved-rotary_dim": RopeConfig(rotary_dim=6, layout="interleaved"),
    "llama3": RopeConfig(theta=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=256),
    "yarn-untruncated": RopeConfig(scaling="yarn", factor=4.0, original_max_position_embeddings=256, mscale=1.0,
                                   mscale_all_dim=0.5, yarn_truncate=False),
    "longrope": RopeConfig(scaling="longrope", short_factor=(1.0, 1.5, 2.0), long_factor=(2.0, 3.0, 4.0),
                           original_max_position_embeddings=256, factor=8.0),
    "inv_freq": RopeConfig(inv_freq=(1.0, 0.10000000149011612, 0.009999999776482582)),
}


@pytest.mark.parametrize("name", list(ROPES))
def test_a_rope_config_survives_json(name: str) -> None:
    rope = ROPES[name]
    fields = rope_to_mapping(rope)
    assert rope_from_mapping(json.loads(json.dumps(fields))) == rope
    assert "yarn_truncate" not in fields or fields["yarn_truncate"] is False  # only what differs from the defaults


def _layer(kind: str) -> Any:
    """A tiny float32 Hugging Face attention layer with rope: Llama 3's scaling, or Qwen3's
    qk-norm with a window (a tuple in our config)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    heads: dict[str, Any] = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
                             "head_dim": 16}
    if kind == "llama3":
        from transformers.models.llama.modeling_llama import LlamaAttention

        config = tf.LlamaConfig(**heads, max_position_embeddings=4096, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
        return LlamaAttention(config, layer_idx=0).eval()
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    config = tf.Qwen3Config(**heads, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                            num_hidden_layers=1, layer_types=["sliding_attention"])
    return Qwen3Attention(config, layer_idx=0).eval()


@needs_both
@pytest.mark.parametrize("kind", ["llama3", "qwen3-window"])
def test_module_to_json_to_module_both_twins(kind: str) -> None:
    """from_hf(layer) -> config_to_json -> config_from_json -> a new module of each twin:
    the same config (rope with the layer's own frequencies, the window) and, with the
    weights copied, the same outputs bit for bit at positions 400.. ."""
    import torch
    from flax import nnx

    import jax_attention
    import torch_attention
    from parity_tests import to_flax
    from torch_attention.interop import from_hf

    ours = from_hf(_layer(kind))
    assert isinstance(ours.config["window"], tuple) == (kind == "qwen3-window")
    with pytest.raises(TypeError, match="RopeConfig is not JSON serializable"):
        json.dumps(ours.config)  # what the issue found
    text = config_to_json(ours.config)
    assert json.loads(text)["rope"]["inv_freq"] == list(ours.config["rope"].inv_freq)
    config = config_from_json(text)
    assert config == ours.config
    assert config_to_json(ours.spec) == text

    again = torch_attention.MultiHeadAttention(**config).eval()
    assert again.config == ours.config
    again.load_state_dict(ours.state_dict())
    x = torch.randn(2, 6, HIDDEN)
    positions = torch.arange(400, 406)[None]
    with torch.no_grad():
        assert torch.equal(again(x, positions=positions), ours(x, positions=positions))

    flax_ours = to_flax(ours)
    flax_text = config_to_json(flax_ours.config)
    assert flax_text == text
    flax_again = jax_attention.MultiHeadAttention(**config_from_json(flax_text), rngs=nnx.Rngs(1))
    assert flax_again.config == flax_ours.config
    nnx.update(flax_again, nnx.state(flax_ours, nnx.Param))
    xs, pos = x.numpy(), positions.numpy()
    np.testing.assert_array_equal(np.asarray(flax_again(xs, positions=pos)), np.asarray(flax_ours(xs, positions=pos)))


@needs_both
def test_the_cli_takes_the_json_of_a_layer_with_rope(tmp_path: Path) -> None:
    """``python -m parity_tests.convert --config`` with ``config_to_json(from_hf(layer).config)``:
    the checkpoint converts to the Flax layout, and a Flax module rebuilt from the same text
    loads it and gives the PyTorch module's numbers."""
    import torch
    from flax import nnx

    import jax_attention
    import torch_attention
    from parity_tests.convert import main
    from parity_tests.tolerances import PARITY
    from torch_attention.interop import from_hf

    ours = from_hf(_layer("llama3"))
    text = config_to_json(ours.config)
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.msgpack"
    torch_attention.interop.save(ours, src)
    assert main([str(src), str(dst), "--to", "flax", "--variant", "MultiHeadAttention", "--config", text]) == 0
    flax_m = jax_attention.interop.load(
        jax_attention.MultiHeadAttention(**config_from_json(text), rngs=nnx.Rngs(1)), dst)
    x = torch.randn(2, 6, HIDDEN)
    positions = torch.arange(400, 406)[None]
    with torch.no_grad():
        want = ours(x, positions=positions).numpy()
    tol = PARITY["float32"]
    np.testing.assert_allclose(np.asarray(flax_m(x.numpy(), positions=positions.numpy())), want,
                               rtol=tol.rtol, atol=tol.atol)


def test_what_json_cannot_hold_is_refused_by_name() -> None:
    from attention_spec.mods import causal

    with pytest.raises(ValueError, match="config_to_json: score_mod is a function"):
        config_to_json({"d_in": 8, "score_mod": causal})
    with pytest.raises(ValueError, match=r"config_to_json: scale=inf has no JSON form"):
        config_to_json({"scale": float("inf")})
    with pytest.raises(TypeError, match="config_to_json: dtype has no JSON form"):
        config_to_json({"dtype": object()})
    with pytest.raises(ValueError, match="a JSON object of constructor keywords; got list"):
        config_from_json("[1, 2]")
    with pytest.raises(ValueError, match="rope has no field 'base'"):
        config_from_json('{"rope": {"base": 10000.0}}')
