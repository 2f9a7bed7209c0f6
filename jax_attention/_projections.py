"""A module's projections: built as the registry declares them, initialised as PyTorch's
(``new_projection``); q, k and v from the inputs (``project``: clamped by ``clip_qkv``,
the output gate split from the queries, q and k through the ``"projected"`` transforms of
``_qk`` before the head split); the heads merged, gated and mixed by ``out_proj``
(``merge``); each product on the path of the call's ``implementation`` (``linear``:
``functional.project``).

Twin of ``torch_attention/_projections.py``.
"""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from attention_spec.registry import AttentionConfig, Projection
from jax_attention._linear import project as project_linear
from jax_attention._qk import normalise, rms, transform_projected

# --------------------------------------------------------------------------- construction


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


def dense(
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


def new_projection(spec: AttentionConfig, proj: Projection, *, dtype: Any, param_dtype: Any, precision: Any,
                   rngs: nnx.Rngs) -> nnx.Module | nnx.Param:
    """The projection ``proj`` of a module of ``spec``: a bare (d_in, d_out) matrix drawn
    N(0, 1) (``layout="matrix"``), else a ``dense`` layer (kernel (in, out)), partitioned
    for tensor parallelism."""
    width, fan_in = cast(int, spec.fan_out(proj.role)), cast(int, spec.fan_in(proj.role))
    if proj.layout == "matrix":  # N(0, 1), as torch.randn in seed 004
        return nnx.Param(draw(jax.random.normal, rngs.params(), (fan_in, width), param_dtype))
    # Tensor parallelism (Megatron): q/k/v split their output features (the heads) over
    # the "model" mesh axis, out_proj splits its input features and reduces over it.
    partitioning = ("model", None) if proj.role == "out" else (None, "model")
    return dense(
        fan_in, width, use_bias=proj.has_bias(spec), dtype=dtype, param_dtype=param_dtype,
        precision=precision, rngs=rngs, partitioning=partitioning,
    )


# --------------------------------------------------------------------------- the work


def linear(layer: nnx.Module | nnx.Param, inputs: Array, implementation: str, precision: Any) -> Array:
    """inputs @ a projection's weight (+ bias): an ``nnx.Linear``'s math, or a bare
    (d_in, d_out) matrix used as x @ W in x's dtype at ``precision`` (the module's);
    ``functional.project`` does the work, on the path that the call's
    ``implementation`` picks."""
    if isinstance(layer, nnx.Param):
        return project_linear(inputs, layer[...], dtype=inputs.dtype, precision=precision,
                              implementation=implementation)
    dense = cast(nnx.Linear, layer)
    return project_linear(
        inputs, dense.kernel[...], None if dense.bias is None else dense.bias[...], dtype=dense.dtype,
        precision=dense.precision, implementation=implementation,
    )


def project(module: Any, x: Array, keys: Array | None, values: Array | None,
            implementation: str) -> tuple[Array, Array, Array, Array | None]:
    """(B, T, d_in) -> q (B, H, T, D); k, v (B, Hkv, S, D) from ``keys`` / ``values``
    (cross-attention) or x, by the module's declared projections (its ``_linear``), on
    ``implementation``'s path: each clamped to [-clip_qkv, clip_qkv] (``clip``), after
    its bias; with ``output_gate``, W_query's gate split from its queries (``split_gate``:
    the fourth of the four, (B, T, H * D), for ``merge``; None without); q and k through
    its ``"projected"`` transforms (``_qk.transform_projected``: qk-norm) before the head
    split.  ``values_from_keys``: v is W_key's output (clamped) before those transforms;
    ``v_norm``: v through a weightless RMS norm per head (``_qk.rms``, ``qk_norm_eps``).
    ``kv_shared``: q alone (k and v None: the call's ``kv=`` are another layer's)."""
    spec = module.spec
    keys = x if keys is None else keys
    values = x if values is None else values
    if not spec.projections():
        # (B, T, C) -> (B, 1, T, C): one head, the inputs themselves
        return x[:, None], keys[:, None], values[:, None], None
    gate = projected_keys = None

    def one(role: str, inputs: Array, heads: int) -> Array:
        nonlocal gate, projected_keys
        if role == "value" and spec.values_from_keys:  # Gemma 4's attention_k_eq_v: no W_value
            y = cast(Array, projected_keys)
        else:
            y = module._linear(getattr(module, cast(Projection, spec.projection(role)).name), inputs, implementation)
            y = clip(y, spec.clip_qkv)
        if role == "query" and spec.output_gate:  # (B, T, H * (D + G)) -> queries, gate (B, T, H * G)
            y, gate = split_gate(y, heads, spec.gate_width())
        if role == "key":
            projected_keys = y
        if role != "value":
            y = transform_projected(module, role, y)
        elif spec.v_norm is not None:  # Gemma 4's v_norm: each value head, no weight
            y = rms(y, cast(int, spec.value_head_dim), spec.qk_norm_eps)
        if role == "value" and spec.v_scale is not None:  # MiMo-V2-Flash: the values times a constant
            y = y * spec.v_scale
        return split_heads(y, heads)  # (B, T, heads * D) -> (B, heads, T, D)

    if spec.kv_shared:  # no W_key / W_value: the call's kv= are another layer's (k and v None here)
        return one("query", x, spec.num_heads), cast(Array, None), cast(Array, None), gate
    kv_heads = spec.kv_heads
    q, k, v = one("query", x, spec.num_heads), one("key", keys, kv_heads), one("value", values, kv_heads)
    return q, k, v, gate


def split_heads(t: Array, heads: int) -> Array:
    b, num_tokens, width = t.shape
    # (B, T, heads * D) -> (B, T, heads, D) -> (B, heads, T, D)
    return t.reshape(b, num_tokens, heads, width // heads).transpose(0, 2, 1, 3)


def merge(module: Any, out: Array, implementation: str, gate: Array | None = None) -> Array:
    """Heads (B, H, T, Dv) -> (B, T, H * Dv), times the activated gate with ``output_gate``
    (``apply_gate``: the gate ``project`` split from this call's queries, (B, T, H * G)),
    through ``out_norm`` (an RMSNorm of the merged heads, BitNet's ``attn_sub_norm``) where it
    has one, mixed by the module's ``out_proj`` (its ``_linear``) where it has one."""
    spec = module.spec
    b, h, num_tokens, head_dim = out.shape
    # (B, H, T, D) -> (B, T, H, D) -> (B, T, H * D)
    out = out.transpose(0, 2, 1, 3).reshape(b, num_tokens, h * head_dim)
    if spec.output_gate:
        assert gate is not None, "a module with output_gate merges with the gate its project split"
        out = apply_gate(spec, out, gate, module.gate_bias[...] if spec.output_gate_bias else None)
    if spec.out_norm is not None:  # BitNet's attn_sub_norm: over the merged heads, with a weight
        out = normalise(out, module.out_norm.scale[...], spec.qk_norm_eps)
    out_proj = getattr(module, "out_proj", None)
    return out if out_proj is None else module._linear(out_proj, out, implementation)  # heads mixed


# --------------------------------------------------------------------------- clip_qkv, the output gate


def clip(t: Array, clip_qkv: float | None) -> Array:
    """t clamped to [-clip_qkv, clip_qkv] (OLMo's ``clip_qkv``), with PyTorch's
    ``clamp`` gradient: it passes where -c <= t <= c (the bounds included, where
    ``jnp.clip``'s gives 1/2) and is zero outside; unchanged for None."""
    if clip_qkv is None:
        return t
    return jnp.where((t >= -clip_qkv) & (t <= clip_qkv), t, jnp.clip(t, -clip_qkv, clip_qkv))


def split_gate(t: Array, heads: int, gate_width: int) -> tuple[Array, Array]:
    """W_query's output (B, T, heads * (D + G)) of a gated module -> queries (B, T, heads *
    D) and gate (B, T, heads * G): each head's features are its D queries, then its G gate
    features (G = D: Qwen3-Next's ``q_proj(x).view(B, T, H, 2D).chunk(2, -1)``; G = 1:
    ``output_gate_per_head``, one value a head)."""
    b, num_tokens, _ = t.shape
    per_head = t.reshape(b, num_tokens, heads, -1)  # (B, T, H, D + G)
    queries = per_head.shape[-1] - gate_width
    return per_head[..., :queries].reshape(b, num_tokens, -1), per_head[..., queries:].reshape(b, num_tokens, -1)


def softplus(t: Array) -> Array:
    """PyTorch's ``F.softplus`` (beta 1, threshold 20): t itself above 20, else
    ``log1p(exp(t))``, with its gradient (1 above 20, else ``exp(t) / (1 + exp(t))``)."""
    return jnp.where(t > 20.0, t, jnp.log1p(jnp.exp(jnp.minimum(t, 20.0))))


def apply_gate(spec: AttentionConfig, out: Array, gate: Array, bias: Array | None = None) -> Array:
    """The merged heads (B, T, H * D) times the activated gate (B, T, H * G): sigmoid(gate)
    in the gate's dtype (Qwen3-Next, AFMoE) or softplus(gate) in float32 at least, cast
    back (Laguna's ``F.softplus(g.float())``); G = 1 (``output_gate_per_head``) scales each
    head's D features by its one value.  ``bias`` (H,) (``output_gate_bias``, Beam's
    ``gate_bias``): each head's added to its G gate features first."""
    if bias is not None:
        b, num_tokens, width = gate.shape
        # (B, T, H, G) + (1, 1, H, 1) -> (B, T, H * G)
        gate = (gate.reshape(b, num_tokens, spec.num_heads, -1) + bias.astype(gate.dtype).reshape(1, 1, -1, 1)
                ).reshape(b, num_tokens, width)
    if spec.output_gate_activation == "softplus":
        activated = softplus(gate.astype(jnp.promote_types(gate.dtype, jnp.float32))).astype(out.dtype)
    else:
        activated = jax.nn.sigmoid(gate).astype(out.dtype)
    if not spec.output_gate_per_head:
        return out * activated
    b, num_tokens, width = out.shape
    # (B, T, H, D) * (B, T, H, 1) -> (B, T, H * D)
    return (out.reshape(b, num_tokens, spec.num_heads, -1) * activated[..., None]).reshape(b, num_tokens, width)


