"""The benchmark machinery (``benchmarks/``) on a tiny shape: every system gives a finite
positive time, the JSON has its environment block, the markdown table and the plot are
written; and the FLOP count against numbers worked out by hand."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import SYSTEMS as ALL_SYSTEMS
from benchmarks import Config, Mode, flops, fwd_bwd_flops, run
from benchmarks.configs import CORE_SYSTEMS
from benchmarks.measure import OUT_OF_TIME
from benchmarks.report import backward_tflops, targets_text
from benchmarks.systems import framework_of
from tests.support import HAS_JAX, HAS_TORCH, needs_both

SYSTEMS = ("ours-jax-fused", "flax-nnx-mha", "ours-torch-sdpa")
TINY = Config(batch=2, seq=32, heads=2, head_dim=16, causal=True, dtype="float32")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Mode, Path, dict]:
    """A tiny run, each system in a worker of its own, one after another: (mode, folder,
    results).  A worker's start (importing its framework, the matmul probe) costs
    seconds, so the tests that read such a run share this one; a test that runs again
    into a folder copies the JSON there first.  Where one framework is missing (nox's
    tests-torch and tests-jax), the other's systems run."""
    installed = {"jax": HAS_JAX, "torch": HAS_TORCH}
    mode = Mode("tiny", (TINY,), tuple(s for s in SYSTEMS if installed[framework_of(s)]),
                runs=2, backward=True, warmup=1)
    out = tmp_path_factory.mktemp("tiny")
    return mode, out, run(mode, out_dir=out, echo=lambda _: None)


def _copy_of(tiny_run: tuple[Mode, Path, dict], folder: Path) -> Path:
    """The shared run's JSON in ``folder`` (an earlier run there, to append to)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_run[1] / "tiny.json", folder / "tiny.json")
    return folder


def test_flops_by_hand() -> None:
    # B=2, H=4, S=128, D=64: two S x S x D matmuls per head, 2 FLOPs per multiply-add.
    assert flops(2, 4, 128, 64, causal=False) == 4 * 2 * 4 * 128 * 128 * 64 == 33_554_432
    assert flops(2, 4, 128, 64, causal=True) == 16_777_216  # the masked half is not counted
    assert fwd_bwd_flops(2, 4, 128, 64, causal=False) == 117_440_512  # 3.5x: backward = 2.5x
    assert fwd_bwd_flops(2, 4, 128, 64, causal=True) == 58_720_256
    config = Config(batch=2, seq=128, heads=4, head_dim=64, causal=True, dtype="float32")
    assert (config.flops(), config.fwd_bwd_flops()) == (16_777_216, 58_720_256)


def test_modes_follow_the_issue() -> None:
    from benchmarks import mode

    full = mode("full")
    sweep = [c for c in full.configs if c.seq <= 16384]
    assert len(sweep) == 6 * 2 * 2 * 2  # seq x head_dim x causal x dtype
    assert {c.dtype for c in sweep} == {"bfloat16", "float16"}
    assert all(c.batch * c.seq == 16384 and c.heads * c.head_dim == 2048 for c in sweep)
    assert sweep[0].group == (128, True, "bfloat16")  # the target group first
    # every config runs our fused module, flax's, SDPA through ours, and every kernel alone
    must = {"ours-jax-fused", "flax-nnx-mha", "ours-torch-sdpa", "torch-nn-mha", *CORE_SYSTEMS}
    assert all(must <= set(c.systems) for c in sweep)
    assert all("ours-torch-compile" in c.systems for c in sweep if c.dtype == "bfloat16" and c.head_dim == 128)
    long = [c for c in full.configs if c.seq > 16384]
    assert {(c.batch, c.seq, c.heads, c.head_dim, c.dtype) for c in long} == {(1, 65536, 16, 128, "bfloat16")}
    assert all("core-jax-fused" in c.systems for c in long)
    assert full.runs >= 10 and full.backward and set(full.systems) == set(ALL_SYSTEMS)

    cpu_sweep = mode("cpu-sweep")
    assert cpu_sweep.process_per_case and cpu_sweep.backward and cpu_sweep.runs == 5
    assert cpu_sweep.warmup_s > 0 and cpu_sweep.timed_s > 0  # short calls: tens of samples, not five

    target = mode("cpu-target")
    assert [c.label for c in target.configs] == ["B4-S1024-H8-D64-causal-float32"]
    assert target.runs == 20 and not target.backward
    assert "ours-torch-compile" not in mode("quick").systems
    assert "ours-torch-compile" in mode("quick", with_compile=True).systems


@needs_both
def test_tiny_run_writes_json_table_and_plot(tiny_run) -> None:
    _, out, results = tiny_run

    saved = json.loads((out / "tiny.json").read_text())
    assert saved == json.loads(json.dumps(results))
    env = saved["env"]
    for key in ("device", "date", "cpu", "packages", "runtime"):
        assert key in env, key
    assert {"jax", "jaxlib", "flax", "torch"} <= set(env["packages"])
    assert set(env["runtime"]) == {"jax", "torch"}

    assert sorted(m["system"] for m in saved["measurements"]) == sorted(SYSTEMS)
    assert saved["wrong"] == []
    for m in saved["measurements"]:
        assert m["error"] is None, m
        # checked against the float64 oracle in its worker, every row at this size
        assert m["oracle"]["ok"] and m["oracle"]["checked"] == "batch 0, every head, 32 of 32 rows", m["oracle"]
        for phase in ("fwd", "fwd_bwd"):
            timing = m[phase]
            assert len(timing["times_ms"]) == 2
            assert math.isfinite(timing["median_ms"]) and timing["median_ms"] > 0
            assert math.isfinite(timing["compile_s"]) and timing["compile_s"] > 0
            expected = (1 if phase == "fwd" else 3.5) * flops(2, 2, 32, 16, True) / (timing["median_ms"] / 1e3) / 1e12
            assert timing["tflops"] == pytest.approx(expected)

    table = (out / "tiny.md").read_text()
    assert "| config | system | fwd ms (IQR) |" in table
    for system in SYSTEMS:
        assert f"| B2-S32-H2-D16-causal-float32 | {system} |" in table
    png = (out / "tiny.png").read_bytes()
    assert png.startswith(b"\x89PNG")


@needs_both
@pytest.mark.slow  # five systems, each compiled forward and backward; the tiny run covers the machinery
def test_core_systems_time_the_function_alone() -> None:
    # The kernels alone: no projection FLOPs; a backend that cannot run (SDPA's cuDNN
    # and memory-efficient kernels on CPU) is a recorded error, not a crash.  Measured in
    # this process, as a worker measures each case: the workers, the JSON and the table
    # are the tiny run's (five more workers would cost a framework import each).
    import torch

    from benchmarks.measure import measure

    config = Config(batch=1, seq=32, heads=2, head_dim=16, causal=False, dtype="float32")
    systems = ("core-jax-fused", "core-flax", "core-torch-fused", "core-torch-sdpa-flash", "core-torch-sdpa-cudnn")
    by_system = {system: measure(system, config, runs=2, warmup=1, backward=True) for system in systems}

    runnable = list(systems[:3])
    if torch.cuda.is_available():  # SDPA's flash kernel takes float16 and bfloat16 only on CUDA
        assert "No available kernel" in by_system["core-torch-sdpa-flash"]["error"]
    else:  # on CPU, its flash backend is the CPU kernel, which takes float32; cuDNN has none
        runnable.append("core-torch-sdpa-flash")
        assert "No viable backend" in by_system["core-torch-sdpa-cudnn"]["error"]
    for system in runnable:
        m = by_system[system]
        assert m["error"] is None, m
        assert m["fwd"]["tflops_incl_projections"] == m["fwd"]["tflops"]
        assert m["fwd_bwd"]["calls_per_run"] >= 1


def test_a_spent_budget_records_every_case_as_not_run(tmp_path) -> None:
    config = Config(batch=1, seq=8, heads=1, head_dim=8, causal=True, dtype="float32")
    results = run(Mode("tiny", (config,), ("ours-jax-fused", "core-torch-fused"), runs=1, backward=False),
                  out_dir=tmp_path, echo=lambda _: None, budget_s=-1.0)
    assert [m["error"] for m in results["measurements"]] == [OUT_OF_TIME, OUT_OF_TIME]
    assert json.loads((tmp_path / "tiny.json").read_text())["measurements"] == results["measurements"]


def test_backward_rate_and_target_table() -> None:
    # B1 H16 S4096 D128, not causal: forward 4*16*4096^2*128 = 1.374e11 FLOPs.  A forward of
    # 0.25 ms and a forward+backward of 1.0 ms: backward 2.5 * 1.374e11 / 0.75e-3 = 458 TFLOP/s.
    config = Config(1, 4096, 16, 128, False, "bfloat16")

    def measurement(system: str, fwd_ms: float, fwd_bwd_ms: float) -> dict:
        return {"system": system, "label": config.label, "config": config.to_json(), "error": None,
                "fwd": {"median_ms": fwd_ms, "tflops": config.flops() / fwd_ms / 1e9},
                "fwd_bwd": {"median_ms": fwd_bwd_ms, "tflops": config.fwd_bwd_flops() / fwd_bwd_ms / 1e9}}

    ours = measurement("core-jax-fused", 0.25, 1.0)
    assert backward_tflops(ours) == pytest.approx(2.5 * config.flops() / 0.75e-3 / 1e12)
    results = {"systems": ["core-jax-fused", "core-torch-sdpa-flash", "core-torch-sdpa-cudnn", "ours-jax-fused",
                           "flax-nnx-mha"],
               "measurements": [ours, measurement("core-torch-sdpa-flash", 0.30, 1.1),
                                measurement("core-torch-sdpa-cudnn", 0.26, 1.2),
                                measurement("ours-jax-fused", 1.0, 3.0), measurement("flax-nnx-mha", 3.5, 9.0)]}
    row = next(line for line in targets_text(results).splitlines() if line.startswith(f"| {config.label}"))
    assert row == f"| {config.label} | 550 | 458 | - | 1.04 (cudnn) | 1.10 (flash) | 3.50 |"


@pytest.mark.slow  # the quick tier shows this feature in another test
def test_appending_keeps_what_a_later_run_left_out_of_time(tiny_run, tmp_path) -> None:
    mode, _, results = tiny_run
    measured = results["measurements"]
    assert measured and all(m["error"] is None for m in measured)
    again = run(mode, out_dir=_copy_of(tiny_run, tmp_path), echo=lambda _: None, append=True, budget_s=-1.0)
    assert again["measurements"] == measured  # the measurements, not the "not run" entries


@pytest.mark.slow  # the quick tier shows this feature in another test
def test_the_allocator_reaches_every_worker_and_the_results(tiny_run, tmp_path, monkeypatch) -> None:
    """The allocator is recorded in the results; one result never mixes two allocators;
    an unknown or missing allocator is refused before anything runs; a preloaded one is in
    the LD_PRELOAD the worker is started with."""
    from benchmarks import environment, runner

    mode, _, results = tiny_run
    config = TINY
    assert results["settings"]["malloc"] == "system" and results["settings"]["ld_preload"] is None
    assert any(note.startswith("Allocator: the system's") for note in results["notes"])
    with pytest.raises(ValueError, match="measured with the system allocator, this run asks for tcmalloc"):
        run(mode, out_dir=_copy_of(tiny_run, tmp_path), echo=lambda _: None, append=True, malloc="tcmalloc")
    with pytest.raises(ValueError, match="unknown allocator 'jemalloc'"):
        environment.preload_for("jemalloc")
    monkeypatch.setattr(environment, "_TCMALLOC_NAMES", ("libno-such-allocator.so.0",))
    monkeypatch.setattr("ctypes.util.find_library", lambda name: None)
    with pytest.raises(ValueError, match="libno-such-allocator.so.0 found"):
        run(mode, out_dir=tmp_path / "other", echo=lambda _: None, malloc="tcmalloc")
    assert not (tmp_path / "other").exists()
    monkeypatch.undo()

    seen = {}

    class Popen:
        def __init__(self, command, env, **kwargs):
            seen["env"] = env
            raise OSError("not started")

    monkeypatch.setattr(runner.subprocess, "Popen", Popen)
    with pytest.raises(OSError, match="not started"):
        runner._worker("core-torch-fused", [config], mode, lambda _: None, None, "/lib/libstand-in.so")
    assert seen["env"]["LD_PRELOAD"].split()[0] == "/lib/libstand-in.so"


def test_a_run_with_the_installed_tcmalloc(tmp_path) -> None:
    """Where tcmalloc is installed, a real run preloads it and records where it came from.
    It is an optional system piece that the project does not install: everything above is
    checked without it (a stand-in library), and only this run needs the real one."""
    from benchmarks import environment

    try:
        library = environment.preload_for("tcmalloc")
    except ValueError as missing:
        pytest.skip(f"tcmalloc is not installed on this machine ({missing})")
    config = Config(batch=1, seq=8, heads=1, head_dim=8, causal=True, dtype="float32")
    mode = Mode("tiny", (config,), ("core-torch-fused",), runs=1, backward=False, warmup=0)
    results = run(mode, out_dir=tmp_path, echo=lambda _: None, malloc="tcmalloc")
    assert results["settings"] == {**results["settings"], "malloc": "tcmalloc", "ld_preload": library}
    assert results["measurements"][0]["error"] is None


def test_time_floors_add_warmup_and_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call of 1/512 s (about 2 ms) with floors of 0.03 s warm-up and 0.1 s timed: more
    warm-up calls than asked for (16: the first sum past 0.03 s), and more timed runs (a
    sample is the 10 calls that fill SAMPLE_S = 20 ms, so ceil(0.1 / 0.0195) = 6), never
    beyond MAX_RUNS; without floors, exactly what was asked. The clock is the test's own
    (each call lasts exactly its repeat times 1/512 s, a binary fraction, so no sum rounds):
    a sleeping call on a loaded machine runs long at random, and the counts with it."""
    from benchmarks import measure

    def clock_of(seconds_per_call: float) -> Callable[[Callable[[int], None], int], float]:
        def clock(call: Callable[[int], None], repeat: int) -> float:
            call(repeat)
            return seconds_per_call * repeat

        return clock

    one_call = 1 / 512
    calls: list[int] = []
    monkeypatch.setattr(measure, "_clock", clock_of(one_call))
    plain = measure._time(calls.append, runs=3, warmup=1, flops=1, projection_flops=0)
    assert plain["runs"] == 3 and calls == [1, 1, 10, 10, 10]
    calls.clear()
    floored = measure._time(calls.append, runs=3, warmup=1, flops=1, projection_flops=0, warmup_s=0.03, timed_s=0.1)
    assert calls == [1] + [1] * 16 + [10] * 6
    assert floored["runs"] == 6 and floored["calls_per_run"] == 10
    assert floored["times_ms"] == [one_call * 1e3] * 6 and floored["median_ms"] == one_call * 1e3
    # A call that returns at once: a sample is then MAX_REPEAT calls, not 20 ms of calls,
    # and the cap is reached at once.
    monkeypatch.setattr(measure, "_clock", clock_of(1e-7))
    capped = measure._time(lambda repeat: None, runs=3, warmup=0, flops=1, projection_flops=0, timed_s=1000.0)
    assert capped["runs"] == measure.MAX_RUNS and capped["calls_per_run"] == measure.MAX_REPEAT


def test_turns_are_rounds_of_every_system_in_rotated_order() -> None:
    from benchmarks.runner import turns

    assert turns(3, 2) == [0, 1, 2, 1, 2, 0]
    assert turns(2, 3) == [0, 1, 1, 0, 0, 1]
    assert turns(4, 0) == []


@needs_both
@pytest.mark.slow  # the quick tier shows this feature in another test
def test_a_run_in_turns_gives_every_system_the_same_rounds(tmp_path) -> None:
    """process_per_case: the systems of a config are timed in turns, a round being one
    run of each, so every system has as many runs as the one wanting the most; a system
    that fails (SDPA's cuDNN backend on a CPU) or whose worker dies is recorded and the
    others go on."""
    import subprocess
    import sys

    import torch

    from benchmarks import runner

    config = Config(batch=2, seq=32, heads=2, head_dim=16, causal=True, dtype="float32")
    broken = "core-torch-sdpa-cudnn" if not torch.cuda.is_available() else None
    systems = ("ours-jax-fused", "core-torch-fused", "ours-torch-sdpa", *(s for s in (broken,) if s))
    started = []
    real_popen = subprocess.Popen

    def popen(command, **kwargs):
        from pathlib import Path

        job = json.loads(Path(command[-1]).read_text())
        started.append(job["system"])
        if job["system"] == "ours-torch-sdpa":  # a worker that starts, answers, then dies
            line = "@@ " + json.dumps({"runtime": {}, "built": None})
            command = [sys.executable, "-c", f"import sys; print({line!r}, flush=True); sys.exit(3)"]
        return real_popen(command, **kwargs)

    mode = Mode("tiny", (config,), systems, runs=3, backward=True, warmup=1, timed_s=0.3, process_per_case=True)
    original = runner.subprocess.Popen
    runner.subprocess.Popen = popen
    try:
        results = run(mode, out_dir=tmp_path, echo=lambda _: None)
    finally:
        runner.subprocess.Popen = original
    assert started == list(systems)  # one worker per system, in order
    by_system = {m["system"]: m for m in results["measurements"]}
    assert by_system["ours-torch-sdpa"]["error"] == "worker process died (exit status 3)"
    if broken:
        assert by_system[broken]["error"].startswith("fwd: RuntimeError: No viable backend")
        assert by_system[broken]["fwd"] is None
    measured = [by_system[s] for s in ("ours-jax-fused", "core-torch-fused")]
    for phase in ("fwd", "fwd_bwd"):
        runs = {m[phase]["runs"] for m in measured}
        assert len(runs) == 1 and runs.pop() > 3  # 0.3 s of samples of at most 20 ms: more than asked
        for m in measured:
            assert m["error"] is None and len(m[phase]["times_ms"]) == m[phase]["runs"]
            assert all(math.isfinite(t) and t > 0 for t in m[phase]["times_ms"])
            assert m["host_share"] is not None
    assert set(results["env"]["runtime"]) == {"jax", "torch"}
    assert any("take turns" in note for note in results["notes"])

@needs_both
def test_routes_gives_each_twins_route_per_case(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m benchmarks.routes``: each twin's route for every dtype, length and case,
    as ``functional.route`` gives it (the weights only on the reference path, a softcap
    never on the fused one), one printed line each."""
    from benchmarks import routes

    found = routes.rows()
    assert len(found) == 2 * 2 * 4 * 2
    for _dtype, _seq, case, _twin, route in found:
        assert route.path in ("reference", "fused", "blockwise")
        if case == "return_weights":
            assert (route.path, route.kernel) == ("reference", "reference")
            assert any(reason.startswith("fused: return_weights=True") for reason in route.reasons)
        if case.startswith("softcap"):
            assert route.path != "fused"
    routes.main()
    assert len(capsys.readouterr().out.splitlines()) == 1 + len(found)


def test_spells_probe_and_its_summary() -> None:
    """``python -m benchmarks.spells``: each window has a positive time per loop; the fast
    level is the median of the fastest quarter, and a window more than ``slow`` above it
    counts as slow (worked by hand: eight matmul windows, two of them 1.2x)."""
    from benchmarks import spells

    windows = spells.probe(0.3, window_s=0.06)
    assert windows and all(w[name] > 0 for w in windows for name in spells.LOOPS)
    made = [{"t": float(i), "matmul": m, "copy": 1.0, "scalar": 2.0}
            for i, m in enumerate((1.0, 1.0, 1.02, 1.2, 1.0, 1.2, 1.05, 0.98))]
    levels = spells.summary(made, slow=0.1)
    assert levels["matmul"] == {"fast_s": 0.99, "slow_fraction": 0.25}  # fastest two: 0.98, 1.0
    assert levels["copy"] == {"fast_s": 1.0, "slow_fraction": 0.0}
    assert spells.main(["--seconds", "0.2", "--window-s", "0.06"]) == 0


def test_ratios_per_round_where_timed_in_turns() -> None:
    """Timed in turns, a ratio also gives the median of the rounds' own ratios (worked by
    hand: rounds 10/20, 30/20, 12/24 -> 0.5, 1.5, 0.5 -> 0.5, where the medians give
    12/20 = 0.60); timed one after another, or with unequal runs, only the medians'."""
    from benchmarks.report import ratios_text

    config = Config(1, 8, 1, 8, True, "float32")

    def measurement(system: str, times: list[float]) -> dict:
        import statistics

        return {"system": system, "label": config.label, "config": config.to_json(), "error": None,
                "fwd": {"median_ms": statistics.median(times), "times_ms": times}, "fwd_bwd": None}

    results = {"systems": ["ours-jax-auto", "flax-nnx-mha"], "settings": {"in_turns": True},
               "measurements": [measurement("ours-jax-auto", [10.0, 30.0, 12.0]),
                                measurement("flax-nnx-mha", [20.0, 20.0, 24.0])]}
    line = f"- {config.label}: ours-jax-auto / flax-nnx-mha = forward 0.60 (per round 0.50)"
    assert line in ratios_text(results).splitlines()
    results["settings"]["in_turns"] = False
    assert f"- {config.label}: ours-jax-auto / flax-nnx-mha = forward 0.60" in ratios_text(results).splitlines()
