"""The gated delta rule (and KDA) for JAX: ``gated_delta_rule``, re-exported by
``functional``; what it computes is ``attention_spec.delta``'s docstring, its twin is
``torch_attention/_delta.py`` and its float64 oracle ``parity_tests.reference_delta``.

Both forms are a ``lax.scan``: over tokens (``"recurrent"``) or over chunks of C tokens
(``"chunked"``), so a program's size does not grow with the length.  Inside a chunk
(i, j the chunk's tokens, G the cumulative sum of g from the chunk's start, D[i, j] =
exp(G_i - G_j) for j <= i and 0 above; per key channel for KDA):

    T       = I + strictly_lower((beta_i k_i) . k_j * D[i, j])     the chunk's updates, coupled
    U, W    = T^-1 (beta v), T^-1 (beta k exp(G))                   one unit-triangular solve
    V'      = U - W S                                               the deltas, given the entering S
    O       = (q exp(G)) S + ((q_i . k_j) * D[i, j]) V'             the chunk's outputs
    S      <- exp(G_last) S + (k exp(G_last - G))^T V'              the state leaving the chunk

the form of transformers' ``torch_chunk_gated_delta_rule`` and flash-linear-attention.
"""

from __future__ import annotations

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


def _chunked(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, size: int) -> tuple[Array, Array]:
    per_channel = g.ndim == 4
    length = q.shape[2]
    pad = -length % size

    def chunks(x: Array) -> Array:  # (B, H, T, ...) -> (N, B, H, C, ...), padded with zeros
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        x = x.reshape(*x.shape[:2], -1, size, *x.shape[3:])
        return jnp.moveaxis(x, 2, 0)

    lower = jnp.tril(jnp.ones((size, size), bool))[None, None]  # j <= i, (1, 1, C, C)
    strict = jnp.tril(jnp.ones((size, size), bool), -1)[None, None]  # j < i
    eye = jnp.eye(size, dtype=q.dtype)[None, None]

    def step(s: Array, chunk: tuple[Array, ...]) -> tuple[Array, Array]:
        q_c, k_c, v_c, g_c, b_c = chunk  # (B, H, C, Dk), ..., g (B, H, C[, Dk]), beta (B, H, C)
        cum = jnp.cumsum(g_c, axis=2)
        last = cum[:, :, -1:]  # (B, H, 1[, Dk])
        k_beta, v_beta = k_c * b_c[..., None], v_c * b_c[..., None]
        if per_channel:  # D (B, H, C, C, Dk): a decay per key channel
            mask = lower[..., None]
            diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]
            decay = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
            coupling = _dot("bhic,bhjc,bhijc->bhij", k_beta, k_c, decay)
            within = _dot("bhic,bhjc,bhijc->bhij", q_c, k_c, decay)
            grown, leaving, kept = jnp.exp(cum), jnp.exp(last - cum), jnp.exp(last)[:, :, 0, :, None]
        else:  # D (B, H, C, C)
            diff = cum[..., :, None] - cum[..., None, :]
            decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
            coupling = _dot("bhic,bhjc->bhij", k_beta, k_c) * decay
            within = _dot("bhic,bhjc->bhij", q_c, k_c) * decay
            grown, leaving, kept = jnp.exp(cum)[..., None], jnp.exp(last - cum)[..., None], jnp.exp(last)[..., None]
        system = jnp.where(strict, coupling, 0.0) + eye
        solved = lax.linalg.triangular_solve(system, jnp.concatenate([v_beta, k_beta * grown], axis=-1),
                                             left_side=True, lower=True, unit_diagonal=True)
        new_values, k_cumdecay = solved[..., : v_c.shape[-1]], solved[..., v_c.shape[-1]:]
        deltas = new_values - _dot("bhck,bhkv->bhcv", k_cumdecay, s)
        out = _dot("bhck,bhkv->bhcv", q_c * grown, s) + _dot("bhij,bhjv->bhiv", within, deltas)
        s = s * kept + _dot("bhck,bhcv->bhkv", k_c * leaving, deltas)
        return s, out

    state, out = lax.scan(step, state, tuple(chunks(x) for x in (q, k, v, g, beta)))
    out = jnp.moveaxis(out, 0, 2)  # (B, H, N, C, Dv)
    return out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :length], state

