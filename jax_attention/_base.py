"""What every Flax NNX attention module shares: the config built from the registry, the
projections it declares, input checks, the batch dimension, the dropout stream, the call
into ``functional``.  A variant's file only gives the constructor signature (the public
API) and docstring.

Twin of ``torch_attention/_base.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array

from attention_spec import dtype_name
from attention_spec.arrays import host_array
from attention_spec.cache import check_cache_context, check_cache_dtype, check_cacheable
from attention_spec.options import CallOptions, check_positive_int
from attention_spec.planning import CallOps, plan_call
from attention_spec.registry import AttentionConfig, Projection, make_config
from attention_spec.rope import check_module_positions
from jax_attention import functional
from jax_attention._cache import append_to_cache, check_room, fill_buckets, over_filled


def draw(sample: Any, key: Array, shape: tuple[int, ...], dtype: Any, *args: Any) -> Array:
    """``sample(key, shape, dtype, *args)`` (``jax.random.uniform``, ``normal``): the same
    numbers, drawn over a flat length rounded up to a power of two and cut to ``shape``.
    Under the default PRNG (threefry, partitionable: jax's default) each number is a
    function of its flat index alone, so the cut is the draw of ``shape`` itself (a test
    holds it), and XLA compiles one program per power of two instead of one per shape
    (0.4-1.0 s each on a CPU: a model's first construction paid it for every new width).
    Any other key or PRNG setting draws ``shape`` directly."""
    if str(jax.random.key_impl(key)) != "threefry2x32" or not getattr(jax.config, "jax_threefry_partitionable", False):
        return sample(key, shape, dtype, *args)
    size = math.prod(shape)
    return sample(key, (1 << max(size - 1, 0).bit_length(),), dtype, *args)[:size].reshape(shape)


def torch_linear_init(fan_in: int) -> Any:
    """PyTorch's ``nn.Linear`` default for kernel and bias: uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key: Array, shape: Any, dtype: Any = jnp.float32) -> Array:
        return draw(jax.random.uniform, key, tuple(shape), dtype, -bound, bound)

    return init


def linear(
    d_in: int,
    d_out: int,
    *,
    use_bias: bool,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    precision: Any,
    rngs: nnx.Rngs,
    partitioning: tuple[str | None, str | None] | None = None,
) -> nnx.Linear:
    """An ``nnx.Linear`` initialised as PyTorch's ``nn.Linear`` (kernel (in, out)),
    parameters stored in ``param_dtype``, computing in ``dtype`` (None: the parameters').

    ``partitioning``: mesh axis names for the kernel's (in, out) dimensions, attached with
    ``nnx.with_partitioning`` (the bias takes the out name).  Metadata only: the values
    are unchanged and nothing is sharded at creation (``eager_sharding=False``: a module
    is built the same with or without a mesh in context, whatever its axes); a user's
    mesh shards the parameters by ``nnx.get_partition_spec`` under ``jax.jit``."""
    init = torch_linear_init(d_in)
    kernel_init, bias_init = init, init
    if partitioning is not None:
        kernel_init = nnx.with_partitioning(init, partitioning, eager_sharding=False)
        bias_init = nnx.with_partitioning(init, (partitioning[1],), eager_sharding=False)
    return nnx.Linear(
        d_in, d_out, use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init,
        dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs,
    )


class _Call(NamedTuple):
    """One call's inputs after every check, batched and canonical."""

    x: Array  # (B, T, d_in)
    mask: Array | None  # bool, rank 4, broadcastable to (B, H, T, S)
    dropout_mask: Array | None  # bool, broadcastable to (B, H, T, S)
    kv_lengths: Array | None  # int (B,): valid keys (with a cache: valid tokens of x)
    implementation: str
    batched: bool
    deterministic: bool
    bias: Array | None = None  # float, rank 4, broadcastable to (B, H, T, S)
    keys: Array | None = None  # (B, S, kdim): cross-attention's key input (None: x)
    values: Array | None = None  # (B, S, vdim): its value input (None: x)
    segment_ids: Array | None = None  # int (B, T)
    kv_segment_ids: Array | None = None  # int (B, S)
    cache: Any = None  # functional.KVCache
    positions: Array | None = None  # int (B, T) or (1, T): rope's positions (None: the default)


_FROM_CALL: Any = object()  # (the call's own kv_lengths)

# The array work that planning a call asks of this twin.
_OPS = CallOps(
    canonical_mask=functional.canonical_mask,
    canonical_bias=functional.canonical_bias,
    canonical_kv_lengths=functional.canonical_kv_lengths,
    as_array=jnp.asarray,
    cache_fields=functional.cache_fields,
    check_cache_room=check_room,  # eager only: a compiled step records an overflow in the cache
    fused_draws_dropout=functional.FUSED_DRAWS_DROPOUT,
    # the library's CPU kernel takes sinks; jax.nn.dot_product_attention does not
    fused_takes_sinks=lambda: jax.default_backend() == "cpu",
)


# Bytes of keys and values above which a one-token cached step attends example by example
# (``_run_cached``): XLA on CPU allocates a call's temporaries afresh on every call, and
# past about 32 MiB (glibc's largest reuse) that cost more than the step; measured at
# batch 8, 2 key/value heads of 64, 4096 positions: 1.4 ms a step against 0.3.
_DECODE_BYTES = 8 << 20


def _first_keys(call: _Call, n: int, max_len: int) -> _Call:
    """A cached call whose key-axis inputs (mask, bias, dropout mask: (..., max_len);
    kv_segment_ids (B, max_len)) are cut to the cache's first n positions."""
    def cut(t: Array | None) -> Array | None:
        return t if t is None or t.shape[-1] != max_len else t[..., :n]

    return call._replace(mask=cut(call.mask), bias=cut(call.bias), dropout_mask=cut(call.dropout_mask),
                         kv_segment_ids=cut(call.kv_segment_ids))


def _unless(ok: Array, t: Array) -> Array:
    """t, or NaN where a compiled cached step ran past max_len (``ok`` False)."""
    return jnp.where(ok, t, jnp.asarray(jnp.nan, t.dtype))


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
            setattr(self, proj.name, self._projection(proj, cast(nnx.Rngs, rngs)) if proj.exists(spec) else None)
        for name, _, width in spec.qk_norms():  # scale ones (and bias zeros), as PyTorch's
            norm = nnx.RMSNorm if spec.qk_norm == "rms" else nnx.LayerNorm
            setattr(self, name, norm(width, epsilon=spec.qk_norm_eps, dtype=dtype, param_dtype=param_dtype,
                                     rngs=cast(nnx.Rngs, rngs)))
            if spec.qk_norm_offset:  # the scale offset + weight starts at 1, as the PyTorch twin's
                norm_ = getattr(self, name)
                norm_.scale[...] = jnp.full_like(norm_.scale[...], 1.0 - spec.qk_norm_offset)
        if spec.sinks:  # zeros: each head starts with a sink of logit 0, as the PyTorch twin
            self.sinks = nnx.Param(jnp.zeros((spec.num_heads,), param_dtype))
        if spec.has_dropout and spec.declaration.heads != "wrapper":  # a wrapper's heads drop
            # Rate 0 never draws: no 'dropout' stream is taken, so the module initialises
            # from a params key alone (nnx.bridge.to_linen(...).init), as nnx.MultiHeadAttention.
            self.dropout = nnx.Dropout(spec.dropout, rngs=rngs if spec.dropout > 0.0 else None)

    def _projection(self, proj: Projection, rngs: nnx.Rngs) -> nnx.Module | nnx.Param:
        spec = self.spec
        width, fan_in = cast(int, spec.fan_out(proj.role)), cast(int, spec.fan_in(proj.role))
        if proj.layout == "matrix":  # N(0, 1), as torch.randn in seed 004
            return nnx.Param(draw(jax.random.normal, rngs.params(), (fan_in, width), self.param_dtype))
        # Tensor parallelism (Megatron): q/k/v split their output features (the heads) over
        # the "model" mesh axis, out_proj splits its input features and reduces over it.
        partitioning = ("model", None) if proj.role == "out" else (None, "model")
        return linear(
            fan_in, width, use_bias=proj.has_bias(spec), dtype=self.dtype, param_dtype=self.param_dtype,
            precision=self.precision, rngs=rngs, partitioning=partitioning,
        )

    # ------------------------------------------------------------------ the options

    @property
    def config(self) -> dict[str, Any]:
        """The constructor keywords this module was built with (not dtype/param_dtype/
        precision/rngs)."""
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

    def _dropout_key(self, rngs: Any) -> Array | None:
        """A key from the call's ``rngs`` (Rngs, RngStream or key), else the module's stream."""
        dropout: Any = getattr(self, "dropout")  # noqa: B009 (a dropout variant has one)
        if isinstance(rngs, nnx.Rngs):
            return rngs[dropout.rng_collection]()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        if rngs is not None:
            return rngs
        return None if dropout.rngs is None else dropout.rngs()

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
        """
        call = self._prepare(x, mask, dropout_mask, deterministic, kv_lengths, implementation, bias,
                             context=context, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                             cache=cache, return_weights=return_weights, positions=positions)
        key = self._draw_key(call, rngs, return_weights)  # after every check: it advances a stream
        if call.cache is not None:
            return self._run_cached(call, return_weights, key)
        return self._unbatch(self._run(call, return_weights, key), call.batched)

    def init_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> functional.KVCache:
        """An empty KV cache for decoding up to ``max_len`` positions of ``batch_size``
        examples, (batch_size, kv_heads, max_len, head_dim) for keys and values: zeros in ``dtype`` (floating point; None: the module's compute dtype).
        Raises TypeError for a dtype that is not floating point, ValueError for ``max_len``
        beyond the module's ``context_length``."""
        spec = self.spec
        check_cacheable(spec)
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_len", max_len)
        check_cache_context(max_len, spec.context_length)
        dtype = jnp.dtype(self._compute_dtype() if dtype is None else dtype)
        check_cache_dtype(dtype_name(dtype))
        shape = (batch_size, spec.kv_heads, max_len)
        return functional.KVCache(
            jnp.zeros((*shape, cast(int, spec.head_dim)), dtype),
            jnp.zeros((*shape, cast(int, spec.head_dim)), dtype),
            jnp.zeros((batch_size,), jnp.int32),
            jnp.zeros((2,), jnp.int32),
        )

    def _prepare(
        self,
        x: Array,
        mask: Any,
        dropout_mask: Array | None,
        deterministic: bool | None,
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
        """Every check of one call (``plan_call``), before any work (and before any random
        draw); the inputs batched and canonical."""
        deterministic = self._deterministic(deterministic)
        plan = plan_call(
            self.spec, _OPS, x, compute_dtype=self._compute_dtype(), training=not deterministic,
            implementation=implementation, context=context, mask=mask, bias=bias, dropout_mask=dropout_mask,
            kv_lengths=kv_lengths, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, cache=cache,
            return_weights=return_weights,
        )
        positions = self._check_positions(positions, x, context)
        keys, values, mask, bias = plan.keys, plan.values, plan.mask, plan.bias
        if not plan.batched:  # (T, C) -> (1, T, C); masks broadcast from the right
            x = x[None]
            keys, values, mask, bias, positions = (
                t if t is None else t[None] for t in (keys, values, mask, bias, positions))
        return _Call(x, mask, dropout_mask, plan.kv_lengths, plan.implementation, plan.batched, deterministic,
                     bias, keys, values, plan.segment_ids, plan.kv_segment_ids, cache, positions)

    # ------------------------------------------------------------------ rotary positions

    def _check_positions(self, positions: Any, x: Array, context: Any) -> Array | None:
        """A call's ``positions=`` checked (``check_module_positions``; a list or NumPy
        array as given, before JAX's conversion changes its dtype), as an array."""
        if positions is not None and not isinstance(positions, jax.Array):
            positions = host_array("rope positions", positions)
        shape = None if positions is None else tuple(positions.shape)
        dtype = None if positions is None else dtype_name(positions.dtype)
        check_module_positions(self.spec.rope is not None, shape, dtype, tuple(x.shape), context=context is not None)
        return None if positions is None else jnp.asarray(positions)

    def _rotate(self, q: Array, k: Array, positions: Array | None, start: Array | None = None) -> tuple[Array, Array]:
        """q and k turned by rope at ``positions`` (None: ``start`` + 0..T-1, start 0
        without a cache: constants); unchanged for a module without rope."""
        rope = self.spec.rope
        if rope is None:
            return q, k
        at: Any = positions
        if at is None:
            steps = np.arange(q.shape[2])[None]
            at = steps if start is None else start[:, None] + jnp.asarray(steps, start.dtype)
        return functional.apply_rope(q, at, rope), functional.apply_rope(k, at, rope)

    def _draws(self, call: _Call) -> bool:
        return not call.deterministic and self.spec.dropout > 0.0 and call.dropout_mask is None

    def _draw_key(self, call: _Call, rngs: Any, return_weights: bool) -> Array | None:
        if not self._draws(call):
            return None
        if call.implementation not in ("auto", "reference"):
            # An explicit path may refuse the options (functional's choice, e.g. a path that
            # cannot draw dropout): ask it on abstract values, before the stream advances.
            run = self._run_cached if call.cache is not None else self._run
            jax.eval_shape(lambda x, key: run(call._replace(x=x), return_weights, key),
                           call.x, jax.random.key(0))
        return self._dropout_key(rngs)

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
        the module's causal, kv_lengths, alignment and scale, and add a q_offset."""
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
            training=not call.deterministic,
            return_weights=return_weights,
            implementation=call.implementation,
        )
        return functional.assemble(
            tuple(q.shape), k.shape[-2], q.dtype, options, mask=call.mask, bias=call.bias,
            kv_lengths=call.kv_lengths if kv_lengths is _FROM_CALL else kv_lengths, dropout_mask=call.dropout_mask,
            q_offset=q_offset, segment_ids=call.segment_ids, kv_segment_ids=call.kv_segment_ids,
            sinks=self.sinks[...] if spec.sinks else None,
        )

    def _run(self, call: _Call, return_weights: bool, key: Array | None) -> Array | tuple[Array, Array]:
        """The work, on checked input: project, attend, merge.  Batched in and out."""
        # q (B, H, T, D), k and v (B, Hkv, S, D)
        q, k, v = self._project(call.x, call.keys, call.values, call.implementation)
        q, k = self._rotate(q, k, call.positions)
        result = self._attend(call, q, k, v, return_weights, key)
        if return_weights:
            out, weights = cast(tuple[Array, Array], result)
            return self._merge(out, call.implementation), weights  # (B, H, T, Dv) -> (B, T, d_out)
        return self._merge(cast(Array, result), call.implementation)

    def _run_cached(self, call: _Call, return_weights: bool, key: Array | None) -> Any:
        """A decode step: x's keys and values appended to (a new) cache, then x attends to
        every filled position, query t of example b at key position lengths[b] + t, over
        the cache's first positions up to the fullest fill (``_over_filled``), or over the
        whole cache on a kernel that reads no key past a length (``_reads_to_lengths``).  A step
        that runs past max_len (possible only under jit) writes nothing and returns NaN
        outputs and the cache with its overflow record (``append_to_cache``)."""
        folded = self._folds(call, return_weights)
        q, k, v = self._project(call.x, None, None, call.implementation)
        start = call.cache.lengths
        q, k = self._rotate(q, k, call.positions, start)
        cache, ok = append_to_cache(call.cache, k, v, self._new_lengths(call))
        filled = cache.lengths  # after the write (the same as before on an overflow)
        if folded:  # one token: its queries of a key/value head as rows, no causal mask (below)
            shape, q = q.shape, q.reshape(q.shape[0], self.spec.kv_heads, -1, q.shape[-1])
            where: dict[str, Any] = {"causal": False}
        else:
            where = {"q_offset": start, "alignment": "top_left"}

        # On a kernel that reads no key past a length, the whole cache as it lies
        whole = not return_weights and not self._draws(call) and self._reads_to_lengths(
            call, q, cache, kv_lengths=filled, **where)

        def attend(c: _Call, n: int) -> Any:
            def one(q: Array, keys: Array, values: Array, filled: Array) -> Any:
                keys, values = keys[:, :, :n].astype(q.dtype), values[:, :, :n].astype(q.dtype)
                return self._attend(c, q, keys, values, return_weights, key, kv_lengths=filled, **where)

            operands = (q, cache.key, cache.value, filled)
            if whole or not folded or q.shape[0] == 1 or 2 * cache.key[:, :, :n].nbytes <= _DECODE_BYTES:
                return one(*operands)
            # a long bucket, example by example: each call's temporaries stay small
            return jax.lax.map(lambda o: one(*(t[None] for t in o))[0], operands)

        result = self._over_filled(call, attend, filled, int(cache.key.shape[2]), return_weights or whole)
        if folded:
            result = result.reshape(*shape[:3], -1)
        if return_weights:
            out, weights = cast(tuple[Array, Array], result)
            return _unless(ok, self._merge(out, call.implementation)), _unless(ok, weights), cache
        return _unless(ok, self._merge(cast(Array, result), call.implementation)), cache

    def _folds(self, call: _Call, return_weights: bool) -> bool:
        """Whether a cached step attends as one token: T = 1, without a window, sinks, dense
        mask, bias, segment ids, dropout or returned weights.  Its queries of each
        key/value head become the rows of one query block (B, Hkv, H / Hkv, D): no path
        repeats the cache's keys and values per query head (a copy of the cache each
        step).  The causal mask is dropped: the token sits at its example's fill, so the
        keys it may see are exactly the ``kv_lengths`` (the fill after the write) that
        every row keeps, whatever the path.  (On CPU, ``"auto"`` then runs the CPU
        kernel's forward for few rows over the whole cache as it lies, as
        ``functional.route`` says of so few query rows (the explicit math where auto
        passes the kernel by), and XLA's dot for the projections of so few tokens:
        ``functional.FEW_QUERY_ROWS``, ``_linear.FEW_ROWS``.)"""
        spec = self.spec
        return (call.x.shape[1] == 1 and spec.window is None and not spec.sinks and not return_weights
                and not self._draws(call)
                and all(t is None for t in (call.mask, call.bias, call.dropout_mask, call.segment_ids,
                                            call.kv_segment_ids)))

    @staticmethod
    def _new_lengths(call: _Call) -> Array:
        """The valid tokens of a cached call's x per example (B,): its ``kv_lengths``, else T."""
        if call.kv_lengths is not None:
            return call.kv_lengths
        return jnp.full((call.x.shape[0],), call.x.shape[1], jnp.int32)

    def _reads_to_lengths(self, call: _Call, q: Array, cache: functional.KVCache, **extra: Any) -> bool:
        """Whether a cached step's attention over the whole cache (``extra``: the step's
        keywords) runs on a kernel that reads no key past ``kv_lengths``
        (``functional.READS_TO_LENGTHS``: on CPU, the kernel's forward for few rows), so
        that it costs what the filled positions cost without buckets (``_over_filled``).
        Asked of ``functional.route``, on shapes."""
        keys, values = (jax.ShapeDtypeStruct(t.shape, q.dtype) for t in (cache.key, cache.value))
        chosen = functional.route_of(q, keys, values, self._attention(call, q, keys, False, **extra))
        return chosen.kernel in functional.READS_TO_LENGTHS

    def _over_filled(self, call: _Call, attend: Any, filled: Array, max_len: int, whole: bool) -> Any:
        """``attend(call, n)`` over the cache's first n positions, n the smallest of
        ``fill_buckets(max_len)`` that holds the fullest fill (``over_filled``; known
        eagerly, a ``lax.switch`` under jit), the call's key-axis inputs cut to n.  Over
        all ``max_len`` positions where the result's shape or draw depends on it (the
        returned weights (B, H, T, max_len), and dropout drawn from a key) and where
        ``whole`` says so (a kernel that reads no key past a length,
        ``_reads_to_lengths``)."""
        if whole or self._draws(call):
            return attend(call, max_len)
        return over_filled(lambda n: attend(_first_keys(call, n, max_len), n), jnp.max(filled), max_len,
                           fill_buckets(max_len))

    @staticmethod
    def _unbatch(result: Array | tuple[Array, Array], batched: bool) -> Array | tuple[Array, Array]:
        if batched:
            return result
        if isinstance(result, tuple):
            return result[0][0], result[1][0]
        return result[0]

    def _linear(self, layer: nnx.Module | nnx.Param, inputs: Array, implementation: str) -> Array:
        """inputs @ a projection's weight (+ bias): an ``nnx.Linear``'s math, or a bare
        (d_in, d_out) matrix used as x @ W in x's dtype; ``functional.project`` does the
        work, on the path that the call's ``implementation`` picks."""
        if isinstance(layer, nnx.Param):
            return functional.project(inputs, layer[...], dtype=inputs.dtype, precision=self.precision,
                                     implementation=implementation)
        linear = cast(nnx.Linear, layer)
        return functional.project(
            inputs, linear.kernel[...], None if linear.bias is None else linear.bias[...], dtype=linear.dtype,
            precision=linear.precision, implementation=implementation,
        )

    def _project(
        self, x: Array, keys: Array | None, values: Array | None, implementation: str
    ) -> tuple[Array, Array, Array]:
        """(B, T, d_in) -> q (B, H, T, D); k, v (B, Hkv, S, D) from ``keys`` / ``values``
        (cross-attention) or x, by the declared projections, on ``implementation``'s path."""
        spec = self.spec
        keys = x if keys is None else keys
        values = x if values is None else values
        if not spec.projections():
            # (B, T, C) -> (B, 1, T, C): one head, the inputs themselves
            return x[:, None], keys[:, None], values[:, None]

        def project(role: str, inputs: Array, heads: int) -> Array:
            layer = getattr(self, cast(Projection, spec.projection(role)).name)
            y = self._normalise_qk(role, self._linear(layer, inputs, implementation))
            return self._split_heads(y, heads)  # (B, T, heads * D) -> (B, heads, T, D)

        kv_heads = spec.kv_heads
        return project("query", x, spec.num_heads), project("key", keys, kv_heads), project("value", values, kv_heads)

    def _normalise_qk(self, role: str, t: Array) -> Array:
        """qk-norm of projected queries or keys (B, T, heads * D), before attention (and
        before any position encoding): each head's D (``qk_norm_scope="head"``) or the
        whole width (``"all"``) normalised as Hugging Face does, in float32 (float64
        for float64), cast back, then times the scale (LayerNorm: plus the bias).  With
        ``qk_norm_offset`` (Gemma 3) the scale is ``offset + scale`` in that precision and
        the product is cast back once, as Gemma's RMSNorm.  Other roles pass through."""
        spec = self.spec
        norm = next((getattr(self, n) for n, r, _ in spec.qk_norms() if r == role), None)
        if norm is None:
            return t
        scale = norm.scale[...].reshape((1,) * t.ndim + (-1,))  # explicit rank: no implicit promotion
        x = t.reshape(*t.shape[:-1], -1, scale.shape[-1])
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # float32 at least: float64 stays
        if spec.qk_norm == "layer":
            x = x - x.mean(-1, keepdims=True)
        x = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + spec.qk_norm_eps)
        if spec.qk_norm_offset:
            x = (x * (spec.qk_norm_offset + scale.astype(x.dtype))).astype(t.dtype)
        else:
            x = x.astype(t.dtype) * scale.astype(t.dtype)
        if spec.qk_norm == "layer":
            x = x + norm.bias[...].reshape(scale.shape).astype(t.dtype)
        return x.reshape(t.shape)

    def _split_heads(self, t: Array, heads: int | None = None) -> Array:
        b, num_tokens, width = t.shape
        heads = self.spec.num_heads if heads is None else heads
        # (B, T, heads * D) -> (B, T, heads, D) -> (B, heads, T, D)
        return t.reshape(b, num_tokens, heads, width // heads).transpose(0, 2, 1, 3)

    def _merge(self, out: Array, implementation: str) -> Array:
        b, h, num_tokens, head_dim = out.shape
        # (B, H, T, D) -> (B, T, H, D) -> (B, T, H * D)
        out = out.transpose(0, 2, 1, 3).reshape(b, num_tokens, h * head_dim)
        out_proj = getattr(self, "out_proj", None)
        return out if out_proj is None else self._linear(out_proj, out, implementation)  # heads mixed
