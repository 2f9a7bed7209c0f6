"""``python -m benchmarks.decode`` on a tiny configuration: every system runs (the jitted
JAX step, the whole loop in one compiled call, ours-PyTorch and the plain SDPA loop),
each one's outputs agree with the float64 oracle, the max_len row pairs each batch's short and long cache, and the
results record the CPU's instruction set and the kernel's build; one of ours that decodes
wrong fails the run, and the plain SDPA loop, made wrong, is recorded as wrong and left out of
the ratios; and the case plan follows its flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

TINY = ["--batches", "1,2", "--prompts", "5", "--new-tokens", "3", "--long-max-len", "16", "--max-len-batches", "1,2",
        "--d-model", "16", "--heads", "4", "--kv-heads", "2", "--runs", "2"]


@needs_both
def test_every_system_decodes_the_same_and_the_results_record_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import decode

    monkeypatch.setattr(decode, "PREFILL_CHUNK", 2)  # a prompt of 5 in chunks 2, 2, 1
    record = decode.main([*TINY, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert saved["results"] == json.loads(json.dumps(record["results"]))
    assert [(r["config"]["batch"], r["config"]["max_len"]) for r in saved["results"]] == [(1, 8), (2, 8)]
    for result in saved["results"]:
        assert [row["system"] for row in result["rows"]] == list(decode.SYSTEMS)
        assert result["config"]["reference"] == "torch-sdpa"
        for row in result["rows"]:
            assert row["max_abs_error"] < 1e-5 and not row["wrong"]
            assert row["tokens_per_s"] > 0 and row["min_s"] <= row["median_s"] <= row["max_s"]
            assert row["runs"] == 2
    rows = saved["max_len"]
    assert [(m["batch"], m["system"]) for m in rows] == [(b, s) for b in (1, 2) for s in decode.SYSTEMS]
    assert all(m["short_max_len"] == 8 and m["long_max_len"] == 16 for m in rows)
    assert all(m["ratio"] == pytest.approx(m["long_s"] / m["short_s"]) for m in rows)
    assert saved["wrong"] == []
    isa = saved["environment"]["instruction_sets"]
    assert {"isa", "kernel_isa", "kernel_isa_built", "kernel_march", "twin_attention_march", "auto_declines",
            "torch_cpu_capability"} <= set(isa)
    assert isa["isa"] == saved["environment"]["cpu"]["isa"]
    text = (tmp_path / "decode.md").read_text()
    assert f"CPU instruction set: {isa['isa']}" in text and "ours-jax-loop" in text and "| 16 vs 8 |" in text


@needs_both
def test_a_system_past_the_budget_runs_once(tmp_path: Path) -> None:
    from benchmarks import decode

    record = decode.main([*TINY, "--batches", "1", "--long-max-len", "0", "--budget-s", "0", "--out", str(tmp_path)])
    assert [row["runs"] for row in record["results"][0]["rows"]] == [1] * len(decode.SYSTEMS)
    assert record["results"][0]["config"]["runs"] == 2


def _off_by_a_little(monkeypatch: pytest.MonkeyPatch, system: str) -> None:
    from benchmarks import decode

    prepare = decode.prepare

    def off(*args: Any, **kwargs: Any) -> Any:
        runners = prepare(*args, **kwargs)
        good = runners[system]

        def bad() -> tuple[float, np.ndarray]:
            elapsed, out = good()
            return elapsed, out + 1e-3

        return {**runners, system: bad}

    monkeypatch.setattr(decode, "prepare", off)


@needs_both
def test_one_of_ours_that_decodes_wrong_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import decode

    _off_by_a_little(monkeypatch, "ours-jax-loop")
    with pytest.raises(AssertionError, match=r"ours-jax-loop \(ours\) is wrong against the float64 oracle"):
        decode.main([*TINY, "--batches", "1", "--long-max-len", "0", "--runs", "1", "--out", str(tmp_path)])


@needs_both
def test_a_wrong_sdpa_loop_is_recorded_and_in_no_ratio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import decode

    _off_by_a_little(monkeypatch, "torch-sdpa")
    record = decode.main([*TINY, "--batches", "1", "--max-len-batches", "1", "--runs", "1", "--out", str(tmp_path)])
    assert {v["system"] for v in record["wrong"]} == {"torch-sdpa"} and len(record["wrong"]) == 2  # both caches
    assert all(v["max_abs_error"] == pytest.approx(1e-3, rel=1e-2) for v in record["wrong"])
    assert [row["wrong"] for row in record["results"][0]["rows"]] == [False, False, False, True]
    assert {m["system"] for m in record["max_len"]} == {"ours-torch", "ours-jax", "ours-jax-loop"}
    text = (tmp_path / "decode.md").read_text()
    assert "| torch-sdpa | " in text and "| wrong |" in text and "Wrong on this machine" in text


def test_the_cases_follow_the_flags() -> None:
    from benchmarks.decode import Case, cases

    main, pairs = cases([1, 64], [128, 4096], 128, runs=5, long_runs=2, long_max_len=4096)
    assert main == [Case(1, 128, 256, 5), Case(1, 4096, 4224, 5), Case(64, 128, 256, 5), Case(64, 4096, 4224, 2)]
    assert pairs == [(Case(1, 128, 256, 5), Case(1, 128, 4096, 5)), (Case(64, 128, 256, 5), Case(64, 128, 4096, 5))]
    assert cases([1, 64], [128], 128, runs=5, long_runs=2, long_max_len=4096, max_len_batches=[1, 8])[1] == [
        (Case(1, 128, 256, 5), Case(1, 128, 4096, 5))]
    assert cases([8], [128], 128, runs=5, long_runs=2, long_max_len=0)[1] == []
    assert cases([8], [128], 128, runs=5, long_runs=2, long_max_len=256)[1] == []  # not longer
