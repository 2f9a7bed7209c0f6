"""attention_spec.interop.packing: packed q/k/v in both orientations and Flax's head-shaped
kernels.  NumPy only (no framework, no forward pass); every comparison is exact, dtype
included.  The loaders that use it (``load_packed_qkv``) are tested per framework.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from attention_spec.interop import packing
from attention_spec.registry import make_config

# d_in != d_out, so a wrong orientation or a missing transpose changes a shape.
D_IN, D_OUT, HEADS = 6, 4, 2
DTYPES = ("float32", "float16", "float64")


def _rand(shape: tuple[int, ...], dtype: str = "float32", seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _mha(**overrides: object) -> object:
    options = {"d_in": D_IN, "d_out": D_OUT, "context_length": None, "dropout": 0.0,
               "num_heads": HEADS, "qkv_bias": True, **overrides}
    return make_config("MultiHeadAttention", options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", packing.PACKED_LAYOUTS)
def test_split_then_join_is_identity(layout: str, dtype: str) -> None:
    shape = (D_IN, 3 * D_OUT) if layout == "in_out" else (3 * D_OUT, D_IN)
    w, b = _rand(shape, dtype), _rand((3 * D_OUT,), dtype, seed=1)
    parts = packing.split_qkv(w, b, layout=layout)
    assert list(parts) == ["query", "key", "value"]
    for qw, qb in parts.values():
        assert qw.shape == (D_OUT, D_IN) and qb is not None and qb.shape == (D_OUT,)
    w2, b2 = packing.join_qkv(*(parts[r][0] for r in packing.ROLES), [parts[r][1] for r in packing.ROLES],
                              layout=layout)
    assert _equal(w2, w) and b2 is not None and _equal(b2, b)


@pytest.mark.parametrize("layout", packing.PACKED_LAYOUTS)
def test_join_then_split_is_identity(layout: str) -> None:
    ws = [_rand((D_OUT, D_IN), seed=i) for i in range(3)]
    w, b = packing.join_qkv(*ws, layout=layout)
    assert b is None
    assert w.shape == ((D_IN, 3 * D_OUT) if layout == "in_out" else (3 * D_OUT, D_IN))
    for (got, bias), want in zip(packing.split_qkv(w, layout=layout).values(), ws, strict=True):
        assert bias is None and _equal(got, want)


def test_split_order_and_orientation() -> None:
    # x @ W_packed[:, :d_out] is the query in GPT-2's Conv1D; (W_packed.T)[:d_out] in nn.Linear.
    w = _rand((D_IN, 3 * D_OUT))
    parts = packing.split_qkv(w, layout="in_out")
    x = _rand((3, D_IN), seed=5)
    for i, role in enumerate(packing.ROLES):
        np.testing.assert_array_equal(x @ parts[role][0].T, x @ w[:, i * D_OUT:(i + 1) * D_OUT])
    out_in = packing.split_qkv(w.T, layout="out_in")
    for role in packing.ROLES:
        assert _equal(out_in[role][0], parts[role][0])


def test_results_are_copies() -> None:
    w = _rand((3 * D_OUT, D_IN))
    parts = packing.split_qkv(w, layout="out_in")
    w[:] = 0
    assert np.any(parts["query"][0] != 0)


@pytest.mark.parametrize(
    ("weight_shape", "bias_shape", "layout", "match"),
    [
        ((D_IN, 3 * D_OUT), None, "rows", "layout must be 'in_out'"),
        ((D_IN, 3 * D_OUT), None, None, "layout must be 'in_out'"),
        ((D_IN, 3 * D_OUT, 1), None, "in_out", r"rank 2 \(d_in, 3\*d_out\)"),
        ((3 * D_OUT,), None, "out_in", r"rank 2 \(3\*d_out, d_in\)"),
        ((D_IN, 3 * D_OUT + 1), None, "in_out", "divisible by 3 .* along axis 1"),
        ((D_IN + 1, 3 * D_OUT), None, "out_in", "divisible by 3 .* along axis 0"),
        ((D_IN, 3 * D_OUT), (3 * D_OUT + 3,), "in_out", r"bias must have shape \(12,\)"),
        ((D_IN, 3 * D_OUT), (3, D_OUT), "in_out", r"bias must have shape \(12,\)"),
    ],
)
def test_split_errors(weight_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None, layout: object,
                      match: str) -> None:
    bias = None if bias_shape is None else _rand(bias_shape)
    with pytest.raises(ValueError, match=match):
        packing.split_qkv(_rand(weight_shape), bias, layout=layout)  # type: ignore[arg-type]


def test_split_refuses_integer_arrays() -> None:
    with pytest.raises(TypeError, match="not floating point"):
        packing.split_qkv(np.ones((D_IN, 3 * D_OUT), np.int32), layout="in_out")


def test_join_errors() -> None:
    q = _rand((D_OUT, D_IN))
    with pytest.raises(ValueError, match="same shape"):
        packing.join_qkv(q, q, _rand((D_OUT, D_IN + 1)), layout="in_out")
    with pytest.raises(ValueError, match="rank 2"):
        packing.join_qkv(q[0], q[0], q[0], layout="in_out")
    with pytest.raises(ValueError, match="same dtype"):
        packing.join_qkv(q, q, q.astype(np.float16), layout="in_out")
    with pytest.raises(ValueError, match="three arrays"):
        packing.join_qkv(q, q, q, [q[:, 0]] * 2, layout="in_out")
    with pytest.raises(ValueError, match=r"key bias must have shape \(4,\)"):
        packing.join_qkv(q, q, q, [q[:, 0], q[0], q[:, 0]], layout="out_in")
    with pytest.raises(ValueError, match="layout must be"):
        packing.join_qkv(q, q, q, layout="in-out")


# ------------------------------------------------------------------ our names


def test_torch_names_follow_the_registry() -> None:
    assert packing.torch_names_for_packed(_mha()) == {
        "query": ("W_query.weight", "W_query.bias"), "key": ("W_key.weight", "W_key.bias"),
        "value": ("W_value.weight", "W_value.bias"), "out": ("out_proj.weight", "out_proj.bias")}
    head = make_config("Head", {"d_in": D_IN, "head_size": D_OUT, "context_length": 8})
    assert packing.torch_names_for_packed(head) == {
        "query": ("query.weight", None), "key": ("key.weight", None), "value": ("value.weight", None)}
    v1 = make_config("SelfAttention_v1", {"d_in": D_IN, "d_out": D_OUT})
    assert packing.torch_names_for_packed(v1)["query"] == ("W_query", None)
    assert "out" not in packing.torch_names_for_packed(_mha(out_proj=False, qkv_bias=False))


@pytest.mark.parametrize("layout", packing.PACKED_LAYOUTS)
def test_packed_state_dict_round_trip(layout: str) -> None:
    shape = (D_IN, 3 * D_OUT) if layout == "in_out" else (3 * D_OUT, D_IN)
    w, b = _rand(shape), _rand((3 * D_OUT,), seed=1)
    ow, ob = _rand((D_OUT, D_OUT), seed=2), _rand((D_OUT,), seed=3)
    state = packing.packed_state_dict(_mha(), w, b, layout=layout, out_weight=ow, out_bias=ob)
    assert {k: v.shape for k, v in state.items()} == {
        "W_query.weight": (D_OUT, D_IN), "W_query.bias": (D_OUT,), "W_key.weight": (D_OUT, D_IN),
        "W_key.bias": (D_OUT,), "W_value.weight": (D_OUT, D_IN), "W_value.bias": (D_OUT,),
        "out_proj.weight": (D_OUT, D_OUT), "out_proj.bias": (D_OUT,)}
    # the out weight follows the layout: (in, out) for Conv1D, (out, in) for Linear
    assert _equal(state["out_proj.weight"], ow.T if layout == "in_out" else ow)
    back = packing.pack_state_dict(_mha(), state, layout=layout)
    assert _equal(back["qkv_weight"], w) and _equal(back["qkv_bias"], b)
    assert _equal(back["out_weight"], ow) and _equal(back["out_bias"], ob)


def test_packed_state_dict_for_raw_matrices() -> None:
    v1 = make_config("SelfAttention_v1", {"d_in": D_IN, "d_out": D_OUT})
    w = _rand((D_IN, 3 * D_OUT))
    state = packing.packed_state_dict(v1, w, layout="in_out")
    assert _equal(state["W_key"], w[:, D_OUT:2 * D_OUT])  # used as x @ W, so (d_in, d_out)
    assert _equal(packing.pack_state_dict(v1, state, layout="in_out")["qkv_weight"], w)


def test_missing_out_bias_loads_zeros_and_partial_loads() -> None:
    w = _rand((D_IN, 3 * D_OUT))
    state = packing.packed_state_dict(_mha(qkv_bias=False), w, layout="in_out", out_weight=_rand((D_OUT, D_OUT)))
    assert _equal(state["out_proj.bias"], np.zeros(D_OUT, np.float32))
    only_qkv = packing.packed_state_dict(_mha(qkv_bias=False), w, layout="in_out")
    assert sorted(only_qkv) == ["W_key.weight", "W_query.weight", "W_value.weight"]


def test_packed_state_dict_errors() -> None:
    w, b = _rand((D_IN, 3 * D_OUT)), _rand((3 * D_OUT,))
    with pytest.raises(ValueError, match="d_in=4, d_out=6 .* the module has d_in=6, d_out=4"):
        packing.packed_state_dict(_mha(), _rand((4, 18)), layout="in_out")
    with pytest.raises(ValueError, match="no qkv_bias was given"):
        packing.packed_state_dict(_mha(), w, layout="in_out")
    with pytest.raises(ValueError, match="module has no q/k/v biases"):
        packing.packed_state_dict(_mha(qkv_bias=False), w, b, layout="in_out")
    with pytest.raises(ValueError, match="out_bias was given without out_weight"):
        packing.packed_state_dict(_mha(), w, b, layout="in_out", out_bias=b[:D_OUT])
    with pytest.raises(ValueError, match="no output projection"):
        packing.packed_state_dict(_mha(out_proj=False), w, b, layout="in_out", out_weight=_rand((4, 4)))
    with pytest.raises(ValueError, match=r"out_weight must have shape \(4, 4\)"):
        packing.packed_state_dict(_mha(), w, b, layout="in_out", out_weight=_rand((4, 5)))
    with pytest.raises(ValueError, match=r"out_bias must have shape \(4,\)"):
        packing.packed_state_dict(_mha(), w, b, layout="in_out", out_weight=_rand((4, 4)), out_bias=b)
    wrapper = make_config("MultiHeadAttentionWrapper", {"d_in": D_IN, "d_out": D_OUT, "context_length": 4,
                                                        "dropout": 0.0, "num_heads": 2})
    with pytest.raises(ValueError, match="MultiHeadAttentionWrapper has no query, key and value"):
        packing.packed_state_dict(wrapper, w, layout="in_out")
    with pytest.raises(TypeError, match="AttentionConfig"):
        packing.packed_state_dict({"d_in": D_IN}, w, layout="in_out")  # type: ignore[arg-type]


# ------------------------------------------------------------------ head-shaped kernels


def test_head_reshapes_round_trip_and_match_our_head_split() -> None:
    kernel, bias, out = _rand((D_IN, D_OUT)), _rand((D_OUT,)), _rand((D_OUT, 5))
    k3 = packing.split_heads_kernel(kernel, HEADS)
    assert k3.shape == (D_IN, HEADS, D_OUT // HEADS)
    # head h holds columns h*head_dim ... (h+1)*head_dim - 1: our modules' split
    np.testing.assert_array_equal(k3[:, 1], kernel[:, D_OUT // HEADS:])
    assert _equal(packing.merge_heads_kernel(k3), kernel)
    assert _equal(packing.merge_heads_bias(packing.split_heads_bias(bias, HEADS)), bias)
    o3 = packing.split_heads_out_kernel(out, HEADS)
    assert o3.shape == (HEADS, D_OUT // HEADS, 5)
    assert _equal(packing.merge_heads_out_kernel(o3), out)


def test_head_reshape_errors() -> None:
    with pytest.raises(ValueError, match="not divisible by num_heads=3"):
        packing.split_heads_kernel(_rand((D_IN, D_OUT)), 3)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        packing.split_heads_bias(_rand((D_OUT,)), 0)
    with pytest.raises(ValueError, match=r"rank 3 \(in, heads, head_dim\)"):
        packing.merge_heads_kernel(_rand((D_IN, D_OUT)))
    with pytest.raises(ValueError, match=r"rank 3 \(heads, head_dim, out\)"):
        packing.merge_heads_out_kernel(_rand((D_IN, D_OUT)))


def _state(bias: bool = True) -> dict[str, np.ndarray]:
    names = ("W_query", "W_key", "W_value")
    state = {f"{n}.weight": _rand((D_OUT, D_IN), seed=i) for i, n in enumerate(names)}
    state["out_proj.weight"] = _rand((D_OUT, D_OUT), seed=7)
    if bias:
        state |= {f"{n}.bias": _rand((D_OUT,), seed=10 + i) for i, n in enumerate(names)}
        state["out_proj.bias"] = _rand((D_OUT,), seed=20)
    return state


@pytest.mark.parametrize("bias", [True, False])
def test_native_flax_params_round_trip(bias: bool) -> None:
    state = _state(bias)
    tree = packing.native_flax_params(state, HEADS, use_bias=bias)
    assert tree["query"]["kernel"].shape == (D_IN, HEADS, D_OUT // HEADS)
    assert tree["out"]["kernel"].shape == (HEADS, D_OUT // HEADS, D_OUT)
    assert ("bias" in tree["out"]) == bias
    back = packing.state_dict_from_native_flax(tree)
    assert sorted(back) == sorted(state)
    assert all(_equal(back[k], state[k]) for k in state)


def test_native_flax_params_errors() -> None:
    tree = packing.native_flax_params(_state(), HEADS)
    with pytest.raises(ValueError, match=r"missing \['out'\]"):
        packing.state_dict_from_native_flax({k: v for k, v in tree.items() if k != "out"})
    partial = {**tree, "key": {"kernel": tree["key"]["kernel"]}}
    with pytest.raises(ValueError, match="only some projections have a bias"):
        packing.state_dict_from_native_flax(partial)
    wrong_heads = {**tree, "value": {"kernel": tree["value"]["kernel"].reshape(D_IN, 4, 1),
                                     "bias": tree["value"]["bias"].reshape(4, 1)}}
    with pytest.raises(ValueError, match="disagree on"):
        packing.state_dict_from_native_flax(wrong_heads)
    bad_bias = {**tree, "query": {"kernel": tree["query"]["kernel"], "bias": tree["query"]["bias"][:1]}}
    with pytest.raises(ValueError, match="does not fit the kernel"):
        packing.state_dict_from_native_flax(bad_bias)
    with pytest.raises(ValueError, match="lacks out_proj.bias"):
        packing.native_flax_params({k: v for k, v in _state().items() if k != "out_proj.bias"}, HEADS)


def test_packing_imports_no_framework() -> None:
    code = ("import sys, attention_spec.interop.packing; "
            "assert not {'torch', 'jax', 'flax'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
