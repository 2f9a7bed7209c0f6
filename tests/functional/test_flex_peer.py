"""PyTorch's own flex tests, the CPU-meaningful cases (issue 55), against both twins and the
float64 loop oracle (``parity_tests.reference.flex_attention``).

Adapted from PyTorch's ``test/inductor/test_flex_attention.py``: its score mods
(``_identity``, ``_times_two``, ``_squared``, ``_causal``, ``_inverse_causal``,
``_rel_bias``, ``_rel_causal``, ``_generate_alibi_bias``, the captured buffer of
``_head_offset``, ``_trig``), each with its mask mod of ``test_score_mask_mod_map``
(``noop_mask``, PyTorch's default, for most); the mask mods of its block-mask tests
(causal, sliding window, prefix LM, document masking, a checkerboard, ``and_masks`` /
``or_masks``); lengths that are not multiples of the block, Q_LEN != KV_LEN and decoding
(one query), block sizes that differ for queries and keys, grouped heads
(``enable_gqa``, ``test_Hq_Hkv``), ``BlockMask.from_kv_blocks``, and the log-sum-exp
(``return_lse``) of every case.  PyTorch's run compiled flex against its eager self in
float64; here the twins (eager PyTorch, jitted JAX) answer in float32 against the oracle,
within ``FLEX_ORACLE``.  Tiny shapes (B 1, 2 where a mod reads b; H 2-4; L, S <= 20; blocks of 8): the oracle's
loops and one JAX compile per case.

Each mod is written once per framework (``_Ops``: torch, jax.numpy or NumPy for the
oracle, and the captured arrays converted to it), as PyTorch's are written for torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

from attention_spec import mods
from parity_tests import reference
from parity_tests.tolerances import FLEX_ORACLE
from tests.support import needs_both

pytestmark = needs_both

E = 8
BLOCK = 8
DOCS = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3],
                 [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]])  # (B, 20)
HEAD_OFFSET = np.random.default_rng(7).random(4)  # _head_offset's captured buffer (H,)


class _Ops(NamedTuple):
    """One framework's functions and the conversion of a captured array to it."""

    name: str
    where: Callable[..., Any]
    sin: Callable[..., Any]
    cos: Callable[..., Any]
    tan: Callable[..., Any]
    array: Callable[[np.ndarray], Any]


def _ops(name: str) -> _Ops:
    if name == "torch":
        import torch
        return _Ops(name, torch.where, torch.sin, torch.cos, lambda x: torch.tan(x.to(torch.float32)),
                    torch.as_tensor)
    if name == "jax":
        import jax.numpy as jnp
        return _Ops(name, jnp.where, jnp.sin, jnp.cos, lambda x: jnp.tan(x.astype(jnp.float32)), jnp.asarray)
    return _Ops(name, np.where, np.sin, np.cos, np.tan, np.asarray)


# --------------------------------------------------------------------------- PyTorch's score mods


def _times_two(o: _Ops) -> Any:
    return lambda score, b, h, m, n: score * 2


def _squared(o: _Ops) -> Any:
    return lambda score, b, h, m, n: score * score


def _causal(o: _Ops) -> Any:
    return lambda score, b, h, q, kv: o.where(q >= kv, score, -math.inf)


def _inverse_causal(o: _Ops) -> Any:
    return lambda score, b, h, m, n: o.where(m <= n, score, -math.inf)


def _rel_bias(o: _Ops) -> Any:
    return lambda score, b, h, q, kv: score + (q - kv)


def _rel_causal(o: _Ops) -> Any:
    return lambda score, b, h, q, kv: o.where(q >= kv, score + (q - kv), -math.inf)


def _alibi(num_heads: int) -> Callable[[_Ops], Any]:
    def make(o: _Ops) -> Any:  # PyTorch's exp2(-((head + 1) * 8 / num_heads)), as a power of 2
        return lambda score, b, h, q, kv: score + (kv - q) * 2.0 ** (-((h + 1) * 8.0 / num_heads))
    return make


def _head_offset(o: _Ops) -> Any:
    offset = o.array(HEAD_OFFSET.astype(np.float64 if o.name == "oracle" else np.float32))
    return lambda score, b, h, m, n: score * offset[h]


def _trig(o: _Ops) -> Any:
    return lambda score, b, h, m, n: o.sin(o.cos(score)) + o.tan(b)


# --------------------------------------------------------------------------- mask mods


def _noop(o: _Ops) -> Any:
    """PyTorch's ``noop_mask`` (a 0-d True) for the PyTorch twin, its JAX image, none for
    the oracle."""
    if o.name == "torch":
        from torch.nn.attention.flex_attention import noop_mask
        return noop_mask
    if o.name == "jax":
        import jax.numpy as jnp
        return lambda b, h, q, kv: jnp.ones((), bool)
    return None


def _causal_mask(o: _Ops) -> Any:
    return lambda b, h, q, kv: q >= kv


def _inverse_causal_mask(o: _Ops) -> Any:
    return lambda b, h, q, kv: q <= kv


def _sliding_window(o: _Ops) -> Any:
    return lambda b, h, q, kv: (q >= kv) & (q - kv <= 5)


def _prefix_lm(o: _Ops) -> Any:
    prefix = o.array(np.array([3, 11]))
    return lambda b, h, q, kv: (kv <= prefix[b]) | (q >= kv)


def _documents(o: _Ops) -> Any:
    docs = o.array(DOCS)
    return lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv)


def _checkerboard(o: _Ops) -> Any:
    return lambda b, h, q, kv: (q + kv) % 2 == 0


def _combined(o: _Ops) -> Any:
    """``or_masks(and_masks(causal, window), prefix)`` of the library (both twins' mods)."""
    return mods.or_masks(mods.and_masks(mods.causal, mods.sliding_window(4)), mods.prefix_lm(2))


class Case(NamedTuple):
    score: Callable[[_Ops], Any] | None
    mask: Callable[[_Ops], Any]
    q_len: int = 20
    kv_len: int = 20
    heads: tuple[int, int] = (2, 2)  # (Hq, Hkv)
    block: int | tuple[int, int] = BLOCK
    batch: int = 1


CASES: dict[str, Case] = {
    # test_builtin_score_mods: each score mod with its mask mod of test_score_mask_mod_map
    "identity-noop": Case(None, _noop),
    "times-two-noop": Case(_times_two, _noop),
    "inverse-causal": Case(_inverse_causal, _inverse_causal_mask),
    "rel-bias-noop": Case(_rel_bias, _noop),
    "rel-causal": Case(_rel_causal, _causal_mask),  # (and _causal's -inf score: the same where)
    "alibi-noop": Case(_alibi(4), _noop, heads=(4, 4)),
    "head-offset-captured": Case(_head_offset, _noop, heads=(4, 4)),
    "trig": Case(_trig, _noop, batch=2),
    # test_builtin_score_mods_different_seqlen, decoding (test_flex_decoding's one query)
    "rel-causal-L12-S20": Case(_rel_causal, _causal_mask, q_len=12),
    "noop-decoding-L1": Case(_rel_bias, _noop, q_len=1, kv_len=19),
    # test_builtin_score_mods_different_block_size
    "causal-blocks-8x16": Case(_times_two, _causal_mask, block=(8, 16)),
    "causal-blocks-16x8": Case(_causal, _causal_mask, block=(16, 8)),
    # test_GQA (Hq, Hkv) of test_Hq_Hkv
    "gqa-4-2-alibi-causal": Case(_alibi(4), _causal_mask, heads=(4, 2)),
    "gqa-4-1-noop": Case(_squared, _noop, heads=(4, 1)),  # (_squared's one case)
    # the block-mask tests' mask mods
    "sliding-window": Case(None, _sliding_window),
    "prefix-lm": Case(_rel_bias, _prefix_lm, batch=2),
    "document-masking": Case(None, _documents, batch=2),
    "checkerboard": Case(None, _checkerboard),
    "and-or-masks": Case(_times_two, _combined, q_len=17, kv_len=17),
}


def _inputs(case: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    c = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    hq, hkv = c.heads
    return (rng.standard_normal((c.batch, hq, c.q_len, E)).astype(np.float32),
            rng.standard_normal((c.batch, hkv, c.kv_len, E)).astype(np.float32),
            rng.standard_normal((c.batch, hkv, c.kv_len, E)).astype(np.float32))


def _mod(make: Callable[[_Ops], Any] | None, framework: str) -> Any:
    return None if make is None else make(_ops(framework))


@functools.cache
def _oracle(case: str) -> tuple[np.ndarray, np.ndarray]:
    c = CASES[case]
    return reference.flex_attention(*_inputs(case), score_mod=_mod(c.score, "oracle"),
                                    mask_mod=_mod(c.mask, "oracle"), scale=1 / math.sqrt(E))


def _torch(case: str) -> tuple[np.ndarray, np.ndarray]:
    import torch

    import torch_attention.functional as tf

    c = CASES[case]
    bm = tf.create_block_mask(_mod(c.mask, "torch"), c.batch, c.heads[0], c.q_len, c.kv_len, device="cpu",
                              BLOCK_SIZE=c.block)
    out, lse = tf.flex_attention(*(torch.tensor(a) for a in _inputs(case)), score_mod=_mod(c.score, "torch"),
                                 block_mask=bm, enable_gqa=c.heads[0] != c.heads[1], return_lse=True)
    return out.numpy(), lse.numpy()


def _jax(case: str) -> tuple[np.ndarray, np.ndarray]:
    import jax
    import jax.numpy as jnp

    import jax_attention.functional as jf

    c = CASES[case]
    bm = jf.create_block_mask(_mod(c.mask, "jax"), c.batch, c.heads[0], c.q_len, c.kv_len, BLOCK_SIZE=c.block)
    score_mod = _mod(c.score, "jax")
    fn = jax.jit(lambda q, k, v: jf.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                   enable_gqa=c.heads[0] != c.heads[1], return_lse=True))
    out, lse = fn(*(jnp.asarray(a) for a in _inputs(case)))
    return np.asarray(out), np.asarray(lse)


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    tol = FLEX_ORACLE["float32"]
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: -inf where the oracle has none, or the converse"
    assert np.all(got[~finite] == want[~finite]), what
    error = np.abs(got[finite] - want[finite])
    assert np.all(error <= tol.atol + tol.rtol * np.abs(want[finite])), f"{what}: max error {error.max():.2e}"


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", list(CASES))
def test_pytorchs_flex_cases_match_the_oracle(case: str, framework: str) -> None:
    out, lse = (_torch if framework == "torch" else _jax)(case)
    want_out, want_lse = _oracle(case)
    _close(out, want_out, f"{framework} {case} out")
    _close(lse, want_lse, f"{framework} {case} lse")


def test_from_kv_blocks_with_full_blocks_in_both_twins() -> None:
    """PyTorch's ``BlockMask.from_kv_blocks`` with partial and full blocks (its
    ``noop_mask`` on the partial ones) and the JAX twin's ``BlockMask`` of the same tables:
    query block 0 sees key block 0 in full and key block 2 (ragged, 4 keys) through the
    mask mod; query block 1 key block 1 in full; query block 2 (ragged) nothing."""
    import jax.numpy as jnp
    import torch
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    q_len, kv_len = 20, 20
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, n, E)).astype(np.float32) for n in (q_len, kv_len, kv_len))
    num, idx = np.array([[[1, 0, 0]]], np.int32), np.array([[[[2, 0, 1], [0, 1, 2], [0, 1, 2]]]], np.int32)
    full_num, full_idx = np.array([[[1, 1, 0]]], np.int32), np.array([[[[0, 1, 2], [1, 0, 2], [0, 1, 2]]]], np.int32)
    visible = np.zeros((q_len, kv_len), bool)
    visible[:8, :8] = visible[:8, 16:] = visible[8:16, 8:16] = True
    want_out, want_lse = reference.flex_attention(q, k, v, mask_mod=lambda b, h, i, j: bool(visible[i, j]),
                                                  scale=1 / math.sqrt(E))
    tbm = TorchBlockMask.from_kv_blocks(*(torch.tensor(a) for a in (num, idx, full_num, full_idx)), BLOCK_SIZE=BLOCK,
                                        seq_lengths=(q_len, kv_len))
    out, lse = tf.flex_attention(*(torch.tensor(a) for a in (q, k, v)), block_mask=tbm, return_lse=True)
    _close(out.numpy(), want_out, "torch out")
    _close(lse.numpy(), want_lse, "torch lse")
    jbm = jf.BlockMask(*(jnp.asarray(a) for a in (num, idx, full_num, full_idx)), BLOCK_SIZE=(BLOCK, BLOCK),
                       mask_mod=_noop(_ops("jax")), seq_lengths=(q_len, kv_len))
    jout, jlse = jf.flex_attention(*(jnp.asarray(a) for a in (q, k, v)), block_mask=jbm, return_lse=True)
    _close(np.asarray(jout), want_out, "jax out")
    _close(np.asarray(jlse), want_lse, "jax lse")
