"""The functional cores in the matrix: ``dot_product_attention`` of both frameworks on
q, k, v directly, with q_len != kv_len, causal masking together with masks and
``kv_lengths``, on every path and in float32, bfloat16 and float16: outputs and gradients
w.r.t. q, k and v, twin against twin and each against the float64 references.

Causal is top-left aligned (DESIGN, "Masks"): query i may attend to keys 0..i whatever
kv_len is.  Where q_len != kv_len, bottom-right alignment (query i sees keys
0..i + kv_len - q_len) differs, and the cases below are chosen so that a path that
aligned it that way would fail; ``test_the_table_would_catch_a_flipped_causal_alignment``
checks that this stays true of the table.

The structure block (grouped-query heads, ``window=``, ``alignment=``,
per-example ``q_offset=`` arrays, ``segment_ids=``) is appended to the table with ids
that name the options (``-kv1-win2_inf-bottomright-seg``); the cases before it keep their
ids.  ``test_the_structure_block_covers_every_option_on_every_path`` and
``test_the_structure_block_would_catch_an_ignored_option`` check what it covers.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from parity_tests.cases import (
    DTYPES,
    FN_HEADS,
    FN_KV_HEADS,
    FN_LENGTHS,
    FN_MASKS,
    FN_POSITIONS,
    FN_SEGMENTS,
    FN_SHAPES,
    FN_WINDOWS,
    IMPLEMENTATIONS,
    functional_matrix,
    ignored_options_visible,
    quick_functional,
    structure_cases,
)
from tests.support import needs_both

CASES = functional_matrix()
QUICK = {c.id for c in quick_functional()}


def test_every_pair_of_axis_values_is_covered():
    axes = {"shape": FN_SHAPES, "causal": (True, False), "mask": FN_MASKS, "lengths": FN_LENGTHS,
            "dtype": DTYPES, "implementation": IMPLEMENTATIONS}

    def value(case, axis):
        return (case.q_len, case.kv_len) if axis == "shape" else getattr(case, axis)

    for (a, av), (b, bv) in itertools.combinations(axes.items(), 2):
        for x, y in itertools.product(av, bv):
            assert any(value(c, a) == x and value(c, b) == y for c in CASES), f"{a}={x!r} with {b}={y!r}"
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.implementation for c in quick_functional()} == set(IMPLEMENTATIONS)


def _bottom_right(q_len: int, kv_len: int) -> np.ndarray:
    return np.tril(np.ones((q_len, kv_len), dtype=bool), k=kv_len - q_len)


def test_the_table_would_catch_a_flipped_causal_alignment():
    """For every path, some causal case with q_len != kv_len, a mask and lengths has an
    output that bottom-right alignment changes by far more than the case's tolerance."""
    from parity_tests import reference
    from parity_tests.tolerances import ORACLE

    caught = set()
    for case in CASES:
        if not case.causal or case.q_len == case.kv_len or case.structured:
            continue
        q, k, v, _, _ = case.inputs()
        scale = 1.0 / math.sqrt(q.shape[-1])
        top_left, _ = reference.attention(q, k, v, scale=scale, mask=case.oracle_mask(), causal=True)
        flipped_mask = case.oracle_mask() & _bottom_right(case.q_len, case.kv_len)
        flipped, _ = reference.attention(q, k, v, scale=scale, mask=flipped_mask)
        tol = ORACLE[case.dtype]
        if np.any(np.abs(top_left - flipped) > 10 * (tol.atol + tol.rtol * np.abs(top_left))):
            caught.add((case.implementation, case.mask != "none", case.lengths != "none"))
    for path in IMPLEMENTATIONS:
        assert (path, True, True) in caught, f"{path}: no case would see bottom-right alignment"


STRUCTURE = structure_cases()


def test_the_structure_block_covers_every_option_on_every_path():
    """Every pair of structure values (window, position, kv heads, segments, causal,
    path) in some case (the pairs of default values in the cases before the block, which
    use no structure option); packed segments
    only where q_len == kv_len; on every path, grouped heads meet a per-head mask."""
    assert CASES[-len(STRUCTURE):] == tuple(STRUCTURE)
    assert not any(c.structured for c in CASES[: -len(STRUCTURE)])
    assert all(c.structured for c in STRUCTURE)
    axes = {"window": FN_WINDOWS, "position": FN_POSITIONS, "kv_heads": FN_KV_HEADS, "segments": FN_SEGMENTS,
            "causal": (True, False), "implementation": IMPLEMENTATIONS}
    for (a, av), (b, bv) in itertools.combinations(axes.items(), 2):
        for x, y in itertools.product(av, bv):
            assert any(getattr(c, a) == x and getattr(c, b) == y for c in CASES), f"{a}={x!r} with {b}={y!r}"
    assert all(c.q_len == c.kv_len for c in STRUCTURE if c.segments)
    for path in IMPLEMENTATIONS:
        assert any(c.implementation == path and c.kv_heads < FN_HEADS and c.mask in ("random", "fully-masked")
                   for c in STRUCTURE), f"{path}: no grouped-heads case with a per-head mask"


def test_the_structure_block_would_catch_an_ignored_option():
    """For every path and every option value, some case's output changes by far more than
    its tolerance if the option were ignored (``ignored_options_visible``): the window
    dropped, query 0 placed at key 0 (top-left) instead of bottom-right or the
    per-example offsets, the segments dropped."""
    caught = {(case.implementation, *option) for case in STRUCTURE for option in ignored_options_visible(case)}
    for path in IMPLEMENTATIONS:
        expected = ({(path, "window", w) for w in FN_WINDOWS if w is not None}
                    | {(path, "position", p) for p in FN_POSITIONS[1:]} | {(path, "segments", True)})
        assert expected <= caught, f"{path}: an ignored option would pass: {sorted(expected - caught, key=str)}"


@needs_both
@pytest.mark.parametrize(
    "case",
    # the quick tier (``-m "not slow"``) runs the --quick subset: every path, causal and windowed
    [pytest.param(c, id=c.id, marks=() if c.id in QUICK else pytest.mark.slow) for c in CASES],
)
def test_case(case):
    from parity_tests.matrix import run_case

    result = run_case(case)
    assert result.ok, "\n".join(f.describe() for f in result.findings if not f.ok)
    names = {f.name for f in result.findings}
    assert {"output", "grad q", "grad k", "grad v"} <= names
    assert {"torch output vs oracle", "flax output vs oracle", "torch grad k vs float64",
            "flax grad v vs float64"} <= names
    if "bias" in case.extra:  # the gradient w.r.t. the bias, twin against twin and vs float64
        assert {"grad bias", "torch grad bias vs float64", "flax grad bias vs float64"} <= names
