"""``python -m parity_tests``: the report runs, writes its JSON and plot, and its exit
status is non-zero when any case fails."""

from __future__ import annotations

import json

from parity_tests.__main__ import main
from parity_tests.conftest import needs_both
from parity_tests.harness import Finding

pytestmark = needs_both


def test_report_passes_and_writes_json_and_plot(tmp_path, capsys):
    report, plot = tmp_path / "report.json", tmp_path / "weights.png"
    status = main(["--quick", "--variant", "sa2", "--dtype", "float32", "--json", str(report), "--plot", str(plot)])
    assert status == 0
    cases = json.loads(report.read_text())["cases"]
    assert cases and all(c["ok"] and c["variant"] == "sa2" and c["dtype"] == "float32" for c in cases)
    assert all(any(f["name"] == "grad input[0]" for f in c["findings"]) for c in cases)
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "passed, 0 failed" in out and "tolerance needed" in out


def test_report_exits_non_zero_on_a_mismatch(monkeypatch, capsys):
    import parity_tests.matrix as matrix

    real = matrix.run_case

    def broken(case, grads=True):
        result = real(case, grads=grads)
        result.parity.append(Finding("output", False, 1.0, 1.0, (0, 0, 0), 0.5, 1.5, 1e-5, 1e-5))
        return result

    monkeypatch.setattr(matrix, "run_case", broken)
    assert main(["--quick", "--variant", "sa2", "--dtype", "float32", "--no-grads"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "output[0, 0, 0]: torch 0.5 vs flax 1.5" in out


def test_report_rejects_an_empty_selection(capsys):
    assert main(["--quick", "--variant", "head", "--dtype", "float16"]) == 2
