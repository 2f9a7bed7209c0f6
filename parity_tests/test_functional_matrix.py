"""The functional cores in the matrix: ``dot_product_attention`` of both frameworks on
q, k, v directly, with q_len != kv_len, causal masking together with masks and
``kv_lengths``, on every path and in float32, bfloat16 and float16: outputs and gradients
w.r.t. q, k and v, twin against twin and each against the float64 references.

Causal is top-left aligned (DESIGN, "Masks"): query i may attend to keys 0..i whatever
kv_len is.  Where q_len != kv_len, bottom-right alignment (query i sees keys
0..i + kv_len - q_len) differs, and the cases below are chosen so that a path that
aligned it that way would fail; ``test_the_table_would_catch_a_flipped_causal_alignment``
checks that this stays true of the table.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from parity_tests.cases import (
    DTYPES,
    FN_LENGTHS,
    FN_MASKS,
    FN_SHAPES,
    IMPLEMENTATIONS,
    functional_matrix,
    quick_functional,
)
from parity_tests.conftest import needs_both

CASES = functional_matrix()


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
        if not case.causal or case.q_len == case.kv_len:
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


@needs_both
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
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
