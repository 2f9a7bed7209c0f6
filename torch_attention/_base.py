"""What every PyTorch attention module shares: the config built from the registry, the
projections it declares, input checks, the batch dimension, the call into ``functional``.
A variant's file only gives the constructor signature (the public API) and docstring.

Twin of ``jax_attention/_base.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple, cast

import torch
from torch import Tensor, nn

from attention_spec import (
    check_compute_dtype,
    check_dropout_mask,
    check_implementation,
    check_input,
    dtype_name,
)
from attention_spec.registry import AttentionConfig, Projection, make_config
from torch_attention import functional


class _Call(NamedTuple):
    """One call's inputs after every check, batched and canonical."""

    x: Tensor  # (B, T, d_in)
    mask: Tensor | None  # bool, rank 4, broadcastable to (B, H, T, T)
    dropout_mask: Tensor | None  # bool, broadcastable to (B, H, T, T)
    kv_lengths: Tensor | None  # int64 (B,)
    implementation: str
    batched: bool
    bias: Tensor | None = None  # float, rank 4, broadcastable to (B, H, T, T)


def _head_slice(m: Tensor | None, i: int) -> Tensor | None:
    """Head ``i`` of a mask broadcastable to (B, H, T, S); a head dimension of 1 is shared."""
    if m is None or m.dim() < 3 or m.shape[-3] == 1:
        return m
    return m[..., i : i + 1, :, :]


class AttentionModule(nn.Module):
    """Base class.  A subclass names its registry entry (``variant``) and passes its
    constructor arguments once: ``super().__init__(locals(), dtype=dtype, device=device)``.

    ``spec`` (an ``attention_spec.AttentionConfig``) holds every option, frozen;
    ``config`` is the plain dict of constructor keywords (``cls(**m.config)`` rebuilds).
    ``dtype``/``device`` are those of ``nn.Linear``: the parameters' storage dtype, which
    is also the dtype the module computes in (``x`` must come in it).
    """

    variant: ClassVar[str]
    spec: AttentionConfig

    def __init__(
        self,
        options: Mapping[str, Any],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        spec = make_config(self.variant, options)  # validates before anything is built
        super().__init__()
        self.spec = spec
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        # Creation order is the registry's: torch's RNG draws the tutorials' weights in it.
        for proj in spec.declaration.projections:
            setattr(self, proj.name, self._projection(proj, factory) if proj.exists(spec) else None)
        if spec.has_dropout and spec.declaration.heads != "wrapper":  # a wrapper's heads drop
            self.dropout = nn.Dropout(spec.dropout)

    def _projection(self, proj: Projection, factory: dict[str, Any]) -> nn.Module | nn.Parameter:
        spec = self.spec
        width = cast(int, spec.width)
        fan_in = width if proj.role == "out" else cast(int, spec.d_in)
        if proj.layout == "matrix":  # N(0, 1) (d_in, d_out), drawn by torch.randn as in seed 004
            return nn.Parameter(torch.randn(fan_in, width, **factory))
        return nn.Linear(fan_in, width, bias=proj.has_bias(spec), **factory)

    # ------------------------------------------------------------------ the options

    @property
    def config(self) -> dict[str, Any]:
        """The constructor keywords this module was built with (not dtype/device)."""
        return self.spec.options()

    d_in = property(lambda self: self.spec.d_in)
    d_out = property(lambda self: self.spec.d_out)
    head_size = property(lambda self: self.spec.head_size)
    context_length = property(lambda self: self.spec.context_length)
    num_heads = property(lambda self: self.spec.num_heads)
    head_dim = property(lambda self: self.spec.head_dim)
    qkv_bias = property(lambda self: self.spec.qkv_bias)
    scale = property(lambda self: self.spec.scale)
    causal = property(lambda self: self.spec.causal)
    mask_strategy = property(lambda self: self.spec.mask_strategy)
    normalization = property(lambda self: self.spec.normalization)
    implementation = property(lambda self: self.spec.implementation)

    def _compute_dtype(self) -> str | None:
        """The dtype the module computes in: its parameters'; None without parameters."""
        for p in self.parameters():
            return dtype_name(p.dtype)
        return None

    # ------------------------------------------------------------------ the call

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
        dropout_mask: Tensor | None = None,
        kv_lengths: Any = None,
        implementation: str | None = None,
        bias: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T, d_in) or (T, d_in) -> (B, T, d_out) or (T, d_out); with
        ``return_weights`` also the attention weights (B, H, T, T) or (H, T, T).

        ``mask``: bool, True = may attend, broadcastable to (B, H, T, T).
        ``dropout_mask``: bool, True = keep, replaces the random dropout draw (training
        mode, dropout > 0 only).  ``kv_lengths``: valid keys per example (an int, a
        sequence or an integer array of shape () or (B,)).  ``implementation``: this
        call's path (None = the module's).  ``bias``: float, broadcastable to (B, H, T, T),
        added to the scaled (soft-capped) scores before masking.  Raises ValueError/TypeError
        before any work.
        """
        call = self._prepare(x, mask, dropout_mask, kv_lengths, implementation, bias)
        return self._unbatch(self._run(call, return_weights), call.batched)

    def _prepare(
        self,
        x: Tensor,
        mask: Any,
        dropout_mask: Tensor | None,
        kv_lengths: Any,
        implementation: str | None,
        bias: Any = None,
    ) -> _Call:
        """Every check of one call, before any work; the inputs batched and canonical."""
        spec = self.spec
        batched = check_input(x.shape, dtype_name(x.dtype), d_in=spec.d_in, context_length=spec.context_length)
        check_compute_dtype(dtype_name(x.dtype), self._compute_dtype())
        implementation = check_implementation(spec.implementation if implementation is None else implementation)
        batch, seq = (x.shape[0] if batched else 1), x.shape[-2]
        weights_shape = (batch, spec.num_heads, seq, seq)
        # Checked against the input's own rank (a 4-d mask for unbatched input is refused),
        # then given the batch dimension.
        mask = functional.canonical_mask(mask, weights_shape if batched else weights_shape[1:])
        if mask is not None and not batched:
            mask = mask[None]
        bias = functional.canonical_bias(bias, weights_shape if batched else weights_shape[1:])
        if bias is not None and not batched:
            bias = bias[None]
        if dropout_mask is not None:
            # A variant without dropout has no train/eval distinction for it: its rate is 0.
            check_dropout_mask(
                dropout_mask.shape, dtype_name(dropout_mask.dtype),
                weights_shape if batched else weights_shape[1:],
                training=self.training or not spec.has_dropout, rate=spec.dropout,
            )
        kv_lengths = functional.canonical_kv_lengths(kv_lengths, batch, seq)
        if not batched:
            x = x.unsqueeze(0)  # (T, C) -> (1, T, C); masks broadcast from the right
        return _Call(x, mask, dropout_mask, kv_lengths, implementation, batched, bias)

    def _run(self, call: _Call, return_weights: bool) -> Tensor | tuple[Tensor, Tensor]:
        """The work, on checked input: project, attend, merge.  Batched in and out."""
        q, k, v = self._project(call.x)  # each (B, H, T, D)
        spec = self.spec
        result = functional.dot_product_attention(
            q, k, v,
            mask=call.mask,
            causal=spec.causal,
            kv_lengths=call.kv_lengths,
            scale=spec.scale,
            mask_strategy=spec.mask_strategy,
            normalization=spec.normalization,
            dropout_rate=spec.dropout,
            dropout_mask=call.dropout_mask,
            training=self.training,
            return_weights=return_weights,
            implementation=call.implementation,
            bias=call.bias,
            softcap=spec.softcap,
        )
        if return_weights:
            out, weights = cast(tuple[Tensor, Tensor], result)
            return self._merge(out), weights  # (B, H, T, Dv) -> (B, T, d_out)
        return self._merge(cast(Tensor, result))

    @staticmethod
    def _unbatch(result: Tensor | tuple[Tensor, Tensor], batched: bool) -> Tensor | tuple[Tensor, Tensor]:
        if batched:
            return result
        if isinstance(result, tuple):
            return result[0][0], result[1][0]
        return result[0]

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, d_in) -> q, k, v, each (B, H, T, D), by the declared projections."""
        spec = self.spec
        if not spec.projections():
            x = x.unsqueeze(1)  # (B, T, C) -> (B, 1, T, C): one head, the input itself
            return x, x, x

        def project(role: str) -> Tensor:
            layer = getattr(self, cast(Projection, spec.projection(role)).name)
            # (B, T, d_in) -> (B, T, H * D) -> (B, H, T, D)
            return self._split_heads(x @ layer if isinstance(layer, nn.Parameter) else layer(x))

        return project("query"), project("key"), project("value")

    def _split_heads(self, t: Tensor) -> Tensor:
        b, num_tokens, width = t.shape
        # (B, T, H * D) -> (B, T, H, D) -> (B, H, T, D)
        return t.view(b, num_tokens, self.spec.num_heads, width // self.spec.num_heads).transpose(1, 2)

    def _merge(self, out: Tensor) -> Tensor:
        b, h, num_tokens, head_dim = out.shape
        # (B, H, T, D) -> (B, T, H, D) -> (B, T, H * D)
        out = out.transpose(1, 2).reshape(b, num_tokens, h * head_dim)
        out_proj = getattr(self, "out_proj", None)
        return out if out_proj is None else out_proj(out)  # heads mixed by out_proj
