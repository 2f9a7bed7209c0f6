"""The float64 NumPy oracle of DeepSeek-V4's attention (``CompressedAttention``): the
whole sequence from position 0, written from ``attention_spec.compressed``'s docstring,
independent of both twins' code: the compressors a window at a time, the indexer's
scores and its choice in float64, the rope and its undoing pair by pair, and the softmax
attention itself by ``parity_tests.reference.attention`` (its loops, sinks and mask).

Parameters come in PyTorch's naming and layout (a ``state_dict`` as NumPy arrays), the
keywords as the module's ``config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parity_tests.reference import attention

__all__ = ["forward", "selection_of"]


def _rms(t: np.ndarray, eps: float, weight: np.ndarray | None = None) -> np.ndarray:
    t = t / np.sqrt((t * t).mean(-1, keepdims=True) + eps)
    return t if weight is None else t * np.asarray(weight, np.float64)


def _rope(t: np.ndarray, positions: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
    """t (..., N, W) turned at positions (N,) (negative: undone): pair i of the trailing
    rope slice, features (W - r + 2i, W - r + 2i + 1), by ``p * inv_freq[i]``."""
    from attention_spec.rope import inv_freq, rotary_dim

    rope = config["rope"]
    dim = rotary_dim(rope, config["head_dim"])
    freqs, factor = inv_freq(rope, config["head_dim"])
    out = np.array(t, np.float64)
    base = t.shape[-1] - dim
    for i in range(dim // 2):
        a, b = base + 2 * i, base + 2 * i + 1
        angle = np.asarray(positions, np.float64) * freqs[i]
        cos, sin = np.cos(angle) * factor, np.sin(angle) * factor
        out[..., a] = t[..., a] * cos - t[..., b] * sin
        out[..., b] = t[..., b] * cos + t[..., a] * sin
    return out


def _compress(x: np.ndarray, p: Mapping[str, np.ndarray], prefix: str, width: int, config: Mapping[str, Any],
              overlapping: bool) -> np.ndarray:
    """The entries (B, W, width) of one compressor over the whole sequence: window w's
    tokens' c = kv_proj x weighted per feature by softmax(gate_proj x + position_bias)
    over the window's slots (overlapping: window w - 1's first series beside window w's
    second), RMS-normed, turned at position w * rate."""
    rate, eps = config["compress_rate"], config["norm_eps"]
    c = x @ p[f"{prefix}.kv_proj.weight"].T
    z = x @ p[f"{prefix}.gate_proj.weight"].T
    bias = p[f"{prefix}.position_bias"]
    batch, length = x.shape[:2]
    entries = np.zeros((batch, length // rate, width))
    for w in range(length // rate):
        now = slice(w * rate, (w + 1) * rate)
        if overlapping:
            kv_slots, logit_slots = [c[:, now, width:]], [z[:, now, width:] + bias[:, width:]]
            if w > 0:
                before = slice((w - 1) * rate, w * rate)
                kv_slots.insert(0, c[:, before, :width])
                logit_slots.insert(0, z[:, before, :width] + bias[:, :width])
            kv, logits = np.concatenate(kv_slots, 1), np.concatenate(logit_slots, 1)
        else:
            kv, logits = c[:, now], z[:, now] + bias
        weights = np.exp(logits - logits.max(1, keepdims=True))
        weights /= weights.sum(1, keepdims=True)
        entries[:, w] = (weights * kv).sum(1)
    entries = _rms(entries, eps, p[f"{prefix}.kv_norm.weight"])
    return _rope(entries, np.arange(length // rate) * rate, config)


def selection_of(params: Mapping[str, Any], config: Mapping[str, Any], x: Any) -> tuple[np.ndarray, np.ndarray]:
    """``csa``'s indexer in float64: (the chosen entries (B, T, W) bool, the scores
    (B, T, W), -inf where an entry is not visible)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    batch, length = x.shape[:2]
    heads, width, topk, rate = config["index_heads"], config["index_head_dim"], config["index_topk"], \
        config["compress_rate"]
    keys = _compress(x, p, "compressor.indexer", width, config, overlapping=True)  # (B, W, ID)
    q_res = _rms(x @ p["q_a_proj.weight"].T, config["norm_eps"], p["q_a_norm.weight"])
    q = (q_res @ p["compressor.indexer.q_b_proj.weight"].T).reshape(batch, length, heads, width)
    q = _rope(q.transpose(0, 2, 1, 3), np.arange(length), config).transpose(0, 2, 1, 3)  # (B, T, IH, ID)
    weights = (x @ p["compressor.indexer.scorer.weights_proj.weight"].T) / np.sqrt(heads)  # (B, T, IH)
    dots = np.maximum(np.einsum("bthd,bwd->bthw", q, keys), 0.0) / np.sqrt(width)
    scores = np.einsum("bth,bthw->btw", weights, dots)
    count = keys.shape[1]
    visible = np.arange(count)[None] < ((np.arange(length) + 1) // rate)[:, None]  # (T, W)
    scores = np.where(visible[None], scores, -np.inf)
    chosen = np.zeros(scores.shape, bool)
    for b in range(batch):
        for t in range(length):
            live = np.flatnonzero(visible[t])
            best = live[np.argsort(-scores[b, t, live], kind="stable")][:topk]
            chosen[b, t, best] = True
    return chosen, scores


def forward(params: Mapping[str, Any], config: Mapping[str, Any], x: Any, selection: Any = None) -> np.ndarray:
    """x (B, T, d_in), the whole sequence from position 0 -> out (B, T, d_in), float64.
    ``selection`` (CSA): bool (B, T, W), the entries each query attends to in place of the
    oracle's own choice (those it cannot see yet stay hidden)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    batch, length = x.shape[:2]
    heads, dim, eps, window = config["num_heads"], config["head_dim"], config["norm_eps"], config["window"]
    groups, rank = config["o_groups"], config["o_lora_rank"]
    positions = np.arange(length)
    q_res = _rms(x @ p["q_a_proj.weight"].T, eps, p["q_a_norm.weight"])
    q = (q_res @ p["q_b_proj.weight"].T).reshape(batch, length, heads, dim).transpose(0, 2, 1, 3)
    q = _rope(_rms(q, eps), positions, config)                                   # (B, H, T, D)
    kv = _rope(_rms(x @ p["kv_proj.weight"].T, eps, p["kv_norm.weight"]), positions, config)[:, None]  # (B, 1, T, D)
    j, t = np.arange(length)[None], positions[:, None]
    mask = np.broadcast_to(((j <= t) & (j > t - window))[None, None], (batch, 1, length, length))
    keys = kv
    if config.get("compression") is not None:
        csa = config["compression"] == "csa"
        entries = _compress(x, p, "compressor", dim, config, overlapping=csa)    # (B, W, D)
        count = entries.shape[1]
        visible = np.arange(count)[None] < ((positions + 1) // config["compress_rate"])[:, None]
        seen = np.broadcast_to(visible[None], (batch, length, count))
        if csa:
            seen = seen & (selection_of(params, config, x)[0] if selection is None else np.asarray(selection, bool))
        keys = np.concatenate([kv, entries[:, None]], axis=2)
        mask = np.concatenate([mask, seen[:, None]], axis=-1)
    out, _ = attention(q, keys, keys, scale=dim ** -0.5, mask=mask, sinks=p["sinks"])
    out = _rope(out, -positions, config)                                         # (B, H, T, D)
    o = out.transpose(0, 2, 1, 3).reshape(batch, length, groups, -1)               # (B, T, G, H * D / G)
    blocks = p["o_a_proj.weight"].reshape(groups, rank, -1)                       # (G, R, H * D / G)
    o = np.einsum("btgi,gri->btgr", o, blocks).reshape(batch, length, groups * rank)
    return o @ p["o_b_proj.weight"].T
