"""The linear-attention layers (``GatedDeltaNet``: Qwen3.5's and Qwen3-Next's gated delta
rule layers; ``KimiDeltaAttention``: Kimi Linear's KDA) in both twins: the causal conv by
hand; against transformers' own layers built tiny (their weights ported by ``from_hf``),
a left-padded batch, outputs and the gradients of the input and of every parameter; twin
against twin with the same weights; a prompt then one-token cached steps equal to the
whole sequence (JAX: one jitted step compiled once) and to transformers' cached decode;
bad input refused with one text in both twins, before any work."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import DELTA_TWINS
from tests.support import needs_both

pytestmark = needs_both

B, T, PROMPT, D = 2, 9, 6, 16
FAMILIES = ("qwen3_5", "qwen3_next", "kimi_linear")


def _hf_layer(family: str) -> tuple[Any, Any]:
    """transformers' layer, tiny (hidden 16; GDN 2 key heads of 4, 4 value heads of 4;
    KDA 2 heads of 4; conv kernel 4), weights drawn N(0, 0.5) (seeded), float32, eval."""
    import torch

    common = {"hidden_size": D, "linear_conv_kernel_dim": 4, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "layer_types": ["linear_attention"]}
    gdn = {"linear_num_key_heads": 2, "linear_key_head_dim": 4, "linear_num_value_heads": 4,
           "linear_value_head_dim": 4, "head_dim": 8}
    if family == "qwen3_5":
        from transformers.models.qwen3_5 import configuration_qwen3_5 as c
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        config, cls = c.Qwen3_5TextConfig(**common, **gdn), m.Qwen3_5GatedDeltaNet
    elif family == "qwen3_next":
        from transformers.models.qwen3_next import configuration_qwen3_next as c
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        config, cls = c.Qwen3NextConfig(**common, **gdn), m.Qwen3NextGatedDeltaNet
    else:
        from transformers.models.kimi_linear import configuration_kimi_linear as c
        from transformers.models.kimi_linear import modeling_kimi_linear as m

        config, cls = c.KimiLinearConfig(**common, linear_num_heads=2, linear_head_dim=4), m.KimiLinearDeltaAttention
    torch.manual_seed(0)
    layer = cls(config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return config, layer


def _draws() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (B, T, D), its left padding (example 1's first 3 tokens), a cotangent."""
    rng = np.random.default_rng(1)
    mask = np.ones((B, T), bool)
    mask[1, :3] = False
    return rng.standard_normal((B, T, D)).astype(np.float32), mask, rng.standard_normal((B, T, D)).astype(np.float32)


@functools.cache
def _jax_grad() -> Any:
    """(d sum(out * cot) over the module's parameters and x, out), jitted, shared."""
    import jax.numpy as jnp
    from flax import nnx

    def loss(module: Any, x: Any, mask: Any, cot: Any) -> Any:
        out = module(x, mask)
        return jnp.sum(out * cot), out

    return nnx.jit(nnx.grad(loss, argnums=(0, 1), has_aux=True))


@functools.cache
def _jax_step() -> Any:
    """A cached call, jitted: one compile per shape of x (the prompt's, then every step's)."""
    from flax import nnx

    traces: list[int] = []

    def step(module: Any, x: Any, mask: Any, cache: Any) -> Any:
        traces.append(x.shape[1])
        return module(x, mask, cache=cache)

    jitted = nnx.jit(step)
    jitted.traces = traces  # type: ignore[attr-defined]
    return jitted


def _error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.fixture(scope="module")
def layers() -> dict[str, tuple[Any, Any, Any, Any]]:
    """{family: (config, transformers' layer, ours (PyTorch) by from_hf, the Flax twin)}."""
    from parity_tests import to_flax
    from torch_attention.interop import from_hf

    made = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' "falling back to its reference PyTorch implementation"
        for family in FAMILIES:
            config, layer = _hf_layer(family)
            ours = from_hf(layer)
            ours.chunk_size = 4  # chunks of 4: a length of 9 spans three, the last ragged
            made[family] = (config, layer, ours, to_flax(ours))  # the declared map: tests/interop/test_delta_interop.py
    return made


# --------------------------------------------------------------------------- by hand


def test_the_causal_conv_by_hand() -> None:
    """One channel, weights (1, 2, 3) (K = 3), x = (1, 10, 100, 1000): out[t] = x[t-2] +
    2 x[t-1] + 3 x[t] = 3, 32, 321, 3210 from zeros; after inputs (5, 7) the first output
    is 5 + 14 + 3 = 22; the state kept is the last two inputs, (100, 1000)."""
    import jax.numpy as jnp
    import torch

    from jax_attention.delta_net import causal_conv as jax_conv
    from torch_attention.delta_net import causal_conv as torch_conv

    x = np.array([[[1.0], [10.0], [100.0], [1000.0]]], np.float32)
    w = np.array([[1.0, 2.0, 3.0]], np.float32)
    for past, first in ((np.zeros((1, 1, 2), np.float32), 3.0), (np.array([[[5.0, 7.0]]], np.float32), 22.0)):
        want = np.array([first, 32.0 + (7.0 if first == 22.0 else 0.0), 321.0, 3210.0])
        for conv, wrap in ((jax_conv, jnp.asarray), (torch_conv, torch.tensor)):
            out, state = conv(wrap(x), wrap(w), wrap(past))
            np.testing.assert_array_equal(np.asarray(out)[0, :, 0], want)
            np.testing.assert_array_equal(np.asarray(state)[0, 0], [100.0, 1000.0])


# --------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_against_transformers_forward_and_every_gradient(family: str, layers: Any) -> None:
    """A left-padded batch: transformers' layer, ours and the Flax twin, float32: the
    output, and the gradients of sum(out * cot) for x and every parameter (theirs mapped
    onto ours by ``from_hf``'s own unpacking, ``_hf_delta.hf_state``), within DELTA_TWINS
    of theirs, and twin within it of twin.  The Flax twin's gradients for the GDN layers
    (one compile serves both); KDA's Flax twin forward only, by the cached test's jitted
    call (its rule's JAX gradients, per-channel decay included, are checked against
    transformers' KDA function in tests/functional/test_delta_rule.py), to keep the
    file's time: a gradient program is the costliest compile here."""
    import jax.numpy as jnp
    import torch

    from torch_attention import _hf_delta

    _, layer, ours, twin = layers[family]
    x, mask, cot = _draws()
    results = {}
    for name, module in (("theirs", layer), ("ours", ours)):
        xt = torch.tensor(x, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = (module(xt, attention_mask=torch.tensor(mask).long()) if name == "theirs"
                   else module(xt, torch.tensor(mask)))
        params = dict(module.named_parameters())
        grads = torch.autograd.grad((out * torch.tensor(cot)).sum(), [xt, *params.values()])
        named = {n: gr for n, gr in zip(params, grads[1:], strict=True)}
        if name == "theirs":
            named = _hf_delta.hf_state(layer, named)
        results[name] = (out.detach().numpy(), grads[0].numpy(), {n: gr.numpy() for n, gr in named.items()})
    jax_grads = family != "kimi_linear"
    if jax_grads:
        (jgrad_module, jgrad_x), jout = _jax_grad()(twin, jnp.asarray(x), jnp.asarray(mask), jnp.asarray(cot))
    else:
        jout = _jax_step()(twin, jnp.asarray(x), jnp.asarray(mask), twin.init_cache(B))[0]
    errors = {"out": _error(results["ours"][0], results["theirs"][0]), "twins": _error(jout, results["ours"][0]),
              "dx": _error(results["ours"][1], results["theirs"][1])}
    if jax_grads:
        errors["jax dx"] = _error(jgrad_x, results["theirs"][1])
    for n, want in results["theirs"][2].items():
        errors[n] = _error(results["ours"][2][n], want)
        module, _, leaf = n.partition(".")
        if jax_grads:
            jg = getattr(jgrad_module, module)
            errors["jax " + n] = _error(np.asarray(jg["kernel"][...]).T if leaf else np.asarray(jg[...]), want)
    assert set(results["theirs"][2]) == set(results["ours"][2])
    assert max(errors.values()) <= DELTA_TWINS, {k: e for k, e in errors.items() if e > DELTA_TWINS}


# --------------------------------------------------------------------------- caches


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_cached_decoding_equals_the_whole_sequence_and_transformers(family: str, layers: Any) -> None:
    """A left-padded prompt of 6 (chunked form) then 3 one-token steps (recurrent form):
    in both twins equal to the whole sequence and to transformers' cached decode (its
    DynamicCache), the cache given to a call unchanged; the JAX step compiles once for
    the prompt and once for every step."""
    import jax.numpy as jnp
    import torch
    from transformers import DynamicCache

    config, layer, ours, twin = layers[family]
    x, mask, _ = _draws()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = ours(torch.tensor(x), torch.tensor(mask)).numpy()
        theirs_cache = DynamicCache(config=config)
        theirs = [layer(torch.tensor(x[:, :PROMPT]), cache=theirs_cache,
                        attention_mask=torch.tensor(mask[:, :PROMPT]).long())]
        theirs += [layer(torch.tensor(x[:, t:t + 1]), cache=theirs_cache) for t in range(PROMPT, T)]
        cache = ours.init_cache(B)
        out, cache = ours(torch.tensor(x[:, :PROMPT]), torch.tensor(mask[:, :PROMPT]), cache=cache)
        steps = [out]
        for t in range(PROMPT, T):
            kept = cache.state.clone()
            out, new = ours(torch.tensor(x[:, t:t + 1]), cache=cache)
            assert torch.equal(cache.state, kept)
            steps.append(out)
            cache = new
    step = _jax_step()
    before = len(step.traces)
    jcache = twin.init_cache(B)
    out, jcache = step(twin, jnp.asarray(x[:, :PROMPT]), jnp.asarray(mask[:, :PROMPT]), jcache)
    jsteps = [out]
    ones = jnp.ones((B, 1), bool)
    for t in range(PROMPT, T):
        out, jcache = step(twin, jnp.asarray(x[:, t:t + 1]), ones, jcache)
        jsteps.append(out)
    theirs_all = torch.cat(theirs, 1).numpy()
    errors = {"torch": _error(torch.cat(steps, 1).numpy(), whole), "jax": _error(np.concatenate(jsteps, 1), whole),
              "transformers": _error(theirs_all, whole),
              "state": _error(cache.state.numpy(), theirs_cache.layers[0].recurrent_states[0].numpy()),
              "conv": _error(cache.conv.numpy(), theirs_cache.layers[0].conv_states[0][..., 1:].numpy())}
    assert max(errors.values()) <= DELTA_TWINS, errors
    assert len(step.traces) - before <= 2  # the prompt, then one compile for every step (none if seen before)


# --------------------------------------------------------------------------- errors


def _bad_calls(twin: str, module: Any, make: Any) -> list[tuple[type, str]]:
    cache = module.init_cache(B)
    other = module.init_cache(B + 1)
    calls = [lambda: module(make((B, T, D + 1))), lambda: module(make((T, D))),
             lambda: module(make((B, T, D)), make((B, T - 1), "bool")),
             lambda: module(make((B, T, D)), make((B, T), "float32")),
             lambda: module(make((B, 1, D)), cache=other), lambda: module(make((B, 1, D)), cache=(cache[0],)),
             lambda: module(make((B, T, D), "float64" if twin == "torch" else "float16")),
             lambda: type(module)(D, 2, 4, 3, 4, rngs=None) if twin == "jax" else type(module)(D, 2, 4, 3, 4)]
    texts = []
    for call in calls:
        with pytest.raises((ValueError, TypeError)) as raised:
            call()
        texts.append((raised.type, str(raised.value)))
    assert cache.state.shape == (B, 4, 4, 4)
    return texts


def test_bad_input_is_refused_with_one_text_in_both_twins(layers: Any) -> None:
    """Wrong widths, a mask of another shape or dtype, a cache of another batch or not a
    DeltaCache, x in another dtype, value heads not a multiple of key heads: the same
    error and text in both twins (x's dtype: each twin's own, the text's form the same)."""
    import jax.numpy as jnp
    import torch

    _, _, ours, twin = layers["qwen3_5"]
    jax_texts = _bad_calls("jax", twin, lambda s, d="float32": jnp.zeros(s, d))
    torch_texts = _bad_calls("torch", ours, lambda s, d="float32": torch.zeros(s, dtype=getattr(torch, d)))
    dtype_case = 6
    for i, (j, t) in enumerate(zip(jax_texts, torch_texts, strict=True)):
        if i == dtype_case:
            assert j[0] is t[0] is TypeError and "takes x in its compute dtype float32" in j[1] and t[1].startswith(
                j[1].split(";")[0])
        else:
            assert j == t, (i, j, t)
    assert "cache must be a DeltaCache from its init_cache(batch_size=2)" in jax_texts[4][1]
    assert "num_value_heads must be a multiple of num_key_heads" in jax_texts[7][1]


def test_from_hf_refuses_what_ours_does_not_compute_by_name(layers: Any) -> None:
    """A conv activation other than silu, or a bias on the conv, is refused naming it,
    before any weight is read; the layers it ports are recognised (``recognises_hf_layer``:
    ``hf_rules`` / ``hf_children`` map them, tests/interop/test_delta_interop.py), and
    ``hf_rules`` refuses the gelu one naming it."""
    import torch

    from torch_attention._hf import hf_rules, recognises_hf_layer
    from torch_attention.interop import from_hf

    _, layer, _, _ = layers["qwen3_5"]
    layer.activation = "gelu"
    try:
        with pytest.raises(ValueError, match="a linear-attention layer .*: a conv activation 'gelu' \\(ours: silu\\)"):
            from_hf(layer)
        with pytest.raises(ValueError, match="a conv activation 'gelu'"):
            hf_rules(layer)
        assert not recognises_hf_layer(layer)
    finally:
        layer.activation = "silu"
    layer.conv1d.bias = torch.nn.Parameter(torch.zeros(layer.conv1d.out_channels))
    try:
        with pytest.raises(ValueError, match="a bias on the causal conv"):
            from_hf(layer)
    finally:
        layer.conv1d.bias = None
    for family in FAMILIES:
        assert recognises_hf_layer(layers[family][1])
