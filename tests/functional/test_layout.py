"""``layout="bshd"`` of both twins' functional ``dot_product_attention`` and ``route``.

With ``"bshd"`` q is (B, T, H, D), k and v (B, S, Hkv, D/Dv) and the output (B, T, H, Dv);
masks, bias, lengths and sinks keep their meaning and returned weights stay (B, H, T, S).
Each case runs on every implementation ("reference", "fused", "blockwise", "auto"), in
both twins: the output and the gradients of q, k and v are compared, transposed, with
the same call in ``"bhsd"`` (bit for bit in JAX, whose kernels read bshd as it is or
see the same transposed numbers; at ``PARITY`` / ``GRAD_PARITY`` in PyTorch, whose
transposed views reach its matmuls with other strides: measured up to 4.8e-7) and with
the float64 oracle (``ORACLE`` / ``GRAD_ORACLE``).  Then: under ``jax.jit`` (with the
sinks' gradient), the returned weights, ``route``, and the errors (a bad layout in both
twins' one text, before any work; a shape error that names the layout).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from parity_tests import reference
from parity_tests.harness import compare
from parity_tests.tolerances import GRAD_ORACLE, GRAD_PARITY, ORACLE, PARITY
from tests.functional.test_structure_options import FRAMEWORKS, PATHS, oracle_gradients, run
from tests.support import needs_jax, tiered

B, H, T, S, D, DV = 2, 4, 6, 9, 8, 5
LAYOUT_ERROR = "layout must be one of 'bhsd', 'bshd'; got 'BSHD'"


def _mask() -> np.ndarray:
    mask = np.random.default_rng(3).random((B, 1, T, S)) < 0.6
    mask[1, 0, 2] = False  # a fully masked row
    return mask


def _bias() -> np.ndarray:
    bias = np.random.default_rng(4).standard_normal((1, H, T, S)).astype(np.float32).astype(np.float64)
    bias[0, 1, 3, 2:5] = -np.inf  # blocked keys, as a mask blocks them
    return bias


# name -> (kv heads, the call's keywords (NumPy arrays or Python values), the oracle's mask)
CASES: dict[str, tuple[int, dict[str, Any], np.ndarray | None]] = {
    "causal": (H, {"causal": True}, None),
    "mask": (H, {"mask": _mask()}, _mask()),
    "kv_lengths": (H, {"kv_lengths": np.array([4, 9]), "causal": True},
                   (np.arange(S)[None, :] < np.array([4, 9])[:, None])[:, None, None, :]),
    "gqa": (2, {"causal": True}, None),
    "sinks": (2, {"sinks": np.array([1.5, -0.5, 0.25, 3.0])}, None),
    "mask, empty lengths, gqa": (2, {"mask": _mask(), "kv_lengths": np.array([0, 7])},
                                 _mask() & (np.arange(S)[None, :] < np.array([0, 7])[:, None])[:, None, None, :]),
    "bias": (2, {"bias": _bias(), "causal": True}, None),
}


def _inputs(kv_heads: int) -> tuple[np.ndarray, ...]:
    """float32-representable q, k, v (B, H, T, D) / (B, Hkv, S, D|Dv) and a cotangent (B, H, T, Dv)."""
    rng = np.random.default_rng(11)
    shapes = ((B, H, T, D), (B, kv_heads, S, D), (B, kv_heads, S, DV), (B, H, T, DV))
    return tuple(rng.standard_normal(s).astype(np.float32).astype(np.float64) for s in shapes)


def _tokens_first(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(a, -3, -2))


def _route_error(fw: str, path: str, call: dict[str, Any], shapes: tuple[Any, ...], layout: str) -> str | None:
    """The error text of ``route`` for this call (None: it routes)."""
    try:
        _route(fw, shapes, implementation=path, layout=layout, **call)
    except ValueError as error:
        return str(error)
    return None


def _route(fw: str, shapes: tuple[Any, ...], **options: Any) -> Any:
    if fw == "torch":
        import torch

        from torch_attention.functional import route

        tensors = [torch.zeros(s) for s in shapes]
        opts: dict[str, Any] = {n: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                                for n, v in options.items()}
        return route(*tensors, **opts)
    import jax.numpy as jnp

    from jax_attention.functional import route as jax_route

    arrays: dict[str, Any] = {n: jnp.asarray(v) if isinstance(v, np.ndarray) else v for n, v in options.items()}
    return jax_route(*(jnp.zeros(s) for s in shapes), **arrays)


@pytest.mark.parametrize(("name", "path", "fw"), tiered("name,path,fw", list(CASES), PATHS, FRAMEWORKS))
def test_bshd_equals_bhsd_transposed_and_the_oracle(fw: str, path: str, name: str):
    kv_heads, call, oracle_mask = CASES[name]
    q, k, v, cot = _inputs(kv_heads)
    bhsd_error = _route_error(fw, path, call, (q.shape, k.shape, v.shape), "bhsd")
    if bhsd_error is not None:  # an option this path refuses: refused alike in bshd, before any work
        shapes = tuple(_tokens_first(a).shape for a in (q, k, v))
        assert _route_error(fw, path, call, shapes, "bshd") == bhsd_error
        return
    # op by op, as a caller without jit: the two layouts then give the same bits in JAX
    heads = run(fw, q, k, v, cot, implementation=path, eager=True, **call)
    qt, kt, vt, cot_t = (_tokens_first(a) for a in (q, k, v, cot))
    tokens = run(fw, qt, kt, vt, cot_t, implementation=path, layout="bshd", eager=True, **call)
    assert tokens["output"].shape == (B, T, H, DV)
    scale = 1 / math.sqrt(D)
    out, weights = reference.attention(q, k, v, scale=scale, mask=oracle_mask, causal=call.get("causal", False),
                                       sinks=call.get("sinks"), bias=call.get("bias"))
    expected = {"output": out, **oracle_gradients(q, k, v, weights, cot, scale)}
    for key, got in tokens.items():
        got = np.swapaxes(got, -3, -2)
        if fw == "jax":  # the same kernels on the same numbers (the CPU kernel reads bshd as it is)
            np.testing.assert_array_equal(got, heads[key], err_msg=f"{name} {path} {key}")
        parity, oracle = (PARITY, ORACLE) if key == "output" else (GRAD_PARITY, GRAD_ORACLE)
        finding = compare(f"{name} {path} {key}: bshd vs bhsd", got, heads[key], parity["float32"], ("bshd", "bhsd"))
        assert finding.ok, finding
        finding = compare(f"{name} {path} {key}: bshd vs oracle", got, expected[key], oracle["float32"],
                          ("bshd", "oracle"))
        assert finding.ok, finding


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_returned_weights_stay_heads_first(fw: str):
    q, k, v, _ = _inputs(2)
    mask = _mask()
    out, weights = reference.attention(q, k, v, scale=1 / math.sqrt(D), mask=mask)
    qt, kt, vt = (_tokens_first(a) for a in (q, k, v))
    got: Any
    if fw == "torch":
        import torch

        from torch_attention.functional import dot_product_attention

        got = dot_product_attention(*(torch.from_numpy(a) for a in (qt, kt, vt)), mask=torch.from_numpy(mask),
                                    return_weights=True, layout="bshd")
    else:
        import jax.numpy as jnp

        from jax_attention.functional import dot_product_attention as jax_attention

        got = jax_attention(*(jnp.asarray(a) for a in (qt, kt, vt)), mask=jnp.asarray(mask), return_weights=True,
                            layout="bshd")
    got_out, got_weights = (np.asarray(t) for t in got)
    assert got_out.shape == (B, T, H, DV) and got_weights.shape == (B, H, T, S)
    for label, a, b in (("output", np.swapaxes(got_out, -3, -2), out), ("weights", got_weights, weights)):
        finding = compare(label, a, b, ORACLE["float32"], ("bshd", "oracle"))
        assert finding.ok, finding


@needs_jax
@pytest.mark.parametrize("path", PATHS)
def test_under_jit_with_the_sinks_gradient(path: str):
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention as jax_attention

    q, k, v, cot = _inputs(2)
    sinks = np.array([1.5, -0.5, 0.25, 3.0])
    if _route_error("jax", path, {"sinks": sinks}, (q.shape, k.shape, v.shape), "bhsd") is not None:
        path = "auto"  # the fused path refuses sinks where the CPU kernel cannot have them

    def loss(layout: str, q_: Any, k_: Any, v_: Any, sinks_: Any, cot_: Any) -> Any:
        out = jax_attention(q_, k_, v_, causal=True, sinks=sinks_, implementation=path, layout=layout)
        return (out * cot_).sum()

    f32 = _f32
    args = [f32(a) for a in (q, k, v)]
    heads = jax.jit(jax.value_and_grad(lambda *a: loss("bhsd", *a), argnums=(0, 1, 2, 3)))(
        *args, f32(sinks), f32(cot))
    swap = [jnp.swapaxes(a, -3, -2) for a in (*args, f32(cot))]
    tokens = jax.jit(jax.value_and_grad(lambda *a: loss("bshd", *a), argnums=(0, 1, 2, 3)))(
        *swap[:3], f32(sinks), swap[3])
    finding = compare("loss", tokens[0], heads[0], PARITY["float32"], ("bshd", "bhsd"))
    assert finding.ok, finding
    for name, got, want in zip(("q", "k", "v", "sinks"), tokens[1], heads[1], strict=True):
        got = got if name == "sinks" else jnp.swapaxes(got, -3, -2)
        finding = compare(f"grad {name}", got, want, GRAD_PARITY["float32"], ("bshd", "bhsd"))
        assert finding.ok, finding


def _f32(a: np.ndarray) -> Any:
    import jax.numpy as jnp

    return jnp.asarray(a, jnp.float32)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("path", PATHS)
def test_route_takes_the_layout(fw: str, path: str):
    """``route(..., layout="bshd")`` is the route of the same call in bhsd."""
    q, k, v, _ = _inputs(2)
    tokens = tuple(_tokens_first(a).shape for a in (q, k, v))
    assert _route(fw, tokens, implementation=path, causal=True, layout="bshd") == _route(
        fw, (q.shape, k.shape, v.shape), implementation=path, causal=True)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("entry", ["dot_product_attention", "route"])
def test_a_bad_layout_is_refused_before_any_work(fw: str, entry: str, monkeypatch: pytest.MonkeyPatch):
    """One text in both twins, raised before any check of the arrays or any kernel: the
    shapes here are wrong too, and a path that ran would fail."""
    import attention_spec.options as options

    def no_shape_check(*args: Any) -> None:
        raise AssertionError("the shapes were checked before the layout")

    monkeypatch.setattr(options, "check_qkv", no_shape_check)
    module = "torch_attention.functional" if fw == "torch" else "jax_attention.functional"
    function = getattr(pytest.importorskip(module), entry)
    array = _array(fw, (2, 3))
    with pytest.raises(ValueError, match=re.escape(LAYOUT_ERROR)):
        function(array, array, _array(fw, (5,)), layout="BSHD")


def _array(fw: str, shape: tuple[int, ...]) -> Any:
    if fw == "torch":
        import torch

        return torch.zeros(shape)
    import jax.numpy as jnp

    return jnp.zeros(shape)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_shape_errors_name_the_layout(fw: str):
    with pytest.raises(ValueError, match=re.escape("layout='bshd' takes q, k and v as (..., S, H, D), at least 3 "
                                                   "dimensions; got (6, 8)")):
        _route(fw, ((6, 8), (9, 8), (9, 8)), layout="bshd")
    message = ("k and v must have the same length (kv_len); got q (2, 4, 6, 8), k (2, 2, 9, 8), v (2, 2, 7, 8) "
               "(read as (..., H, S, D) from layout='bshd', given q (2, 6, 4, 8), k (2, 9, 2, 8), v (2, 7, 2, 8))")
    with pytest.raises(ValueError, match=re.escape(message)):
        _route(fw, ((2, 6, 4, 8), (2, 9, 2, 8), (2, 7, 2, 8)), layout="bshd")

