"""What every Flax NNX attention module shares: the config built from the registry, the
projections it declares, input checks, the batch dimension, the dropout stream, the call
into ``functional``.  A variant's file only gives the constructor signature (the public
API) and docstring.  The work is free functions: the projections (``_projections``), the
q/k transforms (``_qk``), cached decoding (``_cache``).

Twin of ``torch_attention/_base.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter
from typing import Any, ClassVar, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

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
from jax_attention import functional
from jax_attention._cache import new_cache, run_cached
from jax_attention._cache_data import check_room
from jax_attention._call import _Call
from jax_attention._projections import linear, merge, new_projection, project
from jax_attention._qk import (
    check_positions,
    norm_of,
    normalise_qk,
    normalise_turned,
    qk_norm_layers,
    rotate,
    scale_queries,
    transform_heads,
)

_FROM_CALL: Any = object()  # (the call's own kv_lengths)

# The array work that planning a call asks of this twin.
_OPS = CallOps(
    canonical_mask=functional.canonical_mask,
    canonical_bias=functional.canonical_bias,
    canonical_kv_lengths=functional.canonical_kv_lengths,
    as_array=jnp.asarray,
    cache_fields=functional.cache_fields,
    check_cache_room=check_room,  # eager only: a compiled step records an overflow in the cache
    check_route=lambda spec, plan, facts: _check_route(spec, plan, facts),
)
# A kv_shared call's kv= KVCache is planned as a cache the call reads: already written by the
# storing layer, so no room is checked (its fill is, after the plan: ``check_shared_fill``).
_SHARED_OPS = _OPS._replace(check_cache_room=lambda cache, new, max_len: None)


def _check_route(spec: AttentionConfig, plan: CallPlan, facts: RouteFacts) -> None:
    """Raises what the table of paths refuses of a module call's explicit
    ``implementation`` (``functional.route_of``), asked before any work on the call as
    its attention will see it: q (B, H, T, D), k and v (B, Hkv, S, D) as shapes, the
    planned arrays, sinks as a shape, and a cached step's queries at each example's fill
    (a per-example offset)."""
    options = module_options(spec, training=facts.training, return_weights=facts.return_weights,
                             implementation=plan.implementation, alignment="top_left" if facts.cached else None)
    batch, width, dtype = plan.batch, spec.head_dim or 1, jnp.dtype(facts.dtype)
    q = jax.ShapeDtypeStruct((batch, spec.num_heads, plan.seq, width), dtype)
    k = jax.ShapeDtypeStruct((batch, spec.kv_heads, plan.kv_seq, width), dtype)
    shape: Any = jax.ShapeDtypeStruct  # arrays as shapes: the table reads no value
    call = functional.Call(
        options, mask=plan.mask, bias=plan.bias, kv_lengths=plan.kv_lengths,
        offset=shape((batch,), jnp.int32) if facts.cached else 0,
        segments=None if plan.segment_ids is None else shape((batch, 1, plan.seq, plan.kv_seq), jnp.bool_),
        sinks=shape((spec.num_heads,), dtype) if spec.sinks else None, dropout_mask=facts.dropout_mask,
    )
    functional.route_of(q, k, k, call)


def _unbatch(result: Array | tuple[Array, Array], batched: bool) -> Array | tuple[Array, Array]:
    """A batched result (out, or out and weights) as the call's x came: unbatched, its
    example 0."""
    if batched:
        return result
    if isinstance(result, tuple):
        return result[0][0], result[1][0]
    return result[0]


def _dropout_key(dropout: Any, rngs: Any) -> Array | None:
    """A key from the call's ``rngs`` (Rngs, RngStream or key), else the module's stream
    (its ``dropout``'s)."""
    if isinstance(rngs, nnx.Rngs):
        return rngs[dropout.rng_collection]()
    if isinstance(rngs, nnx.RngStream):
        return rngs()
    if rngs is not None:
        return rngs
    return None if dropout.rngs is None else dropout.rngs()


def _head_slice(m: Array | None, i: int) -> Array | None:
    """Head ``i`` of a mask broadcastable to (B, H, T, S); a head dimension of 1 is shared."""
    if m is None or m.ndim < 3 or m.shape[-3] == 1:
        return m
    return m[..., i : i + 1, :, :]


class AttentionModule(nnx.Module):
    """Base class.  A subclass names its registry entry (``variant``) and passes its
    constructor arguments once: ``super().__init__(locals(), dtype=..., param_dtype=...,
    precision=..., rngs=...)``.

    ``spec`` (an ``attention_spec.AttentionConfig``, frozen and hashable) holds every
    option and is a static attribute: ``jit`` hashes it, never traces it.  ``config`` is
    the plain dict of constructor keywords (``cls(**m.config, rngs=...)`` rebuilds).

    dtypes, as Flax's own modules: ``param_dtype`` (default float32) stores the
    parameters, ``dtype`` is the computation dtype (None: ``param_dtype``); ``x`` must
    come in the computation dtype.  PyTorch's ``dtype`` (storage, = computation) maps to
    ``param_dtype`` here.
    """

    variant: ClassVar[str]
    spec: AttentionConfig

    def __init__(
        self,
        options: Mapping[str, Any],
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = "highest",
        rngs: nnx.Rngs | None = None,
    ) -> None:
        spec = make_config(self.variant, options)  # validates before anything is built
        self.spec = spec
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        for proj in spec.declaration.projections:
            setattr(self, proj.name, new_projection(spec, proj, dtype=dtype, param_dtype=param_dtype,
                                                    precision=precision, rngs=cast(nnx.Rngs, rngs))
                    if proj.exists(spec) else None)
        for name, norm in qk_norm_layers(spec, dtype=dtype, param_dtype=param_dtype, rngs=cast(nnx.Rngs, rngs)).items():
            setattr(self, name, norm)
        for name, width in spec.out_norms():  # BitNet's attn_sub_norm: a scale of ones, as the PyTorch twin
            setattr(self, name, nnx.RMSNorm(width, epsilon=spec.qk_norm_eps, dtype=dtype, param_dtype=param_dtype,
                                            rngs=cast(nnx.Rngs, rngs)))
        if spec.output_gate_bias:  # Beam's gate_bias: zeros, as the PyTorch twin
            self.gate_bias = nnx.Param(jnp.zeros((spec.num_heads,), param_dtype))
        if spec.sinks:  # zeros: each head starts with a sink of logit 0, as the PyTorch twin
            self.sinks = nnx.Param(jnp.zeros((spec.num_heads,), param_dtype))
        if spec.has_dropout and spec.declaration.heads != "wrapper":  # a wrapper's heads drop
            # Rate 0 never draws: no 'dropout' stream is taken, so the module initialises
            # from a params key alone (nnx.bridge.to_linen(...).init), as nnx.MultiHeadAttention.
            self.dropout = nnx.Dropout(spec.dropout, rngs=rngs if spec.dropout > 0.0 else None)

    # ------------------------------------------------------------------ the options

    @property
    def config(self) -> dict[str, Any]:
        """The constructor keywords this module was built with (not dtype/param_dtype/
        precision/rngs)."""
        return self.spec.options()

    def _compute_dtype(self) -> str | None:
        """The dtype the module computes in: ``dtype``, else ``param_dtype``; None for a
        module without parameters (it computes in x's dtype)."""
        if not (self.spec.projections() or self.spec.declaration.heads == "wrapper"):
            return None
        return dtype_name(jnp.dtype(self.dtype if self.dtype is not None else self.param_dtype))

    def _deterministic(self, deterministic: bool | None) -> bool:
        """As ``nnx.Dropout``: the call's flag overrides the module's, which ``.eval()``
        and ``.train()`` set; a module without dropout is always deterministic."""
        dropout = getattr(self, "dropout", None)
        if dropout is None:
            return True
        return bool(dropout.deterministic) if deterministic is None else deterministic

    # ------------------------------------------------------------------ the call

    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        *,
        context: Any = None,
        return_weights: bool = False,
        dropout_mask: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | Array | None = None,
        kv_lengths: Any = None,
        implementation: str | None = None,
        bias: Array | None = None,
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
        mode, dropout > 0 only).  ``deterministic``/``rngs``: ``nnx.Dropout``'s
        conventions (the call's flag and key, else the module's).  ``kv_lengths``: valid
        keys per example (an int, a sequence or an integer array of shape () or (B,));
        with a ``cache``, the valid tokens of x (a padded prompt).  ``implementation``:
        this call's path (None = the module's).  ``bias``: float, broadcastable to
        (B, H, T, S), added to the scaled (soft-capped) scores before masking.
        ``segment_ids`` (B, T) / ``kv_segment_ids`` (B, S): packed sequences, tokens
        attend within their own segment.
        ``cache``: a ``KVCache`` from ``init_cache``: returns ``(out, new_cache)``
        (``(out, weights, new_cache)`` with ``return_weights``), x's keys and values
        appended and x attending to every filled position, causally aligned at each
        example's fill.  The cache has a fixed shape, so a jitted decode step compiles
        once; its attention runs over the cache's first positions up to the fullest
        fill (in buckets of 128, 256, ...: a step costs what the filled part costs, not
        ``max_len``).  A step that donates the cache (``donate_argnums``) updates its
        buffers in place.  Raises ValueError/TypeError before any work and before any
        random draw.  Under jit nothing reads the device (no host callback): a step that
        would run past ``max_len`` writes nothing, keeps the fill, returns NaN outputs
        and records the overflow in the returned cache (``KVCache.overflow``); every
        later step on it does the same, and the next eager use of that cache (a call,
        or ``cache.check()``) raises the ValueError the eager call raises, with its text.
        A donated cache is consumed either way: keep the one the step returns.
        ``positions``: integers (B, T) (or (1, T); (T,) for an unbatched x), the positions
        at which a module built with ``rope=`` rotates q and k; None: 0..T-1, with a cache
        each example's fill onward.
        ``return_kv`` (a ``MultiHeadAttention``, no cache): also the keys and values the
        call attended over, (B, Hkv, T, D) each as it computed them (normed, rotated), for
        the modules built with ``kv_shared=True`` that reuse them: ``(out, (k, v))``
        (``(out, weights, (k, v))``).  ``kv``: such a module's keys and values, that pair, or,
        in cached decoding, the storing layer's ``KVCache`` that its call on the same x
        returned (read, not written: the call returns ``out`` or ``(out, weights)``; an
        eager call checks that its fill holds x's tokens, a jitted one reads no fill, and
        one after a step that recorded an overflow gives NaN outputs, as that step did).
        """
        call = self._prepare(x, mask, dropout_mask, deterministic, kv_lengths, implementation, bias,
                             context=context, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                             cache=cache, return_weights=return_weights, positions=positions, kv=kv,
                             return_kv=return_kv)
        key = self._draw_key(call, rngs, return_weights)  # after every check: it advances a stream
        if call.cache is not None:
            return self._run_cached(call, return_weights, key)
        if call.return_kv:
            result, (k, v) = self._run(call, return_weights, key)
            pair = (k, v) if call.batched else (k[0], v[0])
            result = _unbatch(result, call.batched)
            return (*result, pair) if return_weights else (result, pair)
        return _unbatch(self._run(call, return_weights, key), call.batched)

    def init_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> functional.KVCache:
        """An empty KV cache for decoding up to ``max_len`` positions of ``batch_size``
        examples, (batch_size, kv_heads, max_len, head_dim) for keys and values: zeros in ``dtype`` (floating point; None: the module's compute dtype).
        Raises TypeError for a dtype that is not floating point, ValueError for ``max_len``
        beyond the module's ``context_length``."""
        return new_cache(self, batch_size, max_len, dtype)

    def _prepare(self, x: Array, mask: Any, dropout_mask: Array | None, deterministic: bool | None, kv_lengths: Any,
                 implementation: str | None, bias: Any = None, *, context: Any = None, segment_ids: Any = None,
                 kv_segment_ids: Any = None, cache: Any = None, return_weights: bool = False,
                 positions: Any = None, kv: Any = None, return_kv: bool = False) -> _Call:
        """Every check of one call (``plan_call``), before any work (and before any random
        draw); the inputs batched and canonical."""
        deterministic = self._deterministic(deterministic)
        spec = self.spec  # (a kv_shared call's checks first: its kv=, return_kv)
        kind = kv_kind(kv, functional.KVCache)
        check_kv_call(spec.variant, "kv_shared" in spec.declaration.options, spec.kv_shared, kind,
                      return_kv=return_kv, cached=cache is not None, context=context is not None)
        compute_dtype = self._compute_dtype()
        plan = plan_call(
            spec, _SHARED_OPS if kind == "cache" else _OPS, x, compute_dtype=compute_dtype, training=not deterministic,
            implementation=implementation, context=context, mask=mask, bias=bias, dropout_mask=dropout_mask,
            kv_lengths=kv_lengths, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
            cache=kv if kind == "cache" else cache, return_weights=return_weights,
        )
        if kind == "pair":
            check_shared_kv([(tuple(t.shape), dtype_name(t.dtype)) for t in kv], batched=plan.batched,
                            batch=plan.batch, seq=plan.seq, kv_heads=spec.kv_heads, head_dim=cast(int, spec.head_dim),
                            dtype=compute_dtype or dtype_name(x.dtype))
            kv = tuple(kv) if plan.batched else tuple(t[None] for t in kv)
        elif kind == "cache":
            cache = kv
            if not isinstance(kv.lengths, jax.core.Tracer):  # (under jit nothing reads the device)
                new = [plan.seq] * plan.batch if plan.kv_lengths is None else [int(n) for n in plan.kv_lengths]
                check_shared_fill([int(n) for n in kv.lengths], new)
        if self.spec.values_from_keys and isinstance(context, (tuple, list)):
            raise ValueError(VALUES_FROM_KEYS_PAIR)
        positions = check_positions(self.spec, positions, x, context)
        keys, values, mask, bias = plan.keys, plan.values, plan.mask, plan.bias
        if not plan.batched:  # (T, C) -> (1, T, C); masks broadcast from the right
            x = x[None]
            keys, values, mask, bias, positions = (
                t if t is None else t[None] for t in (keys, values, mask, bias, positions))
        return _Call(x, mask, dropout_mask, plan.kv_lengths, plan.implementation, plan.batched, deterministic,
                     bias, keys, values, plan.segment_ids, plan.kv_segment_ids, cache, positions,
                     kv=kv if kind == "pair" else None, return_kv=return_kv)

    def _draws(self, call: _Call) -> bool:
        return not call.deterministic and self.spec.dropout > 0.0 and call.dropout_mask is None

    def _draw_key(self, call: _Call, rngs: Any, return_weights: bool) -> Array | None:
        if not self._draws(call):  # (an explicit path that cannot draw was refused by the plan)
            return None
        return _dropout_key(getattr(self, "dropout"), rngs)  # noqa: B009 (a dropout variant has one)

    def _attend(self, call: _Call, q: Array, k: Array, v: Array, return_weights: bool, key: Array | None,
                **extra: Any) -> Any:
        return functional.attend(q, k, v, self._attention(call, q, k, return_weights, **extra), rng=key,
                                 precision=self.precision)

    def _attention(self, call: _Call, q: Any, k: Any, return_weights: bool, *, causal: bool | None = None,
                   kv_lengths: Any = _FROM_CALL, q_offset: Any = None, alignment: str | None = None,
                   scale: float | None = None) -> functional.Call:
        """The attention of a checked call over q (B, H, T, D) and k (B, Hkv, S, D) (read
        for their shapes): the spec's options and the call's arrays as one value
        (``functional.assemble``: checked once, by ``plan_call``).  The keywords override
        the module's causal, kv_lengths, alignment and scale, and add a q_offset.  A chunked module counts its chunks at the call's
        ``positions`` (``attention_spec.geometry.chunk_origin``: from each example's
        position 0), at key slots where it has none (the default positions)."""
        spec = self.spec
        options = module_options(spec, training=not call.deterministic, return_weights=return_weights,
                                 implementation=call.implementation, causal=causal, scale=scale, alignment=alignment)
        return functional.assemble(
            tuple(q.shape), k.shape[-2], q.dtype, options, mask=call.mask, bias=call.bias,
            kv_lengths=call.kv_lengths if kv_lengths is _FROM_CALL else kv_lengths, dropout_mask=call.dropout_mask,
            q_offset=q_offset, segment_ids=call.segment_ids, kv_segment_ids=call.kv_segment_ids,
            sinks=self.sinks[...] if spec.sinks else None,
            chunk_origin=self._chunk_origin(call, options, q, k, q_offset),
        )

    def _chunk_origin(self, call: _Call, options: Any, q: Array, k: Array, q_offset: Any) -> Any:
        """Where each example's chunks start: None (key slot 0) without chunks or without
        ``positions``; else from the positions, query 0 at key position ``q_offset`` (a
        cached step's fill) or where the alignment puts it."""
        if self.spec.chunk is None or call.positions is None:
            return None
        if q_offset is None:
            q_offset = 0 if options.alignment == "top_left" else k.shape[-2] - q.shape[-2]
        return chunk_origin(call.positions, q_offset, lambda p: (p.max(-1), p.shape[-1] - 1 - jnp.flip(p, -1).argmax(-1)))

    def _run(self, call: _Call, return_weights: bool, key: Array | None) -> Any:
        """The work, on checked input: project, transform q and k, attend, merge.  Batched
        in and out; with the call's ``return_kv``, ``(result, (k, v))``."""
        # q (B, H, T, D), k and v (B, Hkv, S, D)
        q, k, v, gate = self._project(call.x, call.keys, call.values, call.implementation)
        if call.kv is not None:  # kv_shared: another layer's keys and values, the queries turned alone
            k, v = call.kv
            q = transform_heads(self, q, q, call.positions)[0]  # (q as the keys too: their turn discarded)
        else:
            q, k = transform_heads(self, q, k, call.positions)
        result = self._attend(call, q, k, v, return_weights, key)
        if return_weights:
            out, weights = cast(tuple[Array, Array], result)
            merged: Any = merge(self, out, call.implementation, gate), weights  # (B, H, T, Dv) -> (B, T, d_out)
        else:
            merged = merge(self, cast(Array, result), call.implementation, gate)
        return (merged, (k, v)) if call.return_kv else merged

    def _run_cached(self, call: _Call, return_weights: bool, key: Array | None) -> Any:
        """A decode step (``_cache.run_cached``)."""
        return run_cached(self, call, return_weights, key)

    # ------------------------------------------------------------------ the seams
    # One line each, calling the free functions: where parity_tests' locate_divergence
    # records a projection, a qk-norm or the rotation as a submodule (on the instance),
    # and where the tests count projections (on the class).

    def _linear(self, layer: nnx.Module | nnx.Param, inputs: Array, implementation: str) -> Array:
        return linear(layer, inputs, implementation, self.precision)

    def _project(self, x: Array, keys: Array | None, values: Array | None,
                 implementation: str) -> tuple[Array, Array, Array, Array | None]:
        return project(self, x, keys, values, implementation)

    def _normalise_qk(self, role: str, t: Array) -> Array:
        return normalise_qk(self.spec, norm_of(self, role), t)

    def _rotate(self, q: Array, k: Array, positions: Array | None, start: Array | None = None) -> tuple[Array, Array]:
        return rotate(self.spec.rope, q, k, positions, start)

    def _normalise_turned(self, q: Array, k: Array, positions: Array | None,
                          start: Array | None = None) -> tuple[Array, Array]:
        return normalise_turned(self, q, k, positions, start)

    def _scale_queries(self, q: Array, k: Array, positions: Array | None,
                       start: Array | None = None) -> tuple[Array, Array]:
        return scale_queries(self.spec.query_scale, q, k, positions, start, self.spec.query_scale_kind)


# The options read back, one read-only property each: ``m.d_in`` is ``m.spec.d_in``.
for _option in ("d_in", "d_out", "head_size", "context_length", "num_heads", "head_dim", "qkv_bias", "scale",
                "causal", "mask_strategy", "normalization", "implementation"):
    setattr(AttentionModule, _option, property(attrgetter(f"spec.{_option}"), doc=f"``spec.{_option}`` (read-only)."))
del _option
