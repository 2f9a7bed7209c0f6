"""Strict test settings: JAX rank promotion raises (a strictness setting of the tests, not
something the library needs), and bounded compile caches; the
helpers the tests share are in ``tests/support.py``.

No precision flag is set here: the library passes ``precision=`` to its own matmuls, and
``check_parity`` sets full-precision matmuls (JAX "highest", PyTorch TF32 off) in a
context that it restores (``harness.full_precision``); test_global_state.py proves both.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

from tests.support import HAS_JAX

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


def _memory_maps() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


@pytest.fixture(autouse=True)
def _bounded_compile_caches():  # type: ignore[no-untyped-def]
    yield
    if HAS_JAX and "jax" in sys.modules:
        maps = _memory_maps()
        if maps is not None and maps > MAX_MAPS:
            jax.clear_caches()
            gc.collect()
