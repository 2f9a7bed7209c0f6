"""Causal self-attention: ``CausalAttention`` (seed 004) and ``Head`` (seed 002).

Twin of ``jax_attention/causal.py``.
"""

from __future__ import annotations

import torch

from torch_attention._base import AttentionModule


class CausalAttention(AttentionModule):
    """Single-head causal self-attention with dropout on the attention weights.

    Parameters ``W_query``, ``W_key``, ``W_value`` (``nn.Linear(d_in, d_out)``, biases if
    ``qkv_bias``), created in that order.  Input (B, T, d_in) or (T, d_in) with
    T <= context_length -> (B, T, d_out); weights (B, 1, T, T).

    Args:
      context_length: the longest sequence accepted; None = no cap.
      dropout: rate on the attention weights, training mode only.
      scale: None = 1/sqrt(d_out), a float as given.
      causal: True by definition; False turns this into plain (bidirectional) attention.
      mask_strategy: ``"fill"`` (mask before softmax) or ``"renormalize"`` (after, seed 004).
      dtype, device: as ``nn.Linear``'s (the Flax twin's ``param_dtype``).

    Forward: ``mask`` (bool, True = may attend, broadcastable to (B, 1, T, T)) is combined
    with the causal mask; ``dropout_mask`` (bool, True = keep) replaces the random dropout
    draw in training mode.  Raises ``ValueError``/``TypeError`` before any work.
    """

    variant = "CausalAttention"

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int | None,
        dropout: float,
        qkv_bias: bool = False,
        *,
        scale: float | None = None,
        causal: bool = True,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        softcap: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        alignment: str = "top_left",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(locals(), dtype=dtype, device=device)


class Head(AttentionModule):
    """One causal head over (B, T, C), as in seed 002: bias-free projections ``key``,
    ``query``, ``value`` (created in that order) of width ``head_size``, **unscaled**
    scores by default (``scale=1.0``), a ``tril`` causal mask, dropout on the weights.

    Input (B, T, d_in) or (T, d_in), T <= context_length (None = no cap) ->
    (B, T, head_size).
    """

    variant = "Head"

    def __init__(
        self,
        d_in: int,
        head_size: int,
        context_length: int | None,
        dropout: float = 0.0,
        *,
        scale: float | None = 1.0,
        causal: bool = True,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        softcap: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        alignment: str = "top_left",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(locals(), dtype=dtype, device=device)
