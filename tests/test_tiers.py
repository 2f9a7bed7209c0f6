"""The tiers' own rules (tests/conftest.py, tests/tiers.py): a stale entry in the quick
tier's table, or a stand-in that does not run quick, stops a whole run at collection; the
table's names are test functions, without parameters."""

from __future__ import annotations

import pytest

from tests.conftest import _check_stand_ins
from tests.tiers import QUICK_STAND_INS


def test_the_table_names_functions_not_cases() -> None:
    for left, stand_in in QUICK_STAND_INS.items():
        for name in (left, stand_in):
            assert name.startswith("tests/") and ".py::test_" in name and "[" not in name, name
        assert left != stand_in


def test_a_stale_name_or_a_stand_in_that_is_not_quick_is_refused() -> None:
    left, stand_in = next(iter(QUICK_STAND_INS.items()))
    table = {left: stand_in}
    _check_stand_ins({left, stand_in}, {stand_in}, table)  # as the table says: nothing to report
    with pytest.raises(pytest.UsageError, match="not collected"):
        _check_stand_ins({stand_in}, {stand_in}, table)  # the left-out function is gone
    with pytest.raises(pytest.UsageError, match="not in the quick tier"):
        _check_stand_ins({left, stand_in}, set(), table)  # the stand-in is slow itself
