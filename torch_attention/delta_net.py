"""Linear-attention layers of the hybrid models: ``GatedDeltaNet`` (Qwen3-Next's and
Qwen3.5's ``linear_attention`` layers) and ``KimiDeltaAttention`` (Kimi Linear's KDA), on
``functional.gated_delta_rule`` (``attention_spec.delta``).  The twin of
``jax_attention/delta_net.py``: same class names, keywords, parameter names and numbers.

A layer, x (B, T, d_in) -> (B, T, d_in):

    x        <- x * padding_mask                 padded tokens zeroed (transformers'
                                                 apply_mask_to_padding_states)
    q, k, v   = W_query x, W_key x, W_value x    (B, T, Hk*Dk), (B, T, Hk*Dk), (B, T, H*Dv)
    q, k, v   = silu(causal depthwise conv([q | k | v]))   kernel K, per channel
    beta      = sigmoid(W_beta x)                (B, T, H)
    g         = -exp(A_log) * softplus(decay(x) + dt_bias)   (B, T, H), KDA (B, T, H, Dk)
    o, state  = gated_delta_rule(q, k, v, g, beta, qk_l2norm=True)
    o         = norm_weight * rmsnorm(o) * act(gate(x))      per head; act silu (KDA sigmoid)
    out       = out_proj(o)

The causal conv: out[t, c] = sum_j conv_weight[c, j] * in[t - (K - 1) + j, c], inputs
before the sequence (or before the cache's) zeros.

A cache (``init_cache``) holds the conv's last K - 1 inputs per channel and the rule's
state: ``module(x, cache=c)`` returns ``(out, new_cache)``; a call of T > 1 tokens runs
the chunked form, one token the recurrent form (as transformers'), and a prompt then
one-token steps equals the whole sequence.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
from torch_attention._delta import gated_delta_rule

__all__ = ["DeltaCache", "GatedDeltaNet", "KimiDeltaAttention", "causal_conv"]


class DeltaCache(NamedTuple):
    """A linear-attention layer's decoding state: ``conv`` (B, C, K - 1), the causal
    conv's last K - 1 inputs per channel (q, k, v channels in that order), in the
    module's dtype; ``state`` (B, H, Dk, Dv), the delta rule's, float32 (float64 for a
    float64 module).  ``init_cache`` makes one (zeros: nothing seen)."""

    conv: Tensor
    state: Tensor


def causal_conv(x: Tensor, weight: Tensor, past: Tensor) -> tuple[Tensor, Tensor]:
    """The depthwise causal conv: x (B, T, C), weight (C, K), past (B, C, K - 1) (the
    inputs before x) -> (out (B, T, C) before the activation, the last K - 1 inputs
    (B, C, K - 1)).  out[t, c] = sum_j weight[c, j] * [past | x][t + j, c], summed in j's
    order (as the JAX twin)."""
    kernel, length = weight.shape[1], x.shape[1]
    full = torch.cat([past.transpose(1, 2).to(x.dtype), x], dim=1)  # (B, K - 1 + T, C)
    out = full[:, 0:length] * weight[:, 0]
    for j in range(1, kernel):
        out = out + full[:, j:j + length] * weight[:, j]
    return out, full[:, full.shape[1] - (kernel - 1):].transpose(1, 2)


def _uniform(shape: tuple[int, ...], bound: float, factory: dict[str, Any]) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, **factory).uniform_(-bound, bound) if factory.get("device") != "meta"
                        else torch.empty(shape, **factory))


class _DeltaLayer(nn.Module):
    """What both layers share: the projections to q, k, v, the conv, the rule, the gated
    norm, ``out_proj``, the cache.  A subclass gives the decay, beta and the gate."""

    _name = "GatedDeltaNet"
    _norm_activation = "silu"

    def _setup(self, geometry: DeltaNetGeometry, chunk_size: int, norm_eps: float,
               factory: dict[str, Any]) -> None:
        self.geometry, self.chunk_size, self.norm_eps = geometry, chunk_size, float(norm_eps)
        g = geometry
        self.W_query = nn.Linear(g.d_in, g.qk_heads * g.key_dim, bias=False, **factory)
        self.W_key = nn.Linear(g.d_in, g.qk_heads * g.key_dim, bias=False, **factory)
        self.W_value = nn.Linear(g.d_in, g.heads * g.value_dim, bias=False, **factory)
        # nn.Conv1d's default (kaiming uniform, a = sqrt(5)): +-1/sqrt(K) for a depthwise conv
        self.conv_weight = _uniform((g.conv_channels, g.kernel), 1.0 / math.sqrt(g.kernel), factory)
        self.W_beta = nn.Linear(g.d_in, g.heads, bias=False, **factory)
        self.norm_weight = nn.Parameter(torch.ones(g.value_dim, **factory))
        self.out_proj = nn.Linear(g.heads * g.value_dim, g.d_in, bias=False, **factory)

    def _a_log(self, heads: int, factory: dict[str, Any]) -> nn.Parameter:
        # transformers' draw: A uniform in (0.01, 16), kept as log A
        if factory.get("device") == "meta":
            return nn.Parameter(torch.empty(heads, **factory))
        return nn.Parameter(torch.empty(heads, **factory).uniform_(0.01, 16).log())

    # ------------------------------------------------------------------ subclass parts

    def _decay(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _gate(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ the call

    def _compute(self) -> str:
        return dtype_name(self.out_proj.weight.dtype)

    def init_cache(self, batch_size: int) -> DeltaCache:
        """An empty cache for ``batch_size`` examples: zeros, conv (B, C, K - 1) in the
        module's dtype, state (B, H, Dk, Dv) in float32 (float64 for float64)."""
        check_positive_int("batch_size", batch_size)
        conv, state = delta_cache_shapes(self.geometry, batch_size)
        device = self.out_proj.weight.device
        return DeltaCache(torch.zeros(conv, dtype=self.out_proj.weight.dtype, device=device),
                          torch.zeros(state, dtype=getattr(torch, state_dtype(self._compute())), device=device))

    def forward(self, x: Tensor, padding_mask: Tensor | None = None, *,
                cache: DeltaCache | None = None) -> Tensor | tuple[Tensor, DeltaCache]:
        """x (B, T, d_in) in the module's dtype -> (B, T, d_in); with ``cache`` (a
        ``DeltaCache`` from ``init_cache``) ``(out, new_cache)``, x continuing the cached
        sequence (the cache given is not changed).  ``padding_mask`` (B, T) bool or
        integer, True / 1 = a real token: the others' inputs are zeroed first, as
        transformers does (exact for left padding: a zero token writes nothing into the
        state).  T > 1 runs the chunked form (chunks of ``chunk_size``), T = 1 with a
        cache the recurrent form.  Raises ValueError (shapes, a cache of another batch or
        layer) or TypeError (dtypes) before any work."""
        fields = None if cache is None else (
            tuple((tuple(t.shape), dtype_name(t.dtype)) for t in cache)
            if isinstance(cache, DeltaCache) and all(isinstance(t, Tensor) for t in cache) else "not a DeltaCache")
        mask_fields = None if padding_mask is None else (tuple(padding_mask.shape), dtype_name(padding_mask.dtype))
        batch, length = check_delta_net_call(self._name, self.geometry, tuple(x.shape), dtype_name(x.dtype),
                                             self._compute(), mask_fields, fields)
        g = self.geometry
        if padding_mask is not None:
            x = x * (padding_mask != 0)[:, :, None].to(x.dtype)
        mixed = torch.cat([self.W_query(x), self.W_key(x), self.W_value(x)], dim=-1)  # (B, T, C)
        past = cache.conv if cache is not None else x.new_zeros((batch, g.conv_channels, g.kernel - 1))
        mixed, conv_state = causal_conv(mixed, self.conv_weight, past)
        mixed = F.silu(mixed)
        width = g.qk_heads * g.key_dim
        q = mixed[..., :width].reshape(batch, length, g.qk_heads, g.key_dim)
        k = mixed[..., width:2 * width].reshape(batch, length, g.qk_heads, g.key_dim)
        v = mixed[..., 2 * width:].reshape(batch, length, g.heads, g.value_dim)
        beta = torch.sigmoid(self.W_beta(x))
        decay = self._decay(x)
        form = "recurrent" if cache is not None and length == 1 else "chunked"
        work = decay.dtype  # float32 (float64 for float64): the rule's inputs as transformers gives them
        o, state = gated_delta_rule(q.to(work), k.to(work), v.to(work), decay, beta.to(work),
                                    initial_state=None if cache is None else cache.state, qk_l2norm=True, form=form,
                                    chunk_size=self.chunk_size, layout="bshd")
        o = o.to(x.dtype)
        o = self._norm(o, self._gate(x).reshape(batch, length, g.heads, g.value_dim))
        out = self.out_proj(o.reshape(batch, length, g.heads * g.value_dim))
        if cache is None:
            return out
        return out, DeltaCache(conv_state, state.to(cache.state.dtype))

    def _norm(self, o: Tensor, gate: Tensor) -> Tensor:
        """transformers' gated RMSNorm, per head: in float32, the weight applied in x's
        dtype (Qwen's) or float32 (Kimi's; the same for a float32 module)."""
        dtype = o.dtype
        work = torch.float64 if dtype == torch.float64 else torch.float32
        h = o.to(work)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        if self._norm_activation == "silu":
            h = self.norm_weight * h.to(dtype)
            return (h * F.silu(gate.to(work))).to(dtype)
        h = self.norm_weight.to(work) * h
        return (h * torch.sigmoid(gate.to(work))).to(dtype)


class GatedDeltaNet(_DeltaLayer):
    """The gated delta rule layer of Qwen3-Next and Qwen3.5 (``Qwen3NextGatedDeltaNet``,
    ``Qwen3_5GatedDeltaNet``): the module docstring's computation, one decay per value
    head and token, the gate ``W_gate x``, the norm's activation silu.

    Parameters (PyTorch ``nn.Linear`` weights (out, in), no biases), and the Hugging Face
    parameter each is (Qwen3.5's names; Qwen3-Next packs them, see ``from_hf``):

      ``W_query``, ``W_key`` (Hk*Dk, d_in), ``W_value`` (H*Dv, d_in)   rows of ``in_proj_qkv``
      ``conv_weight`` (2*Hk*Dk + H*Dv, K)                             ``conv1d.weight[:, 0, :]``
      ``W_gate`` (H*Dv, d_in)                                         ``in_proj_z``
      ``W_beta`` (H, d_in)                                            ``in_proj_b``
      ``W_decay`` (H, d_in)                                           ``in_proj_a``
      ``A_log`` (H,), ``dt_bias`` (H,)                                ``A_log``, ``dt_bias``
      ``norm_weight`` (Dv,)                                           ``norm.weight``
      ``out_proj`` (d_in, H*Dv)                                       ``out_proj``

    Keywords: ``d_in`` (the hidden size), ``num_key_heads`` (Hk) of ``key_head_dim`` (Dk),
    ``num_value_heads`` (H, a multiple of Hk) of ``value_head_dim`` (Dv), ``conv_kernel_size``
    (K), ``chunk_size`` (the chunked form's), ``norm_eps`` (the gated norm's).
    """

    _name = "GatedDeltaNet"
    _norm_activation = "silu"

    def __init__(self, d_in: int, num_key_heads: int, key_head_dim: int, num_value_heads: int,
                 value_head_dim: int, conv_kernel_size: int = 4, chunk_size: int = DEFAULT_CHUNK,
                 norm_eps: float = 1e-6, *, dtype: Any = None, device: Any = None) -> None:
        geometry = check_delta_net_options(d_in, num_key_heads, key_head_dim, num_value_heads, value_head_dim,
                                           conv_kernel_size, chunk_size, norm_eps)
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self._setup(geometry, chunk_size, norm_eps, factory)
        self.W_gate = nn.Linear(d_in, num_value_heads * value_head_dim, bias=False, **factory)
        self.W_decay = nn.Linear(d_in, num_value_heads, bias=False, **factory)
        self.A_log = self._a_log(num_value_heads, factory)
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads, **factory))

    def _decay(self, x: Tensor) -> Tensor:  # (B, T, H), float32 (float64 for float64)
        a = self.W_decay(x)
        work = torch.float64 if a.dtype == torch.float64 else torch.float32
        return -self.A_log.to(work).exp() * F.softplus(a.to(work) + self.dt_bias)

    def _gate(self, x: Tensor) -> Tensor:
        return self.W_gate(x)


class KimiDeltaAttention(_DeltaLayer):
    """Kimi Linear's KDA layer (``KimiLinearDeltaAttention``): the module docstring's
    computation with one decay per key channel, H heads of width D for q, k and v, the
    decay and the gate through rank-D bottlenecks, the norm's activation sigmoid.

    Parameters (``nn.Linear`` weights (out, in), no biases), and the Hugging Face
    parameter each is:

      ``W_query``, ``W_key``, ``W_value`` (H*D, d_in)   ``q_proj``, ``k_proj``, ``v_proj``
      ``conv_weight`` (3*H*D, K)                        ``conv1d.weight[:, 0, :]``
      ``W_decay_down`` (D, d_in), ``W_decay_up`` (H*D, D)  ``forget_gate.f_a_proj``, ``f_b_proj``
      ``A_log`` (H,), ``dt_bias`` (H*D,)                ``forget_gate.A_log`` (1, 1, H, 1), ``dt_bias``
      ``W_beta`` (H, d_in)                              ``b_proj``
      ``W_gate_down`` (D, d_in), ``W_gate_up`` (H*D, D) ``g_a_proj``, ``g_b_proj``
      ``norm_weight`` (D,)                              ``o_norm.weight``
      ``out_proj`` (d_in, H*D)                          ``o_proj``

    g = -exp(A_log[h]) * softplus(W_decay_up W_decay_down x + dt_bias), per channel.
    """

    _name = "KimiDeltaAttention"
    _norm_activation = "sigmoid"

    def __init__(self, d_in: int, num_heads: int, head_dim: int, conv_kernel_size: int = 4,
                 chunk_size: int = DEFAULT_CHUNK, norm_eps: float = 1e-6, *, dtype: Any = None,
                 device: Any = None) -> None:
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim)):
            check_positive_int(name, value)
        geometry = check_delta_net_options(d_in, num_heads, head_dim, num_heads, head_dim, conv_kernel_size,
                                           chunk_size, norm_eps)
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self._setup(geometry, chunk_size, norm_eps, factory)
        self.W_decay_down = nn.Linear(d_in, head_dim, bias=False, **factory)
        self.W_decay_up = nn.Linear(head_dim, num_heads * head_dim, bias=False, **factory)
        self.A_log = self._a_log(num_heads, factory)
        self.dt_bias = nn.Parameter(torch.ones(num_heads * head_dim, **factory))
        self.W_gate_down = nn.Linear(d_in, head_dim, bias=False, **factory)
        self.W_gate_up = nn.Linear(head_dim, num_heads * head_dim, bias=False, **factory)

    def _decay(self, x: Tensor) -> Tensor:  # (B, T, H, D), float32 (float64 for float64)
        g = self.geometry
        f = self.W_decay_up(self.W_decay_down(x))
        work = torch.float64 if f.dtype == torch.float64 else torch.float32
        f = (f.to(work) + self.dt_bias.to(work)).reshape(*x.shape[:2], g.heads, g.key_dim)
        return -self.A_log.to(work).exp()[:, None] * F.softplus(f)

    def _gate(self, x: Tensor) -> Tensor:
        return self.W_gate_up(self.W_gate_down(x))
