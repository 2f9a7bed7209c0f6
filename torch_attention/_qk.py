"""The transforms of a module's queries and keys, one declared pipeline (``TRANSFORMS``) of
free functions: qk-norm (``normalise_qk``) on each role's projection (B, T, heads * D),
before the head split, then rope (``rotate``, ``_rope.apply_rope``) on q (B, H, T, D) and
k (B, Hkv, S, D), after it, at the call's checked positions (``check_positions``) or each
example's cache fill onward.  The latent variant's RMSNorms (``normalise``) and the
turning of its rope parts (``rotate``) are the same functions.

Twin of ``jax_attention/_qk.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn

from attention_spec import dtype_name
from attention_spec.arrays import host_array
from attention_spec.options import QUERY_SCALE_WITH_CONTEXT, QueryScale
from attention_spec.registry import AttentionConfig
from attention_spec.rope import RopeConfig, check_module_positions
from torch_attention._rope import apply_rope


class Transform(NamedTuple):
    """One transform of q and k: where in the projection it runs, which modules have it,
    and the module's method that runs it (one line, calling a function here: the seam
    where ``parity_tests.locate_divergence`` records it as a submodule)."""

    stage: str  # "projected": hook(role, t), t (B, T, heads * D) before the head split;
    #             "heads": hook(q, k, positions, start), q (B, H, T, D), k (B, Hkv, S, D) after it
    applies: Callable[[AttentionConfig], bool]
    hook: str


# In their order; the next transform is one more entry.
TRANSFORMS = (
    Transform("projected", lambda spec: spec.qk_norm is not None and spec.qk_norm_position == "before_rope",
              "_normalise_qk"),
    Transform("heads", lambda spec: spec.rope is not None, "_rotate"),
    Transform("heads", lambda spec: spec.qk_norm is not None and spec.qk_norm_position == "after_rope",
              "_normalise_turned"),
    Transform("heads", lambda spec: spec.query_scale is not None, "_scale_queries"),
)


def transform_projected(module: Any, role: str, t: Tensor) -> Tensor:
    """One role's projection (B, T, heads * D) through the module's ``"projected"``
    transforms, in order (a role a transform does not touch passes through)."""
    for transform in TRANSFORMS:
        if transform.stage == "projected" and transform.applies(module.spec):
            t = getattr(module, transform.hook)(role, t)
    return t


def transform_heads(module: Any, q: Tensor, k: Tensor, positions: Tensor | None,
                    start: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q (B, H, T, D) and k (B, Hkv, S, D), split into heads, through the module's
    ``"heads"`` transforms, in order, at ``positions`` (None: ``start`` + 0..T-1)."""
    for transform in TRANSFORMS:
        if transform.stage == "heads" and transform.applies(module.spec):
            q, k = getattr(module, transform.hook)(q, k, positions, start)
    return q, k


# --------------------------------------------------------------------------- qk-norm


def qk_norm_layers(spec: AttentionConfig, factory: dict[str, Any]) -> dict[str, nn.Module]:
    """The norms of ``spec.qk_norms()`` by name: weight ones (and bias zeros), as Hugging
    Face's; with ``qk_norm_offset`` the weight starts at ``1 - offset`` (offset + weight =
    1), as Gemma 3's.  ``factory``: ``nn.Linear``'s dtype and device."""
    layers: dict[str, nn.Module] = {}
    for name, _, width in spec.qk_norms():
        norm = nn.RMSNorm if spec.qk_norm == "rms" else nn.LayerNorm
        layer = layers[name] = norm(width, eps=spec.qk_norm_eps, **factory)
        if spec.qk_norm_offset:
            nn.init.constant_(layer.weight, 1.0 - spec.qk_norm_offset)
    return layers


def norm_of(module: Any, role: str) -> Any:
    """The module's qk-norm of ``role`` ("query", "key"), or None (no qk-norm, another role)."""
    return next((getattr(module, n) for n, r, _ in module.spec.qk_norms() if r == role), None)


def normalise_qk(spec: AttentionConfig, norm: Any, t: Tensor) -> Tensor:
    """qk-norm of projected queries or keys (B, T, heads * D), before attention (and
    before any position encoding): each head's D (``qk_norm_scope="head"``) or the
    whole width (``"all"``) normalised as Hugging Face does, in float32 (float64
    for float64), cast back, then times the weight (LayerNorm: plus the bias).  With
    ``qk_norm_offset`` (Gemma 3) the scale is ``offset + weight`` in that precision and
    the product is cast back once, as Gemma's RMSNorm.  ``norm`` (the role's
    ``nn.RMSNorm`` / ``nn.LayerNorm``) None: t passes through, unless the norm is
    weightless (``qk_norm_weight=False``: ``rms``, no module)."""
    if norm is None:
        if spec.qk_norm is not None and not spec.qk_norm_weight:
            return rms(t, cast(int, spec.head_dim) if spec.qk_norm_scope == "head" else t.shape[-1], spec.qk_norm_eps)
        return t
    layer = spec.qk_norm == "layer"
    return normalise(t, norm.weight, spec.qk_norm_eps, centre=layer, offset=spec.qk_norm_offset,
                     bias=norm.bias if layer else None)


def normalise_turned(module: Any, q: Tensor, k: Tensor, positions: Tensor | None = None,
                     start: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q (B, H, T, D) and k (B, Hkv, S, D) through the module's qk-norm after rope
    (``qk_norm_position="after_rope"``, HunYuan's): each merged (B, T, heads * D) through the
    module's ``_normalise_qk`` (the qk-norm's one seam), split back into heads."""
    def one(role: str, t: Tensor) -> Tensor:
        b, heads, num_tokens, head_dim = t.shape
        # (B, heads, T, D) -> (B, T, heads * D) -> normed -> (B, heads, T, D)
        merged = t.transpose(1, 2).reshape(b, num_tokens, heads * head_dim)
        return module._normalise_qk(role, merged).view(b, num_tokens, heads, head_dim).transpose(1, 2)

    return one("query", q), one("key", k)


def normalise(t: Tensor, weight: Tensor, eps: float, *, centre: bool = False, offset: float = 0.0,
              bias: Tensor | None = None) -> Tensor:
    """t (..., W) normalised over each group of ``weight``'s width (W / G groups of G):
    RMSNorm (``centre``: LayerNorm, the mean taken out first) in float32 at least (float64
    stays), cast back to t's dtype, times ``weight`` (G,) (plus ``bias`` (G,)); with
    ``offset``, times ``offset + weight`` in that precision, cast back once."""
    x = t.unflatten(-1, (-1, weight.shape[0]))
    x = x.to(torch.promote_types(x.dtype, torch.float32))  # float32 at least: float64 stays
    if centre:
        x = x - x.mean(-1, keepdim=True)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        x = (x * (offset + weight.to(x.dtype))).to(t.dtype)
    else:
        x = x.to(t.dtype) * weight
    if bias is not None:
        x = x + bias
    return x.flatten(-2)


def rms(t: Tensor, width: int, eps: float) -> Tensor:
    """The weightless RMS norm of t (..., W) over each group of ``width`` features:
    ``x * rsqrt(mean(x^2) + eps)`` in float32 at least (float64 stays), cast back (the
    qk-norm of nanochat and Llama 4, Gemma 4's value norm)."""
    x = t.unflatten(-1, (-1, width))
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype).flatten(-2)


# --------------------------------------------------------------------------- rotary positions


def check_positions(spec: AttentionConfig, positions: Any, x: Tensor, context: Any) -> Tensor | None:
    """A call's ``positions=`` checked (``check_module_positions``: a module with rope or
    a query scale takes them; a list or NumPy array as given, as the JAX twin checks it),
    as a tensor on x's device.  A query scale without rope refuses ``context``."""
    if spec.query_scale is not None and spec.rope is None and context is not None:
        raise ValueError(QUERY_SCALE_WITH_CONTEXT)
    if positions is not None and not isinstance(positions, Tensor):
        positions = host_array("rope positions", positions)
    shape = None if positions is None else tuple(positions.shape)
    dtype = None if positions is None else dtype_name(positions.dtype)
    check_module_positions(spec.rope is not None or spec.query_scale is not None, shape, dtype, tuple(x.shape),
                           context=context is not None)
    return None if positions is None else torch.as_tensor(positions, device=x.device)


def query_positions(q: Tensor, positions: Tensor | None, start: Tensor | None) -> Tensor:
    """The queries' positions: ``positions`` as given, else ``start`` + 0..T-1 ((B, T)),
    or 0..T-1 ((1, T)) without a cache: what rope and the query scale read."""
    if positions is not None:
        return positions
    steps = torch.arange(q.shape[2], device=q.device)[None]
    return steps if start is None else start.to(q.device)[:, None] + steps


def rotate(rope: RopeConfig | None, q: Tensor, k: Tensor, positions: Tensor | None,
           start: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q (B, H, T, D) and k (B, Hkv, T, D) turned by rope at ``positions`` (None:
    ``start`` + 0..T-1, start 0 without a cache); unchanged without rope."""
    if rope is None:
        return q, k
    positions = query_positions(q, positions, start)
    return apply_rope(q, positions, rope), apply_rope(k, positions, rope)


# --------------------------------------------------------------------------- queries scaled by position


def scale_queries(query_scale: QueryScale | None, q: Tensor, k: Tensor, positions: Tensor | None,
                  start: Tensor | None = None, kind: str = "log") -> tuple[Tensor, Tensor]:
    """q (B, H, T, D) times ``1 + beta * log1p(floor((p + offset) / floor))`` at each
    query's position p (``positions``; None: ``start`` + 0..T-1, rope's positions),
    the floor in integers, the scale in float32 at least, the product cast back to q's
    dtype (Llama 4's order); ``kind="power"`` (``query_scale_kind``): times ``exp(beta * log1p((p + offset) /
    floor))`` (Beam's scalable softmax, as its ``compute_attention_scaling``); k unchanged.
    Unchanged without a query scale."""
    if query_scale is None:
        return q, k
    positions = query_positions(q, positions, start)
    dtype = torch.promote_types(q.dtype, torch.float32)
    if kind == "power":
        steps = (positions.to(torch.int64) + query_scale.offset).to(dtype) / query_scale.floor
        power = torch.exp(query_scale.beta * torch.log1p(steps))  # (B or 1, T)
        return (q.to(dtype) * power[:, None, :, None]).to(q.dtype), k
    floors = torch.div(positions.to(torch.int64) + query_scale.offset, query_scale.floor, rounding_mode="floor")
    factor = 1.0 + query_scale.beta * torch.log1p(floors.to(dtype))  # (B or 1, T)
    return (q.to(dtype) * factor[:, None, :, None]).to(q.dtype), k
