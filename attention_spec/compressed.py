"""DeepSeek-V4's attention (``CompressedAttention`` in both twins), framework-free: its
options (``check_compressed_options`` -> ``CompressedGeometry``, one frozen record, one
text per error for both twins), its call's checks (``check_compressed_call``) and the
visibility rules every path and the float64 oracle read.

The layer, x (B, T, d_in) -> (B, T, d_in), H heads of width D, the rope slice the
trailing ``rope_dim`` features of each head (interleaved pairs), position p of token t
its index in the sequence (0.. without a cache, the cache's length onward with one):

    q_res = rms(q_a_proj x) * q_a_norm                       (B, T, q_lora_rank), weighted
    q     = rms(q_b_proj q_res)  per head, no weight         (B, H, T, D), rope at p
    kv    = rms(kv_proj x) * kv_norm                         (B, 1, T, D), rope at p: one KV
                                                             head, read as keys and values
    keys  = [the window's kv | compressed entries]           a query at p sees kv at
                                                             p - window < j <= p, and entry
                                                             w iff w < (p + 1) // rate
                                                             (``csa``: and the indexer
                                                             chose it)
    o     = softmax attention, scale D ** -0.5, sinks (H,)   (B, H, T, D)
    o     = rope of o's rope slice at -p                     undoes the rotation the
                                                             values carry
    out   = o_b_proj(o_a_proj(o))                            o_a_proj block-diagonal: the
                                                             heads in ``o_groups`` groups,
                                                             each to ``o_lora_rank``

The compressor (``compression="hca"`` or ``"csa"``) turns every ``compress_rate`` tokens
into one entry: c = compressor.kv_proj x, z = compressor.gate_proj x + position_bias
(per slot of the window); entry w = kv_norm(sum_j softmax_j(z) * c_j) over the window's
tokens (``hca``: the window's ``rate`` tokens; ``csa``: the previous window's first half
of c and z beside this window's second half, ``2 * rate`` slots, the first window's
missing half weight 0), then rope at position ``w * rate``.  ``csa``'s indexer has its
own compressor (at ``index_head_dim``) and queries ``indexer.q_b_proj q_res`` (rope at
p); its score of entry w for query p is ``sum_h (weights_proj x)_h / sqrt(index_heads)
* relu(q_h . k_w) / sqrt(index_head_dim)``; each query keeps its ``index_topk`` best
visible entries (not differentiated, as in transformers).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from attention_spec.arrays import as_shape
from attention_spec.options import check_positive_int

COMPRESSIONS = (None, "hca", "csa")
NAME = "CompressedAttention"


class CompressedGeometry(NamedTuple):
    """A ``CompressedAttention``'s options, checked (``check_compressed_options``)."""

    d_in: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compression: str | None
    compress_rate: int | None
    index_heads: int | None
    index_head_dim: int | None
    index_topk: int | None
    norm_eps: float

    @property
    def compressed_width(self) -> int:
        """The compressor's projections' width: D (``hca``), 2 D (``csa``: two series)."""
        return (2 if self.compression == "csa" else 1) * self.head_dim


def check_compressed_options(d_in: Any, num_heads: Any, head_dim: Any, q_lora_rank: Any, o_groups: Any,
                             o_lora_rank: Any, window: Any, rope: Any, compression: Any, compress_rate: Any,
                             index_heads: Any, index_head_dim: Any, index_topk: Any,
                             norm_eps: Any) -> CompressedGeometry:
    """The constructor keywords, checked before anything is built; one text for both
    twins.  ``rope`` must be a ``RopeConfig`` of layout ``"interleaved"`` with fixed
    frequencies (not ``"dynamic"`` / ``"longrope"``), turning an even ``rope_dim`` <=
    head_dim (and <= index_head_dim)."""
    from attention_spec.rope import RopeConfig, check_rope, needs_seq_len, rotary_dim

    for name, value in (("d_in", d_in), ("num_heads", num_heads), ("head_dim", head_dim),
                        ("q_lora_rank", q_lora_rank), ("o_groups", o_groups), ("o_lora_rank", o_lora_rank),
                        ("window", window)):
        check_positive_int(name, value)
    if (num_heads * head_dim) % o_groups:
        raise ValueError(f"{NAME}: num_heads * head_dim ({num_heads * head_dim}) must be a multiple of o_groups "
                         f"({o_groups})")
    if not isinstance(rope, RopeConfig):
        raise TypeError(f"{NAME} takes rope= a RopeConfig (its rope is part of the layer); got "
                        f"{type(rope).__name__}")
    check_rope(rope, head_dim)
    if rope.layout != "interleaved":
        raise ValueError(f"{NAME} turns interleaved pairs (DeepSeek-V4's rope): rope layout must be 'interleaved'; "
                         f"got {rope.layout!r}")
    if needs_seq_len(rope):
        raise ValueError(f"{NAME} takes a rope of fixed frequencies; got scaling {rope.scaling!r}")
    rope_dim = rotary_dim(rope, head_dim)
    if compression not in COMPRESSIONS:
        raise ValueError(f"{NAME}: compression must be None, 'hca' or 'csa'; got {compression!r}")
    index = {"index_heads": index_heads, "index_head_dim": index_head_dim, "index_topk": index_topk}
    if compression is None:
        given = [n for n, v in (("compress_rate", compress_rate), *index.items()) if v is not None]
        if given:
            raise ValueError(f"{NAME}: {', '.join(given)} need compression='hca' or 'csa'; got compression=None")
    else:
        check_positive_int("compress_rate", compress_rate)
    if compression == "hca":
        given = [n for n, v in index.items() if v is not None]
        if given:
            raise ValueError(f"{NAME}: {', '.join(given)} belong to compression='csa' (its indexer); "
                             "compression='hca' has no indexer")
    if compression == "csa":
        for name, value in index.items():
            check_positive_int(name, value)
        if rope_dim > index_head_dim:
            raise ValueError(f"{NAME}: the rope slice ({rope_dim}) must fit the indexer's heads (index_head_dim "
                             f"{index_head_dim})")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not (0 < norm_eps < math.inf):
        raise ValueError(f"norm_eps must be a positive finite number; got {norm_eps!r}")
    return CompressedGeometry(d_in, num_heads, head_dim, rope_dim, q_lora_rank, o_groups, o_lora_rank, window,
                              compression, compress_rate, index_heads, index_head_dim, index_topk, float(norm_eps))


def visible_entries(position: int, rate: int) -> int:
    """How many compressed entries the query at ``position`` sees: those of the windows
    that end at or before it, ``(position + 1) // rate``."""
    return (position + 1) // rate


def cache_shapes(g: CompressedGeometry, batch: int, length: int) -> dict[str, tuple[int, ...] | None]:
    """The arrays of a cache after ``length`` tokens, by field: ``keys`` (B, 1, min(length,
    window - 1), D), the last keys the window still needs (rotated); the compressor's
    ``buffer_kv`` / ``buffer_gate`` (B, length % rate, width), the tokens of the open
    window (projected; the gate before ``position_bias``); ``entries`` (B, length // rate,
    D); ``csa``'s ``overlap_kv`` / ``overlap_gate`` (B, rate, D), the last closed window's
    first half (its gate with ``position_bias``; zeros and -inf before any window closed);
    and the indexer's five, at ``index_head_dim`` (None where the layer has none)."""
    shapes: dict[str, tuple[int, ...] | None] = {"keys": (batch, 1, min(length, g.window - 1), g.head_dim)}
    names = ("buffer_kv", "buffer_gate", "entries", "overlap_kv", "overlap_gate")
    for prefix, width in (("", g.head_dim), ("index_", g.index_head_dim)):
        for name in names:
            shapes[prefix + name] = None
        if g.compression is None or (prefix and g.compression != "csa"):
            continue
        assert g.compress_rate is not None and width is not None
        rate, series = g.compress_rate, 2 if g.compression == "csa" else 1
        shapes[prefix + "buffer_kv"] = shapes[prefix + "buffer_gate"] = (batch, length % rate, series * width)
        shapes[prefix + "entries"] = (batch, length // rate, width)
        if g.compression == "csa":
            shapes[prefix + "overlap_kv"] = shapes[prefix + "overlap_gate"] = (batch, rate, width)
    return shapes


CACHE_FIELDS = ("keys", "buffer_kv", "buffer_gate", "entries", "overlap_kv", "overlap_gate", "index_buffer_kv",
                "index_buffer_gate", "index_entries", "index_overlap_kv", "index_overlap_gate")


SELECTION_ONLY_CSA = (f"{NAME}: selection= is the choice of CSA's indexer (compression='csa'); this layer has "
                      "none")


def check_compressed_selection(g: CompressedGeometry, batch: int, tokens: int, length: int, shape: Any,
                               dtype: str) -> None:
    """A call's ``selection=`` (the compressed entries each query attends to, in place of
    the indexer's choice): bool (B, T, W), W the entries after the call, ``(length + T)
    // rate``; only with ``compression="csa"``."""
    if g.compression != "csa":
        raise ValueError(SELECTION_ONLY_CSA)
    assert g.compress_rate is not None
    want = (batch, tokens, (length + tokens) // g.compress_rate)
    if tuple(as_shape(shape)) != want or dtype != "bool":
        raise ValueError(f"{NAME}: selection must be bool (B, T, W) = {want} (W: the compressed entries after "
                         f"the call); got {dtype} {tuple(as_shape(shape))}")


def check_compressed_mask(mask: Any) -> None:
    """A call's ``mask=``: refused whatever it holds (None passes).  DeepSeek-V4's attention
    has no padding mask here: its compressors pool every ``compress_rate`` consecutive
    tokens and its cache counts tokens from 0, so a left-padded row's pads would enter its
    compressed entries and its positions; batch rows of one length (no padding) only."""
    if mask is not None:
        raise ValueError(NO_MASK)


NO_MASK = (f"{NAME} takes no mask (no padding: its compressors pool every compress_rate consecutive tokens, pads "
           "included, and token t sits at position cache.length + t); call it on rows of one length, without "
           "padding")


def check_compressed_call(g: CompressedGeometry, x_shape: Any, x_dtype: str, compute: str,
                          cache: Any) -> tuple[int, int, int]:
    """A call, before any work: x (B, T, d_in), T >= 1, in the module's compute dtype;
    ``cache`` None, or (length, {field: (shape, dtype) or None}) of a ``CompressedCache``
    (every array in ``compute``, shaped as ``cache_shapes`` says for its length), or the
    string ``"not a CompressedCache"``.  Returns (B, T, the cache's length or 0);
    ValueError / TypeError, one text for both twins."""
    shape = as_shape(x_shape)
    if len(shape) != 3 or shape[2] != g.d_in or shape[1] == 0:
        raise ValueError(f"{NAME} takes x of shape (batch, tokens, d_in={g.d_in}), tokens >= 1; got {shape}")
    if x_dtype != compute:
        raise TypeError(f"{NAME} takes x in its compute dtype {compute}; got {x_dtype}")
    batch, tokens = shape[0], shape[1]
    if cache is None:
        return batch, tokens, 0
    if isinstance(cache, str) or isinstance(cache[0], bool) or not isinstance(cache[0], int) or cache[0] < 0:
        raise ValueError(f"{NAME}'s cache must be a CompressedCache from its init_cache(batch_size={batch}); "
                         f"got {cache if isinstance(cache, str) else 'length ' + repr(cache[0])}")
    length, fields = cache
    want = cache_shapes(g, batch, length)
    wrong = [f"{name} {fields.get(name)}" for name in CACHE_FIELDS
             if (want[name] is None) != (fields.get(name) is None)
             or (want[name] is not None and tuple(fields[name]) != (want[name], compute))]
    if wrong:
        expected = ", ".join(f"{n} {want[n]}" for n in CACHE_FIELDS if want[n] is not None)
        raise ValueError(f"{NAME}'s cache must be a CompressedCache from its init_cache(batch_size={batch}), "
                         f"{length} tokens in: {expected} in {compute}; got {', '.join(wrong)}")
    return batch, tokens, length
