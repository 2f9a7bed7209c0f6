"""Attention sinks (gpt-oss) in PyTorch's ``dot_product_attention``, every path, against
the float64 oracle (``parity_tests.reference.attention(..., sinks=...)``).

A sink is one logit per query head, in the units of the final scores (after the scale,
the soft-cap and the bias), in each softmax's denominator: a row's key weights sum to
less than 1, a row that sees no key stays zeros.  The reference and blockwise paths
honour them; the fused path (SDPA) refuses them by name and ``"auto"`` routes around it.
Gradients w.r.t. q, k, v and the sinks: against the float64 reference path in autograd,
against the oracle's closed form for the sinks, and by ``gradcheck`` in float64.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from attention_spec.arrays import check_sinks
from attention_spec.planning import SINKS_FUSED_BLOCKER
from parity_tests import reference
from parity_tests.tolerances import GRAD_ORACLE, ORACLE
from tests.support import needs_torch

pytestmark = needs_torch

B, H, T, S, D = 2, 4, 6, 9, 8
PATHS = ("reference", "blockwise", "auto")
DTYPES = ("float64", "float32", "float16", "bfloat16")
CASES = ("plain", "causal", "window", "lengths", "gqa", "softcap-bias", "masked-rows", "large-sinks",
         "large-logits")


def case_inputs(case: str, seed: int = 0) -> tuple[dict[str, np.ndarray], dict]:
    """float64 q (B, H, T, D), k and v (B, Hkv, S, D), sinks (H,), and the call's options
    (NumPy), for one case."""
    rng = np.random.default_rng(seed)
    kv_heads = 2 if case == "gqa" else H
    arrays = {"q": rng.standard_normal((B, H, T, D)), "k": rng.standard_normal((B, kv_heads, S, D)),
              "v": rng.standard_normal((B, kv_heads, S, D)), "sinks": rng.uniform(-2.0, 2.0, H)}
    options: dict = {}
    if case == "causal":
        options["causal"] = True
    if case == "window":
        options.update(window=(2, 1), alignment="bottom_right")
    if case in ("lengths", "gqa"):
        options["kv_lengths"] = [4, 0]  # example 1 sees no key: zero rows
    if case == "softcap-bias":
        options.update(softcap=1.5, bias=rng.standard_normal((1, H, T, S)))
    if case == "masked-rows":
        mask = rng.random((B, 1, T, S)) > 0.4
        mask[0, 0, 2] = mask[1, 0, 5] = False
        options["mask"] = mask
    if case == "large-sinks":
        arrays["sinks"] = np.array([30.0, -30.0, 12.0, -12.0])
        options["causal"] = True
    if case == "large-logits":  # logits of about 1e3 against sinks of the same size
        arrays["q"], arrays["k"] = arrays["q"] * 12.0, arrays["k"] * 12.0
        arrays["sinks"] = np.array([300.0, -300.0, 40.0, 0.0])
    return arrays, options


def _oracle_mask(options: dict) -> np.ndarray | None:
    mask = options.get("mask")
    if "kv_lengths" in options:
        lengths = (np.arange(S)[None, :] < np.asarray(options["kv_lengths"])[:, None])[:, None, None, :]
        mask = lengths if mask is None else mask & lengths
    return mask


def oracle(arrays: dict[str, np.ndarray], options: dict, **extra) -> tuple[np.ndarray, np.ndarray]:
    """The float64 oracle's (out, weights) for the case's arrays (as the framework saw them)."""
    window, offset = options.get("window"), (S - T if options.get("alignment") == "bottom_right" else 0)
    return reference.attention(
        arrays["q"], arrays["k"], arrays["v"], scale=1 / math.sqrt(D), mask=_oracle_mask(options),
        causal=bool(options.get("causal")), bias=options.get("bias"), softcap=options.get("softcap"),
        window=window, offset=offset, sinks=arrays["sinks"], **extra,
    )


def torch_call(arrays: dict[str, np.ndarray], options: dict, dtype: str, path: str, **extra):
    """(out, weights or None, the torch leaves q, k, v, sinks) in ``dtype``; the sinks in the
    compute dtype's input form (float32 for half inputs), the bias in ``dtype``."""
    import torch

    from torch_attention import functional

    dt = getattr(torch, dtype)
    sink_dtype = torch.float64 if dtype == "float64" else torch.float32
    leaves = [torch.tensor(arrays[n], dtype=dt, requires_grad=True) for n in ("q", "k", "v")]
    leaves.append(torch.tensor(arrays["sinks"], dtype=sink_dtype, requires_grad=True))
    kwargs: dict[str, Any] = {n: (torch.tensor(o, dtype=dt) if n == "bias" else torch.from_numpy(o) if isinstance(o, np.ndarray)
                  else o) for n, o in options.items()}
    q, k, v, sinks = leaves
    result = functional.dot_product_attention(q, k, v, sinks=sinks, implementation=path, **kwargs, **extra)
    out, weights = result if isinstance(result, tuple) else (result, None)
    return out, weights, leaves


def as_seen(leaves, options: dict) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and options as the framework saw them (rounded to its dtype), float64."""
    import torch

    seen = {n: t.detach().double().numpy() for n, t in zip(("q", "k", "v", "sinks"), leaves, strict=True)}
    options = dict(options)
    if "bias" in options:
        options["bias"] = torch.tensor(options["bias"], dtype=leaves[0].dtype).double().numpy()
    return seen, options


def assert_close(got, expected, tol) -> float:
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    bound = tol.atol + tol.rtol * (np.abs(expected).max() if tol.normwise else np.abs(expected))
    error = np.abs(got - expected)
    assert np.isfinite(got).all()
    assert (error <= bound).all(), float(error.max())
    return float(error.max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_the_oracle(case: str, path: str, dtype: str) -> None:
    arrays, options = case_inputs(case)
    out, _, leaves = torch_call(arrays, options, dtype, path)
    seen, seen_options = as_seen(leaves, options)
    expected, _ = oracle(seen, seen_options)
    assert out.dtype == leaves[0].dtype
    assert_close(out.detach().double().numpy(), expected, ORACLE[dtype])
    if "kv_lengths" in options:  # example 1 sees no key: zeros
        assert not out[1].detach().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_returned_weights_are_the_key_weights(case: str, dtype: str) -> None:
    """``return_weights``: the key weights only, each row summing to less than 1."""
    arrays, options = case_inputs(case)
    out, weights, leaves = torch_call(arrays, options, dtype, "auto", return_weights=True)
    seen, seen_options = as_seen(leaves, options)
    expected_out, expected_weights = oracle(seen, seen_options)
    assert_close(weights.detach().double().numpy(), expected_weights, ORACLE[dtype])
    assert_close(out.detach().double().numpy(), expected_out, ORACLE[dtype])
    assert (weights.detach().double().sum(-1) < 1.0 + ORACLE[dtype].atol).all()


@pytest.mark.parametrize("path", ("reference", "auto"))
def test_dropout_acts_on_the_key_weights(path: str) -> None:
    arrays, options = case_inputs("causal")
    keep = np.random.default_rng(3).random((B, H, T, S)) > 0.3
    import torch

    out, _, leaves = torch_call(arrays, options, "float32", path, dropout_rate=0.3, training=True,
                                dropout_mask=torch.from_numpy(keep))
    seen, _ = as_seen(leaves, options)
    expected, _ = oracle(seen, options, keep=keep, rate=0.3)
    assert_close(out.detach().numpy(), expected, ORACLE["float32"])


def _float64_grads(arrays: dict[str, np.ndarray], options: dict, d_out: np.ndarray) -> list[np.ndarray]:
    """d sum(out * d_out) / d(q, k, v, sinks) by the float64 reference path."""
    out, _, leaves = torch_call(arrays, options, "float64", "reference")
    import torch

    (out * torch.from_numpy(d_out)).sum().backward()
    return [t.grad.numpy() for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_gradients_match_float64(case: str, path: str, dtype: str) -> None:
    """Gradients w.r.t. q, k, v and the sinks against the float64 reference path (on the
    inputs as the framework saw them); the sinks' also against the oracle's closed form
    d sink_h = -sum_{b,t} p_sink * rowsum(dO * O), p_sink = 1 - rowsum(w)."""
    import torch

    arrays, options = case_inputs(case)
    d_out = np.random.default_rng(5).standard_normal((B, H, T, D))
    out, _, leaves = torch_call(arrays, options, dtype, path)
    (out * torch.tensor(d_out, dtype=out.dtype)).sum().backward()
    seen, seen_options = as_seen(leaves, options)
    expected = _float64_grads(seen, seen_options, d_out)
    for leaf, want in zip(leaves, expected, strict=True):
        assert_close(leaf.grad.double().numpy(), want, GRAD_ORACLE[dtype])
    o, w = oracle(seen, seen_options)
    closed_form = -((1.0 - w.sum(-1)) * (d_out * o).sum(-1)).sum(axis=(0, 2))
    assert_close(expected[3], closed_form, GRAD_ORACLE["float64"])


@pytest.mark.parametrize("path", ("reference", "blockwise"))
@pytest.mark.parametrize("case", ("causal", "gqa", "softcap-bias", "masked-rows", "large-sinks"))
def test_gradcheck_float64(case: str, path: str) -> None:
    """``torch.autograd.gradcheck`` (finite differences) of the output w.r.t. the sinks on
    a small float64 case (q, k and v: ``test_gradients_match_float64``)."""
    import torch

    from torch_attention import functional

    arrays, options = case_inputs(case)
    _, _, (q, k, v, sinks) = torch_call(arrays, options, "float64", path)
    kwargs: dict[str, Any] = {n: torch.from_numpy(o) if isinstance(o, np.ndarray) else o for n, o in options.items()}

    def f(sinks: torch.Tensor) -> torch.Tensor:
        out = functional.dot_product_attention(q.detach(), k.detach(), v.detach(), sinks=sinks, implementation=path,
                                               **kwargs)
        assert isinstance(out, torch.Tensor)
        return out

    assert torch.autograd.gradcheck(f, (sinks.detach().requires_grad_(),))


def test_fused_refuses_sinks_by_name_and_auto_routes_around() -> None:
    import torch

    from torch_attention import functional

    arrays, options = case_inputs("causal")
    q, k, v = (torch.tensor(arrays[n], dtype=torch.float32) for n in ("q", "k", "v"))
    sinks = torch.tensor(arrays["sinks"], dtype=torch.float32)
    with pytest.raises(ValueError, match=re.escape(f"implementation='fused' cannot honour {SINKS_FUSED_BLOCKER}")):
        functional.dot_product_attention(q, k, v, causal=True, sinks=sinks, implementation="fused")
    taken = functional.route(q, k, v, causal=True, sinks=sinks)
    assert taken.path != "fused" and any(SINKS_FUSED_BLOCKER in r for r in taken.reasons), taken
    assert functional.route(q, k, v, causal=True).path == "fused"  # without sinks: the fast path
    with_sinks = functional.dot_product_attention(q, k, v, causal=True, sinks=sinks)
    without = functional.dot_product_attention(q, k, v, causal=True)
    assert isinstance(with_sinks, torch.Tensor) and isinstance(without, torch.Tensor)
    assert float((with_sinks - without).abs().max()) > 1e-2  # honoured, not dropped


def _expected_error(sinks_shape, sinks_dtype: str, normalization: str) -> tuple[type, str]:
    try:
        check_sinks(sinks_shape, sinks_dtype, (B, H, T, D), normalization)
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    raise AssertionError("check_sinks accepted the bad sinks")


@pytest.mark.parametrize(
    "shape,dtype,normalization",
    [((2,), "float32", "softmax"), ((1, H), "float32", "softmax"), ((), "float32", "softmax"),
     ((H,), "int32", "softmax"), ((H,), "bool", "softmax"), ((H,), "float32", "sum")],
    ids=["kv-heads", "2d", "scalar", "int", "bool", "sum"],
)
def test_bad_sinks_raise_check_sinks_errors_before_work(shape, dtype: str, normalization: str) -> None:
    """The shared text of ``check_sinks``, from ``dot_product_attention`` and from ``route``
    (which computes nothing), whatever the path."""
    import torch

    from torch_attention import functional

    arrays, _ = case_inputs("gqa")
    q, k, v = (torch.tensor(arrays[n], dtype=torch.float32) for n in ("q", "k", "v"))
    sinks = torch.zeros(shape, dtype=getattr(torch, dtype))
    kind, text = _expected_error(shape, dtype, normalization)
    for call in (functional.dot_product_attention, functional.route):
        for path in ("reference", "auto", "fused"):
            with pytest.raises(kind, match=re.escape(text)):
                call(q, k, v, sinks=sinks, normalization=normalization, implementation=path)


@pytest.mark.parametrize("path", PATHS)
def test_a_row_with_no_key_and_a_sink_of_minus_inf_is_zeros_with_finite_gradients(path: str) -> None:
    """A sink of -inf is no sink; a query that sees no key then gets a zero row and
    finite gradients (it was 0 / 0 = NaN on the reference path), as the JAX twin and the
    oracle give."""
    import torch

    from parity_tests.reference import attention
    from torch_attention.functional import dot_product_attention

    rng = np.random.default_rng(4)
    q, k, v = (torch.tensor(rng.standard_normal((1, 2, 3, 4)), requires_grad=True) for _ in range(3))
    sinks = torch.tensor([-math.inf, 0.5], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False  # query 1 sees no key
    out = dot_product_attention(q, k, v, mask=mask, sinks=sinks, implementation=path)
    want, _ = attention(*(t.detach().numpy() for t in (q, k, v)), scale=0.5, mask=mask.numpy(),
                        sinks=sinks.detach().numpy())
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    assert not out[0, :, 1].any()
    out.sum().backward()
    assert all(bool(t.grad.isfinite().all()) for t in (q, k, v, sinks))
