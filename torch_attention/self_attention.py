"""Self-attention with trainable weights (seeds 003 and 004).

``SelfAttention_v1`` holds raw ``(d_in, d_out)`` matrices applied as ``x @ W``;
``SelfAttention_v2`` holds ``nn.Linear`` layers.  Twin of ``jax_attention/self_attention.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attention_spec import check_config
from torch_attention._base import AttentionModule


class SelfAttention_v1(AttentionModule):  # noqa: N801 (the tutorials' name)
    """Single-head self-attention with parameters ``W_query``, ``W_key``, ``W_value`` of
    shape (d_in, d_out), drawn from N(0, 1) in that order, as seed 004 does.

    Input (B, T, d_in) or (T, d_in) -> (B, T, d_out) or (T, d_out); weights (B, 1, T, T).
    Scores are scaled by 1/sqrt(d_out) unless ``scale`` says otherwise; ``causal=True``
    blocks future keys; an optional bool ``mask`` (True = may attend) blocks more.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        scale: float | None = None,
        causal: bool = False,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_config(d_in=d_in, d_out=d_out, scale=scale, causal=causal, mask_strategy=mask_strategy,
                     implementation=implementation)
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, d_out=d_out, scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.W_query = nn.Parameter(torch.randn(d_in, d_out, **factory))
        self.W_key = nn.Parameter(torch.randn(d_in, d_out, **factory))
        self.W_value = nn.Parameter(torch.randn(d_in, d_out, **factory))

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
        # (B, T, d_in) @ (d_in, d_out) -> (B, 1, T, d_out)
        return (
            self._split_heads(x @ self.W_query),
            self._split_heads(x @ self.W_key),
            self._split_heads(x @ self.W_value),
        )


class SelfAttention_v2(AttentionModule):  # noqa: N801 (the tutorials' name)
    """As ``SelfAttention_v1`` with ``nn.Linear`` projections ``W_query``, ``W_key``,
    ``W_value`` (PyTorch's default initialisation), with biases if ``qkv_bias``.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        qkv_bias: bool = False,
        *,
        scale: float | None = None,
        causal: bool = False,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_config(d_in=d_in, d_out=d_out, scale=scale, causal=causal, mask_strategy=mask_strategy,
                     implementation=implementation)
        super().__init__()
        self.d_in, self.d_out, self.qkv_bias = d_in, d_out, qkv_bias
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, d_out=d_out, qkv_bias=qkv_bias, scale=scale, causal=causal,
            mask_strategy=mask_strategy,
            implementation=implementation,
        )
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)

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
        # (B, T, d_in) -> (B, T, d_out) -> (B, 1, T, d_out)
        return (
            self._split_heads(self.W_query(x)),
            self._split_heads(self.W_key(x)),
            self._split_heads(self.W_value(x)),
        )
