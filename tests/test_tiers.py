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


def test_budgets_follow_the_cpus_kind_not_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX-512 CPU gets its kind's budgets whatever build is timed on it (the AVX2 build
    under TWIN_ATTENTION_MARCH included): AMD's Zen 4 / Zen 5 one, Intel's Xeons another; a
    CPU without AVX-512 the slowest kind's, whose whole .ci/run is half CI's limit of 5,400 s."""
    from tests import budgets

    monkeypatch.setenv("TWIN_ATTENTION_MARCH", "x86-64-v3")
    monkeypatch.setattr(budgets, "cpu_flags", lambda: {"sse2", "avx", "avx2", "avx512f"})
    monkeypatch.setattr(budgets, "cpu_vendor", lambda: "AuthenticAMD")
    assert (budgets.budgets().quick, budgets.budgets().default, budgets.budgets().ci) == (180, 900, 1200)
    monkeypatch.setattr(budgets, "cpu_vendor", lambda: "GenuineIntel")  # Intel's Xeons: a kind of their own
    assert budgets.budgets() is budgets.XEON_AVX512
    monkeypatch.setattr(budgets, "cpu_flags", lambda: {"sse2", "avx", "avx2"})
    assert budgets.budgets() is budgets.SLOWER and budgets.SLOWER.ci == 5400 // 2
    assert budgets.cpu_description().endswith(", AVX2")
    kinds = (budgets.AVX512, budgets.XEON_AVX512, budgets.SLOWER)
    assert all(b.quick < b.default < b.ci <= budgets.SLOWER.ci for b in kinds)


def test_the_shell_form_is_what_ci_reads(capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    from tests import budgets

    budgets.main(["--shell"])
    words = dict(w.split("=", 1) for w in shlex.split(capsys.readouterr().out.replace(";", " ")))
    assert set(words) == {"cpu", "budget_quick", "budget_default", "budget_ci"}
    assert int(words["budget_ci"]) == budgets.budgets().ci and words["cpu"] == budgets.cpu_description()
