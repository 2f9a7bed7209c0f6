"""What every PyTorch attention module shares: the config built from the registry, the
projections it declares, input checks, the batch dimension, the call into ``functional``.
A variant's file only gives the constructor signature (the public API) and docstring.
The work is free functions: the projections (``_projections``), the q/k transforms
(``_qk``), cached decoding (``_cache``).

Twin of ``jax_attention/_base.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from attention_spec import dtype_name
from attention_spec.geometry import chunk_origin
from attention_spec.options import (
    VALUES_FROM_KEYS_PAIR,
    check_kv_call,
    check_shared_fill,
    check_shared_kv,
    kv_kind,
)
from attention_spec.planning import CallOps, CallPlan, RouteFacts, module_options, plan_call
from attention_spec.registry import AttentionConfig, make_config
from torch_attention import functional
from torch_attention._cache import new_cache, run_cached
from torch_attention._cache_data import check_room
from torch_attention._call import _Call
from torch_attention._projections import linear, merge, new_projection, project
from torch_attention._qk import (
    check_positions,
    norm_of,
    normalise_qk,
    normalise_turned,
    qk_norm_layers,
    rotate,
    scale_queries,
    transform_heads,
)

_CACHE_FIELD = _Call._fields.index("cache")
_FROM_CALL: Any = object()  # (the call's own kv_lengths)


def _first_parameter(module: nn.Module) -> Tensor | None:
    """``next(module.parameters(), None)`` without its generators (a decode step asks it
    every token): the module's own parameters, then each submodule's, depth first."""
    for p in module._parameters.values():
        if p is not None:
            return p
    for child in module._modules.values():
        found = None if child is None else _first_parameter(child)
        if found is not None:
            return found
    return None


# The array work that planning a call asks of this twin.
_OPS = CallOps(
    canonical_mask=functional.canonical_mask,
    canonical_bias=functional.canonical_bias,
    canonical_kv_lengths=functional.canonical_kv_lengths,
    as_array=torch.as_tensor,
    cache_fields=functional.cache_fields,
    check_cache_room=check_room,
    check_route=lambda spec, plan, facts: _check_route(spec, plan, facts),
)
# A kv_shared call's kv= KVCache is planned as a cache the call reads: already written by the
# storing layer, so no room is checked (its fill is, after the plan: ``check_shared_fill``).
_SHARED_OPS = _OPS._replace(check_cache_room=lambda cache, new, max_len: None)


def _check_route(spec: AttentionConfig, plan: CallPlan, facts: RouteFacts) -> None:
    """Raises what the table of paths refuses of a module call's explicit
    ``implementation`` (``functional.route_of``), asked before any work on the call as
    its attention will see it: q (B, H, T, D), k and v (B, Hkv, S, D) and sinks as shapes
    (tensors on the meta device), the planned tensors, and a cached step's queries at
    each example's fill (a per-example offset)."""
    options = module_options(spec, training=facts.training, return_weights=facts.return_weights,
                             implementation=plan.implementation, alignment="top_left" if facts.cached else None)
    batch, width, dtype = plan.batch, spec.head_dim or 1, getattr(torch, facts.dtype)

    def shape(*size: int, dtype: torch.dtype = dtype) -> Tensor:
        return torch.empty(size, dtype=dtype, device="meta")

    q, k = shape(batch, spec.num_heads, plan.seq, width), shape(batch, spec.kv_heads, plan.kv_seq, width)
    call = functional.Call(
        options, mask=plan.mask, bias=plan.bias, kv_lengths=plan.kv_lengths,
        offset=shape(batch, dtype=torch.int64) if facts.cached else 0,
        segments=None if plan.segment_ids is None else shape(batch, 1, plan.seq, plan.kv_seq, dtype=torch.bool),
        sinks=shape(spec.num_heads) if spec.sinks else None, dropout_mask=facts.dropout_mask,
    )
    functional.route_of(q, k, k, call)


def _unbatch(result: Tensor | tuple[Tensor, Tensor], batched: bool) -> Tensor | tuple[Tensor, Tensor]:
    """A batched result (out, or out and weights) as the call's x came: unbatched, its
    example 0."""
    if batched:
        return result
    if isinstance(result, tuple):
        return result[0][0], result[1][0]
    return result[0]


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
            setattr(self, proj.name, new_projection(spec, proj, factory) if proj.exists(spec) else None)
        for name, norm in qk_norm_layers(spec, factory).items():
            setattr(self, name, norm)
        for name, width in spec.out_norms():  # BitNet's attn_sub_norm: a weight of ones
            setattr(self, name, nn.RMSNorm(width, eps=spec.qk_norm_eps, **factory))
        if spec.output_gate_bias:  # Beam's gate_bias: zeros, as its initialisation
            self.gate_bias = nn.Parameter(torch.zeros(spec.num_heads, **factory))
        if spec.sinks:  # zeros: each head starts with a sink of logit 0 (gpt-oss draws its own)
            self.sinks = nn.Parameter(torch.zeros(spec.num_heads, **factory))
        if spec.has_dropout and spec.declaration.heads != "wrapper":  # a wrapper's heads drop
            self.dropout = nn.Dropout(spec.dropout)

    # ------------------------------------------------------------------ the options

    @property
    def config(self) -> dict[str, Any]:
        """The constructor keywords this module was built with (not dtype/device)."""
        return self.spec.options()

    def _compute_dtype(self) -> str | None:
        """The dtype the module computes in: its parameters'; None without parameters."""
        p = _first_parameter(self)
        return None if p is None else dtype_name(p.dtype)

    # ------------------------------------------------------------------ the call

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        context: Any = None,
        return_weights: bool = False,
        dropout_mask: Tensor | None = None,
        kv_lengths: Any = None,
        implementation: str | None = None,
        bias: Tensor | None = None,
        segment_ids: Any = None,
        kv_segment_ids: Any = None,
        cache: Any = None,
        positions: Any = None,
        kv: Any = None,
        return_kv: bool = False,
    ) -> Any:
        """x (B, T, d_in) or (T, d_in) -> (B, T, d_out) or (T, d_out) (``out_features``
        when a ``MultiHeadAttention`` is built with it); with
        ``return_weights`` also the attention weights (B, H, T, S) or (H, T, S).

        ``context``: cross-attention, keys and values from another sequence: one array
        (B, S, kdim) (kdim = vdim), or a pair ``(key_input, value_input)`` of widths
        ``kdim`` and ``vdim`` (both ``d_in`` unless the module was built with them); None
        attends over x itself (S = T).
        ``mask``: bool, True = may attend, broadcastable to (B, H, T, S).
        ``dropout_mask``: bool, True = keep, replaces the random dropout draw (training
        mode, dropout > 0 only).  ``kv_lengths``: valid keys per example (an int, a
        sequence or an integer array of shape () or (B,)); with a ``cache``, the valid
        tokens of x (a padded prompt).  ``implementation``: this call's path (None = the
        module's).  ``bias``: float, broadcastable to (B, H, T, S), added to the scaled
        (soft-capped) scores before masking.  ``segment_ids`` (B, T) / ``kv_segment_ids``
        (B, S): packed sequences, tokens attend within their own segment.
        ``cache``: a ``KVCache`` from ``init_cache``: x's keys and values are appended to
        it (in place) and x attends to every cached position, causally aligned at each
        example's fill; returns ``(out, cache)`` (``(out, weights, cache)`` with
        ``return_weights``).  Autograd differentiates through several cached steps.
        ``positions``: integers (B, T) (or (1, T); (T,) for an unbatched x), the positions
        at which a module built with ``rope=`` rotates q and k; None: 0..T-1, with a cache
        each example's fill onward.
        ``return_kv`` (a ``MultiHeadAttention``, no cache): also the keys and values the
        call attended over, (B, Hkv, T, D) each as it computed them (normed, rotated), for
        the modules built with ``kv_shared=True`` that reuse them: ``(out, (k, v))``
        (``(out, weights, (k, v))``).  ``kv``: such a module's keys and values, that pair, or,
        in cached decoding, the storing layer's ``KVCache`` after its call on the same x
        (read, not written: the call returns ``out`` or ``(out, weights)``).
        Raises ValueError/TypeError before any work (and before the cache is written); a
        call that fails after its write (in its attention) puts the cache back as it was.
        """
        call = self._prepare(x, mask, dropout_mask, kv_lengths, implementation, bias,
                             context=context, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                             cache=cache, return_weights=return_weights, positions=positions, kv=kv,
                             return_kv=return_kv)
        if call.cache is not None:
            return self._run_cached(call, return_weights)
        if call.return_kv:
            result, (k, v) = self._run(call, return_weights)
            pair = (k, v) if call.batched else (k[0], v[0])
            result = _unbatch(result, call.batched)
            return (*result, pair) if return_weights else (result, pair)
        return _unbatch(self._run(call, return_weights), call.batched)

    def init_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> functional.KVCache:
        """An empty KV cache for decoding up to ``max_len`` positions of ``batch_size``
        examples, (batch_size, kv_heads, max_len, head_dim) for keys and values: zeros, in ``dtype`` (floating point; None: the module's compute dtype),
        on the module's device.  Raises TypeError for a dtype that is not floating point,
        ValueError for ``max_len`` beyond the module's ``context_length``."""
        return new_cache(self, batch_size, max_len, dtype)

    def _prepare(self, x: Tensor, mask: Any, dropout_mask: Tensor | None, kv_lengths: Any, implementation: str | None,
                 bias: Any = None, *, context: Any = None, segment_ids: Any = None, kv_segment_ids: Any = None,
                 cache: Any = None, return_weights: bool = False, positions: Any = None, kv: Any = None,
                 return_kv: bool = False) -> _Call:
        """Every check of one call (``plan_call``), before any work (a cached call's
        included: nothing after these raises for the call's input, so a refused call never
        writes its cache); the inputs batched and canonical.

        A decode step repeats its checks at every token; they read only shapes, dtypes and
        the module's config, never values, except the cache's room, which reads its fill.
        So a cached call with nothing but x (``_step_key``) whose key equals the last such
        call's that passed reuses that call's checked plan and checks only the room: the
        same errors, at the same point, before any work (a changed module, x or cache
        changes the key and is checked in full)."""
        key = self._step_key(x, cache, implementation, return_weights) if (
            mask is None and dropout_mask is None and kv_lengths is None and bias is None and context is None
            and segment_ids is None and kv_segment_ids is None and positions is None and kv is None
            and return_kv is False and not self.spec.kv_shared) else None
        checked = self.__dict__.get("_checked_step")
        if key is not None and checked is not None and checked[0] == key:
            check_room(cache, x.shape[1], cache.key.shape[2])
            kept = checked[1]  # (_replace(x=x, cache=cache), built directly: a decode step asks it every token)
            return _Call._make((x, *kept[1:_CACHE_FIELD], cache, *kept[_CACHE_FIELD + 1:]))
        # every check, through plan_call (a kv_shared call's first: its kv=, return_kv)
        spec = self.spec
        kind = kv_kind(kv, functional.KVCache)
        check_kv_call(spec.variant, "kv_shared" in spec.declaration.options, spec.kv_shared, kind,
                      return_kv=return_kv, cached=cache is not None, context=context is not None)
        compute_dtype = self._compute_dtype()
        plan = plan_call(
            spec, _SHARED_OPS if kind == "cache" else _OPS, x, compute_dtype=compute_dtype, training=self.training,
            implementation=implementation, context=context, mask=mask, bias=bias, dropout_mask=dropout_mask,
            kv_lengths=kv_lengths, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
            cache=kv if kind == "cache" else cache, return_weights=return_weights,
        )
        if kind == "pair":
            check_shared_kv([(tuple(t.shape), dtype_name(t.dtype)) for t in kv], batched=plan.batched,
                            batch=plan.batch, seq=plan.seq, kv_heads=spec.kv_heads, head_dim=cast(int, spec.head_dim),
                            dtype=compute_dtype or dtype_name(x.dtype))
            kv = tuple(kv) if plan.batched else tuple(t.unsqueeze(0) for t in kv)
        elif kind == "cache":
            new = [plan.seq] * plan.batch if plan.kv_lengths is None else plan.kv_lengths.tolist()
            check_shared_fill(kv.lengths.tolist(), new)
            cache = kv
        if self.spec.values_from_keys and isinstance(context, (tuple, list)):
            raise ValueError(VALUES_FROM_KEYS_PAIR)
        positions = check_positions(self.spec, positions, x, context)
        keys, values, mask, bias = plan.keys, plan.values, plan.mask, plan.bias
        if not plan.batched:  # (T, C) -> (1, T, C); masks broadcast from the right
            x = x.unsqueeze(0)
            keys, values, mask, bias, positions = (
                t if t is None else t.unsqueeze(0) for t in (keys, values, mask, bias, positions))
        call = _Call(x, mask, dropout_mask, plan.kv_lengths, plan.implementation, plan.batched, bias,
                     keys, values, plan.segment_ids, plan.kv_segment_ids, cache, positions,
                     kv=kv if kind == "pair" else None, return_kv=return_kv)
        if key is not None:  # (set past nn.Module.__setattr__: a plain attribute, not state)
            call = call._replace(plans={})
            self.__dict__["_checked_step"] = (key, call._replace(x=cast(Tensor, None), cache=None))
        return call

    def _step_key(self, x: Any, cache: Any, implementation: str | None, return_weights: bool) -> tuple[Any, ...] | None:
        """Everything the checks of a cached call with nothing but x read: the module's
        config, compute dtype and mode, the call's options, and the shapes and dtypes of x
        and of the cache's fields; None for an x or a cache that is not what a decode
        step takes (a plain tensor, a ``KVCache`` of tensors), which is checked in full."""
        if not isinstance(x, Tensor) or type(cache) is not functional.KVCache:
            return None
        key, value, lengths = cache
        if not (isinstance(key, Tensor) and isinstance(value, Tensor) and isinstance(lengths, Tensor)):
            return None
        return (self.spec, self._compute_dtype(), self.training, implementation, return_weights, x.shape, x.dtype,
                key.shape, key.dtype, value.shape, value.dtype, lengths.shape, lengths.dtype)

    def _attention(self, call: _Call, q: Tensor, k: Tensor, return_weights: bool, *, causal: bool | None = None,
                   kv_lengths: Any = _FROM_CALL, q_offset: Any = None, alignment: str | None = None,
                   scale: float | None = None) -> functional.Call:
        """The attention of a checked call over q (B, H, T, D) and k (B, Hkv, S, D): the
        spec's options and the call's tensors as one value (``functional.assemble``:
        checked once, by ``plan_call``).  The keywords override the module's causal,
        kv_lengths, alignment and scale, and add a q_offset.  A chunked module counts its chunks at the call's
        ``positions`` (``attention_spec.geometry.chunk_origin``: from each example's
        position 0), at key slots where it has none (the default positions)."""
        spec = self.spec
        options = module_options(spec, training=self.training, return_weights=return_weights,
                                 implementation=call.implementation, causal=causal, scale=scale, alignment=alignment)
        return functional.assemble(
            q, k.shape[-2], options, mask=call.mask, bias=call.bias,
            kv_lengths=call.kv_lengths if kv_lengths is _FROM_CALL else kv_lengths, dropout_mask=call.dropout_mask,
            q_offset=q_offset, segment_ids=call.segment_ids, kv_segment_ids=call.kv_segment_ids,
            sinks=self.sinks if spec.sinks else None,
            chunk_origin=self._chunk_origin(call, options, q, k, q_offset),
        )

    def _chunk_origin(self, call: _Call, options: Any, q: Tensor, k: Tensor, q_offset: Any) -> Any:
        """Where each example's chunks start: None (key slot 0) without chunks or without
        ``positions``; else from the positions, query 0 at key position ``q_offset`` (a
        cached step's fill) or where the alignment puts it."""
        if self.spec.chunk is None or call.positions is None:
            return None
        if q_offset is None:
            q_offset = 0 if options.alignment == "top_left" else k.shape[-2] - q.shape[-2]
        return chunk_origin(call.positions, q_offset, lambda p: (p.amax(-1), p.shape[-1] - 1 - p.flip(-1).argmax(-1)))

    def _attend(self, call: _Call, q: Tensor, k: Tensor, v: Tensor, return_weights: bool, **extra: Any) -> Any:
        return functional.attend(q, k, v, self._attention(call, q, k, return_weights, **extra))

    def _run(self, call: _Call, return_weights: bool) -> Any:
        """The work, on checked input: project, transform q and k, attend, merge.  Batched
        in and out; with the call's ``return_kv``, ``(result, (k, v))``."""
        # q (B, H, T, D), k and v (B, Hkv, S, D)
        q, k, v, gate = self._project(call.x, call.keys, call.values, call.implementation)
        if call.kv is not None:  # kv_shared: another layer's keys and values, the queries turned alone
            k, v = call.kv
            q = transform_heads(self, q, q, call.positions)[0]  # (q as the keys too: their turn discarded)
        else:
            q, k = transform_heads(self, q, k, call.positions)
        result = self._attend(call, q, k, v, return_weights)
        if return_weights:
            out, weights = cast(tuple[Tensor, Tensor], result)
            merged: Any = merge(self, out, call.implementation, gate), weights  # (B, H, T, Dv) -> (B, T, d_out)
        else:
            merged = merge(self, cast(Tensor, result), call.implementation, gate)
        return (merged, (k, v)) if call.return_kv else merged

    def _run_cached(self, call: _Call, return_weights: bool) -> Any:
        """A decode step (``_cache.run_cached``)."""
        return run_cached(self, call, return_weights)

    # ------------------------------------------------------------------ the seams
    # One line each, calling the free functions: where parity_tests' locate_divergence
    # records a projection, a qk-norm or the rotation as a submodule (on the instance),
    # and where the tests count projections (on the class).

    def _linear(self, layer: nn.Module | nn.Parameter, inputs: Tensor, implementation: str) -> Tensor:
        return linear(layer, inputs, implementation)

    def _project(self, x: Tensor, keys: Tensor | None, values: Tensor | None,
                 implementation: str) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        return project(self, x, keys, values, implementation)

    def _normalise_qk(self, role: str, t: Tensor) -> Tensor:
        return normalise_qk(self.spec, norm_of(self, role), t)

    def _rotate(self, q: Tensor, k: Tensor, positions: Tensor | None, start: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return rotate(self.spec.rope, q, k, positions, start)

    def _normalise_turned(self, q: Tensor, k: Tensor, positions: Tensor | None,
                          start: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return normalise_turned(self, q, k, positions, start)

    def _scale_queries(self, q: Tensor, k: Tensor, positions: Tensor | None,
                       start: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return scale_queries(self.spec.query_scale, q, k, positions, start, self.spec.query_scale_kind)


# The options read back, one read-only property each: ``m.d_in`` is ``m.spec.d_in``.
for _option in ("d_in", "d_out", "head_size", "context_length", "num_heads", "head_dim", "qkv_bias", "scale",
                "causal", "mask_strategy", "normalization", "implementation"):
    setattr(AttentionModule, _option, property(attrgetter(f"spec.{_option}"), doc=f"``spec.{_option}`` (read-only)."))
del _option
