"""What every PyTorch attention module shares: input checks, the batch dimension, the call
into ``functional``.  Subclasses only project to heads and merge heads back.

Twin of ``jax_attention/_base.py``.
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor, nn

from attention_spec import check_dropout_mask, check_input, check_kv_lengths, check_mask, dtype_name
from torch_attention import functional


class AttentionModule(nn.Module):
    """Base class.  Subclasses set the attributes below in ``__init__``, define
    ``_project(x) -> q, k, v`` of shape (B, H, T, D), and may extend ``_merge``.
    """

    d_in: int | None = None
    context_length: int | None = None
    num_heads: int = 1
    causal: bool = False
    scale: float | None = None
    mask_strategy: str = "fill"
    normalization: str = "softmax"
    implementation: str = "reference"

    def _set_config(self, **config: Any) -> None:
        # Stored as a tuple of pairs: hashable, so that a Flax module's graphdef can be a
        # static argument of jax.jit.
        self._config = tuple(config.items())

    @property
    def config(self) -> dict[str, Any]:
        """The constructor keywords this module was built with (not dtype/device/rngs)."""
        return dict(self._config)

    def _dropout_rate(self) -> float:
        dropout = getattr(self, "dropout", None)
        return float(dropout.p) if dropout is not None else 0.0

    def _check_call(
        self, x: Tensor, mask: Tensor | None, dropout_mask: Tensor | None, kv_lengths: Tensor | None = None
    ) -> bool:
        """All checks of one call, before any work; returns whether ``x`` is batched."""
        batched = check_input(
            x.shape, dtype_name(x.dtype), d_in=self.d_in, context_length=self.context_length
        )
        seq = x.shape[-2]
        weights_shape = ((x.shape[0],) if batched else ()) + (self.num_heads, seq, seq)
        if mask is not None:
            check_mask(mask.shape, dtype_name(mask.dtype), weights_shape)
        if kv_lengths is not None:
            check_kv_lengths(kv_lengths.shape, dtype_name(kv_lengths.dtype), weights_shape)
        if dropout_mask is not None:
            check_dropout_mask(
                dropout_mask.shape, dtype_name(dropout_mask.dtype), weights_shape,
                training=self.training,
            )
        return batched

    def _attend(
        self,
        x: Tensor,
        mask: Tensor | None,
        return_weights: bool,
        dropout_mask: Tensor | None = None,
        kv_lengths: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        batched = self._check_call(x, mask, dropout_mask, kv_lengths)
        if not batched:
            x = x.unsqueeze(0)  # (T, C) -> (1, T, C); masks broadcast from the right
        q, k, v = self._project(x)  # each (B, H, T, D)
        result = functional.dot_product_attention(
            q, k, v,
            mask=mask,
            causal=self.causal,
            kv_lengths=kv_lengths,
            scale=self.scale,
            mask_strategy=self.mask_strategy,
            normalization=self.normalization,
            dropout_rate=self._dropout_rate(),
            dropout_mask=dropout_mask,
            training=self.training,
            return_weights=return_weights,
            implementation=self.implementation,
        )
        if return_weights:
            out, weights = cast(tuple[Tensor, Tensor], result)
            out = self._merge(out)  # (B, H, T, Dv) -> (B, T, d_out)
            return (out, weights) if batched else (out[0], weights[0])
        out = self._merge(cast(Tensor, result))  # (B, H, T, Dv) -> (B, T, d_out)
        return out if batched else out[0]

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def _split_heads(self, t: Tensor) -> Tensor:
        b, num_tokens, width = t.shape
        # (B, T, H * D) -> (B, T, H, D) -> (B, H, T, D)
        return t.view(b, num_tokens, self.num_heads, width // self.num_heads).transpose(1, 2)

    def _merge(self, out: Tensor) -> Tensor:
        b, h, num_tokens, head_dim = out.shape
        # (B, H, T, D) -> (B, T, H, D) -> (B, T, H * D)
        return out.transpose(1, 2).reshape(b, num_tokens, h * head_dim)
