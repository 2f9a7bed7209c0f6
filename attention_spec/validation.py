"""Argument and shape checks shared by both twins, with the one text of each error.

Every function takes plain Python values (ints, tuples of ints, dtype *names*) so that it
runs before any framework work and cannot change a module's state.  The frameworks call
them with ``tuple(x.shape)`` and ``dtype_name(x.dtype)``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

Shape = tuple[int, ...]

MASK_STRATEGIES = ("fill", "renormalize")
NORMALIZATIONS = ("softmax", "sum")
IMPLEMENTATIONS = ("auto", "reference", "fused", "blockwise")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` and ``jnp.float32`` both become ``"float32"``."""
    name = str(dtype)
    return name.removeprefix("torch.")


def _shape(shape: Any) -> Shape:
    return tuple(int(s) for s in shape)


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {options}; got {value!r}")
    return value


# --------------------------------------------------------------------------- configuration


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return value


def check_heads(d_out: Any, num_heads: Any) -> int:
    """Checks ``num_heads`` and that ``d_out`` splits evenly into heads; returns head_dim."""
    check_positive_int("d_out", d_out)
    check_positive_int("num_heads", num_heads)
    if d_out % num_heads:
        raise ValueError(
            f"d_out must be divisible by num_heads; got d_out={d_out}, num_heads={num_heads}"
        )
    return d_out // num_heads


def check_dropout_rate(rate: Any) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1); got {type(rate).__name__} {rate!r}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout must be in [0, 1); got {rate}")
    return float(rate)


def _is_real(value: Any) -> bool:
    """A Python or NumPy real number (``np.float32(0.5)``, ``np.int64(2)``), not a bool
    (``np.bool_`` is no ``numbers.Real``) and not an array."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_scale(scale: Any) -> float | None:
    """``scale``: None, or a positive finite number (a NumPy scalar included); returns a
    Python float.  Raises TypeError (not a number, or a bool) or ValueError."""
    if scale is None:
        return None
    if not _is_real(scale):
        raise TypeError(f"scale must be None or a float; got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be None or a positive finite number; got {scale}")
    return float(scale)


def check_mask_strategy(value: Any) -> str:
    return _one_of("mask_strategy", value, MASK_STRATEGIES)


def check_normalization(value: Any) -> str:
    return _one_of("normalization", value, NORMALIZATIONS)


def check_implementation(value: Any) -> str:
    return _one_of("implementation", value, IMPLEMENTATIONS)


def check_linear(x_shape: tuple[int, ...], weight_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None,
                 *, layout: str) -> None:
    """A projection's operands: x (..., d_in), a weight of d_in input and d_out output
    features laid out ``"in_out"`` (Flax's kernel (d_in, d_out)) or ``"out_in"``
    (PyTorch's weight (d_out, d_in)), a bias (d_out,)."""
    if layout not in ("in_out", "out_in"):
        raise ValueError(f"linear: layout must be 'in_out' or 'out_in'; got {layout!r}")
    if len(weight_shape) != 2:
        raise ValueError(f"linear: the weight must be a matrix; got shape {tuple(weight_shape)}")
    d_in, d_out = weight_shape if layout == "in_out" else weight_shape[::-1]
    if len(x_shape) < 1 or x_shape[-1] != d_in:
        raise ValueError(f"linear: x must end in the weight's {d_in} input features; got shape {tuple(x_shape)}")
    if bias_shape is not None and tuple(bias_shape) != (d_out,):
        raise ValueError(f"linear: the bias must have shape ({d_out},) (the weight's output features); "
                         f"got {tuple(bias_shape)}")


# --------------------------------------------------------------------------- arrays


def check_bool(name: str, dtype: str, meaning: str) -> None:
    if dtype != "bool":
        raise TypeError(f"{name} must be a bool array ({meaning}); got dtype {dtype}")


def check_floating(name: str, dtype: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point array; got dtype {dtype}")


ADDITIVE_BIAS_MESSAGE = (
    "additive mask holds values other than 0 and blocked (-inf or <= -1e4) (a bias); "
    "it cannot be converted to a bool mask without losing them"
)


def check_input(
    shape: Any, dtype: str, *, d_in: int | None, context_length: int | None = None
) -> bool:
    """Checks a module input ``x``; returns whether it is batched.

    Raises:
      ValueError: rank not 2 or 3, last dimension != d_in, empty sequence, or a sequence
        longer than ``context_length``.
      TypeError: a dtype that is not floating point.
    """
    shape = _shape(shape)
    if len(shape) not in (2, 3):
        raise ValueError(
            "x must have shape (batch, seq, d_in) or (seq, d_in); "
            f"got a {len(shape)}-d array of shape {shape}"
        )
    check_floating("x", dtype)
    if d_in is not None and shape[-1] != d_in:
        raise ValueError(f"x has last dimension {shape[-1]} but the module expects d_in={d_in}")
    seq = shape[-2]
    if seq == 0:
        raise ValueError(f"x has an empty sequence: shape {shape}")
    if context_length is not None and seq > context_length:
        raise ValueError(
            f"sequence length {seq} exceeds context_length {context_length}"
        )
    return len(shape) == 3


def _broadcasts(shape: Shape, target: Shape) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target[len(target) - len(shape):]), strict=True))


def check_mask(shape: Any, dtype: str, target: Any) -> None:
    """``mask`` must be bool (True = may attend) and broadcast to ``target``.

    ``target`` is ``(batch, heads, q_len, kv_len)``, or ``(heads, q_len, kv_len)`` for
    unbatched input.
    """
    check_bool("mask", dtype, "True = may attend")
    shape, target = _shape(shape), _shape(target)
    if not _broadcasts(shape, target):
        names = "(batch, heads, q_len, kv_len)" if len(target) == 4 else "(heads, q_len, kv_len)"
        raise ValueError(f"mask of shape {shape} does not broadcast to {names} = {target}")


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
    shape, target = _shape(shape), _shape(target)
    if not _broadcasts(shape, target):
        raise ValueError(
            f"dropout_mask of shape {shape} does not broadcast to the attention weights' "
            f"shape {target}"
        )


def check_kv_lengths(shape: Any, dtype: str, target: Any) -> None:
    """``kv_lengths``: int (B,), one valid key count per example, for (B, H, T, S) weights."""
    shape, target = _shape(shape), _shape(target)
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
    shape = _shape(shape)
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
        f"{_shape(q_shape)}"
    )


def check_lengths_dtype(dtype: str) -> None:
    """``padding_mask(lengths, kv_len)``: the lengths are integers (a fraction is a bug)."""
    if dtype == "bool" or not dtype.startswith(("int", "uint")):
        raise TypeError(f"lengths must be an integer array; got dtype {dtype}")


def check_mask_lengths(q_len: Any, kv_len: Any) -> None:
    """``causal_mask(q_len, kv_len)``: non-negative Python ints."""
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
        if value.__index__() < 0:
            raise ValueError(f"{name} must be >= 0; got {value}")


def check_masks_broadcast(shapes: Any, dtypes: Any) -> None:
    """``combine_masks``: bool masks whose shapes broadcast together (from the right)."""
    for dtype in dtypes:
        check_bool("mask", dtype, "True = may attend")
    shapes = [_shape(s) for s in shapes]
    for axis in range(1, max([0] + [len(s) for s in shapes]) + 1):
        sizes = [s[-axis] for s in shapes if len(s) >= axis and s[-axis] != 1]
        if any(size != sizes[0] for size in sizes):
            listed = ", ".join(str(s) for s in shapes)
            raise ValueError(f"masks of shapes {listed} do not broadcast together")


# A value of an additive mask at or below this (after rounding to the mask's dtype), or
# -inf, means "blocked": exp(-1e4) underflows to 0 in every float dtype, and -1e4 is
# representable in float16 (unlike -1e9 or float32's lowest value).
ADDITIVE_BLOCKED_AT = -1.0e4

# Why an explicit "fused" refuses float64 (both frameworks, one behaviour): JAX's fused
# attention computes float64 with float32 accuracy; "auto" sends float64 to a path that
# stays float64.
FUSED_FLOAT64_BLOCKER = "float64 inputs (the fused kernel does not guarantee float64 accuracy)"


def check_qkv(q: Any, k: Any, v: Any, dtypes: tuple[str, str, str]) -> None:
    """Shapes ``(..., q_len, d)``, ``(..., kv_len, d)``, ``(..., kv_len, d_v)``, one dtype."""
    q, k, v = _shape(q), _shape(k), _shape(v)
    got = f"got q {q}, k {k}, v {v}"
    if not (len(q) == len(k) == len(v)) or len(q) < 2:
        raise ValueError(f"q, k and v must have the same rank, at least 2; {got}")
    if k[:-2] != v[:-2]:
        raise ValueError(f"k and v must have the same leading (batch, heads) dimensions; {got}")
    grouped = len(q) >= 3 and q[:-3] == k[:-3] and k[-3] >= 1 and q[-3] % k[-3] == 0
    if q[:-2] != k[:-2] and not grouped:
        raise ValueError(
            "q, k and v must have the same leading (batch, heads) dimensions, or k and v "
            f"fewer heads that divide q's (grouped-query attention); {got}"
        )
    if q[-1] != k[-1]:
        raise ValueError(f"q and k must have the same last dimension (head_dim); {got}")
    if k[-2] != v[-2]:
        raise ValueError(f"k and v must have the same length (kv_len); {got}")
    if q[-2] == 0 or k[-2] == 0:
        raise ValueError(f"q, k and v must not have an empty sequence; {got}")
    if len(set(dtypes)) != 1 or dtypes[0] not in FLOAT_DTYPES:
        raise TypeError(
            "q, k and v must share one floating-point dtype; got "
            f"{dtypes[0]}, {dtypes[1]}, {dtypes[2]}"
        )


def zero_row_sum_message() -> str:
    return (
        "normalization='sum' divides each row of scores by its sum, and a row sums to zero; "
        "use normalization='softmax'"
    )


_UNSET: Any = object()


def check_config(
    *,
    d_in: Any = _UNSET,
    d_out: Any = _UNSET,
    head_size: Any = _UNSET,
    context_length: Any = _UNSET,
    num_heads: Any = _UNSET,
    dropout: Any = _UNSET,
    scale: Any = _UNSET,
    causal: Any = _UNSET,
    mask_strategy: Any = _UNSET,
    normalization: Any = _UNSET,
    implementation: Any = _UNSET,
) -> None:
    """Checks the constructor arguments that a module has (the others stay unset)."""
    for name, value in (
        ("d_in", d_in), ("d_out", d_out), ("head_size", head_size),
        ("context_length", context_length),
    ):
        if value is not _UNSET:
            check_positive_int(name, value)
    if num_heads is not _UNSET:
        check_heads(d_out, num_heads)
    if dropout is not _UNSET:
        check_dropout_rate(dropout)
    if scale is not _UNSET:
        check_scale(scale)
    if causal is not _UNSET and not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__} {causal!r}")
    if mask_strategy is not _UNSET:
        check_mask_strategy(mask_strategy)
    if normalization is not _UNSET:
        check_normalization(normalization)
    if implementation is not _UNSET:
        check_implementation(implementation)


# --------------------------------------------------------------------------- modules (appended by the modules' owner)


def check_compute_dtype(x_dtype: str, compute_dtype: str | None, name: str = "x") -> None:
    """A module computes in one dtype (PyTorch: its parameters'; Flax: ``dtype``, else
    ``param_dtype``); ``x`` must come in that dtype, in both frameworks alike: PyTorch
    would fail inside a matmul and JAX would silently promote.  ``compute_dtype=None``
    (a module without parameters) computes in ``x``'s dtype.  ``name``: the input
    checked (``"x"``, or a context input).  Raises TypeError."""
    if compute_dtype is not None and x_dtype != compute_dtype:
        raise TypeError(
            f"{name} has dtype {x_dtype} but the module computes in {compute_dtype}; cast {name} first"
        )


# --------------------------------------------------------------------------- foreign masks (appended by the torch-native helper)
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
    shape = _shape(shape)
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
    shape = _shape(shape)
    if len(shape) != 2:
        raise ValueError(
            "attention_mask (Hugging Face: 1 = attend, 0 = padding) must have shape "
            f"(batch, seq); got a {len(shape)}-d array of shape {shape}"
        )


# --------------------------------------------------------------------------- bias and soft-capping (issue 9 items 4, 7)
# Order on every path and in the oracle: s = scale * q.k; s = softcap * tanh(s / softcap)
# (Gemma 2 caps the raw logits); s = s + bias (a position bias such as ALiBi is added to
# the capped logits, as Gemma 2 adds its attention mask after the cap); then masking.

SOFTCAP_FUSED_BLOCKER = "softcap (the fused kernel has no logit soft-capping)"


def fused_blockers(float64: bool, softcap: float | None) -> tuple[str, ...]:
    """What the fused kernels of both twins cannot honour beyond ``resolve_implementation``'s
    common list: float64 inputs (``float64``) and soft-capping."""
    return ((FUSED_FLOAT64_BLOCKER,) if float64 else ()) + ((SOFTCAP_FUSED_BLOCKER,) if softcap is not None else ())


def check_explicit_path(
    implementation: str,
    *,
    fused_draws_dropout: bool,
    float64: bool,
    softcap: float | None,
    return_weights: bool,
    normalization: str,
    dropout_active: bool,
    dropout_mask_given: bool,
) -> None:
    """Raises the ``ValueError`` that ``dot_product_attention`` raises for an explicit
    ``implementation`` that cannot honour these options, from the options alone: a
    module asks it before any work, a cached call before it writes its cache.  (An
    explicit path's refusals do not depend on the preference order of ``"auto"``;
    ``fused_draws_dropout`` is the twin's: SDPA draws it, JAX's fused kernels cannot.)"""
    from attention_spec.routing import resolve_implementation

    if implementation in ("auto", "reference"):
        return  # they refuse nothing: "auto" falls back to the reference math
    resolve_implementation(
        implementation, preference=(), return_weights=return_weights, normalization=normalization,
        dropout_active=dropout_active, dropout_mask_given=dropout_mask_given,
        fused_draws_dropout=fused_draws_dropout, fused_blockers=fused_blockers(float64, softcap),
    )


def check_bias(shape: Any, dtype: str, target: Any) -> None:
    """``bias``: a floating-point array added to the scaled scores, broadcastable to
    ``target`` = (batch, heads, q_len, kv_len).  Raises TypeError / ValueError."""
    check_floating("bias", dtype)
    shape, target = _shape(shape), _shape(target)
    if not _broadcasts(shape, target):
        names = "(batch, heads, q_len, kv_len)" if len(target) == 4 else "(heads, q_len, kv_len)"
        raise ValueError(f"bias of shape {shape} does not broadcast to {names} = {target}")


def check_softcap(softcap: Any) -> float | None:
    """``softcap``: None (off) or a positive finite number (a NumPy scalar included);
    returns a Python float.  Raises ValueError."""
    if softcap is None:
        return None
    if not _is_real(softcap) or not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a positive finite float; got {softcap!r}")
    return float(softcap)


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi head slopes of Press et al.: for n a power of two, 2^(-8 i / n) for
    i = 1..n; otherwise those of the nearest lower power of two followed by every other
    slope of twice that many heads (the interpolation of the reference code, HF's BLOOM).
    Raises TypeError / ValueError for a num_heads that is not a positive int."""
    check_positive_int("num_heads", num_heads)

    def powers(n: int) -> list[float]:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    closest = 2 ** math.floor(math.log2(num_heads))
    if closest == num_heads:
        return powers(num_heads)
    return powers(closest) + powers(2 * closest)[0::2][: num_heads - closest]


# --------------------------------------------------------------------------- issue 9 options

ALIGNMENTS = ("top_left", "bottom_right")


def check_alignment(value: Any) -> str:
    """Where query 0 sits among the keys for ``causal`` and ``window``: ``"top_left"`` (at
    key 0) or ``"bottom_right"`` (at key kv_len - q_len: the last query sees the last key)."""
    return _one_of("alignment", value, ALIGNMENTS)


def _is_int(value: Any) -> bool:
    """A Python or NumPy integer (``np.int64(2)``), or another integer-like scalar; not a
    bool and not an array (a NumPy scalar has a shape, (), but is ``numbers.Integral``)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral) or (hasattr(value, "__index__") and not hasattr(value, "shape"))


def check_window(window: Any) -> tuple[int | None, int | None] | None:
    """``window=(left, right)``: query at position p may attend to keys p - left .. p + right
    (inclusive); None on a side is unbounded there.  Returns the pair as Python ints, or
    None for no window (None, or (None, None))."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints >= 0 or None; got {window!r}")
    pair = []
    for side, value in zip(("left", "right"), window, strict=True):
        if value is not None and not _is_int(value):
            raise TypeError(
                f"window must be None or a pair (left, right) of ints >= 0 or None; got {window!r}"
            )
        if value is not None and value.__index__() < 0:
            raise ValueError(f"window {side} must be >= 0 or None; got {value}")
        pair.append(None if value is None else value.__index__())
    left, right = pair
    return None if left is None and right is None else (left, right)


def check_kv_heads(num_heads: Any, num_kv_heads: Any) -> int:
    """``num_kv_heads`` (grouped-query attention): a positive int dividing ``num_heads``;
    returns it (None -> ``num_heads``)."""
    if num_kv_heads is None:
        return int(num_heads)
    check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads; got num_heads={num_heads}, "
            f"num_kv_heads={num_kv_heads}"
        )
    return int(num_kv_heads)


def check_optional_width(name: str, value: Any) -> int | None:
    """``kdim`` / ``vdim``: None (= d_in) or a positive int."""
    return None if value is None else check_positive_int(name, value)


def check_segment_ids(name: str, shape: Any, dtype: str, batch: int, length: int) -> None:
    """``segment_ids`` (B, T) / ``kv_segment_ids`` (B, S): integers, one id per token;
    tokens attend only to tokens of the same id."""
    shape = _shape(shape)
    if dtype == "bool" or not dtype.startswith(("int", "uint")):
        raise TypeError(f"{name} must hold integers (one segment id per token); got dtype {dtype}")
    if shape != (batch, length):
        raise ValueError(f"{name} must have shape (batch, length) = ({batch}, {length}); got shape {shape}")


def context_pair(context: Any) -> tuple[Any, Any]:
    """A module's ``context`` -> (key input, value input): None, one array for both, or a pair."""
    if context is None:
        return None, None
    if isinstance(context, (tuple, list)):
        if len(context) != 2:
            raise TypeError(f"context must be an array or a pair (key_input, value_input); got {len(context)} items")
        return context[0], context[1]
    return context, context


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


def rank_message(name: str, q_shape: Any) -> str:
    """An option that is given per example needs the (batch, heads, len, dim) layout."""
    return f"{name} needs q, k and v of shape (batch, heads, len, dim); got q of shape {_shape(q_shape)}"


def kv_segment_ids_message(q_len: int, kv_len: int) -> str:
    return (
        f"segment_ids for queries of length {q_len} and keys of length {kv_len} need "
        "kv_segment_ids for the keys"
    )


def check_q_offset_array(shape: Any, dtype: str, batch: int) -> None:
    """``q_offset``: the key position of query 0, an int or integers of shape (batch,)."""
    shape = _shape(shape)
    if dtype == "bool" or not dtype.startswith(("int", "uint")):
        raise TypeError(f"q_offset must hold integers (the key position of query 0); got dtype {dtype}")
    if shape not in ((), (batch,)):
        raise ValueError(f"q_offset must be an int or have shape (batch,) = ({batch},); got shape {shape}")


def check_context(x_shape: Any, context_shape: Any, name: str, width: int) -> None:
    """Cross-attention input ``context`` (or one of its pair): (B, S, width) for a batched
    x (B, T, d_in), (S, width) for an unbatched one."""
    x, c = _shape(x_shape), _shape(context_shape)
    if len(c) != len(x):
        raise ValueError(f"{name} must have the rank of x ({len(x)}); got shape {c} for x of shape {x}")
    if len(x) == 3 and c[0] != x[0]:
        raise ValueError(f"{name} and x must have the same batch size; got {c[0]} and {x[0]}")
    if c[-1] != width:
        raise ValueError(f"{name} must have width {width} (its last dimension); got shape {c}")
    if c[-2] == 0:
        raise ValueError(f"{name} must not be empty; got shape {c}")


CACHE_NEEDS_INIT_MESSAGE = "cache must come from module.init_cache(batch_size, max_len); got {got}"


def check_cache_call(x_shape: Any, *, batched: bool, has_context: bool) -> None:
    """A module call with a cache: self-attention on batched x (B, T, d_in), B >= 1 (a
    cache has at least one example: ``init_cache`` refuses batch_size 0)."""
    if has_context:
        raise ValueError("a cache is for self-attention decoding; context must be None")
    if not batched:
        raise ValueError(f"a call with a cache needs batched x (batch, len, d_in); got shape {_shape(x_shape)}")
    if _shape(x_shape)[0] == 0:
        raise ValueError(
            "a call with a cache needs at least one example (init_cache takes batch_size >= 1); "
            f"got x of shape {_shape(x_shape)}"
        )


def check_cache_dtype(dtype: str) -> None:
    """A KV cache's keys and values are floating point (``init_cache``'s ``dtype``, and a
    cache given to a call): an integer or bool cache would truncate them.  Raises TypeError."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"a KV cache must hold floating-point keys and values; got dtype {dtype}")


def check_cache_context(max_len: int, context_length: int | None) -> None:
    """A module with a ``context_length`` refuses a longer sequence, and decoding through a
    cache is a sequence too: a cache never holds more than ``context_length`` positions
    (``init_cache``'s ``max_len``, and a cache given to a call).  Raises ValueError."""
    if context_length is not None and max_len > context_length:
        raise ValueError(
            f"a KV cache of max_len={max_len} does not fit context_length {context_length}: the module "
            "attends over at most context_length positions (a longer sequence is refused, decoded or not)"
        )


def check_cache_room(index_max: int, new: int, max_len: int) -> None:
    """A decode step appends ``new`` positions to a cache that holds ``index_max`` (the
    fullest example's) of ``max_len``."""
    if index_max + new > max_len:
        raise ValueError(
            f"the KV cache holds {index_max} of max_len={max_len} positions and cannot take "
            f"{new} more; init_cache with a larger max_len"
        )




def check_cache(fields: Any, batch: int, kv_heads: int, key_width: int, value_width: int) -> int:
    """A KV cache ``(key, value, lengths)`` from ``init_cache``: key (B, Hkv, max_len, D),
    value (B, Hkv, max_len, Dv), lengths (B,) integers; returns max_len.  ``fields`` holds
    each field's (shape, dtype name), or is None for something that is not a cache."""
    if fields is None:
        raise TypeError(CACHE_NEEDS_INIT_MESSAGE.format(got="something else"))
    (key, key_dtype), (value, value_dtype), (index, index_dtype) = ((_shape(s), d) for s, d in fields)
    max_len = key[2] if len(key) == 4 else -1
    want = (batch, kv_heads, max_len, key_width), (batch, kv_heads, max_len, value_width), (batch,)
    if (key, value, index) != want or not index_dtype.startswith(("int", "uint")):
        raise ValueError(
            f"the cache does not fit this call: key {key}, value {value}, lengths {index}; "
            f"expected key (batch, kv_heads, max_len, head_dim) = {want[0]}, value {want[1]} and "
            f"lengths ({batch},) of integers (init_cache({batch}, max_len))"
        )
    check_cache_dtype(key_dtype)
    check_cache_dtype(value_dtype)
    return max_len


def cache_unsupported_message(variant: str) -> str:
    return (
        f"{variant} has no KV cache: decoding needs one set of key/value projections "
        "(MultiHeadAttention, CausalAttention, SelfAttention_v1/v2 or Head)"
    )
