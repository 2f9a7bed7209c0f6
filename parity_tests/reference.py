"""The float64 NumPy oracle: every variant written as explicit loops over queries, keys
and values (seed 001's unravelled form), independent of both frameworks' code.

Parameters come in PyTorch's naming and layout (a ``state_dict`` as NumPy arrays), so
the oracle checks a module after conversion too.  Masks are bool, True = may attend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["attention", "forward"]


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scale: float,
    mask: np.ndarray | None = None,
    causal: bool = False,
    normalization: str = "softmax",
    keep: np.ndarray | None = None,
    rate: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """q (..., T, D), k (..., S, D), v (..., S, Dv) -> out (..., T, Dv), weights (..., T, S).

    ``keep`` (bool, broadcastable to the weights) applies dropout: kept weights are
    scaled by 1/(1 - rate), the others become 0.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    lead = q.shape[:-2]
    t_len, s_len = q.shape[-2], k.shape[-2]
    allowed = np.ones((*lead, t_len, s_len), dtype=bool)
    if mask is not None:
        allowed = allowed & np.broadcast_to(mask, allowed.shape)
    keep_b = None if keep is None else np.broadcast_to(keep, allowed.shape)
    out = np.zeros((*lead, t_len, v.shape[-1]))
    weights = np.zeros((*lead, t_len, s_len))
    for idx in np.ndindex(*lead):
        for i in range(t_len):  # each query
            scores = []
            for j in range(s_len):  # each key
                if (causal and j > i) or not allowed[idx + (i, j)]:
                    scores.append(None)  # blocked
                else:
                    scores.append(float(np.dot(q[idx + (i,)], k[idx + (j,)])) * scale)
            live = [s for s in scores if s is not None]
            if not live:
                continue  # nothing to attend to: zero weights, zero output
            if normalization == "sum":
                total = math.fsum(live)
                if total == 0:
                    raise ValueError("row sums to zero")
                row = [0.0 if s is None else s / total for s in scores]
            else:
                top = max(live)
                exps = [0.0 if s is None else math.exp(s - top) for s in scores]
                total = math.fsum(exps)
                row = [e / total for e in exps]
            if keep_b is not None:
                row = [w / (1.0 - rate) if keep_b[idx + (i, j)] else 0.0 for j, w in enumerate(row)]
            acc = np.zeros(v.shape[-1])
            for j, w in enumerate(row):  # each value, weighted
                acc += w * v[idx + (j,)]
            out[idx + (i,)] = acc
            weights[idx + (i,)] = row
    return out, weights


def _linear(params: Mapping[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
    y = x @ np.asarray(params[f"{name}.weight"], np.float64).T
    bias = params.get(f"{name}.bias")
    return y if bias is None else y + np.asarray(bias, np.float64)


def _heads(t: np.ndarray, num_heads: int) -> np.ndarray:
    b, n, width = t.shape
    return t.reshape(b, n, num_heads, width // num_heads).transpose(0, 2, 1, 3)


def forward(
    variant: str,
    config: Mapping[str, Any],
    params: Mapping[str, np.ndarray],
    x: np.ndarray,
    mask: np.ndarray | None = None,
    keep: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The oracle for one module: (out, weights) for x (B, T, d_in) or (T, d_in).

    ``keep`` is the dropout keep-mask of a training-mode call (None = eval mode).
    Weights are (B, H, T, T), the ones that mixed the values.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 2:
        out, weights = forward(variant, config, params, x[None], mask, keep)
        return out[0], weights[0]
    rate = float(config.get("dropout", 0.0))
    causal = bool(config.get("causal", variant in ("CausalAttention", "Head", "MultiHeadAttention",
                                                    "MultiHeadAttentionWrapper")))
    common = {"mask": mask, "causal": causal, "keep": keep, "rate": rate}

    def scale_for(head_dim: int) -> float:
        default = 1.0 if variant == "Head" else None
        scale = config.get("scale", default)
        return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    if variant == "SimplifiedAttention":
        xs = x[:, None]
        out, weights = attention(xs, xs, xs, scale=1.0, normalization=config.get("normalization", "softmax"),
                                 **common)
        return out[:, 0], weights
    if variant == "MultiHeadAttentionWrapper":
        outs, ws = [], []
        head_config = {**config, "num_heads": 1}
        for i in range(config["num_heads"]):
            head_params = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"heads.{i}.")}
            head_mask = None if mask is None else _head(mask, i)
            head_keep = None if keep is None else _head(keep, i)
            o, w = forward("CausalAttention", head_config, head_params, x, head_mask, head_keep)
            outs.append(o)
            ws.append(w)
        return np.concatenate(outs, axis=-1), np.concatenate(ws, axis=-3)

    if variant == "SelfAttention_v1":
        q, k, v = (x @ np.asarray(params[n], np.float64) for n in ("W_query", "W_key", "W_value"))
    elif variant == "Head":
        q, k, v = (_linear(params, n, x) for n in ("query", "key", "value"))
    else:
        q, k, v = (_linear(params, n, x) for n in ("W_query", "W_key", "W_value"))
    num_heads = int(config.get("num_heads", 1)) if variant == "MultiHeadAttention" else 1
    q, k, v = (_heads(t, num_heads) for t in (q, k, v))  # (B, H, T, D)
    out, weights = attention(q, k, v, scale=scale_for(q.shape[-1]), **common)
    b, h, n, d = out.shape
    out = out.transpose(0, 2, 1, 3).reshape(b, n, h * d)
    if variant == "MultiHeadAttention" and "out_proj.weight" in params:
        out = _linear(params, "out_proj", out)
    return out, weights


def _head(m: np.ndarray, i: int) -> np.ndarray:
    m = np.asarray(m)
    if m.ndim < 3 or m.shape[-3] == 1:
        return m
    return m[..., i : i + 1, :, :]
