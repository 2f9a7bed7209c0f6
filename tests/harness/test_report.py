"""``python -m parity_tests``: the report runs, shows each case's path, writes its JSON and
plot, reports refusals by design, and its exit status is non-zero when any case fails."""

from __future__ import annotations

import json
import re

from parity_tests.__main__ import main
from parity_tests.harness import Finding
from tests.support import needs_both

pytestmark = needs_both


def test_report_passes_and_writes_json_and_plot(tmp_path, capsys):
    report, plot = tmp_path / "report.json", tmp_path / "weights.png"
    status = main(["--quick", "--variant", "causal", "--dtype", "float32", "--json", str(report),
                   "--plot", str(plot)])
    assert status == 0
    cases = json.loads(report.read_text())["cases"]
    assert cases and all(c["ok"] and c["variant"] == "causal" and c["dtype"] == "float32" for c in cases)
    assert all(any(f["name"] == "grad input[0]" for f in c["findings"]) for c in cases)
    assert all(c["implementation"] in c["id"] for c in cases)
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "passed, 0 failed" in out and "tolerance needed" in out
    # every case line names its path in a column of its own
    lines = [line for line in out.splitlines() if line.startswith("causal-")]
    assert lines and all(re.match(r"\S+ +(reference|fused|blockwise|auto) ", line) for line in lines)


def test_report_shows_refusals_by_design_and_the_functional_cores(capsys):
    assert main(["--quick", "--variant", "simplified-sum", "--variant", "fn", "--implementation", "fused",
                 "--no-grads"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^simplified-sum-\S+-fused-\S+ +fused .* refused \(normalization='sum'\)", out, re.M), out
    assert re.search(r"^fn-\S+-fused +fused .* pass", out, re.M), out


def test_report_exits_non_zero_on_a_mismatch(monkeypatch, capsys):
    import parity_tests.matrix as matrix

    real = matrix.run_case

    def broken(case, grads=True):
        result = real(case, grads=grads)
        result.parity.append(Finding("output", False, 1.0, 1.0, (0, 0, 0), 0.5, 1.5, 1e-5, 1e-5))
        return result

    monkeypatch.setattr(matrix, "run_case", broken)
    assert main(["--quick", "--variant", "causal", "--dtype", "float32", "--no-grads"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "output[0, 0, 0]: torch 0.5 vs flax 1.5" in out


def test_report_rejects_an_empty_selection(capsys):
    assert main(["--quick", "--variant", "head", "--dtype", "float16"]) == 2
