"""The float64 NumPy oracle: every variant written as explicit loops over queries, keys
and values (seed 001's unravelled form), independent of both frameworks' code.  What each
variant is made of is read from the variant registry (``attention_spec.registry``).

Parameters come in PyTorch's naming and layout (a ``state_dict`` as NumPy arrays), so
the oracle checks a module after conversion too.  Masks are bool, True = may attend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from parity_tests.reference_layers import _heads, _linear, _qk_norm, rope
from parity_tests.reference_sparse import indexer_scores, top_keys, visible_keys

__all__ = ["attention", "flex_attention", "forward"]


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
    bias: np.ndarray | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    offset: int | np.ndarray = 0,
    segment_ids: np.ndarray | None = None,
    kv_segment_ids: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    chunk: int | None = None,
    chunk_origin: int | np.ndarray = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """q (..., T, D), k (..., S, D), v (..., S, Dv) -> out (..., T, Dv), weights (..., T, S).

    Each visible score is ``s = q.k * scale``, then ``softcap * tanh(s / softcap)``, then
    ``+ bias[..., i, j]`` (bias broadcastable to the weights), as in Gemma 2.  A ``-inf``
    bias entry blocks its key exactly as the mask does (a row blocked throughout: zeros).

    ``keep`` (bool, broadcastable to the weights) applies dropout: kept weights are
    scaled by 1/(1 - rate), the others become 0.

    Structure (issue 9): query i sits at key position ``p = i + offset`` (``offset`` an
    int, or one int per example, shape (B,)); ``causal`` blocks keys j > p and
    ``window=(left, right)`` (inclusive, None = unbounded on that side) blocks keys
    outside p - left .. p + right; ``chunk`` C (chunked local attention) blocks keys of
    another chunk of C key positions counted from ``chunk_origin`` o (an int, or one per
    example, (B,)): (j - o) // C != (p - o) // C.  ``segment_ids`` (B, T) and ``kv_segment_ids`` (B, S)
    (default: ``segment_ids``) block keys of another segment.  Grouped-query attention:
    k and v (..., Hkv, S, D) with Hkv dividing q's H; query head h reads kv head
    h // (H // Hkv).  Per-example options index the first axis (B).

    Attention sinks (gpt-oss): ``sinks`` (H,), one logit per query head, joins every
    softmax's denominator as a key with no value: a row's weights are
    ``exp(s_j) / (sum_j exp(s_j) + exp(sink))`` and sum to less than 1.  A row that sees
    no key stays zeros (its whole weight on the sink).

    A module's flex mods (q (B, H, T, D)): ``mask_mod(b, h, p, j)`` blocks key j of query
    i where it is false, and the final score (capped, biased) becomes
    ``score_mod(s, b, h, p, j)`` (a -inf blocks the key), each index an ``np.int64``, p
    the query's key position (``i + offset``), h the query head.
    """
    from attention_spec.mods import portable

    score_mod, mask_mod = portable("score_mod", score_mod), portable("mask_mod", mask_mod)
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    lead = q.shape[:-2]
    t_len, s_len = q.shape[-2], k.shape[-2]
    groups = 1  # query heads per key/value head
    if q.ndim >= 3 and k.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        if q.shape[-3] % k.shape[-3]:
            raise ValueError(f"q has {q.shape[-3]} heads, not a multiple of k's {k.shape[-3]}")
        groups = q.shape[-3] // k.shape[-3]
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    offsets, origins = np.asarray(offset), np.asarray(chunk_origin)
    seg_q = None if segment_ids is None else np.asarray(segment_ids)
    seg_k = seg_q if kv_segment_ids is None else np.asarray(kv_segment_ids)
    allowed = np.ones((*lead, t_len, s_len), dtype=bool)
    if mask is not None:
        allowed = allowed & np.broadcast_to(mask, allowed.shape)
    keep_b = None if keep is None else np.broadcast_to(keep, allowed.shape)
    bias_b = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64), allowed.shape)
    sink_logits = None if sinks is None else np.asarray(sinks, np.float64)
    out = np.zeros((*lead, t_len, v.shape[-1]))
    weights = np.zeros((*lead, t_len, s_len))
    any_mod = score_mod is not None or mask_mod is not None
    for idx in np.ndindex(*lead):
        kv_idx = idx if groups == 1 else idx[:-1] + (idx[-1] // groups,)  # its key/value head
        idx64 = tuple(np.int64(n) for n in idx)
        shift = int(offsets) if offsets.ndim == 0 else int(offsets[idx[0]])  # key position of query 0
        o = int(origins) if origins.ndim == 0 else int(origins[idx[0]])  # where its chunks start
        for i in range(t_len):  # each query
            p = i + shift  # its key position
            masked = (~allowed[idx + (i,)]).tolist()  # the mask's verdict on each key
            if all(masked):
                continue  # the mask leaves it no key: zero weights and output, as for a row blocked below
            scores: list[float | None] = []
            for j in range(s_len):  # each key
                blocked = (
                    masked[j]
                    or (right is not None and j - p > right)
                    or (left is not None and p - j > left)
                    or (chunk is not None and (j - o) // chunk != (p - o) // chunk)
                    or (seg_q is not None and seg_k is not None and seg_q[idx[0], i] != seg_k[idx[0], j])
                )
                # a -inf bias entry blocks its key as a mask does (the library's rule)
                blocked = blocked or (bias_b is not None and bias_b[idx + (i, j)] == -math.inf)
                at = (*idx64, np.int64(p), np.int64(j)) if any_mod else ()  # a mod's (b, h, p, j)
                blocked = blocked or (mask_mod is not None and not bool(mask_mod(*at)))
                if blocked:
                    scores.append(None)  # blocked
                else:
                    s = float(np.dot(q[idx + (i,)], k[kv_idx + (j,)])) * scale
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if bias_b is not None:
                        s += float(bias_b[idx + (i, j)])
                    if score_mod is not None:
                        s = float(score_mod(np.float64(s), *at))
                    scores.append(None if s == -math.inf else s)
            live = [s for s in scores if s is not None]
            if not live:
                continue  # nothing to attend to: zero weights, zero output
            if normalization == "sum":
                total = math.fsum(live)
                if total == 0:
                    raise ValueError("row sums to zero")
                row = [0.0 if s is None else s / total for s in scores]
            else:
                sink = None if sink_logits is None else float(sink_logits[idx[-1]])
                top = max(live) if sink is None else max(*live, sink)
                exps = [0.0 if s is None else math.exp(s - top) for s in scores]
                total = math.fsum(exps + ([] if sink is None else [math.exp(sink - top)]))
                row = [e / total for e in exps]
            if keep_b is not None:
                row = [w / (1.0 - rate) if keep_b[idx + (i, j)] else 0.0 for j, w in enumerate(row)]
            acc = np.zeros(v.shape[-1])
            for j, w in enumerate(row):  # each value, weighted
                acc += w * v[kv_idx + (j,)]
            out[idx + (i,)] = acc
            weights[idx + (i,)] = row
    return out, weights


def flex_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    score_mod: Any = None,
    mask_mod: Any = None,
    scale: float,
    sinks: np.ndarray | None = None,
    keep: np.ndarray | None = None,
    rate: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """PyTorch's flex_attention as loops: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev)
    -> out (B, Hq, L, Ev), lse (B, Hq, L), float64.

    What ours adds: ``sinks`` (Hq,), one logit per query head that joins each row's sum of
    exp as a key with no value: weights exp(s_j - lse), lse = log(sum_j exp(s_j) +
    exp(sink)), and a row that sees no key has zeros and lse = its sink.  ``keep`` (bool,
    broadcastable to (B, Hq, L, S)): dropout, a kept weight scaled by 1/(1 - rate), the
    others 0 (the lse is the softmax's, before dropout).

    For each (b, h, i, j): query head h reads kv head h // (Hq // Hkv); the score
    ``s = q.k * scale`` (float64) becomes ``score_mod(s, b, h, i, j)``, each index an
    ``np.int64``; key j is visible where ``mask_mod(b, h, i, j)`` holds and the modded
    score is not -inf.  A row's weights are the softmax of its visible scores and its
    lse the natural log of their sum of exp; a row that sees no key is zeros, lse -inf.
    Mods that capture arrays should capture NumPy (float64) ones here; a library mod's
    arrays that do not fit the sizes raise the twins' ValueError (``mods.check_sizes``)."""
    from attention_spec.mods import check_sizes

    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    batch, heads, t_len, _ = q.shape
    groups = heads // k.shape[1]  # query heads per key/value head
    s_len = k.shape[2]
    for role, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        check_sizes(mod, batch, heads, t_len, s_len, where=f"flex_attention: {role}")
    out = np.zeros((batch, heads, t_len, v.shape[-1]))
    lse = np.full((batch, heads, t_len), -math.inf)
    keep_b = None if keep is None else np.broadcast_to(np.asarray(keep, bool), (batch, heads, t_len, s_len))
    for b in range(batch):
        for h in range(heads):
            kvh = h // groups
            sink = None if sinks is None else float(np.asarray(sinks, np.float64)[h])
            for i in range(t_len):
                scores: list[float | None] = []
                for j in range(s_len):
                    index = (np.int64(b), np.int64(h), np.int64(i), np.int64(j))
                    if mask_mod is not None and not bool(mask_mod(*index)):
                        scores.append(None)  # blocked
                        continue
                    s = np.float64(float(np.dot(q[b, h, i], k[b, kvh, j])) * scale)
                    if score_mod is not None:
                        s = float(score_mod(s, *index))
                    scores.append(None if s == -math.inf else float(s))
                live = [s for s in scores if s is not None]
                if not live:
                    if sink is not None:
                        lse[b, h, i] = sink  # the whole weight on the sink
                    continue  # nothing to attend to: zeros, lse -inf
                top = max(live) if sink is None else max(*live, sink)
                exps = [0.0 if s is None else math.exp(s - top) for s in scores]
                total = math.fsum(exps + ([] if sink is None else [math.exp(sink - top)]))
                lse[b, h, i] = top + math.log(total)
                acc = np.zeros(v.shape[-1])
                for j, e in enumerate(exps):  # each value, weighted
                    w = e / total
                    if keep_b is not None:
                        w = w / (1.0 - rate) if keep_b[b, h, i, j] else 0.0
                    acc += w * v[b, kvh, j]
                out[b, h, i] = acc
    return out, lse


def forward(
    variant: str,
    config: Mapping[str, Any],
    params: Mapping[str, np.ndarray],
    x: np.ndarray,
    mask: np.ndarray | None = None,
    keep: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    positions: np.ndarray | None = None,
    *,
    kv: tuple[np.ndarray, np.ndarray] | None = None,
    return_kv: bool = False,
    selection: np.ndarray | None = None,
) -> Any:
    """The oracle for one module: (out, weights) for x (B, T, d_in) or (T, d_in).

    ``config`` holds the constructor keywords; what the variant is made of (projections
    and their layouts, how it has heads, the defaults of ``causal`` and ``scale``) comes
    from the variant registry, ``attention_spec.registry``.  ``keep`` is the dropout
    keep-mask of a training-mode call (None = eval mode); ``bias`` the additive bias of the
    call (broadcastable to (B, H, T, T)); ``config["softcap"]`` soft-caps the scores.  Weights are (B, H, T, T), the
    ones that mixed the values.  Widths come from the parameters' shapes (``head_dim``,
    when given, is checked against them); ``out_bias=False``: ``out_proj`` has no bias.
    ``config["rope"]`` (a ``RopeConfig``) turns q and k at ``positions`` (integers (B, T)
    or (1, T); None: 0..T-1), in float64 (``rope``).  ``clip_qkv`` clamps the three
    projections' outputs (biases added) to [-c, c] before anything else; ``output_gate``
    reads W_query's output as each head's queries then its gate (2 * head_dim a head) and
    multiplies the merged heads by sigmoid(gate) before ``out_proj`` (``output_gate_activation=
    "softplus"``: by softplus(gate); ``output_gate_per_head``: one gate value a head, W_query's
    D + 1 outputs a head); ``out_norm="rms"``: the merged heads (gated) RMS-normed with the
    weight ``out_norm.weight`` before ``out_proj``; ``qk_norm_position="after_rope"``: the
    qk-norm (with its weight) of the turned q and k.  ``values_from_keys``:
    the values are W_key's output (clamped) before k-norm and rope; ``v_norm="rms"``: each
    value head RMS-normed, no weight; ``v_head_dim``: value heads of that width (W_value's
    output), ``v_scale``: the values times it (after ``v_norm``); ``qk_norm_weight=False``: q and k RMS-normed without
    weight after rope, where the families norm them (the twins norm before: a rotation
    keeps the norm); ``query_scale``: q times 1 + beta log1p(floor((p + offset) / floor))
    at its position p, after rope and qk-norm (``query_scale_kind="power"``: times (1 + (p + offset) /
    floor) ** beta).  ``return_kv``: (out, weights, (k, v)), the
    keys and values (B, Hkv, T, D) attended over (normed, rotated); ``kv`` (a
    ``kv_shared`` module's): those of another layer, in place of its own (only q is
    projected, normed, rotated and scaled).  Sparse attention (``index_topk``): the
    indexer's choice in float64 (``reference_sparse``), or ``selection`` (bool (B, T, T),
    True = selected) in its place.
    """
    from attention_spec.registry import variant as declaration

    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 2:
        result = forward(variant, config, params, x[None], mask, keep, bias,
                         None if positions is None else np.asarray(positions)[None],
                         kv=None if kv is None else (np.asarray(kv[0])[None], np.asarray(kv[1])[None]),
                         return_kv=return_kv, selection=None if selection is None else np.asarray(selection)[None])
        if return_kv:
            return result[0][0], result[1][0], (result[2][0][0], result[2][1][0])
        return result[0][0], result[1][0]
    decl = declaration(variant)
    options = {**decl.defaults, **dict(decl.fixed), **config}
    if decl.heads == "wrapper":  # num_heads copies of the head variant, concatenated
        assert decl.head_variant is not None
        outs, ws = [], []
        head_config = {**config, "num_heads": 1}
        for i in range(config["num_heads"]):
            head_params = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"heads.{i}.")}
            head_mask = None if mask is None else _head(mask, i)
            head_keep = None if keep is None else _head(keep, i)
            head_bias = None if bias is None else _head(bias, i)
            o, w = forward(decl.head_variant, head_config, head_params, x, head_mask, head_keep, head_bias)
            outs.append(o)
            ws.append(w)
        return np.concatenate(outs, axis=-1), np.concatenate(ws, axis=-3)

    rate = float(options.get("dropout", 0.0))
    common = {"mask": mask, "causal": bool(options.get("causal", False)), "keep": keep, "rate": rate,
              "normalization": options.get("normalization", "softmax"), "bias": bias,
              "softcap": options.get("softcap"), "window": options.get("window"), "chunk": options.get("chunk"),
              "sinks": params.get("sinks") if options.get("sinks") else None,
              "score_mod": options.get("score_mod"), "mask_mod": options.get("mask_mod")}
    if decl.heads == "latent":  # multi-head latent attention: its own projections
        return _latent(options, params, x, positions, common, selection)
    projections = [p for p in decl.projections if p.exists(options)]
    by_role: dict[str, np.ndarray] = {}
    for p in projections:
        if p.role == "out":
            continue
        if p.layout == "matrix":  # x @ W, W (d_in, d_out)
            by_role[p.role] = x @ np.asarray(params[p.name], np.float64)
        else:
            by_role[p.role] = _linear(params, p.name, x)
    clip = options.get("clip_qkv")
    if clip is not None:  # OLMo: each projection's output clamped to [-clip, clip], biases added
        by_role = {role: np.clip(y, -float(clip), float(clip)) for role, y in by_role.items()}
    if options.get("values_from_keys"):  # Gemma 4's attention_k_eq_v: W_key's output is the values
        by_role["value"] = by_role["key"]
    shared = bool(options.get("kv_shared"))  # Gemma 4's "reuse" layers: another layer's k and v
    if shared and kv is None:
        raise ValueError("the oracle of a kv_shared module takes kv=(k, v), another layer's")
    gate = None
    if options.get("output_gate"):  # Qwen3-Next: each head's outputs of W_query, queries then gate
        q_and_gate = _heads(by_role["query"], int(options["num_heads"]))  # (B, H, T, D + G)
        queries = q_and_gate.shape[-1] - 1 if options.get("output_gate_per_head") else q_and_gate.shape[-1] // 2
        by_role["query"], gate = (np.ascontiguousarray(part.transpose(0, 2, 1, 3)).reshape(*x.shape[:2], -1)
                                  for part in (q_and_gate[..., :queries], q_and_gate[..., queries:]))
    weightless = options.get("qk_norm") is not None and options.get("qk_norm_weight") is False
    after = options.get("qk_norm_position", "before_rope") == "after_rope"  # HunYuan: on the turned q and k
    for name, role in (("q_norm", "query"), ("k_norm", "key")):
        if options.get("qk_norm") is not None and not weightless and not after and not (shared and role == "key"):
            by_role[role] = _qk_norm(params, name, by_role[role], options["qk_norm"], options["qk_norm_eps"],
                                     float(options.get("qk_norm_offset", 0.0)))
    if not by_role:  # no projections: queries, keys and values are x itself
        by_role = {"query": x, "key": x, "value": x}
    num_heads = int(options.get("num_heads", 1)) if decl.heads == "split" else 1
    kv_heads = int(options.get("num_kv_heads") or num_heads)  # grouped-query: fewer k/v heads
    head_dim = options.get("head_dim")  # free widths: None = the projections' width / heads
    q = _heads(by_role["query"], num_heads, head_dim)  # (B, H, T, D)
    if shared and kv is not None:  # already normed and rotated by the layer that computed them
        k, v = np.asarray(kv[0], np.float64), np.asarray(kv[1], np.float64)
    else:
        k = _heads(by_role["key"], kv_heads, head_dim)  # (B, Hkv, T, D)
        v = _heads(by_role["value"], kv_heads, options.get("v_head_dim") or head_dim)  # (B, Hkv, T, Dv)
    if options.get("v_norm") == "rms":  # Gemma 4: each value head over its head_dim, no weight
        v = _rms(v, float(options["qk_norm_eps"]))
    if options.get("v_scale") is not None:  # MiMo-V2-Flash: the values times a constant
        v = v * float(options["v_scale"])
    pos = np.arange(x.shape[1])[None] if positions is None else np.asarray(positions)
    if options.get("rope") is not None:
        q = rope(q, pos, options["rope"])
        k = k if shared else rope(k, pos, options["rope"])
    if after and not weightless:  # HunYuan: the weighted qk-norm of the turned q and k, merged
        norm = (options["qk_norm"], options["qk_norm_eps"], float(options.get("qk_norm_offset", 0.0)))
        q = _heads(_qk_norm(params, "q_norm", _merged(q), *norm), num_heads, head_dim)
        if not shared:
            k = _heads(_qk_norm(params, "k_norm", _merged(k), *norm), kv_heads, head_dim)
    if weightless:  # nanochat / Llama 4: after rope, over each head (or all heads together)
        eps, whole = float(options["qk_norm_eps"]), options.get("qk_norm_scope") == "all"
        q = _heads(_rms(_merged(q), eps), num_heads, head_dim) if whole else _rms(q, eps)
        if not shared:
            k = _heads(_rms(_merged(k), eps), kv_heads, head_dim) if whole else _rms(k, eps)
    if options.get("query_scale") is not None:  # Llama 4's temperature tuning, Ministral 3's beta
        factor = _query_factor(options["query_scale"], np.broadcast_to(pos, (x.shape[0], x.shape[1])),
                               options.get("query_scale_kind", "log"))
        q = q * factor[:, None, :, None]
    scale = options.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if options.get("chunk") is not None and positions is not None:  # chunks at the positions: from each row's 0
        at = np.broadcast_to(pos, (x.shape[0], x.shape[1]))  # (the last slot of its furthest position, minus it)
        common = {**common, "chunk_origin": x.shape[1] - 1 - at[:, ::-1].argmax(-1) - at.max(-1)}
    out, weights = attention(q, k, v, scale=scale, **common)
    b, h, n, d = out.shape
    out = out.transpose(0, 2, 1, 3).reshape(b, n, h * d)
    if gate is not None:  # the merged heads times sigmoid(gate) (softplus: Laguna), before out_proj
        if options.get("output_gate_bias"):  # Beam: each head's gate_bias over its gate features
            per_head = gate.reshape(*gate.shape[:2], int(options["num_heads"]), -1)
            gate = (per_head + np.asarray(params["gate_bias"], np.float64)[:, None]).reshape(gate.shape)
        activated = np.logaddexp(0.0, gate) if options.get("output_gate_activation") == "softplus" else (
            1.0 / (1.0 + np.exp(-gate)))
        if options.get("output_gate_per_head"):  # one value a head, over its D features
            activated = np.repeat(activated, out.shape[-1] // activated.shape[-1], axis=-1)
        out = out * activated
    if options.get("out_norm") == "rms":  # BitNet's attn_sub_norm: the merged heads, with a weight
        out = _qk_norm(params, "out_norm", out, "rms", float(options["qk_norm_eps"]))
    for p in projections:
        if p.role == "out":  # out_features / out_bias: out_proj's (out, in) weight and bias, if any
            if p.has_bias(options) != (f"{p.name}.bias" in params):
                raise ValueError(f"{p.name}.bias: the config says bias={p.has_bias(options)}, the parameters differ")
            out = _linear(params, p.name, out)
    return (out, weights, (k, v)) if return_kv else (out, weights)


def _latent(options: Mapping[str, Any], params: Mapping[str, np.ndarray], x: np.ndarray,
            positions: np.ndarray | None, common: dict[str, Any],
            selection: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Multi-head latent attention (DeepSeek-V2/V3) in float64, keys and values expanded:
    q from ``q_proj`` or ``q_b_proj(rms(q_a_proj(x)))``; ``kv_a_proj_with_mqa(x)`` split into
    the latent (normalised) and one rope key for every head; ``kv_b_proj(latent)`` split per
    head into the nope key and the value; rope on the rope parts; the scale
    ``qk_head_dim ** -0.5``, times ``(0.1 mscale_all_dim ln(factor) + 1) ** 2`` under YaRN."""
    heads, rank = int(options["num_heads"]), int(options["kv_lora_rank"])
    nope, rot, dv = (int(options[n]) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    eps = float(options["norm_eps"])
    if options.get("q_lora_rank") is None:
        q = _linear(params, "q_proj", x)
    else:
        q_resid = _qk_norm(params, "q_a_layernorm", _linear(params, "q_a_proj", x), "rms", eps)
        q = _linear(params, "q_b_proj", q_resid)
    if options.get("index_topk") is not None:  # sparse attention: the indexer's keys only
        if selection is None:
            seen = visible_keys(options, x.shape[0], x.shape[1], common["mask"], common["bias"])
            selection = top_keys(indexer_scores(options, params, x, q_resid, positions), seen,
                                 int(options["index_topk"]))
        chosen = np.asarray(selection, dtype=bool)[:, None]  # (B, 1, T, T)
        common = {**common, "mask": chosen if common["mask"] is None else np.asarray(common["mask"], bool) & chosen}
    q = _heads(q, heads, nope + rot)  # (B, H, T, nope + rope)
    compressed = _linear(params, "kv_a_proj_with_mqa", x)
    latent = _qk_norm(params, "kv_a_layernorm", compressed[..., :rank], "rms", eps)
    k_rope = compressed[:, None, :, rank:]  # (B, 1, T, rope): one key for every head
    kv = _heads(_linear(params, "kv_b_proj", latent), heads, nope + dv)  # (B, H, T, nope + dv)
    config = options.get("rope")
    if config is not None:
        pos = np.arange(x.shape[1])[None] if positions is None else np.asarray(positions)
        q = np.concatenate((q[..., :nope], rope(q[..., nope:], pos, config)), axis=-1)
        k_rope = rope(k_rope, pos, config)
    if options.get("query_scale") is not None:  # Mistral 4: the whole query, after rope
        at = np.arange(x.shape[1])[None] if positions is None else np.asarray(positions)
        q = q * _query_factor(options["query_scale"], np.broadcast_to(at, (x.shape[0], x.shape[1])))[:, None, :, None]
    k = np.concatenate((kv[..., :nope], np.broadcast_to(k_rope, (*kv.shape[:3], rot))), axis=-1)
    scale = options.get("scale")
    if scale is None:
        scale = (nope + rot) ** -0.5
        if config is not None and config.scaling == "yarn" and config.mscale_all_dim and config.factor > 1:
            scale *= (0.1 * config.mscale_all_dim * math.log(config.factor) + 1.0) ** 2
    out, weights = attention(q, k, kv[..., nope:], scale=float(scale), **common)
    b, h, n, d = out.shape
    return _linear(params, "o_proj", out.transpose(0, 2, 1, 3).reshape(b, n, h * d)), weights


def _query_factor(query_scale: Any, positions: np.ndarray, kind: str = "log") -> np.ndarray:
    """The queries' factor at positions p (B, T), in float64: ``1 + beta log1p(floor((p +
    offset) / floor))``, or for ``query_scale_kind="power"`` ``(1 + (p + offset) / floor) ** beta``."""
    beta, floor, offset = query_scale
    at = positions.astype(np.int64) + offset
    if kind == "power":
        return (1.0 + at.astype(np.float64) / floor) ** beta
    return 1.0 + beta * np.log1p(np.floor_divide(at, floor).astype(np.float64))


def _rms(t: np.ndarray, eps: float) -> np.ndarray:
    """The weightless RMS norm of t over its last axis, in float64."""
    t = np.asarray(t, np.float64)
    return t / np.sqrt((t * t).mean(-1, keepdims=True) + eps)


def _merged(t: np.ndarray) -> np.ndarray:
    """Heads (B, H, T, D) -> (B, T, H * D)."""
    b, h, n, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def _head(m: np.ndarray, i: int) -> np.ndarray:
    m = np.asarray(m)
    if m.ndim < 3 or m.shape[-3] == 1:
        return m
    return m[..., i : i + 1, :, :]
