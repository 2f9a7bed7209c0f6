"""Self-attention with trainable weights (seeds 003 and 004).

``SelfAttention_v1`` holds raw ``(d_in, d_out)`` matrices applied as ``x @ W``;
``SelfAttention_v2`` holds ``nn.Linear`` layers.  Twin of ``jax_attention/self_attention.py``.
"""

from __future__ import annotations

import torch

from torch_attention._base import AttentionModule


class SelfAttention_v1(AttentionModule):  # noqa: N801 (the tutorials' name)
    """Single-head self-attention with parameters ``W_query``, ``W_key``, ``W_value`` of
    shape (d_in, d_out), drawn from N(0, 1) in that order, as seed 004 does.

    Input (B, T, d_in) or (T, d_in) -> (B, T, d_out) or (T, d_out); weights (B, 1, T, T).
    Scores are scaled by 1/sqrt(d_out) unless ``scale`` says otherwise; ``causal=True``
    blocks future keys; an optional bool ``mask`` (True = may attend) blocks more.
    ``dtype``/``device`` as ``nn.Linear``'s (parameter storage, also the compute dtype;
    the Flax twin's ``param_dtype``).
    """

    variant = "SelfAttention_v1"

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        scale: float | None = None,
        causal: bool = False,
        mask_strategy: str = "fill",
        implementation: str = "auto",
        softcap: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        alignment: str = "top_left",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(locals(), dtype=dtype, device=device)


class SelfAttention_v2(AttentionModule):  # noqa: N801 (the tutorials' name)
    """As ``SelfAttention_v1`` with ``nn.Linear`` projections ``W_query``, ``W_key``,
    ``W_value`` (PyTorch's default initialisation), with biases if ``qkv_bias``.
    """

    variant = "SelfAttention_v2"

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
        softcap: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        alignment: str = "top_left",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(locals(), dtype=dtype, device=device)
