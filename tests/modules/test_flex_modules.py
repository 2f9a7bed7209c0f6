"""A module built with flex attention's mods (``score_mod=``, ``mask_mod=``), in both twins.

The parity matrix runs two such variants on every path, outputs and gradients, twin
against twin and against the float64 oracle (``mha-flexwindow``: a mask mod standing for
a window; ``mha-flex-alibi-gqa``: ALiBi over a prefix LM, grouped heads).  Here: which
path runs what (a mod standing for a named option is that option, to the bit; any other
mod runs on the flex path under ``"auto"`` and is refused by name elsewhere), the call's
own options and tensors together with the mods, decoding with a cache (the mods see
positions), the conversion of mods between the twins, and the checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from attention_spec import mods
from attention_spec.flex import fold_named
from parity_tests import reference
from parity_tests.harness import to_flax, to_torch
from parity_tests.tolerances import ORACLE
from torch_attention.interop import torch_state_dict

D_IN, HEADS, T = 16, 4, 20
TOL = {"rtol": ORACLE["float32"].rtol, "atol": ORACLE["float32"].atol}
SLOPES = 2.0 ** (-8.0 * np.arange(1, HEADS + 1) / HEADS)


def _torch_pair(context_length=64, **options):
    """(torch module, its Flax twin), eval mode, float32 weights drawn from seed 0."""
    import torch

    import torch_attention

    torch.manual_seed(0)
    pt = torch_attention.MultiHeadAttention(D_IN, D_IN, context_length, 0.0, HEADS, qkv_bias=True, **options).eval()
    return pt, to_flax(pt)


@pytest.fixture(scope="module")
def x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((2, T, D_IN)).astype(np.float32)


def _run(module, x, **call):
    """Output of either twin as NumPy."""
    import torch

    if isinstance(module, torch.nn.Module):
        tensors = {k: torch.as_tensor(v.astype(np.float32) if v.dtype == np.float64 else v)
                   if isinstance(v, np.ndarray) else v for k, v in call.items()}
        return module(torch.as_tensor(x), **tensors).detach().numpy()
    import jax.numpy as jnp

    arrays = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in call.items()}
    return np.asarray(module(jnp.asarray(x), **arrays))


def _flex_calls(monkeypatch) -> list[str]:
    """Counts the flex path's runs in both twins."""
    import jax_attention._flex
    import torch_attention._flex

    seen: list[str] = []
    for name, module in (("torch", torch_attention._flex), ("flax", jax_attention._flex)):
        original = module.run_call

        def counted(*args, _original=original, _name=name, **kwargs):
            seen.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "run_call", counted)
    return seen


def test_mods_that_stand_for_no_option_run_on_the_flex_path_with_the_calls_own_options(x, monkeypatch):
    """ALiBi over a prefix LM with the module's soft cap, and each of a mask, key lengths,
    a bias and segment ids given to the call: the flex path under "auto" in both twins,
    equal to the float64 oracle; the reference math too; the kernels refuse by name."""
    pt, fx = _torch_pair(causal=False, softcap=3.0, score_mod=mods.alibi(SLOPES), mask_mod=mods.prefix_lm(3))
    rng = np.random.default_rng(1)
    seg = np.array([[0] * 7 + [1] * 13, [0] * 12 + [1] * 8])
    calls = [{}, {"mask": rng.random((2, 1, T, T)) < 0.7}, {"kv_lengths": np.array([T, 9])},
             {"bias": rng.standard_normal((2, HEADS, T, T))}, {"segment_ids": seg}]
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(pt).items()}
    x64 = x.astype(np.float64)
    seen = _flex_calls(monkeypatch)
    for call in calls:
        mask = call.get("mask")
        if "kv_lengths" in call:
            mask = np.arange(T)[None, None, None, :] < call["kv_lengths"][:, None, None, None]
        if "segment_ids" in call:
            mask = (seg[:, :, None] == seg[:, None, :])[:, None]
        bias = call.get("bias")
        want, _ = reference.forward("MultiHeadAttention", pt.config, params, x64, mask,
                                    bias=None if bias is None else bias.astype(np.float32))
        for module in (pt, fx):
            np.testing.assert_allclose(_run(module, x, **call), want, **TOL)
            np.testing.assert_allclose(_run(module, x, implementation="reference", **call), want,
                                       **TOL)
    assert seen == ["torch", "flax"] * len(calls)  # "auto" took the flex path, the reference did not
    for module in (pt, fx):
        for path in ("fused", "blockwise"):
            with pytest.raises(ValueError, match=r"mask_mod \(PrefixLM, which stands for no named "
                                                 r"option\); score_mod \(Alibi"):
                _run(module, x, implementation=path)


def test_mods_that_stand_for_named_options_are_those_options_on_every_path(x, monkeypatch):
    """A window written as mask mods and a soft cap as a score mod give the numbers of the
    module built with window= and softcap= on every path, to the bit, and never the flex
    path."""
    pt, fx = _torch_pair(mask_mod=mods.and_masks(mods.causal, mods.sliding_window(3)),
                         score_mod=mods.chain(mods.softcap(2.0)))
    named_pt, named_fx = _torch_pair(window=(3, 0), softcap=2.0)
    seen = _flex_calls(monkeypatch)
    for module, named in ((pt, named_pt), (fx, named_fx)):
        for path in ("auto", "reference", "blockwise"):
            np.testing.assert_array_equal(_run(module, x, implementation=path),
                                          _run(named, x, implementation=path))
    assert seen == []


def test_folding_narrows_the_window_and_keeps_what_is_no_single_option():
    assert fold_named(False, (5, None), None, None, mods.sliding_window(3, 1)) == (False, (3, 1), None, None, None)
    assert fold_named(False, (2, None), None, None, mods.sliding_window(3, 1))[1] == (2, 1)  # each side narrower
    assert fold_named(True, None, None, None, mods.sliding_window(2, 2))[:2] == (True, (2, 2))
    capped = mods.softcap(2.0)
    assert fold_named(False, None, 5.0, capped, None) == (False, None, 5.0, capped, None)  # two caps: no one option
    prefix = mods.prefix_lm(2)
    assert fold_named(True, None, None, None, prefix)[4] is prefix


def test_what_the_flex_path_cannot_honour_goes_to_the_reference_math(x, monkeypatch):
    """Returned weights and dropout: "auto" passes the flex path by for the reference math
    (which applies the mods); equal to the oracle's weights."""
    pt, fx = _torch_pair(causal=False, score_mod=mods.alibi(SLOPES))
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(pt).items()}
    _, want = reference.forward("MultiHeadAttention", pt.config, params, x.astype(np.float64))
    seen = _flex_calls(monkeypatch)
    import jax.numpy as jnp
    import torch

    _, w_pt = pt(torch.as_tensor(x), return_weights=True)
    _, w_fx = fx(jnp.asarray(x), return_weights=True)
    np.testing.assert_allclose(w_pt.detach().numpy(), want, **TOL)
    np.testing.assert_allclose(np.asarray(w_fx), want, **TOL)
    assert seen == []


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_decoding_with_a_cache_sees_positions(framework, x):
    """A prompt of 12 and 8 one-token steps into a cache equal the whole sequence at once:
    the mods see key positions (a causal ALiBi decodes as it trains)."""
    pt, fx = _torch_pair(score_mod=mods.alibi(SLOPES), mask_mod=mods.prefix_lm(4))
    module = pt if framework == "torch" else fx
    whole = _run(module, x, implementation="reference")
    if framework == "torch":
        import torch

        cache = module.init_cache(2, 32)
        outs = []
        for start, stop in [(0, 12)] + [(i, i + 1) for i in range(12, T)]:
            out, cache = module(torch.as_tensor(x[:, start:stop]), cache=cache)
            outs.append(out.detach().numpy())
    else:
        import jax.numpy as jnp

        cache = module.init_cache(2, 32)
        outs = []
        for start, stop in [(0, 12)] + [(i, i + 1) for i in range(12, T)]:
            out, cache = module(jnp.asarray(x[:, start:stop]), cache=cache)
            outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole, **TOL)


def test_a_jitted_flax_module_with_mods_equals_the_torch_one(x):
    import jax.numpy as jnp
    from flax import nnx

    pt, fx = _torch_pair(causal=False, score_mod=mods.alibi(SLOPES), mask_mod=mods.prefix_lm(3))
    mask = np.random.default_rng(2).random((2, 1, T, T)) < 0.8
    got = nnx.jit(lambda m, x, mask: m(x, mask))(fx, jnp.asarray(x), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), _run(pt, x, mask=mask), **TOL)


def test_mods_move_between_the_twins_as_numpy_and_a_function_of_ones_own_does_not():
    import torch

    learned = torch.tensor(SLOPES, requires_grad=True)
    pt, fx = _torch_pair(causal=False, score_mod=mods.alibi(learned))
    assert isinstance(fx.config["score_mod"].slopes, np.ndarray)
    np.testing.assert_array_equal(fx.config["score_mod"].slopes, SLOPES)
    assert isinstance(to_torch(fx).config["score_mod"].slopes, np.ndarray)

    def own(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx - kv_idx)

    import torch_attention

    mine = torch_attention.MultiHeadAttention(D_IN, D_IN, 64, 0.0, HEADS, score_mod=own)
    with pytest.raises(ValueError, match="score_mod is a function of its own .*build it from attention_spec.mods"):
        to_flax(mine)


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_a_mod_that_is_not_callable_is_refused_by_name(framework):
    if framework == "torch":
        import torch_attention as lib

        extra = {}
    else:
        from flax import nnx

        import jax_attention as lib

        extra = {"rngs": nnx.Rngs(0)}
    for role in ("score_mod", "mask_mod"):
        with pytest.raises(TypeError, match=rf"^{role} must be callable or None; got float$"):
            lib.MultiHeadAttention(D_IN, D_IN, 64, 0.0, HEADS, **{role: math.pi}, **extra)


def test_a_jitted_call_with_traced_lengths_still_skips_the_causal_blocks():
    """Under jit a call's lengths are traced, so its mask mod's block mask cannot be known;
    the blocks are those its untraced part (the causal band) leaves, each partial: at
    S=512 in blocks of 128, 10 of the 16, and the numbers those of the eager call."""
    import jax
    import jax.numpy as jnp

    import jax_attention._flex as jax_flex
    from attention_spec.flex import blocks_computed, plan_blocks
    from attention_spec.mods import CallMask

    seen = []

    @jax.jit
    def outline(lengths):
        bm = jax_flex._call_block_mask(CallMask(0, None, 0, lengths), 2, 4, 512, 512)
        seen.append(bm)
        return bm.kv_num_blocks

    outline(jnp.asarray([512, 300]))
    bm = seen[0]
    assert not isinstance(bm.kv_num_blocks, jax.core.Tracer) and bm.full_kv_num_blocks is None
    plan = plan_blocks(*jax_flex._host(bm.tables()), bm.BLOCK_SIZE, (512, 512))
    assert blocks_computed(plan, bm.BLOCK_SIZE) == 10

    from flax import nnx

    pt, fx = _torch_pair(None, score_mod=mods.alibi(SLOPES))  # causal: the band is the untraced part
    x = np.random.default_rng(3).standard_normal((2, 300, D_IN)).astype(np.float32)
    lengths = np.array([300, 170])
    got = nnx.jit(lambda m, x, n: m(x, kv_lengths=n))(fx, jnp.asarray(x), jnp.asarray(lengths))
    np.testing.assert_allclose(np.asarray(got), _run(pt, x, kv_lengths=lengths), **TOL)
