"""Numerical edges, in both frameworks, against the float64 loop oracle
(``reference.py``) or against finite differences of it:

* a ``-inf`` bias entry blocks its key as a mask does: weight 0, a row that is ``-inf``
  throughout gets zeros (the fully-masked rows' rule), gradients finite, on every path;
* JAX's blockwise path with fewer queries than its tile over 4096 or more keys (one
  decoding step into a long cache), with a bias, soft-capping, a mask and lengths;
* NumPy scalars where Python numbers are accepted (``window``, ``softcap``, ``scale``).

The rings' huge-logit cases run with the distributed tests (``tests/distributed``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from parity_tests.reference import attention as oracle
from parity_tests.tolerances import ORACLE
from tests.support import needs_both, needs_jax, needs_torch, tiered

FRAMEWORKS = [pytest.param("torch", marks=needs_torch, id="torch"), pytest.param("jax", marks=needs_jax, id="jax")]
PATHS = ("reference", "blockwise", "fused", "auto")
# |<grad, u> - central difference of the oracle| <= GRAD_RTOL * (sum |grad_i u_i| + |difference|):
# float32 autograd against float64 differences (measured <= 3.6e-8 here, 2026-11-25).
GRAD_RTOL = 1e-5
EPS = 1e-6


def lib(fw: str) -> Any:
    if fw == "torch":
        import torch_attention

        return torch_attention
    import jax_attention

    return jax_attention


def run_with_grads(fw: str, arrays: dict[str, np.ndarray], cot: np.ndarray, **options: Any) -> tuple[Any, ...]:
    """out and d sum(out * cot) / d(each of ``arrays``) from float32 inputs, as float64 NumPy
    (JAX under jit)."""
    names = list(arrays)
    if fw == "torch":
        import torch

        leaves = {n: torch.tensor(np.float32(a), requires_grad=True) for n, a in arrays.items()}
        out = lib(fw).dot_product_attention(leaves["q"], leaves["k"], leaves["v"],
                                            **{n: leaves[n] for n in names if n not in ("q", "k", "v")}, **options)
        (out * torch.from_numpy(np.float32(cot))).sum().backward()
        found = [leaves[n].grad for n in names]
        grads = [g.numpy() for g in found if g is not None]
        assert len(grads) == len(names)
        return np.float64(out.detach().numpy()), *(np.float64(g) for g in grads)
    import jax
    import jax.numpy as jnp

    def loss(*values: Any) -> Any:
        given = dict(zip(names, values, strict=True))
        out = lib(fw).dot_product_attention(given["q"], given["k"], given["v"],
                                            **{n: given[n] for n in names if n not in ("q", "k", "v")}, **options)
        return (out * jnp.asarray(np.float32(cot))).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True))(
        *(jnp.asarray(np.float32(a)) for a in arrays.values()))
    return np.float64(out), *(np.float64(g) for g in grads)


def check_directional_derivatives(grads: dict[str, np.ndarray], arrays: dict[str, np.ndarray],
                                  loss: Any, rng: np.random.Generator, frozen: dict[str, np.ndarray]) -> None:
    """<grad, u> against the oracle's central difference along random directions u (zero
    where ``frozen`` is True: -inf bias entries, whose perturbation is meaningless)."""
    for _ in range(3):
        u = {n: np.where(frozen.get(n, False), 0.0, rng.standard_normal(a.shape)) for n, a in arrays.items()}
        plus = loss({n: np.where(frozen.get(n, False), a, a + EPS * u[n]) for n, a in arrays.items()})
        minus = loss({n: np.where(frozen.get(n, False), a, a - EPS * u[n]) for n, a in arrays.items()})
        fd = (plus - minus) / (2 * EPS)
        terms = [np.where(frozen.get(n, False), 0.0, grads[n] * u[n]) for n in arrays]
        ad = sum(float(t.sum()) for t in terms)
        magnitude = sum(float(np.abs(t).sum()) for t in terms)
        assert abs(ad - fd) <= GRAD_RTOL * (magnitude + abs(fd)), (ad, fd)


# --------------------------------------------------------------------------- -inf bias


def _neg_inf_bias_problem(kind: str) -> tuple[dict[str, np.ndarray], np.ndarray, float]:
    rng = np.random.default_rng(24)
    q = rng.standard_normal((2, 2, 4, 3)).astype(np.float32)
    k = rng.standard_normal((2, 2, 5, 3)).astype(np.float32)
    v = rng.standard_normal((2, 2, 5, 2)).astype(np.float32)
    bias = rng.standard_normal((1, 2, 4, 5)).astype(np.float32)  # per head, shared by the batch
    if kind in ("row", "both"):
        bias[0, 0, 1, :] = -np.inf  # head 0, query 1: nothing to attend to
        bias[0, 1, 3, :] = -np.inf
    if kind in ("part", "both"):
        bias[0, 0, 2, 1] = bias[0, 1, 0, 3] = bias[0, 1, 2, 0] = -np.inf
        bias[0, :, :, 4] = -np.inf  # key 4 blocked for every query: its value mixes nothing
    cot = rng.uniform(0.5, 1.5, (2, 2, 4, 2))
    return {"q": q, "k": k, "v": v, "bias": bias}, cot, 1 / math.sqrt(3)


# the fused path refuses softcap (test_bias_softcap.py): "auto" then takes another
PATH_SOFTCAP = [pytest.param((path, softcap), id=f"{path}-{'softcap' if softcap else 'plain'}")
                for path in PATHS for softcap in (None, 2.0) if not (path == "fused" and softcap)]


# pairwise over (framework, path with or without softcap, kind: "both" is a row blocked
# throughout and a key blocked in part); the product with --exhaustive
@pytest.mark.parametrize("fw,path_softcap,kind", tiered("fw,path_softcap,kind", FRAMEWORKS, PATH_SOFTCAP,
                                                        ["both", "row", "part"]))
def test_neg_inf_bias_blocks_its_key_on_every_path(fw: str, path_softcap: tuple[str, float | None], kind: str) -> None:
    """Outputs against the oracle (which blocks a -inf entry as it blocks a masked one),
    zeros for a row that is -inf throughout, and gradients: finite, zero for the -inf
    entries of the bias and the never-seen key's value, and equal to the oracle's central
    differences along random directions."""
    path, softcap = path_softcap
    arrays, cot, scale = _neg_inf_bias_problem(kind)
    out, *grads = run_with_grads(fw, arrays, cot, implementation=path, softcap=softcap)
    options: dict[str, Any] = dict(scale=scale, softcap=softcap)
    want, weights = oracle(*(arrays[n] for n in "qkv"), bias=arrays["bias"], **options)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=ORACLE["float32"].rtol, atol=ORACLE["float32"].atol)
    blocked = np.isneginf(arrays["bias"])
    dead = np.broadcast_to(blocked.all(-1), out.shape[:-1])
    assert (out[dead] == 0).all() and (weights[np.broadcast_to(blocked, weights.shape)] == 0).all()
    named = dict(zip(arrays, grads, strict=True))
    for name, g in named.items():
        assert np.isfinite(g).all(), name
    assert (named["bias"][blocked] == 0).all()
    if kind != "row":
        assert (named["v"][..., 4, :] == 0).all()

    def loss(given: dict[str, np.ndarray]) -> float:
        return float((oracle(*(given[n] for n in "qkv"), bias=given["bias"], **options)[0] * cot).sum())

    check_directional_derivatives(named, {n: np.asarray(a, np.float64) for n, a in arrays.items()}, loss,
                                  np.random.default_rng(7), {"bias": blocked})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_neg_inf_bias_equals_the_mask_it_stands_for(fw: str, path: str) -> None:
    """A -inf bias entry and a False mask entry (with the bias 0 there) give the same
    output, and the weights that ``return_weights`` gives are the mask's (reference path)."""
    arrays, _, _ = _neg_inf_bias_problem("both")
    bias = arrays["bias"]
    mask = ~np.isneginf(bias)
    as_fw = _converter(fw)
    q, k, v = (as_fw(arrays[n]) for n in "qkv")
    by_bias = lib(fw).dot_product_attention(q, k, v, bias=as_fw(bias), implementation=path)
    by_mask = lib(fw).dot_product_attention(q, k, v, bias=as_fw(np.where(mask, bias, 0)), mask=as_fw(mask),
                                            implementation=path)
    np.testing.assert_allclose(np.asarray(_numpy(by_bias)), np.asarray(_numpy(by_mask)), rtol=1e-6, atol=1e-7)
    if path == "reference":
        _, weights = lib(fw).dot_product_attention(q, k, v, bias=as_fw(bias), return_weights=True)
        assert np.isfinite(_numpy(weights)).all()
        assert (_numpy(weights)[np.broadcast_to(~mask, _numpy(weights).shape)] == 0).all()


@pytest.mark.parametrize("with_mask", [False, True], ids=["bias-alone", "bias-and-mask"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_key_hidden_by_a_neg_inf_bias_holds_nan_in_vain(fw: str, path: str, with_mask: bool) -> None:
    """Grouped heads (4 query heads over 2 key/value heads): key 3 is -inf in the bias for
    both query heads of group 0, and its key and value there hold NaN; a row -inf
    throughout and a partly -inf row besides, with or without a mask that hides other
    keys.  As for a masked key, the NaN reaches no output and no gradient: every path
    equals the oracle on the same inputs with that key's k and v set to 0."""
    rng = np.random.default_rng(31)
    q = rng.standard_normal((2, 4, 5, 3)).astype(np.float32)
    k = rng.standard_normal((2, 2, 7, 3)).astype(np.float32)
    v = rng.standard_normal((2, 2, 7, 2)).astype(np.float32)
    bias = rng.standard_normal((1, 4, 5, 7)).astype(np.float32)
    bias[0, :2, :, 3] = -np.inf  # group 0 never sees key 3
    bias[0, 2, 1, :] = -np.inf  # nothing to attend to
    bias[0, 3, 2, :4] = -np.inf
    mask = None
    if with_mask:
        mask = np.ones((2, 1, 5, 7), bool)
        mask[1, 0, :, 5] = False
        mask[0, 0, 4, :] = False
    clean_k, clean_v = k.copy(), v.copy()
    clean_k[:, 0, 3] = clean_v[:, 0, 3] = 0.0
    k[:, 0, 3] = v[:, 0, 3] = np.nan
    as_fw = _converter(fw)
    options: dict[str, Any] = {} if mask is None else {"mask": as_fw(mask)}
    out = _numpy(lib(fw).dot_product_attention(as_fw(q), as_fw(k), as_fw(v), bias=as_fw(bias),
                                               implementation=path, **options))
    # the oracle repeats each key/value head for its group of queries
    want, _ = oracle(q, np.repeat(clean_k, 2, axis=1), np.repeat(clean_v, 2, axis=1), scale=1 / math.sqrt(3),
                     bias=bias, mask=mask)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=ORACLE["float32"].rtol, atol=ORACLE["float32"].atol)


def _converter(fw: str) -> Any:
    if fw == "torch":
        import torch

        return lambda a: torch.from_numpy(np.array(a, copy=True))
    import jax.numpy as jnp

    return jnp.asarray


def _numpy(x: Any) -> np.ndarray:
    return np.asarray(x.detach().numpy() if hasattr(x, "detach") else x, np.float64)


def test_oracle_blocks_a_neg_inf_bias_entry() -> None:
    """The oracle's own rule, by hand: one query, keys with scores 0 and 0, bias (0, -inf):
    all the weight on key 0; bias (-inf, -inf): a zero row."""
    q = np.zeros((1, 1))
    k = np.zeros((2, 1))
    v = np.array([[3.0], [5.0]])
    out, weights = oracle(q, k, v, scale=1.0, bias=np.array([[0.0, -np.inf]]))
    assert out.tolist() == [[3.0]] and weights.tolist() == [[1.0, 0.0]]
    out, weights = oracle(q, k, v, scale=1.0, bias=np.array([[-np.inf, -np.inf]]))
    assert out.tolist() == [[0.0]] and weights.tolist() == [[0.0, 0.0]]


# --------------------------------------------------------------------------- short queries, long keys


LONG = 4096  # the JAX blockwise path walks key tiles in loops from here on


def _long_problem(q_len: int, option: str) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """(float32 q, k, v and, for ``option``, a bias; the call's options; the oracle's)."""
    rng = np.random.default_rng(q_len)
    arrays = {"q": rng.standard_normal((2, 2, q_len, 4)).astype(np.float32),
              "k": rng.standard_normal((2, 1, LONG, 4)).astype(np.float32),
              "v": rng.standard_normal((2, 1, LONG, 3)).astype(np.float32)}
    call: dict[str, Any] = {}
    want: dict[str, Any] = {}
    if option == "bias":
        arrays["bias"] = rng.standard_normal((2, 1, q_len, LONG)).astype(np.float32)
    elif option == "softcap":
        call["softcap"] = want["softcap"] = 0.5
    elif option == "mask":
        mask = rng.random((2, 1, 1, LONG)) < 0.5
        mask[1, ..., :] = False  # example 1 attends to nothing
        call["mask"] = want["mask"] = mask
    elif option == "lengths":
        call["kv_lengths"] = np.array([LONG - 5, 7], np.int32)
        want["mask"] = (np.arange(LONG) < call["kv_lengths"][:, None])[:, None, None, :]
    elif option == "causal":  # bottom-right: the queries are the last of the sequence
        call.update(causal=True, alignment="bottom_right")
        want.update(causal=True, offset=LONG - q_len)
    return arrays, call, want


# the quick tier (``-m "not slow"``) runs one query on the blockwise path
# pairwise over (framework, path, option, query rows); the full product with --exhaustive
@pytest.mark.parametrize("fw,path,option,q_len", tiered(
    "fw,path,option,q_len", FRAMEWORKS, ["blockwise", "auto"], ["plain", "bias", "softcap", "mask", "lengths", "causal"],
    [1, 3]))
def test_few_queries_over_long_keys(fw: str, path: str, option: str, q_len: int) -> None:
    """One (or three) queries over 4096 keys, fewer than a tile's rows: outputs against the
    oracle, gradients against the reference path's (itself checked against the oracle)."""
    arrays, call, want = _long_problem(q_len, option)
    call = {n: _converter(fw)(a) if isinstance(a, np.ndarray) else a for n, a in call.items()}
    cot = np.random.default_rng(1).uniform(0.5, 1.5, (2, 2, q_len, 3))
    out, *grads = run_with_grads(fw, arrays, cot, implementation=path, **call)
    ref_out, *ref_grads = run_with_grads(fw, arrays, cot, implementation="reference", **call)
    q, k, v = (arrays[n] for n in "qkv")
    expected, _ = oracle(q, k, v, scale=0.5, bias=arrays.get("bias"), **want)  # grouped heads: its own
    np.testing.assert_allclose(out, expected, rtol=ORACLE["float32"].rtol, atol=ORACLE["float32"].atol)
    for name, g, ref in zip(arrays, grads, ref_grads, strict=True):
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("path", ["blockwise", "auto"])
@needs_both
def test_decode_one_token_at_a_time_into_a_4096_cache(path: str) -> None:
    """A 5-token prompt, then 3 tokens one at a time, into a cache of max_len 4096: each
    step equals the module's full causal forward, in both twins (the JAX step jitted)."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import torch_attention
    from parity_tests.harness import to_flax

    torch.manual_seed(0)
    tm = torch_attention.MultiHeadAttention(8, 8, None, 0.0, 2, True, causal=True, num_kv_heads=1,
                                            implementation=path).eval()
    fm = to_flax(tm)
    x = np.random.default_rng(3).standard_normal((1, 8, 8)).astype(np.float32)
    with torch.no_grad():
        full = tm(torch.from_numpy(x)).numpy()
        t_cache = tm.init_cache(1, LONG)
        t_outs = [tm(torch.from_numpy(x[:, :5]), cache=t_cache)[0].numpy()]
        for i in range(5, 8):
            t_outs.append(tm(torch.from_numpy(x[:, i : i + 1]), cache=t_cache)[0].numpy())
    step = nnx.jit(lambda m, token, cache: m(token, cache=cache))
    f_cache = fm.init_cache(1, LONG)
    out, f_cache = fm(jnp.asarray(x[:, :5]), cache=f_cache)
    f_outs = [np.asarray(out)]
    for i in range(5, 8):
        out, f_cache = step(fm, jnp.asarray(x[:, i : i + 1]), f_cache)
        f_outs.append(np.asarray(out))
    tol = ORACLE["float32"]
    np.testing.assert_allclose(np.concatenate(t_outs, axis=1), full, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(np.concatenate(f_outs, axis=1), full, rtol=tol.rtol, atol=tol.atol)


# --------------------------------------------------------------------------- NumPy scalars


@pytest.mark.parametrize("path", ["reference", "blockwise", "auto"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_functional_calls_take_numpy_scalars(fw: str, path: str) -> None:
    """``window=(np.int64(2), np.int32(0))``, ``softcap=np.float32(2)`` and
    ``scale=np.float32(.5)`` give what the Python numbers give (and the oracle)."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(3))
    as_fw = _converter(fw)
    numpy_options = dict(window=(np.int64(2), np.int32(0)), softcap=np.float32(2), scale=np.float32(0.5))
    python_options = dict(window=(2, 0), softcap=2.0, scale=0.5)
    got = _numpy(lib(fw).dot_product_attention(*map(as_fw, (q, k, v)), implementation=path, **numpy_options))
    same = _numpy(lib(fw).dot_product_attention(*map(as_fw, (q, k, v)), implementation=path, **python_options))
    np.testing.assert_array_equal(got, same)
    want, _ = oracle(q, k, v, scale=0.5, softcap=2.0, window=(2, 0))
    np.testing.assert_allclose(got, want, rtol=ORACLE["float32"].rtol, atol=ORACLE["float32"].atol)


def _module(fw: str, **options: Any) -> Any:
    if fw == "torch":
        return lib(fw).MultiHeadAttention(4, 4, None, 0.0, 2, **options)
    from flax import nnx

    return lib(fw).MultiHeadAttention(4, 4, None, 0.0, 2, **options, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_module_constructors_take_numpy_scalars(fw: str) -> None:
    """The config normalises them to Python numbers: equal and hashing equal to the config
    of Python numbers, and ``cls(**config)`` rebuilds it."""
    from_numpy = _module(fw, window=(np.int64(2), None), softcap=np.float32(2), scale=np.float32(0.5))
    from_python = _module(fw, window=(2, None), softcap=2.0, scale=0.5)
    assert from_numpy.spec == from_python.spec and hash(from_numpy.spec) == hash(from_python.spec)
    assert from_numpy.config == from_python.config
    config = from_numpy.config
    assert type(config["scale"]) is float and type(config["softcap"]) is float
    assert type(config["window"][0]) is int
    assert _module(fw, **{n: config[n] for n in ("window", "softcap", "scale")}).spec == from_python.spec


BOOL_REFUSALS = [
    ("window", (np.bool_(True), None), TypeError,
     "window must be None or a pair (left, right) of ints >= 0 or None; got (np.True_, None)"),
    ("window", (True, None), TypeError,
     "window must be None or a pair (left, right) of ints >= 0 or None; got (True, None)"),
    ("softcap", np.bool_(True), ValueError, "softcap must be None or a positive finite float; got np.True_"),
    ("softcap", True, ValueError, "softcap must be None or a positive finite float; got True"),
    ("scale", np.bool_(True), TypeError, "scale must be None or a float; got bool np.True_"),
    ("scale", True, TypeError, "scale must be None or a float; got bool True"),
    ("scale", np.float32("nan"), ValueError, "scale must be None or a positive finite number; got nan"),
    ("softcap", np.float64(-1.0), ValueError, "softcap must be None or a positive finite float; got np.float64(-1.0)"),
    ("window", (np.int64(-1), None), ValueError, "window left must be >= 0 or None; got -1"),
]


@pytest.mark.parametrize(("name", "value", "error", "message"), BOOL_REFUSALS,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(BOOL_REFUSALS)])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bools_and_bad_numpy_scalars_are_still_refused(fw: str, name: str, value: Any, error: type,
                                                       message: str) -> None:
    """Both in the functional call and in the constructor, with one text."""
    x = _converter(fw)(np.zeros((1, 3, 4), np.float32))
    with pytest.raises(error, match=re.escape(message)):
        lib(fw).dot_product_attention(x, x, x, **{name: value})
    with pytest.raises(error, match=re.escape(message)):
        _module(fw, **{name: value})
