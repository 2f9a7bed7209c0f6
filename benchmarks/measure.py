"""Timing one (system, config) case: the first call (compile) apart, warm-up calls, then
the median of the timed runs; failures, out-of-memory above all, become an ``error``
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

from benchmarks.configs import Config, is_core
from benchmarks.environment import cpu_ticks, host_share
from benchmarks.systems import Case, build, framework_of


def measure(system: str, config: Config, *, runs: int, warmup: int, backward: bool, warmup_s: float = 0.0,
            timed_s: float = 0.0) -> dict[str, Any]:
    """One measurement: ``fwd`` (and ``fwd_bwd`` when ``backward``) timings, the peak
    device memory, and ``error`` (None, or the failure of a phase: ``"fwd+bwd: ..."``).

    Timings: the first call is timed alone as ``compile_s``, ``warmup`` more calls are
    not timed (more, until the warm-up has lasted ``warmup_s``), then ``runs`` samples (more,
    until they fill ``timed_s``, up to ``MAX_RUNS``) each timed with a host clock around calls that
    return only when the device is done.  A sample is one call, or as many back-to-back
    calls as fill ``SAMPLE_S`` when one call is shorter (GPU kernels of a millisecond:
    the launch and synchronisation are then not counted per call); the times are per
    call.  TFLOP/s count the attention core only (``configs.flops``);
    ``tflops_incl_projections`` adds the four projections of a module system."""
    result = empty_result(system, config)
    rss_before = _max_rss_bytes()
    ticks_before, own_before = cpu_ticks(), time.process_time()
    phase = "build"
    case: Case | None = None
    try:
        case = build(system, config)
        phase = "fwd"
        projections = 0 if is_core(system) else config.projection_flops()
        floors = {"warmup_s": warmup_s, "timed_s": timed_s}
        result["fwd"] = _time(case.forward, runs, warmup, config.flops(), projections, **floors)
        if backward:
            phase = "fwd+bwd"
            # A projection's backward is 2x its forward: the input and the weight gradients.
            result["fwd_bwd"] = _time(
                case.forward_backward, runs, warmup, config.fwd_bwd_flops(), 3 * projections, **floors
            )
        result.update(case.memory())
    except Exception as error:  # any failure of one case is a result, not a crash
        result["error"] = f"{phase}: {describe(error)}"
    finally:
        case = None  # what the case holds is freed before the next one is built
        _release(framework_of(system))
    result["max_rss_growth_bytes"] = _max_rss_bytes() - rss_before
    result["host_share"] = host_share(ticks_before, cpu_ticks(), time.process_time() - own_before)
    return result


OUT_OF_TIME = "not run: the run's time budget (--budget-s) was spent"


def empty_result(system: str, config: Config, error: str | None = None) -> dict[str, Any]:
    """A measurement with nothing measured (yet): the shape every result has."""
    return {
        "system": system, "label": config.label, "config": config.to_json(),
        "fwd": None, "fwd_bwd": None, "peak_mem_bytes": None, "peak_mem_source": None,
        "max_rss_growth_bytes": None, "host_share": None, "error": error,
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
    compile_s = _clock(call, 1)
    one = compile_s
    warmed, done = 0.0, 0
    while done < warmup or (warmed < warmup_s and done < MAX_RUNS):
        one = _clock(call, 1)
        warmed, done = warmed + one, done + 1
    repeat = max(1, min(MAX_REPEAT, int(SAMPLE_S / max(one, 1e-9))))
    runs = max(runs, min(MAX_RUNS, math.ceil(timed_s / max(one * repeat, 1e-9))))
    gc.collect()
    gc.disable()  # no collector pauses inside the timed runs (as timeit does)
    try:
        times = [_clock(call, repeat) / repeat for _ in range(runs)]
    finally:
        gc.enable()
    median = statistics.median(times)
    q1, _, q3 = statistics.quantiles(times, n=4) if runs > 1 else (median, median, median)
    return {
        "compile_s": compile_s,
        "median_ms": median * 1e3,
        "iqr_pct": 100 * (q3 - q1) / median,  # spread: interquartile range over the median
        "tflops": flops / median / 1e12,
        "tflops_incl_projections": (flops + projection_flops) / median / 1e12,
        "runs": runs,
        "calls_per_run": repeat,
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
