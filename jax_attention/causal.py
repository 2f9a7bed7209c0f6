"""Causal self-attention: ``CausalAttention`` (seed 004) and ``Head`` (seed 002).

Twin of ``torch_attention/causal.py``.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from jax import Array

from attention_spec import check_config
from jax_attention._base import AttentionModule, linear


class CausalAttention(AttentionModule):
    """Single-head causal self-attention with dropout on the attention weights.

    Parameters ``W_query``, ``W_key``, ``W_value`` (``nnx.Linear(d_in, d_out)``, biases if
    ``qkv_bias``).  Input (B, T, d_in) or (T, d_in) with T <= context_length ->
    (B, T, d_out); weights (B, 1, T, T).

    Args:
      dropout: rate on the attention weights, training mode only (``nnx.Dropout``
        conventions: ``.eval()``/``.train()``, ``deterministic=``, the ``dropout`` stream).
      scale: None = 1/sqrt(d_out), a float as given.
      causal: True by definition; False turns this into plain (bidirectional) attention.
      mask_strategy: ``"fill"`` (mask before softmax) or ``"renormalize"`` (after, seed 004).

    Call: ``mask`` (bool, True = may attend, broadcastable to (B, 1, T, T)) is combined
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
        dtype: Any = None,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        check_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        self.d_in, self.d_out, self.context_length, self.qkv_bias = d_in, d_out, context_length, qkv_bias
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
            qkv_bias=qkv_bias, scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        self.precision = precision
        kw = {"use_bias": qkv_bias, "dtype": dtype, "precision": precision, "rngs": rngs}
        self.W_query = linear(d_in, d_out, **kw)
        self.W_key = linear(d_in, d_out, **kw)
        self.W_value = linear(d_in, d_out, **kw)
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
        # (B, T, d_in) -> (B, T, d_out) -> (B, 1, T, d_out)
        return (
            self._split_heads(self.W_query(x)),
            self._split_heads(self.W_key(x)),
            self._split_heads(self.W_value(x)),
        )


class Head(AttentionModule):
    """One causal head over (B, T, C), as in seed 002: bias-free projections ``key``,
    ``query``, ``value`` of width ``head_size``, **unscaled** scores by default
    (``scale=1.0``), a ``tril`` causal mask, dropout on the weights.

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
        dtype: Any = None,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        check_config(
            d_in=d_in, head_size=head_size, context_length=context_length, dropout=dropout,
            scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        self.d_in, self.head_size, self.context_length = d_in, head_size, context_length
        self.scale, self.causal, self.mask_strategy = scale, causal, mask_strategy
        self.implementation = implementation
        self._set_config(
            d_in=d_in, head_size=head_size, context_length=context_length, dropout=dropout,
            scale=scale, causal=causal, mask_strategy=mask_strategy, implementation=implementation,
        )
        self.precision = precision
        kw = {"use_bias": False, "dtype": dtype, "precision": precision, "rngs": rngs}
        self.key = linear(d_in, head_size, **kw)
        self.query = linear(d_in, head_size, **kw)
        self.value = linear(d_in, head_size, **kw)
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
        # (B, T, C) -> (B, T, head_size) -> (B, 1, T, head_size)
        return (
            self._split_heads(self.query(x)),
            self._split_heads(self.key(x)),
            self._split_heads(self.value(x)),
        )
