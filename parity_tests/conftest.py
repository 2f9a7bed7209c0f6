"""Strict test settings: JAX rank promotion raises, float32 matmuls at full precision in
both frameworks (TF32 off), and helpers that skip cleanly when a framework is missing."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("flax") is not None

if HAS_JAX:
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_default_matmul_precision", "highest")
    if os.environ.get("JAX_ENABLE_X64"):
        jax.config.update("jax_enable_x64", True)

if HAS_TORCH:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

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
