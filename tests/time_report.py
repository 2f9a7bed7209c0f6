"""``pytest --time-report=PATH``: where the suite's time goes, per file and per test, written
to PATH as Markdown (and PATH + ``.json``) at the end of the run.

For each test (setup, call and teardown together): its wall time; the time XLA spent
compiling programs for it and how many (``jax._src.compiler.backend_compile_and_load``:
XLA compiles with the GIL released, so a sampling profiler of Python's stacks drops
those samples as idle); the CPU time of the processes it started (``RUSAGE_CHILDREN``: a
subprocess's import, compile, build); and the time of the garbage collector's passes
(``gc.callbacks``). Under xdist each worker measures its own tests and hands its rows to
the controller (``workeroutput``), which writes the report. The figures the docs quote
("The tiers, and adding a test" in docs/architecture.md) come from this report.
"""

from __future__ import annotations

import gc
import json
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_KEY = "time_report"


class _Clock:
    """One process's figures per test: nodeid -> [wall, compile s, compiles, child CPU s, gc s]."""

    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}
        self.current: list[float] | None = None
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)
        try:
            from jax._src import compiler
        except ImportError:  # no JAX: nothing compiles
            self._compiler = None
        else:
            self._compiler, self._compile = compiler, compiler.backend_compile_and_load
            compiler.backend_compile_and_load = self._timed_compile

    def close(self) -> None:
        """Stops measuring: the compiler and the collector as they were."""
        gc.callbacks.remove(self._on_gc)
        if self._compiler is not None:
            self._compiler.backend_compile_and_load = self._compile

    def _timed_compile(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._compile(*args, **kwargs)
        finally:
            if self.current is not None:
                self.current[1] += time.perf_counter() - start
                self.current[2] += 1

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self.current is not None:
            self.current[4] += time.perf_counter() - self._gc_started

    def measure(self, nodeid: str) -> Iterator[None]:
        row = self.current = [0.0, 0.0, 0.0, 0.0, 0.0]
        children, start = _children_cpu(), time.perf_counter()
        try:
            yield
        finally:
            row[0] = time.perf_counter() - start
            row[3] = _children_cpu() - children
            self.current = None
            self.rows[nodeid] = row


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def add_option(parser: pytest.Parser) -> None:
    """Called by tests/conftest.py, which registers this module as a plugin when the option is given."""
    parser.addoption("--time-report", metavar="PATH", default=None,
                     help="write where the run's time went (per file and per test: wall, XLA compiling, "
                          "subprocesses' CPU, garbage collection) to PATH as Markdown and PATH.json")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_CLOCK] = _Clock()
    config.stash[_ROWS] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield from item.config.stash[_CLOCK].measure(item.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    rows = config.stash[_CLOCK].rows
    if hasattr(config, "workerinput"):  # an xdist worker: the controller writes the report
        config.workeroutput[_KEY] = json.dumps(rows)  # type: ignore[attr-defined]
    else:
        config.stash[_ROWS].update(rows)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: its controller gets a worker's rows
def pytest_testnodedown(node: Any, error: Any) -> None:
    rows = getattr(node, "workeroutput", {}).get(_KEY)
    if rows is not None:
        node.config.stash[_ROWS].update(json.loads(rows))


def pytest_unconfigure(config: pytest.Config) -> None:
    config.stash[_CLOCK].close()
    if hasattr(config, "workerinput"):  # the controller writes the report
        return
    path, rows = config.getoption("--time-report"), config.stash[_ROWS]
    Path(path + ".json").write_text(json.dumps(rows))
    Path(path).write_text(render(rows, workers=getattr(config.option, "numprocesses", None)))


def render(rows: dict[str, list[float]], *, workers: int | None = None, slowest: int = 40) -> str:
    """The report: totals, every file by its tests' time, and the slowest tests."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0] * 6)
    for nodeid, row in rows.items():
        total = files[nodeid.split("::")[0]]
        for i, value in enumerate(row):
            total[i] += value
        total[5] += 1
    wall, compiling, compiles, children, collecting = (sum(r[i] for r in rows.values()) for i in range(5))
    lines = [
        "# Where the test run's time went",
        "",
        f"{len(rows)} tests, {wall:.0f} s of test time ({_processes(workers)}): XLA compiling "
        f"{compiling:.0f} s ({compiles:.0f} programs; a hit of the shared compile cache is not one), "
        f"the CPU time of the processes the tests started {children:.0f} s, garbage collection {collecting:.0f} s.",
        "",
        "| file | tests | time s | compiling s | programs | subprocesses' CPU s | gc s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (t, c, n, ch, g, count) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {name} | {count:.0f} | {t:.1f} | {c:.1f} | {n:.0f} | {ch:.1f} | {g:.1f} |")
    lines += ["", f"The {slowest} slowest tests:", "",
              "| test | time s | compiling s | programs | subprocesses' CPU s | gc s |",
              "|---|---:|---:|---:|---:|---:|"]
    for nodeid, (t, c, n, ch, g) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:slowest]:
        lines.append(f"| {nodeid} | {t:.1f} | {c:.1f} | {n:.0f} | {ch:.1f} | {g:.1f} |")
    return "\n".join(lines) + "\n"


def _processes(workers: int | None) -> str:
    return "one process" if not workers else f"{workers} workers' together"


_CLOCK = pytest.StashKey[_Clock]()
_ROWS = pytest.StashKey[dict[str, list[float]]]()
