"""What every Flax NNX attention module shares: input checks, the batch dimension, the
dropout stream, the call into ``functional``.  Subclasses only project to heads and merge
heads back.

Twin of ``torch_attention/_base.py``.
"""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from attention_spec import check_dropout_mask, check_input, check_kv_lengths, check_mask, dtype_name
from jax_attention import functional


def torch_linear_init(fan_in: int) -> Any:
    """PyTorch's ``nn.Linear`` default for kernel and bias: uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key: Array, shape: Any, dtype: Any = jnp.float32) -> Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def linear(
    d_in: int, d_out: int, *, use_bias: bool, dtype: Any, precision: Any, rngs: nnx.Rngs
) -> nnx.Linear:
    """An ``nnx.Linear`` initialised as PyTorch's ``nn.Linear`` (kernel (in, out))."""
    init = torch_linear_init(d_in)
    return nnx.Linear(
        d_in, d_out, use_bias=use_bias, kernel_init=init, bias_init=init,
        param_dtype=dtype or jnp.float32, precision=precision, rngs=rngs,
    )


class AttentionModule(nnx.Module):
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
    precision: Any = "highest"

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
        return 0.0 if dropout is None else float(dropout.rate)

    def _deterministic(self, deterministic: bool | None) -> bool:
        """As ``nnx.Dropout``: the call's flag overrides the module's, which ``.eval()``
        and ``.train()`` set; a module without dropout is always deterministic."""
        dropout = getattr(self, "dropout", None)
        if dropout is None:
            return True
        return bool(dropout.deterministic) if deterministic is None else deterministic

    def _dropout_key(self, rngs: Any) -> Array | None:
        """A key from the call's ``rngs`` (Rngs, RngStream or key), else the module's stream."""
        dropout: Any = getattr(self, "dropout")  # noqa: B009 (set by subclasses)
        if isinstance(rngs, nnx.Rngs):
            return rngs[dropout.rng_collection]()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        if rngs is not None:
            return rngs
        return None if dropout.rngs is None else dropout.rngs()

    def _check_call(
        self,
        x: Array,
        mask: Array | None,
        dropout_mask: Array | None,
        deterministic: bool,
        kv_lengths: Array | None = None,
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
                training=not deterministic,
            )
        return batched

    def _attend(
        self,
        x: Array,
        mask: Array | None,
        return_weights: bool,
        dropout_mask: Array | None,
        deterministic: bool | None,
        rngs: Any,
        kv_lengths: Array | None = None,
    ) -> Array | tuple[Array, Array]:
        deterministic = self._deterministic(deterministic)
        batched = self._check_call(x, mask, dropout_mask, deterministic, kv_lengths)
        rate = self._dropout_rate()
        draws = not deterministic and rate > 0.0 and dropout_mask is None
        key = self._dropout_key(rngs) if draws else None  # after the checks: state changes
        if not batched:
            x = x[None]  # (T, C) -> (1, T, C); masks broadcast from the right
        q, k, v = self._project(x)  # each (B, H, T, D)
        result = functional.dot_product_attention(
            q, k, v,
            mask=mask,
            causal=self.causal,
            kv_lengths=kv_lengths,
            scale=self.scale,
            mask_strategy=self.mask_strategy,
            normalization=self.normalization,
            dropout_rate=rate,
            dropout_mask=dropout_mask,
            deterministic=deterministic,
            rng=key,
            return_weights=return_weights,
            implementation=self.implementation,
            precision=self.precision,
        )
        if return_weights:
            out, weights = cast(tuple[Array, Array], result)
            out = self._merge(out)  # (B, H, T, Dv) -> (B, T, d_out)
            return (out, weights) if batched else (out[0], weights[0])
        out = self._merge(cast(Array, result))  # (B, H, T, Dv) -> (B, T, d_out)
        return out if batched else out[0]

    def _project(self, x: Array) -> tuple[Array, Array, Array]:
        raise NotImplementedError

    def _split_heads(self, t: Array) -> Array:
        b, num_tokens, width = t.shape
        # (B, T, H * D) -> (B, T, H, D) -> (B, H, T, D)
        return t.reshape(b, num_tokens, self.num_heads, width // self.num_heads).transpose(0, 2, 1, 3)

    def _merge(self, out: Array) -> Array:
        b, h, num_tokens, head_dim = out.shape
        # (B, H, T, D) -> (B, T, H, D) -> (B, T, H * D)
        return out.transpose(0, 2, 1, 3).reshape(b, num_tokens, h * head_dim)
