"""The parity matrix of ``cases.py``: every case, forward and gradients, twin against twin
and each twin against the float64 references (the same runs as ``python -m parity_tests``)."""

from __future__ import annotations

import pytest

from parity_tests.cases import DTYPES, HEADS, MASKS, SEQS, VARIANTS, matrix
from parity_tests.conftest import needs_both

CASES = matrix()


def test_every_value_of_every_axis_appears():
    assert {c.variant for c in CASES} == set(VARIANTS)
    assert {c.heads for c in CASES} == set(HEADS)
    assert {c.seq for c in CASES} == set(SEQS)
    assert {c.mask for c in CASES} == set(MASKS)
    assert {c.dtype for c in CASES} == set(DTYPES)
    assert {c.direction for c in CASES} == {"pt2fx", "fx2pt"}
    assert len({c.id for c in CASES}) == len(CASES)


@needs_both
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(case):
    from parity_tests.matrix import run_case

    result = run_case(case)
    assert result.ok, "\n".join(f.describe() for f in result.findings if not f.ok)
    names = [f.name for f in result.findings]
    assert "output" in names and "attention weights" in names and "grad input[0]" in names
    assert "torch output vs oracle" in names and "flax grad input[0] vs float64" in names
