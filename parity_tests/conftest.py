"""Strict test settings: JAX rank promotion raises (a strictness setting of the tests, not
something the library needs), and helpers that skip cleanly when a framework is missing.

No precision flag is set here: the library passes ``precision=`` to its own matmuls, and
``check_parity`` sets full-precision matmuls (JAX "highest", PyTorch TF32 off) in a
context that it restores (``harness.full_precision``); test_global_state.py proves both.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("flax") is not None

if HAS_JAX:
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    if os.environ.get("JAX_ENABLE_X64"):
        jax.config.update("jax_enable_x64", True)

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
