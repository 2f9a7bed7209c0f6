"""An additive ``bias=`` at call time (with ALiBi) and logit soft-capping (``softcap=``),
in both twins, on every path, against the float64 oracle.

Order everywhere (oracle included): s = scale * q.k; s = softcap * tanh(s / softcap); s += bias;
then the mask.  The fused paths refuse ``softcap`` by name; ``auto`` then takes another path.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from parity_tests import reference
from parity_tests.tolerances import GRAD_PARITY, ORACLE, PARITY
from tests.support import needs_both, needs_jax, needs_torch, tiered

FRAMEWORKS = [pytest.param("torch", marks=needs_torch, id="torch"), pytest.param("jax", marks=needs_jax, id="jax")]
PATHS = ("reference", "blockwise", "fused", "auto")
B, H, T, S, D = 2, 2, 5, 7, 4
CASES = ("none", "mask", "causal", "causal-mask-lengths")


def case_inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k = rng.standard_normal((B, H, S, D)).astype(np.float32)
    v = rng.standard_normal((B, H, S, D)).astype(np.float32)
    bias = rng.standard_normal((1, H, T, S)).astype(np.float32)
    options = {}
    if "mask" in case:
        mask = rng.random((B, 1, T, S)) > 0.3
        mask[0, 0, 1] = False  # a fully masked row
        options["mask"] = mask
    if "causal" in case:
        options["causal"] = True
    if "lengths" in case:
        options["kv_lengths"] = [3, S]
    return q, k, v, bias, options


def oracle_mask(options):
    allowed = np.ones((B, 1, T, S), dtype=bool)
    if "mask" in options:
        allowed = allowed & options["mask"]
    if "kv_lengths" in options:
        allowed = allowed & (np.arange(S)[None, :] < np.asarray(options["kv_lengths"])[:, None])[:, None, None, :]
    return allowed


def call(fw, q, k, v, bias, options, implementation, softcap=None):
    """(out, grads of sum(out * c) w.r.t. q, k, v, bias) as NumPy, bias may be None."""
    c = np.random.default_rng(9).uniform(0.5, 1.5, (B, H, T, D))
    if fw == "torch":
        import torch

        from torch_attention import functional

        arrays = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
        tb = None if bias is None else torch.tensor(bias, requires_grad=True)
        conv = {n: torch.from_numpy(o) if isinstance(o, np.ndarray) else o for n, o in options.items()}
        out = functional.dot_product_attention(*arrays, bias=tb, softcap=softcap, implementation=implementation,
                                               **conv)
        (out * torch.from_numpy(c.astype(np.float32))).sum().backward()
        grads = [a.grad.numpy() for a in arrays] + ([] if tb is None else [tb.grad.numpy()])
        return out.detach().numpy(), grads
    import jax
    import jax.numpy as jnp

    from jax_attention import functional

    conv = {n: jnp.asarray(o) if isinstance(o, np.ndarray) else o for n, o in options.items()}

    def loss(q_, k_, v_, b_):
        out = functional.dot_product_attention(q_, k_, v_, bias=b_, softcap=softcap,
                                               implementation=implementation, **conv)
        return jnp.sum(out * jnp.asarray(c, jnp.float32)), out

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    args = [jnp.asarray(a) for a in (q, k, v)] + [None if bias is None else jnp.asarray(bias)]
    (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*args)
    return np.asarray(out), [np.asarray(g) for g in grads]


def assert_close(got, expected, tol):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    bound = tol.atol + tol.rtol * (np.abs(expected).max() if tol.normwise else np.abs(expected))
    assert np.isfinite(got).all()
    assert (np.abs(got - expected) <= bound).all(), float(np.abs(got - expected).max())


def oracle(q, k, v, bias, options, softcap=None):
    out, _ = reference.attention(q, k, v, scale=1 / math.sqrt(D), mask=oracle_mask(options),
                                 causal=bool(options.get("causal")), bias=bias, softcap=softcap)
    return out


def oracle_bias_grad(q, k, v, bias, options, softcap=None, h=1e-6):
    """d sum(out * c) / d bias by central differences of the float64 oracle."""
    c = np.random.default_rng(9).uniform(0.5, 1.5, (B, H, T, D))
    bias = bias.astype(np.float64)
    grad = np.zeros_like(bias)
    for idx in np.ndindex(*bias.shape):
        up, down = bias.copy(), bias.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (np.sum(oracle(q, k, v, up, options, softcap) * c)
                     - np.sum(oracle(q, k, v, down, options, softcap) * c)) / (2 * h)
    return grad


def torch_float64_grads(q, k, v, bias, options, softcap=None):
    """Gradients w.r.t. q, k, v of the float64 reference path (the oracle's twin in autograd)."""
    import torch

    from torch_attention import functional

    c = np.random.default_rng(9).uniform(0.5, 1.5, (B, H, T, D))
    arrays = [torch.tensor(a.astype(np.float64), requires_grad=True) for a in (q, k, v)]
    conv = {n: torch.from_numpy(o) if isinstance(o, np.ndarray) else o for n, o in options.items()}
    out = functional.dot_product_attention(*arrays, bias=torch.tensor(bias, dtype=torch.float64), softcap=softcap,
                                           implementation="reference", **conv)
    (out * torch.from_numpy(c)).sum().backward()
    return [a.grad.numpy() for a in arrays]


# Every pair of case, cap and framework by default (8 of the 16; the rest with
# --exhaustive); each case runs on every path.
@pytest.mark.parametrize(("case", "softcap", "fw"), tiered(
    "case,softcap,fw", CASES, [pytest.param(None, id="nocap"), pytest.param(2.0, id="cap2")], FRAMEWORKS))
def test_every_path_matches_the_oracle(fw, case, softcap):
    q, k, v, bias, options = case_inputs(case)
    expected = oracle(q, k, v, bias, options, softcap)
    expected_bias_grad = oracle_bias_grad(q, k, v, bias, options, softcap)
    without_bias = oracle(q, k, v, None, options, softcap)
    assert np.abs(expected - without_bias).max() > 1e-2  # the bias matters in this case
    for path in PATHS:
        if softcap is not None and path == "fused":
            continue  # refused by name: test_fused_refuses_softcap_by_name
        out, grads = call(fw, q, k, v, bias, options, path, softcap)
        assert_close(out, expected, ORACLE["float32"])
        assert_close(grads[3], expected_bias_grad, GRAD_PARITY["float32"])


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("shape", [(1, 1, T, S), (T, S)], ids=["1x1xTxS", "TxS"])
def test_a_bias_shared_by_every_slice(fw, shape):
    """One bias for every (batch, head) slice: its gradient sums over all of them (the
    blockwise path sums it in a scan's carry, or over vectorised single-block slices)."""
    q, k, v, _, options = case_inputs("causal-mask-lengths", seed=3)
    bias = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    expected = oracle(q, k, v, bias, options)
    expected_bias_grad = oracle_bias_grad(q, k, v, bias, options)
    for path in PATHS:
        out, grads = call(fw, q, k, v, bias, options, path)
        assert grads[3].shape == shape
        assert_close(out, expected, ORACLE["float32"])
        assert_close(grads[3], expected_bias_grad, GRAD_PARITY["float32"])


@needs_torch
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("case", ["mask", "causal-mask-lengths"])
def test_gradients_wrt_qkv_match_float64(fw, case):
    q, k, v, bias, options = case_inputs(case, seed=1)
    for softcap in (None, 3.0):
        expected = torch_float64_grads(q, k, v, bias, options, softcap)
        for path in PATHS:
            if softcap is not None and path == "fused":
                continue
            _, grads = call(fw, q, k, v, bias, options, path, softcap)
            for g, e in zip(grads[:3], expected, strict=True):
                assert_close(g, e, GRAD_PARITY["float32"])


@needs_both
@pytest.mark.parametrize("case", CASES)
def test_twins_agree(case):
    q, k, v, bias, options = case_inputs(case, seed=2)
    for path in PATHS:
        for softcap in (None, 1.5):
            if softcap is not None and path == "fused":
                continue
            t_out, t_grads = call("torch", q, k, v, bias, options, path, softcap)
            j_out, j_grads = call("jax", q, k, v, bias, options, path, softcap)
            assert_close(j_out, t_out, PARITY["float32"])
            for a, b in zip(j_grads, t_grads, strict=True):
                assert_close(a, b, GRAD_PARITY["float32"])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_fused_refuses_softcap_by_name(fw):
    q, k, v, bias, options = case_inputs("mask")
    with pytest.raises(ValueError, match=re.escape("implementation='fused' cannot honour softcap")):
        call(fw, q, k, v, None, options, "fused", softcap=2.0)
    # auto never drops it: it equals the reference path with the cap, not the uncapped result
    capped, _ = call(fw, q * 4, k * 4, v, None, options, "auto", softcap=0.5)
    reference_capped, _ = call(fw, q * 4, k * 4, v, None, options, "reference", softcap=0.5)
    uncapped, _ = call(fw, q * 4, k * 4, v, None, options, "reference")
    assert_close(capped, reference_capped, PARITY["float32"])
    assert np.abs(capped - uncapped).max() > 1e-2


@needs_both
@pytest.mark.parametrize(
    "options,error",
    [
        ({"bias": np.zeros((1, H, T, S), dtype=np.int32)}, TypeError),
        ({"bias": np.zeros((1, H, T, S), dtype=bool)}, TypeError),
        ({"bias": np.zeros((3, H, T, S), dtype=np.float32)}, ValueError),
        ({"bias": np.zeros((T, S + 1), dtype=np.float32)}, ValueError),
        ({"softcap": 0.0}, ValueError),
        ({"softcap": -1.0}, ValueError),
        ({"softcap": math.inf}, ValueError),
        ({"softcap": math.nan}, ValueError),
        ({"softcap": True}, ValueError),
        ({"softcap": "2"}, ValueError),
    ],
    ids=["int-bias", "bool-bias", "batch-3", "width", "cap-0", "cap-neg", "cap-inf", "cap-nan", "cap-bool",
         "cap-str"],
)
def test_validation_same_text_in_both(options, error):
    import jax.numpy as jnp
    import torch

    from jax_attention import functional as jf
    from torch_attention import functional as tf

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, H, T, D), (B, H, S, D), (B, H, S, D)))
    messages = []
    for f, conv in ((tf, torch.from_numpy), (jf, jnp.asarray)):
        kw = {n: conv(o) if isinstance(o, np.ndarray) else o for n, o in options.items()}
        with pytest.raises(error) as info:
            f.dot_product_attention(conv(q), conv(k), conv(v), **kw)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert ("bias" in messages[0]) or ("softcap" in messages[0])
    if "bias" in options and error is ValueError:
        assert str(tuple(options["bias"].shape)) in messages[0] and str((B, H, T, S)) in messages[0]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("path", PATHS)
def test_padded_keys_never_influence_anything(fw, path):
    """A key blocked for every query: NaN stored there, any bias there, changes nothing,
    and the bias gradient there is 0."""
    q, k, v, bias, options = case_inputs("none", seed=3)
    bias = np.broadcast_to(bias, (B, H, T, S)).copy()  # one bias per example
    options = {"kv_lengths": [4, S]}
    out, _ = call(fw, q, k, v, bias, options, path)
    k2, v2, bias2 = k.copy(), v.copy(), bias.copy()
    k2[0, :, 4:] = np.nan
    v2[0, :, 4:] = np.inf
    bias2[0, ..., 4:] = 1e4
    out2, grads2 = call(fw, q, k2, v2, bias2, options, path)
    np.testing.assert_array_equal(out2, out)
    assert (grads2[3][0, ..., 4:] == 0).all()
    assert np.abs(grads2[3][1, ..., 4:]).max() > 0  # example 1 sees those keys
    for g in grads2:
        assert np.isfinite(g).all()


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_alibi_numbers(fw):
    if fw == "torch":
        from torch_attention import alibi_bias

        def get(*a):
            return alibi_bias(*a).numpy()
    else:
        from jax_attention import alibi_bias

        def get(*a):
            return np.asarray(alibi_bias(*a))
    eight = get(8, 3, 4)
    assert eight.shape == (1, 8, 3, 4) and eight.dtype == np.float32
    slopes = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625]  # 2^(-8 i / 8)
    np.testing.assert_array_equal(eight[0, :, 0, 1], slopes)  # key 1, query 0: distance +1
    np.testing.assert_array_equal(eight[0, 0, 2], [-1.0, -0.5, 0.0, 0.5])  # query 2: distances -2..1
    np.testing.assert_array_equal(eight[0, 7, 1], [-0.00390625, 0.0, 0.00390625, 0.0078125])
    # 6 heads, not a power of two: the 4-head slopes, then every other 8-head slope
    six = get(6, 2, 2)
    np.testing.assert_array_equal(six[0, :, 1, 0], [-0.25, -0.0625, -0.015625, -0.00390625, -0.5, -0.125])
    np.testing.assert_array_equal(get(1, 1, 1), [[[[0.0]]]])
    np.testing.assert_array_equal(get(2, 2, 2)[0, :, 1, 0], [-1 / 16, -1 / 256])
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        get(0, 2, 2)


@needs_both
def test_alibi_twins_equal():
    import jax_attention
    import torch_attention

    np.testing.assert_array_equal(torch_attention.alibi_bias(12, 5, 9).numpy(),
                                  np.asarray(jax_attention.alibi_bias(12, 5, 9)))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_softcap_bounds_and_vanishes(fw):
    q, k, v, _, options = case_inputs("none", seed=4)
    q, k = q * 10, k * 10  # logits in the hundreds
    for cap in (0.5, 2.0):
        if fw == "torch":
            import torch

            from torch_attention import functional

            _, w = functional.dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)), softcap=cap,
                                                    return_weights=True)
            w = w.numpy()
        else:
            import jax.numpy as jnp

            from jax_attention import functional

            _, w = functional.dot_product_attention(*(jnp.asarray(a) for a in (q, k, v)), softcap=cap,
                                                    return_weights=True)
            w = np.asarray(w)
        # every capped score lies in (-cap, cap): no weight is more than e^(2 cap) times another
        ratio = w.max(-1) / w.min(-1)
        assert (ratio <= math.exp(2 * cap) * (1 + 1e-5)).all()
        assert ratio.max() > math.exp(2 * cap) * 0.5  # and the bound is nearly reached
    big, _ = call(fw, q, k, v, None, {}, "blockwise", softcap=1e7)
    plain, _ = call(fw, q, k, v, None, {}, "blockwise")
    assert_close(big, plain, ORACLE["float32"])


@needs_both
@pytest.mark.parametrize("cls", ["MultiHeadAttention", "MultiHeadAttentionWrapper", "CausalAttention"])
def test_modules_take_bias_and_softcap(cls):
    import jax.numpy as jnp
    import torch

    import torch_attention
    from parity_tests.harness import to_flax

    heads = 1 if cls == "CausalAttention" else 2
    config = {"d_in": 6, "d_out": 4, "context_length": 8, "dropout": 0.0, "softcap": 1.5}
    if heads > 1:
        config["num_heads"] = heads
    torch.manual_seed(0)
    module = getattr(torch_attention, cls)(**config).eval()
    assert module.spec.softcap == 1.5 and module.config["softcap"] == 1.5
    flax_module = to_flax(module)
    assert flax_module.spec.softcap == 1.5
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 5, 6)).astype(np.float32) * 3
    bias = rng.standard_normal((1, heads, 5, 5)).astype(np.float32)
    params = {n: p.detach().numpy() for n, p in module.state_dict().items()}
    expected, _ = reference.forward(cls, config, params, x, bias=bias)
    for path in ("reference", "blockwise", "auto"):
        t_out = module(torch.from_numpy(x), bias=torch.from_numpy(bias), implementation=path).detach().numpy()
        j_out = np.asarray(flax_module(jnp.asarray(x), bias=jnp.asarray(bias), implementation=path))
        assert_close(t_out, expected, ORACLE["float32"])
        assert_close(j_out, expected, ORACLE["float32"])
    no_bias, _ = reference.forward(cls, config, params, x)
    assert np.abs(no_bias - expected).max() > 1e-3
    with pytest.raises(ValueError, match="cannot honour softcap"):
        module(torch.from_numpy(x), implementation="fused")
    with pytest.raises(ValueError, match="cannot honour softcap"):
        flax_module(jnp.asarray(x), implementation="fused")
    messages = []
    for m, conv in ((module, torch.from_numpy), (flax_module, jnp.asarray)):
        with pytest.raises(ValueError) as info:
            m(conv(x), bias=conv(np.zeros((3, heads, 5, 5), np.float32)))
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "bias of shape" in messages[0]
    with pytest.raises(ValueError, match="softcap must be None or a positive finite float"):
        getattr(torch_attention, cls)(**{**config, "softcap": -1.0})


@needs_both
def test_module_bias_fused_without_softcap():
    """Without softcap the fused path takes the bias in both twins (SDPA's float mask,
    jax.nn.dot_product_attention's bias), with the gradient w.r.t. the bias."""
    import jax
    import jax.numpy as jnp
    import torch

    import torch_attention
    from parity_tests.harness import to_flax

    config = {"d_in": 6, "d_out": 4, "context_length": 8, "dropout": 0.0, "num_heads": 2}
    torch.manual_seed(0)
    module = torch_attention.MultiHeadAttention(**config).eval()
    flax_module = to_flax(module)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 5, 6)).astype(np.float32)
    bias = rng.standard_normal((2, 1, 5, 5)).astype(np.float32)
    params = {n: p.detach().numpy() for n, p in module.state_dict().items()}
    expected, _ = reference.forward("MultiHeadAttention", config, params, x, bias=bias)
    tb = torch.tensor(bias, requires_grad=True)
    t_out = module(torch.from_numpy(x), bias=tb, implementation="fused")
    t_out.sum().backward()
    j_grad = jax.grad(lambda b: flax_module(jnp.asarray(x), bias=b, implementation="fused").sum())(jnp.asarray(bias))
    assert_close(t_out.detach().numpy(), expected, ORACLE["float32"])
    assert_close(np.asarray(flax_module(jnp.asarray(x), bias=jnp.asarray(bias), implementation="fused")), expected,
                 ORACLE["float32"])
    assert_close(np.asarray(j_grad), tb.grad.numpy(), GRAD_PARITY["float32"])
    assert np.abs(tb.grad.numpy()).max() > 0


@needs_both
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_bias_added_in_float32(dtype):
    import jax.numpy as jnp
    import torch

    from jax_attention import functional as jf
    from torch_attention import functional as tf

    q, k, v, bias, options = case_inputs("causal", seed=7)
    expected = oracle(q, k, v, bias, options, 2.0)
    for path in ("reference", "blockwise"):
        t = tf.dot_product_attention(*(torch.from_numpy(a).to(getattr(torch, dtype)) for a in (q, k, v)),
                                     bias=torch.from_numpy(bias).to(getattr(torch, dtype)), softcap=2.0,
                                     implementation=path, **options)
        j = jf.dot_product_attention(*(jnp.asarray(a, dtype) for a in (q, k, v)), bias=jnp.asarray(bias, dtype),
                                     softcap=2.0, implementation=path, **options)
        assert t.dtype == getattr(torch, dtype) and j.dtype == jnp.dtype(dtype)
        # the bias itself is rounded to half precision once; the oracle gets that rounded bias
        rounded = np.asarray(jnp.asarray(bias, dtype), np.float32)
        expected = oracle(q, k, v, rounded, options, 2.0)
        assert_close(t.float().numpy(), expected, ORACLE[dtype])
        assert_close(np.asarray(j, np.float32), expected, ORACLE[dtype])
