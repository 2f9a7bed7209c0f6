"""PyTorch's decode step: its checks made once per cache, every one still kept, and its
attention over the filled part of the cache only.

A cached call with nothing but x reuses the plan of the last such call whose module, x
and cache had the same shapes, dtypes and config (``AttentionModule._prepare``); these
tests take a module through several such steps first, then give it a bad call, and
expect the error of a fresh module (the same type and text), before any work, the cache
unchanged.  The steps themselves equal the full causal forward and the float64 oracle on
every path, with NaN stored in the unfilled part of a large cache, and each step's
attention reads keys [0, fill), not max_len.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from parity_tests import reference
from parity_tests.tolerances import ORACLE
from tests.support import needs_torch

pytestmark = needs_torch

D_IN, HEADS, KV_HEADS = 8, 4, 2
PROMPT, STEPS, MAX_LEN = 5, 6, 64


def _module(dropout: float = 0.0, **options: Any) -> Any:
    import torch

    import torch_attention

    torch.manual_seed(0)
    return torch_attention.MultiHeadAttention(D_IN, D_IN, None, dropout, HEADS, True, num_kv_heads=KV_HEADS,
                                              **options).eval()


def _x(batch: int = 2, seq: int = PROMPT + STEPS, dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((batch, seq, D_IN)).astype(dtype)


def _decoded(m: Any, cache: Any, x: np.ndarray) -> Any:
    """x's first PROMPT tokens as a prompt, then the rest one at a time: the outputs, (B, T, d_out)."""
    import torch

    with torch.no_grad():
        first, cache = m(torch.from_numpy(x[:, :PROMPT]), cache=cache)
        outs = [first]
        for i in range(PROMPT, x.shape[1]):
            out, cache = m(torch.from_numpy(x[:, i : i + 1]), cache=cache)
            outs.append(out)
    return torch.cat(outs, 1)


def _oracle(m: Any, x: np.ndarray) -> np.ndarray:
    """The module's causal forward in float64 from its state dict (grouped heads repeated)."""
    state = {k: v.double().numpy() for k, v in m.state_dict().items()}

    def linear(name: str, t: np.ndarray) -> np.ndarray:
        return t.astype(np.float64) @ state[f"{name}.weight"].T + state[f"{name}.bias"]

    def heads(t: np.ndarray, n: int) -> np.ndarray:
        return t.reshape(t.shape[0], t.shape[1], n, -1).transpose(0, 2, 1, 3)

    q = heads(linear("W_query", x), HEADS)
    k, v = (np.repeat(heads(linear(n, x), KV_HEADS), HEADS // KV_HEADS, axis=1) for n in ("W_key", "W_value"))
    out, _ = reference.attention(q, k, v, scale=1.0 / np.sqrt(q.shape[-1]), causal=True)
    return linear("out_proj", out.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("path", ["reference", "fused", "blockwise", "auto"])
def test_steps_equal_the_full_forward_and_the_oracle_past_nan_in_the_unfilled_cache(path: str, dtype: str) -> None:
    """NaN written into every position of a 64-long cache beyond the prompt: each step
    overwrites its own position and attends over [0, fill), so no NaN reaches an output
    (float64 takes its own paths: "fused" refuses it, so it runs on "auto" there)."""
    import torch

    if dtype == "float64" and path == "fused":
        path = "auto"
    m = _module(implementation=path).to(getattr(torch, dtype))
    x = _x(dtype=np.dtype(dtype).type)
    cache = m.init_cache(2, MAX_LEN)
    cache.key[:, :, PROMPT:] = float("nan")
    cache.value[:, :, PROMPT:] = float("nan")
    got = _decoded(m, cache, x).numpy()
    with torch.no_grad():
        full = m(torch.from_numpy(x)).numpy()
    tol = ORACLE[dtype]
    np.testing.assert_allclose(got, full, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(got, _oracle(m, x), rtol=tol.rtol, atol=tol.atol)
    assert cache.lengths.tolist() == [PROMPT + STEPS] * 2


def test_a_step_attends_over_the_filled_part_of_the_cache_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every single-token step hands SDPA keys and values of its fill, not max_len."""
    import torch.nn.functional as F

    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        seen.append(k.shape[-2])
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    m = _module(implementation="fused")
    _decoded(m, m.init_cache(2, 4096), _x())
    assert seen == list(range(PROMPT, PROMPT + STEPS + 1))


# ----------------------------------------------------------------------------- every check kept


def _error(fn: Callable[[], Any]) -> Exception:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return e
    raise AssertionError("no error raised")


def _warm(m: Any, batch: int = 2, max_len: int = 8) -> Any:
    """A cache of ``max_len`` after a prompt of 3 and two single-token steps (the plan
    kept).  Made by another module, it gives a module its first cached call: every check
    run in full."""
    import torch

    cache = m.init_cache(batch, max_len)
    x = torch.from_numpy(_x(batch))
    with torch.no_grad():
        _, cache = m(x[:, :3], cache=cache)
        for i in (3, 4):
            _, cache = m(x[:, i : i + 1], cache=cache)
    return cache


def _token(batch: int = 2, width: int = D_IN, dtype: Any = None) -> Any:
    import torch

    t = torch.from_numpy(_x(batch, 1)[:, :, :width] if width <= D_IN else np.ones((batch, 1, width), np.float32))
    return t if dtype is None else t.to(dtype)


def _bad_calls() -> list[Any]:
    """(call(module, cache), the cache's max_len): a bad call after warm steps, on the
    same module and cache."""
    import torch

    def int_cache(m: Any, c: Any) -> Any:
        return type(c)(c.key.to(torch.int32), c.value.to(torch.int32), c.lengths)

    return [
        pytest.param(lambda m, c: m(_token(), cache=c), 5, id="past-max-len"),
        pytest.param(lambda m, c: m(torch.from_numpy(_x(2, 4)), cache=c), 8, id="chunk-past-max-len"),
        pytest.param(lambda m, c: m(_token(dtype=torch.float64), cache=c), 8, id="x-float64"),
        pytest.param(lambda m, c: m(_token(width=D_IN + 1), cache=c), 8, id="x-width"),
        pytest.param(lambda m, c: m(_token(batch=3), cache=c), 8, id="x-batch"),
        pytest.param(lambda m, c: m(_token()[0], cache=c), 8, id="x-unbatched"),
        pytest.param(lambda m, c: m(_token(), cache=int_cache(m, c)), 8, id="cache-int32"),
        pytest.param(lambda m, c: m(_token(), cache=(c.key, c.value, c.lengths)), 8, id="cache-plain-tuple"),
        pytest.param(lambda m, c: m(_token(), cache=type(c)(c.key[:, :1], c.value[:, :1], c.lengths)),
                     8, id="cache-kv-heads"),
        pytest.param(lambda m, c: m(_token(), cache=c, implementation="fused", return_weights=True),
                     8, id="fused-weights"),
        pytest.param(lambda m, c: m(_token(), cache=c, implementation="nope"), 8, id="implementation"),
        pytest.param(lambda m, c: m.double()(_token(), cache=c), 8, id="module-float64"),
    ]


@pytest.mark.parametrize("call,max_len", _bad_calls())
def test_a_bad_call_after_kept_steps_raises_as_on_a_fresh_module_and_writes_nothing(
    call: Callable[[Any, Any], Any], max_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same error type and text as a fresh module's, raised before the projections,
    the caller's cache unchanged (past-max-len: the warm steps filled a cache of 5)."""
    import torch

    with torch.no_grad():
        fresh = _error(lambda: call(_module(), _warm(_module(), max_len=max_len)))
        m = _module()
        cache = _warm(m, max_len=max_len)
        assert "_checked_step" in vars(m), "the warm steps kept no plan"
        before = [t.clone() for t in cache]
        projected: list[int] = []
        project = type(m)._project

        def recording(*a: Any, **k: Any) -> Any:
            projected.append(1)
            return project(*a, **k)

        monkeypatch.setattr(type(m), "_project", recording)
        kept = _error(lambda: call(m, cache))
    assert type(kept) is type(fresh) and str(kept) == str(fresh)
    assert not projected, "the refused call projected x before refusing it"
    for a, b in zip(before, cache, strict=True):
        assert torch.equal(a, b)


def test_the_kept_plan_follows_the_module_mode() -> None:
    """Dropout that the explicit "blockwise" path cannot draw: steps in eval mode keep a
    plan; in train mode the same step is refused, as on a fresh module."""
    import torch

    m = _module(dropout=0.5, implementation="blockwise")
    cache = _warm(m)
    before = [t.clone() for t in cache]
    m.train()
    kept = _error(lambda: m(_token(), cache=cache))
    fresh_m = _module(dropout=0.5, implementation="blockwise")
    fresh = _error(lambda: fresh_m.train()(_token(), cache=_warm(_module())))
    assert type(kept) is type(fresh) and str(kept) == str(fresh)
    assert "cannot honour" in str(kept)
    assert all(torch.equal(a, b) for a, b in zip(before, cache, strict=True))


def test_another_cache_decodes_as_on_a_fresh_module() -> None:
    """After steps on one cache, a cache of the same shapes and one of another max_len
    each decode exactly as a fresh module's first cached steps."""
    import torch

    m = _module()
    _warm(m)
    for max_len in (8, 16):
        with torch.no_grad():
            out, _ = m(_token(), cache=_warm(_module(), max_len=max_len))
            want, _ = _module()(_token(), cache=_warm(_module(), max_len=max_len))
        torch.testing.assert_close(out, want, rtol=0, atol=0)
