"""Issue 55: every benchmark checks each system's output, ours included, against the float64
oracle (``benchmarks/oracle_check.py``).  An outside system made wrong on purpose is recorded
as wrong (its error, the tolerance, PyTorch's CPU capability, the ISA), left out of every
ratio, and the run goes on; one of ours made wrong fails the run, naming it.  The main
benchmark's workers run in this process here, so that the system made wrong reaches them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import oracle_check
from benchmarks.configs import Config, Mode
from tests.support import needs_both

TINY = Config(batch=1, seq=16, heads=2, head_dim=8, causal=True, dtype="float32")


def test_rows_are_all_where_they_fit_else_a_few_within_the_budget() -> None:
    assert oracle_check.rows(16, 16, 2, causal=True) == list(range(16))
    # causal, 8 heads, 1024 keys: row i is 8 (i + 1) pairs; in 20000, the last (8192), the first, the middle
    # (4104), the first quarter (2056) and the second row; not the last quarter (6152), nor the last but one
    assert oracle_check.rows(1024, 1024, 8, causal=True, budget=20000) == [0, 1, 256, 512, 1023]
    # non-causal: each row is 8192 pairs; two fit
    assert oracle_check.rows(1024, 1024, 8, causal=False, budget=20000) == [0, 1023]
    # one row past the budget: still one row, the one that sees every key
    assert oracle_check.rows(1024, 1024, 8, causal=False, budget=10) == [1023]
    # decoding: rows are new tokens after a prompt of 1000
    assert oracle_check.rows(4, 1004, 1, causal=True, offset=1000, budget=3100) == [0, 2, 3]


def test_a_verdict_holds_the_error_the_tolerance_and_the_machine() -> None:
    want = np.linspace(-1, 1, 12).reshape(3, 4)
    right = oracle_check.verdict("torch-sdpa", want + 1e-7, want, "float32", framework="torch")
    assert right["ok"] and not right["ours"] and right["max_abs_error"] == pytest.approx(1e-7)
    assert right["tolerance"] == {"rtol": 1e-5, "atol": 1e-5} and {"device", "torch_cpu_capability", "isa"} <= set(right)
    checks = oracle_check.Checks()
    assert not checks.check("torch-sdpa", want + 1.0, want, "float32")
    assert not checks.check("torch-sdpa-nan", np.full_like(want, np.nan), want, "float32")
    assert [v["system"] for v in checks.wrong] == ["torch-sdpa", "torch-sdpa-nan"] and checks.is_wrong("torch-sdpa")
    assert (checks.wrong[1]["max_abs_error"], checks.wrong[1]["non_finite"]) == (float("inf"), 12)
    with pytest.raises(AssertionError, match=r"ours-torch-sdpa \(ours\) is wrong against the float64 oracle"):
        checks.check("ours-torch-sdpa", want + 1.0, want, "float32")
    text = oracle_check.wrong_text(checks.wrong)
    assert "| torch-sdpa | 1 | 1e-05 / 1e-05 | float32 |" in text and "| torch-sdpa-nan | inf (12 NaN or inf) |" in text


def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's workers measure in this process."""
    from benchmarks import runner
    from benchmarks.measure import measure

    def worker(system: str, configs: list[Config], mode: Mode, *_: Any) -> tuple[int, list[dict[str, Any]]]:
        return 0, [{"measurement": measure(system, c, runs=mode.runs, warmup=mode.warmup, backward=mode.backward)}
                   for c in configs]

    monkeypatch.setattr(runner, "_worker", worker)


def _garbage(monkeypatch: pytest.MonkeyPatch, system: str) -> None:
    """``system``'s cases give an output 1.0 off."""
    from benchmarks import systems

    real = systems._BUILDERS[system]

    def build(config: Config) -> Any:
        case = real(config)
        output = case.output
        case.output = lambda: output() + 1.0
        return case

    monkeypatch.setitem(systems._BUILDERS, system, build)


@needs_both
def test_an_outside_system_that_is_wrong_is_recorded_and_left_out_of_the_ratios(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import run

    _in_process(monkeypatch)
    _garbage(monkeypatch, "flax-nnx-mha")
    mode = Mode("tiny", (TINY,), ("ours-jax-fused", "flax-nnx-mha", "ours-torch-sdpa"), runs=1, backward=False,
                warmup=0)
    results = run(mode, out_dir=tmp_path, echo=lambda _: None)
    by_system = {m["system"]: m for m in results["measurements"]}
    assert [by_system[s]["oracle"]["ok"] for s in mode.systems] == [True, False, True]
    assert by_system["flax-nnx-mha"]["fwd"]["median_ms"] > 0  # timed all the same, and marked
    saved = json.loads((tmp_path / "tiny.json").read_text())
    (wrong,) = saved["wrong"]
    assert (wrong["system"], wrong["label"], wrong["ours"]) == ("flax-nnx-mha", TINY.label, False)
    assert wrong["max_abs_error"] == pytest.approx(1.0, abs=1e-4) and wrong["tolerance"] == {"rtol": 1e-5, "atol": 1e-5}
    # a JAX worker reports PyTorch's capability only where PyTorch is loaded (in process: by an earlier test)
    import sys
    loaded = sys.modules.get("torch")
    assert wrong["torch_cpu_capability"] in (None, loaded and loaded.backends.cpu.get_cpu_capability())
    assert wrong["isa"] == saved["env"]["cpu"]["isa"]
    text = (tmp_path / "tiny.md").read_text()
    assert f"{TINY.label}: ours-jax-fused / ours-torch-sdpa" in text
    assert "/ flax-nnx-mha" not in text  # in no ratio
    assert "Wrong on this machine" in text and f"| flax-nnx-mha at {TINY.label} | 1 |" in text
    assert "wrong: 1 off the float64 oracle (left out of the ratios)" in text


@needs_both
def test_one_of_ours_that_is_wrong_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import run

    _in_process(monkeypatch)
    _garbage(monkeypatch, "ours-torch-sdpa")
    mode = Mode("tiny", (TINY,), ("ours-torch-sdpa",), runs=1, backward=False, warmup=0)
    with pytest.raises(AssertionError, match=r"ours-torch-sdpa \(ours\) is wrong against the float64 oracle"):
        run(mode, out_dir=tmp_path, echo=lambda _: None)
    (saved,) = json.loads((tmp_path / "tiny.json").read_text())["measurements"]  # what was measured is kept
    assert not saved["oracle"]["ok"]
