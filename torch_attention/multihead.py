"""Multi-head attention: a wrapper of single heads, and heads split from one projection
(seed 004; seed 000's last section without the output projection).

Twin of ``jax_attention/multihead.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from attention_spec import check_config, check_positive_int
from torch_attention._base import AttentionModule
from torch_attention.causal import CausalAttention


def _head_slice(m: Tensor | None, i: int) -> Tensor | None:
    """Head ``i`` of a mask broadcastable to (B, H, T, S); a head dimension of 1 is shared."""
    if m is None or m.dim() < 3 or m.shape[-3] == 1:
        return m
    return m[..., i : i + 1, :, :]


class MultiHeadAttentionWrapper(AttentionModule):
    """``num_heads`` independent ``CausalAttention`` heads (``heads[i]``), outputs
    concatenated: (B, T, d_in) -> (B, T, num_heads * d_out); weights (B, num_heads, T, T).

    A mask or dropout mask with a head dimension of ``num_heads`` gives head i its slice.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        scale: float | None = None,
        causal: bool = True,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        # Each head has its own width d_out, so num_heads need not divide it.
        check_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        check_positive_int("num_heads", num_heads)
        super().__init__()
        self.d_in, self.d_out, self.context_length = d_in, d_out, context_length
        self.num_heads, self.qkv_bias = num_heads, qkv_bias
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            num_heads=num_heads, qkv_bias=qkv_bias, scale=scale, causal=causal,
            mask_strategy=mask_strategy,
            implementation=implementation,
        )
        self.heads = nn.ModuleList(
            CausalAttention(
                d_in, d_out, context_length, dropout, qkv_bias,
                scale=scale, causal=causal, mask_strategy=mask_strategy,
                implementation=implementation, dtype=dtype, device=device,
            )
            for _ in range(num_heads)
        )

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
        dropout_mask: Tensor | None = None,
        kv_lengths: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        self._check_call(x, mask, dropout_mask, kv_lengths)
        results = [
            head(
                x, _head_slice(mask, i), return_weights=return_weights,
                dropout_mask=_head_slice(dropout_mask, i), kv_lengths=kv_lengths,
            )
            for i, head in enumerate(self.heads)
        ]
        if not return_weights:
            return torch.cat(cast(list[Tensor], results), dim=-1)  # (B, T, num_heads * d_out)
        pairs = cast(list[tuple[Tensor, Tensor]], results)
        out = torch.cat([o for o, _ in pairs], dim=-1)
        return out, torch.cat([w for _, w in pairs], dim=-3)  # (B, num_heads, T, T)


class MultiHeadAttention(AttentionModule):
    """Causal multi-head attention with weight splits: one ``nn.Linear(d_in, d_out)`` per
    q/k/v (``W_query``, ``W_key``, ``W_value``) split into ``num_heads`` heads of
    ``d_out // num_heads``, heads mixed by ``out_proj`` (``nn.Linear(d_out, d_out)``).
    ``out_proj=False`` only concatenates the heads (seed 000).

    (B, T, d_in) -> (B, T, d_out); weights (B, num_heads, T, T).
    Scale None = 1/sqrt(head_dim).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        out_proj: bool = True,
        scale: float | None = None,
        causal: bool = True,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            num_heads=num_heads, scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        super().__init__()
        self.d_in, self.d_out, self.context_length = d_in, d_out, context_length
        self.num_heads, self.head_dim, self.qkv_bias = num_heads, d_out // num_heads, qkv_bias
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            num_heads=num_heads, qkv_bias=qkv_bias, out_proj=out_proj, scale=scale, causal=causal,
            mask_strategy=mask_strategy,
            implementation=implementation,
        )
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.out_proj = nn.Linear(d_out, d_out, **factory) if out_proj else None
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
        # (B, T, d_in) -> (B, T, d_out) -> (B, num_heads, T, head_dim)
        return (
            self._split_heads(self.W_query(x)),
            self._split_heads(self.W_key(x)),
            self._split_heads(self.W_value(x)),
        )

    def _merge(self, out: Tensor) -> Tensor:
        out = super()._merge(out)  # (B, num_heads, T, head_dim) -> (B, T, d_out)
        return out if self.out_proj is None else self.out_proj(out)
