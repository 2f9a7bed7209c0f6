"""Simplified self-attention with no trainable weights (seeds 003 and 004, first part).

Twin of ``torch_attention/simplified.py``.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from jax_attention._base import AttentionModule


class SimplifiedAttention(AttentionModule):
    """scores = x @ x^T, weights = softmax over keys, context = weights @ x.

    Args:
      normalization: ``"softmax"`` (default) or ``"sum"``, the division by the row sum
        that the tutorials show and reject (a row summing to zero raises ``ValueError``).
      causal: block keys after each query.
      mask_strategy: ``"fill"`` or ``"renormalize"`` (see ``functional.normalize_scores``).
      implementation: ``"auto"``, ``"reference"``, ``"fused"`` or ``"blockwise"``.
      precision: of the matmuls (``jax.lax.Precision``), ``"highest"`` by default.
      rngs: accepted for uniformity with the other modules; nothing is random here.

    Input (B, T, C) or (T, C) of any float dtype (no parameters, so no ``dtype``: it
    computes in ``x``'s dtype); output the same shape; weights (B, 1, T, T) or (1, T, T).
    Scores are not scaled, as in the tutorials.
    """

    variant = "SimplifiedAttention"

    def __init__(
        self,
        *,
        normalization: str = "softmax",
        causal: bool = False,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        softcap: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        alignment: str = "top_left",
        precision: Any = "highest",
        rngs: nnx.Rngs | None = None,
    ) -> None:
        super().__init__(locals(), precision=precision, rngs=rngs)
