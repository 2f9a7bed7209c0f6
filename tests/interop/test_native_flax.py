"""Flax's own attention, both ways: ``flax.nnx.MultiHeadAttention`` and Linen's
``MultiHeadDotProductAttention`` against our Flax ``MultiHeadAttention``
(``jax_attention.interop``), and ``load_packed_qkv``.

Outputs and gradients with respect to the input and every parameter (the native
module's head-shaped kernels reshaped to compare) are held to the float32 tolerances of
``tolerances.py``, run in ``full_precision()`` so that neither side rounds its matmuls.
Then the whole port: native -> ours (Flax) -> ``to_torch`` -> ``assert_parity``.
Round trips are exact (``np.array_equal``, dtype included); refusals are checked by
their message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from attention_spec.interop import packing
from parity_tests.harness import compare, full_precision
from parity_tests.tolerances import GRAD_PARITY, PARITY
from tests.support import needs_both

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jax_attention as ja  # noqa: E402
from jax_attention import interop  # noqa: E402

B, T, D_IN, D_OUT, HEADS = 2, 5, 6, 8, 2
ROLES = ("query", "key", "value", "out")


def _x(seed: int = 0, shape: tuple[int, ...] = (B, T, D_IN)) -> Any:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _masks() -> dict[str, Any]:
    """Masks with at least one visible key per query (Flax's softmax averages every value
    on a row with none; ours gives zeros there, a documented difference)."""
    rng = np.random.default_rng(3)
    eye = np.eye(T, dtype=bool)
    shared = (rng.random((B, 1, T, T)) < 0.6) | eye
    per_head = (rng.random((B, HEADS, T, T)) < 0.5) | eye
    padding = np.arange(T)[None, None, None, :] < np.array([T, 3])[:, None, None, None]
    return {"none": None, "shared": jnp.asarray(shared), "per-head": jnp.asarray(per_head),
            "padding": jnp.asarray(padding)}


def _native_nnx(use_bias: bool = True, in_features: int = D_IN, seed: int = 1, **kw: Any) -> Any:
    m = nnx.MultiHeadAttention(num_heads=HEADS, in_features=in_features, qkv_features=D_OUT,
                               out_features=D_OUT, use_bias=use_bias, rngs=nnx.Rngs(seed),
                               **{"decode": False, **kw})
    if use_bias:  # Flax initialises biases to zero: give them values, so a lost bias shows
        for i, role in enumerate(ROLES):
            bias = getattr(m, role).bias
            bias[...] = 0.1 * jax.random.normal(jax.random.key(100 + i), bias.shape, bias.dtype)
    return m


def _grads(module: Any, call: Callable[[Any, Any], Any], x: Any, cot: Any) -> tuple[Any, Any, Any]:
    """(output, d/dx, d/dparams as an nnx.State) of sum(call(module, x) * cot)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(p: Any, x: Any) -> Any:
        out = call(nnx.merge(graphdef, p, rest), x)
        return jnp.sum(out * cot), out

    (_, out), (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return out, gx, gp


def _ours_as_native_tree(grads: Any, use_bias: bool) -> dict[str, dict[str, np.ndarray]]:
    """Our parameter gradients (nnx.State of W_query/kernel ...) in the native layout."""
    state = interop.state_to_torch(grads, "MultiHeadAttention",
                                   {"d_in": D_IN, "d_out": D_OUT, "context_length": None, "dropout": 0.0,
                                    "num_heads": HEADS, "qkv_bias": use_bias})
    return packing.native_flax_params(state, HEADS, use_bias=use_bias)


def _native_tree(grads: Any) -> dict[str, dict[str, np.ndarray]]:
    flat = {tuple(str(k) for k in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    tree: dict[str, dict[str, np.ndarray]] = {}
    for (role, name), value in flat.items():
        tree.setdefault(role, {})[name] = value
    return tree


WORST: dict[str, float] = {}  # the worst errors per comparison kind, read by hand when measuring


def _assert_close(native: dict[str, Any], ours: dict[str, Any]) -> None:
    findings = []
    for name, value in native.items():
        tol = (GRAD_PARITY if name.startswith("grad") else PARITY)["float32"]
        finding = compare(name, value, ours[name], tol, labels=("native", "ours"))
        kind = "grad" if name.startswith("grad") else "out"
        WORST[f"{kind} rel"] = max(WORST.get(f"{kind} rel", 0.0), finding.max_rel)
        WORST[f"{kind} abs"] = max(WORST.get(f"{kind} abs", 0.0), finding.max_abs)
        WORST[f"{kind} needed"] = max(WORST.get(f"{kind} needed", 0.0), finding.needed)
        findings.append(finding)
    bad = [f.describe() for f in findings if not f.ok]
    assert not bad, "\n".join(bad)


def _compare_modules(native: Any, native_call: Callable, ours: Any, ours_call: Callable, use_bias: bool,
                     x: Any, native_tree: Callable[[Any], dict] = _native_tree) -> None:
    cot = _x(9, (B, T, D_OUT))
    with full_precision():
        n_out, n_gx, n_gp = _grads(native, native_call, x, cot)
        o_out, o_gx, o_gp = _grads(ours, ours_call, x, cot)
    n_tree, o_tree = native_tree(n_gp), _ours_as_native_tree(o_gp, use_bias)
    assert {r: sorted(v) for r, v in n_tree.items()} == {r: sorted(v) for r, v in o_tree.items()}
    native_values = {"out": n_out, "grad x": n_gx}
    ours_values = {"out": o_out, "grad x": o_gx}
    for role, node in n_tree.items():
        for name in node:
            native_values[f"grad {role}/{name}"] = n_tree[role][name]
            ours_values[f"grad {role}/{name}"] = o_tree[role][name]
    _assert_close(native_values, ours_values)


# ------------------------------------------------------------- nnx.MultiHeadAttention


@pytest.mark.parametrize("mask", ["none", "shared", "per-head", "padding"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_from_nnx_matches_native(use_bias: bool, mask: str) -> None:
    native = _native_nnx(use_bias)
    ours = interop.from_nnx_multihead(native)
    assert ours.config == {"d_in": D_IN, "d_out": D_OUT, "context_length": None, "dropout": 0.0,
                           "num_heads": HEADS, "qkv_bias": use_bias, "out_proj": True, "scale": None,
                           "causal": False, "mask_strategy": "fill", "implementation": "auto",
                           "softcap": None, "num_kv_heads": None, "kdim": None, "vdim": None,
                           "window": None, "alignment": "top_left", "head_dim": None, "out_features": None,
                           "out_bias": True, "qk_norm": None, "qk_norm_scope": "head", "qk_norm_eps": 1e-6,
                           "rope": None, "sinks": False, "qk_norm_offset": 0.0, "score_mod": None, "mask_mod": None,
                           "clip_qkv": None, "output_gate": False, "qk_norm_weight": True, "v_norm": None,
                           "values_from_keys": False, "query_scale": None, "chunk": None, "kv_shared": False,
                           "output_gate_activation": "sigmoid", "output_gate_per_head": False,
                           "qk_norm_position": "before_rope", "out_norm": None, "output_gate_bias": False,
                           "query_scale_kind": "log", "v_head_dim": None, "v_scale": None}
    m = _masks()[mask]
    _compare_modules(native, lambda mod, x: mod(x, mask=m), ours, lambda mod, x: mod(x, m), use_bias, _x())


def test_native_is_causal_is_our_causal_mask() -> None:
    native = _native_nnx()
    ours = interop.from_nnx_multihead(native)
    causal = ja.causal_mask(T)
    _compare_modules(native, lambda mod, x: mod(x, is_causal=True), ours, lambda mod, x: mod(x, causal),
                     True, _x(4))


def test_to_nnx_matches_ours_causal_and_unbiased() -> None:
    # the other direction, from one of our modules: causal (allowed, called with is_causal)
    # and qkv_bias=False with a nonzero out_proj bias (exported as zero q/k/v biases)
    ours = ja.MultiHeadAttention(D_IN, D_OUT, 16, 0.0, HEADS, rngs=nnx.Rngs(5))
    native = interop.to_nnx_multihead(ours, use_bias=True, allow_causal=True)
    assert native.use_bias and not native.decode
    assert np.array_equal(np.asarray(native.query.bias[...]), np.zeros((HEADS, D_OUT // HEADS), np.float32))
    cot = _x(9, (B, T, D_OUT))
    x = _x(6)
    with full_precision():
        n_out, n_gx, _ = _grads(native, lambda mod, x: mod(x, is_causal=True), x, cot)
        o_out, o_gx, _ = _grads(ours, lambda mod, x: mod(x), x, cot)
    _assert_close({"out": n_out, "grad x": n_gx}, {"out": o_out, "grad x": o_gx})


def test_nnx_round_trips_are_exact() -> None:
    for dtype in (jnp.float32, jnp.bfloat16):
        native = _native_nnx(param_dtype=dtype)
        back = interop.to_nnx_multihead(interop.from_nnx_multihead(native))
        assert back.param_dtype == dtype
        for role in ROLES:
            for name in ("kernel", "bias"):
                a, b = getattr(getattr(native, role), name)[...], getattr(getattr(back, role), name)[...]
                assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), (role, name)
    ours = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, qkv_bias=True, causal=False,
                                 precision="highest", rngs=nnx.Rngs(2))
    again = interop.from_nnx_multihead(interop.to_nnx_multihead(ours))
    assert again.config == ours.config and again.precision == "highest"
    for key, value in interop.torch_state_dict(ours).items():
        assert np.array_equal(interop.torch_state_dict(again)[key], value), key


def test_unbiased_native_imports_a_zero_out_bias() -> None:
    ours = interop.from_nnx_multihead(_native_nnx(use_bias=False))
    assert not ours.qkv_bias
    assert np.array_equal(np.asarray(ours.out_proj.bias[...]), np.zeros(D_OUT, np.float32))
    back = interop.to_nnx_multihead(ours)
    assert not back.use_bias and back.out.bias is None


def test_dropout_rate_and_mode_carry_over() -> None:
    native = _native_nnx(dropout_rate=0.1, deterministic=True)
    with pytest.raises(ValueError, match="dropout_rate=0.1: pass rngs="):
        interop.from_nnx_multihead(native)
    ours = interop.from_nnx_multihead(native, rngs=nnx.Rngs(3))
    assert ours.config["dropout"] == 0.1 and ours.dropout.deterministic
    with full_precision():  # deterministic: dropout is off on both sides
        np.testing.assert_allclose(np.asarray(ours(_x())), np.asarray(native(_x())), rtol=1e-5, atol=1e-5)
    back = interop.to_nnx_multihead(ours, rngs=nnx.Rngs(4))
    assert back.dropout_rate == 0.1 and back.deterministic is True


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decode": True}, "decode=True"),
        ({"attention_fn": lambda *a, **k: None}, "attention_fn="),
    ],
)
def test_from_nnx_refuses_what_ours_cannot_express(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        interop.from_nnx_multihead(_native_nnx(**kwargs))


@pytest.mark.parametrize("implementation", ["reference", "fused", "blockwise", "auto"])
def test_from_nnx_cross_attention(implementation: str) -> None:
    """in_kv_features: the native m(x, context) equals ours(x, context=context) on every
    path, and the round trip through to_nnx_multihead is bit-exact."""
    native = _native_nnx(in_kv_features=5)
    ours = interop.from_nnx_multihead(native)
    assert (ours.spec.kdim, ours.spec.vdim) == (5, 5)
    context = jax.random.normal(jax.random.key(7), (B, T + 3, 5))
    with full_precision():
        want = native(_x(), context)
        got = ours(_x(), context=context, implementation=implementation)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    back = interop.to_nnx_multihead(ours)
    assert back.in_kv_features == 5
    for role in ROLES:
        np.testing.assert_array_equal(np.asarray(getattr(back, role).kernel[...]),
                                      np.asarray(getattr(native, role).kernel[...]))


def test_to_nnx_refuses_two_kv_widths_and_linen_grouped_heads() -> None:
    ours = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, causal=False, rngs=nnx.Rngs(0), kdim=3, vdim=4)
    with pytest.raises(ValueError, match=re.escape("kdim=3 != vdim=4")):
        interop.to_nnx_multihead(ours)
    grouped = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, causal=False, rngs=nnx.Rngs(0), num_kv_heads=1)
    for export in (interop.to_linen_multihead_params, interop.to_linen_multihead):
        with pytest.raises(ValueError, match=re.escape("num_kv_heads=1 (grouped-query heads; Linen "
                                                       "MultiHeadDotProductAttention has one key/value head")):
            export(grouped)


GROUPED_HEADS, KV_HEADS = 4, 2


def _native_grouped(use_bias: bool = True, seed: int = 1) -> Any:
    m = nnx.MultiHeadAttention(num_heads=GROUPED_HEADS, in_features=D_IN, qkv_features=D_OUT, out_features=D_OUT,
                               num_kv_heads=KV_HEADS, use_bias=use_bias, decode=False, rngs=nnx.Rngs(seed))
    if use_bias:
        for i, role in enumerate(ROLES):
            bias = getattr(m, role).bias
            bias[...] = 0.1 * jax.random.normal(jax.random.key(200 + i), bias.shape, bias.dtype)
    return m


@pytest.mark.parametrize("use_bias", [True, False])
def test_from_nnx_grouped_heads(use_bias: bool) -> None:
    """Flax's ``num_kv_heads`` (grouped-query: query head h reads key/value head
    h // (heads // kv_heads), as ours): the weights map exactly, the outputs equal the
    native module's, and ``to_nnx_multihead`` gives the native module back bit for bit."""
    native = _native_grouped(use_bias)
    ours = interop.from_nnx_multihead(native)
    assert (ours.config["num_heads"], ours.config["num_kv_heads"]) == (GROUPED_HEADS, KV_HEADS)
    state = interop.torch_state_dict(ours)
    for role, name in (("query", "W_query"), ("key", "W_key"), ("value", "W_value")):
        kernel = np.asarray(getattr(native, role).kernel[...])
        np.testing.assert_array_equal(state[f"{name}.weight"], kernel.reshape(D_IN, -1).T)
        if use_bias:
            np.testing.assert_array_equal(state[f"{name}.bias"], np.asarray(getattr(native, role).bias[...]).ravel())
    m = _masks()["shared"]
    x = _x(11)
    with full_precision():
        want, got = native(x, mask=m), ours(x, m)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    back = interop.to_nnx_multihead(ours)
    assert (back.num_heads, back.num_kv_heads) == (GROUPED_HEADS, KV_HEADS)
    for role in ROLES:
        for name in ("kernel", "bias"):
            a, b = getattr(getattr(native, role), name), getattr(getattr(back, role), name)
            assert (a is None) == (b is None), (role, name)
            if a is not None:
                assert np.array_equal(np.asarray(a[...]), np.asarray(b[...])), (role, name)
    with full_precision():
        np.testing.assert_array_equal(np.asarray(back(x, mask=m)), np.asarray(want))


def test_from_nnx_refusals_are_listed_together() -> None:
    native = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D_IN, qkv_features=D_OUT, num_kv_heads=1,
                                    decode=True, attention_fn=lambda *a, **k: None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"(?s)decode=True.*attention_fn="):
        interop.from_nnx_multihead(native)
    cached = _native_nnx()
    cached.init_cache((B, T, D_IN))
    with pytest.raises(ValueError, match="an initialised decode cache"):
        interop.from_nnx_multihead(cached)
    with pytest.raises(TypeError, match="takes an nnx.MultiHeadAttention"):
        interop.from_nnx_multihead(ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, rngs=nnx.Rngs(0)))


def test_to_nnx_refuses_what_native_cannot_express() -> None:
    causal = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="causal=True .* allow_causal=True"):
        interop.to_nnx_multihead(causal)
    with pytest.raises(ValueError, match=r"nonzero biases out_proj.bias with use_bias=False"):
        interop.to_nnx_multihead(causal, allow_causal=True)  # qkv_bias=False, a drawn out bias
    no_out = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, out_proj=False, causal=False,
                                   rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="out_proj=False"):
        interop.to_nnx_multihead(no_out)
    scaled = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, qkv_bias=True, scale=1.0, causal=False,
                                   rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="scale=1.0"):
        interop.to_nnx_multihead(scaled)
    with pytest.raises(ValueError, match="W_query.bias"):
        interop.to_nnx_multihead(scaled, use_bias=False)
    with pytest.raises(TypeError, match="takes our MultiHeadAttention"):
        interop.to_nnx_multihead(ja.CausalAttention(D_IN, D_OUT, 8, 0.0, rngs=nnx.Rngs(0)))


@needs_both
@pytest.mark.parametrize("mask", ["none", "per-head"])
def test_port_native_nnx_to_torch(mask: str) -> None:
    # The whole port: nnx.MultiHeadAttention -> ours (Flax) -> our PyTorch twin, forward
    # and gradients through the harness; the first step is held to the native module above.
    import torch

    from parity_tests import assert_parity, to_torch

    native = _native_nnx()
    ours = interop.from_nnx_multihead(native)
    twin = to_torch(ours)
    m = _masks()[mask]
    np_mask = None if m is None else np.array(m)
    x = np.array(_x(7))
    report = assert_parity(twin, ours, x, mask=np_mask)
    assert report.ok and len(report.findings) >= 10  # output, grad x, 8 parameters
    with full_precision():
        native_out = np.asarray(native(jnp.asarray(x), mask=m))
        twin_out = twin(torch.from_numpy(x), None if np_mask is None else torch.from_numpy(np_mask))
    np.testing.assert_allclose(twin_out.detach().numpy(), native_out, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------- Linen MultiHeadDotProductAttention


def _linen(use_bias: bool = True, **kw: Any) -> tuple[Any, dict[str, Any]]:
    module = nn.MultiHeadDotProductAttention(num_heads=HEADS, use_bias=use_bias,
                                             **{"qkv_features": D_OUT, "out_features": D_OUT, **kw})
    variables = module.init(jax.random.key(11), _x())
    if use_bias:
        variables = jax.tree.map(lambda a: a + 0.1 if a.ndim <= 2 else a, variables)  # nonzero biases
    return module, variables


class _LinenHolder(nnx.Module):
    """Linen params as nnx.Params, so that ``_grads`` splits them like a module's."""

    def __init__(self, module: Any, params: Any) -> None:
        self.module = module
        self.params = nnx.data(jax.tree.map(nnx.Param, params))

    def __call__(self, x: Any, mask: Any = None) -> Any:
        params = jax.tree.map(lambda v: v[...], self.params, is_leaf=lambda v: isinstance(v, nnx.Param))
        return self.module.apply({"params": params}, x, mask=mask)


def _linen_tree(grads: Any) -> dict[str, dict[str, np.ndarray]]:
    flat = {tuple(str(k) for k in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    tree: dict[str, dict[str, np.ndarray]] = {}
    for path, value in flat.items():
        role, name = path[-2:]
        tree.setdefault(role, {})[name] = value
    return tree


@pytest.mark.parametrize("mask", ["none", "shared", "padding"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_from_linen_matches_native(use_bias: bool, mask: str) -> None:
    module, variables = _linen(use_bias)
    ours = interop.from_linen_multihead(module, variables)
    assert ours.qkv_bias == use_bias and not ours.causal
    m = _masks()[mask]
    _compare_modules(_LinenHolder(module, variables["params"]), lambda mod, x: mod(x, m),
                     ours, lambda mod, x: mod(x, m), use_bias, _x(2), native_tree=_linen_tree)


def test_linen_round_trips_are_exact() -> None:
    module, variables = _linen()
    ours = interop.from_linen_multihead_params(variables["params"])  # num_heads read from the kernels
    assert ours.num_heads == HEADS
    linen, back = interop.to_linen_multihead(ours)
    assert linen.num_heads == HEADS and linen.use_bias
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and bool(np.array_equal(a, b)), variables, back)
    assert all(jax.tree.leaves(same))
    assert jax.tree.map(np.shape, interop.to_linen_multihead_params(ours)) == jax.tree.map(
        np.shape, variables["params"])
    with full_precision():
        np.testing.assert_array_equal(np.asarray(linen.apply(back, _x())), np.asarray(module.apply(variables, _x())))


def test_from_linen_errors_before_building() -> None:
    _, variables = _linen()
    params = variables["params"]
    with pytest.raises(ValueError, match="num_heads=4 but the query kernel"):
        interop.from_linen_multihead_params(params, num_heads=4)
    with pytest.raises(ValueError, match=r"missing \['value'\]"):
        interop.from_linen_multihead_params({k: v for k, v in params.items() if k != "value"})
    mixed = {**params, "out": {"kernel": params["out"]["kernel"].astype(jnp.bfloat16),
                               "bias": params["out"]["bias"].astype(jnp.bfloat16)}}
    with pytest.raises(ValueError, match="mix dtypes"):
        interop.from_linen_multihead_params(mixed)
    with pytest.raises(ValueError, match="hold query_ln without key_ln"):
        interop.from_linen_multihead_params({**params, "query_ln": {"scale": jnp.ones(D_OUT // HEADS)}})
    with pytest.raises(ValueError, match="normalize_qk=True but the params lack query_ln"):
        interop.from_linen_multihead(nn.MultiHeadDotProductAttention(num_heads=HEADS, normalize_qk=True),
                                     variables)


# ------------------------------------------------------------------------ load_packed_qkv


@pytest.mark.parametrize("layout", packing.PACKED_LAYOUTS)
def test_load_packed_qkv_round_trip_and_orientation(layout: str) -> None:
    source = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, qkv_bias=True, rngs=nnx.Rngs(1))
    packed = packing.pack_state_dict(source.spec, interop.torch_state_dict(source), layout=layout)
    target = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, qkv_bias=True, rngs=nnx.Rngs(2))
    interop.load_packed_qkv(target, packed["qkv_weight"], packed["qkv_bias"], layout=layout,
                            out_weight=packed["out_weight"], out_bias=packed["out_bias"])
    for key, value in interop.torch_state_dict(source).items():
        assert np.array_equal(interop.torch_state_dict(target)[key], value), key
    # what the packed checkpoint means: Conv1D computes x @ W + b, nn.Linear x @ W.T + b
    x = np.asarray(_x(3)).astype(np.float64)
    w = packed["qkv_weight"].astype(np.float64)
    qkv = (x @ w if layout == "in_out" else x @ w.T) + packed["qkv_bias"]
    with full_precision():
        key = np.asarray(target.W_key(_x(3)))
    np.testing.assert_allclose(key, qkv[..., D_OUT:2 * D_OUT], rtol=1e-5, atol=1e-5)


def test_load_packed_qkv_without_out_weight_keeps_out_proj() -> None:
    module = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, rngs=nnx.Rngs(1))
    before = interop.torch_state_dict(module)
    w = np.random.default_rng(0).standard_normal((D_IN, 3 * D_OUT)).astype(np.float32)
    interop.load_packed_qkv(module, w, layout="in_out")
    after = interop.torch_state_dict(module)
    assert np.array_equal(after["out_proj.weight"], before["out_proj.weight"])
    assert np.array_equal(after["W_value.weight"], w[:, 2 * D_OUT:].T)


def test_load_packed_qkv_refuses_before_writing() -> None:
    module = ja.MultiHeadAttention(D_IN, D_OUT, None, 0.0, HEADS, qkv_bias=True, rngs=nnx.Rngs(1))
    before = interop.torch_state_dict(module)
    w = np.ones((D_IN, 3 * D_OUT), np.float32)
    cases = [
        (dict(layout="out_in"), r"is for d_in=24, d_out=2 \(layout=.out_in.\); the module has d_in=6"),
        (dict(layout="in_out"), "no qkv_bias was given"),
        (dict(layout="in_out", out_weight=np.ones((D_OUT, D_IN), np.float32)), "out_weight must have shape"),
        (dict(layout="sideways"), "layout must be"),
    ]
    for kwargs, match in cases:
        bias = np.ones(3 * D_OUT, np.float32) if "out_weight" in kwargs else None
        with pytest.raises(ValueError, match=match):
            interop.load_packed_qkv(module, w, bias, **kwargs)
    with pytest.raises(TypeError, match="not floating point"):
        interop.load_packed_qkv(module, w.astype(np.int32), np.ones(3 * D_OUT, np.int32), layout="in_out")
    after = interop.torch_state_dict(module)
    assert all(np.array_equal(after[k], v) for k, v in before.items())
    with pytest.raises(TypeError, match="load_packed_qkv loads into this library's modules; got MultiHeadAttention"):
        interop.load_packed_qkv(_native_nnx(), w, layout="in_out")
