"""``flex_attention`` (issue 42) in both twins: score and mask mods written once
(``attention_spec.mods``), block masks in PyTorch's layout, forward and backward on CPU.

Against the float64 loop oracle (``reference.flex_attention``) forward and, by central
differences, backward (q, k, v and the arrays the mods capture); against PyTorch's own
``flex_attention`` and ``create_block_mask``; twin against twin; each library mod against
the named option of ``dot_product_attention`` it stands for; block skipping counted; no
(L, S) array kept for the backward; one error text per bad input.

Small shapes (B 2, H 4, L = S = 32, blocks of 8) so that blocks are skipped and the
oracle's loops stay quick; one jitted function per case and dtype.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import numpy as np
import pytest

from attention_spec import mods
from attention_spec.positions import alibi_slopes
from parity_tests import reference
from parity_tests.tolerances import FLEX_GRAD_ORACLE, FLEX_OPTION, FLEX_ORACLE, FLEX_TORCH, ORACLE, PARITY
from tests.support import needs_both

pytestmark = needs_both

B, H, L, E = 2, 4, 32, 8
BLOCK = 8
RNG_IDS = np.random.default_rng(42)
DOC_IDS = np.sort(RNG_IDS.integers(0, 4, (B, L)), axis=1)  # packed documents, (B, L)
DOC_IDS_KV = np.sort(RNG_IDS.integers(0, 4, (B, 40)), axis=1)  # the keys' ids, S = 40
TABLE = RNG_IDS.standard_normal((H, 9))  # a relative-position bias, reach 4
SLOPES = np.asarray(alibi_slopes(H), np.float64)


def _rows_blocked(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A plain function (not a library mod): the first query block and every row 5i + 3
    see no key, the others are causal."""
    return (q_idx >= 8) & (q_idx % 5 != 3) & (kv_idx <= q_idx)


# id -> (mask_mod, score_mod, block mask batch (None: broadcast), kv heads, kv_len, without
# a block mask).  Every library mod, the combinators, grouped heads, L != S, a plain
# function with fully masked rows and a query block without keys, and no block mask.
CASES: dict[str, tuple[Any, Any, int | None, int, int, bool]] = {
    "causal-softcap": (mods.causal, mods.softcap(4.0), None, H, L, False),
    "window-5-2": (mods.sliding_window(5, 2), None, None, H, L, False),
    "prefix-per-example-alibi": (mods.prefix_lm(np.array([3, 20])), mods.alibi(SLOPES), B, H, L, False),
    "documents-bias-table": (mods.documents(DOC_IDS), mods.bias_table(TABLE), B, H, L, False),
    "documents-S40": (mods.documents(DOC_IDS, DOC_IDS_KV), None, B, H, 40, False),
    "gqa-causal-alibi": (mods.causal, mods.alibi(SLOPES), None, 2, L, False),
    "and-causal-window": (mods.and_masks(mods.causal, mods.sliding_window(6)), None, None, H, L, False),
    "or-window-prefix": (mods.or_masks(mods.sliding_window(2, 2), mods.prefix_lm(4)), None, None, H, L, False),
    "rows-blocked-chain": (_rows_blocked, mods.chain(mods.softcap(3.0), mods.alibi(SLOPES)), None, H, L, False),
    "no-block-mask-chain": (None, mods.chain(mods.softcap(3.0), mods.bias_table(TABLE)), None, 1, L, True),
}


def _inputs(case: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v, float32 values (exact in float64)."""
    _, _, _, kv_heads, kv_len, _ = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    q = rng.standard_normal((B, H, L, E)).astype(np.float32)
    k = rng.standard_normal((B, kv_heads, kv_len, E)).astype(np.float32)
    v = rng.standard_normal((B, kv_heads, kv_len, E)).astype(np.float32)
    return q, k, v


@functools.cache
def _oracle(case: str) -> tuple[np.ndarray, np.ndarray]:
    mask_mod, score_mod, *_ = CASES[case]
    return reference.flex_attention(*_inputs(case), score_mod=score_mod, mask_mod=mask_mod, scale=1 / math.sqrt(E))


def _run_torch(case: str, dtype: str, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import torch

    import torch_attention.functional as tf

    mask_mod, score_mod, batch, kv_heads, kv_len, unmasked = CASES[case]
    bm = None if unmasked else tf.create_block_mask(mask_mod, batch, None, L, kv_len, device="cpu", BLOCK_SIZE=BLOCK)
    t = [torch.tensor(a, dtype=getattr(torch, dtype)) for a in (q, k, v)]
    out, lse = tf.flex_attention(*t, score_mod=score_mod, block_mask=bm, enable_gqa=kv_heads != H, return_lse=True)
    return out.numpy(), lse.numpy()


@functools.cache
def _jax_fn(case: str) -> Any:
    """The case's jitted JAX call (block mask and mods closed over; one per case)."""
    import jax

    import jax_attention.functional as jf

    mask_mod, score_mod, batch, kv_heads, kv_len, unmasked = CASES[case]
    bm = None if unmasked else jf.create_block_mask(mask_mod, batch, None, L, kv_len, BLOCK_SIZE=BLOCK)
    return jax.jit(lambda q, k, v: jf.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                     enable_gqa=kv_heads != H, return_lse=True))


def _run_jax(case: str, dtype: str, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import jax
    import jax.numpy as jnp

    with jax.enable_x64(dtype == "float64"):
        out, lse = _jax_fn(case)(*(jnp.asarray(a, getattr(jnp, dtype)) for a in (q, k, v)))
        return np.asarray(out), np.asarray(lse)


RUN = {"torch": _run_torch, "jax": _run_jax}


def _close(got: np.ndarray, want: np.ndarray, tol: Any, what: str) -> None:
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: -inf where the oracle has none, or the converse"
    assert np.all(got[~finite] == want[~finite]), what
    error = np.abs(got[finite] - want[finite])
    bound = tol.atol + tol.rtol * np.abs(want[finite])
    assert np.all(error <= bound), f"{what}: max error {error.max():.2e}"


# --------------------------------------------------------------------------- the oracle, forward


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_lse_match_the_oracle(case: str, framework: str, dtype: str) -> None:
    out, lse = RUN[framework](case, dtype, *_inputs(case))
    want_out, want_lse = _oracle(case)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.dtype(dtype)
    _close(out, want_out, FLEX_ORACLE[dtype], f"{framework} {dtype} out")
    _close(lse, want_lse, FLEX_ORACLE[dtype], f"{framework} {dtype} lse")


def test_fully_masked_rows_are_zeros_with_lse_minus_inf() -> None:
    """The oracle's answer for the rows that see nothing, which the test above holds both
    twins to: zeros, and -inf."""
    out, lse = _oracle("rows-blocked-chain")
    blocked = [i for i in range(L) if i < 8 or i % 5 == 3]
    assert np.all(out[:, :, blocked] == 0) and np.all(lse[:, :, blocked] == -np.inf)
    assert np.all(np.isfinite(np.delete(lse, blocked, axis=2)))


# --------------------------------------------------------------------------- twin against twin


@pytest.mark.parametrize("case", ["causal-softcap", "documents-S40", "gqa-causal-alibi", "rows-blocked-chain"])
def test_the_twins_agree_in_float32(case: str) -> None:
    inputs = _inputs(case)
    (to, tl), (jo, jl) = _run_torch(case, "float32", *inputs), _run_jax(case, "float32", *inputs)
    _close(jo, to, PARITY["float32"], "out")
    _close(jl, tl, PARITY["float32"], "lse")


# --------------------------------------------------------------------------- PyTorch's own


def _torch_flex(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # eager on CPU: it warns that it materialises the scores
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("no-block-mask-chain",)])
def test_torch_twin_matches_torchs_own_flex_attention(case: str) -> None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod, score_mod, batch, kv_heads, kv_len, _ = CASES[case]
    q, k, v = (torch.tensor(a) for a in _inputs(case))
    theirs_bm = create_block_mask(mask_mod, batch, None, L, kv_len, device="cpu", BLOCK_SIZE=BLOCK)
    theirs = _torch_flex(q, k, v, score_mod=score_mod, block_mask=theirs_bm, enable_gqa=kv_heads != H,
                         return_lse=True)
    ours = _run_torch(case, "float32", *_inputs(case))
    _close(ours[0], theirs[0].numpy(), FLEX_TORCH, "out")
    _close(ours[1], theirs[1].numpy(), FLEX_TORCH, "lse")


def test_torch_twin_has_a_cpu_backward_where_torchs_own_raises() -> None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import torch_attention.functional as tf

    q, k, v = (torch.tensor(a, requires_grad=True) for a in _inputs("causal-softcap"))
    with pytest.raises(NotImplementedError, match="backward"):
        _torch_flex(q, k, v, block_mask=create_block_mask(mods.causal, None, None, L, L, device="cpu",
                                                          BLOCK_SIZE=BLOCK)).sum().backward()
    out = tf.flex_attention(q, k, v, block_mask=tf.create_block_mask(mods.causal, None, None, L, L, BLOCK_SIZE=BLOCK))
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


BLOCK_MASK_CASES = {
    "causal": (mods.causal, None, 32, 32, 8),
    "window-ragged": (mods.sliding_window(9, 3), None, 30, 37, (8, 16)),
    "documents": (mods.documents(DOC_IDS), B, 32, 32, 8),
    "causal-and-documents": (mods.and_masks(mods.causal, mods.documents(DOC_IDS)), B, 32, 32, (16, 8)),
}


@pytest.mark.parametrize("case", list(BLOCK_MASK_CASES))
def test_create_block_mask_matches_torchs_tables(case: str) -> None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    mask_mod, batch, q_len, kv_len, size = BLOCK_MASK_CASES[case]
    theirs = create_block_mask(mask_mod, batch, H, q_len, kv_len, device="cpu", BLOCK_SIZE=size)
    for ours in (tf.create_block_mask(mask_mod, batch, H, q_len, kv_len, BLOCK_SIZE=size),
                 jf.create_block_mask(mask_mod, batch, H, q_len, kv_len, BLOCK_SIZE=size)):
        assert ours.BLOCK_SIZE == tuple(theirs.BLOCK_SIZE) and ours.seq_lengths == tuple(theirs.seq_lengths)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            got, want = np.asarray(getattr(ours, name)), getattr(theirs, name).numpy()
            assert got.dtype == np.int32 and np.array_equal(got, want), name
    # and the PyTorch twin takes PyTorch's own block mask: on the flex path (whether its
    # tables are its mod's cannot be known, so they are read), the bits of ours there
    q = torch.tensor(np.random.default_rng(1).standard_normal((B, H, q_len, E)), dtype=torch.float32)
    kv = torch.tensor(np.random.default_rng(2).standard_normal((B, H, kv_len, E)), dtype=torch.float32)
    ours_out, _ = tf.flex_attention(q, kv, kv, block_mask=tf.create_block_mask(mask_mod, batch, H, q_len, kv_len,
                                                                              BLOCK_SIZE=size), return_lse=True)
    assert tf.flex_route(q, kv, kv, block_mask=theirs).path == "flex"
    assert torch.equal(tf.flex_attention(q, kv, kv, block_mask=theirs), ours_out)


# --------------------------------------------------------------------------- the backward


# id -> (mask mod, score mod over `arr` (the captured array, or None), its NumPy value,
# kv heads).  B 2, H 2 (H 4 with grouped heads), L = S = 12, blocks of 4.
GRAD_CASES: dict[str, tuple[Any, Any, np.ndarray | None, int]] = {
    "causal-bias-table": (mods.causal, mods.bias_table, np.random.default_rng(5).standard_normal((2, 7)), 2),
    "documents-alibi-softcap": (mods.documents(DOC_IDS[:, :12]), lambda s: mods.chain(mods.alibi(s), mods.softcap(2.0)),
                                np.array([0.5, 0.25]), 2),
    "gqa-window-alibi": (mods.sliding_window(3, 1), mods.alibi, np.array([0.5, 0.25, 0.125, 0.0625]), 1),
    "rows-blocked-no-mod": (_rows_blocked, None, None, 2),
}
GRAD_EPS = 1e-6


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_match_central_differences_of_the_oracle(case: str) -> None:
    """float64 gradients of q, k, v and of the captured array, both twins (JAX under
    ``jax.jit``), against directional central differences of the oracle."""
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    mask_mod, make_score_mod, captured, kv_heads = GRAD_CASES[case]
    heads, seq = (4 if kv_heads == 1 else 2), 12
    rng = np.random.default_rng(sum(map(ord, case)))
    q = rng.standard_normal((B, heads, seq, E))
    k, v = (rng.standard_normal((B, kv_heads, seq, E)) for _ in range(2))
    cot = rng.uniform(0.5, 1.5, (B, heads, seq, E))
    scale = 1 / math.sqrt(E)
    arrays = [q, k, v] + ([] if captured is None else [captured])

    def score_mod(arr: Any) -> Any:
        return None if make_score_mod is None else make_score_mod(arr)

    def oracle_loss(t: float, us: list[np.ndarray]) -> float:
        moved = [a + t * u for a, u in zip(arrays, us, strict=True)]
        o, _ = reference.flex_attention(*moved[:3], score_mod=score_mod(moved[3] if captured is not None else None),
                                        mask_mod=mask_mod, scale=scale)
        return math.fsum((o * cot).ravel())

    tbm = tf.create_block_mask(mask_mod, B, None, seq, seq, BLOCK_SIZE=4)
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = tf.flex_attention(*ts[:3], score_mod=score_mod(ts[3] if captured is not None else None), block_mask=tbm,
                            enable_gqa=kv_heads != heads)
    (out * torch.tensor(cot)).sum().backward()
    torch_grads = [t.grad.numpy() for t in ts]
    with jax.enable_x64(True):
        jbm = jf.create_block_mask(mask_mod, B, None, seq, seq, BLOCK_SIZE=4)

        def loss(*xs: Any) -> Any:
            o = jf.flex_attention(*xs[:3], score_mod=score_mod(xs[3] if captured is not None else None),
                                  block_mask=jbm, enable_gqa=kv_heads != heads)
            return jnp.sum(o * jnp.asarray(cot))

        grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(arrays)))))(*(jnp.asarray(a) for a in arrays))
        jax_grads = [np.asarray(g) for g in grads]
    if captured is not None:  # the captured array is reached, not left at zero
        assert np.abs(torch_grads[3]).max() > 1e-3 and np.abs(jax_grads[3]).max() > 1e-3
    for _ in range(2):
        us = [rng.standard_normal(a.shape) for a in arrays]
        fd = (oracle_loss(GRAD_EPS, us) - oracle_loss(-GRAD_EPS, us)) / (2 * GRAD_EPS)
        for side, got in (("torch", torch_grads), ("jax", jax_grads)):
            ad = math.fsum(float((g * u).sum()) for g, u in zip(got, us, strict=True))
            magnitude = math.fsum(float(np.abs(g * u).sum()) for g, u in zip(got, us, strict=True))
            error = abs(ad - fd) / (magnitude + abs(fd))
            assert error <= FLEX_GRAD_ORACLE, f"{side}: <grad, u> = {ad!r}, difference {fd!r} ({error:.2e})"


def test_backward_keeps_no_scores_array() -> None:
    """Each query block is recomputed in the backward: nothing of (L, S) is kept, in
    either twin (PyTorch: what autograd saves outside the checkpoints; JAX: the residuals
    of the vjp)."""
    import jax.numpy as jnp
    import torch
    from jax._src.ad_checkpoint import saved_residuals

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    seq, block = 256, 32
    q = np.random.default_rng(0).standard_normal((1, 2, seq, E)).astype(np.float32)
    limit = q.size  # one input's worth: a (rows, S) block's scores are 4x, the whole (L, S) 32x
    saved: list[int] = []
    ts = [torch.tensor(q, requires_grad=True) for _ in range(3)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        tf.flex_attention(*ts, score_mod=mods.softcap(5.0),
                          block_mask=tf.create_block_mask(mods.causal, None, None, seq, seq, BLOCK_SIZE=block))
    assert saved and max(saved) <= limit, max(saved)
    jbm = jf.create_block_mask(mods.causal, None, None, seq, seq, BLOCK_SIZE=block)
    residuals = saved_residuals(lambda *x: jf.flex_attention(*x, score_mod=mods.softcap(5.0), block_mask=jbm),
                                *(jnp.asarray(q),) * 3)
    assert residuals and max(math.prod(aval.shape) for aval, _ in residuals) <= limit


# --------------------------------------------------------------------------- the named options


def _option_cases() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    """id -> (mask mod, score mod, the same call's dot_product_attention keywords)."""
    prefix = np.array([3, 20])
    dense_prefix = (np.arange(L)[None, None, None, :] < prefix[:, None, None, None]) | np.tril(np.ones((L, L), bool))
    positions = np.arange(L)
    return {
        "causal-softcap": (mods.causal, mods.softcap(4.0), {"causal": True, "softcap": 4.0}),
        "window": (mods.sliding_window(5, 2), None, {"window": (5, 2)}),
        "causal-and-window": (mods.and_masks(mods.causal, mods.sliding_window(6, 3)), None,
                              {"causal": True, "window": (6, 3)}),
        "documents": (mods.documents(DOC_IDS), None, {"segment_ids": DOC_IDS}),
        "prefix-lm": (mods.prefix_lm(prefix), None, {"mask": dense_prefix}),
        "alibi": (None, mods.alibi(SLOPES), {"bias": (SLOPES[:, None, None]
                                                      * (positions[None, :] - positions[:, None]))[None]}),
    }


def _plain(options: dict[str, Any]) -> dict[str, Any]:
    return {n: o.tolist() if isinstance(o, np.ndarray) else o for n, o in options.items()}


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_library_mods_equal_the_named_options_they_stand_for(framework: str) -> None:
    """flex with each library mod against ``dot_product_attention`` with the option it
    stands for (``implementation="reference"``, float64); where a mod has ``options``, they
    are the keywords used."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((B, H, L, E)) for _ in range(3))
    for name, (mask_mod, score_mod, keywords) in _option_cases().items():
        stands_for: dict[str, Any] = {}
        for m in (mask_mod, score_mod):
            if m is not None and m.options is not None:
                stands_for.update({n: o for n, o in m.options.items() if o is not None})
        if name in ("prefix-lm", "alibi"):
            assert stands_for == {}, name  # no named option: a dense mask, a dense bias
        else:
            assert _plain(stands_for) == _plain(keywords), name
        if framework == "torch":
            import torch

            import torch_attention.functional as tf

            tq, tk, tv = (torch.tensor(a) for a in (q, k, v))
            bm = None if mask_mod is None else tf.create_block_mask(mask_mod, B, None, L, L, BLOCK_SIZE=BLOCK)
            got = tf.flex_attention(tq, tk, tv, score_mod=score_mod, block_mask=bm).numpy()
            conv = {n: torch.tensor(o) if isinstance(o, np.ndarray) else o for n, o in keywords.items()}
            want = tf.dot_product_attention(tq, tk, tv, implementation="reference", **conv).numpy()
        else:
            import jax
            import jax.numpy as jnp

            import jax_attention.functional as jf

            with jax.enable_x64(True):
                jq, jk, jv = (jnp.asarray(a) for a in (q, k, v))
                bm = None if mask_mod is None else jf.create_block_mask(mask_mod, B, None, L, L, BLOCK_SIZE=BLOCK)
                got = np.asarray(jax.jit(functools.partial(jf.flex_attention, score_mod=score_mod, block_mask=bm))(
                    jq, jk, jv))
                conv = {n: jnp.asarray(o) if isinstance(o, np.ndarray) else o for n, o in keywords.items()}
                want = np.asarray(jf.dot_product_attention(jq, jk, jv, implementation="reference", **conv))
        _close(got, want, FLEX_OPTION, f"{framework} {name}")


def test_mod_options_and_arrays() -> None:
    ids = np.array([[0, 0, 1]])
    assert mods.causal.options == {"causal": True}
    assert mods.sliding_window(4).options == {"window": (4, 0)}
    assert mods.softcap(2).options == {"softcap": 2.0}
    assert mods.chain(mods.softcap(2.0)).options == {"softcap": 2.0}
    assert mods.chain(mods.softcap(2.0), mods.alibi([1.0])).options is None
    assert mods.and_masks(mods.sliding_window(1), mods.sliding_window(2)).options is None  # two windows: none
    assert mods.or_masks(mods.causal, mods.sliding_window(2)).options is None
    d = mods.documents(ids)
    assert d.options["segment_ids"] is ids and d.arrays == (ids,)
    both = mods.and_masks(mods.causal, d, mods.prefix_lm(np.array([1])))
    assert len(both.arrays) == 2
    copied = both.map_arrays(np.copy)
    assert copied.arrays[0] is not ids and np.array_equal(copied.arrays[0], ids)
    assert copied != both and both.map_arrays(lambda a: a) == both and hash(mods.sliding_window(3)) == hash(
        mods.sliding_window(3))
    with pytest.raises(ValueError, match=r"bias_table: table must have shape \(H, 2m \+ 1\)"):
        mods.bias_table(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="window left must be >= 0"):
        mods.sliding_window(-1)
    with pytest.raises(TypeError, match="and_masks takes callable mods"):
        mods.and_masks(mods.causal, 3)


# --------------------------------------------------------------------------- block skipping


def test_a_causal_block_mask_computes_about_half_the_blocks() -> None:
    """Counted twice: the plan's pairs of blocks, and what the mods see (a spy): the score
    mod the blocks computed (36 of 64 pairs), the mask mod only the 8 partial ones."""
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attention._flex as jflex
    import torch_attention._flex as tflex

    seq = 64
    q = np.random.default_rng(3).standard_normal((B, H, seq, E)).astype(np.float32)
    for fx, lib, arr in ((tflex, "torch", torch.tensor(q)), (jflex, "jax", jnp.asarray(q))):
        seen = {"scores": 0, "masked": 0}

        def score_spy(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, seen: dict[str, int] = seen) -> Any:
            seen["scores"] += math.prod(s.shape)
            return s

        def causal_spy(b: Any, h: Any, q_idx: Any, kv_idx: Any, seen: dict[str, int] = seen) -> Any:
            seen["masked"] += q_idx.shape[2] * kv_idx.shape[3]
            return q_idx >= kv_idx

        bm = fx.create_block_mask(mods.causal, None, None, seq, seq, BLOCK_SIZE=BLOCK)
        assert fx.blocks_computed(bm, seq, seq) == 36 and fx.blocks_computed(None, seq, seq) == 1
        bm = type(bm)(*(getattr(bm, f) for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                 "full_kv_indices")), BLOCK_SIZE=bm.BLOCK_SIZE,
                      mask_mod=causal_spy, seq_lengths=bm.seq_lengths)
        if lib == "jax":  # counted as it traces: nothing to compile
            jax.eval_shape(functools.partial(fx.flex_attention, score_mod=score_spy, block_mask=bm), arr, arr, arr)
        else:
            fx.flex_attention(arr, arr, arr, score_mod=score_spy, block_mask=bm)
        # JAX traces one slice's function, which lax.map runs for each of the B * H slices
        slices = B * H if lib == "torch" else 1
        assert seen == {"scores": 36 * BLOCK * BLOCK * slices, "masked": 8 * BLOCK * BLOCK}, (lib, seen)


def test_captured_float_arrays_are_read_in_the_scores_dtype() -> None:
    """ALiBi's slopes and a bias table given as float64 NumPy arrays are read in the
    scores' float32 in both twins (as the JAX twin reads them without x64): the same
    numbers as the mods over float32 copies, not float64 sums cast back."""
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(5)
    scores = rng.standard_normal((1, H, 6, 7)).astype(np.float32) * 1e3
    index = (np.arange(1).reshape(1, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1), np.arange(6).reshape(1, 1, 6, 1),
             np.arange(7).reshape(1, 1, 1, 7))
    slopes = rng.standard_normal(H) * (1 + 1e-12)  # float64 digits that float32 drops
    for wide, narrow in ((mods.alibi(slopes), mods.alibi(slopes.astype(np.float32))),
                         (mods.bias_table(TABLE * (1 + 1e-12)), mods.bias_table(TABLE.astype(np.float32)))):
        for lib, wrap in ((torch, torch.as_tensor), (jnp, jnp.asarray)):
            got = wide(wrap(scores), *(wrap(i) for i in index))
            want = narrow(wrap(scores), *(wrap(i) for i in index))
            assert got.dtype == want.dtype == wrap(scores).dtype, lib.__name__
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --------------------------------------------------------------------------- JAX transforms


def test_jax_block_mask_traced_vmapped_and_mods_as_arguments() -> None:
    """Under ``jax.jit`` a block mask passed in (traced: every block, masked), one made
    inside from traced document ids, and ``jax.vmap`` over a leading axis, give the
    closed-over result; a library mod passed in is a pytree (new arrays, no recompile)."""
    import jax
    import jax.numpy as jnp

    import jax_attention.functional as jf

    case = "documents-bias-table"
    q, k, v = (jnp.asarray(a) for a in _inputs(case))
    want = np.asarray(_jax_fn(case)(q, k, v)[0])
    bm = jf.create_block_mask(mods.documents(DOC_IDS), B, None, L, L, BLOCK_SIZE=BLOCK)
    table = mods.bias_table(jnp.asarray(TABLE, jnp.float32))
    passed = jax.jit(lambda q, k, v, bm, sm: jf.flex_attention(q, k, v, score_mod=sm, block_mask=bm))
    _close(np.asarray(passed(q, k, v, bm, table)), want, PARITY["float32"], "block mask passed in")

    @jax.jit
    def inside(q: Any, k: Any, v: Any, ids: Any) -> Any:
        block_mask = jf.create_block_mask(mods.documents(ids), B, None, L, L, BLOCK_SIZE=BLOCK)
        return jf.flex_attention(q, k, v, score_mod=table, block_mask=block_mask)

    _close(np.asarray(inside(q, k, v, jnp.asarray(DOC_IDS))), want, PARITY["float32"], "block mask made inside")
    stacked = [jnp.stack([a, 2 * a]) for a in (q, k, v)]
    mapped = jax.jit(jax.vmap(lambda q, k, v: jf.flex_attention(q, k, v, score_mod=table, block_mask=bm)))(*stacked)
    _close(np.asarray(mapped[0]), want, PARITY["float32"], "vmap")
    passed(q, k, v, bm, mods.bias_table(jnp.zeros_like(table.table)))
    assert passed._cache_size() == 1


@pytest.mark.parametrize("case", ["documents-bias-table", "gqa-causal-alibi", "rows-blocked-chain",
                                  "no-block-mask-chain"])
def test_jax_many_query_blocks_run_in_loops(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``UNROLLED_BLOCKS`` query blocks the JAX twin runs them in a few loops over the
    key blocks each group needs (per-example kinds, grouped heads, rows and a whole block
    without keys, no block mask): out and lse equal the float64 oracle, and the gradients
    (q, k, v and a captured table) the unrolled blocks'."""
    import jax
    import jax.numpy as jnp

    import jax_attention._flex as jax_flex
    import jax_attention.functional as jf

    mask_mod, score_mod, batch, kv_heads, kv_len, unmasked = CASES[case]
    bm = None if unmasked else jf.create_block_mask(mask_mod, batch, None, L, kv_len, BLOCK_SIZE=BLOCK)
    q, k, v = (jnp.asarray(a) for a in _inputs(case))
    arrays = [jnp.asarray(a, jnp.float32) for a in getattr(score_mod, "arrays", ())]

    def run(limit: int) -> Any:
        monkeypatch.setattr(jax_flex, "UNROLLED_BLOCKS", limit)

        def loss(q: Any, k: Any, v: Any, arrays: Any) -> Any:
            mod = score_mod.with_arrays(arrays) if arrays else score_mod
            out, lse = jf.flex_attention(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=kv_heads != H,
                                         return_lse=True)
            return (out * jnp.cos(out)).sum(), (out, lse)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, arrays)

    looped = []
    original = jax_flex._looped
    monkeypatch.setattr(jax_flex, "_looped", lambda *a: (looped.append(1), original(*a))[1])
    grads, (out, lse) = run(0)
    assert looped
    want_out, want_lse = _oracle(case)
    _close(np.asarray(out), want_out, FLEX_ORACLE["float32"], "out")
    _close(np.asarray(lse), want_lse, FLEX_ORACLE["float32"], "lse")
    unrolled, _ = run(10**6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=PARITY["float32"].rtol,
                                   atol=PARITY["float32"].atol * float(np.abs(want).max()))


# --------------------------------------------------------------------------- bad input


def _bad_calls() -> dict[str, tuple[Any, str]]:
    """id -> (a function of (framework's functional module, a q/k/v maker), the text)."""
    four = (B, H, 16, E)
    return {
        "rank": (lambda f, mk: f.flex_attention(mk((H, 16, E)), mk((H, 16, E)), mk((H, 16, E))),
                 r"flex_attention: q, k and v must be 4-d"),
        "batch": (lambda f, mk: f.flex_attention(mk(four), mk((1, H, 16, E)), mk((1, H, 16, E))),
                  r"must have one batch size"),
        "head-dim": (lambda f, mk: f.flex_attention(mk(four), mk((B, H, 16, 4)), mk(four)),
                     r"q and k must have the same last dimension \(E\)"),
        "heads-without-gqa": (lambda f, mk: f.flex_attention(mk(four), mk((B, 2, 16, E)), mk((B, 2, 16, E))),
                              r"q has 4 heads and k and v 2; pass enable_gqa=True"),
        "gqa-not-multiple": (lambda f, mk: f.flex_attention(mk(four), mk((B, 3, 16, E)), mk((B, 3, 16, E)),
                                                            enable_gqa=True),
                             r"q's heads \(4\) must be a multiple of k's and v's \(3\)"),
        "dtypes": (lambda f, mk: f.flex_attention(mk(four), mk(four, "float64"), mk(four)),
                   r"must share one floating-point dtype; got float32, float64, float32"),
        "scale": (lambda f, mk: f.flex_attention(mk(four), mk(four), mk(four), scale=-1.0),
                  r"scale must be None or a positive finite number"),
        "score-mod": (lambda f, mk: f.flex_attention(mk(four), mk(four), mk(four), score_mod=3),
                      r"score_mod must be callable or None; got int"),
        "block-mask-lengths": (lambda f, mk: f.flex_attention(mk(four), mk(four), mk(four), block_mask=(
            f.create_block_mask(mods.causal, None, None, 32, 32, BLOCK_SIZE=8))),
            r"block_mask was made for q_len=32, kv_len=32; got q_len=16, kv_len=16"),
        "block-mask-heads": (lambda f, mk: f.flex_attention(mk(four), mk(four), mk(four), block_mask=(
            f.create_block_mask(mods.causal, None, 3, 16, 16, BLOCK_SIZE=8))),
            r"block_mask.kv_num_blocks must have shape \(2 or 1, 4 or 1, 2\)"),
        "block-size": (lambda f, mk: f.create_block_mask(mods.causal, None, None, 16, 16, BLOCK_SIZE=0),
                       r"create_block_mask: BLOCK_SIZE must be >= 1; got 0"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_gives_one_error_text_in_both_twins(case: str) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    call, text = _bad_calls()[case]
    found = []
    with jax.enable_x64(True):
        for f, mk in ((tf, lambda s, d="float32": torch.zeros(s, dtype=getattr(torch, d))),
                      (jf, lambda s, d="float32": jnp.zeros(s, getattr(jnp, d)))):
            with pytest.raises((TypeError, ValueError), match=text) as info:
                call(f, mk)
            found.append((info.type, str(info.value)))
    assert found[0] == found[1]


# --------------------------------------------------------------------------- named options


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_mods_that_stand_for_named_options_run_as_dot_product_attention(framework: str) -> None:
    """Library mods that all stand for named options (causal, a window, soft-capping,
    documents) make the call that call of ``dot_product_attention``: the same numbers to
    the bit, and ``flex_route`` gives its route led by the options.  A mod that stands for
    none (ALiBi), or ``return_lse``, keeps the call on the flex path (``_flex``'s numbers),
    and ``flex_route`` says why.  The checks are the flex path's whichever runs."""
    if framework == "torch":
        import torch

        import torch_attention._flex as flex_path
        import torch_attention.functional as f
        conv: Any = torch.tensor
    else:
        import jax.numpy as jnp

        import jax_attention._flex as flex_path  # type: ignore[no-redef]
        import jax_attention.functional as f  # type: ignore[no-redef]
        conv = jnp.asarray
    rng = np.random.default_rng(3)
    q, k, v = (conv(rng.standard_normal((2, 4, 32, 8), dtype=np.float32)) for _ in range(3))
    ids = np.repeat(np.array([[0] * 20 + [1] * 12]), 2, axis=0)
    mask_mod = mods.and_masks(mods.causal, mods.sliding_window(9), mods.documents(ids))
    block_mask = f.create_block_mask(mask_mod, 2, None, 32, 32, BLOCK_SIZE=8)
    named = {"causal": True, "window": (9, 0), "softcap": 20.0, "segment_ids": conv(ids)}
    got = f.flex_attention(q, k, v, score_mod=mods.softcap(20.0), block_mask=block_mask)
    want = f.dot_product_attention(q, k, v, **named)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    chosen = f.flex_route(q, k, v, score_mod=mods.softcap(20.0), block_mask=block_mask)
    assert chosen.reasons[0] == ("flex: the mods stand for causal=True, window=(9, 0), segment_ids=<array>, "
                                 "kv_segment_ids=None, softcap=20.0")
    assert (chosen.path, chosen.kernel, chosen.reasons[1:]) == tuple(f.route(q, k, v, **named))

    slopes = mods.alibi(np.linspace(0.5, 0.1, 4, dtype=np.float32))
    got = f.flex_attention(q, k, v, score_mod=slopes, block_mask=block_mask)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(
        flex_path.flex_attention(q, k, v, score_mod=slopes, block_mask=block_mask)))
    assert f.flex_route(q, k, v, score_mod=slopes, block_mask=block_mask) == (
        "flex", "flex-blocks", ("named options: score_mod (Alibi) stands for no named option",))
    assert f.flex_route(q, k, v, block_mask=block_mask, return_lse=True).reasons == (
        "named options: return_lse=True (dot_product_attention gives no log-sum-exp)",)
    with pytest.raises(ValueError, match="flex_attention: q has 4 heads and k and v 2"):
        f.flex_attention(q, k[:, :2], v[:, :2], score_mod=mods.softcap(20.0), block_mask=block_mask)


# --------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_computes_in_float32(dtype: str) -> None:
    """Scores, softmax and lse in float32 (lse returned in float32), the output rounded
    once to the input dtype; against the oracle over the inputs as rounded."""
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    case = "documents-bias-table"
    mask_mod, score_mod, batch, *_ = CASES[case]
    t_in = [torch.tensor(a).to(getattr(torch, dtype)) for a in _inputs(case)]
    rounded = [t.double().numpy() for t in t_in]
    want_out, want_lse = reference.flex_attention(*rounded, score_mod=score_mod, mask_mod=mask_mod,
                                                  scale=1 / math.sqrt(E))
    out, lse = tf.flex_attention(*t_in, score_mod=score_mod, return_lse=True,
                                 block_mask=tf.create_block_mask(mask_mod, batch, None, L, L, BLOCK_SIZE=BLOCK))
    assert out.dtype == getattr(torch, dtype) and lse.dtype == torch.float32
    jbm = jf.create_block_mask(mask_mod, batch, None, L, L, BLOCK_SIZE=BLOCK)
    j_out, j_lse = jax.jit(functools.partial(jf.flex_attention, score_mod=score_mod, block_mask=jbm, return_lse=True))(
        *(jnp.asarray(a, getattr(jnp, dtype)) for a in rounded))
    assert j_out.dtype == getattr(jnp, dtype) and j_lse.dtype == jnp.float32
    for name, (o, s) in (("torch", (out.float().numpy(), lse.numpy())),
                         ("jax", (np.asarray(j_out, np.float32), np.asarray(j_lse)))):
        _close(o, want_out, ORACLE[dtype], f"{name} {dtype} out")
        _close(s, want_lse, FLEX_ORACLE["float32"], f"{name} {dtype} lse (float32)")
