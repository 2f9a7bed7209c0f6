"""Defects found by probing the harness and the converter (issue 55), one test each:

- a) ``to_flax`` / ``to_torch`` refuse a module whose ``mask_mod`` / ``score_mod`` holds a
  function of the user's own inside a library combinator (``and_masks``, ``or_masks``,
  ``chain``, nested), naming the function and where it sits, as they refuse one given
  directly; before, the function moved into the twin and its first call failed there.
- b) ``infer_param_map`` maps a correctly tied port when the PyTorch model registers its
  output head before the embedding it is tied to (the shared weight is then named
  ``head.weight`` by ``named_parameters()``).
- d) ``python -m parity_tests.convert`` keeps a safetensors file's own ``__metadata__``.

(c, the cached ``auto`` measurement's report, is in ``tests/functional/test_route_jax.py``;
e, Flax's grouped heads, in ``tests/interop/test_native_flax.py``.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both

D, HEADS, T = 8, 2, 4


# --------------------------------------------------------------------------- a) own functions in combinators


def _torch_own(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    import torch

    return torch.ge(q_idx, kv_idx)  # torch's operations: a JAX array fails here


def _torch_own_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    import torch

    return torch.sub(score, 0.1 * (q_idx - kv_idx))


def _jax_own(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    import jax.numpy as jnp

    return jnp.greater_equal(q_idx, kv_idx)


def _torch_cases() -> list[tuple[str, Any, str]]:
    from attention_spec import mods

    return [
        ("mask_mod", mods.and_masks(mods.causal, _torch_own), "mask_mod.parts[1]"),
        ("mask_mod", mods.or_masks(_torch_own, mods.sliding_window(1, 0)), "mask_mod.parts[0]"),
        ("mask_mod", mods.and_masks(mods.causal, mods.or_masks(mods.prefix_lm(2), _torch_own)),
         "mask_mod.parts[1].parts[1]"),
        ("score_mod", mods.chain(mods.softcap(5.0), _torch_own_score), "score_mod.parts[1]"),
    ]


@pytest.mark.parametrize("case", range(4))
def test_to_flax_refuses_an_own_function_inside_a_combinator(case: int) -> None:
    import torch_attention as ta
    from parity_tests import to_flax

    role, mod, where = _torch_cases()[case]
    name = "_torch_own_score" if role == "score_mod" else "_torch_own"
    module = ta.MultiHeadAttention(D, D, None, 0.0, HEADS, causal=False, **{role: mod})
    with pytest.raises(ValueError, match=rf"{role} holds a function of its own at {re.escape(where)} "
                                         rf"\({name}\).*build it from attention_spec.mods"):
        to_flax(module)


def test_to_torch_refuses_an_own_function_inside_a_combinator() -> None:
    from flax import nnx

    import jax_attention as ja
    from attention_spec import mods
    from parity_tests import to_torch

    module = ja.MultiHeadAttention(D, D, None, 0.0, HEADS, causal=False,
                                   mask_mod=mods.and_masks(mods.causal, _jax_own), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mask_mod holds a function of its own at mask_mod.parts\[1\] \(_jax_own\)"):
        to_torch(module)


def test_library_combinators_still_move() -> None:
    import torch

    import torch_attention as ta
    from attention_spec import mods
    from parity_tests import to_flax

    module = ta.MultiHeadAttention(D, D, None, 0.0, HEADS, causal=False,
                                   mask_mod=mods.and_masks(mods.causal, mods.or_masks(mods.prefix_lm(2))))
    twin = to_flax(module)
    x = torch.randn(1, T, D)
    np.testing.assert_allclose(np.asarray(twin(x.numpy())), module(x).detach().numpy(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- b) a tied head registered first


def _tied_pair() -> tuple[Any, Any]:
    import torch
    from flax import nnx
    from torch import nn

    vocab, width = 11, 6

    class HeadFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(width, vocab, bias=False)  # registered before the embedding
            self.embed = nn.Embedding(vocab, width)
            self.head.weight = self.embed.weight  # tied: one tensor, two names

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    class Port(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(vocab, width, rngs=rngs)

        def __call__(self, ids: Any) -> Any:
            return self.embed.attend(self.embed(ids))  # tied as PyTorch ties it

    torch.manual_seed(0)
    return HeadFirst(), Port(nnx.Rngs(0))


def test_infer_param_map_takes_a_tied_head_registered_before_its_embedding() -> None:
    import torch

    from parity_tests import copy_params, infer_param_map

    theirs, port = _tied_pair()
    assert [n for n, _ in theirs.named_parameters()] == ["head.weight"]
    rules = infer_param_map(theirs, port)
    assert [(tuple(r.torch_names), tuple(r.flax_paths)) for r in rules] == [(("head.weight",), (("embed", "embedding"),))]
    copy_params(theirs, port, rules)
    np.testing.assert_array_equal(np.asarray(port.embed.embedding[...]), theirs.embed.weight.detach().numpy())
    ids = torch.tensor([[1, 4, 9]])
    np.testing.assert_allclose(np.asarray(port(ids.numpy())), theirs(ids).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_infer_param_map_still_refuses_an_untied_port_of_a_tied_head() -> None:
    from flax import nnx

    from parity_tests import infer_param_map

    theirs, port = _tied_pair()
    port.head = nnx.Linear(6, 11, use_bias=False, rngs=nnx.Rngs(1))  # a head of its own: not tied
    with pytest.raises(ValueError, match=r"PyTorch ties 'embed.weight' to 'head.weight', but the Flax embed has "
                                         r"parameters of its own"):
        infer_param_map(theirs, port)


# --------------------------------------------------------------------------- d) the converter keeps __metadata__


def _metadata(path: Path) -> dict[str, str]:
    blob = path.read_bytes()
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + size])["__metadata__"]


CONFIG = {"d_in": 6, "d_out": 4, "context_length": 8, "dropout": 0.0, "num_heads": 2}


def _source(tmp_path: Path, metadata: dict[str, str]) -> Path:
    import torch

    import torch_attention as ta
    from attention_spec.interop import files

    torch.manual_seed(0)
    module = ta.MultiHeadAttention(**CONFIG)
    path = tmp_path / "in.safetensors"
    files.write_safetensors(ta.interop.torch_state_dict(module), path, metadata)
    return path


def _convert(*argv: Any) -> int:
    from parity_tests.convert import main

    return main([str(a) for a in argv])


def test_convert_keeps_the_inputs_metadata(tmp_path: Path) -> None:
    mine = {"author": "someone", "license": "apache-2.0", "step": "1200"}
    source = _source(tmp_path, mine)
    out = tmp_path / "out.safetensors"
    assert _convert(source, out, "--to", "flax", "--variant", "MultiHeadAttention", "--config", json.dumps(CONFIG)) == 0
    assert _metadata(out) == {**mine, "format": "flax"}
    back = tmp_path / "back.safetensors"
    assert _convert(out, back, "--to", "torch", "--variant", "MultiHeadAttention", "--config", json.dumps(CONFIG)) == 0
    assert _metadata(back) == {**mine, "format": "pt"}


@pytest.mark.parametrize(("theirs", "want"), [
    ("pt", {"format": "flax", "author": "someone"}),  # the input's layout: now the one written
    ("mlx", {"format": "flax", "converted_from_format": "mlx", "author": "someone"}),  # a value of their own
])
def test_convert_says_what_it_chose_for_a_clashing_format_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              theirs: str, want: dict[str, str]) -> None:
    """The input's ``format`` (Hugging Face writes ``{"format": "pt"}``): the output's
    names the layout written; a value that is no layout's name is kept under
    ``converted_from_format``; the command says which."""
    source = _source(tmp_path, {"format": theirs, "author": "someone"})
    out = tmp_path / "out.safetensors"
    assert _convert(source, out, "--to", "flax", "--variant", "MultiHeadAttention", "--config", json.dumps(CONFIG)) == 0
    assert _metadata(out) == want
    said = capsys.readouterr().out
    assert "__metadata__" in said and f"{{'format': {theirs!r}}}" in said
    assert ("converted_from_format" in said) == ("converted_from_format" in want)


def test_convert_to_a_format_without_metadata_says_it_is_not_kept(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    source = _source(tmp_path, {"author": "someone"})
    assert _convert(source, tmp_path / "out.msgpack", "--to", "flax", "--variant", "MultiHeadAttention",
                    "--config", json.dumps(CONFIG)) == 0
    assert "the input's __metadata__ (1 key) is not kept: a msgpack checkpoint has no place for it" in (
        capsys.readouterr().out)


def test_convert_keeping_metadata_refuses_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A refusal (here a config whose shapes the file does not fit) leaves no OUT."""
    source = _source(tmp_path, {"author": "someone"})
    out = tmp_path / "out.safetensors"
    assert _convert(source, out, "--to", "flax", "--variant", "MultiHeadAttention",
                    "--config", json.dumps({**CONFIG, "d_in": 5})) == 2
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]
    assert capsys.readouterr().err.startswith("convert: error: ")
