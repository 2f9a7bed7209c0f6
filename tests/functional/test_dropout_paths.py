"""Dropout on every implementation path: the rate, the 1/(1 - rate) scaling, and the paths
that must refuse it.

The trick that makes a path without weights show its dropout: with values ``v = I``
(``S == Dv``, ``v[j] = e_j``) the output row equals the attention weight row after
dropout, ``out[..., t, j] = w'[t, j]``.  The clean weights come from the float64 oracle
(``reference.attention``), so every check below is independent of the code under test:

- the fraction of dropped entries (``out == 0`` where the clean weight is positive) is
  within 5 binomial standard deviations of the rate;
- survivors equal ``w / (1 - rate)`` (``ORACLE["float32"]``), blocked entries stay 0;
- the keep pattern differs between (batch, head) slices (one independent draw per weight).

Covered: PyTorch reference, fused (SDPA draws the dropout itself) and auto; JAX reference
and auto (which must fall back to a path that can draw); the explicit paths that cannot
draw (PyTorch blockwise, JAX fused and blockwise) raise ValueError naming the dropout; an
explicit ``dropout_mask`` gives exactly ``keep * w / (1 - rate)`` (and is refused where
the rate is 0, where it would be ignored); the modules in training mode on each path,
configured in the constructor or chosen per call with ``implementation=``.
``test_the_checks_catch_a_halved_sdpa_rate`` proves the checks
have teeth: SDPA handed half the rate fails both the rate and the scaling check.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from parity_tests.reference import attention as oracle
from parity_tests.tolerances import ORACLE
from tests.support import needs_jax, needs_torch

TOL = ORACLE["float32"]
SIGMAS = 5.0
# B * H * T * S = 8192 weights (4224 under a causal mask): 5 sigma of the dropped
# fraction is <= 0.04 at rate 0.5 and <= 0.023 at rate 0.1, so half the rate (or a
# survivor scale of 1/(1 - rate/2)) is far outside either check.
B, H, T, D = 4, 2, 32, 8
S = T  # the identity values need Dv == S
RATES = (0.1, 0.5)


def problem(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (B, H, T, D), k (B, H, S, D), v = I broadcast to (B, H, S, S)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k = rng.standard_normal((B, H, S, D)).astype(np.float32)
    v = np.broadcast_to(np.eye(S, dtype=np.float32), (B, H, S, S)).copy()
    return q, k, v


def clean_weights(q: np.ndarray, k: np.ndarray, *, causal: bool, scale: float | None = None) -> np.ndarray:
    v = np.broadcast_to(np.eye(k.shape[-2]), (*k.shape[:-1], k.shape[-2]))
    _, w = oracle(q, k, v, scale=1 / math.sqrt(q.shape[-1]) if scale is None else scale, causal=causal)
    return w


def check_rate(out: np.ndarray, clean: np.ndarray, rate: float) -> None:
    """The fraction of dropped weights is the rate (binomial, 5 sigma)."""
    allowed = clean > 0
    n = int(allowed.sum())
    dropped = float((out[allowed] == 0).mean())
    bound = SIGMAS * math.sqrt(rate * (1 - rate) / n)
    assert abs(dropped - rate) <= bound, f"dropped {dropped:.4f} of {n} weights, rate {rate} (+-{bound:.4f})"


def check_scaling(out: np.ndarray, clean: np.ndarray, rate: float) -> None:
    """Survivors are w / (1 - rate); blocked weights stay 0; the draw is per element."""
    allowed = clean > 0
    kept = allowed & (out != 0)
    assert kept.any(), "every weight was dropped"
    np.testing.assert_allclose(out[kept], clean[kept] / (1 - rate), rtol=TOL.rtol, atol=TOL.atol)
    assert (out[~allowed] == 0).all(), "a blocked weight survived dropout"
    slices = kept.reshape(-1, *kept.shape[-2:])
    assert any(not np.array_equal(slices[0], s) for s in slices[1:]), "every (batch, head) got the same draw"


def check_dropout(out: np.ndarray, clean: np.ndarray, rate: float) -> None:
    assert out.shape == clean.shape and np.isfinite(out).all()
    check_rate(out, clean, rate)
    check_scaling(out, clean, rate)


# =========================================================================== PyTorch


def torch_dropout(path: str, rate: float, causal: bool, seed: int = 0, **kw: Any) -> np.ndarray:
    import torch

    from torch_attention.functional import dot_product_attention

    q, k, v = (torch.from_numpy(a) for a in problem(seed))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = dot_product_attention(
            q, k, v, causal=causal, dropout_rate=rate, training=True, implementation=path, **kw
        )
    return out.numpy()


@needs_torch
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("path", ["reference", "fused", "auto"])
def test_torch_dropout_rate_and_scaling(path: str, rate: float, causal: bool) -> None:
    q, k, _ = problem()
    check_dropout(torch_dropout(path, rate, causal), clean_weights(q, k, causal=causal), rate)


@needs_torch
def test_torch_dropout_is_drawn_afresh_and_seeded() -> None:
    first, again = torch_dropout("fused", 0.5, False, seed=0), torch_dropout("fused", 0.5, False, seed=0)
    other = torch_dropout("fused", 0.5, False, seed=1)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first == 0, other == 0)


@needs_torch
def test_the_checks_catch_a_halved_sdpa_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plausible mutation: SDPA handed dropout_p = rate / 2.  Both checks must
    fail, on the fused path and on auto (which is SDPA in PyTorch)."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def halved(*args: Any, dropout_p: float = 0.0, **kwargs: Any) -> Any:
        return real(*args, dropout_p=dropout_p / 2, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", halved)
    q, k, _ = problem()
    clean = clean_weights(q, k, causal=False)
    for path in ("fused", "auto"):
        for rate in RATES:
            out = torch_dropout(path, rate, False)
            with pytest.raises(AssertionError, match="dropped"):
                check_rate(out, clean, rate)
            with pytest.raises(AssertionError, match="Not equal to tolerance"):
                check_scaling(out, clean, rate)


@needs_torch
def test_torch_blockwise_refuses_random_dropout() -> None:
    with pytest.raises(ValueError, match="implementation='blockwise'.*dropout"):
        torch_dropout("blockwise", 0.5, False)


@needs_torch
@pytest.mark.parametrize("path", ["reference", "auto"])
def test_torch_explicit_dropout_mask(path: str) -> None:
    rate = 0.25
    q, k, _ = problem()
    keep = np.random.default_rng(7).random((B, H, T, S)) > rate
    import torch

    out = torch_dropout(path, rate, True, dropout_mask=torch.from_numpy(keep))
    want = np.where(keep, clean_weights(q, k, causal=True) / (1 - rate), 0.0)
    np.testing.assert_allclose(out, want, rtol=TOL.rtol, atol=TOL.atol)


@needs_torch
@pytest.mark.parametrize("path", ["fused", "blockwise"])
def test_torch_fast_paths_refuse_a_dropout_mask(path: str) -> None:
    import torch

    keep = torch.ones((B, H, T, S), dtype=torch.bool)
    with pytest.raises(ValueError, match=f"implementation='{path}'.*dropout_mask"):
        torch_dropout(path, 0.25, False, dropout_mask=keep)


# =========================================================================== JAX


def jax_dropout(path: str, rate: float, causal: bool, seed: int = 0, **kw: Any) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    q, k, v = (jnp.asarray(a) for a in problem())
    out = dot_product_attention(
        q, k, v, causal=causal, dropout_rate=rate, deterministic=False, rng=jax.random.key(seed),
        implementation=path, **kw,
    )
    return np.asarray(out)


@needs_jax
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("path", ["reference", "auto"])
def test_jax_dropout_rate_and_scaling(path: str, rate: float, causal: bool) -> None:
    q, k, _ = problem()
    check_dropout(jax_dropout(path, rate, causal), clean_weights(q, k, causal=causal), rate)


@needs_jax
def test_jax_dropout_follows_the_key() -> None:
    first, again = jax_dropout("auto", 0.5, False, seed=0), jax_dropout("auto", 0.5, False, seed=0)
    other = jax_dropout("auto", 0.5, False, seed=1)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first == 0, other == 0)
    # the key's draw is jax.random's of the weights' shape, bit for bit (the library
    # draws it flat, which compiles faster): the same key drops what that mask drops
    import jax

    as_shaped = jax_dropout("reference", 0.5, False, dropout_mask=jax.random.bernoulli(jax.random.key(0), 0.5, (B, H, T, S)))
    np.testing.assert_array_equal(first, as_shaped)


@needs_jax
@pytest.mark.parametrize("path", ["fused", "blockwise"])
def test_jax_fast_paths_refuse_random_dropout(path: str) -> None:
    with pytest.raises(ValueError, match=f"implementation='{path}'.*dropout"):
        jax_dropout(path, 0.5, False)


@needs_jax
@pytest.mark.parametrize("path", ["reference", "auto"])
def test_jax_explicit_dropout_mask(path: str) -> None:
    import jax.numpy as jnp

    rate = 0.25
    q, k, _ = problem()
    keep = np.random.default_rng(7).random((B, H, T, S)) > rate
    out = jax_dropout(path, rate, True, dropout_mask=jnp.asarray(keep))
    want = np.where(keep, clean_weights(q, k, causal=True) / (1 - rate), 0.0)
    np.testing.assert_allclose(out, want, rtol=TOL.rtol, atol=TOL.atol)


@needs_jax
@pytest.mark.parametrize("path", ["fused", "blockwise"])
def test_jax_fast_paths_refuse_a_dropout_mask(path: str) -> None:
    import jax.numpy as jnp

    with pytest.raises(ValueError, match=f"implementation='{path}'.*dropout_mask"):
        jax_dropout(path, 0.25, False, dropout_mask=jnp.ones((B, H, T, S), bool))


# =========================================================================== modules
#
# MultiHeadAttention with out_proj=False, W_value = I and one-hot inputs: head h of token
# s carries e_s as its value, so the merged output is the heads' weights after dropout,
# (B, T, H * T) -> (B, H, T, T).  The clean weights come from the oracle on the module's
# own projections.

M_HEADS, M_SEQ, M_BATCH = 2, 16, 8
M_WIDTH = M_HEADS * M_SEQ  # d_in = d_out, head_dim = M_SEQ
M_RATE = 0.5


def module_inputs() -> np.ndarray:
    """(B, T, H * T): token s is e_s in every head's slice."""
    one_hot = np.tile(np.eye(M_SEQ, dtype=np.float32), (1, M_HEADS))
    return np.broadcast_to(one_hot, (M_BATCH, M_SEQ, M_WIDTH)).copy()


# "constructor": the module is built with the path; "call": it is built with the opposite
# kind of path (blockwise, which cannot draw dropout, for a path that can; reference for
# one that cannot) and the call's ``implementation=`` overrides it, so an ignored
# override fails the test.
HOW = ("constructor", "call")


def configured(path: str, how: str, *, draws: bool) -> str:
    if how == "constructor":
        return path
    return "blockwise" if draws else "reference"


def torch_module(path: str) -> Any:
    import torch

    import torch_attention

    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = torch_attention.MultiHeadAttention(
            M_WIDTH, M_WIDTH, M_SEQ, M_RATE, M_HEADS, out_proj=False, implementation=path
        )
    with torch.no_grad():
        module.W_value.weight.copy_(torch.eye(M_WIDTH))
    return module


def module_clean_weights(state: dict[str, np.ndarray]) -> np.ndarray:
    x = module_inputs().astype(np.float64)

    def heads(t: np.ndarray) -> np.ndarray:  # (B, T, H * Dh) -> (B, H, T, Dh)
        return t.reshape(M_BATCH, M_SEQ, M_HEADS, M_SEQ).transpose(0, 2, 1, 3)

    q, k = heads(x @ state["W_query.weight"].T), heads(x @ state["W_key.weight"].T)
    return clean_weights(q, k, causal=True)


def merged_to_heads(out: np.ndarray) -> np.ndarray:  # (B, T, H * T) -> (B, H, T, T)
    return out.reshape(M_BATCH, M_SEQ, M_HEADS, M_SEQ).transpose(0, 2, 1, 3)


@needs_torch
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("path", ["reference", "fused", "auto"])
def test_torch_module_dropout_in_training_mode(path: str, how: str) -> None:
    import torch

    module = torch_module(configured(path, how, draws=True))
    per_call = {"implementation": path} if how == "call" else {}
    clean = module_clean_weights({k: v.numpy() for k, v in module.state_dict().items()})
    module.train()
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(1)
        out = module(torch.from_numpy(module_inputs()), **per_call).numpy()
    check_dropout(merged_to_heads(out), clean, M_RATE)
    module.eval()
    with torch.no_grad():
        evaluated = merged_to_heads(module(torch.from_numpy(module_inputs()), **per_call).numpy())
    np.testing.assert_allclose(evaluated, clean, rtol=TOL.rtol, atol=TOL.atol)


@needs_torch
@pytest.mark.parametrize("how", HOW)
def test_torch_module_blockwise_refuses_random_dropout(how: str) -> None:
    import torch

    module = torch_module(configured("blockwise", how, draws=False)).train()
    per_call = {"implementation": "blockwise"} if how == "call" else {}
    with pytest.raises(ValueError, match="implementation='blockwise'.*dropout"):
        module(torch.from_numpy(module_inputs()), **per_call)


def flax_module(path: str) -> Any:
    from flax import nnx

    import jax_attention
    from jax_attention.interop import load_torch_state_dict

    module = jax_attention.MultiHeadAttention(
        M_WIDTH, M_WIDTH, M_SEQ, M_RATE, M_HEADS, out_proj=False, implementation=path, rngs=nnx.Rngs(0)
    )
    rng = np.random.default_rng(0)
    bound = 1 / math.sqrt(M_WIDTH)
    state = {
        f"{name}.weight": rng.uniform(-bound, bound, (M_WIDTH, M_WIDTH)).astype(np.float32)
        for name in ("W_query", "W_key")
    }
    state["W_value.weight"] = np.eye(M_WIDTH, dtype=np.float32)
    load_torch_state_dict(module, state)
    return module, state


@needs_jax
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("path", ["reference", "auto"])
def test_flax_module_dropout_in_training_mode(path: str, how: str) -> None:
    import jax.numpy as jnp

    module, state = flax_module(configured(path, how, draws=True))
    per_call = {"implementation": path} if how == "call" else {}
    x = jnp.asarray(module_inputs())
    clean = module_clean_weights(state)
    module.train()
    out = merged_to_heads(np.asarray(module(x, **per_call)))
    check_dropout(out, clean, M_RATE)
    again = merged_to_heads(np.asarray(module(x, **per_call)))
    assert not np.array_equal(out == 0, again == 0), "the module's dropout stream did not advance"
    module.eval()
    evaluated = merged_to_heads(np.asarray(module(x, **per_call)))
    np.testing.assert_allclose(evaluated, clean, rtol=TOL.rtol, atol=TOL.atol)


@needs_jax
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("path", ["fused", "blockwise"])
def test_flax_module_fast_paths_refuse_random_dropout(path: str, how: str) -> None:
    import jax.numpy as jnp

    module, _ = flax_module(configured(path, how, draws=False))
    per_call = {"implementation": path} if how == "call" else {}
    module.train()
    with pytest.raises(ValueError, match=f"implementation='{path}'.*dropout"):
        module(jnp.asarray(module_inputs()), **per_call)


@needs_jax
def test_flax_wrapper_with_a_raw_key_draws_per_head() -> None:
    """A raw key handed to ``MultiHeadAttentionWrapper`` must still give each head its own
    dropout draw."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention

    module = jax_attention.MultiHeadAttentionWrapper(8, 4, T, 0.5, 4, rngs=nnx.Rngs(0))
    module.train()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, T, 8)).astype(np.float32))
    _, weights = module(x, return_weights=True, rngs=jax.random.key(3))
    kept = np.asarray(weights) != 0  # (B, H, T, T)
    for h in range(1, 4):
        assert not np.array_equal(kept[:, 0], kept[:, h]), f"heads 0 and {h} share one dropout mask"


# =========================================================================== rate 0


@needs_torch
@pytest.mark.parametrize("path", ["reference", "fused", "blockwise", "auto"])
def test_torch_dropout_mask_with_rate_zero_is_refused(path: str) -> None:
    """A keep-mask with dropout off would be silently ignored: refused, naming it."""
    import torch

    with pytest.raises(ValueError, match="dropout_mask"):
        torch_dropout(path, 0.0, False, dropout_mask=torch.zeros((B, H, T, S), dtype=torch.bool))


@needs_jax
@pytest.mark.parametrize("path", ["reference", "fused", "blockwise", "auto"])
def test_jax_dropout_mask_with_rate_zero_is_refused(path: str) -> None:
    import jax.numpy as jnp

    with pytest.raises(ValueError, match="dropout_mask"):
        jax_dropout(path, 0.0, False, dropout_mask=jnp.zeros((B, H, T, S), bool))
