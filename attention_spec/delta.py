"""The gated delta rule, once: what both twins' ``gated_delta_rule`` compute, and the checks
of its arguments (one text for both).

Linear attention keeps, per head, a state ``S`` of shape (Dk, Dv) in place of the keys and
values seen so far.  Token ``t`` (q_t, k_t of width Dk, v_t of width Dv, a log-space decay
``g_t`` <= 0 and a write strength ``beta_t``) updates it and reads it:

    S   <- exp(g_t) * S                 decay (KDA: one g per key channel, row c of S times exp(g_t[c]))
    u_t  = beta_t * (v_t - S^T k_t)     the delta: what S mispredicts for k_t, times beta_t
    S   <- S + k_t u_t^T                write the correction
    o_t  = S^T (scale * q_t)            read

(Gated DeltaNet, arXiv 2412.06464, eq. 10, transposed to (Dk, Dv) as transformers and
flash-linear-attention keep it; with one decay per key channel it is Kimi Linear's KDA).
``scale`` defaults to 1 / sqrt(Dk); ``qk_l2norm`` first divides each q_t and k_t by
sqrt(|x|^2 + 1e-6), as those libraries do inside their kernels.

Two forms compute it, the same numbers up to rounding:

  - ``"recurrent"``: the loop above, a token at a time (decoding: one step per token);
  - ``"chunked"`` (training): the sequence in chunks of C tokens; within a chunk the
    delta rule's C updates are one triangular solve (the UT transform of DeltaNet), the
    chunk's outputs two matrix products, and only the state crosses from chunk to chunk
    (a ``lax.scan`` in JAX: compile time independent of the length).  A length that is
    not a multiple of C is padded with tokens that write nothing (beta 0) and decay
    nothing (g 0), so the final state is exactly the last real token's.

Shapes, in the library's ``layout="bhsd"`` (heads before tokens): q and k (B, Hk, T, Dk),
v (B, H, T, Dv), ``g`` (B, H, T) (one decay per head and token) or (B, H, T, Dk) (KDA),
``beta`` (B, H, T), the state (B, H, Dk, Dv).  ``layout="bshd"`` takes tokens before
heads, as transformers' functions do: q (B, T, Hk, Dk), g (B, T, H) or (B, T, H, Dk),
beta (B, T, H); the state is (B, H, Dk, Dv) in both.  H must be a multiple of Hk:
value head h reads query/key head h // (H // Hk) (grouped value heads, as Qwen3-Next).
float16 and bfloat16 are computed in float32 and the output rounded once; the state
stays float32 (float64 inputs: float64 throughout).

The layers on it (``GatedDeltaNet``, ``KimiDeltaAttention`` in both twins' ``delta_net``)
are checked here too: their keywords (``check_delta_net_options``), their calls and caches
(``check_delta_net_call``, ``delta_cache_shapes``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from attention_spec.arrays import FLOAT_DTYPES, as_shape
from attention_spec.options import check_attention_layout, check_positive_int, check_scale

FORMS = ("chunked", "recurrent")
L2NORM_EPS = 1e-6
DEFAULT_CHUNK = 64


class DeltaShapes(NamedTuple):
    """A call's sizes, read in ``layout="bhsd"``; ``per_channel``: g has one decay per key
    channel (KDA)."""

    batch: int
    qk_heads: int
    heads: int
    length: int
    key_dim: int
    value_dim: int
    per_channel: bool


def _heads_first(shape: tuple[int, ...], layout: str, rank: int) -> tuple[int, ...]:
    """A shape given in ``layout`` as (B, H, T, ...)."""
    if layout == "bhsd" or len(shape) < 3:
        return shape
    return (shape[0], shape[2], shape[1], *shape[3:]) if rank >= 3 else shape


def check_gated_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, initial_state: Any,
                           dtypes: tuple[str, ...], *, layout: Any, form: Any, chunk_size: Any,
                           scale: Any) -> DeltaShapes:
    """Checks a ``gated_delta_rule`` call before any work: shapes (given in ``layout``),
    one floating dtype for q, k, v, g and beta (the state: any floating dtype), ``form``,
    ``chunk_size`` and ``scale``; returns the sizes.  ValueError for shapes and values,
    TypeError for dtypes and types, one text for both twins."""
    layout = check_attention_layout(layout)
    if not isinstance(form, str) or form not in FORMS:
        raise ValueError(f"form must be one of 'chunked', 'recurrent'; got {form!r}")
    check_positive_int("chunk_size", chunk_size)
    check_scale(scale)
    given = {"q": as_shape(q), "k": as_shape(k), "v": as_shape(v), "g": as_shape(g), "beta": as_shape(beta)}
    got = ", ".join(f"{name} {shape}" for name, shape in given.items())
    where = "" if layout == "bhsd" else " (read as (B, H, T, ...) from layout='bshd')"
    for name in ("q", "k", "v"):
        if len(given[name]) != 4:
            raise ValueError(f"gated_delta_rule takes q, k and v of rank 4 (batch, heads, tokens, width); got {got}")
    qs, ks, vs = (_heads_first(given[n], layout, 4) for n in ("q", "k", "v"))
    gs, bs = _heads_first(given["g"], layout, 3), _heads_first(given["beta"], layout, 3)
    if qs != ks:
        raise ValueError(f"q and k must have the same shape (B, Hk, T, Dk){where}; got {got}")
    batch, qk_heads, length, key_dim = ks
    if vs[0] != batch or vs[2] != length:
        raise ValueError(f"v must have q's batch and length{where}; got {got}")
    heads, value_dim = vs[1], vs[3]
    if heads % qk_heads:
        raise ValueError(f"v's heads must be a multiple of q and k's (grouped value heads){where}; got {got}")
    if length == 0 or key_dim == 0 or value_dim == 0:
        raise ValueError(f"gated_delta_rule takes no empty sequence or width; got {got}")
    if gs not in ((batch, heads, length), (batch, heads, length, key_dim)):
        raise ValueError(
            f"g must be (B, H, T) (a decay per head and token) or (B, H, T, Dk) (a decay per key channel, "
            f"KDA), H v's heads{where}; got {got}")
    if bs != (batch, heads, length):
        raise ValueError(f"beta must be (B, H, T), H v's heads{where}; got {got}")
    if len(set(dtypes[:5])) != 1 or dtypes[0] not in FLOAT_DTYPES:
        raise TypeError("q, k, v, g and beta must share one floating-point dtype; got " + ", ".join(dtypes[:5]))
    if initial_state is not None:
        state = as_shape(initial_state)
        if state != (batch, heads, key_dim, value_dim):
            raise ValueError(f"initial_state must be (B, H, Dk, Dv) = {(batch, heads, key_dim, value_dim)}; "
                             f"got {state}")
        if dtypes[5] not in FLOAT_DTYPES:
            raise TypeError(f"initial_state must be floating-point; got {dtypes[5]}")
    return DeltaShapes(batch, qk_heads, heads, length, key_dim, value_dim, len(gs) == 4)


def state_dtype(dtype: str) -> str:
    """The dtype the rule computes in and keeps its state in: float64 for float64, else
    float32."""
    return "float64" if dtype == "float64" else "float32"


# --------------------------------------------------------------------------- the layers

CACHE_FIELDS = ("conv", "state")


class DeltaNetGeometry(NamedTuple):
    """A linear-attention layer's sizes (``GatedDeltaNet``, ``KimiDeltaAttention``):
    ``qk_heads`` heads of width ``key_dim`` for q and k, ``heads`` of width ``value_dim``
    for v (a multiple of ``qk_heads``: grouped value heads), ``conv_channels`` the
    depthwise causal conv's channels (q, k and v concatenated), ``kernel`` its width."""

    d_in: int
    qk_heads: int
    key_dim: int
    heads: int
    value_dim: int
    kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.qk_heads * self.key_dim + self.heads * self.value_dim


def check_delta_net_options(d_in: Any, num_key_heads: Any, key_head_dim: Any, num_value_heads: Any,
                            value_head_dim: Any, conv_kernel_size: Any, chunk_size: Any,
                            norm_eps: Any) -> DeltaNetGeometry:
    """A linear-attention layer's constructor keywords, checked before anything is built;
    one text for both twins."""
    for name, value in (("d_in", d_in), ("num_key_heads", num_key_heads), ("key_head_dim", key_head_dim),
                        ("num_value_heads", num_value_heads), ("value_head_dim", value_head_dim),
                        ("conv_kernel_size", conv_kernel_size), ("chunk_size", chunk_size)):
        check_positive_int(name, value)
    if num_value_heads % num_key_heads:
        raise ValueError(f"num_value_heads must be a multiple of num_key_heads (grouped value heads); "
                         f"got {num_value_heads} and {num_key_heads}")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not (0 < norm_eps < float("inf")):
        raise ValueError(f"norm_eps must be a positive finite number; got {norm_eps!r}")
    return DeltaNetGeometry(d_in, num_key_heads, key_head_dim, num_value_heads, value_head_dim, conv_kernel_size)


def delta_cache_shapes(geometry: DeltaNetGeometry, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The cache's two arrays: ``conv`` (B, C, K - 1), the last K - 1 inputs of the
    causal conv per channel (transformers keeps (B, C, K), its first column never read),
    and ``state`` (B, H, Dk, Dv), the delta rule's."""
    return ((batch, geometry.conv_channels, geometry.kernel - 1),
            (batch, geometry.heads, geometry.key_dim, geometry.value_dim))


def check_delta_net_call(name: str, geometry: DeltaNetGeometry, x_shape: Any, x_dtype: str, compute: str,
                         padding_mask: Any, cache: Any) -> tuple[int, int]:
    """A linear-attention layer's call, before any work: x (B, T, d_in) in the module's
    compute dtype, ``padding_mask`` None or (B, T) bool / integer (True or nonzero = a
    real token), ``cache`` None or (``conv``, ``state``) as (shape, dtype name) pairs of
    ``delta_cache_shapes`` and the dtypes ``init_cache`` gives (conv: ``compute``; state:
    ``state_dtype(compute)``), or the string ``"not a DeltaCache"``.  Returns (B, T);
    ValueError (shapes, a wrong cache) or TypeError (dtypes), one text for both twins."""
    shape = as_shape(x_shape)
    if len(shape) != 3 or shape[2] != geometry.d_in or shape[1] == 0:
        raise ValueError(f"{name} takes x of shape (batch, tokens, d_in={geometry.d_in}), tokens >= 1; got {shape}")
    if x_dtype != compute:
        raise TypeError(f"{name} takes x in its compute dtype {compute}; got {x_dtype}")
    batch, length = shape[0], shape[1]
    if padding_mask is not None:
        mask_shape, mask_dtype = padding_mask
        if as_shape(mask_shape) != (batch, length):
            raise ValueError(f"padding_mask must be (B, T) = {(batch, length)} (True = a real token); "
                             f"got {as_shape(mask_shape)}")
        if mask_dtype != "bool" and not mask_dtype.startswith(("int", "uint")):
            raise TypeError(f"padding_mask must be bool or integer (True or 1 = a real token); got {mask_dtype}")
    if cache is not None:
        want = dict(zip(CACHE_FIELDS, delta_cache_shapes(geometry, batch), strict=True))
        kinds = {"conv": compute, "state": state_dtype(compute)}
        got = None if isinstance(cache, str) else dict(zip(CACHE_FIELDS, cache, strict=True))
        if got is None or any(got[f] != (want[f], kinds[f]) for f in CACHE_FIELDS):
            expected = ", ".join(f"{f} {want[f]} {kinds[f]}" for f in CACHE_FIELDS)
            found = cache if got is None else ", ".join(f"{f} {got[f][0]} {got[f][1]}" for f in CACHE_FIELDS)
            raise ValueError(f"{name}'s cache must be a DeltaCache from its init_cache(batch_size={batch}): "
                             f"{expected}; got {found}")
    return batch, length
