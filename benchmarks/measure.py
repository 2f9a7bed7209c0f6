"""Timing one (system, config) case: the first call (compile) apart, warm-up calls, the
output checked against the float64 oracle (``oracle``: ``benchmarks/oracle_check.py``),
then the median of the timed runs; failures, out-of-memory above all, become an ``error``
entry instead of ending the run."""

from __future__ import annotations

import gc
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks import oracle_check
from benchmarks.configs import Config, is_core
from benchmarks.environment import cpu_ticks, host_share
from benchmarks.systems import Case, build, framework_of


def measure(system: str, config: Config, *, runs: int, warmup: int, backward: bool, warmup_s: float = 0.0,
            timed_s: float = 0.0) -> dict[str, Any]:
    """One measurement: ``fwd`` (and ``fwd_bwd`` when ``backward``) timings, the peak
    device memory, ``oracle`` (the float64 oracle's verdict on the forward's output,
    ``oracle_check.verdict``: the runner fails the run where one of ours is wrong), and ``error`` (None, or the failure of a phase: ``"fwd+bwd: ..."``).

    Timings: the first call is timed alone as ``compile_s``, ``warmup`` more calls are
    not timed (more, until the warm-up has lasted ``warmup_s``), then ``runs`` samples (more,
    until they fill ``timed_s``, up to ``MAX_RUNS``) each timed with a host clock around calls that
    return only when the device is done.  A sample is one call, or as many back-to-back
    calls as fill ``SAMPLE_S`` when one call is shorter (GPU kernels of a millisecond:
    the launch and synchronisation are then not counted per call); the times are per
    call.  TFLOP/s count the attention core only (``configs.flops``);
    ``tflops_incl_projections`` adds the four projections of a module system."""
    case = CaseTimer(system, config, warmup=warmup, warmup_s=warmup_s, rewarm=False)
    for phase in ("fwd", "fwd_bwd") if backward else ("fwd",):
        wanted = case.prepare(phase, runs, timed_s)
        for _ in range(wanted or 0):
            if not case.sample(phase):
                break
    return case.finish()


# A call shorter than this is called once, untimed, before each turn's timed run: the
# turn before was another process's, which left the caches cold and this process's
# thread pool asleep; a timed run should find them as a run after another run does.
REWARM_BELOW_S = 0.2
NO_TICKS = {"total": 0, "idle": 0, "steal": 0}  # cpu_ticks' keys: CaseTimer sums the timed runs' ticks


class CaseTimer:
    """One case measured a sample at a time: built on creation, then per phase ``prepare``
    (the first call, the warm-up) and ``sample`` as often as asked, then ``finish``, the
    measurement.  ``measure`` samples it straight through; ``runner``'s turns interleave
    the samples of several systems' cases (``rewarm``: see ``REWARM_BELOW_S``).  A failure
    ends the case with an ``error``; what it measured before stays.  ``host_share``
    covers the timed runs only (in turns, the case is idle in between)."""

    PHASES = {"fwd": "fwd", "fwd_bwd": "fwd+bwd"}  # the result's key: the phase's name in errors

    def __init__(self, system: str, config: Config, *, warmup: int, warmup_s: float = 0.0,
                 rewarm: bool = True) -> None:
        self.system, self.config, self.warmup, self.warmup_s = system, config, warmup, warmup_s
        self.rewarm = rewarm
        self.result = empty_result(system, config)
        self.rss_before = _max_rss_bytes()
        self.ticks = dict(NO_TICKS)
        self.own_s = 0.0
        self.phases: dict[str, Phase] = {}
        self.times: dict[str, list[float]] = {}
        self.case: Case | None = None
        try:
            self.case = build(system, config)
        except Exception as error:
            self._fail("build", error)

    @property
    def failed(self) -> bool:
        return self.result["error"] is not None

    def prepare(self, phase: str, runs: int, timed_s: float = 0.0) -> int | None:
        """Compiles and warms up ``phase`` ("fwd" or "fwd_bwd"); how many timed runs it
        wants (``runs``, or more to fill ``timed_s``), or None where it failed."""
        if self.failed or self.case is None:
            return None
        call = self.case.forward if phase == "fwd" else self.case.forward_backward
        try:
            self.phases[phase] = Phase(call, self.warmup, self.warmup_s)
        except Exception as error:
            self._fail(self.PHASES[phase], error)
            return None
        if phase == "fwd":  # compiled and warm: the output against the oracle, before it is timed
            try:
                self.result["oracle"] = oracle_check.timed(self._verdict)
            except Exception as error:
                self._fail("oracle check", error)
                return None
        self.times[phase] = []
        gc.collect()
        return self.phases[phase].runs_for(runs, timed_s)

    def sample(self, phase: str) -> bool:
        """One timed run of ``phase``; False where it failed."""
        if self.failed:
            return False
        ticks, own = cpu_ticks(), time.process_time()
        gc.disable()  # no collector pauses inside a timed run
        try:
            timed = self.phases[phase]
            if self.rewarm and timed.one_s < REWARM_BELOW_S:
                timed.call(1)  # untimed: the caches and thread pool as a run after another finds them
            seconds = timed.sample()
        except Exception as error:
            self._fail(self.PHASES[phase], error)
            return False
        finally:
            gc.enable()
        after = cpu_ticks()
        self.own_s += time.process_time() - own
        if ticks is not None and after is not None:
            for key in self.ticks:
                self.ticks[key] += after[key] - ticks[key]
        self.times[phase].append(seconds)
        return True

    def finish(self) -> dict[str, Any]:
        """The measurement, as ``measure`` gives it; frees the case."""
        projections = 0 if is_core(self.system) else self.config.projection_flops()
        flops = {"fwd": (self.config.flops(), projections),
                 "fwd_bwd": (self.config.fwd_bwd_flops(), 3 * projections)}
        for phase, times in self.times.items():
            failed_here = self.failed and self.result["error"].startswith(self.PHASES[phase] + ":")
            if times and not failed_here:
                self.result[phase] = self.phases[phase].summary(times, *flops[phase])
        if self.case is not None and not self.failed:
            try:
                self.result.update(self.case.memory())
            except Exception as error:
                self._fail("memory", error)
        self.case = None
        _release(framework_of(self.system))
        self.result["max_rss_growth_bytes"] = _max_rss_bytes() - self.rss_before
        self.result["host_share"] = host_share(NO_TICKS, self.ticks, self.own_s)
        return self.result

    def _verdict(self) -> dict[str, Any]:
        assert self.case is not None
        got, want, checked = self.case.oracle(self.case.output())
        return oracle_check.verdict(self.system, got, want, self.config.dtype, checked=checked,
                                    framework=framework_of(self.system))

    def _fail(self, phase: str, error: BaseException) -> None:
        if not self.failed:
            self.result["error"] = f"{phase}: {describe(error)}"


OUT_OF_TIME = "not run: the run's time budget (--budget-s) was spent"


def empty_result(system: str, config: Config, error: str | None = None) -> dict[str, Any]:
    """A measurement with nothing measured (yet): the shape every result has."""
    return {
        "system": system, "label": config.label, "config": config.to_json(),
        "fwd": None, "fwd_bwd": None, "peak_mem_bytes": None, "peak_mem_source": None,
        "max_rss_growth_bytes": None, "host_share": None, "oracle": None, "error": error,
    }


def describe(error: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, shortened: XLA's out-of-memory reports run to
    pages."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


SAMPLE_S = 0.02  # a timed sample lasts at least this long where single calls are shorter
MAX_REPEAT = 100
MAX_RUNS = 50  # timed runs at most, where the mode's timed_s asks for more than `runs`


def _time(
    call: Callable[[int], None], runs: int, warmup: int, flops: int, projection_flops: int,
    warmup_s: float = 0.0, timed_s: float = 0.0,
) -> dict[str, Any]:
    phase = Phase(call, warmup, warmup_s)
    runs = phase.runs_for(runs, timed_s)
    gc.collect()
    gc.disable()  # no collector pauses inside the timed runs (as timeit does)
    try:
        times = [phase.sample() for _ in range(runs)]
    finally:
        gc.enable()
    return phase.summary(times, flops, projection_flops)


class Phase:
    """One phase of a case (the forward, or forward + backward), warmed up and ready to be
    sampled: the first call is timed as ``compile_s``, then ``warmup`` calls (more, until
    they have lasted ``warmup_s``); a sample is ``repeat`` back-to-back calls, as many as
    fill ``SAMPLE_S`` where one call is shorter."""

    def __init__(self, call: Callable[[int], None], warmup: int, warmup_s: float = 0.0) -> None:
        self.call = call
        self.compile_s = _clock(call, 1)
        one, warmed, done = self.compile_s, 0.0, 0
        while done < warmup or (warmed < warmup_s and done < MAX_RUNS):
            one = _clock(call, 1)
            warmed, done = warmed + one, done + 1
        self.one_s = one  # about how long one call lasts
        self.repeat = max(1, min(MAX_REPEAT, int(SAMPLE_S / max(one, 1e-9))))
        self.sample_s = one * self.repeat  # and one sample

    def runs_for(self, runs: int, timed_s: float) -> int:
        """``runs``, or more where they do not fill ``timed_s`` (up to ``MAX_RUNS``)."""
        return max(runs, min(MAX_RUNS, math.ceil(timed_s / max(self.sample_s, 1e-9))))

    def sample(self) -> float:
        """One timed run: seconds per call."""
        return _clock(self.call, self.repeat) / self.repeat

    def summary(self, times: list[float], flops: int, projection_flops: int) -> dict[str, Any]:
        median = statistics.median(times)
        q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (median, median, median)
        return {
            "compile_s": self.compile_s,
            "median_ms": median * 1e3,
            "iqr_pct": 100 * (q3 - q1) / median,  # spread: interquartile range over the median
            "tflops": flops / median / 1e12,
            "tflops_incl_projections": (flops + projection_flops) / median / 1e12,
            "runs": len(times),
            "calls_per_run": self.repeat,
            "times_ms": [t * 1e3 for t in times],
        }


def _clock(call: Callable[[int], None], repeat: int) -> float:
    start = time.perf_counter()
    call(repeat)
    return time.perf_counter() - start


def _max_rss_bytes() -> int:
    """The process's high-water resident set (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _release(framework: str) -> None:
    """Frees what the last case held before the next one is built."""
    gc.collect()
    if framework == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
