"""Strict test settings: JAX rank promotion raises (a strictness setting of the tests, not
something the library needs), and helpers that skip cleanly when a framework is missing.

No precision flag is set here: the library passes ``precision=`` to its own matmuls, and
``check_parity`` sets full-precision matmuls (JAX "highest", PyTorch TF32 off) in a
context that it restores (``harness.full_precision``); test_global_state.py proves both.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("flax") is not None

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


needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")
needs_jax = pytest.mark.skipif(not HAS_JAX, reason="JAX / Flax are not installed")
needs_both = pytest.mark.skipif(not (HAS_TORCH and HAS_JAX), reason="needs both PyTorch and JAX")

TUTORIAL_INPUTS = [
    [0.43, 0.15, 0.89],  # Your     (x^1)
    [0.55, 0.87, 0.66],  # journey  (x^2)
    [0.57, 0.85, 0.64],  # starts   (x^3)
    [0.22, 0.58, 0.33],  # with     (x^4)
    [0.77, 0.25, 0.10],  # one      (x^5)
    [0.05, 0.80, 0.55],  # step     (x^6)
]
