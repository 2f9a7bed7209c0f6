"""Causal self-attention: ``CausalAttention`` (seed 004) and ``Head`` (seed 002).

Twin of ``jax_attention/causal.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attention_spec import check_config
from torch_attention._base import AttentionModule


class CausalAttention(AttentionModule):
    """Single-head causal self-attention with dropout on the attention weights.

    Parameters ``W_query``, ``W_key``, ``W_value`` (``nn.Linear(d_in, d_out)``, biases if
    ``qkv_bias``), created in that order.  Input (B, T, d_in) or (T, d_in) with
    T <= context_length -> (B, T, d_out); weights (B, 1, T, T).

    Args:
      dropout: rate on the attention weights, training mode only.
      scale: None = 1/sqrt(d_out), a float as given.
      causal: True by definition; False turns this into plain (bidirectional) attention.
      mask_strategy: ``"fill"`` (mask before softmax) or ``"renormalize"`` (after, seed 004).

    Forward: ``mask`` (bool, True = may attend, broadcastable to (B, 1, T, T)) is combined
    with the causal mask; ``dropout_mask`` (bool, True = keep) replaces the random dropout
    draw in training mode.  Raises ``ValueError``/``TypeError`` before any work.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
        *,
        scale: float | None = None,
        causal: bool = True,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        super().__init__()
        self.d_in, self.d_out, self.context_length, self.qkv_bias = d_in, d_out, context_length, qkv_bias
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            qkv_bias=qkv_bias, scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
        dropout_mask: Tensor | None = None,
        kv_lengths: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        return self._attend(x, mask, return_weights, dropout_mask, kv_lengths)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # (B, T, d_in) -> (B, T, d_out) -> (B, 1, T, d_out)
        return (
            self._split_heads(self.W_query(x)),
            self._split_heads(self.W_key(x)),
            self._split_heads(self.W_value(x)),
        )


class Head(AttentionModule):
    """One causal head over (B, T, C), as in seed 002: bias-free projections ``key``,
    ``query``, ``value`` (created in that order) of width ``head_size``, **unscaled**
    scores by default (``scale=1.0``), a ``tril`` causal mask, dropout on the weights.

    Input (B, T, d_in) or (T, d_in), T <= context_length -> (B, T, head_size).
    """

    def __init__(
        self,
        d_in: int,
        head_size: int,
        context_length: int,
        dropout: float = 0.0,
        *,
        scale: float | None = 1.0,
        causal: bool = True,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_config(
            d_in=d_in, head_size=head_size, context_length=context_length, dropout=dropout,
            scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        super().__init__()
        self.d_in, self.head_size, self.context_length = d_in, head_size, context_length
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, head_size=head_size, context_length=context_length, dropout=dropout,
            scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.key = nn.Linear(d_in, head_size, bias=False, **factory)
        self.query = nn.Linear(d_in, head_size, bias=False, **factory)
        self.value = nn.Linear(d_in, head_size, bias=False, **factory)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
        dropout_mask: Tensor | None = None,
        kv_lengths: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        return self._attend(x, mask, return_weights, dropout_mask, kv_lengths)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # (B, T, C) -> (B, T, head_size) -> (B, 1, T, head_size)
        return (
            self._split_heads(self.query(x)),
            self._split_heads(self.key(x)),
            self._split_heads(self.value(x)),
        )
