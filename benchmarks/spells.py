"""``python -m benchmarks.spells``: does the host slow this machine's vector units in spells?

On a shared virtual machine the host may, for seconds at a time, give part of a core's
vector units to another guest; the guest sees no steal time, only slower vector code.
This probe shows it in one process. Every window of ``--window-s`` it times three loops
that use different parts of a core:

  matmul  a 256 x 256 float32 matmul (numpy), L2-resident: vector throughput
  copy    a 64 MiB copy (numpy): memory bandwidth
  scalar  a loop of Python integer arithmetic: scalar throughput

It prints each window's medians, each relative to that loop's fastest quarter of windows,
then how many windows each loop was more than ``--slow`` over its fast level. Where only
``matmul`` has slow windows, the host is slowing vector code, and programs timed one after
another are compared across spells. This is why ``--cpu-sweep`` times a config's systems
in turns (``runner._run_in_turns``). Measured on the 2-core Zen 5 of
``results/cpu-2core-amd-epyc-zen5`` (2026-11-26): the matmul 15-35% slower in spells from
about a second to most of a minute (68% of one minute's windows), with other minutes
free of them; copy and scalar unchanged.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

LOOPS = ("matmul", "copy", "scalar")


def probe(seconds: float, window_s: float = 0.5) -> list[dict[str, float]]:
    """Per window: the median seconds of one call of each loop."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    big = np.ones(16 * 2**20, np.float32)
    dst = np.empty_like(big)

    def scalar() -> None:
        total = 0
        for i in range(20_000):
            total += i * i

    calls: dict[str, Callable[[], Any]] = {
        "matmul": lambda: a @ a, "copy": lambda: np.copyto(dst, big), "scalar": scalar,
    }
    windows = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        window: dict[str, float] = {"t": time.perf_counter()}
        for name, call in calls.items():
            times = []
            stop = time.perf_counter() + window_s / len(calls)
            while not times or time.perf_counter() < stop:
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            window[name] = statistics.median(times)
        windows.append(window)
    return windows


def summary(windows: list[dict[str, float]], slow: float = 0.1) -> dict[str, dict[str, float]]:
    """Per loop: its fast level (the median of its fastest quarter of windows) and the
    fraction of windows more than ``slow`` above it."""
    out = {}
    for name in LOOPS:
        times = sorted(w[name] for w in windows)
        fast = statistics.median(times[: max(1, len(times) // 4)])
        out[name] = {"fast_s": fast, "slow_fraction": sum(t > (1 + slow) * fast for t in times) / len(times)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spells", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to probe (default 30)")
    parser.add_argument("--window-s", type=float, default=0.5, help="one window's length (default 0.5)")
    parser.add_argument("--slow", type=float, default=0.1, help="a window this much over the fast level is slow")
    args = parser.parse_args(argv)
    windows = probe(args.seconds, args.window_s)
    levels = summary(windows, args.slow)
    start = windows[0]["t"]
    print("  time s  " + "  ".join(f"{name:>8}" for name in LOOPS) + "   (each over its fast level)")
    for w in windows:
        print(f"{w['t'] - start:8.1f}  " + "  ".join(f"{w[n] / levels[n]['fast_s']:8.2f}" for n in LOOPS))
    for name in LOOPS:
        level = levels[name]
        print(f"{name}: fast level {level['fast_s'] * 1e6:.1f} us; "
              f"{level['slow_fraction']:.0%} of windows more than {args.slow:.0%} slower")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
