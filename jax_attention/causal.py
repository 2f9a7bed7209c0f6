"""Causal self-attention: ``CausalAttention`` (seed 004) and ``Head`` (seed 002).

Twin of ``torch_attention/causal.py``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jax_attention._base import AttentionModule


class CausalAttention(AttentionModule):
    """Single-head causal self-attention with dropout on the attention weights.

    Parameters ``W_query``, ``W_key``, ``W_value`` (``nnx.Linear(d_in, d_out)``, biases if
    ``qkv_bias``).  Input (B, T, d_in) or (T, d_in) with T <= context_length ->
    (B, T, d_out); weights (B, 1, T, T).

    Args:
      context_length: the longest sequence accepted; None = no cap.
      dropout: rate on the attention weights, training mode only (``nnx.Dropout``
        conventions: ``.eval()``/``.train()``, ``deterministic=``, the ``dropout`` stream;
        a rate of 0 takes no stream, so ``rngs`` needs only ``params``).
      scale: None = 1/sqrt(d_out), a float as given.
      causal: True by definition; False turns this into plain (bidirectional) attention.
      mask_strategy: ``"fill"`` (mask before softmax) or ``"renormalize"`` (after, seed 004).
      dtype: the computation dtype (None: ``param_dtype``); ``x`` must come in it.
      param_dtype: the parameters' storage dtype (PyTorch's ``dtype``), float32 by default.

    Call: ``mask`` (bool, True = may attend, broadcastable to (B, 1, T, T)) is combined
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
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(locals(), dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)


class Head(AttentionModule):
    """One causal head over (B, T, C), as in seed 002: bias-free projections ``key``,
    ``query``, ``value`` of width ``head_size``, **unscaled** scores by default
    (``scale=1.0``), a ``tril`` causal mask, dropout on the weights.

    Input (B, T, d_in) or (T, d_in), T <= context_length (None = no cap) ->
    (B, T, head_size).  dtypes as ``CausalAttention``.
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
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = "highest",
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(locals(), dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
