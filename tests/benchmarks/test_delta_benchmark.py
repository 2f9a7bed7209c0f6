"""``python -m benchmarks.delta`` at a tiny size: every system checked against the float64
oracle and timed in every phase, the record and its table written; an outside system made
wrong is recorded and left out of the ratios, one of ours made wrong fails the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both

TINY = {"length": 24, "heads": 2, "dim": 4, "chunk": 8, "runs": 1, "check_tokens": 12}


def test_a_tiny_run_times_every_system_and_writes_the_record(tmp_path: Path) -> None:
    from benchmarks import delta

    record = delta.run(**TINY, out=tmp_path)
    assert set(record["seconds"]) == set(delta.SYSTEMS)
    assert all(set(p) == set(delta.PHASES) for p in record["seconds"].values())
    assert not record["wrong"] and all(v["ok"] for v in record["verdicts"])
    assert set(record["ratio_to_transformers"]) == {"ours-jax", "ours-torch"}
    assert sorted(map(int, record["jax_memory_bytes"])) == [12, 24]  # S/4 = 6 is shorter than a chunk
    written = json.loads((tmp_path / "delta.json").read_text())
    assert written["shape"]["length"] == 24
    assert "| ours-jax |" in (tmp_path / "delta.md").read_text()


def _wrong_output(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    from benchmarks import delta

    made = getattr(delta, name)

    def wrong(*args: Any, **kwargs: Any) -> dict[str, Any]:
        system = made(*args, **kwargs)
        right = system["output"]
        return {**system, "output": lambda: right() + np.float32(1.0)}

    monkeypatch.setattr(delta, name, wrong)


def test_a_wrong_outside_system_is_recorded_and_in_no_ratio(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from benchmarks import delta

    made = delta._torch_system

    def wrong(x: Any, chunk: int, theirs: bool) -> dict[str, Any]:
        system = made(x, chunk, theirs)
        if theirs:
            right = system["output"]
            system = {**system, "output": lambda: right() + np.float32(1.0)}
        return system

    monkeypatch.setattr(delta, "_torch_system", wrong)
    record = delta.run(**TINY, out=tmp_path, memory=False)
    assert [v["system"] for v in record["wrong"]] == ["transformers"]
    assert record["ratio_to_transformers"] == {}
    assert "Wrong on this machine" in (tmp_path / "delta.md").read_text()


def test_one_of_ours_wrong_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import delta

    _wrong_output(monkeypatch, "_jax_system")
    with pytest.raises(AssertionError, match="ours-jax \\(ours\\) is wrong against the float64 oracle"):
        delta.run(**TINY, memory=False, systems=("ours-jax",))
