"""Checks of what blocks or drops keys: bool masks (``mask``, ``combine_masks``,
``causal_mask``, ``padding_mask``), additive masks, dropout keep-masks, ``kv_lengths``,
segment ids, ``q_offset`` arrays, and the foreign masks that the converters take
(``nn.MultiheadAttention``'s ``key_padding_mask``, Hugging Face's ``attention_mask``).

Shapes and dtype names in, the one error text of both twins out; the values of an array
are the framework's to read (the texts for them live here).
"""

from __future__ import annotations

from typing import Any

from attention_spec.arrays import FLOAT_DTYPES, as_shape, broadcasts, check_bool, dtype_name

ADDITIVE_BIAS_MESSAGE = (
    "additive mask holds values other than 0 and blocked (-inf or <= -1e4) (a bias); "
    "it cannot be converted to a bool mask without losing them"
)

# A value of an additive mask at or below this (after rounding to the mask's dtype), or
# -inf, means "blocked": exp(-1e4) underflows to 0 in every float dtype, and -1e4 is
# representable in float16 (unlike -1e9 or float32's lowest value).
ADDITIVE_BLOCKED_AT = -1.0e4


def check_mask(shape: Any, dtype: str, target: Any) -> None:
    """``mask`` must be bool (True = may attend) and broadcast to ``target``.

    ``target`` is ``(batch, heads, q_len, kv_len)``, or ``(heads, q_len, kv_len)`` for
    unbatched input.
    """
    check_bool("mask", dtype, "True = may attend")
    shape, target = as_shape(shape), as_shape(target)
    if not broadcasts(shape, target):
        names = "(batch, heads, q_len, kv_len)" if len(target) == 4 else "(heads, q_len, kv_len)"
        raise ValueError(f"mask of shape {shape} does not broadcast to {names} = {target}")


def check_masks_broadcast(shapes: Any, dtypes: Any) -> None:
    """``combine_masks``: bool masks whose shapes broadcast together (from the right)."""
    for dtype in dtypes:
        check_bool("mask", dtype, "True = may attend")
    shapes = [as_shape(s) for s in shapes]
    for axis in range(1, max([0] + [len(s) for s in shapes]) + 1):
        sizes = [s[-axis] for s in shapes if len(s) >= axis and s[-axis] != 1]
        if any(size != sizes[0] for size in sizes):
            listed = ", ".join(str(s) for s in shapes)
            raise ValueError(f"masks of shapes {listed} do not broadcast together")


def check_mask_lengths(q_len: Any, kv_len: Any) -> None:
    """``causal_mask(q_len, kv_len)``: non-negative Python ints."""
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
        if value.__index__() < 0:
            raise ValueError(f"{name} must be >= 0; got {value}")


def check_lengths_dtype(dtype: str) -> None:
    """``padding_mask(lengths, kv_len)``: the lengths are integers (a fraction is a bug)."""
    if dtype == "bool" or not dtype.startswith(("int", "uint")):
        raise TypeError(f"lengths must be an integer array; got dtype {dtype}")


def check_dropout_mask(
    shape: Any, dtype: str, target: Any, *, training: bool, rate: float | None = None
) -> None:
    """An explicit dropout keep-mask: bool (True = keep), broadcastable to the weights,
    only in training mode and with a dropout rate above 0 (otherwise dropout is off and
    the mask would be silently ignored).  ``rate=None``: the rate is not known here."""
    if not training:
        raise ValueError(
            "dropout_mask was given, but dropout is off: the module is in eval mode "
            "(deterministic); dropout applies in training mode only"
        )
    if rate is not None and rate == 0.0:
        raise ValueError(
            "dropout_mask was given, but dropout is off: the dropout rate is 0.0, so the "
            "mask would be ignored; give a rate > 0 or no dropout_mask"
        )
    check_bool("dropout_mask", dtype, "True = keep")
    shape, target = as_shape(shape), as_shape(target)
    if not broadcasts(shape, target):
        raise ValueError(
            f"dropout_mask of shape {shape} does not broadcast to the attention weights' "
            f"shape {target}"
        )


def check_kv_lengths(shape: Any, dtype: str, target: Any) -> None:
    """``kv_lengths``: int (B,), one valid key count per example, for (B, H, T, S) weights."""
    shape, target = as_shape(shape), as_shape(target)
    if not dtype.startswith(("int", "uint")):
        raise TypeError(f"kv_lengths must be an integer array; got dtype {dtype}")
    if len(target) != 4 or shape != target[:1]:
        raise ValueError(
            f"kv_lengths must have shape (batch,) for attention weights (batch, heads, q_len, "
            f"kv_len) = {target}; got shape {shape}"
        )


def check_kv_lengths_array(shape: Any, dtype: str, batch: int) -> None:
    """``kv_lengths`` as given to a functional core: integers of shape () (one length for
    every example) or (batch,).  ``dtype`` is a dtype name ("int64", "float32", "bool")."""
    shape = as_shape(shape)
    if dtype == "bool" or not dtype.startswith(("int", "uint")):
        raise TypeError(
            f"kv_lengths must hold integers (valid keys per example); got dtype {dtype}"
        )
    if shape not in ((), (batch,)):
        raise ValueError(
            f"kv_lengths must be an int or have shape (batch,) = ({batch},); got shape {shape}"
        )


def check_kv_lengths_values(lowest: int, highest: int, kv_len: int) -> None:
    """Every length must lie in [0, kv_len] (0 = nothing to attend to: a zero output)."""
    if lowest < 0 or highest > kv_len:
        raise ValueError(
            f"kv_lengths must lie in [0, kv_len] = [0, {kv_len}]; got values from {lowest} "
            f"to {highest}"
        )


def kv_lengths_rank_message(q_shape: Any) -> str:
    return (
        "kv_lengths needs q, k and v of shape (batch, heads, len, dim); got q of shape "
        f"{as_shape(q_shape)}"
    )


def rank_message(name: str, q_shape: Any) -> str:
    """An option that is given per example needs the (batch, heads, len, dim) layout."""
    return f"{name} needs q, k and v of shape (batch, heads, len, dim); got q of shape {as_shape(q_shape)}"


def check_q_offset_array(shape: Any, dtype: str, batch: int) -> None:
    """``q_offset``: the key position of query 0, an int or integers of shape (batch,)."""
    shape = as_shape(shape)
    if dtype == "bool" or not dtype.startswith(("int", "uint")):
        raise TypeError(f"q_offset must hold integers (the key position of query 0); got dtype {dtype}")
    if shape not in ((), (batch,)):
        raise ValueError(f"q_offset must be an int or have shape (batch,) = ({batch},); got shape {shape}")


def check_segment_ids(name: str, shape: Any, dtype: str, batch: int, length: int) -> None:
    """``segment_ids`` (B, T) / ``kv_segment_ids`` (B, S): integers, one id per token;
    tokens attend only to tokens of the same id."""
    shape = as_shape(shape)
    if dtype == "bool" or not dtype.startswith(("int", "uint")):
        raise TypeError(f"{name} must hold integers (one segment id per token); got dtype {dtype}")
    if shape != (batch, length):
        raise ValueError(f"{name} must have shape (batch, length) = ({batch}, {length}); got shape {shape}")


def segment_ids_pair(
    segment_ids: Any, kv_segment_ids: Any, *, batched: bool, batch: int, seq: int, kv_seq: int, cached: bool,
    as_array: Any,
) -> tuple[Any, Any]:
    """A module's segment ids as (B, T) / (B, S) integer arrays (``as_array`` converts to
    the framework's; an unbatched input gives (T,)), checked, or (None, None)."""
    if segment_ids is None and kv_segment_ids is None:
        return None, None
    if cached:
        raise ValueError("segment_ids cannot be combined with a cache")
    out: list[Any] = []
    for name, ids, length in (("segment_ids", segment_ids, seq), ("kv_segment_ids", kv_segment_ids, kv_seq)):
        if ids is None:
            out.append(None)
            continue
        ids = as_array(ids)
        shape = tuple(ids.shape) if batched else (1, *ids.shape)
        check_segment_ids(name, shape, dtype_name(ids.dtype), batch, length)
        out.append(ids.reshape(batch, length))
    if out[0] is None:
        raise ValueError("kv_segment_ids needs segment_ids for the queries")
    if out[1] is None and seq != kv_seq:
        raise ValueError(kv_segment_ids_message(seq, kv_seq))
    return out[0], out[1]


def kv_segment_ids_message(q_len: int, kv_len: int) -> str:
    return (
        f"segment_ids for queries of length {q_len} and keys of length {kv_len} need "
        "kv_segment_ids for the keys"
    )


# nn.MultiheadAttention's key_padding_mask and Hugging Face's attention_mask are both
# (batch, kv_len) but with opposite polarities, and a (batch, kv_len) mask given where a
# (q_len, kv_len) one is expected broadcasts silently when batch == q_len: the converters
# insist on rank 2 and on their own dtype, so that a mask cannot be read the wrong way.


def check_key_padding_mask(shape: Any, dtype: str) -> None:
    """``from_key_padding_mask``: bool (batch, kv_len), True = ignore this key.  A float
    key_padding_mask (nn.MultiheadAttention adds it to the scores) is refused: it is an
    additive mask, for ``from_additive_mask``.  Raises TypeError / ValueError."""
    if dtype in FLOAT_DTYPES:
        raise TypeError(
            f"key_padding_mask must be a bool array (True = ignore); got dtype {dtype}. A float "
            "key_padding_mask is additive (0 = attend, -inf = ignore): convert it with "
            "from_additive_mask(mask)[:, None, None, :]"
        )
    check_bool("key_padding_mask", dtype, "True = ignore, as nn.MultiheadAttention takes it")
    shape = as_shape(shape)
    if len(shape) != 2:
        raise ValueError(
            "key_padding_mask must have shape (batch, kv_len) (True = ignore); got a "
            f"{len(shape)}-d array of shape {shape}"
        )


HF_ATTENTION_MASK_VALUES_MESSAGE = (
    "attention_mask (Hugging Face: 1 = attend, 0 = padding) holds values other than 0 and 1"
)


def check_hf_attention_mask(shape: Any, dtype: str) -> None:
    """``from_hf_attention_mask``: integer or bool (batch, seq), 1 = attend, 0 = padding.
    A float mask is refused: 0 means attend in an additive mask and padding here, so a
    float mask's meaning cannot be told from its dtype.  Raises TypeError / ValueError;
    values other than 0 and 1 raise ``HF_ATTENTION_MASK_VALUES_MESSAGE`` (the caller
    checks them: the values are the framework's)."""
    if dtype != "bool" and not dtype.startswith(("int", "uint")):
        raise TypeError(
            "attention_mask (Hugging Face: 1 = attend, 0 = padding) must be an integer or bool "
            f"array; got dtype {dtype}. A float mask may be additive (0 = attend): convert that "
            "with from_additive_mask"
        )
    shape = as_shape(shape)
    if len(shape) != 2:
        raise ValueError(
            "attention_mask (Hugging Face: 1 = attend, 0 = padding) must have shape "
            f"(batch, seq); got a {len(shape)}-d array of shape {shape}"
        )
