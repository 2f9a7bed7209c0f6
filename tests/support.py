"""What the tests share: whether each framework is installed, markers that skip a test
cleanly where one is missing, and the tutorials' six input embeddings."""

from __future__ import annotations

import importlib.util

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("flax") is not None

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
