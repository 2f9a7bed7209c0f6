"""Strict test settings: JAX rank promotion raises (a strictness setting of the tests, not
something the library needs), and bounded compile caches; the tiers (``--exhaustive``)
and their time budgets; the helpers the tests share are in ``tests/support.py``.

No precision flag is set here: the library passes ``precision=`` to its own matmuls, and
``check_parity`` sets full-precision matmuls (JAX "highest", PyTorch TF32 off) in a
context that it restores (``harness.full_precision``); test_global_state.py proves both.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import pytest

from tests import budgets, time_report
from tests.support import HAS_JAX
from tests.tiers import QUICK_STAND_INS

# implementation="auto" on CPU takes the library's CPU kernel or not as a short measurement
# on the machine says (jax_attention/_cpu_measure.py: made on first use, cached beside the
# kernel's build). The suite stays deterministic, and does not measure in every cache a test
# makes (its subprocesses inherit this): "auto" takes the kernel, as the measurement does on
# the machines the suite is timed on. Set here, before anything imports jax_attention;
# tests/kernels/test_cpu_auto.py unsets it to measure. A value the environment gives
# (measure, blockwise) is kept, and the tests follow its decision.
os.environ.setdefault("TWIN_ATTENTION_CPU_AUTO", "kernel")

if HAS_JAX:
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    if os.environ.get("JAX_ENABLE_X64"):
        jax.config.update("jax_enable_x64", True)

# Every program XLA's CPU backend compiles keeps its machine code in memory maps of its
# own, and JAX caches every program for the life of the process. The suite compiles
# thousands (each eager primitive, each jitted shape), so one pytest process would reach
# Linux's limit of 65530 maps per process (vm.max_map_count) and the next compilation
# would crash with a segmentation fault. Past MAX_MAPS, the caches are cleared between
# tests: later tests recompile what they need (about 140 maps a test here, 675 after a
# clear).
MAX_MAPS = 30000
# Reading /proc/self/maps costs the kernel about 4 us a map (95 ms at 25,000 here):
# read after every test, it took 5% of the suite. It is read again only after as many
# tests as cannot reach MAX_MAPS at GROWTH_PER_TEST maps each (several times the most a
# test here adds), so the margin below Linux's limit stays above 30,000 maps.
GROWTH_PER_TEST = 2500
_UNCHECKED = {"tests_left": 0}


def _memory_maps() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:  # not Linux
        return None


@pytest.fixture(autouse=True)
def _bounded_compile_caches():  # type: ignore[no-untyped-def]
    yield
    if not HAS_JAX or "jax" not in sys.modules:
        return
    if _UNCHECKED["tests_left"] > 0:
        _UNCHECKED["tests_left"] -= 1
        return
    maps = _memory_maps()
    if maps is None:  # not Linux: no limit to keep under
        _UNCHECKED["tests_left"] = sys.maxsize
    elif maps > MAX_MAPS:
        jax.clear_caches()
        _SHARED_IR_CONTEXT.clear()
        gc.collect()
    else:
        _UNCHECKED["tests_left"] = (MAX_MAPS - maps) // GROWTH_PER_TEST


# JAX lowers every program (each eager primitive of a new shape, each jitted shape) in a
# fresh MLIR context and loads all its dialects into it: about 7 ms a program here, a
# tenth of the suite's time, and fresh contexts left for the garbage collector held
# twice the memory (float64 + structure-option files in one process: 170 s and 2.5 GB
# with fresh contexts, 152 s and 1.1 GB with one). The tests lower in one context per
# process, made afresh when the compile caches are cleared; the library is untouched
# (TWIN_ATTENTION_FRESH_IR_CONTEXTS=1 turns this off, to rule it out).
_SHARED_IR_CONTEXT: list[Any] = []


def _share_ir_context() -> None:
    from jax._src.interpreters import mlir

    fresh = getattr(mlir, "make_ir_context", None)
    if fresh is None or os.environ.get("TWIN_ATTENTION_FRESH_IR_CONTEXTS"):
        return  # another JAX: lower as it does

    def shared() -> Any:
        if not _SHARED_IR_CONTEXT:
            _SHARED_IR_CONTEXT.append(fresh())
        return _SHARED_IR_CONTEXT[0]

    mlir.make_ir_context = shared


if HAS_JAX:
    _share_ir_context()


# Both worker processes compile many of the same programs (an eager primitive of a shape
# that several files use, a module's step in two files), and a process recompiles what it
# had after its caches are cleared (above). The run keeps each compiled program once, in
# a folder of its own that the two workers share and the process that made it removes at
# the end: JAX's persistent compilation cache, keyed by the program, XLA's flags and the
# backend, so a hit is the executable the compile would have made (the same machine
# code). Writes are atomic (a file appears whole, or not at all), so a worker never reads
# the other's half-written entry. On a 2-core Zen 5 the default run took 624-705 s without
# it and 597-613 s with it (four runs each); about a fifth of all compiles hit.
# TWIN_ATTENTION_TEST_COMPILE_CACHE=0 turns it off; a path in that variable keeps the
# programs there, for the next run (a hit needs the same program, flags and backend).
_COMPILE_CACHE = "TWIN_ATTENTION_TEST_COMPILE_CACHE"
_MADE_COMPILE_CACHE: list[str] = []


def _share_compiled_programs() -> None:
    from jax._src import lru_cache

    path = os.environ.get(_COMPILE_CACHE)
    if path == "0" or not hasattr(lru_cache, "_CACHE_SUFFIX"):  # off, or another JAX
        return
    if not path:  # the first process of the run (xdist's controller, or -n 0): the workers inherit it
        path = tempfile.mkdtemp(prefix="twin-attention-compiled-")
        os.environ[_COMPILE_CACHE] = path
        _MADE_COMPILE_CACHE.append(path)

    def put(self: Any, key: str, value: bytes) -> None:
        # no eviction (max_size -1): JAX writes with Path.write_bytes; write a temporary
        # file and rename it into place instead
        final = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if final.exists():
            return
        part = final.with_name(f".{final.name}.{os.getpid()}")
        part.write_bytes(value)
        os.replace(part, final)

    lru_cache.LRUCache.put = put
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_compilation_cache_max_size", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


if HAS_JAX:
    _share_compiled_programs()


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _MADE_COMPILE_CACHE:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- tiers and budgets
#
# quick (``-m "not slow"``): each test function once; default (plain ``pytest``, CI):
# every feasible pair of option values; exhaustive (``--exhaustive``): the full products.
# The budgets are for a 2-core CPU, per kind of CPU (tests/budgets.py; docs/architecture.md,
# "The tiers, and adding a test").
_BUDGETS = budgets.budgets()
BUDGET_S = {"quick": _BUDGETS.quick, "default": _BUDGETS.default}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="also run the tests marked exhaustive: the full products of option axes "
                          "that the default run covers pairwise (tests/support.py, tiered)")
    time_report.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--time-report"):  # where the run's time goes: tests/time_report.py
        config.pluginmanager.register(time_report, "time_report")


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The quick tier runs each test function once: its first case not marked slow. (A
    # parametrised test's other cases show the same feature again; they run by default.)
    # The functions in tests/tiers.py's table are left out of it: a quicker test (named
    # there) touches their feature.
    quick_seen: set[str] = set()
    for item in items:
        function = _function(item)
        if function in QUICK_STAND_INS:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow"):
            continue
        if function in quick_seen:
            item.add_marker(pytest.mark.slow)
        quick_seen.add(function)
    if _tier(config) is not None:  # the whole suite collected: the table must name tests that are there
        _check_stand_ins({_function(item) for item in items}, quick_seen)
    if config.getoption("--exhaustive"):
        return
    left_out = [item for item in items if item.get_closest_marker("exhaustive")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]


def _function(item: pytest.Item) -> str:
    """file::[class::]function: without pytest's parameters ("[...]") or those of absl's
    ``parameterized`` and ``chex.variants`` ("_('fused')__with_jit"), so that a
    parametrised test is one function."""
    return re.sub(r"_\(.*$", "", item.nodeid.split("[")[0])


def _check_stand_ins(collected: set[str], quick: set[str], table: dict[str, str] = QUICK_STAND_INS) -> None:
    stale = [f"{left} (not collected)" for left in table if left not in collected]
    stale += [f"{stand_in}, standing in for {left} (not collected, or not in the quick tier)"
              for left, stand_in in table.items() if stand_in not in quick]
    if stale:
        raise pytest.UsageError("tests/tiers.py names tests that do not run as it says:\n  " + "\n  ".join(stale))


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # At exit, pytest's unraisable-exception plugin runs the garbage collector five times
    # (gc_collect_harder) over what the process holds: in a worker, JAX's caches of
    # thousands of programs, about 10 s at the end of each run. Every test has finished
    # and has had its own unraisable exceptions reported: what is left is frozen, so
    # those collections have nothing to walk.
    gc.freeze()


def _tier(config: pytest.Config) -> str | None:
    """Which tier this run is, by its options (None: a selection of its own)."""
    marks = (config.getoption("-m") or "").strip()
    if config.args and any(os.path.abspath(a) != os.path.abspath("tests") for a in config.args if a):
        return None
    if config.getoption("-k") or marks not in ("", "not slow"):
        return None
    if config.getoption("--exhaustive"):
        return "exhaustive" if not marks else None
    return "quick" if marks == "not slow" else "default"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or config.option.collectonly or _STARTED not in config.stash:
        return
    took = time.monotonic() - config.stash[_STARTED]
    tier = _tier(config)
    budget = BUDGET_S.get(tier or "")
    line = f"suite time: {took:.0f} s"
    if budget is not None:
        line += (f" ({tier} tier; budget {budget} s on 2 cores of a CPU {_BUDGETS.kind}"
                 f"{', OVER BUDGET' if took > budget else ''})")
    terminalreporter.write_line(line)


_STARTED = pytest.StashKey[float]()
