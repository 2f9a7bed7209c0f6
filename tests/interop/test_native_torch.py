"""Native PyTorch modules, both ways: ``torch.nn.MultiheadAttention`` and Hugging Face's
``GPT2Attention`` against our ``MultiHeadAttention`` (and on to its Flax twin).

Each parity test runs the native module and ours on the same input and compares the
outputs and the gradients (of ``sum(out * cotangent)``) with respect to the input and to
every native parameter, our gradients mapped to the native layout (``in_proj_weight``'s
gradient is the concatenation of ``W_query``'s, ``W_key``'s and ``W_value``'s; GPT-2's
``Conv1D`` gradients are those, transposed), within the float32 tolerances of
``tolerances.py``.  Round trips are compared bit for bit; every refusal is raised before
anything is built or written.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import numpy as np
import pytest

from tests.support import needs_jax

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import torch_attention as ta  # noqa: E402
from parity_tests.harness import compare  # noqa: E402
from parity_tests.tolerances import GRAD_PARITY, PARITY  # noqa: E402
from torch_attention.interop import from_nn_multihead, load_packed_qkv, to_nn_multihead  # noqa: E402

E, HEADS, BATCH, SEQ = 8, 2, 3, 5
LENGTHS = (5, 3, 4)  # key padding: every query keeps key 0, so no row is fully masked


def _native_mha(*, bias: bool = True, batch_first: bool = True, seed: int = 0, **kwargs: Any) -> nn.MultiheadAttention:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        mha = nn.MultiheadAttention(E, HEADS, bias=bias, batch_first=batch_first, **kwargs)
        if bias:  # torch initialises the biases to zero: make them count
            with torch.no_grad():
                mha.in_proj_bias.normal_(0.0, 0.5)
                mha.out_proj.bias.normal_(0.0, 0.5)
    return mha.eval()


def _inputs(batch: int = BATCH, seq: int = SEQ, width: int = E) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((batch, seq, width)).astype(np.float32)
    cotangent = rng.uniform(0.5, 1.5, (batch, seq, width)).astype(np.float32)
    return x, cotangent


def _key_padding(batch: int = BATCH, seq: int = SEQ, lengths: tuple[int, ...] = LENGTHS) -> torch.Tensor:
    """(B, S) bool, True = ignore (nn.MultiheadAttention's polarity)."""
    return torch.arange(seq)[None, :] >= torch.tensor(lengths[:batch])[:, None]


def _attn_mask(seq: int = SEQ) -> torch.Tensor:
    """(T, S) bool, True = blocked; key 0 is never blocked, so no row is fully masked."""
    blocked = torch.from_numpy(np.random.default_rng(3).random((seq, seq)) < 0.4)
    blocked[:, 0] = False
    return blocked


def _assert_close(label: str, native: Any, ours: Any, *, grad: bool) -> float:
    tol = (GRAD_PARITY if grad else PARITY)["float32"]
    finding = compare(label, native, ours, tol, labels=("native", "ours"))
    assert finding.ok, finding.describe()
    return finding.max_abs


def _run_native_mha(mha: nn.MultiheadAttention, x: np.ndarray, cot: np.ndarray, **masks: Any) -> dict[str, np.ndarray]:
    xt = torch.tensor(x, requires_grad=True)
    xin = xt if mha.batch_first else xt.transpose(0, 1)
    out, _ = mha(xin, xin, xin, need_weights=False, **masks)
    out = out if mha.batch_first else out.transpose(0, 1)
    mha.zero_grad(set_to_none=True)
    (out * torch.from_numpy(cot)).sum().backward()
    result = {"output": out.detach().numpy(), "grad x": xt.grad.numpy()}
    result.update({f"grad {n}": p.grad.numpy() for n, p in mha.named_parameters()})
    return result


def _run_ours_as_native(module: ta.MultiHeadAttention, x: np.ndarray, cot: np.ndarray,
                        mask: torch.Tensor | None) -> dict[str, np.ndarray]:
    """Our module's output and gradients, named and laid out as nn.MultiheadAttention's."""
    xt = torch.tensor(x, requires_grad=True)
    out = module(xt, mask)
    module.zero_grad(set_to_none=True)
    (out * torch.from_numpy(cot)).sum().backward()
    projections = (module.W_query, module.W_key, module.W_value)
    result = {
        "output": out.detach().numpy(),
        "grad x": xt.grad.numpy(),
        "grad in_proj_weight": torch.cat([p.weight.grad for p in projections]).numpy(),
        "grad out_proj.weight": module.out_proj.weight.grad.numpy(),
    }
    if module.qkv_bias:
        result["grad in_proj_bias"] = torch.cat([p.bias.grad for p in projections]).numpy()
        result["grad out_proj.bias"] = module.out_proj.bias.grad.numpy()
    return result


MASKS = ("none", "key_padding", "attn_mask", "both")


def _masks(kind: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The native call's mask keywords and the same masks converted to ours."""
    native: dict[str, torch.Tensor] = {}
    ours = []
    if kind in ("key_padding", "both"):
        native["key_padding_mask"] = _key_padding()
        ours.append(ta.from_key_padding_mask(native["key_padding_mask"]))
    if kind in ("attn_mask", "both"):
        native["attn_mask"] = _attn_mask()
        ours.append(ta.from_blocked_mask(native["attn_mask"]))
    return native, ta.combine_masks(*ours)


# --------------------------------------------------------------------------- nn.MultiheadAttention


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
def test_nn_multihead_outputs_and_gradients(batch_first, bias, mask):
    mha = _native_mha(bias=bias, batch_first=batch_first)
    ours = from_nn_multihead(mha)
    x, cot = _inputs()
    native_masks, our_mask = _masks(mask)
    native = _run_native_mha(mha, x, cot, **native_masks)
    mine = _run_ours_as_native(ours, x, cot, our_mask)
    # every native parameter is compared; ours has one more only without bias (the zero
    # out_proj bias nn.MultiheadAttention does not have)
    assert set(native) == set(mine)
    for name in native:
        _assert_close(name, native[name], mine[name], grad=name.startswith("grad"))


@pytest.mark.parametrize("implementation", ["reference", "fused", "blockwise"])
def test_nn_multihead_on_every_path(implementation):
    mha = _native_mha()
    ours = from_nn_multihead(mha)
    x, cot = _inputs()
    native_masks, our_mask = _masks("both")
    native = _run_native_mha(mha, x, cot, **native_masks)
    xt = torch.tensor(x, requires_grad=True)
    out = ours(xt, our_mask, implementation=implementation)
    (out * torch.from_numpy(cot)).sum().backward()
    _assert_close("output", native["output"], out.detach(), grad=False)
    _assert_close("grad x", native["grad x"], xt.grad, grad=True)


def test_nn_multihead_key_padding_mask_with_batch_equal_to_seq():
    """The defect this converter fixes: a (B, S) key padding mask read as (q_len, kv_len)
    broadcasts silently when B == S, and the output is wrong."""
    mha = _native_mha()
    ours = from_nn_multihead(mha)
    x, cot = _inputs(batch=4, seq=4)
    kpm = _key_padding(batch=4, seq=4, lengths=(4, 1, 2, 3))
    native = _run_native_mha(mha, x, cot, key_padding_mask=kpm)
    with torch.no_grad():
        right = ours(torch.from_numpy(x), ta.from_key_padding_mask(kpm))
        wrong = ours(torch.from_numpy(x), ta.from_blocked_mask(kpm))
    _assert_close("output", native["output"], right.numpy(), grad=False)
    assert np.abs(wrong.numpy() - native["output"]).max() > 0.1


def test_nn_multihead_unbatched_input():
    """(S, E) input; its (S,) key_padding_mask converts as mask[None], then [0]."""
    mha = _native_mha()
    ours = from_nn_multihead(mha)
    x = torch.from_numpy(_inputs()[0][0])  # (S, E)
    kpm = _key_padding()[1]  # (S,), True = ignore
    with torch.no_grad():
        native, _ = mha(x, x, x, need_weights=False)
        _assert_close("output", native, ours(x), grad=False)
        native, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=False)
        _assert_close("output with key padding", native, ours(x, ta.from_key_padding_mask(kpm[None])[0]), grad=False)


def test_nn_multihead_separate_projection_weights():
    """A module with q_proj_weight / k_proj_weight / v_proj_weight (``_qkv_same_embed_dim``
    False) of shape (E, E) is read like in_proj_weight's three blocks."""
    mha = _native_mha(kdim=E + 2, vdim=E + 2)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(5)
        mha.k_proj_weight = nn.Parameter(torch.randn(E, E) * 0.4)
        mha.v_proj_weight = nn.Parameter(torch.randn(E, E) * 0.4)
    mha.kdim = mha.vdim = E
    assert mha.in_proj_weight is None and not mha._qkv_same_embed_dim
    ours = from_nn_multihead(mha)
    assert torch.equal(ours.W_query.weight, mha.q_proj_weight)
    assert torch.equal(ours.W_key.weight, mha.k_proj_weight)
    assert torch.equal(ours.W_value.weight, mha.v_proj_weight)
    x = torch.from_numpy(_inputs()[0])
    with torch.no_grad():
        native, _ = mha(x, x, x, need_weights=False)
        _assert_close("output", native, ours(x), grad=False)


@needs_jax
@pytest.mark.parametrize(
    ("bias", "mask"), [(True, "both"), (False, "key_padding"), (True, "none")],
    ids=["bias-both-masks", "no-bias-key-padding", "bias-no-mask"],
)
def test_nn_multihead_to_flax(bias, mask):
    """The whole port: nn.MultiheadAttention -> ours -> the Flax twin, whose outputs and
    gradients match both ours (assert_parity) and the native module."""
    from parity_tests import assert_parity, to_flax

    mha = _native_mha(bias=bias)
    ours = from_nn_multihead(mha)
    fx = to_flax(ours)
    x, cot = _inputs()
    native_masks, our_mask = _masks(mask)
    report = assert_parity(ours, fx, x, mask=None if our_mask is None else our_mask.numpy(), cotangent=cot)
    native = _run_native_mha(mha, x, cot, **native_masks)
    _assert_close("flax output", native["output"], report.flax_results["output"], grad=False)
    _assert_close("flax grad x", native["grad x"], report.flax_results["grad input[0]"], grad=True)
    flax_in_proj = np.concatenate([report.flax_results[f"grad {n}.weight"] for n in ("W_query", "W_key", "W_value")])
    _assert_close("flax grad in_proj_weight", native["grad in_proj_weight"], flax_in_proj, grad=True)


# --------------------------------------------------------------------------- round trips


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
def test_nn_multihead_round_trip_is_bit_exact(batch_first, bias, dtype):
    mha = _native_mha(bias=bias, batch_first=batch_first, dropout=0.25).to(getattr(torch, dtype)).train()
    before = _state(mha)
    rng_before = torch.get_rng_state()
    ours = from_nn_multihead(mha)
    back = to_nn_multihead(ours, batch_first=batch_first)
    assert torch.equal(rng_before, torch.get_rng_state())  # nothing drawn, nothing initialised
    _assert_bit_exact(before, _state(mha))  # the source is untouched
    _assert_bit_exact(before, _state(back))
    assert ours.config == {**ours.config, "d_in": E, "d_out": E, "num_heads": HEADS, "context_length": None,
                           "causal": False, "qkv_bias": bias, "dropout": 0.25}
    assert ours.W_query.weight.dtype == getattr(torch, dtype) and ours.training and back.training
    assert (back.batch_first, back.dropout, back.num_heads, back.embed_dim) == (batch_first, 0.25, HEADS, E)
    assert (back.in_proj_bias is not None, back.out_proj.bias is not None) == (bias, bias)
    if not bias:
        assert torch.equal(ours.out_proj.bias, torch.zeros(E, dtype=getattr(torch, dtype)))


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_ours_round_trip_is_bit_exact(qkv_bias):
    with torch.random.fork_rng():
        torch.manual_seed(1)
        ours = ta.MultiHeadAttention(E, E, None, 0.1, HEADS, qkv_bias=qkv_bias, causal=False).eval()
    if not qkv_bias:  # nn.MultiheadAttention(bias=False) has no out_proj bias
        with torch.no_grad():
            ours.out_proj.bias.zero_()
    back = from_nn_multihead(to_nn_multihead(ours))
    _assert_bit_exact(_state(ours), _state(back))
    assert back.config == ours.config and not back.training


@pytest.mark.parametrize("implementation", ["reference", "fused", "blockwise", "auto"])
@pytest.mark.parametrize(("kdim", "vdim"), [(6, 5), (E, 3)], ids=["kdim6-vdim5", "vdim3"])
def test_nn_multihead_cross_attention(kdim: int, vdim: int, implementation: str) -> None:
    """kdim / vdim: torch's mha(query, key, value) equals ours(query, context=(key, value)),
    with the key padding, forward and gradients, on every path; and back to torch."""
    mha = _native_mha(kdim=kdim, vdim=vdim)
    ours = from_nn_multihead(mha)
    assert (ours.spec.kdim or E, ours.spec.vdim or E) == (kdim, vdim)
    rng = np.random.default_rng(11)
    q = torch.tensor(rng.standard_normal((BATCH, SEQ, E)).astype(np.float32), requires_grad=True)
    k = torch.tensor(rng.standard_normal((BATCH, SEQ + 3, kdim)).astype(np.float32), requires_grad=True)
    v = torch.tensor(rng.standard_normal((BATCH, SEQ + 3, vdim)).astype(np.float32), requires_grad=True)
    kpm = torch.zeros(BATCH, SEQ + 3, dtype=torch.bool)
    kpm[1, 4:] = True  # example 1: the last keys are padding
    native, _ = mha(q, k, v, key_padding_mask=kpm, need_weights=False)
    mine = ours(q, context=(k, v), mask=ta.from_key_padding_mask(kpm), implementation=implementation)
    _assert_close("cross-attention output", native, mine, grad=False)
    g_native = torch.autograd.grad(native.sum(), (q, k, v))
    g_mine = torch.autograd.grad(mine.sum(), (q, k, v))
    for name, a, b in zip("qkv", g_native, g_mine, strict=True):
        _assert_close(f"grad {name}", a, b, grad=True)
    back = from_nn_multihead(to_nn_multihead(ours))
    _assert_bit_exact(_state(ours), _state(back))


def test_to_nn_multihead_refuses_grouped_heads() -> None:
    ours = _ours(causal=False, num_kv_heads=1)
    with pytest.raises(ValueError, match=re.escape("num_kv_heads=1 (grouped-query heads")):
        to_nn_multihead(ours)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"add_bias_kv": True}, "add_bias_kv=True"),
        ({"add_zero_attn": True}, "add_zero_attn=True"),
    ],
    ids=["add_bias_kv", "add_zero_attn"],
)
def test_from_nn_multihead_refuses(kwargs, pattern):
    mha = _native_mha(**kwargs)
    with pytest.raises(ValueError, match="cannot be expressed as MultiHeadAttention: .*" + re.escape(pattern)):
        from_nn_multihead(mha)


def test_from_nn_multihead_refuses_other_classes():
    with pytest.raises(TypeError, match="takes a torch.nn.MultiheadAttention; got Linear"):
        from_nn_multihead(nn.Linear(4, 4))


def _ours(**kwargs: Any) -> ta.MultiHeadAttention:
    options = {"d_in": E, "d_out": E, "context_length": None, "dropout": 0.0, "num_heads": HEADS,
               "qkv_bias": True, "causal": False, **kwargs}
    return ta.MultiHeadAttention(**options)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"causal": True}, "causal=True (nn.MultiheadAttention takes a causal mask per call"),
        ({"out_proj": False}, "out_proj=False"),
        ({"d_in": 6}, "d_in=6 != d_out=8"),
        ({"scale": 1.0}, "scale=1.0 (nn.MultiheadAttention scales by 1/sqrt(head_dim)"),
        ({"qkv_bias": False}, "a nonzero out_proj bias with qkv_bias=False"),
    ],
    ids=["causal", "no-out-proj", "d_in", "scale", "out-bias"],
)
def test_to_nn_multihead_refuses(kwargs, pattern):
    module = _ours(**kwargs)
    with torch.no_grad():
        if module.out_proj is not None:
            module.out_proj.bias.fill_(0.5)
    with pytest.raises(ValueError, match="cannot express this MultiHeadAttention: .*" + re.escape(pattern)):
        to_nn_multihead(module)


def test_to_nn_multihead_names_every_problem_and_accepts_the_default_scale():
    with pytest.raises(ValueError, match=r"causal=True .*; out_proj=False"):
        to_nn_multihead(_ours(causal=True, out_proj=False))
    mha = to_nn_multihead(_ours(scale=1 / math.sqrt(E // HEADS), context_length=16))
    assert mha.embed_dim == E
    with pytest.raises(TypeError, match="takes torch_attention.MultiHeadAttention; got CausalAttention"):
        to_nn_multihead(ta.CausalAttention(E, E, 4, 0.0))


# --------------------------------------------------------------------------- packed q/k/v


def _packed(d_in: int, d_out: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 * d_out, d_in, generator=g), "b": torch.randn(3 * d_out, generator=g),
            "ow": torch.randn(d_out, d_out, generator=g), "ob": torch.randn(d_out, generator=g)}


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_load_packed_qkv_places_every_block(layout):
    module = _ours(d_in=6, causal=True)
    p = _packed(6, E)
    t = (lambda w: w.T) if layout == "in_out" else (lambda w: w)
    load_packed_qkv(module, t(p["w"]), p["b"], layout=layout, out_weight=t(p["ow"]), out_bias=p["ob"])
    for i, proj in enumerate((module.W_query, module.W_key, module.W_value)):
        assert torch.equal(proj.weight, p["w"][i * E:(i + 1) * E])
        assert torch.equal(proj.bias, p["b"][i * E:(i + 1) * E])
    assert torch.equal(module.out_proj.weight, p["ow"]) and torch.equal(module.out_proj.bias, p["ob"])


@pytest.mark.parametrize(
    ("cls", "config"),
    [("SelfAttention_v1", (6, 4)), ("SelfAttention_v2", (6, 4, True)), ("CausalAttention", (6, 4, 8, 0.0)),
     ("Head", (6, 4, 8))],
)
def test_load_packed_qkv_into_other_variants_round_trips(cls, config):
    from attention_spec.interop.packing import pack_state_dict

    module = getattr(ta, cls)(*config)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(6, 12, generator=g)
    bias = torch.randn(12, generator=g) if module.spec.qkv_bias else None
    load_packed_qkv(module, weight, bias, layout="in_out")
    packed = pack_state_dict(module.spec, module.state_dict(), layout="in_out")
    np.testing.assert_array_equal(packed["qkv_weight"], weight.numpy(), strict=True)
    if bias is not None:
        np.testing.assert_array_equal(packed["qkv_bias"], bias.numpy(), strict=True)


def test_load_packed_qkv_keeps_out_proj_and_casts():
    module = _ours(qkv_bias=False).double()
    out_before = _state(module.out_proj)
    p = _packed(E, E)
    load_packed_qkv(module, p["w"].numpy(), layout="out_in")
    _assert_bit_exact(out_before, _state(module.out_proj))
    assert module.W_key.weight.dtype == torch.float64
    assert torch.equal(module.W_key.weight, p["w"][E:2 * E].double())
    load_packed_qkv(module, p["w"], layout="out_in", out_weight=p["ow"])  # no out_bias: zeros
    assert torch.equal(module.out_proj.bias, torch.zeros(E, dtype=torch.float64))


@pytest.mark.parametrize(
    ("module_kwargs", "arrays", "error", "pattern"),
    [
        ({}, {"layout": "rows"}, ValueError, "layout must be 'in_out'"),
        # an out_in weight (24, 8) given as in_out: its packed width, 8, is not 3 * d_out
        ({}, {"layout": "in_out"}, ValueError, "must have a width divisible by 3"),
        ({"d_in": 6}, {}, ValueError, "is for d_in=8, d_out=8 (layout='out_in'); the module has d_in=6, d_out=8"),
        ({"qkv_bias": False}, {}, ValueError, "a qkv_bias was given but the module has no q/k/v biases"),
        ({}, {"qkv_bias": None}, ValueError, "the module has q/k/v biases but no qkv_bias was given"),
        ({}, {"qkv_bias": (12,)}, ValueError, "the packed q/k/v bias must have shape (24,)"),
        ({"out_proj": False}, {"out_weight": (8, 8), "out_bias": (8,)}, ValueError,
         "out_weight was given but the module has no output projection"),
        ({}, {"out_bias": (8,)}, ValueError, "out_bias was given without out_weight"),
        ({}, {"out_weight": (8, 6)}, ValueError, "out_weight must have shape (8, 8)"),
        ({}, {"dtype": torch.int64}, TypeError, "floating"),
    ],
    ids=["layout", "wrong-layout-shape", "d_in", "bias-unwanted", "bias-missing", "bias-shape",
         "no-out-proj", "out-bias-alone", "out-shape", "integer"],
)
def test_load_packed_qkv_refuses_before_writing(module_kwargs, arrays, error, pattern):
    module = _ours(**module_kwargs)
    before = _state(module)
    arrays = {"qkv_weight": (24, 8), "qkv_bias": (24,), "layout": "out_in", **arrays}
    dtype = arrays.pop("dtype", torch.float32)
    kwargs = {k: v if k == "layout" or v is None else torch.randn(v).to(dtype) for k, v in arrays.items()}
    with pytest.raises(error, match=re.escape(pattern)):
        load_packed_qkv(module, **kwargs)
    _assert_bit_exact(before, _state(module))


def test_load_packed_qkv_refuses_modules_without_own_qkv():
    with pytest.raises(TypeError, match="this library's modules; got Linear"):
        load_packed_qkv(nn.Linear(4, 4), torch.randn(12, 4), layout="out_in")
    wrapper = ta.MultiHeadAttentionWrapper(4, 4, 4, 0.0, 2)
    with pytest.raises(ValueError, match="no query, key and value projections of its own"):
        load_packed_qkv(wrapper, torch.randn(12, 4), layout="out_in")


# --------------------------------------------------------------------------- GPT-2 (Hugging Face)

GPT2_E, GPT2_HEADS = 16, 4
HF_LENGTHS = (6, 4)  # right padding: every query still sees key 0


def _gpt2_attention() -> Any:
    pytest.importorskip("transformers")
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = GPT2Config(n_embd=GPT2_E, n_head=GPT2_HEADS, n_positions=32, n_layer=1, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        attn = GPT2Attention(config, layer_idx=0)
        with torch.no_grad():  # Conv1D draws N(0, 0.02) and zero biases: nearly uniform attention
            for p in attn.parameters():
                p.normal_(0.0, 0.4)
    return attn.eval()


def _gpt2_into_ours(attn: Any) -> ta.MultiHeadAttention:
    ours = ta.MultiHeadAttention(GPT2_E, GPT2_E, None, 0.0, GPT2_HEADS, qkv_bias=True, causal=True)
    return load_packed_qkv(ours, attn.c_attn.weight, attn.c_attn.bias, layout="in_out",
                           out_weight=attn.c_proj.weight, out_bias=attn.c_proj.bias)


def _hf_masks(hf_mask: torch.Tensor | None, seq: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The 4-d additive mask GPT2Model hands its attention layers (eager: causal and
    padding, 0 = attend, the dtype's lowest value = blocked; GPT2Attention itself applies
    no causal mask in this transformers version), and ours from the same 1/0 mask."""
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    ours = None
    if hf_mask is not None:
        allowed = allowed & hf_mask.bool()[:, None, None, :]
        ours = ta.from_hf_attention_mask(hf_mask)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return additive, ours


def test_gpt2_mask_is_the_one_transformers_builds():
    """The hand-built 4-d mask above is what transformers' own mask builder gives the
    eager attention of GPT2Model (where this transformers version has one)."""
    pytest.importorskip("transformers")
    masking_utils = pytest.importorskip("transformers.masking_utils")
    attn = _gpt2_attention()
    hf_mask = (torch.arange(6)[None, :] < torch.tensor(HF_LENGTHS)[:, None]).long()
    # transformers 5.24 renamed past_key_values to cache (the old name warns)
    parameters = inspect.signature(masking_utils.create_causal_mask).parameters
    no_cache = {"cache": None} if "cache" in parameters else {"past_key_values": None}
    try:
        built = masking_utils.create_causal_mask(
            config=attn.config, inputs_embeds=torch.zeros(2, 6, GPT2_E), attention_mask=hf_mask,
            position_ids=torch.arange(6)[None].expand(2, -1), **no_cache,
        )
    except TypeError as error:  # another signature in another version
        pytest.skip(f"create_causal_mask has another signature here: {error}")
    additive, _ = _hf_masks(hf_mask, 6)
    assert torch.equal(built, additive)


@pytest.mark.parametrize("padding", [False, True], ids=["no-mask", "hf-padding-mask"])
def test_gpt2_attention_outputs_and_gradients(padding):
    attn = _gpt2_attention()
    ours = _gpt2_into_ours(attn)
    x, cot = _inputs(batch=2, seq=6, width=GPT2_E)
    hf_mask = (torch.arange(6)[None, :] < torch.tensor(HF_LENGTHS)[:, None]).long() if padding else None
    additive, our_mask = _hf_masks(hf_mask, 6)

    xt = torch.tensor(x, requires_grad=True)
    out, _ = attn(xt, attention_mask=additive)  # returns (attn_output, attn_weights)
    (out * torch.from_numpy(cot)).sum().backward()
    mine = _run_ours_as_native(ours, x, cot, our_mask)

    _assert_close("output", out.detach(), mine["output"], grad=False)
    _assert_close("grad x", xt.grad, mine["grad x"], grad=True)
    # Conv1D holds (in, out): the packed gradients are ours concatenated, transposed
    _assert_close("grad c_attn.weight", attn.c_attn.weight.grad, mine["grad in_proj_weight"].T, grad=True)
    _assert_close("grad c_attn.bias", attn.c_attn.bias.grad, mine["grad in_proj_bias"], grad=True)
    _assert_close("grad c_proj.weight", attn.c_proj.weight.grad, mine["grad out_proj.weight"].T, grad=True)
    _assert_close("grad c_proj.bias", attn.c_proj.bias.grad, mine["grad out_proj.bias"], grad=True)
    if padding:  # the padding mask changes the answer: it was honoured, not ignored
        with torch.no_grad():
            assert (ours(torch.from_numpy(x)) - out).abs().max() > 1e-3


def test_gpt2_weights_round_trip_bit_exact():
    from attention_spec.interop.packing import pack_state_dict

    attn = _gpt2_attention()
    ours = _gpt2_into_ours(attn)
    packed = pack_state_dict(ours.spec, ours.state_dict(), layout="in_out")
    for ours_name, theirs in (("qkv_weight", "c_attn.weight"), ("qkv_bias", "c_attn.bias"),
                              ("out_weight", "c_proj.weight"), ("out_bias", "c_proj.bias")):
        np.testing.assert_array_equal(packed[ours_name], attn.state_dict()[theirs].numpy(), strict=True)


@needs_jax
def test_gpt2_attention_to_flax():
    """GPT-2 attention -> ours -> the Flax twin, with a Hugging Face padding mask."""
    from parity_tests import assert_parity, to_flax

    attn = _gpt2_attention()
    ours = _gpt2_into_ours(attn)
    x, cot = _inputs(batch=2, seq=6, width=GPT2_E)
    hf_mask = (torch.arange(6)[None, :] < torch.tensor(HF_LENGTHS)[:, None]).long()
    additive, our_mask = _hf_masks(hf_mask, 6)
    report = assert_parity(ours, to_flax(ours), x, mask=our_mask.numpy(), cotangent=cot)
    with torch.no_grad():
        out, _ = attn(torch.from_numpy(x), attention_mask=additive)
    _assert_close("flax output", out, report.flax_results["output"], grad=False)
