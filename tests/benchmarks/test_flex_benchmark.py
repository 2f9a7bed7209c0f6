"""``python -m benchmarks.flex`` on a tiny configuration: every system runs (both twins'
flex with a causal and a full block mask, forward and forward + backward, torch.compile's
flex forward, flex with named-option mods and the named option), each output is checked
against the float64 oracle, and the record holds the times, the ratios the issue sets and the
machine.  torch.compile's flex is wrong where PyTorch's CPU kernels are AVX2
(``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 CPU too): it is then recorded as wrong and its
ratio is absent; an outside system made wrong is recorded so, and one of ours fails the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import needs_both

TINY = ["--seq", "32", "--heads", "2", "--head-dim", "8", "--block", "8", "--runs", "1"]


@needs_both
def test_every_system_runs_agrees_and_the_record_holds_the_ratios(tmp_path: Path) -> None:
    from benchmarks import flex

    record = flex.main([*TINY, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "flex.json").read_text())
    assert saved["times_ms"] == record["times_ms"] and saved["environment"]["device"]
    systems = {name.rsplit(" ", 1)[0] for name in saved["times_ms"]}
    assert systems == {"ours-jax-flex causal", "ours-jax-flex full", "ours-torch-flex causal", "ours-torch-flex full",
                       "torch-compile-flex causal", "ours-jax-flex named", "ours-jax named option",
                       "ours-torch-flex named", "ours-torch named option"}
    assert all(t > 0 for t in saved["times_ms"].values())
    # two twins x two masks, torch.compile's, and the named four: ours all right, every row checked
    assert len(saved["oracle"]) == 9 and all(v["ok"] for v in saved["oracle"] if v["ours"])
    assert all(v["checked"] == "batch 0, 2 heads, 32 of 32 rows" for v in saved["oracle"])
    ours_ratios = {
        "ours-jax-flex causal / full, forward + backward", "ours-torch-flex causal / full, forward + backward",
        "ours-jax-flex named / named option, forward + backward",
        "ours-torch-flex named / named option, forward + backward"}
    text = (tmp_path / "flex.md").read_text()
    assert "Ratios" in text
    if saved["wrong"]:  # PyTorch's AVX2 kernels (issue 55; docs/performance.md, Known issues)
        import torch

        (wrong,) = saved["wrong"]
        assert wrong["system"] == "torch-compile-flex causal" and wrong["max_abs_error"] > 1e-5
        assert wrong["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert wrong["isa"] == saved["environment"]["cpu"]["isa"] and wrong["device"] == "cpu"
        assert set(saved["ratios"]) == ours_ratios and "Wrong on this machine" in text
    else:
        assert set(saved["ratios"]) == ours_ratios | {"ours-jax flex / torch.compile flex, forward (causal)"}


@needs_both
def test_a_wrong_torch_compile_flex_is_recorded_and_left_out_of_the_ratios(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from benchmarks import flex

    def garbage(fn: Any, **_: Any) -> Any:  # torch.compile that "compiles" to ones
        return lambda q, *args, **kwargs: torch.ones_like(q)

    monkeypatch.setattr(torch, "compile", garbage)
    record = flex.main([*TINY, "--out", str(tmp_path)])
    assert [v["system"] for v in record["wrong"]] == ["torch-compile-flex causal"]
    assert not any("torch.compile" in name for name in record["ratios"]) and len(record["ratios"]) == 4
    assert record["times_ms"]["torch-compile-flex causal forward"] > 0
    text = (tmp_path / "flex.md").read_text()
    assert "| torch-compile-flex causal |" in text and "(wrong)" in text


@needs_both
def test_a_wrong_twin_fails_the_flex_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch_attention.functional as tf
    from benchmarks import flex

    real = tf.flex_attention
    monkeypatch.setattr(tf, "flex_attention", lambda *args, **kwargs: real(*args, **kwargs) + 1.0)
    with pytest.raises(AssertionError, match=r"ours-torch-flex causal \(ours\) is wrong against the float64 oracle"):
        flex.main([*TINY, "--no-compile", "--out", str(tmp_path)])


def test_the_benchmarks_entry_point_runs_the_flex_benchmark(tmp_path: Path, monkeypatch) -> None:
    """``python -m benchmarks --flex`` is ``python -m benchmarks.flex``, given its options."""
    from benchmarks import __main__ as entry
    from benchmarks import flex

    given: list[list[str]] = []
    monkeypatch.setattr(flex, "main", lambda argv=None: given.append(list(argv or [])))
    entry.main(["--flex", "--runs", "3", "--seq", "512", "--out", str(tmp_path)])
    assert given == [["--runs", "3", "--seq", "512", "--out", str(tmp_path)]]
