"""KV-cache decoding and the checks of a module call, in both frameworks.

A refused cached call changes nothing, its cache included, and does no work; a cache
holds floating-point keys and values and never more than ``context_length`` positions;
PyTorch differentiates through several cached steps as JAX does (gradients equal the
full forward's); under ``jit`` a step past ``max_len`` records the error in the cache
and the next eager use raises the eager text (an undonated cache survives it); ``kv_lengths`` may be a list holding traced values; a
context in the wrong dtype is named as the context; batch 0 has correct messages.  The
texts are also cases of the error table (test_errors.py), which checks them identical in
both twins, raised before any work, the module unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from tests.support import needs_jax, needs_torch, tiered

FRAMEWORKS = [pytest.param("torch", marks=needs_torch, id="torch"), pytest.param("flax", marks=needs_jax, id="flax")]
PATHS = ("reference", "fused", "blockwise", "auto")
D_IN = 8


def _x(batch: int = 2, seq: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, seq, D_IN)).astype(np.float32)


def _module(fw: str, context_length: int | None = None, **options: Any) -> Any:
    """Causal MHA, d_in = d_out = 8, 2 heads of 4, dropout 0, eval mode."""
    if fw == "torch":
        import torch

        import torch_attention

        torch.manual_seed(0)
        return torch_attention.MultiHeadAttention(D_IN, D_IN, context_length, 0.0, 2, **options).eval()
    from flax import nnx

    import jax_attention

    return jax_attention.MultiHeadAttention(D_IN, D_IN, context_length, 0.0, 2, **options, rngs=nnx.Rngs(0))


def _array(fw: str, a: np.ndarray) -> Any:
    if fw == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(a))
    import jax.numpy as jnp

    return jnp.asarray(a)


def _np(t: Any) -> np.ndarray:
    return t.detach().numpy() if hasattr(t, "detach") else np.asarray(t)


def _cache_values(cache: Any) -> list[np.ndarray]:
    return [_np(t).copy() for t in cache]


def _error(fn: Any) -> Exception:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the test compares the texts)
        return e
    raise AssertionError("no error raised")


# --------------------------------------------------------------------------- a refused cached call


REFUSALS = [
    pytest.param({}, {"implementation": "fused", "return_weights": True},
                 "implementation='fused' cannot honour return_weights=True", id="fused-weights"),
    pytest.param({}, {"implementation": "blockwise", "return_weights": True},
                 "implementation='blockwise' cannot honour return_weights=True", id="blockwise-weights"),
    pytest.param({"softcap": 5.0}, {"implementation": "fused"},
                 "implementation='fused' cannot honour softcap", id="fused-softcap"),
]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("options,call,text", REFUSALS)
def test_refused_cached_call_writes_nothing_and_does_no_work(
    fw: str, options: dict[str, Any], call: dict[str, Any], text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit path that cannot honour the call is refused before the projections
    run and before the cache is written: the lengths stay 3 (not 4) and the next step
    still equals the full forward."""
    m = _module(fw, **options)
    x = _x()
    cache = m.init_cache(2, 8)
    _, cache = m(_array(fw, x[:, :3]), cache=cache)
    before = _cache_values(cache)
    projected: list[int] = []
    project = type(m)._project
    monkeypatch.setattr(type(m), "_project", lambda *a, **k: projected.append(1) or project(*a, **k))
    with pytest.raises(ValueError, match=re.escape(text)):
        m(_array(fw, x[:, 3:4]), cache=cache, **call)
    assert not projected, "the refused call projected x before refusing it"
    for a, b in zip(before, _cache_values(cache), strict=True):
        np.testing.assert_array_equal(a, b)
    rest, cache = m(_array(fw, x[:, 3:]), cache=cache)
    np.testing.assert_allclose(_np(rest), _np(m(_array(fw, x)))[:, 3:], rtol=1e-5, atol=1e-5)
    assert _np(cache.lengths).tolist() == [6, 6]


# --------------------------------------------------------------------------- the cache's dtype


CACHE_DTYPE_TEXT = "a KV cache must hold floating-point keys and values; got dtype {}"


def _dtype(fw: str, name: str) -> Any:
    if fw == "torch":
        import torch

        return getattr(torch, name)
    import jax.numpy as jnp

    return getattr(jnp, "bool_" if name == "bool" else name)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["int32", "bool", "int64"])
def test_init_cache_refuses_a_dtype_that_is_not_floating(fw: str, dtype: str) -> None:
    """An integer cache truncated keys and values (the output was off by 0.58)."""
    m = _module(fw)
    with pytest.raises(TypeError, match=re.escape(CACHE_DTYPE_TEXT.format(dtype))):
        m.init_cache(2, 8, dtype=_dtype(fw, dtype))
    assert _np(m.init_cache(2, 8, dtype=_dtype(fw, "float32")).key).dtype == np.float32


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_hand_made_integer_cache_is_refused_at_the_call(fw: str) -> None:
    m = _module(fw)
    good = m.init_cache(2, 8)
    lib = type(good)
    bad = lib(*(_array(fw, _np(t).astype(np.int32)) for t in good[:2]), good.lengths)
    with pytest.raises(TypeError, match=re.escape(CACHE_DTYPE_TEXT.format("int32"))):
        m(_array(fw, _x()), cache=bad)


# --------------------------------------------------------------------------- gradients through cached steps


def _torch_grads(m: Any, x: np.ndarray, cot: np.ndarray, path: str, chunks: list[tuple[int, int]] | None) -> Any:
    import torch

    xt = torch.from_numpy(x).requires_grad_()
    if chunks is None:
        out = m(xt, implementation=path)
    else:
        cache, outs = m.init_cache(x.shape[0], x.shape[1]), []
        for a, b in chunks:
            o, cache = m(xt[:, a:b], cache=cache, implementation=path)
            outs.append(o)
        out = torch.cat(outs, dim=1)
    params = dict(m.named_parameters())
    grads = torch.autograd.grad((out * torch.from_numpy(cot)).sum(), [xt, *params.values()])
    return {"x": grads[0].numpy(), **{k: g.numpy() for k, g in zip(params, grads[1:], strict=True)}}


def _flax_grads(m: Any, x: np.ndarray, cot: np.ndarray, path: str, chunks: list[tuple[int, int]] | None) -> Any:
    import jax.numpy as jnp
    from flax import nnx

    def loss(module: Any, xj: Any) -> Any:
        if chunks is None:
            out = module(xj, implementation=path)
        else:
            cache, outs = module.init_cache(x.shape[0], x.shape[1]), []
            for a, b in chunks:
                o, cache = module(xj[:, a:b], cache=cache, implementation=path)
                outs.append(o)
            out = jnp.concatenate(outs, axis=1)
        return (out * jnp.asarray(cot)).sum()

    # "auto" eagerly, as a user's first try runs it (each eager call plans with concrete
    # lengths); every other path under jit: one program, where eagerly every primitive of
    # the steps and of their transposes compiles on its own (about 200 programs, 5-15 s a
    # path), and what an eager call adds, its checks, changes no value.
    grad = nnx.grad(loss, argnums=(0, 1))
    g_module, g_x = (grad if path == "auto" else nnx.jit(grad))(m, jnp.asarray(x))
    flat = {"/".join(map(str, p)): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
            for p, v in nnx.to_flat_state(g_module)}
    return {"x": np.asarray(g_x), **flat}


# each framework on two paths, every path once (auto first: the case of the quick tier);
# the rest with --exhaustive
@pytest.mark.parametrize("path,fw", tiered("path,fw", PATHS[::-1], FRAMEWORKS, strength=1))
def test_backward_through_cached_steps_equals_the_full_forward(fw: str, path: str) -> None:
    """A prompt of 3, one token, a chunk of 2: the gradients of the decoded outputs w.r.t.
    x and every parameter are those of one causal forward (PyTorch raised "modified by
    an inplace operation")."""
    m = _module(fw)
    x, cot = _x(), _x(seed=1)
    grads = _torch_grads if fw == "torch" else _flax_grads
    got = grads(m, x, cot, path, [(0, 3), (3, 4), (4, 6)])
    want = grads(m, x, cot, path, None)
    assert got.keys() == want.keys() and len(got) > 1
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-5, err_msg=name)


@needs_torch
def test_cached_steps_with_grad_still_write_the_callers_cache() -> None:
    """With autograd recording, the cache is still written in place: a caller who keeps
    the cache it passed (as the README's loop does) sees every step."""
    import torch

    m = _module("torch")
    x = torch.from_numpy(_x()).requires_grad_()
    cache = m.init_cache(2, 6)
    m(x[:, :3], cache=cache)
    m(x[:, 3:4], cache=cache)
    out, _ = m(x[:, 4:], cache=cache)
    assert cache.lengths.tolist() == [6, 6]
    np.testing.assert_allclose(out.detach().numpy(), m(x).detach().numpy()[:, 4:], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- a full cache under jit, donated or not


ROOM_TEXT = "the KV cache holds 3 of max_len=4 positions and cannot take 2 more; init_cache with a larger max_len"


@needs_jax
def test_jit_step_past_max_len_records_the_error_and_the_next_eager_use_raises_it() -> None:
    """A compiled step cannot raise without a host round trip: one that runs past max_len
    writes nothing, keeps the fill, returns NaN and records (fill, new) in the cache; the
    next eager use (a call, or ``check()``) raises the eager text exactly, later compiled
    steps on that cache keep the record; the caller's (undonated) cache serves on."""
    import jax
    from flax import nnx

    m = _module("flax")
    x = _array("flax", _x())
    step = nnx.jit(lambda m, token, cache: m(token, cache=cache))
    _, cache = step(m, x[:, :3], m.init_cache(2, 4))
    eager = _error(lambda: m(x[:, 3:5], cache=cache))
    assert isinstance(eager, ValueError) and str(eager) == ROOM_TEXT
    out, failed = jax.block_until_ready(step(m, x[:, 3:5], cache))
    assert np.isnan(np.asarray(out)).all()
    assert np.asarray(failed.lengths).tolist() == [3, 3] and np.asarray(failed.overflow).tolist() == [3, 2]
    for before, after in zip(_cache_values(cache)[:2], _cache_values(failed)[:2], strict=True):
        np.testing.assert_array_equal(after, before)  # nothing written
    for use in (lambda: m(x[:, 3:4], cache=failed), failed.check):
        err = _error(use)
        assert isinstance(err, ValueError) and str(err) == ROOM_TEXT, str(err)
    out, again = step(m, x[:, 3:4], failed)  # fits by itself, but the cache holds the record
    assert np.isnan(np.asarray(out)).all() and np.asarray(again.overflow).tolist() == [3, 2]
    assert np.asarray(again.lengths).tolist() == [3, 3]
    out, cache = step(m, x[:, 3:4], cache.check())
    np.testing.assert_allclose(np.asarray(out), np.asarray(m(x[:, :4]))[:, 3:], rtol=1e-5, atol=1e-5)


@needs_jax
def test_a_donated_cache_comes_back_with_the_record_after_an_overflow() -> None:
    """Donation hands the cache's buffers to the step: the caller's old cache is deleted,
    and the one returned holds the overflow record, which the next eager use raises.
    The docs say so (``__call__`` and ``KVCache``)."""
    import jax
    from flax import nnx

    import jax_attention

    m = _module("flax")
    x = _array("flax", _x())
    step = nnx.jit(lambda m, token, cache: m(token, cache=cache), donate_argnums=2)
    _, cache = step(m, x[:, :3], m.init_cache(2, 4))
    out, failed = jax.block_until_ready(step(m, x[:, 3:5], cache))
    assert all(t.is_deleted() for t in cache)
    assert np.isnan(np.asarray(out)).all() and np.asarray(failed.lengths).tolist() == [3, 3]
    err = _error(lambda: m(x[:, 3:4], cache=failed))
    assert isinstance(err, ValueError) and str(err) == ROOM_TEXT
    doc = " ".join(str(jax_attention.MultiHeadAttention.__call__.__doc__).split())
    assert "donate_argnums" in doc and "overflow" in doc and "check()" in doc
    cache_doc = " ".join(str(jax_attention.functional.KVCache.__doc__).split())
    assert "donate_argnums" in cache_doc and "in place" in cache_doc


# --------------------------------------------------------------------------- kv_lengths as a list of traced values


@needs_jax
def test_kv_lengths_list_holding_traced_values_under_jit() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention

    m = _module("flax")
    x = jnp.asarray(_x())
    want = np.asarray(m(x, kv_lengths=jnp.asarray([3, 5])))
    got = nnx.jit(lambda m, x, n: m(x, kv_lengths=[n, 5]))(m, x, 3)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    got = nnx.jit(lambda m, x, n: m(x, kv_lengths=(n, jnp.int32(5))))(m, x, 3)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    # with a cache: the valid tokens of a padded prompt
    step = nnx.jit(lambda m, x, n, cache: m(x, kv_lengths=[n, 5], cache=cache))
    out, cache = step(m, x[:, :5], 3, m.init_cache(2, 8))
    assert np.asarray(cache.lengths).tolist() == [3, 5]
    # functional, under jax.jit
    q = jnp.asarray(np.random.default_rng(2).standard_normal((2, 2, 4, 4)).astype(np.float32))
    f = jax.jit(lambda q, n: jax_attention.dot_product_attention(q, q, q, kv_lengths=[n, 4]))
    np.testing.assert_allclose(np.asarray(f(q, 2)),
                               np.asarray(jax_attention.dot_product_attention(q, q, q, kv_lengths=[2, 4])),
                               rtol=1e-6, atol=1e-6)
    # a traced float is still refused by dtype
    with pytest.raises(TypeError, match="kv_lengths must hold integers"):
        jax.jit(lambda x, n: m(x, kv_lengths=[n, 5]))(x, 3.0)


# --------------------------------------------------------------------------- the context's dtype


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_context_in_the_wrong_dtype_is_named_as_the_context(fw: str) -> None:
    m = _module(fw)
    context = _array(fw, _x(2, 4).astype(np.float16))
    text = "context key input has dtype float16 but the module computes in float32; cast context key input first"
    with pytest.raises(TypeError, match=re.escape(text)):
        m(_array(fw, _x()), context=context)
    value = "context value input has dtype float16"
    with pytest.raises(TypeError, match=re.escape(value)):
        m(_array(fw, _x()), context=(_array(fw, _x(2, 4)), context))


# --------------------------------------------------------------------------- a cache longer than context_length

CONTEXT_TEXT = (
    "a KV cache of max_len={} does not fit context_length 4: the module attends over at most "
    "context_length positions (a longer sequence is refused, decoded or not)"
)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_cache_never_decodes_past_context_length(fw: str) -> None:
    """context_length=4 refuses a 6-token forward; decoding 6 positions through a cache
    is refused too: init_cache(max_len > 4) and a longer cache made elsewhere, before any
    write; a cache of max_len 4 runs out of room at the 5th position."""
    m = _module(fw, context_length=4)
    x = _array(fw, _x())
    with pytest.raises(ValueError, match=re.escape("sequence length 6 exceeds context_length 4")):
        m(x)
    with pytest.raises(ValueError, match=re.escape(CONTEXT_TEXT.format(8))):
        m.init_cache(2, 8)
    longer = _module(fw).init_cache(2, 8)  # a module without a context_length made it
    with pytest.raises(ValueError, match=re.escape(CONTEXT_TEXT.format(8))):
        m(x[:, :3], cache=longer)
    assert _np(longer.lengths).tolist() == [0, 0]
    _, cache = m(x[:, :3], cache=m.init_cache(2, 4))
    with pytest.raises(ValueError, match=re.escape("holds 3 of max_len=4 positions and cannot take 3 more")):
        m(x[:, 3:], cache=cache)


# --------------------------------------------------------------------------- batch 0


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_batch_zero_takes_an_empty_list_of_lengths(fw: str) -> None:
    m = _module(fw)
    x = _array(fw, np.zeros((0, 3, D_IN), np.float32))
    assert tuple(m(x, kv_lengths=[]).shape) == (0, 3, D_IN)
    assert tuple(m(x, kv_lengths=()).shape) == (0, 3, D_IN)
    with pytest.raises(ValueError, match=re.escape("kv_lengths must be an int or have shape (batch,) = (2,)")):
        m(_array(fw, _x()), kv_lengths=[])


BATCH_ZERO_TEXT = (
    "a call with a cache needs at least one example (init_cache takes batch_size >= 1); "
    "got x of shape (0, 3, 8)"
)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_batch_zero_with_a_cache_names_no_refused_call(fw: str) -> None:
    m = _module(fw)
    x = _array(fw, np.zeros((0, 3, D_IN), np.float32))
    error = _error(lambda: m(x, cache=m.init_cache(2, 4)))
    assert isinstance(error, ValueError) and str(error) == BATCH_ZERO_TEXT
    assert "init_cache(0" not in str(error)
    with pytest.raises(ValueError, match=re.escape("batch_size must be >= 1; got 0")):
        m.init_cache(0, 4)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_fresh_and_a_used_cache_check_as_themselves(fw: str):
    """``cache.check()`` in both twins (code that decodes on either can call it): the
    cache itself, from ``init_cache`` and after an eager step that fits."""
    m = _module(fw)
    cache = m.init_cache(2, 8)
    assert cache.check() is cache
    if fw == "torch":
        import torch

        _, cache = m(torch.from_numpy(_x(seq=3)), cache=cache)
    else:
        import jax.numpy as jnp

        _, cache = m(jnp.asarray(_x(seq=3)), cache=cache)
    assert cache.check() is cache
    assert [int(n) for n in cache.lengths] == [3, 3]
