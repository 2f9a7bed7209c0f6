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

from attention_spec import dtype_name
from attention_spec.arrays import host_array
from attention_spec.cache import check_cache_context, check_cache_dtype, check_cache_room, check_cacheable
from attention_spec.options import CallOptions, check_positive_int
from attention_spec.planning import CallOps, plan_call
from attention_spec.registry import AttentionConfig, Projection, make_config
from attention_spec.rope import check_module_positions
from torch_attention import functional
from torch_attention._cache import append_at


class _Call(NamedTuple):
    """One call's inputs after every check, batched and canonical."""

    x: Tensor  # (B, T, d_in)
    mask: Tensor | None  # bool, rank 4, broadcastable to (B, H, T, S)
    dropout_mask: Tensor | None  # bool, broadcastable to (B, H, T, S)
    kv_lengths: Tensor | None  # int64 (B,): valid keys (with a cache: valid tokens of x)
    implementation: str
    batched: bool
    bias: Tensor | None = None  # float, rank 4, broadcastable to (B, H, T, S)
    keys: Tensor | None = None  # (B, S, kdim): cross-attention's key input (None: x)
    values: Tensor | None = None  # (B, S, vdim): its value input (None: x)
    segment_ids: Tensor | None = None  # int (B, T)
    kv_segment_ids: Tensor | None = None  # int (B, S)
    cache: Any = None  # functional.KVCache
    positions: Tensor | None = None  # int (B, T) or (1, T): rope's positions (None: the default)
    plans: dict[str, Any] | None = None  # a checked decode step's kept attention plans (see _prepare)


_CACHE_FIELD = _Call._fields.index("cache")
_FROM_CALL: Any = object()  # (the call's own kv_lengths)


def _prefix(t: Tensor | None, n: int) -> Tensor | None:
    """The first ``n`` key positions of a mask or bias broadcastable to (B, H, T, S); a
    broadcast (size-1) key dimension stays."""
    return t if t is None or t.shape[-1] == 1 else t[..., :n]


def _check_room(cache: Any, new: int, max_len: int) -> None:
    """``check_cache_room`` on the fullest example's fill (read from the device)."""
    check_cache_room(max(cache.lengths.tolist()), new, max_len)


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
    check_cache_room=_check_room,
    fused_draws_dropout=functional.FUSED_DRAWS_DROPOUT,
    fused_takes_sinks=lambda: False,  # SDPA has no sinks
)


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
        for name, _, width in spec.qk_norms():  # weight ones (and bias zeros), as Hugging Face's
            norm = nn.RMSNorm if spec.qk_norm == "rms" else nn.LayerNorm
            setattr(self, name, norm(width, eps=spec.qk_norm_eps, **factory))
            if spec.qk_norm_offset:  # the scale offset + weight starts at 1, as Gemma 3's
                nn.init.constant_(getattr(self, name).weight, 1.0 - spec.qk_norm_offset)
        if spec.sinks:  # zeros: each head starts with a sink of logit 0 (gpt-oss draws its own)
            self.sinks = nn.Parameter(torch.zeros(spec.num_heads, **factory))
        if spec.has_dropout and spec.declaration.heads != "wrapper":  # a wrapper's heads drop
            self.dropout = nn.Dropout(spec.dropout)

    def _projection(self, proj: Projection, factory: dict[str, Any]) -> nn.Module | nn.Parameter:
        spec = self.spec
        width, fan_in = cast(int, spec.fan_out(proj.role)), cast(int, spec.fan_in(proj.role))
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
        Raises ValueError/TypeError before any work (and before the cache is written).
        """
        call = self._prepare(x, mask, dropout_mask, kv_lengths, implementation, bias,
                             context=context, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                             cache=cache, return_weights=return_weights, positions=positions)
        if call.cache is not None:
            return self._run_cached(call, return_weights)
        return self._unbatch(self._run(call, return_weights), call.batched)

    def init_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> functional.KVCache:
        """An empty KV cache for decoding up to ``max_len`` positions of ``batch_size``
        examples, (batch_size, kv_heads, max_len, head_dim) for keys and values: zeros, in ``dtype`` (floating point; None: the module's compute dtype),
        on the module's device.  Raises TypeError for a dtype that is not floating point,
        ValueError for ``max_len`` beyond the module's ``context_length``."""
        spec = self.spec
        check_cacheable(spec)
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_len", max_len)
        check_cache_context(max_len, spec.context_length)
        p = next(self.parameters())
        dtype = p.dtype if dtype is None else dtype
        check_cache_dtype(dtype_name(dtype))
        shape = (batch_size, spec.kv_heads, max_len)
        return functional.KVCache(
            torch.zeros(*shape, cast(int, spec.head_dim), dtype=dtype, device=p.device),
            torch.zeros(*shape, self._value_head_dim(), dtype=dtype, device=p.device),
            torch.zeros(batch_size, dtype=torch.int64, device=p.device),
        )

    def _value_head_dim(self) -> int:
        spec = self.spec
        return cast(int, spec.head_dim)

    def _prepare(
        self,
        x: Tensor,
        mask: Any,
        dropout_mask: Tensor | None,
        kv_lengths: Any,
        implementation: str | None,
        bias: Any = None,
        *,
        context: Any = None,
        segment_ids: Any = None,
        kv_segment_ids: Any = None,
        cache: Any = None,
        return_weights: bool = False,
        positions: Any = None,
    ) -> _Call:
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
            and segment_ids is None and kv_segment_ids is None and positions is None) else None
        checked = self.__dict__.get("_checked_step")
        if key is not None and checked is not None and checked[0] == key:
            _check_room(cache, x.shape[1], cache.key.shape[2])
            kept = checked[1]  # (_replace(x=x, cache=cache), built directly: a decode step asks it every token)
            return _Call._make((x, *kept[1:_CACHE_FIELD], cache, *kept[_CACHE_FIELD + 1:]))
        # every check, through plan_call
        plan = plan_call(
            self.spec, _OPS, x, compute_dtype=self._compute_dtype(), training=self.training,
            implementation=implementation, context=context, mask=mask, bias=bias, dropout_mask=dropout_mask,
            kv_lengths=kv_lengths, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, cache=cache,
            return_weights=return_weights,
        )
        positions = self._check_positions(positions, x, context)
        keys, values, mask, bias = plan.keys, plan.values, plan.mask, plan.bias
        if not plan.batched:  # (T, C) -> (1, T, C); masks broadcast from the right
            x = x.unsqueeze(0)
            keys, values, mask, bias, positions = (
                t if t is None else t.unsqueeze(0) for t in (keys, values, mask, bias, positions))
        call = _Call(x, mask, dropout_mask, plan.kv_lengths, plan.implementation, plan.batched, bias,
                     keys, values, plan.segment_ids, plan.kv_segment_ids, cache, positions)
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

    # ------------------------------------------------------------------ rotary positions

    def _check_positions(self, positions: Any, x: Tensor, context: Any) -> Tensor | None:
        """A call's ``positions=`` checked (``check_module_positions``; a list or NumPy
        array as given, as the JAX twin checks it), as a tensor on x's device."""
        if positions is not None and not isinstance(positions, Tensor):
            positions = host_array("rope positions", positions)
        shape = None if positions is None else tuple(positions.shape)
        dtype = None if positions is None else dtype_name(positions.dtype)
        check_module_positions(self.spec.rope is not None, shape, dtype, tuple(x.shape), context=context is not None)
        return None if positions is None else torch.as_tensor(positions, device=x.device)

    def _rotate(
        self, q: Tensor, k: Tensor, positions: Tensor | None, start: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """q and k turned by rope at ``positions`` (None: ``start`` + 0..T-1, start 0
        without a cache); unchanged for a module without rope."""
        rope = self.spec.rope
        if rope is None:
            return q, k
        if positions is None:
            steps = torch.arange(q.shape[2], device=q.device)[None]
            positions = steps if start is None else start.to(q.device)[:, None] + steps
        return functional.apply_rope(q, positions, rope), functional.apply_rope(k, positions, rope)

    def _attention(self, call: _Call, q: Tensor, k: Tensor, return_weights: bool, *, causal: bool | None = None,
                   kv_lengths: Any = _FROM_CALL, q_offset: Any = None, alignment: str | None = None,
                   scale: float | None = None) -> functional.Call:
        """The attention of a checked call over q (B, H, T, D) and k (B, Hkv, S, D): the
        spec's options and the call's tensors as one value (``functional.assemble``:
        checked once, by ``plan_call``).  The keywords override the module's causal,
        kv_lengths, alignment and scale, and add a q_offset."""
        spec = self.spec
        options = CallOptions(
            causal=spec.causal if causal is None else causal,
            scale=spec.scale if scale is None else scale,
            mask_strategy=spec.mask_strategy,
            normalization=spec.normalization,
            softcap=spec.softcap,
            window=spec.window,
            alignment=spec.alignment if alignment is None else alignment,
            dropout_rate=spec.dropout,
            training=self.training,
            return_weights=return_weights,
            implementation=call.implementation,
        )
        return functional.assemble(
            q, k.shape[-2], options, mask=call.mask, bias=call.bias,
            kv_lengths=call.kv_lengths if kv_lengths is _FROM_CALL else kv_lengths, dropout_mask=call.dropout_mask,
            q_offset=q_offset, segment_ids=call.segment_ids, kv_segment_ids=call.kv_segment_ids,
            sinks=self.sinks if spec.sinks else None,
        )

    def _attend(self, call: _Call, q: Tensor, k: Tensor, v: Tensor, return_weights: bool, **extra: Any) -> Any:
        return functional.attend(q, k, v, self._attention(call, q, k, return_weights, **extra))

    def _attend_all(self, call: _Call, q: Tensor, k: Tensor, v: Tensor, return_weights: bool) -> Any:
        """``_attend`` for queries that see every key of k and v (no causal band, mask,
        bias, lengths or segments: a decoded token over the filled prefix), with the
        checks and the route of ``dot_product_attention`` made at the first such call of
        a checked decode step (kept in ``call.plans``, see ``_prepare``) and reused by
        the next: nothing of that plan depends on kv_len, the only shape that changes."""
        plans = cast(dict[str, Any], call.plans)
        plan = plans.get("all keys")
        if plan is None:
            plan = plans["all keys"] = self._attention(call, q, k, return_weights, causal=False, alignment="top_left")
        return functional.attend(q, k, v, plan)

    def _run(self, call: _Call, return_weights: bool) -> Tensor | tuple[Tensor, Tensor]:
        """The work, on checked input: project, attend, merge.  Batched in and out."""
        # q (B, H, T, D), k and v (B, Hkv, S, D)
        q, k, v = self._project(call.x, call.keys, call.values, call.implementation)
        q, k = self._rotate(q, k, call.positions)
        result = self._attend(call, q, k, v, return_weights)
        if return_weights:
            out, weights = cast(tuple[Tensor, Tensor], result)
            return self._merge(out, call.implementation), weights  # (B, H, T, Dv) -> (B, T, d_out)
        return self._merge(cast(Tensor, result), call.implementation)

    def _run_cached(self, call: _Call, return_weights: bool) -> Any:
        """A decode step: x's keys and values appended to the cache, then x attends to
        every filled position, query t of example b at key position lengths[b] + t."""
        q, k, v = self._project(call.x, None, None, call.implementation)
        cache = call.cache
        batch, seq = call.x.shape[0], call.x.shape[1]
        fills = cache.lengths.tolist()  # each example's fill before this call (one read)
        if min(fills) == max(fills) and (call.kv_lengths is None or bool((call.kv_lengths == seq).all())):
            # One fill for every example and every token valid: one slice written, a static
            # offset, and no lengths (every key of the prefix is filled), so SDPA gets no mask.
            if self.spec.rope is not None:
                q, k = self._rotate(q, k, call.positions, cache.lengths)  # (read before the write)
            cache = append_at(cache, k, v, fills[0])
            return self._attend_cached(call, cache, q, fills[0] + seq, fills[0], None, return_weights)
        lengths = call.kv_lengths if call.kv_lengths is not None else torch.full(
            (batch,), seq, dtype=torch.int64, device=q.device)
        start = cache.lengths.clone()
        q, k = self._rotate(q, k, call.positions, start)
        cache = functional.append_to_cache(cache, k, v, lengths.to(q.device))
        kv_lengths = start + lengths.to(q.device)
        return self._attend_cached(call, cache, q, int(cache.lengths.max()), start, kv_lengths, return_weights)

    def _attend_cached(
        self, call: _Call, cache: functional.KVCache, q: Tensor, filled: int, q_offset: Tensor | int, kv_lengths: Tensor | None,
        return_weights: bool,
    ) -> Any:
        """q attends to the cache's keys [0, filled) (its fullest example's fill), query 0
        of each example at key position ``q_offset``: eager shapes may change per step, so
        a step costs what the filled part costs (the twin keeps max_len, the fixed shape
        that lets one compilation serve every step).  Returns ``(out, cache)`` or, with
        ``return_weights``, ``(out, weights, cache)``."""
        keys, values = cache.key[:, :, :filled], cache.value[:, :, :filled]
        if keys.dtype != q.dtype:  # (a cache in another dtype than the module's)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if keys.requires_grad or values.requires_grad:
            # Autograd saves what the attention reads; the next step writes the cache in
            # place, so this step reads a copy (gradients still reach every written k and v
            # through the in-place writes, as through the twin's functional update).
            keys, values = keys.clone(), values.clone()
        if call.mask is not None or call.bias is not None or call.dropout_mask is not None:
            call = call._replace(mask=_prefix(call.mask, filled), bias=_prefix(call.bias, filled),
                                 dropout_mask=_prefix(call.dropout_mask, filled))
        spec = self.spec
        if (isinstance(q_offset, int) and q_offset + 1 == filled and q.shape[2] == 1 and spec.window is None
                and call.plans is not None and not spec.sinks and call.mask is None and call.bias is None
                and call.dropout_mask is None):
            # One query at the last filled position: every key is before it, causal or not.
            # (Sinks stay on the general path: a kept plan would hold the module's tensor.)
            result = self._attend_all(call, q, keys, values, return_weights)
        else:
            result = self._attend(call, q, keys, values, return_weights, kv_lengths=kv_lengths, q_offset=q_offset,
                                  alignment="top_left")
        if return_weights:  # zero weights on the unfilled positions: (B, H, T, max_len), as the twin's
            out, weights = cast(tuple[Tensor, Tensor], result)
            weights = torch.nn.functional.pad(weights, (0, cache.key.shape[2] - filled))
            return self._merge(out, call.implementation), weights, cache
        return self._merge(cast(Tensor, result), call.implementation), cache

    @staticmethod
    def _unbatch(result: Tensor | tuple[Tensor, Tensor], batched: bool) -> Tensor | tuple[Tensor, Tensor]:
        if batched:
            return result
        if isinstance(result, tuple):
            return result[0][0], result[1][0]
        return result[0]

    @staticmethod
    def _linear(layer: nn.Module | nn.Parameter, inputs: Tensor, implementation: str) -> Tensor:
        """inputs @ a projection's weight (+ bias) through ``functional.project``: an
        ``nn.Linear``'s math, or a bare (d_in, d_out) matrix used as x @ W."""
        if isinstance(layer, nn.Module):  # (tested first: isinstance of a Parameter runs Python code)
            linear = cast(nn.Linear, layer)
            return functional.project(inputs, linear.weight, linear.bias, implementation=implementation)
        return functional.project(inputs, layer.T, implementation=implementation)

    def _project(
        self, x: Tensor, keys: Tensor | None, values: Tensor | None, implementation: str
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, d_in) -> q (B, H, T, D); k, v (B, Hkv, S, D) from ``keys`` / ``values``
        (cross-attention) or x, by the declared projections, on ``implementation``'s path."""
        spec = self.spec
        keys = x if keys is None else keys
        values = x if values is None else values
        names = {p.role: p.name for p in spec.projections()}  # (one pass over the registry's list)
        if not names:
            # (B, T, C) -> (B, 1, T, C): one head, the inputs themselves
            return x.unsqueeze(1), keys.unsqueeze(1), values.unsqueeze(1)

        def project(role: str, inputs: Tensor, heads: int) -> Tensor:
            t = self._linear(getattr(self, names[role]), inputs, implementation)
            if spec.qk_norm is not None:
                t = self._normalise_qk(role, t)
            # (B, T, d_in) -> (B, T, heads * D) -> (B, heads, T, D)
            return self._split_heads(t, heads)

        kv_heads = spec.kv_heads
        return project("query", x, spec.num_heads), project("key", keys, kv_heads), project("value", values, kv_heads)

    def _normalise_qk(self, role: str, t: Tensor) -> Tensor:
        """qk-norm of projected queries or keys (B, T, heads * D), before attention (and
        before any position encoding): each head's D (``qk_norm_scope="head"``) or the
        whole width (``"all"``) normalised as Hugging Face does, in float32 (float64
        for float64), cast back, then times the weight (LayerNorm: plus the bias).  With
        ``qk_norm_offset`` (Gemma 3) the scale is ``offset + weight`` in that precision and
        the product is cast back once, as Gemma's RMSNorm.  Other roles pass through."""
        spec = self.spec
        norm = next((getattr(self, n) for n, r, _ in spec.qk_norms() if r == role), None)
        if norm is None:
            return t
        x = t.unflatten(-1, (-1, norm.weight.shape[0]))
        x = x.to(torch.promote_types(x.dtype, torch.float32))  # float32 at least: float64 stays
        if spec.qk_norm == "layer":
            x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.qk_norm_eps)
        if spec.qk_norm_offset:
            x = (x * (spec.qk_norm_offset + norm.weight.to(x.dtype))).to(t.dtype)
        else:
            x = x.to(t.dtype) * norm.weight
        if spec.qk_norm == "layer":
            x = x + norm.bias
        return x.flatten(-2)

    def _split_heads(self, t: Tensor, heads: int | None = None) -> Tensor:
        b, num_tokens, width = t.shape
        heads = self.spec.num_heads if heads is None else heads
        # (B, T, heads * D) -> (B, T, heads, D) -> (B, heads, T, D)
        return t.view(b, num_tokens, heads, width // heads).transpose(1, 2)

    def _merge(self, out: Tensor, implementation: str) -> Tensor:
        b, h, num_tokens, head_dim = out.shape
        # (B, H, T, D) -> (B, T, H, D) -> (B, T, H * D)
        out = out.transpose(1, 2).reshape(b, num_tokens, h * head_dim)
        out_proj = getattr(self, "out_proj", None)
        return out if out_proj is None else self._linear(out_proj, out, implementation)  # heads mixed
