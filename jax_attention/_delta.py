"""The gated delta rule (and KDA) for JAX: ``gated_delta_rule``, re-exported by
``functional``; what it computes is ``attention_spec.delta``'s docstring, its twin is
``torch_attention/_delta.py`` and its float64 oracle ``parity_tests.reference_delta``.

Both forms are a ``lax.scan``: over tokens (``"recurrent"``) or over chunks of C tokens
(``"chunked"``), so a program's size does not grow with the length.  Inside a chunk
(i, j the chunk's tokens, G the cumulative sum of g from the chunk's start, D[i, j] =
exp(G_i - G_j) for j <= i and 0 above; per key channel for KDA):

    T       = I + strictly_lower((beta_i k_i) . k_j * D[i, j])     the chunk's updates, coupled
    U, W    = T^-1 (beta v), T^-1 (beta k exp(G))                   T^-1 formed once per chunk
    V'      = U - W S = T^-1 (beta v - (beta k exp(G)) S)           the deltas, given the entering S
    O       = (q exp(G)) S + ((q_i . k_j) * D[i, j]) V'             the chunk's outputs
    S      <- exp(G_last) S + (k exp(G_last - G))^T V'              the state leaving the chunk

the form of transformers' ``torch_chunk_gated_delta_rule`` and flash-linear-attention.  Every
chunk's D, its two matrices and T^-1 (a blocked inverse, not XLA's CPU triangular_solve) are
computed for all chunks at once before the scan; the scan carries only S.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax

from attention_spec.arrays import dtype_name
from attention_spec.delta import DEFAULT_CHUNK, L2NORM_EPS, check_gated_delta_rule, state_dtype

HIGHEST = lax.Precision.HIGHEST


def _dot(spec: str, *operands: Array) -> Array:
    return jnp.einsum(spec, *operands, precision=HIGHEST)


def gated_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, *, initial_state: Array | None = None,
                     scale: float | None = None, qk_l2norm: bool = False, form: str = "chunked",
                     chunk_size: int = DEFAULT_CHUNK, layout: str = "bhsd") -> tuple[Array, Array]:
    """The gated delta rule (``attention_spec.delta``): q, k (B, Hk, T, Dk), v (B, H, T, Dv),
    ``g`` (B, H, T) or, for KDA, (B, H, T, Dk) (log-space decays, <= 0), ``beta`` (B, H, T),
    ``initial_state`` (B, H, Dk, Dv) (None: zeros); tokens before heads with
    ``layout="bshd"``.  Returns (out in v's layout and dtype, the final state (B, H, Dk, Dv)
    in float32, or float64 for float64 inputs).

    ``form``: ``"chunked"`` (chunks of ``chunk_size`` tokens, for training) or
    ``"recurrent"`` (a token at a time, for decoding), the same numbers up to rounding.
    ``scale``: None is 1/sqrt(Dk).  ``qk_l2norm``: q and k divided by their L2 norm
    (eps 1e-6) first.  jit-compatible; the options are static."""
    dtypes = tuple(dtype_name(x.dtype) for x in (q, k, v, g, beta))
    dtypes += (dtype_name(initial_state.dtype),) if initial_state is not None else ()
    shapes = check_gated_delta_rule(q.shape, k.shape, v.shape, g.shape, beta.shape,
                                    None if initial_state is None else initial_state.shape, dtypes,
                                    layout=layout, form=form, chunk_size=chunk_size, scale=scale)
    compute = jnp.dtype(state_dtype(dtypes[0]))
    if layout == "bshd":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        g, beta = jnp.swapaxes(g, 1, 2), jnp.swapaxes(beta, 1, 2)
    q, k, v, g, beta = (x.astype(compute) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = (x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS) for x in (q, k))
    group = shapes.heads // shapes.qk_heads
    if group > 1:
        q, k = jnp.repeat(q, group, axis=1), jnp.repeat(k, group, axis=1)
    q = q * (shapes.key_dim ** -0.5 if scale is None else float(scale))
    state = (jnp.zeros((shapes.batch, shapes.heads, shapes.key_dim, shapes.value_dim), compute)
             if initial_state is None else initial_state.astype(compute))
    run = _recurrent if form == "recurrent" else _chunked
    out, state = run(q, k, v, g, beta, state, chunk_size)
    out = out.astype(dtypes[2])
    return (jnp.swapaxes(out, 1, 2) if layout == "bshd" else out), state


def _recurrent(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, _: int) -> tuple[Array, Array]:
    per_channel = g.ndim == 4

    def step(s: Array, token: tuple[Array, ...]) -> tuple[Array, Array]:
        q_t, k_t, v_t, g_t, b_t = token  # (B, H, Dk), (B, H, Dk), (B, H, Dv), (B, H[, Dk]), (B, H)
        s = s * (jnp.exp(g_t)[..., :, None] if per_channel else jnp.exp(g_t)[..., None, None])
        u = b_t[..., None] * (v_t - _dot("bhkv,bhk->bhv", s, k_t))
        s = s + k_t[..., :, None] * u[..., None, :]
        return s, _dot("bhkv,bhk->bhv", s, q_t)

    tokens = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
    state, out = lax.scan(step, state, tokens)
    return jnp.moveaxis(out, 0, 2), state


def _rows_inverse(lower: Array) -> Array:
    """(I + L)^-1 by forward substitution, a row at a time: row i = e_i - L[i] (I + L)^-1,
    the rows above it already final."""
    size = lower.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(size, dtype=lower.dtype), lower.shape)

    def row(i: Array, x: Array) -> Array:
        new = -_dot("...j,...jc->...c", lax.dynamic_index_in_dim(lower, i, axis=-2, keepdims=False), x)
        new = new + (jnp.arange(size) == i).astype(x.dtype).reshape((1,) * (x.ndim - 2) + (size,))
        return lax.dynamic_update_index_in_dim(x, new, i, axis=-2)

    return lax.fori_loop(1, size, row, eye)


def _blocked_inverse(lower: Array) -> Array:
    """(I + L)^-1 by halves: [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]], the
    halves' inverses in one batch, down to blocks of at most 16 rows (forward substitution)."""
    size = lower.shape[-1]
    if size <= 16:
        return _rows_inverse(lower)
    half = size // 2
    a, c, b = lower[..., :half, :half], lower[..., half:, :half], lower[..., half:, half:]
    if size % 2 == 0:
        a_inv, b_inv = _blocked_inverse(jnp.stack([a, b]))
    else:
        a_inv, b_inv = _blocked_inverse(a), _blocked_inverse(b)
    top = jnp.concatenate([a_inv, jnp.zeros(a.shape[:-1] + (size - half,), a.dtype)], axis=-1)
    bottom = jnp.concatenate([-_dot("...ij,...jk,...kl->...il", b_inv, c, a_inv), b_inv], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


@jax.custom_jvp
def _unit_lower_inverse(lower: Array) -> Array:
    """(I + L)^-1 for a strictly lower-triangular L (..., C, C), to be used by matmuls: XLA's
    CPU triangular_solve is a LAPACK call per matrix and slower.  Differentiated as
    -(I + L)^-1 dL (I + L)^-1, not through the loop."""
    return _blocked_inverse(lower)


@_unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    x = _unit_lower_inverse(primals[0])
    return x, -_dot("...ij,...jk,...kl->...il", x, tangents[0], x)


def _chunked(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, size: int) -> tuple[Array, Array]:
    per_channel = g.ndim == 4
    length = q.shape[2]
    pad = -length % size

    def chunks(x: Array) -> Array:  # (B, H, T, ...) -> (B, H, N, C, ...), padded with zeros
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(*x.shape[:2], -1, size, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    lower = jnp.tril(jnp.ones((size, size), bool))[None, None, None]  # j <= i, (1, 1, 1, C, C)
    strict = jnp.tril(jnp.ones((size, size), bool), -1)[None, None, None]  # j < i
    # What does not depend on the state, for every chunk at once (batched over B, H, N): the
    # decays, the chunk's matrices and T^-1; the scan carries only the state.
    cum = jnp.cumsum(g, axis=3)  # (B, H, N, C[, Dk])
    last = cum[:, :, :, -1:]  # (B, H, N, 1[, Dk])
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    if per_channel:  # D (C, C, Dk) per chunk: a decay per key channel, a chunk at a time
        mask = lower[0, ..., None]  # (1, 1, C, C, 1)

        def matrices(chunk: tuple[Array, Array, Array, Array]) -> tuple[Array, Array]:
            q_c, k_c, kb_c, cum_c = chunk  # (B, H, C, Dk)
            diff = cum_c[:, :, :, None, :] - cum_c[:, :, None, :, :]
            decay = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
            return (_dot("bhic,bhjc,bhijc->bhij", kb_c, k_c, decay), _dot("bhic,bhjc,bhijc->bhij", q_c, k_c, decay))

        coupling, within = lax.map(matrices, tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, k_beta, cum)))
        coupling, within = jnp.moveaxis(coupling, 0, 2), jnp.moveaxis(within, 0, 2)
        grown, leaving, kept = jnp.exp(cum), jnp.exp(last - cum), jnp.exp(last)[:, :, :, 0, :, None]
    else:  # D (B, H, N, C, C)
        diff = cum[..., :, None] - cum[..., None, :]
        decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
        coupling = _dot("bhnic,bhnjc->bhnij", k_beta, k) * decay
        within = _dot("bhnic,bhnjc->bhnij", q, k) * decay
        grown, leaving, kept = jnp.exp(cum)[..., None], jnp.exp(last - cum)[..., None], jnp.exp(last)[..., None]
    inverse = _unit_lower_inverse(jnp.where(strict, coupling, 0.0))  # T^-1, (B, H, N, C, C)
    # what meets the entering state S: (k beta exp(G)) S (W S = T^-1 of it) and (q exp(G)) S
    projected = jnp.concatenate([k_beta * grown, q * grown], axis=3)  # (B, H, N, 2C, Dk)
    k_leaving = k * leaving

    def step(s: Array, chunk: tuple[Array, ...]) -> tuple[Array, Array]:
        proj_c, v_c, inverse_c, within_c, k_c, kept_c = chunk  # the chunk's (B, H, ...); kept (B, H, 1|Dk, 1)
        met = _dot("bhck,bhkv->bhcv", proj_c, s)
        deltas = _dot("bhij,bhjv->bhiv", inverse_c, v_c - met[:, :, :size])  # V' = U - W S
        out = met[:, :, size:] + _dot("bhij,bhjv->bhiv", within_c, deltas)
        return s * kept_c + _dot("bhck,bhcv->bhkv", k_c, deltas), out

    scanned = (projected, v_beta, inverse, within, k_leaving, kept)
    state, out = lax.scan(step, state, tuple(jnp.moveaxis(x, 2, 0) for x in scanned))
    out = jnp.moveaxis(out, 0, 2)  # (B, H, N, C, Dv)
    return out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :length], state
