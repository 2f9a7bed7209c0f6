"""The float64 NumPy oracle of the gated delta rule (and of KDA, its per-channel decay):
the recurrence of ``attention_spec.delta`` written as explicit loops over tokens and the
state's entries, from the papers' equations (Gated DeltaNet, arXiv 2412.06464, eq. 10;
Kimi Linear's KDA), independent of both twins' code and of transformers'.
"""

from __future__ import annotations

import math

import numpy as np

from attention_spec.delta import L2NORM_EPS

__all__ = ["gated_delta_rule"]


def _l2normed(x: np.ndarray) -> np.ndarray:
    return x / math.sqrt(float(np.sum(x * x)) + L2NORM_EPS)


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, *,
                     initial_state: np.ndarray | None = None, scale: float | None = None,
                     qk_l2norm: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """q, k (B, Hk, T, Dk), v (B, H, T, Dv), g (B, H, T) or (B, H, T, Dk), beta (B, H, T),
    ``initial_state`` (B, H, Dk, Dv) -> (out (B, H, T, Dv), final state (B, H, Dk, Dv)),
    in float64.  Value head h reads query/key head h // (H // Hk)."""
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    batch, qk_heads, length, key_dim = k.shape
    heads, value_dim = v.shape[1], v.shape[3]
    group = heads // qk_heads
    scale = 1.0 / math.sqrt(key_dim) if scale is None else float(scale)
    out = np.zeros((batch, heads, length, value_dim))
    states = np.zeros((batch, heads, key_dim, value_dim))
    if initial_state is not None:
        states[...] = np.asarray(initial_state, dtype=np.float64)
    for b in range(batch):
        for h in range(heads):
            s = states[b, h]  # (Dk, Dv), updated in place
            for t in range(length):
                q_t, k_t = q[b, h // group, t], k[b, h // group, t]
                if qk_l2norm:
                    q_t, k_t = _l2normed(q_t), _l2normed(k_t)
                decay = g[b, h, t]
                for c in range(key_dim):  # S <- exp(g_t) S, row by row (one g for all rows, or one each)
                    s[c, :] *= math.exp(decay if np.ndim(decay) == 0 else decay[c])
                for e in range(value_dim):
                    predicted = sum(s[c, e] * k_t[c] for c in range(key_dim))  # (S^T k_t)[e]
                    u = beta[b, h, t] * (v[b, h, t, e] - predicted)
                    for c in range(key_dim):
                        s[c, e] += k_t[c] * u
                for e in range(value_dim):
                    out[b, h, t, e] = sum(s[c, e] * scale * q_t[c] for c in range(key_dim))
    return out, states
