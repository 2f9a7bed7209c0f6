"""Simplified self-attention with no trainable weights (seeds 003 and 004, first part).

Twin of ``torch_attention/simplified.py``.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from jax import Array

from attention_spec import check_config
from jax_attention._base import AttentionModule


class SimplifiedAttention(AttentionModule):
    """scores = x @ x^T, weights = softmax over keys, context = weights @ x.

    Args:
      normalization: ``"softmax"`` (default) or ``"sum"``, the division by the row sum
        that the tutorials show and reject (a row summing to zero raises ``ValueError``).
      causal: block keys after each query.
      mask_strategy: ``"fill"`` or ``"renormalize"`` (see ``functional.normalize_scores``).
      rngs: accepted for uniformity with the other modules; nothing is random here.

    Input (B, T, C) or (T, C); output the same shape; weights (B, 1, T, T) or (1, T, T).
    Scores are not scaled, as in the tutorials.
    """

    def __init__(
        self,
        *,
        normalization: str = "softmax",
        causal: bool = False,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        precision: Any = "highest",
        rngs: nnx.Rngs | None = None,
    ) -> None:
        check_config(normalization=normalization, causal=causal, mask_strategy=mask_strategy,
                     implementation=implementation)
        self.normalization = normalization
        self.causal = causal
        self.mask_strategy = mask_strategy
        self.implementation = implementation
        self.scale = 1.0
        self._set_config(normalization=normalization, causal=causal, mask_strategy=mask_strategy,
                     implementation=implementation)
        self.precision = precision

    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        *,
        return_weights: bool = False,
        kv_lengths: Array | None = None,
    ) -> Array | tuple[Array, Array]:
        return self._attend(x, mask, return_weights, None, None, None, kv_lengths)

    def _project(self, x: Array) -> tuple[Array, Array, Array]:
        x = x[:, None]  # (B, T, C) -> (B, 1, T, C): one head, the input itself
        return x, x, x
