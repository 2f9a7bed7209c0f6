"""Simplified self-attention with no trainable weights (seeds 003 and 004, first part).

Twin of ``jax_attention/simplified.py``.
"""

from __future__ import annotations

from torch import Tensor

from attention_spec import check_config
from torch_attention._base import AttentionModule


class SimplifiedAttention(AttentionModule):
    """scores = x @ x^T, weights = softmax over keys, context = weights @ x.

    Args:
      normalization: ``"softmax"`` (default) or ``"sum"``, the division by the row sum
        that the tutorials show and reject (a row summing to zero raises ``ValueError``).
      causal: block keys after each query.
      mask_strategy: ``"fill"`` or ``"renormalize"`` (see ``functional.normalize_scores``).

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
    ) -> None:
        check_config(normalization=normalization, causal=causal, mask_strategy=mask_strategy,
                     implementation=implementation)
        super().__init__()
        self.normalization = normalization
        self.causal = causal
        self.mask_strategy = mask_strategy
        self.implementation = implementation
        self.scale = 1.0
        self._set_config(normalization=normalization, causal=causal, mask_strategy=mask_strategy,
                     implementation=implementation)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
        kv_lengths: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        return self._attend(x, mask, return_weights, kv_lengths=kv_lengths)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = x.unsqueeze(1)  # (B, T, C) -> (B, 1, T, C): one head, the input itself
        return x, x, x
