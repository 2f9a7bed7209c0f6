"""Multi-head attention: a wrapper of single heads, and heads split from one projection
(seed 004; seed 000's last section without the output projection).

Twin of ``torch_attention/multihead.py``.
"""

from __future__ import annotations

from typing import Any, cast

import jax.numpy as jnp
from flax import nnx
from jax import Array

from attention_spec import check_config, check_positive_int
from jax_attention._base import AttentionModule, linear
from jax_attention.causal import CausalAttention


def _head_slice(m: Array | None, i: int) -> Array | None:
    """Head ``i`` of a mask broadcastable to (B, H, T, S); a head dimension of 1 is shared."""
    if m is None or m.ndim < 3 or m.shape[-3] == 1:
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
        dtype: Any = None,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        # Each head has its own width d_out, so num_heads need not divide it.
        check_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        check_positive_int("num_heads", num_heads)
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
        self.precision = precision
        self.heads = nnx.List(
            [
                CausalAttention(
                    d_in, d_out, context_length, dropout, qkv_bias, scale=scale, causal=causal,
                    mask_strategy=mask_strategy, implementation=implementation, dtype=dtype,
                    precision=precision, rngs=rngs,
                )
                for _ in range(num_heads)
            ]
        )

    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        *,
        return_weights: bool = False,
        dropout_mask: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | Array | None = None,
        kv_lengths: Array | None = None,
    ) -> Array | tuple[Array, Array]:
        self._check_call(x, mask, dropout_mask, self.heads[0]._deterministic(deterministic), kv_lengths)
        results = [
            head(
                x, _head_slice(mask, i), return_weights=return_weights,
                dropout_mask=_head_slice(dropout_mask, i), deterministic=deterministic, rngs=rngs,
                kv_lengths=kv_lengths,
            )
            for i, head in enumerate(self.heads)
        ]
        if not return_weights:
            return jnp.concatenate(cast(list[Array], results), axis=-1)  # (B, T, num_heads * d_out)
        pairs = cast(list[tuple[Array, Array]], results)
        out = jnp.concatenate([o for o, _ in pairs], axis=-1)
        return out, jnp.concatenate([w for _, w in pairs], axis=-3)  # (B, num_heads, T, T)


class MultiHeadAttention(AttentionModule):
    """Causal multi-head attention with weight splits: one ``nnx.Linear(d_in, d_out)`` per
    q/k/v (``W_query``, ``W_key``, ``W_value``) split into ``num_heads`` heads of
    ``d_out // num_heads``, heads mixed by ``out_proj`` (``nnx.Linear(d_out, d_out)``).
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
        dtype: Any = None,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        check_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            num_heads=num_heads, scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
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
        self.precision = precision
        kw = {"use_bias": qkv_bias, "dtype": dtype, "precision": precision, "rngs": rngs}
        self.W_query = linear(d_in, d_out, **kw)
        self.W_key = linear(d_in, d_out, **kw)
        self.W_value = linear(d_in, d_out, **kw)
        self.out_proj = (
            linear(d_out, d_out, use_bias=True, dtype=dtype, precision=precision, rngs=rngs)
            if out_proj
            else None
        )
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        *,
        return_weights: bool = False,
        dropout_mask: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | Array | None = None,
        kv_lengths: Array | None = None,
    ) -> Array | tuple[Array, Array]:
        return self._attend(x, mask, return_weights, dropout_mask, deterministic, rngs, kv_lengths)

    def _project(self, x: Array) -> tuple[Array, Array, Array]:
        # (B, T, d_in) -> (B, T, d_out) -> (B, num_heads, T, head_dim)
        return (
            self._split_heads(self.W_query(x)),
            self._split_heads(self.W_key(x)),
            self._split_heads(self.W_value(x)),
        )

    def _merge(self, out: Array) -> Array:
        out = super()._merge(out)  # (B, num_heads, T, head_dim) -> (B, T, d_out)
        return out if self.out_proj is None else self.out_proj(out)
