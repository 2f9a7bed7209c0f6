"""A cached call that fails after its checks leaves the cache as it was, and float64
decoding runs in JAX (issue 55).

PyTorch writes its cache in place before the attention that reads it, so a call whose
attention raises (a mod that cannot serve the module's heads, a path's failure, here a
failure injected into ``functional.attend``) must put back the fills and every bit of
the keys and values it overwrote; the next call then decodes as though the failed one
had never run, gradients through the steps included.  The Flax twin is functional: a
failed call returns nothing, and the cache and the module's state it was given stay as
they were.  Under ``jax_enable_x64`` the Flax twin's cache write once mixed int64 and
int32 indices and every cached step failed: here float64 decoding equals the whole
sequence and the PyTorch twin to 1e-12.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support import needs_both, needs_torch

D_IN, HEADS, KV_HEADS, MAX_LEN = 8, 4, 2, 12
PROMPT, STEPS = 4, 3


class InjectedError(RuntimeError):
    """The failure put into the attention of a cached call."""


def _fail(*_args: Any, **_kwargs: Any) -> Any:
    raise InjectedError("injected failure in the attention")


def _x(seq: int, seed: int = 1, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, seq, D_IN))


def _bits(t: Any) -> np.ndarray:
    """The bytes of a tensor or array (NaN compared bit for bit)."""
    import torch

    a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return np.ascontiguousarray(a).view(np.uint8)


def _torch_mha(dtype: Any = None, **options: Any) -> Any:
    import torch

    import torch_attention

    torch.manual_seed(0)
    m = torch_attention.MultiHeadAttention(D_IN, D_IN, None, 0.0, HEADS, True, num_kv_heads=KV_HEADS, **options)
    return m.to(dtype or torch.float32).eval()


def _torch_latent() -> Any:
    import torch

    import torch_attention

    torch.manual_seed(0)
    return torch_attention.MultiHeadLatentAttention(d_in=D_IN, num_heads=HEADS, kv_lora_rank=6, qk_nope_head_dim=4,
                                                    qk_rope_head_dim=2, v_head_dim=3).eval()


def _warm_torch_cache(m: Any, padded: bool) -> Any:
    """A cache after a prompt (of unequal valid lengths when ``padded``: fills 4 and 2,
    the padding keys left past the second fill), NaN in every position past the prompt."""
    import torch

    cache = m.init_cache(2, MAX_LEN)
    with torch.no_grad():
        cache.key[:, :, PROMPT:] = float("nan")
        cache.value[:, :, PROMPT:] = float("nan")
    kv_lengths = torch.tensor([PROMPT, 2]) if padded else None
    _, cache = m(torch.from_numpy(_x(PROMPT)).float(), cache=cache, kv_lengths=kv_lengths)
    return cache


# --------------------------------------------------------------------------- PyTorch


@needs_torch
@pytest.mark.parametrize("module", ["mha", "latent"])
@pytest.mark.parametrize("padded", [False, True], ids=["one-fill", "padded-prompt"])
@pytest.mark.parametrize("seq", [1, 3], ids=["token", "chunk"])
def test_a_torch_call_that_fails_in_its_attention_leaves_the_cache_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch, module: str, padded: bool, seq: int) -> None:
    """The failure reaches the caller, and the fills, keys and values (NaN and the
    padding past a fill included) are the bits of before; the next call decodes as
    on a cache that never saw the failed one."""
    import torch

    import torch_attention

    m = _torch_mha() if module == "mha" else _torch_latent()
    cache = _warm_torch_cache(m, padded)
    before = [_bits(t) for t in cache]
    step = torch.from_numpy(_x(seq, seed=2)).float()
    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(torch_attention.functional, "attend", _fail)
        with pytest.raises(InjectedError):
            m(step, cache=cache)
    for old, field in zip(before, cache, strict=True):
        np.testing.assert_array_equal(_bits(field), old)
    # the next call: as on a cache that the failed call never reached
    fresh = _warm_torch_cache(m, padded)
    with torch.no_grad():
        out, cache = m(step, cache=cache)
        want, fresh = m(step, cache=fresh)
    np.testing.assert_array_equal(_bits(out), _bits(want))
    for got, field in zip(cache, fresh, strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(field))


@needs_torch
def test_a_failed_torch_call_under_autograd_leaves_the_gradients_of_the_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding with autograd recording (the writes recorded in place): a failed call
    between the steps is put back, recorded too, so the gradients of the steps' outputs
    with respect to x and every parameter equal those of decoding without it."""
    import torch

    import torch_attention

    def decode(fail: bool) -> list[Any]:
        m = _torch_mha()
        x = torch.from_numpy(_x(PROMPT + STEPS)).float().requires_grad_()
        cache = m.init_cache(2, MAX_LEN)
        outs = [m(x[:, :PROMPT], cache=cache)[0]]
        for t in range(PROMPT, PROMPT + STEPS):
            if fail:
                with monkeypatch.context() as patch, pytest.raises(InjectedError):
                    patch.setattr(torch_attention.functional, "attend", _fail)
                    m(x[:, t : t + 1] * 2, cache=cache)
            outs.append(m(x[:, t : t + 1], cache=cache)[0])
        torch.cat(outs, 1).pow(2).sum().backward()
        assert x.grad is not None
        return [x.grad, *(p.grad for p in m.parameters())]

    for got, want in zip(decode(True), decode(False), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))


@needs_torch
def test_a_library_mod_that_cannot_serve_the_heads_leaves_the_cache() -> None:
    """ALiBi with fewer slopes than heads: whether it is refused before the write or
    fails in the attention, the cache is as it was."""
    import torch

    from attention_spec import mods

    try:
        m = _torch_mha(score_mod=mods.alibi(np.array([0.5, 0.25])))
    except (TypeError, ValueError):
        return  # refused at construction: no cache to write
    cache = m.init_cache(2, MAX_LEN)
    before = [_bits(t) for t in cache]
    with torch.no_grad(), pytest.raises((IndexError, RuntimeError, TypeError, ValueError)):
        m(torch.from_numpy(_x(3)).float(), cache=cache)
    for old, field in zip(before, cache, strict=True):
        np.testing.assert_array_equal(_bits(field), old)


# --------------------------------------------------------------------------- Flax


@needs_both
def test_a_flax_call_that_fails_in_its_attention_changes_neither_cache_nor_module(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Eagerly, a cached call whose attention raises returns nothing: the cache it was
    given (fills 4 and 2, NaN past them) keeps its bits, and the module its state."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention
    from parity_tests import to_flax

    m = to_flax(_torch_mha())
    empty = m.init_cache(2, MAX_LEN)
    filled = np.arange(MAX_LEN) < np.array([[PROMPT], [2]])  # (B, max_len)
    key, value = (jnp.where(filled[:, None, :, None], jnp.asarray(np.random.default_rng(3).standard_normal(t.shape),
                                                                    t.dtype), jnp.nan) for t in empty[:2])
    cache = empty._replace(key=key, value=value, lengths=jnp.asarray([PROMPT, 2], empty.lengths.dtype))

    def module_state() -> list[np.ndarray]:
        return [_bits(t) for t in jax.tree_util.tree_leaves(nnx.state(m))]

    before, state = [_bits(t) for t in cache], module_state()
    with monkeypatch.context() as patch:
        patch.setattr(jax_attention.functional, "attend", _fail)
        with pytest.raises(InjectedError):
            m(jnp.asarray(_x(1, seed=2), jnp.float32), cache=cache)
    for old, field in zip(before, cache, strict=True):
        np.testing.assert_array_equal(_bits(field), old)
    for old, leaf in zip(state, module_state(), strict=True):
        np.testing.assert_array_equal(leaf, old)


# --------------------------------------------------------------------------- float64 decoding in JAX


def _decode(m: Any, x: Any, cache: Any) -> tuple[Any, Any, Any]:
    """x's first PROMPT tokens as a prompt, then the rest one token at a time, and the
    whole of x at once: (the steps' outputs, the whole's, the cache)."""
    import jax.numpy as jnp

    out, cache = m(x[:, :PROMPT], cache=cache)
    outs = [out]
    for t in range(PROMPT, x.shape[1]):
        out, cache = m(x[:, t : t + 1], cache=cache)
        outs.append(out)
    return jnp.concatenate(outs, 1), m(x), cache


@needs_both
# the latent module (the same cache write) with --exhaustive: a jitted decode costs seconds
@pytest.mark.parametrize("module", ["mha", pytest.param("latent", marks=(pytest.mark.slow, pytest.mark.exhaustive))])
def test_float64_decoding_under_x64_equals_the_whole_sequence_and_the_torch_twin(module: str) -> None:
    """With ``jax_enable_x64``, a float64 prompt and then one-token steps decode (once
    eagerly, a step, and then all in one jitted program: eager JAX compiles each
    primitive of a new shape apart): float64 outputs, equal to the whole sequence's
    causal forward in float64 and to the PyTorch twin's float64 decoding, to 1e-12."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from parity_tests import to_flax

    tol = 1e-12
    pt = (_torch_mha() if module == "mha" else _torch_latent()).to(torch.float64)
    x = _x(PROMPT + STEPS)
    with torch.no_grad():
        cache = pt.init_cache(2, MAX_LEN)
        torch_outs = [pt(torch.from_numpy(x[:, :PROMPT]), cache=cache)[0]]
        torch_outs += [pt(torch.from_numpy(x[:, t : t + 1]), cache=cache)[0] for t in range(PROMPT, PROMPT + STEPS)]
    torch_decoded = torch.cat(torch_outs, 1).numpy()
    with jax.enable_x64(True):
        fx = to_flax(pt)
        xs = jnp.asarray(x)
        cache = fx.init_cache(2, MAX_LEN)
        assert cache.key.dtype == jnp.float64
        eager, _ = fx(xs[:, :1], cache=cache)  # one eager step (the write that failed under x64)
        decoded, whole, cache = nnx.jit(_decode)(fx, xs, cache)
        cache.check()
        assert decoded.dtype == whole.dtype == eager.dtype == jnp.float64
        assert np.asarray(cache.lengths).tolist() == [PROMPT + STEPS] * 2
        decoded, whole, eager = (np.asarray(t) for t in (decoded, whole, eager))
    np.testing.assert_allclose(eager, whole[:, :1], rtol=tol, atol=tol)
    np.testing.assert_allclose(decoded, whole, rtol=tol, atol=tol)
    np.testing.assert_allclose(decoded, torch_decoded, rtol=tol, atol=tol)
