"""Flex attention's checks of what the mods capture and of hand-made block masks (issue
55), in both twins with one error text (``attention_spec``'s), before any work.

Found by a probe: a library mod's captured array shorter than the call's sizes (ALiBi's 2
slopes for 4 heads: JAX clamped the head index, heads 2 and 3 silently took head 1's
slope; PyTorch raised a bare IndexError), document ids or prefix lengths that do not fit
(IndexErrors whose texts differed between the twins), a block mask made for B=None over
per-example documents (1.5 apart with and without ``return_lse``), a block mask without a
mask mod (every key, or an AssertionError) and full-block counts without their indices.

Tiny shapes: B 2, H 4, L = S = 16, blocks of 8.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from attention_spec import mods
from attention_spec.flex import BlockMask
from parity_tests import reference
from parity_tests.tolerances import FLEX_ORACLE
from tests.support import needs_both

pytestmark = needs_both

B, H, L, E = 2, 4, 16, 8
BLOCK = 8
RNG = np.random.default_rng(55)
Q = RNG.standard_normal((B, H, L, E)).astype(np.float32)
IDS = np.array([[0] * 8 + [1] * 8, [0] * 3 + [1] * 13])  # (B, L): a different packing per example
SHORT_IDS = IDS[:, :8]  # 8 positions for 16 queries


@pytest.fixture(scope="module")
def twins() -> tuple[tuple[Any, Callable[[np.ndarray], Any]], ...]:
    """(functional module, array maker) of each twin."""
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    return ((tf, torch.as_tensor), (jf, jnp.asarray))


def _call(f: Any, mk: Any, score_mod: Any = None, block_mask: Any = None, kv_len: int = L, **kw: Any) -> Any:
    kv = mk(Q[:, :, :1].repeat(kv_len, axis=2))
    return f.flex_attention(mk(Q), kv, kv, score_mod=score_mod, block_mask=block_mask, **kw)


def _made(f: Any, mask_mod: Any, batch: int | None = B, kv_len: int = L) -> Any:
    return f.create_block_mask(mask_mod, batch, None, L, kv_len, BLOCK_SIZE=BLOCK)


def _swapped(f: Any, made_for: Any, mask_mod: Any, batch: int | None = B) -> Any:
    """A block mask made for ``made_for`` whose mask mod is then ``mask_mod`` (a hand-made
    block mask: what ``create_block_mask`` would refuse reaches the call)."""
    return dataclasses.replace(_made(f, made_for, batch), mask_mod=mask_mod)


def _half_full(f: Any, drop: str) -> Any:
    made = _made(f, mods.causal, None)
    return BlockMask(made.kv_num_blocks, made.kv_indices,
                     None if drop == "counts" else made.full_kv_num_blocks,
                     None if drop == "indices" else made.full_kv_indices,
                     BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mods.causal, seq_lengths=(L, L))


def _axis(where: str, label: str, shape: str, axis: int, what: str, want: str) -> str:
    return (rf"^{where} {label} has shape \({shape}\): its axis {axis} is indexed by the {what}, so it must "
            rf"have {want}")


ONE_TABLE = (r"^{}: a block mask made for B=1 or None \(one table for every example\) cannot serve {} documents: "
             r"doc_ids of shape \(2, 16\), which holds 2 examples' own entries \(each example its own blocks\): "
             r"make it with B=2$")

# id -> (a call of (functional module, array maker), the text both twins raise).
BAD: dict[str, tuple[Callable[[Any, Any], Any], str]] = {
    # (a) score mods' arrays against the call's heads (JAX gave heads 2 and 3 head 1's slope)
    "alibi-2-slopes-4-heads": (lambda f, mk: _call(f, mk, mods.alibi([0.5, 0.25])),
                               _axis("flex_attention: score_mod", "alibi: slopes", "2,", 0, "query head",
                                     r"4 entries \(H=4\)$")),
    "alibi-2-slopes-with-lse": (lambda f, mk: _call(f, mk, mods.alibi([0.5, 0.25]), return_lse=True),
                                _axis("flex_attention: score_mod", "alibi: slopes", "2,", 0, "query head",
                                      r"4 entries \(H=4\)$")),
    "bias-table-2-rows": (lambda f, mk: _call(f, mk, mods.bias_table(np.zeros((2, 5)))),
                          _axis("flex_attention: score_mod", "bias_table: table", "2, 5", 0, "query head",
                                r"4 entries \(H=4\)$")),
    "chain-part-alibi": (lambda f, mk: _call(f, mk, mods.chain(mods.softcap(2.0), mods.alibi([0.5, 0.25]))),
                         _axis("flex_attention: score_mod", "chain part 2, alibi: slopes", "2,", 0, "query head",
                               r"4 entries \(H=4\)$")),
    # (b) mask mods' arrays, where create_block_mask evaluates them ...
    "documents-8-ids-16-queries": (lambda f, mk: _made(f, mods.documents(SHORT_IDS)),
                                   _axis("create_block_mask: mask_mod", "documents: doc_ids", "2, 8", 1,
                                         "query position", r"16 entries \(Q_LEN=16\)$")),
    "documents-no-kv-ids-S24": (lambda f, mk: _made(f, mods.documents(IDS), kv_len=24),
                                _axis("create_block_mask: mask_mod", "documents: doc_ids", "2, 16", 1,
                                      "key position", r"24 entries \(KV_LEN=24\); without kv_doc_ids the keys read "
                                      r"doc_ids too: give kv_doc_ids \(B, KV_LEN\)")),
    "prefix-lm-1-length-B2": (lambda f, mk: _made(f, mods.prefix_lm([3])),
                              _axis("create_block_mask: mask_mod", "prefix_lm: prefix_length", "1,", 0, "example",
                                    r"2 entries \(B=2\)$")),
    "and-masks-part-documents": (lambda f, mk: _made(f, mods.and_masks(mods.causal, mods.documents(SHORT_IDS))),
                                 _axis("create_block_mask: mask_mod", "and_masks part 2, documents: doc_ids", "2, 8",
                                       1, "query position", r"16 entries \(Q_LEN=16\)$")),
    # ... and at the call (a hand-made block mask), on either route (named options or flex)
    "documents-8-ids-at-the-call": (lambda f, mk: _call(f, mk, block_mask=_swapped(f, mods.documents(IDS),
                                                                                   mods.documents(SHORT_IDS))),
                                    _axis("flex_attention: block_mask.mask_mod", "documents: doc_ids", "2, 8", 1,
                                          "query position", r"16 entries \(Q_LEN=16\)$")),
    "prefix-lm-at-the-call-with-lse": (lambda f, mk: _call(f, mk, block_mask=_swapped(f, mods.causal, mods.prefix_lm(
        [3])), return_lse=True), _axis("flex_attention: block_mask.mask_mod", "prefix_lm: prefix_length", "1,", 0,
                                       "example", r"2 entries \(B=2\)$")),
    # (c) one table for every example, over documents packed differently per example
    "documents-block-mask-B-None": (lambda f, mk: _made(f, mods.documents(IDS), None),
                                    ONE_TABLE.format("create_block_mask", "mask_mod")),
    "documents-block-mask-B1-at-the-call": (lambda f, mk: _call(f, mk, block_mask=_swapped(
        f, mods.documents(IDS[:1]), mods.documents(IDS), None)),
        ONE_TABLE.format("flex_attention", "block_mask.mask_mod")),
    "documents-block-mask-B1-at-the-call-with-lse": (lambda f, mk: _call(f, mk, block_mask=_swapped(
        f, mods.documents(IDS[:1]), mods.documents(IDS), None), return_lse=True),
        ONE_TABLE.format("flex_attention", "block_mask.mask_mod")),
    # (e) full blocks half given
    "full-counts-without-indices": (lambda f, mk: _half_full(f, "indices"),
                                    r"^BlockMask: full_kv_num_blocks and full_kv_indices must be both given or both "
                                    r"None; got full_kv_num_blocks without full_kv_indices$"),
    "full-indices-without-counts": (lambda f, mk: _half_full(f, "counts"),
                                    r"^BlockMask: full_kv_num_blocks and full_kv_indices must be both given or both "
                                    r"None; got full_kv_indices without full_kv_num_blocks$"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_mods_and_block_masks_give_one_error_text_in_both_twins(case: str, twins: Any) -> None:
    call, text = BAD[case]
    found = []
    for f, mk in twins:
        with pytest.raises(ValueError, match=text) as info:
            call(f, mk)
        found.append((info.type, str(info.value)))
    assert found[0] == found[1]


def test_the_oracle_checks_the_same_sizes() -> None:
    k = Q[:, :, :1].repeat(L, axis=2)
    for kw, text in (({"score_mod": mods.alibi([0.5, 0.25])}, BAD["alibi-2-slopes-4-heads"][1]),
                     ({"mask_mod": mods.documents(SHORT_IDS)},
                      _axis("flex_attention: mask_mod", "documents: doc_ids", "2, 8", 1, "query position",
                            r"16 entries \(Q_LEN=16\)$"))):
        with pytest.raises(ValueError, match=text):
            reference.flex_attention(Q, k, k, scale=1.0, **kw)


def test_a_modules_mod_is_checked_at_the_positions_it_sees() -> None:
    """A module's mod sees key positions (``Positioned``: q_idx + offset): its query axis
    needs at least Q_LEN + offset entries; the arrays of the call's own mask broadcast."""
    seen = mods.Positioned(mods.documents(IDS), 4)
    with pytest.raises(ValueError, match=_axis("flex_attention: mask_mod", "documents: doc_ids", "2, 16",
                                               1, "query position",
                                               r"at least 20 entries \(Q_LEN=16, at key positions from 4\)$")):
        mods.check_sizes(seen, B, H, L, 20, where="flex_attention: mask_mod")
    mods.check_sizes(seen, B, H, 12, 16, where="flex_attention: mask_mod")
    own = mods.CallMask(mask=np.ones((1, 1, L, L), bool))
    own.check_sizes(B, H, L, L, where="flex_attention: mask_mod")
    with pytest.raises(ValueError, match=r"the call's mask: mask has shape \(1, 3, 16, 16\): its axis 1 is indexed "
                                         r"by the query head, so it must have 1 or 4 entries \(H=4\)$"):
        mods.CallMask(mask=np.ones((1, 3, L, L), bool)).check_sizes(B, H, L, L, where="flex_attention: mask_mod")


def test_a_block_mask_without_a_mask_mod_keeps_its_blocks(twins: Any) -> None:
    """(d) No mask mod: PyTorch's ``noop_mask``, every key of the listed blocks, with and
    without ``return_lse`` (before: every key, or a bare AssertionError).  A causal block
    mask's blocks: query block i sees key blocks 0..i whole."""
    k = RNG.standard_normal((B, H, L, E)).astype(np.float32)
    want_out, want_lse = reference.flex_attention(Q, k, k, mask_mod=lambda b, h, i, j: j < BLOCK * (i // BLOCK + 1),
                                                  scale=1 / math.sqrt(E))
    for f, mk in twins:
        made = _made(f, mods.causal, None)
        bare = dataclasses.replace(made, mask_mod=None)
        out = f.flex_attention(mk(Q), mk(k), mk(k), block_mask=bare)
        np.testing.assert_allclose(np.asarray(out), want_out, rtol=FLEX_ORACLE["float32"].rtol,
                                   atol=FLEX_ORACLE["float32"].atol)
        out_lse, lse = f.flex_attention(mk(Q), mk(k), mk(k), block_mask=bare, return_lse=True)
        for got, want in ((out_lse, want_out), (lse, want_lse)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=FLEX_ORACLE["float32"].rtol,
                                       atol=FLEX_ORACLE["float32"].atol)
        assert bare.mask_mod is mods.noop_mask
        assert f.flex_route(mk(Q), mk(k), mk(k), block_mask=bare).path == "flex"


def test_documents_with_a_table_per_example_agree_with_and_without_lse(twins: Any) -> None:
    """(c) The block mask that per-example documents need (B=2): one answer, the oracle's,
    whether the call runs as ``dot_product_attention(segment_ids=)`` or on the flex path."""
    k = RNG.standard_normal((B, H, L, E)).astype(np.float32)
    mask_mod = mods.documents(IDS)
    want_out, _ = reference.flex_attention(Q, k, k, mask_mod=mask_mod, scale=1 / math.sqrt(E))
    for f, mk in twins:
        bm = _made(f, mask_mod)
        for got in (f.flex_attention(mk(Q), mk(k), mk(k), block_mask=bm),
                    f.flex_attention(mk(Q), mk(k), mk(k), block_mask=bm, return_lse=True)[0]):
            np.testing.assert_allclose(np.asarray(got), want_out, rtol=FLEX_ORACLE["float32"].rtol,
                                       atol=FLEX_ORACLE["float32"].atol)


def test_a_hand_made_block_mask_is_read_even_where_its_mod_stands_for_an_option(twins: Any) -> None:
    """One call, one answer: a block mask made by hand whose mask mod is ``mods.causal``
    and whose tables skip a block the mod allows (query block 1 without key block 0). The
    call follows the tables and the mod with and without ``return_lse`` (before: without
    it, the call ran as ``dot_product_attention(causal=True)``, every causal key)."""
    k = RNG.standard_normal((B, H, L, E)).astype(np.float32)
    want_out, _ = reference.flex_attention(Q, k, k, mask_mod=lambda b, h, i, j: (j <= i) & ~((i >= BLOCK) & (j < BLOCK)),
                                           scale=1 / math.sqrt(E))
    for f, mk in twins:
        made = _made(f, mods.causal, None)
        none = np.zeros((1, 1, 2), np.int32)
        skipping = BlockMask(made.kv_num_blocks, made.kv_indices, mk(none), mk(np.zeros((1, 1, 2, 2), np.int32)),
                             BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mods.causal, seq_lengths=(L, L))
        for got in (f.flex_attention(mk(Q), mk(k), mk(k), block_mask=skipping),
                    f.flex_attention(mk(Q), mk(k), mk(k), block_mask=skipping, return_lse=True)[0]):
            np.testing.assert_allclose(np.asarray(got), want_out, rtol=FLEX_ORACLE["float32"].rtol,
                                       atol=FLEX_ORACLE["float32"].atol)
        assert f.flex_route(mk(Q), mk(k), mk(k), block_mask=skipping).path == "flex"
        assert f.flex_route(mk(Q), mk(k), mk(k), block_mask=made).path != "flex"  # made for its mod: folds
