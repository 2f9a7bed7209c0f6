"""Linear-attention layers of the hybrid models for Flax NNX: ``GatedDeltaNet`` (Qwen3-Next's
and Qwen3.5's ``linear_attention`` layers) and ``KimiDeltaAttention`` (Kimi Linear's KDA), on
``functional.gated_delta_rule``.  The twin of ``torch_attention/delta_net.py``, whose
docstring gives the computation; same class names, keywords, parameter names (Flax kernels
(in, out) where PyTorch's ``nn.Linear`` weights are (out, in); ``conv_weight`` (C, K),
``A_log``, ``dt_bias`` and ``norm_weight`` the same on both sides) and numbers.

``module(x, cache=c)`` returns ``(out, new_cache)``; the cache (``init_cache``) has a fixed
shape, so under ``nnx.jit`` the prompt compiles once and every one-token step once.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from attention_spec.arrays import dtype_name
from attention_spec.delta import (
    DEFAULT_CHUNK,
    DeltaNetGeometry,
    check_delta_net_call,
    check_delta_net_options,
    delta_cache_shapes,
    state_dtype,
)
from attention_spec.options import check_positive_int
from jax_attention._delta import gated_delta_rule
from jax_attention._projections import dense

__all__ = ["DeltaCache", "GatedDeltaNet", "KimiDeltaAttention", "causal_conv"]


class DeltaCache(NamedTuple):
    """A linear-attention layer's decoding state, a pytree of fixed shape: ``conv``
    (B, C, K - 1), the causal conv's last K - 1 inputs per channel (q, k, v channels in
    that order), in the module's compute dtype; ``state`` (B, H, Dk, Dv), the delta
    rule's, float32 (float64 for a float64 module).  ``init_cache`` makes one."""

    conv: Array
    state: Array


def causal_conv(x: Array, weight: Array, past: Array) -> tuple[Array, Array]:
    """The depthwise causal conv: x (B, T, C), weight (C, K), past (B, C, K - 1) ->
    (out (B, T, C) before the activation, the last K - 1 inputs (B, C, K - 1)), summed in
    j's order as the PyTorch twin."""
    kernel, length = weight.shape[1], x.shape[1]
    full = jnp.concatenate([jnp.swapaxes(past, 1, 2).astype(x.dtype), x], axis=1)  # (B, K - 1 + T, C)
    out = full[:, 0:length] * weight[None, None, :, 0]
    for j in range(1, kernel):
        out = out + full[:, j:j + length] * weight[None, None, :, j]
    return out, jnp.swapaxes(full[:, full.shape[1] - (kernel - 1):], 1, 2)


class _DeltaLayer(nnx.Module):
    """What both layers share (the PyTorch twin's ``_DeltaLayer``)."""

    _name = "GatedDeltaNet"
    _norm_activation = "silu"

    def _setup(self, geometry: DeltaNetGeometry, chunk_size: int, norm_eps: float, dtype: Any, param_dtype: Any,
               precision: Any, rngs: nnx.Rngs) -> None:
        self.geometry, self.chunk_size, self.norm_eps = geometry, chunk_size, float(norm_eps)
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        g = geometry
        self.W_query = self._dense(g.d_in, g.qk_heads * g.key_dim, rngs)
        self.W_key = self._dense(g.d_in, g.qk_heads * g.key_dim, rngs)
        self.W_value = self._dense(g.d_in, g.heads * g.value_dim, rngs)
        bound = 1.0 / math.sqrt(g.kernel)  # nn.Conv1d's default for a depthwise conv
        self.conv_weight = nnx.Param(jax.random.uniform(rngs.params(), (g.conv_channels, g.kernel), param_dtype,
                                                        -bound, bound))
        self.W_beta = self._dense(g.d_in, g.heads, rngs)
        self.norm_weight = nnx.Param(jnp.ones((g.value_dim,), param_dtype))
        self.out_proj = self._dense(g.heads * g.value_dim, g.d_in, rngs)

    def _dense(self, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
        return dense(d_in, d_out, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                     precision=self.precision, rngs=rngs)

    def _a_log(self, heads: int, rngs: nnx.Rngs) -> nnx.Param:
        # transformers' draw: A uniform in (0.01, 16), kept as log A
        return nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (heads,), self.param_dtype, 0.01, 16.0)))

    def _decay(self, x: Array) -> Array:
        raise NotImplementedError

    def _gate(self, x: Array) -> Array:
        raise NotImplementedError

    def _compute(self) -> str:
        return dtype_name(jnp.dtype(self.dtype if self.dtype is not None else self.param_dtype))

    def init_cache(self, batch_size: int) -> DeltaCache:
        """An empty cache for ``batch_size`` examples: zeros, conv (B, C, K - 1) in the
        module's compute dtype, state (B, H, Dk, Dv) in float32 (float64 for float64)."""
        check_positive_int("batch_size", batch_size)
        conv, state = delta_cache_shapes(self.geometry, batch_size)
        return DeltaCache(jnp.zeros(conv, self._compute()), jnp.zeros(state, state_dtype(self._compute())))

    def __call__(self, x: Array, padding_mask: Array | None = None, *,
                 cache: DeltaCache | None = None) -> Array | tuple[Array, DeltaCache]:
        """x (B, T, d_in) in the module's compute dtype -> (B, T, d_in); with ``cache`` (a
        ``DeltaCache`` from ``init_cache``) ``(out, new_cache)``.  ``padding_mask`` (B, T)
        bool or integer, True / 1 = a real token (the others' inputs zeroed first).  T > 1
        runs the chunked form, T = 1 with a cache the recurrent form.  jit-compatible;
        raises ValueError / TypeError (the PyTorch twin's texts) before any work."""
        fields = None if cache is None else (
            tuple((tuple(t.shape), dtype_name(t.dtype)) for t in cache)
            if isinstance(cache, DeltaCache) and all(hasattr(t, "shape") and hasattr(t, "dtype") for t in cache)
            else "not a DeltaCache")
        mask_fields = None if padding_mask is None else (tuple(padding_mask.shape), dtype_name(padding_mask.dtype))
        batch, length = check_delta_net_call(self._name, self.geometry, tuple(x.shape), dtype_name(x.dtype),
                                             self._compute(), mask_fields, fields)
        g = self.geometry
        if padding_mask is not None:
            x = x * (padding_mask != 0)[:, :, None].astype(x.dtype)
        mixed = jnp.concatenate([self.W_query(x), self.W_key(x), self.W_value(x)], axis=-1)  # (B, T, C)
        past = cache.conv if cache is not None else jnp.zeros((batch, g.conv_channels, g.kernel - 1), x.dtype)
        mixed, conv_state = causal_conv(mixed, self.conv_weight[...].astype(x.dtype), past)
        mixed = jax.nn.silu(mixed)
        width = g.qk_heads * g.key_dim
        q = mixed[..., :width].reshape(batch, length, g.qk_heads, g.key_dim)
        k = mixed[..., width:2 * width].reshape(batch, length, g.qk_heads, g.key_dim)
        v = mixed[..., 2 * width:].reshape(batch, length, g.heads, g.value_dim)
        beta = jax.nn.sigmoid(self.W_beta(x))
        decay = self._decay(x)
        form = "recurrent" if cache is not None and length == 1 else "chunked"
        work = decay.dtype  # float32 (float64 for float64): the rule's inputs as transformers gives them
        o, state = gated_delta_rule(q.astype(work), k.astype(work), v.astype(work), decay, beta.astype(work),
                                    initial_state=None if cache is None else cache.state, qk_l2norm=True, form=form,
                                    chunk_size=self.chunk_size, layout="bshd")
        o = self._norm(o.astype(x.dtype), self._gate(x).reshape(batch, length, g.heads, g.value_dim))
        out = self.out_proj(o.reshape(batch, length, g.heads * g.value_dim))
        if cache is None:
            return out
        return out, DeltaCache(conv_state, state.astype(cache.state.dtype))

    def _norm(self, o: Array, gate: Array) -> Array:
        """transformers' gated RMSNorm, per head (the PyTorch twin's ``_norm``)."""
        dtype = o.dtype
        work = jnp.float64 if dtype == jnp.float64 else jnp.float32
        h = o.astype(work)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.norm_eps)
        weight = self.norm_weight[...][None, None, None, :]  # (1, 1, 1, Dv)
        if self._norm_activation == "silu":
            h = weight.astype(dtype) * h.astype(dtype)
            return (h * jax.nn.silu(gate.astype(work))).astype(dtype)
        h = weight.astype(work) * h
        return (h * jax.nn.sigmoid(gate.astype(work))).astype(dtype)


class GatedDeltaNet(_DeltaLayer):
    """The gated delta rule layer of Qwen3-Next and Qwen3.5: the PyTorch twin's
    ``GatedDeltaNet`` (whose docstring names the Hugging Face parameter of each of ours).

    Parameters: ``W_query``, ``W_key`` (``nnx.Linear(d_in, Hk*Dk)``, kernels (in, out)),
    ``W_value``, ``W_gate`` (d_in -> H*Dv), ``W_beta``, ``W_decay`` (d_in -> H),
    ``conv_weight`` (2*Hk*Dk + H*Dv, K), ``A_log`` (H,), ``dt_bias`` (H,), ``norm_weight``
    (Dv,), ``out_proj`` (H*Dv -> d_in); no biases.  dtypes as the library's modules:
    ``param_dtype`` stores, ``dtype`` computes (None: ``param_dtype``)."""

    _name = "GatedDeltaNet"
    _norm_activation = "silu"

    def __init__(self, d_in: int, num_key_heads: int, key_head_dim: int, num_value_heads: int,
                 value_head_dim: int, conv_kernel_size: int = 4, chunk_size: int = DEFAULT_CHUNK,
                 norm_eps: float = 1e-6, *, dtype: Any = None, param_dtype: Any = jnp.float32,
                 precision: Any = "highest", rngs: nnx.Rngs) -> None:
        geometry = check_delta_net_options(d_in, num_key_heads, key_head_dim, num_value_heads, value_head_dim,
                                           conv_kernel_size, chunk_size, norm_eps)
        self._setup(geometry, chunk_size, norm_eps, dtype, param_dtype, precision, rngs)
        self.W_gate = self._dense(d_in, num_value_heads * value_head_dim, rngs)
        self.W_decay = self._dense(d_in, num_value_heads, rngs)
        self.A_log = self._a_log(num_value_heads, rngs)
        self.dt_bias = nnx.Param(jnp.ones((num_value_heads,), param_dtype))

    def _decay(self, x: Array) -> Array:  # (B, T, H), float32 (float64 for float64)
        a = self.W_decay(x)
        work = jnp.float64 if a.dtype == jnp.float64 else jnp.float32
        a_log, dt_bias = self.A_log[...][None, None], self.dt_bias[...][None, None]  # (1, 1, H)
        return -jnp.exp(a_log.astype(work)) * jax.nn.softplus(a.astype(work) + dt_bias.astype(work))

    def _gate(self, x: Array) -> Array:
        return self.W_gate(x)


class KimiDeltaAttention(_DeltaLayer):
    """Kimi Linear's KDA layer: the PyTorch twin's ``KimiDeltaAttention``.  Parameters
    ``W_query``, ``W_key``, ``W_value`` (d_in -> H*D), ``conv_weight`` (3*H*D, K),
    ``W_decay_down`` (d_in -> D), ``W_decay_up`` (D -> H*D), ``A_log`` (H,), ``dt_bias``
    (H*D,), ``W_beta`` (d_in -> H), ``W_gate_down`` (d_in -> D), ``W_gate_up`` (D -> H*D),
    ``norm_weight`` (D,), ``out_proj`` (H*D -> d_in)."""

    _name = "KimiDeltaAttention"
    _norm_activation = "sigmoid"

    def __init__(self, d_in: int, num_heads: int, head_dim: int, conv_kernel_size: int = 4,
                 chunk_size: int = DEFAULT_CHUNK, norm_eps: float = 1e-6, *, dtype: Any = None,
                 param_dtype: Any = jnp.float32, precision: Any = "highest", rngs: nnx.Rngs) -> None:
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim)):
            check_positive_int(name, value)
        geometry = check_delta_net_options(d_in, num_heads, head_dim, num_heads, head_dim, conv_kernel_size,
                                           chunk_size, norm_eps)
        self._setup(geometry, chunk_size, norm_eps, dtype, param_dtype, precision, rngs)
        self.W_decay_down = self._dense(d_in, head_dim, rngs)
        self.W_decay_up = self._dense(head_dim, num_heads * head_dim, rngs)
        self.A_log = self._a_log(num_heads, rngs)
        self.dt_bias = nnx.Param(jnp.ones((num_heads * head_dim,), param_dtype))
        self.W_gate_down = self._dense(d_in, head_dim, rngs)
        self.W_gate_up = self._dense(head_dim, num_heads * head_dim, rngs)

    def _decay(self, x: Array) -> Array:  # (B, T, H, D), float32 (float64 for float64)
        g = self.geometry
        f = self.W_decay_up(self.W_decay_down(x))
        work = jnp.float64 if f.dtype == jnp.float64 else jnp.float32
        f = (f.astype(work) + self.dt_bias[...][None, None].astype(work)).reshape(*x.shape[:2], g.heads, g.key_dim)
        return -jnp.exp(self.A_log[...].astype(work))[None, None, :, None] * jax.nn.softplus(f)

    def _gate(self, x: Array) -> Array:
        return self.W_gate_up(self.W_gate_down(x))
