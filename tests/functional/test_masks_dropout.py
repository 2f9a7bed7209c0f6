"""Mask strategies, fully masked rows, mask helpers, and dropout, in both frameworks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import needs_both, needs_jax, needs_torch

FRAMEWORKS = [pytest.param("torch", marks=needs_torch), pytest.param("jax", marks=needs_jax)]


def qkv(seed=0, shape=(2, 3, 5, 4)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]


def call(fw, q, k, v, **kw):
    """functional.dot_product_attention of one framework; returns NumPy (out, weights)."""
    if fw == "torch":
        import torch

        from torch_attention import functional

        conv = {k_: torch.from_numpy(v_) if isinstance(v_, np.ndarray) else v_ for k_, v_ in kw.items()}
        out, w = functional.dot_product_attention(
            *(torch.from_numpy(a) for a in (q, k, v)), return_weights=True, **conv)
        return out.numpy(), w.numpy()
    import jax.numpy as jnp

    from jax_attention import functional

    conv = {k_: jnp.asarray(v_) if isinstance(v_, np.ndarray) else v_ for k_, v_ in kw.items()}
    out, w = functional.dot_product_attention(*(jnp.asarray(a) for a in (q, k, v)), return_weights=True, **conv)
    return np.asarray(out), np.asarray(w)


def fully_masked_mask(shape=(2, 3, 5, 5), seed=1):
    mask = np.random.default_rng(seed).random(shape) < 0.6
    mask[:, :, 2] = False  # query 2 may attend to nothing
    mask[1, 0] = False  # one whole (batch, head) sees nothing
    return mask


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("causal", [False, True])
def test_mask_strategies_agree(fw, causal):
    q, k, v = qkv()
    mask = fully_masked_mask()
    fill = call(fw, q, k, v, mask=mask, causal=causal, mask_strategy="fill")
    renorm = call(fw, q, k, v, mask=mask, causal=causal, mask_strategy="renormalize")
    np.testing.assert_allclose(fill[0], renorm[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fill[1], renorm[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("strategy", ["fill", "renormalize"])
def test_fully_masked_rows_are_zero_and_other_rows_sum_to_one(fw, strategy):
    q, k, v = qkv()
    mask = fully_masked_mask()
    out, w = call(fw, q, k, v, mask=mask, mask_strategy=strategy)
    dead = ~mask.any(-1)  # (B, H, T)
    assert np.isfinite(out).all() and np.isfinite(w).all()
    assert (out[dead] == 0).all() and (w[dead] == 0).all()
    np.testing.assert_allclose(w.sum(-1)[~dead], 1.0, rtol=1e-6)
    assert (w[~np.broadcast_to(mask, w.shape)] == 0).all()  # nothing leaks through the mask


@needs_torch
@pytest.mark.parametrize("strategy", ["fill", "renormalize"])
def test_fully_masked_rows_have_finite_zero_gradients_torch(strategy):
    import torch

    from torch_attention import functional

    q, k, v = (torch.tensor(a, requires_grad=True) for a in qkv())
    mask = torch.from_numpy(fully_masked_mask())
    out = functional.dot_product_attention(q, k, v, mask=mask, mask_strategy=strategy)
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    dead = ~mask.any(-1)
    assert (q.grad[dead] == 0).all()  # a query that sees nothing gets no gradient
    assert (k.grad[1, 0] == 0).all() and (v.grad[1, 0] == 0).all()


@needs_jax
@pytest.mark.parametrize("strategy", ["fill", "renormalize"])
def test_fully_masked_rows_have_finite_zero_gradients_jax(strategy):
    import jax
    import jax.numpy as jnp

    from jax_attention import functional

    q, k, v = (jnp.asarray(a) for a in qkv())
    mask = fully_masked_mask()

    def loss(q, k, v):
        return jnp.sum(functional.dot_product_attention(
            q, k, v, mask=jnp.asarray(mask), mask_strategy=strategy) ** 2)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    dead = ~mask.any(-1)
    assert (np.asarray(grads[0])[dead] == 0).all()
    assert (np.asarray(grads[1])[1, 0] == 0).all() and (np.asarray(grads[2])[1, 0] == 0).all()


@needs_both
def test_fully_masked_module_rows_agree_between_frameworks():
    import torch

    import torch_attention
    from parity_tests import assert_parity, to_flax

    torch.manual_seed(0)
    module = torch_attention.MultiHeadAttention(8, 8, 5, 0.0, 2).eval()
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    mask = fully_masked_mask((2, 2, 5, 5))
    report = assert_parity(module, to_flax(module), x, mask=mask, weights=True)
    weights = report.torch_results["attention weights"]
    assert (weights[1, 0] == 0).all()


# ------------------------------------------------------------------ mask helpers


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_mask_helpers(fw):
    if fw == "torch":
        import torch

        import torch_attention as lib

        arr = torch.tensor
    else:
        import jax.numpy as jnp

        import jax_attention as lib

        arr = jnp.asarray
    np.testing.assert_array_equal(np.asarray(lib.causal_mask(3)), [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(  # decoding: 2 queries after 2 cached keys
        np.asarray(lib.causal_mask(2, 4, bottom_right=True)), [[1, 1, 1, 0], [1, 1, 1, 1]])
    pad = np.asarray(lib.padding_mask(arr(np.array([1, 3])), 3))
    assert pad.shape == (2, 1, 1, 3)
    np.testing.assert_array_equal(pad[:, 0, 0], [[1, 0, 0], [1, 1, 1]])
    both = np.asarray(lib.combine_masks(lib.causal_mask(3), None, lib.padding_mask(arr(np.array([2])), 3)))
    np.testing.assert_array_equal(both[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 0]])
    assert lib.combine_masks(None) is None
    blocked = arr(np.array([[False, True]]))
    np.testing.assert_array_equal(np.asarray(lib.from_blocked_mask(blocked)), [[True, False]])
    additive = arr(np.array([[0.0, -np.inf, np.finfo(np.float32).min]], dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(lib.from_additive_mask(additive)), [[True, False, False]])


# ------------------------------------------------------------------ dropout


def build(fw, rate, seed=0):
    if fw == "torch":
        import torch

        import torch_attention

        torch.manual_seed(seed)
        return torch_attention.MultiHeadAttention(8, 8, 32, rate, 2)
    from flax import nnx

    import jax_attention

    return jax_attention.MultiHeadAttention(8, 8, 32, rate, 2, rngs=nnx.Rngs(seed))


def run(fw, module, x, **kw):
    if fw == "torch":
        import torch

        kw = {k: torch.from_numpy(v) for k, v in kw.items()}
        out, w = module(torch.from_numpy(x), return_weights=True, **kw)
        return out.detach().numpy(), w.detach().numpy()
    import jax.numpy as jnp

    kw = {k: jnp.asarray(v) for k, v in kw.items()}
    out, w = module(jnp.asarray(x), return_weights=True, **kw)
    return np.asarray(out), np.asarray(w)


def train(fw, module, on):
    if fw == "torch":
        module.train(on)
    else:
        module.train() if on else module.eval()


X = np.random.default_rng(3).standard_normal((2, 32, 8)).astype(np.float32)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_eval_mode_is_exactly_deterministic(fw):
    module = build(fw, 0.5)
    train(fw, module, False)
    a, b = run(fw, module, X), run(fw, module, X)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_rate_zero_is_the_identity(fw):
    module = build(fw, 0.0)
    train(fw, module, True)
    trained = run(fw, module, X)
    train(fw, module, False)
    evaluated = run(fw, module, X)
    assert np.array_equal(trained[0], evaluated[0]) and np.array_equal(trained[1], evaluated[1])


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_training_drops_a_fraction_p_and_scales_survivors(fw, rate):
    module = build(fw, rate)
    train(fw, module, False)
    _, clean = run(fw, module, X)
    train(fw, module, True)
    _, dropped = run(fw, module, X)
    allowed = clean > 0  # causal: the upper triangle is 0 either way
    kept = dropped[allowed] != 0
    n = allowed.sum()  # 2 * 2 * 528 = 2112 weights
    # binomial: |observed - p| within 4 standard deviations
    assert abs((1 - kept.mean()) - rate) < 4 * np.sqrt(rate * (1 - rate) / n)
    np.testing.assert_allclose(dropped[allowed][kept], clean[allowed][kept] / (1 - rate), rtol=1e-6)
    assert (dropped[~allowed] == 0).all()


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_explicit_dropout_mask_matches_the_formula(fw):
    module = build(fw, 0.25)
    train(fw, module, False)
    _, clean = run(fw, module, X)
    train(fw, module, True)
    keep = np.random.default_rng(0).random((2, 2, 32, 32)) > 0.25
    _, dropped = run(fw, module, X, dropout_mask=keep)
    np.testing.assert_allclose(dropped, np.where(keep, clean / 0.75, 0.0), rtol=1e-6, atol=1e-7)
