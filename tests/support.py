"""What the tests share: whether each framework is installed, markers that skip a test
cleanly where one is missing, the tutorials' six input embeddings, seeded inputs, and the
constructor errors of both twins."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
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


def random_x(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Standard normal float32 inputs of ``shape``, from ``seed``."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def constructor_errors(options: dict[str, Any], variant: str = "MultiHeadAttention") -> list[tuple[type, str]]:
    """The exception of the registry's ``make_config`` and of each twin's constructor for
    ``options``, as (type, text): a bad option must give the same three."""
    from flax import nnx

    import jax_attention
    import torch_attention
    from attention_spec.registry import make_config

    found = []
    for build in (lambda: make_config(variant, options),
                  lambda: getattr(torch_attention, variant)(**options),
                  lambda: getattr(jax_attention, variant)(**options, rngs=nnx.Rngs(0))):
        with pytest.raises((TypeError, ValueError)) as info:
            build()
        found.append((info.type, str(info.value)))
    return found
