"""The gated delta rule (and KDA) for PyTorch: ``gated_delta_rule``, re-exported by
``functional``; the twin of ``jax_attention/_delta.py`` (whose docstring gives the chunked
form's equations); what it computes is ``attention_spec.delta``'s docstring, its float64
oracle ``parity_tests.reference_delta``.  Eager loops: over tokens (``"recurrent"``) or
over chunks (``"chunked"``), the chunk's delta-rule updates one unit-triangular solve.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attention_spec.arrays import dtype_name
from attention_spec.delta import DEFAULT_CHUNK, L2NORM_EPS, check_gated_delta_rule, state_dtype


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                     initial_state: Tensor | None = None, scale: float | None = None, qk_l2norm: bool = False,
                     form: str = "chunked", chunk_size: int = DEFAULT_CHUNK,
                     layout: str = "bhsd") -> tuple[Tensor, Tensor]:
    """The gated delta rule (``attention_spec.delta``): q, k (B, Hk, T, Dk), v (B, H, T, Dv),
    ``g`` (B, H, T) or, for KDA, (B, H, T, Dk) (log-space decays, <= 0), ``beta`` (B, H, T),
    ``initial_state`` (B, H, Dk, Dv) (None: zeros); tokens before heads with
    ``layout="bshd"``.  Returns (out in v's layout and dtype, the final state (B, H, Dk, Dv)
    in float32, or float64 for float64 inputs).

    ``form``: ``"chunked"`` (chunks of ``chunk_size`` tokens, for training) or
    ``"recurrent"`` (a token at a time, for decoding), the same numbers up to rounding.
    ``scale``: None is 1/sqrt(Dk).  ``qk_l2norm``: q and k divided by their L2 norm
    (eps 1e-6) first."""
    dtypes = tuple(dtype_name(x.dtype) for x in (q, k, v, g, beta))
    dtypes += (dtype_name(initial_state.dtype),) if initial_state is not None else ()
    shapes = check_gated_delta_rule(q.shape, k.shape, v.shape, g.shape, beta.shape,
                                    None if initial_state is None else initial_state.shape, dtypes,
                                    layout=layout, form=form, chunk_size=chunk_size, scale=scale)
    compute = getattr(torch, state_dtype(dtypes[0]))
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    q, k, v, g, beta = (x.to(compute) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q, k))
    group = shapes.heads // shapes.qk_heads
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    q = q * (shapes.key_dim ** -0.5 if scale is None else float(scale))
    state = (q.new_zeros((shapes.batch, shapes.heads, shapes.key_dim, shapes.value_dim))
             if initial_state is None else initial_state.to(compute))
    run = _recurrent if form == "recurrent" else _chunked
    out, state = run(q, k, v, g, beta, state, chunk_size)
    out = out.to(getattr(torch, dtypes[2]))
    return (out.transpose(1, 2) if layout == "bshd" else out), state


def _recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor, _: int) -> tuple[Tensor, Tensor]:
    per_channel = g.dim() == 4
    out = []
    for t in range(q.shape[2]):
        g_t = g[:, :, t]
        s = s * (g_t.exp()[..., :, None] if per_channel else g_t.exp()[..., None, None])
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, :, t]))
        s = s + k[:, :, t, :, None] * u[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return torch.stack(out, dim=2), s


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor, size: int) -> tuple[Tensor, Tensor]:
    per_channel = g.dim() == 4
    length = q.shape[2]
    pad = -length % size

    def chunks(x: Tensor) -> Tensor:  # (B, H, T, ...) -> (B, H, N, C, ...), padded with zeros
        widths = [0, 0] * (x.dim() - 3) + [0, pad]
        x = torch.nn.functional.pad(x, widths)
        return x.reshape(*x.shape[:2], -1, size, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    strict = lower.tril(-1)
    eye = torch.eye(size, dtype=q.dtype, device=q.device)
    out = []
    for n in range(q.shape[2]):
        q_c, k_c, v_c, g_c, b_c = q[:, :, n], k[:, :, n], v[:, :, n], g[:, :, n], beta[:, :, n]
        cum = g_c.cumsum(dim=2)
        last = cum[:, :, -1:]
        k_beta, v_beta = k_c * b_c[..., None], v_c * b_c[..., None]
        if per_channel:  # D (B, H, C, C, Dk): a decay per key channel
            mask = lower[:, :, None]
            diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]
            decay = torch.where(mask, torch.where(mask, diff, 0.0).exp(), 0.0)
            coupling = torch.einsum("bhic,bhjc,bhijc->bhij", k_beta, k_c, decay)
            within = torch.einsum("bhic,bhjc,bhijc->bhij", q_c, k_c, decay)
            grown, leaving, kept = cum.exp(), (last - cum).exp(), last.exp()[:, :, 0, :, None]
        else:  # D (B, H, C, C)
            diff = cum[..., :, None] - cum[..., None, :]
            decay = torch.where(lower, torch.where(lower, diff, 0.0).exp(), 0.0)
            coupling = (k_beta @ k_c.transpose(-1, -2)) * decay
            within = (q_c @ k_c.transpose(-1, -2)) * decay
            grown, leaving, kept = cum.exp()[..., None], (last - cum).exp()[..., None], last.exp()[..., None]
        system = torch.where(strict, coupling, 0.0) + eye
        solved = torch.linalg.solve_triangular(system, torch.cat([v_beta, k_beta * grown], dim=-1),
                                               upper=False, unitriangular=True)
        new_values, k_cumdecay = solved[..., : v_c.shape[-1]], solved[..., v_c.shape[-1]:]
        deltas = new_values - k_cumdecay @ s
        out.append((q_c * grown) @ s + within @ deltas)
        s = s * kept + (k_c * leaving).transpose(-1, -2) @ deltas
    result = torch.stack(out, dim=2)  # (B, H, N, C, Dv)
    return result.reshape(*result.shape[:2], -1, result.shape[-1])[:, :, :length], s
