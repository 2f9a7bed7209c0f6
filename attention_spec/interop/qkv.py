"""Packed q/k/v along one axis, framework-free: ``split_qkv`` and ``join_qkv``.

One weight holds the query, key and value projections side by side.  ``layout="in_out"``:
(d_in, packed), applied as ``x @ W`` (GPT-2's ``Conv1D`` ``c_attn.weight``);
``layout="out_in"``: (packed, d_in), applied as ``x @ W.T`` (``nn.Linear``,
``nn.MultiheadAttention.in_proj_weight``).  ``packing=`` orders the packed axis:
``"thirds"`` ([q; k; v], three equal blocks), ``"per_head"`` (each head's query, key and
value in turn, GPT-NeoX), ``"grouped"`` ([q; k; v] with grouped key/value heads, Phi-3) or
``"codegen"`` (4 model-parallel shards in turn, each [q; v; k] of a quarter of each width:
CodeGen's ``qkv_proj``, ``mp_num = 4``).

The layer under both ``attention_spec.interop.specs`` (whose ``SplitQKV`` / ``JoinQKV``
steps run these functions) and ``attention_spec.interop.packing`` (which names the result
by our modules' parameters); ``packing`` re-exports every public name here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attention_spec.interop.numpy_arrays import as_numpy, check_float_arrays

__all__ = ["PACKED_LAYOUTS", "QKV_PACKINGS", "ROLES", "check_layout", "check_packing", "join_qkv", "split_qkv"]

PACKED_LAYOUTS = ("in_out", "out_in")
QKV_PACKINGS = ("thirds", "per_head", "grouped", "codegen")
CODEGEN_SHARDS = 4  # CodeGen's mp_num: its qkv_proj packs 4 shards, each [q; v; k] of d_out / 4 rows
# the packings that need no heads: the query, key and value widths equal (d_out each)
UNHEADED = ("thirds", "codegen")
ROLES = ("query", "key", "value")


def check_layout(layout: Any) -> str:
    """``layout`` itself if it is ``"in_out"`` or ``"out_in"``; else ValueError."""
    if not isinstance(layout, str) or layout not in PACKED_LAYOUTS:
        raise ValueError(
            "layout must be 'in_out' (packed weight (d_in, 3*d_out), applied as x @ W, as GPT-2's "
            "Conv1D) or 'out_in' ((3*d_out, d_in), applied as x @ W.T, as nn.Linear and "
            f"nn.MultiheadAttention.in_proj_weight); got {layout!r}"
        )
    return layout


def _float(name: str, value: Any) -> np.ndarray:
    array = as_numpy(value)
    check_float_arrays({name: array}, name)
    return array


def _rank(name: str, array: np.ndarray, rank: int, meaning: str) -> None:
    if array.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {meaning}; got shape {tuple(array.shape)}")


def check_packing(packing: Any) -> str:
    """``packing`` itself if it is one of ``QKV_PACKINGS``; else ValueError."""
    if not isinstance(packing, str) or packing not in QKV_PACKINGS:
        raise ValueError(
            "packing must be 'thirds' ([q; k; v] in three equal blocks, as GPT-2's c_attn and "
            "nn.MultiheadAttention.in_proj_weight), 'per_head' (each head's query, key and value in "
            "turn, (num_heads, 3, head_dim), as GPT-NeoX's query_key_value) or 'grouped' ([q; k; v] "
            "with num_heads query heads and num_kv_heads key/value heads, as Phi-3's qkv_proj) or "
            "'codegen' (4 model-parallel shards in turn, each [q; v; k] of d_out/4 rows, as CodeGen's "
            f"qkv_proj); got {packing!r}"
        )
    return packing


def _heads(num_heads: Any) -> int:
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int; got {num_heads!r}")
    return int(num_heads)


def _packing_heads(packing: str, num_heads: Any, num_kv_heads: Any) -> tuple[int, int] | None:
    """(num_heads, num_kv_heads) that ``packing`` needs, checked; None for ``"thirds"`` and
    ``"codegen"``."""
    if packing in UNHEADED:
        return None
    if num_heads is None:
        raise ValueError(f"packing={packing!r} needs num_heads")
    h = _heads(num_heads)
    if packing == "per_head":
        if num_kv_heads is not None and num_kv_heads != h:
            raise ValueError(
                f"packing='per_head' holds one query, key and value head at a time, so key/value heads "
                f"cannot be grouped; got num_heads={h}, num_kv_heads={num_kv_heads!r}"
            )
        return h, h
    if num_kv_heads is None:
        raise ValueError("packing='grouped' needs num_kv_heads (the key/value heads)")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, (int, np.integer)) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be a positive int; got {num_kv_heads!r}")
    if h % num_kv_heads:
        raise ValueError(f"num_heads must be a multiple of num_kv_heads; got num_heads={h}, "
                         f"num_kv_heads={num_kv_heads}")
    return h, int(num_kv_heads)


def _heads_words(packing: str, heads: tuple[int, int]) -> tuple[str, int]:
    """How ``packing`` builds its packed width from head_dim: (words, multiple of head_dim)."""
    h, hkv = heads
    if packing == "per_head":
        return f"3*num_heads*head_dim = {3 * h}*head_dim (num_heads={h})", 3 * h
    return (f"(num_heads + 2*num_kv_heads)*head_dim = {h + 2 * hkv}*head_dim (num_heads={h}, "
            f"num_kv_heads={hkv})"), h + 2 * hkv


def _check_packed(weight: np.ndarray, bias: np.ndarray | None, layout: str,
                  packing: str = "thirds") -> tuple[int, int]:
    """(d_in, d_out) of a packed weight, after every check."""
    expected = "(d_in, 3*d_out)" if layout == "in_out" else "(3*d_out, d_in)"
    _rank("the packed q/k/v weight", weight, 2, f"{expected} for layout={layout!r}")
    packed, d_in = (weight.shape[1], weight.shape[0]) if layout == "in_out" else weight.shape
    if packed == 0 or packed % 3:
        axis = 1 if layout == "in_out" else 0
        raise ValueError(
            f"the packed q/k/v weight {tuple(weight.shape)} must have a width divisible by 3 "
            f"(query, key, value) along axis {axis}, {expected} for layout={layout!r}; got {packed}"
        )
    _check_packed_bias(weight, bias, layout, packed, "3*d_out")
    _check_shards(packing, packed // 3)
    return int(d_in), packed // 3


def _check_shards(packing: str, d_out: int) -> None:
    """Refuses a ``"codegen"`` width that its 4 shards do not divide."""
    if packing == "codegen" and d_out % CODEGEN_SHARDS:
        raise ValueError(f"packing='codegen' packs {CODEGEN_SHARDS} shards, each [q; v; k] of d_out/{CODEGEN_SHARDS} "
                         f"rows, so d_out must be a multiple of {CODEGEN_SHARDS}; got d_out={d_out}")


def _check_packed_bias(weight: np.ndarray, bias: np.ndarray | None, layout: str, packed: int, words: str) -> None:
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != packed):
        raise ValueError(
            f"the packed q/k/v bias must have shape ({packed},) ({words}, to match the weight "
            f"{tuple(weight.shape)} with layout={layout!r}); got {tuple(bias.shape)}"
        )


def _check_packed_heads(
    weight: np.ndarray, bias: np.ndarray | None, layout: str, packing: str, heads: tuple[int, int]
) -> int:
    """head_dim of a packed weight in a by-heads ``packing``, after every check."""
    axis = 1 if layout == "in_out" else 0
    shape = "(d_in, packed)" if layout == "in_out" else "(packed, d_in)"
    words, multiple = _heads_words(packing, heads)
    _rank("the packed q/k/v weight", weight, 2, f"{shape} for layout={layout!r}")
    packed = weight.shape[axis]
    if packed == 0 or packed % multiple:
        raise ValueError(
            f"the packed q/k/v weight {tuple(weight.shape)} does not fit packing={packing!r}: its packed "
            f"width along axis {axis} ({shape} for layout={layout!r}) must be {words}; got {packed}"
        )
    _check_packed_bias(weight, bias, layout, packed, "the packed width")
    return packed // multiple


def _rows(packing: str, heads: tuple[int, int] | None, head_dim: int) -> dict[str, np.ndarray | slice]:
    """Where query, key and value lie along the packed axis (rows of the (packed, d_in) weight)."""
    if packing == "codegen":  # (shards, [q, v, k], d_out / shards): row (shard, role, i)
        index = np.arange(3 * head_dim).reshape(CODEGEN_SHARDS, 3, head_dim // CODEGEN_SHARDS)
        return {role: index[:, i].reshape(-1) for role, i in (("query", 0), ("value", 1), ("key", 2))}
    if heads is None or packing == "thirds":
        return {role: slice(i * head_dim, (i + 1) * head_dim) for i, role in enumerate(ROLES)}
    h, hkv = heads
    if packing == "per_head":  # (num_heads, 3, head_dim): row (head, role, i)
        index = np.arange(3 * h * head_dim).reshape(h, 3, head_dim)
        return {role: index[:, i].reshape(-1) for i, role in enumerate(ROLES)}
    q, kv = h * head_dim, hkv * head_dim
    return {"query": slice(0, q), "key": slice(q, q + kv), "value": slice(q + kv, q + 2 * kv)}


def split_qkv(
    weight: Any,
    bias: Any = None,
    *,
    layout: str,
    packing: str = "thirds",
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """A packed q/k/v weight (and bias) -> {"query"|"key"|"value": (weight, bias or None)}.

    weight: (d_in, packed) for ``layout="in_out"``, (packed, d_in) for ``"out_in"``, with
    packed = 3*d_out for ``packing="thirds"`` (the default), ``"codegen"`` and ``"per_head"``
    (``num_heads`` required), (num_heads + 2*num_kv_heads)*head_dim for ``"grouped"``
    (both required).  bias: (packed,) or None.  Each returned weight is in PyTorch's (out,
    in) layout, (d_out, d_in) (key and value (num_kv_heads*head_dim, d_in) when grouped),
    each bias (d_out,).  Raises ValueError for a bad layout or packing, a weight not of
    rank 2 or whose packed width does not fit the packing, a bias that does not fit, heads
    missing or inconsistent; TypeError for non-floating arrays.
    """
    layout = check_layout(layout)
    packing = check_packing(packing)
    heads = _packing_heads(packing, num_heads, num_kv_heads)
    w = _float("the packed q/k/v weight", weight)
    b = None if bias is None else _float("the packed q/k/v bias", bias)
    if heads is None:
        _, width = _check_packed(w, b, layout, packing)
    else:
        width = _check_packed_heads(w, b, layout, packing, heads)
    out_in = w.T if layout == "in_out" else w
    rows = _rows(packing, heads, width)
    return {
        role: (np.array(out_in[rows[role]]), None if b is None else np.array(b[rows[role]]))
        for role in ROLES
    }


def join_qkv(
    query: Any,
    key: Any,
    value: Any,
    biases: Sequence[Any] | None = None,
    *,
    layout: str,
    packing: str = "thirds",
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Three weights in PyTorch's (out, in) layout (and optionally their three biases, in
    the order query, key, value) -> (packed weight, packed bias or None).

    ``packing="thirds"`` (the default) and ``"per_head"`` (``num_heads`` required): three
    (d_out, d_in) weights and (d_out,) biases; ``"grouped"`` (``num_heads`` and
    ``num_kv_heads`` required): query (num_heads*head_dim, d_in), key and value
    (num_kv_heads*head_dim, d_in).  The packed weight is (d_in, packed) for
    ``layout="in_out"``, (packed, d_in) for ``"out_in"``; the bias (packed,).
    ``split_qkv`` with the same arguments undoes it exactly.  Raises ValueError for a bad
    layout or packing, weights not of rank 2 or of shapes the packing does not take, a
    ``biases`` that is not three arrays that fit them; TypeError for non-floating arrays.
    """
    layout = check_layout(layout)
    packing = check_packing(packing)
    heads = _packing_heads(packing, num_heads, num_kv_heads)
    weights = [_float(f"the {r} weight", w) for r, w in zip(ROLES, (query, key, value), strict=True)]
    for role, w in zip(ROLES, weights, strict=True):
        _rank(f"the {role} weight", w, 2, "(d_out, d_in), PyTorch's layout")
    head_dim = _check_join_shapes(weights, packing, heads)
    dtypes = {w.dtype for w in weights}
    if len(dtypes) != 1:
        raise ValueError(
            "the query, key and value weights must have the same dtype; got "
            + ", ".join(str(w.dtype) for w in weights)
        )
    rows = _rows(packing, heads, head_dim)
    packed_bias = None
    if biases is not None:
        if isinstance(biases, (str, bytes)) or not isinstance(biases, Sequence) or len(biases) != 3:
            raise ValueError("biases must be None or a sequence of three arrays (query, key, value)")
        bs = [_float(f"the {r} bias", b) for r, b in zip(ROLES, biases, strict=True)]
        for role, b, w in zip(ROLES, bs, weights, strict=True):
            if b.shape != (w.shape[0],):
                raise ValueError(
                    f"the {role} bias must have shape ({w.shape[0]},) to match the weights "
                    f"{tuple(w.shape)}; got {tuple(b.shape)}"
                )
        if len({b.dtype for b in bs}) != 1:
            raise ValueError("the query, key and value biases must have the same dtype; got "
                             + ", ".join(str(b.dtype) for b in bs))
        packed_bias = _place(bs, rows)
    packed = _place(weights, rows)  # (packed, d_in)
    return (np.array(packed.T) if layout == "in_out" else packed), packed_bias


def _place(parts: Sequence[np.ndarray], rows: Mapping[str, np.ndarray | slice]) -> np.ndarray:
    """The packed array whose ``rows[role]`` hold each part (the inverse of indexing by rows)."""
    total = sum(p.shape[0] for p in parts)
    out = np.empty((total, *parts[0].shape[1:]), parts[0].dtype)
    for role, part in zip(ROLES, parts, strict=True):
        out[rows[role]] = part
    return out


def _check_join_shapes(weights: Sequence[np.ndarray], packing: str, heads: tuple[int, int] | None) -> int:
    """The width of one block of ``_rows`` (d_out, or head_dim for a by-heads packing)."""
    shapes = [tuple(w.shape) for w in weights]
    got = ", ".join(str(s) for s in shapes)
    if heads is None or packing == "per_head":
        if len(set(shapes)) != 1:
            raise ValueError(
                "the query, key and value weights must have the same shape (d_out, d_in); got " + got
            )
        if heads is None:
            _check_shards(packing, int(shapes[0][0]))
            return int(shapes[0][0])
        if shapes[0][0] % heads[0]:
            raise ValueError(f"the query, key and value weights {shapes[0]} do not fit packing='per_head': "
                             f"d_out must be num_heads*head_dim with num_heads={heads[0]}")
        return int(shapes[0][0]) // heads[0]
    h, hkv = heads
    q_width, d_in = shapes[0]
    head_dim = q_width // h
    want = [(q_width, d_in), (hkv * head_dim, d_in), (hkv * head_dim, d_in)]
    if q_width % h or shapes != want:
        raise ValueError(
            f"the query, key and value weights do not fit packing='grouped' (num_heads={h}, "
            f"num_kv_heads={hkv}): expected (num_heads*head_dim, d_in), then (num_kv_heads*head_dim, "
            f"d_in) twice{', ' + ', '.join(str(s) for s in want) if not q_width % h else ''}; got {got}"
        )
    return head_dim
