"""The float64 oracle of sparse attention's indexer (DSA: DeepSeek-V3.2, GLM-5), beside the
latent attention's (``reference._latent``), as loops over heads and keys: its scores in
float64 and its choice of each query's top ``index_topk`` visible keys.

Parameters in PyTorch's naming (``indexer.wq_b.weight``, ...), as ``reference``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from parity_tests.reference_layers import _heads, _linear, _qk_norm, rope

__all__ = ["indexer_scores", "top_keys", "visible_keys"]


def indexer_scores(options: Mapping[str, Any], params: Mapping[str, np.ndarray], x: np.ndarray,
                   q_resid: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
    """x (B, T, d_in) and the queries' low-rank input q_resid (B, T, q_lora_rank) -> the
    indexer's scores (B, T, T) in float64, every key: ``sum_h w[t, h] * relu(iq[t, h] .
    ik[s] / sqrt(Di))``, ``w = weights_proj(x) / sqrt(Hi)``, iq = ``wq_b(q_resid)`` per
    head, ik = ``LayerNorm(wk(x))``, both turned on their first rope features
    (``attention_spec.latent.indexer_rope``: the module's frequencies, in
    ``index_rope_layout``)."""
    from attention_spec.latent import indexer_rope

    heads, width = int(options["index_heads"]), int(options["index_head_dim"])
    iq = _heads(_linear(params, "indexer.wq_b", q_resid), heads, width)  # (B, Hi, T, Di)
    ik = _qk_norm(params, "indexer.k_norm", _linear(params, "indexer.wk", x), "layer",
                  float(options["norm_eps"]))[:, None]  # (B, 1, T, Di)
    config = indexer_rope(SimpleNamespace(rope=options.get("rope"), qk_rope_head_dim=options["qk_rope_head_dim"],
                                          index_rope_layout=options.get("index_rope_layout", "half")))
    if config is not None:
        pos = np.arange(x.shape[1])[None] if positions is None else np.asarray(positions)
        iq, ik = rope(iq, pos, config), rope(ik, pos, config)
    w = _linear(params, "indexer.weights_proj", x) / np.sqrt(heads)  # (B, T, Hi)
    batch, seq = x.shape[:2]
    scores = np.zeros((batch, seq, seq))
    for h in range(heads):  # one head at a time: relu of its scaled dot products, weighted
        dots = np.einsum("btd,bsd->bts", iq[:, h], ik[:, 0]) / np.sqrt(width)
        scores += w[:, :, h, None] * np.maximum(dots, 0.0)
    return scores


def visible_keys(options: Mapping[str, Any], batch: int, seq: int, mask: np.ndarray | None = None,
                 bias: np.ndarray | None = None) -> np.ndarray:
    """(B, T, T) bool: the keys query i may see, as the oracle's ``attention`` decides: the
    module's ``causal`` and ``window`` (inclusive, at offset 0), the call's ``mask`` (True =
    may attend) and a ``-inf`` ``bias``, a key seen by any head."""
    seen = np.ones((batch, seq, seq), dtype=bool)
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    if options.get("causal", True):
        seen &= j <= i
    window = options.get("window")
    if window is not None:
        left, right = window
        if left is not None:
            seen &= j >= i - left
        if right is not None:
            seen &= j <= i + right
    for m in (mask, None if bias is None else ~np.isneginf(np.asarray(bias, np.float64))):
        if m is not None:  # broadcastable to (B, H, T, S): seen by any head
            m = np.asarray(m, dtype=bool)
            m = m.reshape((1,) * (4 - m.ndim) + m.shape)
            seen &= np.broadcast_to(m, (m.shape[0], m.shape[1], seq, seq)).any(axis=1)
    return seen


def top_keys(scores: np.ndarray, visible: np.ndarray, topk: int) -> np.ndarray:
    """Each query's top ``min(topk, S)`` visible keys by ``scores`` (B, T, S), as bool (B, T,
    S) (True = selected, visible only); equal scores go to the earlier key (the twins'
    order)."""
    masked = np.where(visible, scores, -np.inf)
    order = np.argsort(-masked, axis=-1, kind="stable")[..., : min(topk, scores.shape[-1])]
    chosen = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(chosen, order, True, axis=-1)
    return chosen & visible
