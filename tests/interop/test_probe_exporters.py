"""The native importers and exporters decide by allow-lists (issue 40, items 2, 7, 8).

``to_nn_multihead`` (PyTorch) and ``to_nnx_multihead`` / ``to_linen_multihead`` (Flax)
export only what the native module reproduces: every other option of our module that is
not at its default is refused by name, with one text in both twins, before anything is
built (item 2: ``softcap=`` and ``window=`` went out silently and the native module
computed something else).  The list of our options comes from the module's ``spec``, so
an option added later is refused until an exporter declares it; the same holds for the
native module's options on the way in.

``from_nnx_multihead`` / ``from_linen_multihead`` import ``normalize_qk=True`` (a
bias-free LayerNorm of each head's queries and keys: our ``qk_norm="layer"``) and
``out_features != qkv_features`` (our ``head_dim=``): the import computes what the native
module computes (item 7), and ours -> nnx -> ours is bit-exact for ``head_dim`` other than
``d_out // num_heads`` (item 8).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from parity_tests.harness import full_precision
from tests.support import needs_jax, needs_torch

# The texts both twins give for an option their native module cannot express.
SOFTCAP = "softcap=0.5 ({target} cannot express it; only softcap=None converts)"
WINDOW = "window=(1, 0) ({target} cannot express it; only window=None converts)"

D, HEADS, B, T = 8, 2, 2, 5
OURS = {"d_in": D, "d_out": D, "context_length": None, "dropout": 0.0, "num_heads": HEADS, "qkv_bias": True,
        "causal": False}
# float32, full-precision matmuls: the native LayerNorm's one-pass variance against our
# two-pass one, the matmuls in another order.  Measured over 20 seeds of these tests'
# modules: |ours - native| <= 4.1e-7 * (1 + |native|) (Linen, normalize_qk), 1.2e-7 (torch).
RTOL = ATOL = 1e-6


def _x(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _future_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """An option that the registry declares after the exporters were written: in every
    spec's options (``future=1``) and the variant's defaults (``future=0``)."""
    from attention_spec.registry import AttentionConfig, Variant

    options, defaults = AttentionConfig.options, Variant.defaults
    monkeypatch.setattr(AttentionConfig, "options", lambda self: {**options(self), "future": 1})
    monkeypatch.setattr(Variant, "defaults", property(lambda self: {**defaults.fget(self), "future": 0}))


# --------------------------------------------------------------------------- PyTorch


@needs_torch
@pytest.mark.parametrize(("option", "text"), [({"softcap": 0.5}, SOFTCAP), ({"window": (1, 0)}, WINDOW)],
                         ids=["softcap", "window"])
def test_to_nn_multihead_refuses_softcap_and_window(option: dict[str, Any], text: str) -> None:
    """Item 2: nn.MultiheadAttention has no softcap and no window; the export is refused
    by name (it went out silently, 2e-2 and 0.5 off)."""
    import torch_attention as ta
    from torch_attention.interop import to_nn_multihead

    module = ta.MultiHeadAttention(**OURS, **option)
    with pytest.raises(ValueError, match=re.escape(text.format(target="nn.MultiheadAttention"))):
        to_nn_multihead(module)


@needs_torch
def test_to_nn_multihead_names_every_option_it_cannot_express(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every offending option in one error, an undeclared one included: the exporter
    reads our options from the spec, so an option it has not declared is refused."""
    import torch_attention as ta
    from torch_attention.interop import to_nn_multihead

    module = ta.MultiHeadAttention(**OURS, softcap=0.5, window=(1, 0))
    _future_option(monkeypatch)
    with pytest.raises(ValueError) as info:
        to_nn_multihead(module)
    for text in (SOFTCAP, WINDOW, "future=1 ({target} cannot express it; only future=0 converts)"):
        assert text.format(target="nn.MultiheadAttention") in str(info.value)


@needs_torch
def test_to_nn_multihead_still_takes_inert_and_carried_options() -> None:
    """What does not change the computation goes out: the path, the mask strategy (every
    path computes "renormalize" in the "fill" form), an alignment without causal or
    window, a qk-norm epsilon without qk-norm, and a context_length (a cap on the input)."""
    import torch

    import torch_attention as ta
    from torch_attention.interop import to_nn_multihead

    torch.manual_seed(0)
    module = ta.MultiHeadAttention(**{**OURS, "context_length": 16}, implementation="reference",
                                   mask_strategy="renormalize", alignment="bottom_right",
                                   qk_norm_eps=1e-5).eval()
    native = to_nn_multihead(module)
    x = torch.from_numpy(_x((B, T, D)))
    with torch.no_grad(), full_precision():
        np.testing.assert_allclose(native(x, x, x, need_weights=False)[0].numpy(), module(x).numpy(),
                                   rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- Flax


def _ours_flax(**options: Any) -> Any:
    from flax import nnx

    import jax_attention as ja

    return ja.MultiHeadAttention(**{**OURS, **options}, rngs=nnx.Rngs(1))


def _nonzero_norm_and_biases(module: Any, seed: int = 3) -> Any:
    """Every bias of the native module and its query/key norm scales given values (Flax
    initialises them to zeros and ones), so that a lost or misplaced one shows."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    for role in ("query", "key", "value", "out", "query_ln", "key_ln"):
        node = getattr(module, role, None)
        for name in ("bias", "scale"):
            variable = getattr(node, name, None) if node is not None else None
            if variable is not None:
                shape = variable[...].shape
                variable[...] = jnp.asarray(rng.uniform(0.5, 1.5, shape) if name == "scale"
                                            else rng.normal(0.0, 0.3, shape), variable[...].dtype)
    return module


def _assert_same_weights(a: Any, b: Any) -> None:
    from jax_attention import interop

    sa, sb = interop.torch_state_dict(a), interop.torch_state_dict(b)
    assert list(sa) == list(sb)
    for name, value in sa.items():
        assert value.dtype == sb[name].dtype and np.array_equal(value, sb[name]), name


@needs_jax
@pytest.mark.parametrize(("option", "text"), [({"softcap": 0.5}, SOFTCAP), ({"window": (1, 0)}, WINDOW)],
                         ids=["softcap", "window"])
def test_to_nnx_multihead_refuses_softcap_and_window(option: dict[str, Any], text: str) -> None:
    """Item 2, the Flax twin: nnx.MultiHeadAttention and Linen's attention have neither;
    the same text as PyTorch's, naming the native module."""
    from jax_attention import interop

    module = _ours_flax(**option)
    with pytest.raises(ValueError, match=re.escape(text.format(target="nnx.MultiHeadAttention"))):
        interop.to_nnx_multihead(module)
    with pytest.raises(ValueError, match=re.escape(text.format(target="Linen MultiHeadDotProductAttention"))):
        interop.to_linen_multihead(module)


@needs_jax
def test_to_nnx_multihead_names_every_option_it_cannot_express(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax_attention import interop

    module = _ours_flax(softcap=0.5, window=(1, 0), qk_norm="rms")
    _future_option(monkeypatch)
    with pytest.raises(ValueError) as info:
        interop.to_nnx_multihead(module)
    for text in (SOFTCAP, WINDOW, "future=1 ({target} cannot express it; only future=0 converts)",
                 "qk_norm='rms' ({target}'s normalize_qk is a LayerNorm"):
        assert text.format(target="nnx.MultiHeadAttention") in str(info.value)


@needs_jax
def test_from_nnx_imports_normalize_qk_and_out_features() -> None:
    """Item 7: normalize_qk=True (a bias-free LayerNorm of each head, epsilon 1e-6) is our
    qk_norm="layer" with zero norm biases, and out_features != qkv_features our
    head_dim=; the import computes what the native module computes, and goes back
    bit-exactly."""
    import jax.numpy as jnp
    from flax import nnx

    from jax_attention import interop

    native = _nonzero_norm_and_biases(nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=6, qkv_features=12, out_features=4, normalize_qk=True, decode=False,
        rngs=nnx.Rngs(2)))
    ours = interop.from_nnx_multihead(native)
    assert {k: ours.config[k] for k in ("d_in", "d_out", "head_dim", "out_features", "qk_norm", "qk_norm_scope",
                                        "qk_norm_eps", "qkv_bias")} == {
        "d_in": 6, "d_out": 4, "head_dim": 6, "out_features": None, "qk_norm": "layer", "qk_norm_scope": "head",
        "qk_norm_eps": native.query_ln.epsilon, "qkv_bias": True}
    assert np.array_equal(np.asarray(ours.q_norm.bias[...]), np.zeros(6, np.float32))
    x = jnp.asarray(_x((B, T, 6), seed=4))
    with full_precision():
        np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(native(x)), rtol=RTOL, atol=ATOL)
    back = interop.to_nnx_multihead(ours)
    assert back.normalize_qk and (back.qkv_features, back.out_features) == (12, 4)
    for role, name in [(r, n) for r in ("query", "key", "value", "out") for n in ("kernel", "bias")] + [
            ("query_ln", "scale"), ("key_ln", "scale")]:
        a, b = getattr(getattr(native, role), name)[...], getattr(getattr(back, role), name)[...]
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), (role, name)


@needs_jax
def test_from_linen_imports_normalize_qk_and_out_features() -> None:
    """Item 7 for Linen's MultiHeadDotProductAttention: its query_ln/key_ln params become
    our q_norm/k_norm, and out_features != qkv_features our head_dim=."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jax_attention import interop

    x = jnp.asarray(_x((B, T, 6), seed=5))
    linen = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=12, out_features=4, normalize_qk=True)
    variables = linen.init(jax.random.key(0), x)
    variables = jax.tree.map(lambda a: a + 0.25 * jax.random.normal(jax.random.key(a.size), a.shape), variables)
    ours = interop.from_linen_multihead(linen, variables)
    assert (ours.spec.qk_norm, ours.spec.head_dim, ours.spec.fan_out("out")) == ("layer", 6, 4)
    with full_precision():
        np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(linen.apply(variables, x)), rtol=RTOL,
                                   atol=ATOL)
    again, params = interop.to_linen_multihead(ours)
    assert again.normalize_qk
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and bool(np.array_equal(a, b)), variables, params)
    assert all(jax.tree.leaves(same))


@needs_jax
@pytest.mark.parametrize("options", [{"head_dim": 8}, {"head_dim": 3, "out_features": 5, "qk_norm": "layer"}],
                         ids=["head_dim8", "head_dim3-out5-qk_norm"])
def test_ours_nnx_ours_is_bit_exact_with_free_head_dim(options: dict[str, Any]) -> None:
    """Item 8: heads * head_dim != d_model goes out as qkv_features != out_features and
    comes back with every weight equal (array_equal, dtype included) and the same output."""
    import jax.numpy as jnp

    from jax_attention import interop

    ours = _ours_flax(**options)
    rng = np.random.default_rng(7)  # every weight drawn (norm scales are ones, biases zeros at first);
    interop.load_torch_state_dict(ours, {  # the norms' biases stay zero: normalize_qk has none
        name: np.zeros_like(a) if name.endswith("norm.bias") else rng.standard_normal(a.shape).astype(a.dtype)
        for name, a in interop.torch_state_dict(ours).items()})
    back = interop.from_nnx_multihead(interop.to_nnx_multihead(ours))
    _assert_same_weights(ours, back)
    assert back.spec.head_dim == ours.spec.head_dim and back.spec.fan_out("out") == ours.spec.fan_out("out")
    x = jnp.asarray(_x((B, T, D), seed=6))
    assert np.array_equal(np.asarray(back(x)), np.asarray(ours(x)))
    if "out_features" not in options:  # one canonical form of the widths: the same config
        assert back.config == ours.config


@needs_jax
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"decode": True}, "decode=True"),
        ({"qkv_promote_dtype": lambda xs, dtype=None: xs}, "qkv_promote_dtype=<function"),
    ],
    ids=["decode", "custom-promotion"],  # grouped heads (num_kv_heads) import: test_native_flax.py
)
def test_from_nnx_refuses_only_what_ours_cannot_express(options: dict[str, Any], match: str) -> None:
    """What ours cannot express is still refused, by name; a native option the importer
    has not declared (a custom dtype promotion) is refused too, rather than dropped."""
    from flax import nnx

    from jax_attention import interop

    native = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, qkv_features=D, rngs=nnx.Rngs(0),
                                    **{"decode": False, **options})
    with pytest.raises(ValueError, match=re.escape(match)):
        interop.from_nnx_multihead(native)


@needs_jax
def test_from_nnx_refuses_two_layer_norm_epsilons() -> None:
    """Our q_norm and k_norm share one epsilon: a native module whose two differ is refused."""
    from flax import nnx

    from jax_attention import interop

    native = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, normalize_qk=True, decode=False,
                                    rngs=nnx.Rngs(0))
    native.key_ln.epsilon = 1e-5
    with pytest.raises(ValueError, match=re.escape("query_ln.epsilon=1e-06 != key_ln.epsilon=1e-05")):
        interop.from_nnx_multihead(native)


@needs_jax
def test_to_nnx_refuses_a_qk_norm_that_normalize_qk_is_not() -> None:
    """normalize_qk is one thing: LayerNorm per head, epsilon 1e-6, no bias, no offset."""
    import jax.numpy as jnp

    from jax_attention import interop

    target = "nnx.MultiHeadAttention"
    for options, text in (
        ({"qk_norm": "layer", "qk_norm_scope": "all"}, f"qk_norm_scope='all' ({target}'s normalize_qk"),
        ({"qk_norm": "layer", "qk_norm_eps": 1e-5}, f"qk_norm_eps=1e-05 ({target}'s normalize_qk"),
        ({"qk_norm": "layer", "qk_norm_offset": 1.0},
         f"qk_norm_offset=1.0 ({target} cannot express it; only qk_norm_offset=0.0 converts)"),
    ):
        with pytest.raises(ValueError, match=re.escape(text)):
            interop.to_nnx_multihead(_ours_flax(**options))
    module = _ours_flax(qk_norm="layer")
    module.k_norm.bias[...] = jnp.full_like(module.k_norm.bias[...], 0.5)
    with pytest.raises(ValueError, match=re.escape("nonzero biases k_norm.bias (")):
        interop.to_nnx_multihead(module)
