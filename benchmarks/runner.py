"""Runs a benchmark mode: each system in a worker process of its own, one after another,
then the results to ``benchmarks/results/<device>/<mode>.{json,md,png}``.

Why processes: JAX and PyTorch each keep an allocator (and on CPU a thread pool) for the
life of a process, so in one process each would run in the other's leftovers; a worker
per system starts clean, and a crash (a host out-of-memory kill, say) costs one case,
not the run: the worker is restarted for the cases after it.

Each worker checks its system's output against the float64 oracle before timing it
(``measure``, ``benchmarks/oracle_check.py``); the runner reads the verdicts: one of ours
that is wrong fails the run (AssertionError, naming it, once the JSON holds what was
measured); an outside system that is wrong is listed in the results' ``wrong`` (its error,
tolerance, device, PyTorch's CPU capability, the ISA) and left out of every ratio.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import oracle_check, report
from benchmarks.configs import Config, Mode, is_core
from benchmarks.environment import (
    MALLOCS,
    cpu_busy,
    device_slug,
    host_environment,
    load_average,
    preload_for,
)
from benchmarks.measure import MAX_RUNS, OUT_OF_TIME, REWARM_BELOW_S, empty_result
from benchmarks.systems import framework_of

ROOT = Path(__file__).resolve().parent.parent  # the repository: benchmarks and the twins
RESULTS = ROOT / "benchmarks" / "results"

# JAX preallocates 75% of a GPU by default; in a worker of its own it may take more,
# so that the reference path runs out of memory where torch's would, not earlier.
WORKER_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90"}

BUSY_THRESHOLD = 0.25  # CPU busy with other work (fraction of all cores) worth a warning


def run(
    mode: Mode,
    *,
    out_dir: Path | None = None,
    append: bool = False,
    budget_s: float | None = None,
    malloc: str = "system",
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measures every (system, config) of ``mode``, writes the results and prints the
    table; returns the results (what ``<mode>.json`` holds).

    ``out_dir`` defaults to ``benchmarks/results/<device-slug>``.  ``append`` keeps the
    measurements of an earlier ``<mode>.json`` there that this run did not repeat (to
    split a long run into several calls).  ``budget_s``: no case starts after that many
    seconds; the cases left are recorded as not run (a lent machine's command limit).
    ``malloc``: the allocator of every worker, ``"system"`` (glibc's) or ``"tcmalloc"``
    (preloaded; ``ValueError`` before anything runs where it is not installed).
    ``<mode>.json`` is rewritten after each system, so that what was measured survives
    the run being killed."""
    if malloc not in MALLOCS:
        raise ValueError(f"unknown allocator {malloc!r}; expected one of {', '.join(MALLOCS)}")
    env = host_environment()
    out_dir = out_dir or RESULTS / device_slug(env)
    env["runtime"] = {}
    deadline = None if budget_s is None else time.time() + budget_s
    measurements: list[dict[str, Any]] = []
    jobs = [] if mode.process_per_case else [
        (system, [c for c in mode.configs if c.runs_system(system)]) for system in mode.systems
    ]
    earlier = out_dir / f"{mode.name}.json"
    earlier_results = json.loads(earlier.read_text()) if append and earlier.exists() else None
    earlier_malloc = None if earlier_results is None else earlier_results["settings"].get("malloc", "system")
    if earlier_malloc not in (None, malloc):
        raise ValueError(f"--append: {earlier} was measured with the {earlier_malloc} allocator, this run asks "
                         f"for {malloc}; one result holds one allocator")
    # The library is looked up after the arguments' own checks (a refused --append names
    # the mix whether or not tcmalloc is installed), still before anything runs.
    preload = preload_for(malloc)
    echo(f"Benchmark '{mode.name}' on {env['device']}; results to {out_dir}")
    if mode.name == "full" and not env["gpus"]:
        echo("Note: the full sweep is meant for a GPU; on a CPU it takes hours (try --quick or --cpu-target).")

    def results_so_far() -> dict[str, Any]:
        results = {
            "mode": mode.name,
            "env": env,
            "settings": {"runs": mode.runs, "warmup": mode.warmup, "backward": mode.backward,
                         "warmup_s": mode.warmup_s, "timed_s": mode.timed_s, "malloc": malloc,
                         "ld_preload": preload, "in_turns": mode.process_per_case},
            "notes": notes(mode, env, malloc),
            "systems": list(mode.systems),
            "measurements": measurements,
        }
        results = results if earlier_results is None else _merge(earlier_results, results)
        return {**results, "wrong": wrong_of(results["measurements"])}

    for system, configs in jobs:
        if configs:
            runtime, done = _run_system(system, configs, mode, echo, deadline, preload)
            if runtime:
                env["runtime"].setdefault(framework_of(system), runtime)
            measurements += done
            report.write_json(results_so_far(), out_dir)
            _judge(done, env)
    for config in mode.configs if mode.process_per_case else ():
        systems = [s for s in mode.systems if config.runs_system(s)]
        if deadline is not None and time.time() > deadline:
            done = [empty_result(s, config, OUT_OF_TIME) for s in systems]
        else:
            runtimes, done = _run_in_turns(config, systems, mode, echo, preload)
            for system, runtime in runtimes.items():
                env["runtime"].setdefault(framework_of(system), runtime)
        measurements += done
        report.write_json(results_so_far(), out_dir)
        _judge(done, env)
    env["load_average_at_end"] = load_average()  # this run's own work included
    env["cpu_busy_at_end"] = cpu_busy()
    results = results_so_far()
    paths = report.write(results, out_dir)
    echo("\n" + report.environment_text(env))
    echo(report.table(results))
    echo(report.ratios_text(results))
    echo(oracle_check.wrong_text(results["wrong"]))
    echo(report.notes_text(results))
    echo("Written: " + ", ".join(str(p) for p in paths))
    return results


def wrong_of(measurements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The verdicts of the measurements that are wrong against the oracle, each with its config's label."""
    return [{**m["oracle"], "label": m["label"]} for m in measurements if m.get("oracle") and not m["oracle"]["ok"]]


def _judge(done: list[dict[str, Any]], env: dict[str, Any]) -> None:
    """The verdicts of ``done`` (the machine's ISA added where a worker could not read it,
    a PyTorch worker not importing the library's JAX kernel); AssertionError for one of
    ours that is wrong."""
    for m in done:
        if m.get("oracle") is not None:
            m["oracle"]["isa"] = m["oracle"].get("isa") or env["cpu"].get("isa")
    for m in done:
        if m.get("oracle") is not None:
            oracle_check.fail_if_ours({**m["oracle"], "checked": f"{m['label']}, {m['oracle']['checked']}"})


def notes(mode: Mode, env: dict[str, Any], malloc: str = "system") -> list[str]:
    """What a reader needs to read the numbers right."""
    runs = f"median of {mode.runs} timed runs"
    if mode.timed_s:
        runs = (f"median of the timed runs, at least {mode.runs} and as many more as fill "
                f"{mode.timed_s:g} s, up to {MAX_RUNS} ('runs' in the JSON)")
    elif mode.name == "quick":
        runs += " (quick mode: fewer runs than the 20 of the full and CPU-target modes, so noisier)"
    elif mode.runs < 20:
        runs += " (fewer than 20: noisier)"
    warmup = f"{mode.warmup} untimed warm-up call(s)"
    if mode.warmup_s:
        warmup = f"untimed warm-up calls, at least {mode.warmup} and for at least {mode.warmup_s:g} s"
    return [
        f"Times: {runs}, after one first call (timed apart as 'compile s': JAX compiles, "
        f"PyTorch allocates, torch.compile compiles; forward / forward+backward) and "
        f"{warmup}; the clock stops when the device is done. "
        "A timed run is one call or, where one call is shorter than 20 ms, as many back-to-back "
        "calls as fill 20 ms, its time divided by their number ('calls_per_run' in the JSON). "
        "IQR = interquartile range / median. Inputs are random normal.",
        "What is timed: the whole module, multi-head self-attention with d_in = d_out = "
        "H*D, so the four projections are included; forward in eval mode without "
        "gradient tracking; forward+backward = gradient of sum(out) with respect to the "
        "input and every parameter.",
        "TFLOP/s count the attention core only, as the issue defines it: forward "
        "4*B*H*S^2*D (halved for causal), backward 2.5x forward (forward+backward = 3.5x); "
        "since the time includes the projections (8*B*S*(H*D)^2 more FLOPs forward, as many "
        "as a non-causal core at S = 2*H*D), this understates the core's own rate. The JSON "
        "also gives 'tflops_incl_projections'.",
        *([CORE_NOTE] if any(is_core(s) for s in mode.systems) else []),
        "Precision: float32 matmuls at full precision on both sides (PyTorch TF32 off for "
        "matmul and cuDNN, float32 matmul precision 'highest'; JAX default matmul "
        "precision 'highest'), so that every system computes the same thing. Parameters "
        "are created in the benchmark dtype.",
        "Peak memory: on an NVIDIA GPU, torch.cuda.max_memory_allocated per case (reset "
        "after the module and input are built) and, for JAX, the peak planned by XLA's "
        "compiled memory analysis (arguments + outputs + temporaries) of the larger of the "
        "forward and forward+backward functions: JAX's peak_bytes_in_use cannot be reset "
        "within a process. On CPU not measured (n/a); the JSON's max_rss_growth_bytes is how "
        "much the worker process's high-water resident set grew during the case (0 when an "
        "earlier case of the same system had used more).",
        ("Each (config, system) runs in a worker process of its own; the workers of a config are alive "
         "together and take turns: a round is one timed run of each system (one after another, the order "
         f"rotated every round, a pause of {SETTLE_S * 1e3:g} ms between turns), and a phase is as many rounds "
         "as the system wanting the most runs asks for, so every system of a config has the same number of "
         "runs, run i of each taken within one round ('times_ms' in the JSON, in round order). Why: on a "
         "shared virtual machine the host can take a share of a core's vector units for seconds at a time "
         "(measured on the 2-core Zen 5 with python -m benchmarks.spells: a float32 matmul 15-35% slower "
         "in spells of a second to most of a minute, scalar code and memory copies unaffected), and "
         "systems timed one after another were compared across such spells; in turns, each spell falls on "
         "every system alike; the ratios also give the median of the rounds' own ratios ('per round'). "
         f"A call shorter than {REWARM_BELOW_S:g} s is called once, untimed, before each timed run of its turn. "
         "The 'resident peak MiB' column is how much that process's high-water resident set grew during "
         "the case (its memory above the imported frameworks), and 'fwd of matmul rate' is the forward's "
         "FLOP rate, projections included, over a plain float32 1024^3 matmul's rate in the same "
         "framework measured at the worker's start; 'host: others / steal' is the share of the machine's "
         "CPU time, over the case's timed runs, that other processes used and that the hypervisor stole (from "
         "/proc/stat; above a few percent, the case shared the machine)."
         if mode.process_per_case else
         "Each system runs in a worker process of its own, one system after another."),
        MALLOC_NOTES[malloc],
        *_busy_machine_warning(env),
    ]


MALLOC_NOTES = {
    "system": "Allocator: the system's (glibc malloc) in every worker.",
    "tcmalloc": (
        "Allocator: tcmalloc, preloaded (LD_PRELOAD) into every worker of both frameworks "
        "('ld_preload' in the settings). Under glibc, XLA's CPU runtime takes each call's temporaries "
        "as one block, which above 32 MiB glibc maps fresh and unmaps on every call, so every page is "
        "faulted in again; tcmalloc keeps the memory."
    ),
}


CORE_NOTE = (
    "The core-* systems time the attention function alone on random q, k, v in each one's own layout: "
    "(B, S, H, D) for the JAX cores (ours with layout=\"bshd\", jax.nn.dot_product_attention and Flax's), "
    "(B, H, S, D) for PyTorch's; no projections, so "
    "their TFLOP/s are the kernel's own; forward+backward = gradient of sum(out) with respect to q, k "
    "and v. core-torch-sdpa-* hold F.scaled_dot_product_attention to one backend (sdpa_kernel); "
    "core-torch-fused is ours, SDPA with its own choice of backend. JAX's compile flags (XLA_FLAGS) "
    "are in each runtime entry of the JSON."
)


def _busy_machine_warning(env: dict[str, Any]) -> list[str]:
    """A warning when other work kept the CPU busy before or after the run: the numbers
    are then not a fair comparison (PyTorch's OpenMP threads, one per core, stall badly
    when a core is taken; measured here: 5x slower than a single thread on a 2-core
    machine under a load of 4)."""
    busy = [b for b in (env.get("cpu_busy_at_start"), env.get("cpu_busy_at_end")) if b is not None]
    if not busy or max(busy) <= BUSY_THRESHOLD:
        return []
    return [
        f"WARNING: other work kept the CPU busy ({max(busy):.0%} of all cores, sampled for a "
        "second before and after the run): the times are noisy and CPU comparisons unfair; "
        "PyTorch's OpenMP threads (one per core) suffer most. Rerun on an idle machine "
        "before drawing conclusions."
    ]


SETTLE_S = 0.01  # between two systems' turns: the last one's thread pool goes back to sleep


def _run_in_turns(
    config: Config, systems: list[str], mode: Mode, echo: Callable[[str], None], preload: str | None = None,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """One worker per system at ``config``, started one after another, then each phase
    timed in rounds of one sample per system (``runs``: what the system wanting the most
    asks for).  Returns each system's runtime description and its measurement, in
    ``systems`` order."""
    workers: list[_TurnWorker] = []
    try:
        for system in systems:  # one at a time: each start measures the machine's matmul rate
            workers.append(_TurnWorker(system, config, mode, preload))
        for phase in ("fwd", "fwd_bwd") if mode.backward else ("fwd",):
            live = [w for w in workers if w.alive]
            wanted = [w.prepare(phase) for w in live]  # one at a time: nothing else runs during a warm-up
            live = [w for w, runs in zip(live, wanted, strict=True) if runs is not None]
            for turn in turns(len(live), max((r for r in wanted if r is not None), default=0)):
                if live[turn].alive:
                    time.sleep(SETTLE_S)
                    live[turn].sample(phase)
        done = [w.finish() for w in workers]
    finally:
        for w in workers:
            w.stop()
    for m in done:
        echo(report.progress_line(m))
    return {w.system: w.runtime for w in workers if w.runtime}, done


def turns(systems: int, rounds: int) -> list[int]:
    """Which system samples when: ``rounds`` rounds of every system once, the order
    rotated by one each round, so that no system always runs right after the same one."""
    return [(r + i) % systems for r in range(rounds) for i in range(systems)]


class _TurnWorker:
    """The runner's end of a ``python -m benchmarks._worker --in-turns`` process."""

    def __init__(self, system: str, config: Config, mode: Mode, preload: str | None) -> None:
        self.system, self.config = system, config
        self.runtime: dict[str, Any] | None = None
        self.error: str | None = None
        self.measurement: dict[str, Any] | None = None
        self._job = tempfile.NamedTemporaryFile("w", prefix="benchmarks-", suffix=".json", delete=False)
        json.dump({"system": system, "config": config.to_json(), "runs": mode.runs, "warmup": mode.warmup,
                   "warmup_s": mode.warmup_s, "timed_s": mode.timed_s}, self._job)
        self._job.close()
        command = [sys.executable, "-m", "benchmarks._worker", "--in-turns", self._job.name]
        self._process = subprocess.Popen(command, env=_worker_env(preload), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, bufsize=1)
        first = self._read()
        if first is not None:
            self.runtime = first["runtime"]
            self.error = first["built"]

    @property
    def alive(self) -> bool:
        return self.error is None

    def prepare(self, phase: str) -> int | None:
        """The runs this system wants of ``phase``, or None where it failed."""
        answer = self._ask(f"prepare {phase}")
        if answer is not None and "failed" in answer:
            self.error = answer["failed"] or f"{phase} failed"
        return None if answer is None or "failed" in answer else int(answer["runs"])

    def sample(self, phase: str) -> None:
        answer = self._ask(f"sample {phase}")
        if answer is not None and not answer["ok"]:
            self.error = f"{phase} failed"  # the worker's measurement says how

    def finish(self) -> dict[str, Any]:
        if self.measurement is None:
            answer = self._ask("finish")
            self.measurement = answer["measurement"] if answer else empty_result(
                self.system, self.config, self.error)
        return self.measurement

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()
        Path(self._job.name).unlink(missing_ok=True)

    def _ask(self, command: str) -> dict[str, Any] | None:
        if self._process.poll() is not None:
            return self._died()
        try:
            assert self._process.stdin is not None
            self._process.stdin.write(command + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass
        return self._read()

    def _read(self) -> dict[str, Any] | None:
        """The worker's next answer (other lines passed on); None where it died, with
        the error recorded."""
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
            print(line, end="")
        return self._died()

    def _died(self) -> None:
        status = self._process.wait()
        self.error = self.error or f"worker process died (exit status {status})"
        return None


def _run_system(
    system: str, configs: list[Config], mode: Mode, echo: Callable[[str], None], deadline: float | None,
    preload: str | None = None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The worker's runtime description and one measurement per config, in order."""
    runtime = None
    done: list[dict[str, Any]] = []
    while len(done) < len(configs):
        todo = configs[len(done):]
        if deadline is not None and time.time() > deadline:
            done += [empty_result(system, c, OUT_OF_TIME) for c in todo]
            break
        status, lines = _worker(system, todo, mode, echo, deadline, preload)
        runtime = runtime or next((line["runtime"] for line in lines if "runtime" in line), None)
        done += [line["measurement"] for line in lines if "measurement" in line]
        if status != 0 and len(done) < len(configs):
            # The worker died inside this case: record it, then go on with a new worker.
            failed = empty_result(system, configs[len(done)], f"worker process died (exit status {status})")
            echo(report.progress_line(failed))
            done.append(failed)
    return runtime, done


def _worker(
    system: str, configs: list[Config], mode: Mode, echo: Callable[[str], None], deadline: float | None,
    preload: str | None = None,
) -> tuple[int, list[dict[str, Any]]]:
    """Runs ``python -m benchmarks._worker`` (with ``preload`` in LD_PRELOAD), passing on
    what it prints (one line per measurement), and reads back the results it wrote."""
    job = {
        "system": system, "configs": [c.to_json() for c in configs],
        "runs": mode.runs, "warmup": mode.warmup, "backward": mode.backward, "deadline": deadline,
        "warmup_s": mode.warmup_s, "timed_s": mode.timed_s,
    }
    env = _worker_env(preload)
    with tempfile.TemporaryDirectory(prefix="benchmarks-") as tmp:
        job_path, out_path = Path(tmp, "job.json"), Path(tmp, "results.jsonl")
        job_path.write_text(json.dumps(job))
        command = [sys.executable, "-m", "benchmarks._worker", str(job_path), str(out_path)]
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as worker:
            assert worker.stdout is not None
            for line in worker.stdout:
                echo(line.rstrip("\n"))
        status = worker.returncode
        lines = out_path.read_text().splitlines() if out_path.exists() else []
    return status, [json.loads(line) for line in lines]


def _worker_env(preload: str | None) -> dict[str, str]:
    env = {**WORKER_ENV, **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if preload:
        env["LD_PRELOAD"] = " ".join(p for p in (preload, os.environ.get("LD_PRELOAD")) if p)
    return env


def _merge(earlier: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """``results`` plus the measurements of ``earlier`` (an earlier run of the same mode)
    that it does not repeat; a case this run left out of time does not replace an earlier
    one.  The earlier environments are kept in ``earlier_envs``."""
    def key(m: dict[str, Any]) -> tuple[str, str]:
        return m["system"], m["label"]

    before = {key(m) for m in earlier["measurements"]}
    fresh = [m for m in results["measurements"] if not (m["error"] == OUT_OF_TIME and key(m) in before)]
    new = {key(m) for m in fresh}
    kept = [m for m in earlier["measurements"] if key(m) not in new]
    systems = list(dict.fromkeys(earlier["systems"] + results["systems"]))
    earlier_envs = earlier.get("earlier_envs", []) + [earlier["env"]]
    return {**results, "systems": systems, "measurements": kept + fresh, "earlier_envs": earlier_envs}
