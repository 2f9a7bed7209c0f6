"""The linear-attention layers' weight maps (``GatedDeltaNet``, ``KimiDeltaAttention``):
``to_flax`` / ``to_torch`` through the declared rules (``attention_spec.interop.delta``),
bit-exact both ways, every parameter in exactly one rule, a misfit state refused before
anything is written; transformers' Qwen3.5 / Qwen3-Next / Kimi linear layers ->
``from_hf`` -> ours -> ``to_hf`` -> the layer, bit-exact, ``hf_rules`` giving the same
arrays as ``from_hf``'s own unpacking, ``infer_param_map`` / ``copy_params`` pairing the
layer with our Flax twin, and ``to_hf`` refusing by name (nothing written) what does not
fit.  The layers' numbers against transformers are tests/modules/test_delta_net.py's."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both

FAMILIES = ("qwen3_5", "qwen3_next", "kimi_linear")


@pytest.fixture(scope="module")
def hf() -> dict[str, tuple[Any, Any, Any]]:
    """{family: (transformers' layer (tiny, weights N(0, 0.5)), ours by from_hf, its Flax twin by to_flax)}."""
    from parity_tests import to_flax
    from tests.modules.test_delta_net import _hf_layer
    from torch_attention.interop import from_hf

    made = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' "falling back to its reference PyTorch implementation"
        for family in FAMILIES:
            layer = _hf_layer(family)[1]
            ours = from_hf(layer)
            made[family] = (layer, ours, to_flax(ours))
    return made


def _fresh(family: str) -> Any:
    """Another layer of the family, its weights other draws (N(0, 1), seed 7)."""
    import torch

    from tests.modules.test_delta_net import _hf_layer

    layer = _hf_layer(family)[1]
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return layer


def _same(a: Any, b: Any) -> bool:
    """Bit-equal arrays of one dtype (bfloat16 compared by its bits)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------- twin <-> twin


@pytest.mark.parametrize("case", ["gdn", "kda", "gdn-bf16"])
def test_to_flax_and_to_torch_round_trip_bit_exact(case: str) -> None:
    """GatedDeltaNet (2 key heads of 4, 4 value heads of 8: every weight of its own
    shape) and KimiDeltaAttention (2 heads of 4), float32, and GatedDeltaNet in
    bfloat16: ``to_flax`` gives every parameter once (a Linear weight transposed into
    its kernel, the others as they are), bit-exact, the sizes and chunk size kept;
    ``to_torch`` of it gives back every parameter bit-exact in its dtype."""
    import torch
    from flax import nnx

    from attention_spec.interop.conversion import module_rules
    from parity_tests import to_flax, to_torch
    from torch_attention import GatedDeltaNet, KimiDeltaAttention

    torch.manual_seed(3)
    dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    ours = (KimiDeltaAttention(16, 2, 4, chunk_size=8, dtype=dtype) if case == "kda" else
            GatedDeltaNet(16, 2, 4, 4, 8, conv_kernel_size=3, chunk_size=8, norm_eps=1e-5, dtype=dtype))
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
    twin = to_flax(ours)
    assert (type(twin).__name__, twin.geometry, twin.chunk_size, twin.norm_eps) == (
        type(ours).__name__, ours.geometry, ours.chunk_size, ours.norm_eps)
    rules = module_rules(ours)
    params = dict(ours.named_parameters())
    flax = {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(twin, nnx.Param))}
    assert sorted(n for r in rules for n in r.torch_names) == sorted(params)  # each once
    assert sorted(p for r in rules for p in r.flax_paths) == sorted(flax)
    for name, p in params.items():
        module, _, leaf = name.partition(".")
        want = p.detach().float().numpy()
        got = np.asarray(flax[(module, "kernel") if leaf else (module,)]).astype(np.float32)
        assert str(flax[(module, "kernel") if leaf else (module,)].dtype) == str(p.dtype).removeprefix("torch.")
        assert _same(got, want.T if leaf else want), name
    back = to_torch(twin)
    assert type(back) is type(ours) and back.geometry == ours.geometry and back.chunk_size == ours.chunk_size
    for (name, p), (name2, q) in zip(ours.named_parameters(), back.named_parameters(), strict=True):
        assert name == name2 and p.dtype == q.dtype and torch.equal(p, q), name


def test_a_misfit_state_is_refused_before_anything_is_written(hf: Any) -> None:
    """A state of another geometry (W_query one row short) or lacking a parameter is
    refused naming it, in both loaders, and nothing is written."""
    import torch

    import jax_attention.interop as jax_interop
    import torch_attention.interop as torch_interop
    from parity_tests import to_torch

    _, ours, twin = hf["qwen3_5"]
    target = to_torch(twin)
    before = {n: p.clone() for n, p in target.named_parameters()}
    state = {n: p.detach().clone() for n, p in ours.state_dict().items()}
    state["A_log"] = state["A_log"] + 1.0
    short = {**state, "W_query.weight": state["W_query.weight"][:-1]}
    lacking = {n: v for n, v in state.items() if n != "dt_bias"}
    for bad, named in ((short, "W_query.weight"), (lacking, "dt_bias")):
        with pytest.raises(ValueError, match=named.replace(".", "\\.")):
            torch_interop.load_torch_state_dict(target, bad)
        with pytest.raises(ValueError, match=named.replace(".", "\\.")):
            jax_interop.load_torch_state_dict(twin, bad)
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())
    assert _same(twin.A_log[...], ours.A_log.detach().numpy())


# --------------------------------------------------------------------------- ours <-> transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_rules_and_to_hf_round_trip_bit_exact(family: str, hf: Any) -> None:
    """``hf_rules`` run on the layer's parameters gives exactly the twin's arrays (from
    ``from_hf``'s own unpacking, then ``to_flax``); the layer -> ours -> Flax -> ours
    (``to_torch``) -> ``to_hf`` into a layer of other weights gives every parameter back
    bit-exact; ``infer_param_map`` pairs the layer with the twin, and ``copy_params``
    through it moves the twin's weights into a fresh layer bit-exact; every parameter of
    the layer is in exactly one rule."""
    import torch

    from attention_spec.interop.specs import apply_specs
    from jax_attention.interop import flax_arrays
    from parity_tests import copy_params, to_torch
    from parity_tests.param_map import infer_param_map
    from torch_attention._hf import hf_rules
    from torch_attention.interop import to_hf

    layer, _, twin = hf[family]
    rules = hf_rules(layer)
    assert sorted(n for r in rules for n in r.torch_names) == sorted(n for n, _ in layer.named_parameters())
    via = apply_specs(dict(layer.named_parameters()), rules, "to_flax")
    want = flax_arrays(twin)
    assert set(via) == set(want) and all(_same(via[p], want[p]) for p in want)
    fresh = _fresh(family)
    assert to_hf(to_torch(twin), fresh) is fresh
    for (name, p), (_, q) in zip(layer.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    inferred = infer_param_map(layer, twin)
    assert sorted(p for r in inferred for p in r.flax_paths) == sorted(want)
    other = _fresh(family)
    copy_params(other, twin, inferred, to="torch")
    assert all(torch.equal(p, q) for p, q in zip(layer.parameters(), other.parameters(), strict=True))


def test_hf_children_pair_real_modules_and_recognition(hf: Any) -> None:
    """``hf_children`` names sub-modules the layer has, each paired with ours of the same
    output width; ``recognises_hf_layer`` takes all three layouts."""
    from torch_attention._hf import hf_children, recognises_hf_layer

    for family, (layer, ours, _) in hf.items():
        children = hf_children(layer)
        theirs, mine = dict(layer.named_modules()), dict(ours.named_modules())
        assert children and recognises_hf_layer(layer), family
        for name, (child, layout) in children.items():
            assert layout is None and theirs[name].out_features == mine[child].out_features, (family, name)


def test_locate_divergence_pairs_the_linear_layers_without_a_module_map(hf: Any) -> None:
    """``locate_divergence``'s pairing (``_declared_pairs``) finds our Flax linear-attention
    layer where a model holds transformers' at the same place, and pairs their children
    as ``hf_children`` says (no ``module_map``)."""
    import torch
    from flax import nnx

    from parity_tests.divergence import _declared_pairs
    from torch_attention._hf import hf_children

    for family, (layer, _, twin) in hf.items():
        theirs = torch.nn.Module()
        theirs.add_module("mixer", layer)

        class Ours(nnx.Module):
            def __init__(self, mixer: Any) -> None:
                self.mixer = mixer

        pairs, _ = _declared_pairs(theirs, Ours(twin), {})
        assert pairs == {f"mixer.{n}": f"mixer.{child}" for n, (child, _) in hf_children(layer).items()}, family
        assert pairs, family


def test_to_hf_refuses_by_name_and_writes_nothing(hf: Any) -> None:
    """Ours of other sizes (1 key head; a kernel of 3), the other layer class, a softmax
    attention module, and a layer ours does not compute (a gelu conv) are refused naming
    what differs, and the layer keeps its weights; ``hf_rules``, ``hf_children`` and
    ``recognises_hf_layer`` refuse the gelu layer too."""
    import torch

    from torch_attention import GatedDeltaNet, MultiHeadAttention
    from torch_attention._hf import hf_children, hf_rules, recognises_hf_layer
    from torch_attention.interop import to_hf

    layer, _, _ = hf["qwen3_next"]
    kimi = hf["kimi_linear"][1]
    before = {n: p.clone() for n, p in layer.named_parameters()}
    with pytest.raises(ValueError, match="num_key_heads: ours 1, the layer's 2.*conv_kernel_size: ours 3, the layer's 4"):
        to_hf(GatedDeltaNet(16, 1, 4, 4, 4, conv_kernel_size=3), layer)
    with pytest.raises(ValueError, match="is a GatedDeltaNet, not a KimiDeltaAttention \\(nothing was written\\)"):
        to_hf(kimi, layer)
    with pytest.raises(TypeError, match="to_hf takes torch_attention.GatedDeltaNet .*got MultiHeadAttention"):
        to_hf(MultiHeadAttention(16, 16, 8, 0.0, num_heads=2), layer)
    layer.activation = "gelu"
    try:
        for call in (lambda: to_hf(hf["qwen3_next"][1], layer), lambda: hf_rules(layer), lambda: hf_children(layer)):
            with pytest.raises(ValueError, match="a conv activation 'gelu' \\(ours: silu\\)"):
                call()
        assert not recognises_hf_layer(layer)
    finally:
        layer.activation = "silu"
    assert all(torch.equal(p, before[n]) for n, p in layer.named_parameters())
