"""The parity matrix of ``cases.py``: every case, forward and gradients, on its path, twin
against twin and each twin against the float64 references (the same runs as
``python -m parity_tests``); and the design itself: every pair of axis values that a path
can run is covered, and every refusal by design has its case."""

from __future__ import annotations

import itertools

import pytest

from parity_tests.cases import (
    AXES,
    BATCHES,
    DIRECTIONS,
    DTYPES,
    HEADS,
    IMPLEMENTATIONS,
    MASKS,
    SEQS,
    VARIANTS,
    _valid,
    matrix,
    quick,
)
from tests.support import needs_both

CASES = matrix()
QUICK = {c.id for c in quick()}
NUMBERS = [c for c in CASES if c.refusal is None]


def _values(case):
    return (case.variant, case.batch, case.heads, case.seq, case.mask, case.dtype, case.direction,
            case.implementation)


def test_every_feasible_pair_of_axis_values_is_covered():
    axes = [tuple(VARIANTS), BATCHES, HEADS, SEQS, MASKS, DTYPES, DIRECTIONS, IMPLEMENTATIONS]
    rows = {_values(c) for c in NUMBERS}
    for i, j in itertools.combinations(range(len(axes)), 2):
        for a, b in itertools.product(axes[i], axes[j]):
            if _valid({i: a, j: b}):
                assert any(r[i] == a and r[j] == b for r in rows), f"{AXES[i]}={a!r} with {AXES[j]}={b!r}"
    assert all(_valid(dict(enumerate(r))) for r in rows)
    assert len({c.id for c in CASES}) == len(CASES)


def test_every_path_runs_every_variant_that_it_can_and_refuses_the_others():
    for variant in VARIANTS.values():
        for path in IMPLEMENTATIONS:
            cases = [c for c in CASES if c.variant == variant.id and c.implementation == path]
            assert cases, (variant.id, path)
            refused = variant.refusal(path)
            assert all(c.refusal == refused for c in cases)
    # the design refuses exactly what DESIGN says an explicit fast path cannot honour
    # (sinks: SDPA and jax.nn.dot_product_attention; the JAX twin's CPU kernel may take them;
    # a flex mod that stands for no named option: the kernels, not the flex path nor the math)
    assert {(c.variant, c.implementation) for c in CASES if c.refusal} == {
        ("simplified-sum", "fused"), ("simplified-sum", "blockwise"), ("mha-sinks-gqa", "fused"),
        ("mha-flex-alibi-gqa", "fused"), ("mha-flex-alibi-gqa", "blockwise"),
    }


def test_ids_show_the_path_and_weights_are_compared_on_the_reference_path_only():
    for case in CASES:
        assert f"-{case.implementation}-{case.direction}" in case.id
        assert case.weights is (case.implementation == "reference")


def test_quick_runs_every_path_and_every_variant():
    cases = quick()
    assert {c.variant for c in cases} == set(VARIANTS)
    assert {c.implementation for c in cases if c.refusal is None} == set(IMPLEMENTATIONS)
    assert {c.id for c in cases} <= {c.id for c in CASES}


@needs_both
@pytest.mark.parametrize(
    "case",
    # the quick tier (``-m "not slow"``) runs the --quick subset: each variant once, every path
    [pytest.param(c, id=c.id, marks=() if c.id in QUICK else pytest.mark.slow) for c in CASES],
)
def test_case(case):
    from parity_tests.matrix import run_case

    result = run_case(case)
    assert result.ok, "\n".join(result.problems + [f.describe() for f in result.findings if not f.ok])
    if case.refusal is not None:
        ran = {side for side in ("torch", "flax") if f"{side} output vs oracle" in [f.name for f in result.findings]}
        assert set(result.refusals) | ran == {"torch", "flax"} and not set(result.refusals) & ran
        assert all(case.spec.may_honour(side) for side in ran)
        return
    names = [f.name for f in result.findings]
    assert "output" in names and "grad input[0]" in names
    assert "torch output vs oracle" in names and "flax grad input[0] vs float64" in names
    assert ("attention weights" in names) is case.weights
    assert ("flax weights vs oracle" in names) is case.weights
