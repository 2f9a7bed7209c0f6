"""Regressions of issue 55, flex attention in both twins: what a mask mod may answer.

- A mask mod's bool answer need not span the key axis: a 0-d one (PyTorch's own
  ``noop_mask``, the default of ``BlockMask.from_kv_blocks``; ``True``), one of the query
  alone (``q_idx < 30``) or of the key alone is broadcast, on full, partial and ragged
  blocks (decoding: one query; lengths not a multiple of the block).  The PyTorch twin
  crashed on each (``IndexError`` in ``_mask`` on any partial block, a size mismatch).
- A non-bool answer (0/1 integers, floats) is refused with one text in both twins
  (``attention_spec.flex_answers``), as PyTorch's own flex refuses it; the JAX twin took
  it, the PyTorch twin crashed with framework errors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from attention_spec import mods
from parity_tests import reference
from parity_tests.tolerances import FLEX_ORACLE
from tests.support import needs_both

pytestmark = needs_both

B, H, E = 2, 2, 8
BLOCK = 16


def _inputs(q_len: int, kv_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(np.float32)  # type: ignore[return-value]
                 for s in ((B, H, q_len, E), (B, H, kv_len, E), (B, H, kv_len, E)))


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    tol = FLEX_ORACLE["float32"]
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: -inf where the oracle has none, or the converse"
    assert np.all(np.abs(got[finite] - want[finite]) <= tol.atol + tol.rtol * np.abs(want[finite])), what


def _zero_d(framework: str) -> Any:
    """Each framework's 0-d ``True`` mask mod: PyTorch's own ``noop_mask``; its JAX image."""
    if framework == "torch":
        from torch.nn.attention.flex_attention import noop_mask
        return noop_mask
    import jax.numpy as jnp
    return lambda b, h, q_idx, kv_idx: jnp.ones((), bool)


def _query_alone(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx < 30  # rows 30.. see no key: zeros, lse -inf


def _key_alone(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx < 25


def _python_true(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return True


# id -> (mask mod (None: the framework's 0-d noop), the oracle's mask mod, q_len, kv_len).
# Lengths not multiples of the block (ragged partial blocks), one query (decoding), L != S.
ANSWERS: dict[str, tuple[Any, Any, int, int]] = {
    "noop-0d-ragged": (None, None, 40, 40),
    "noop-0d-decoding": (None, None, 1, 37),
    "python-true": (_python_true, None, 40, 24),
    "query-alone": (_query_alone, _query_alone, 40, 40),
    "key-alone-L-ne-S": (_key_alone, _key_alone, 21, 40),
}


def _run(framework: str, mask_mod: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray,
         block_mask_of: Any = None) -> tuple[np.ndarray, np.ndarray]:
    q_len, kv_len = q.shape[2], k.shape[2]
    if framework == "torch":
        import torch

        import torch_attention.functional as tf
        bm = tf.create_block_mask(mask_mod, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=BLOCK)
        out, lse = tf.flex_attention(*(torch.tensor(a) for a in (q, k, v)), block_mask=bm, return_lse=True)
        return out.numpy(), lse.numpy()
    import jax.numpy as jnp

    import jax_attention.functional as jf
    bm = jf.create_block_mask(mask_mod, B, H, q_len, kv_len, BLOCK_SIZE=BLOCK)
    out, lse = jf.flex_attention(*(jnp.asarray(a) for a in (q, k, v)), block_mask=bm, return_lse=True)
    return np.asarray(out), np.asarray(lse)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", list(ANSWERS))
def test_a_bool_answer_that_does_not_span_the_keys_is_broadcast(case: str, framework: str) -> None:
    mask_mod, oracle_mod, q_len, kv_len = ANSWERS[case]
    mask_mod = _zero_d(framework) if mask_mod is None else mask_mod
    q, k, v = _inputs(q_len, kv_len)
    want_out, want_lse = reference.flex_attention(q, k, v, mask_mod=oracle_mod, scale=1 / math.sqrt(E))
    out, lse = _run(framework, mask_mod, q, k, v)
    _close(out, want_out, f"{framework} {case} out")
    _close(lse, want_lse, f"{framework} {case} lse")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_tables_of_kv_blocks_with_a_0d_mask_mod(framework: str) -> None:
    """PyTorch's ``BlockMask.from_kv_blocks`` (default ``noop_mask``) and the JAX twin's
    ``BlockMask`` of the same tables: key block 1 of query block 0 and key blocks 0 and 2
    (ragged) of query block 1 partial, the 0-d mod letting each key through; the rest
    skipped."""
    q, k, v = _inputs(24, 40)
    num = np.array([[[1, 2]]], np.int32)
    indices = np.array([[[[1, 0, 2], [0, 2, 1]]]], np.int32)
    visible = np.zeros((24, 40), bool)
    visible[:16, 16:32] = True
    visible[16:, :16] = visible[16:, 32:] = True

    def oracle_mod(b: Any, h: Any, i: Any, j: Any) -> bool:
        return bool(visible[i, j])

    want_out, want_lse = reference.flex_attention(q, k, v, mask_mod=oracle_mod, scale=1 / math.sqrt(E))
    if framework == "torch":
        import torch
        from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

        import torch_attention.functional as tf
        bm = TorchBlockMask.from_kv_blocks(torch.tensor(num), torch.tensor(indices), BLOCK_SIZE=BLOCK,
                                           seq_lengths=(24, 40))
        out, lse = tf.flex_attention(*(torch.tensor(a) for a in (q, k, v)), block_mask=bm, return_lse=True)
        got = out.numpy(), lse.numpy()
    else:
        import jax.numpy as jnp

        import jax_attention.functional as jf
        jbm = jf.BlockMask(jnp.asarray(num), jnp.asarray(indices), None, None, BLOCK_SIZE=(BLOCK, BLOCK),
                           mask_mod=_zero_d("jax"), seq_lengths=(24, 40))
        out, lse = jf.flex_attention(*(jnp.asarray(a) for a in (q, k, v)), block_mask=jbm, return_lse=True)
        got = np.asarray(out), np.asarray(lse)
    _close(got[0], want_out, f"{framework} out")
    _close(got[1], want_lse, f"{framework} lse")


def _int_answer(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) * 1  # 0/1 integers


def _float_answer(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) * 1.0


def _wrong_shape(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return np.ones((3,), bool)


def _error(fn: Any) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    return info.type, str(info.value)


@pytest.mark.parametrize("mod", [_int_answer, _float_answer, _wrong_shape])
def test_a_non_bool_or_unbroadcastable_answer_gives_one_error_in_both_twins(mod: Any) -> None:
    """Refused by ``create_block_mask`` and by ``flex_attention`` (a block mask of a bool
    mod given the bad one), with the same type and text in both twins: non-bool a
    TypeError that names the dtype (PyTorch's own flex asserts ``mask.dtype must be
    torch.bool``), a shape that does not broadcast a ValueError."""
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    q, k, v = _inputs(40, 40)
    t = [torch.tensor(a) for a in (q, k, v)]
    j = [jnp.asarray(a) for a in (q, k, v)]
    made_t = _error(lambda: tf.create_block_mask(mod, B, H, 40, 40, device="cpu", BLOCK_SIZE=BLOCK))
    made_j = _error(lambda: jf.create_block_mask(mod, B, H, 40, 40, BLOCK_SIZE=BLOCK))
    assert made_t == made_j
    assert made_t[1].startswith("create_block_mask: mask_mod")
    tbm = dataclasses.replace(tf.create_block_mask(mods.causal, B, H, 40, 40, device="cpu", BLOCK_SIZE=BLOCK),
                              mask_mod=mod)
    jbm = dataclasses.replace(jf.create_block_mask(mods.causal, B, H, 40, 40, BLOCK_SIZE=BLOCK), mask_mod=mod)
    called_t = _error(lambda: tf.flex_attention(*t, block_mask=tbm))
    called_j = _error(lambda: jf.flex_attention(*j, block_mask=jbm))
    assert called_t == called_j
    assert called_t[1].startswith("flex_attention: mask_mod")
    kind = ValueError if mod is _wrong_shape else TypeError
    assert made_t[0] is kind and called_t[0] is kind
    if kind is TypeError:
        assert ("got integers" if mod is _int_answer else "got floating-point numbers") in made_t[1]
