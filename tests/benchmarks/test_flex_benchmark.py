"""``python -m benchmarks.flex`` on a tiny configuration: every system runs (both twins'
flex with a causal and a full block mask, forward and forward + backward, torch.compile's
flex forward, flex with named-option mods and the named option), their outputs agree with
ours-PyTorch's, and the record holds the times, the ratios the issue sets and the machine."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import needs_both


@needs_both
def test_every_system_runs_agrees_and_the_record_holds_the_ratios(tmp_path: Path) -> None:
    from benchmarks import flex

    record = flex.main(["--seq", "32", "--heads", "2", "--head-dim", "8", "--block", "8", "--runs", "1",
                        "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "flex.json").read_text())
    assert saved["times_ms"] == record["times_ms"] and saved["environment"]["device"]
    systems = {name.rsplit(" ", 1)[0] for name in saved["times_ms"]}
    assert systems == {"ours-jax-flex causal", "ours-jax-flex full", "ours-torch-flex causal", "ours-torch-flex full",
                       "torch-compile-flex causal", "ours-jax-flex named", "ours-jax named option",
                       "ours-torch-flex named", "ours-torch named option"}
    assert all(t > 0 for t in saved["times_ms"].values())
    assert all(d <= flex.AGREEMENT for d in saved["max_abs_diff_vs_ours_torch"].values())
    assert len(saved["max_abs_diff_vs_ours_torch"]) == 5  # two twins x two masks, and torch.compile's
    assert set(saved["ratios"]) == {
        "ours-jax-flex causal / full, forward + backward", "ours-torch-flex causal / full, forward + backward",
        "ours-jax-flex named / named option, forward + backward",
        "ours-torch-flex named / named option, forward + backward",
        "ours-jax flex / torch.compile flex, forward (causal)"}
    assert "Ratios" in (tmp_path / "flex.md").read_text()


def test_the_benchmarks_entry_point_runs_the_flex_benchmark(tmp_path: Path, monkeypatch) -> None:
    """``python -m benchmarks --flex`` is ``python -m benchmarks.flex``, given its options."""
    from benchmarks import __main__ as entry
    from benchmarks import flex

    given: list[list[str]] = []
    monkeypatch.setattr(flex, "main", lambda argv=None: given.append(list(argv or [])))
    entry.main(["--flex", "--runs", "3", "--seq", "512", "--out", str(tmp_path)])
    assert given == [["--runs", "3", "--seq", "512", "--out", str(tmp_path)]]
