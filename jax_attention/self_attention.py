"""Self-attention with trainable weights (seeds 003 and 004).

``SelfAttention_v1`` holds raw ``(d_in, d_out)`` matrices applied as ``x @ W``;
``SelfAttention_v2`` holds ``nnx.Linear`` layers.  Twin of ``torch_attention/self_attention.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from attention_spec import check_config
from jax_attention._base import AttentionModule, linear


class SelfAttention_v1(AttentionModule):  # noqa: N801 (the tutorials' name)
    """Single-head self-attention with parameters ``W_query``, ``W_key``, ``W_value`` of
    shape (d_in, d_out), drawn from N(0, 1) as PyTorch's ``torch.randn`` in seed 004.

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
        dtype: Any = None,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        check_config(d_in=d_in, d_out=d_out, scale=scale, causal=causal, mask_strategy=mask_strategy,
                     implementation=implementation)
        self.d_in, self.d_out = d_in, d_out
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, d_out=d_out, scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        self.precision = precision
        dtype = dtype or jnp.float32
        self.W_query = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), dtype))
        self.W_key = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), dtype))
        self.W_value = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), dtype))

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
        # (B, T, d_in) @ (d_in, d_out) -> (B, 1, T, d_out)
        return (
            self._split_heads(jnp.matmul(x, self.W_query[...], precision=self.precision)),
            self._split_heads(jnp.matmul(x, self.W_key[...], precision=self.precision)),
            self._split_heads(jnp.matmul(x, self.W_value[...], precision=self.precision)),
        )


class SelfAttention_v2(AttentionModule):  # noqa: N801 (the tutorials' name)
    """As ``SelfAttention_v1`` with ``nnx.Linear`` projections ``W_query``, ``W_key``,
    ``W_value`` initialised as PyTorch's ``nn.Linear``, with biases if ``qkv_bias``.
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
        dtype: Any = None,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        check_config(d_in=d_in, d_out=d_out, scale=scale, causal=causal, mask_strategy=mask_strategy,
                     implementation=implementation)
        self.d_in, self.d_out, self.qkv_bias = d_in, d_out, qkv_bias
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, d_out=d_out, qkv_bias=qkv_bias, scale=scale, causal=causal,
            mask_strategy=mask_strategy,
            implementation=implementation,
        )
        self.precision = precision
        kw = {"use_bias": qkv_bias, "dtype": dtype, "precision": precision, "rngs": rngs}
        self.W_query = linear(d_in, d_out, **kw)
        self.W_key = linear(d_in, d_out, **kw)
        self.W_value = linear(d_in, d_out, **kw)

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
        # (B, T, d_in) -> (B, T, d_out) -> (B, 1, T, d_out)
        return (
            self._split_heads(self.W_query(x)),
            self._split_heads(self.W_key(x)),
            self._split_heads(self.W_value(x)),
        )
