"""``flex_attention``'s contract, framework-free: the checks of its arguments (one error
text for both twins), of ``create_block_mask``'s, and the plan of the blocks a call
computes, read from a block mask's tables on the host.

Block masks have PyTorch's layout (``torch.nn.attention.flex_attention.BlockMask``):
for each (b, h) (each of size B or 1, broadcast) and query block i,
``kv_num_blocks[b, h, i]`` key blocks in ``kv_indices[b, h, i, :kv_num_blocks]`` are
*partial* (some of their keys masked: the mask mod decides) and
``full_kv_num_blocks[b, h, i]`` in ``full_kv_indices`` are *full* (every key visible: no
mask needed); every other key block is empty and skipped.  Indices are int32, each row
the block numbers of one kind in ascending order, then the others (PyTorch's stable
descending argsort of the dense block mask).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from attention_spec import mods as library
from attention_spec.arrays import FLOAT_DTYPES, as_shape, check_sinks, dtype_name
from attention_spec.geometry import Reach, reach, unanchored
from attention_spec.masks import check_dropout_mask
from attention_spec.mods import Mod
from attention_spec.options import CallOptions, check_dropout_rate, check_scale
from attention_spec.routing import Route, option_blockers

__all__ = [
    "DEFAULT_BLOCK",
    "BlockMask",
    "FlexExtras",
    "KeyRun",
    "QueryBlock",
    "blocks_computed",
    "call_mods",
    "check_module_mods",
    "fold_named",
    "mask_reads",
    "mod_blockers",
    "check_block_mask",
    "check_block_mask_args",
    "check_flex_call",
    "check_flex_extras",
    "check_full_pair",
    "check_one_table",
    "check_flex_inputs",
    "flex_call_options",
    "flex_route",
    "options_text",
    "check_mod",
    "dense_blocks",
    "named_options",
    "ordered_blocks",
    "untraced_part",
    "plan_blocks",
    "plan_without_mask",
]


# Without a block mask: query blocks of this many rows (PyTorch's default BLOCK_SIZE).
DEFAULT_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class BlockMask:
    """A block-sparse mask in PyTorch's layout: int32 kv_num_blocks (B', H', n_q),
    kv_indices (B', H', n_q, n_kv), and the same for full blocks (or None), B' and H' the
    batch and heads it was made for (1: broadcast), as each twin's ``create_block_mask``
    makes them (NumPy or JAX arrays, torch tensors); ``BLOCK_SIZE`` (query block, key
    block); ``mask_mod``, applied on partial blocks (None: ``mods.noop_mask``, the listed
    blocks wholly visible, as PyTorch's); ``seq_lengths`` (Q_LEN, KV_LEN); ``made_for``,
    the mask mod whose tables these are (``create_block_mask`` sets it; None: made by
    hand, its tables may list fewer blocks than its mod allows).  The
    JAX twin registers it as a pytree (the tables its leaves, the rest static data); the
    PyTorch twin also takes PyTorch's own ``BlockMask`` (the same attributes).

    Raises ValueError for full-block counts without full-block indices, or the reverse
    (``check_full_pair``), as PyTorch's does when it is made."""

    kv_num_blocks: Any
    kv_indices: Any
    full_kv_num_blocks: Any
    full_kv_indices: Any
    BLOCK_SIZE: tuple[int, int]  # noqa: N815 (PyTorch's name)
    mask_mod: Callable[..., Any] | None
    seq_lengths: tuple[int, int]
    made_for: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        # Only what is None is read here: the JAX twin rebuilds a BlockMask from leaves that
        # are tracers, or placeholders without shapes (jax.vmap's in_axes).
        check_full_pair(self.full_kv_num_blocks, self.full_kv_indices)
        if self.mask_mod is None:
            object.__setattr__(self, "mask_mod", library.noop_mask)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B', H', Q_LEN, KV_LEN)."""
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    def tables(self) -> tuple[Any, Any, Any, Any]:
        return (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices)


# --------------------------------------------------------------------------- checks


def check_flex_inputs(q: Any, k: Any, v: Any, dtypes: tuple[str, str, str], *, enable_gqa: bool,
                      scale: Any) -> tuple[int, float | None]:
    """q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), one floating dtype; Hq == Hkv,
    or with ``enable_gqa`` a multiple of it.  Returns (Hq // Hkv, the scale checked).

    Raises:
      ValueError: shapes that do not fit together; TypeError: dtypes (or a bad scale,
        ``check_scale``'s texts)."""
    q, k, v = as_shape(q), as_shape(k), as_shape(v)
    got = f"got q {q}, k {k}, v {v}"
    if not len(q) == len(k) == len(v) == 4:
        raise ValueError(f"flex_attention: q, k and v must be 4-d, (B, Hq, L, E), (B, Hkv, S, E) and "
                         f"(B, Hkv, S, Ev); {got}")
    if not q[0] == k[0] == v[0]:
        raise ValueError(f"flex_attention: q, k and v must have one batch size; {got}")
    if k[1] != v[1] or k[2] != v[2]:
        raise ValueError(f"flex_attention: k and v must have the same heads and length (Hkv, S); {got}")
    if q[3] != k[3]:
        raise ValueError(f"flex_attention: q and k must have the same last dimension (E); {got}")
    if 0 in q or 0 in k or 0 in v:
        raise ValueError(f"flex_attention: q, k and v must not be empty; {got}")
    if len(set(dtypes)) != 1 or dtypes[0] not in FLOAT_DTYPES:
        raise TypeError(f"flex_attention: q, k and v must share one floating-point dtype; got "
                        f"{dtypes[0]}, {dtypes[1]}, {dtypes[2]}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"flex_attention: enable_gqa must be a bool; got {enable_gqa!r}")
    if not enable_gqa and q[1] != k[1]:
        raise ValueError(f"flex_attention: q has {q[1]} heads and k and v {k[1]}; pass enable_gqa=True for "
                         f"grouped-query attention; {got}")
    if q[1] % k[1]:
        raise ValueError(f"flex_attention: with enable_gqa=True, q's heads ({q[1]}) must be a multiple of "
                         f"k's and v's ({k[1]}); {got}")
    return q[1] // k[1], check_scale(scale)


def check_mod(name: str, mod: Any) -> None:
    """``score_mod`` / ``mask_mod``: None or a callable.  Raises TypeError."""
    if mod is not None and not callable(mod):
        raise TypeError(f"flex_attention: {name} must be callable or None; got {type(mod).__name__}")


def check_block_mask(shapes: Sequence[Any], block_size: Any, seq_lengths: Any, q: Any, *, full_given: bool,
                     kv_len: int) -> None:
    """A block mask for q (B, Hq, L, E) and keys of length ``kv_len``: ``shapes`` those of
    kv_num_blocks, kv_indices (and full_kv_num_blocks, full_kv_indices where
    ``full_given``), made for (L, kv_len), each of (B, Hq) of size 1 or the call's.
    Raises ValueError."""
    q = as_shape(q)
    b, h, q_len = q[0], q[1], q[2]
    lengths = tuple(int(n) for n in seq_lengths)
    if lengths != (q_len, kv_len):
        raise ValueError(f"flex_attention: block_mask was made for q_len={lengths[0]}, kv_len={lengths[1]}; "
                         f"got q_len={q_len}, kv_len={kv_len}; make one for these lengths")
    bq, bkv = block_size
    n_q, n_kv = -(-q_len // bq), -(-kv_len // bkv)
    num, idx = as_shape(shapes[0]), as_shape(shapes[1])
    expected = [num, idx] + ([as_shape(shapes[2]), as_shape(shapes[3])] if full_given else [])
    for name, shape in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"), expected,
                           strict=False):
        rank = 3 if "num" in name else 4
        ok = len(shape) == rank and shape[0] in (1, b) and shape[1] in (1, h) and shape[2] == n_q
        if ok and rank == 4:
            ok = shape[3] == n_kv
        if not ok:
            want = f"({b} or 1, {h} or 1, {n_q}" + (")" if rank == 3 else f", {n_kv})")
            raise ValueError(f"flex_attention: block_mask.{name} must have shape {want} for q {q} and "
                             f"BLOCK_SIZE {tuple(block_size)}; got {shape}")


def check_full_pair(full_kv_num_blocks: Any, full_kv_indices: Any) -> None:
    """A block mask's full blocks: their counts and their indices both given or both None.
    Raises ValueError."""
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        given, missing = (("full_kv_num_blocks", "full_kv_indices") if full_kv_indices is None
                          else ("full_kv_indices", "full_kv_num_blocks"))
        raise ValueError(f"BlockMask: full_kv_num_blocks and full_kv_indices must be both given or both None; "
                         f"got {given} without {missing}")


def check_one_table(where: str, role: str, mod: Any, batch: int, heads: int) -> None:
    """A block mask made for ``batch`` (B') examples and ``heads`` (H') heads, each 1 (one
    table for every example / head, broadcast) or the call's, for ``mod``: a library mod
    whose captured arrays differ by example (or head) needs a table for each, since the
    blocks that one example skips, or takes as full, may be another's partial blocks (with
    one table, a flex call would follow example 0's blocks for every example, and a call
    standing for named options would follow the mod: two answers).  Raises ValueError."""
    for index, made, name, what in (("b", batch, "B", "example"), ("h", heads, "H", "head")):
        found = library.per_index(mod, index) if made == 1 else ()
        if found:
            entry = found[0]
            n = next(n for i, n in zip(entry.axes, entry.shape, strict=False) if i == index and n > 1)
            raise ValueError(f"{where}: a block mask made for {name}=1 or None (one table for every {what}) cannot "
                             f"serve {role} {entry.label} of shape {entry.shape}, which holds {n} {what}s' own "
                             f"entries (each {what} its own blocks): make it with {name}={n}")


def check_flex_call(query: Any, key: Any, value: Any, score_mod: Any, block_mask: Any, scale: Any,
                    enable_gqa: bool) -> tuple[int, float | None]:
    """Every check of a flex call in either twin, before any work, whichever path then runs
    it: q, k and v (read for their shapes and dtypes), the scale, the mods (a library
    mod's captured arrays against the call's B, query heads, L and S:
    ``mods.check_sizes``) and the block mask (either twin's ``BlockMask``, or PyTorch's:
    the same attributes).  Returns (query heads per key/value head, the scale checked)."""
    groups, scale = check_flex_inputs(query.shape, key.shape, value.shape,
                                      (dtype_name(query.dtype), dtype_name(key.dtype), dtype_name(value.dtype)),
                                      enable_gqa=enable_gqa, scale=scale)
    check_mod("score_mod", score_mod)
    sizes = (int(query.shape[0]), int(query.shape[1]), int(query.shape[2]), int(key.shape[2]))
    library.check_sizes(score_mod, *sizes, where="flex_attention: score_mod")
    if block_mask is not None:
        tables = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                  block_mask.full_kv_indices)
        check_full_pair(tables[2], tables[3])
        full_given = tables[2] is not None and tables[3] is not None
        check_block_mask([t.shape for t in tables if t is not None], tuple(int(n) for n in block_mask.BLOCK_SIZE),
                         block_mask.seq_lengths, query.shape, full_given=full_given, kv_len=key.shape[2])
        check_mod("block_mask.mask_mod", block_mask.mask_mod)
        library.check_sizes(block_mask.mask_mod, *sizes, where="flex_attention: block_mask.mask_mod")
    return groups, scale


class FlexExtras(NamedTuple):
    """What a flex call has beyond PyTorch's flex_attention, checked
    (``check_flex_extras``): ``sinks`` (Hq,) or None; dropout on the weights at ``rate``
    (0.0: off, eval mode included), with the explicit keep-mask ``keep`` (bool, True =
    keep, broadcastable to (B, Hq, L, S)) or, ``drawn``, a keep-mask the flex path draws
    block by block."""

    sinks: Any = None
    rate: float = 0.0
    keep: Any = None
    drawn: bool = False


def _prefixed(check: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``check`` (a check ``dot_product_attention`` shares), its error text led by
    ``flex_attention: ``, as every flex text is."""
    try:
        check(*args, **kwargs)
    except (TypeError, ValueError) as error:
        raise type(error)(f"flex_attention: {error}") from None


def check_flex_extras(query: Any, key: Any, *, sinks: Any, dropout_rate: Any, mode: tuple[str, Any],
                      dropout_mask: Any, rng: tuple[str, bool]) -> FlexExtras:
    """A flex call's sinks and dropout, before any work (one text in both twins, each
    ``dot_product_attention``'s check led by ``flex_attention: ``): ``sinks`` a floating
    array (Hq,), one logit per query head (``check_sinks``); ``dropout_rate`` in [0, 1);
    ``mode`` (the twin's flag, its value): ``("training", bool)`` (PyTorch) or
    ``("deterministic", bool)`` (JAX); ``dropout_mask`` bool, broadcastable to the
    weights (B, Hq, L, S), only with dropout on (``check_dropout_mask``); ``rng`` (the
    twin's name for its random stream, whether the call has one): dropout drawn in
    training mode without one is refused (the PyTorch twin always has one, its global
    generator, as ``nn.Dropout``).  Returns the extras checked, arrays as given.

    Raises:
      TypeError: a flag that is not a bool, a rate that is not a float, sinks or a
        keep-mask of the wrong dtype.
      ValueError: a rate out of range, sinks or a keep-mask of the wrong shape, a keep-mask
        with dropout off, dropout without an rng."""
    name, flag = mode
    if not isinstance(flag, bool):
        raise TypeError(f"flex_attention: {name} must be a bool; got {type(flag).__name__} {flag!r}")
    training = flag if name == "training" else not flag
    _prefixed(check_dropout_rate, dropout_rate)
    rate = float(dropout_rate)
    q, k = as_shape(query.shape), as_shape(key.shape)
    if sinks is not None:
        _prefixed(check_sinks, as_shape(sinks.shape), dtype_name(sinks.dtype), q, "softmax")
    if dropout_mask is not None:
        _prefixed(check_dropout_mask, as_shape(dropout_mask.shape), dtype_name(dropout_mask.dtype),
                  (q[0], q[1], q[2], k[2]), training=training, rate=rate)
    active = training and rate > 0.0
    drawn = active and dropout_mask is None
    if drawn and not rng[1]:
        raise ValueError(f"flex_attention: dropout in training mode needs {rng[0]} (or a dropout_mask)")
    return FlexExtras(sinks, rate if active else 0.0, dropout_mask, drawn)


def flex_call_options(query: Any, key: Any, value: Any, score_mod: Any, block_mask: Any, scale: Any,
                      enable_gqa: bool, return_lse: bool,
                      extras: FlexExtras | Callable[[], FlexExtras] | None = None
                      ) -> tuple[dict[str, Any] | None, str]:
    """A flex call checked (``check_flex_call``, then ``extras``: the call's sinks and
    dropout, or the twin's ``check_flex_extras`` of them, called after), then the named
    options its mods stand for (``named_options``), with the sinks and an explicit
    keep-mask that ``dot_product_attention`` takes as they are, or None and why not
    (dropout drawn: the flex path draws its own keep-mask): what each twin's
    ``flex_attention`` and ``flex_route`` decide by.  A block mask made for one example
    (or head) whose library mask mod differs by example (or head) is refused
    (``check_one_table``).  (A module's call on the flex path makes its own block masks,
    for the examples and heads its mod reads, and is not checked so: under ``jax.jit`` it
    may list, for every example, the blocks that its mod's untraced part leaves, all
    partial.)  The options carry ``training=True`` with an explicit keep-mask (the JAX
    twin passes it on as ``deterministic=False``)."""
    check_flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa)
    extras = FlexExtras() if extras is None else extras() if callable(extras) else extras
    if block_mask is not None:
        lead = block_mask.kv_num_blocks.shape
        check_one_table("flex_attention", "block_mask.mask_mod", block_mask.mask_mod, int(lead[0]), int(lead[1]))
    options, why = named_options(score_mod, None if block_mask is None else block_mask.mask_mod,
                                 return_lse=return_lse)
    if options is not None and block_mask is not None and getattr(block_mask, "made_for", None) is not (
            block_mask.mask_mod):
        # Its tables may skip blocks that its mod allows: run as the named options, the call
        # would follow the mod alone, and on the flex path (return_lse=True) the tables too.
        return None, "block_mask was not made by create_block_mask for its mask_mod (its blocks are read)"
    if options is not None and extras.drawn:
        return None, "dropout drawn in training mode (the flex path draws its keep-mask block by block)"
    if options is not None and extras.sinks is not None:
        options["sinks"] = extras.sinks
    if options is not None and extras.keep is not None:
        options.update(dropout_rate=extras.rate, dropout_mask=extras.keep, training=True)
    return options, why


def options_text(options: dict[str, Any]) -> str:
    """``flex_route``'s first reason for a call that runs as ``dot_product_attention``."""
    shown = ", ".join(f"{name}=<array>" if hasattr(value, "shape") else f"{name}={value!r}"
                      for name, value in options.items())
    return f"flex: the mods stand for {shown or 'no option'}"


def flex_route(options: dict[str, Any] | None, why: str, route: Callable[..., Route]) -> Route:
    """Each twin's ``flex_route`` from ``flex_call_options``'s answer: ``route(**options)``'s
    route, its reasons led by the options (``options_text``), where the mods stand for
    named options; else ``("flex", "flex-blocks", ("named options: <why not>",))``."""
    if options is None:
        return Route("flex", "flex-blocks", (f"named options: {why}",))
    chosen = route(**options)
    return Route(chosen.path, chosen.kernel, (options_text(options), *chosen.reasons), basis=chosen.basis)


def named_options(score_mod: Any, mask_mod: Any, *, return_lse: bool) -> tuple[dict[str, Any] | None, str]:
    """(the options of ``dot_product_attention`` that a flex call's mods stand for, or None
    and why not).  A call whose mods are all library mods (``attention_spec.mods``) that
    stand for named options, none set two ways, and that asks for no log-sum-exp is that
    call of ``dot_product_attention``: the twins run it there, on the fastest path that
    honours those options (a mod missing, None, stands for nothing to add)."""
    if return_lse:
        return None, "return_lse=True (dot_product_attention gives no log-sum-exp)"
    options: dict[str, Any] = {}
    for role, mod in (("block_mask.mask_mod", mask_mod), ("score_mod", score_mod)):
        if mod is None:
            continue
        own = mod.options if isinstance(mod, Mod) else None
        if own is None:
            what = type(mod).__name__ if isinstance(mod, Mod) else "a function of its own"
            return None, f"{role} ({what}) stands for no named option"
        for name, value in own.items():
            if name in options and not (options[name] is value or (
                    not hasattr(value, "shape") and options[name] == value)):
                return None, f"the mods set {name} two ways"
            options[name] = value
    return options, ""


def check_block_mask_args(mask_mod: Any, batch: Any, heads: Any, q_len: Any, kv_len: Any,
                          block_size: Any) -> tuple[int, int, int, int, tuple[int, int]]:
    """``create_block_mask``'s arguments: a callable ``mask_mod``; B and H None (1) or
    ints >= 1; Q_LEN, KV_LEN ints >= 1; BLOCK_SIZE an int >= 1 or a pair (query block,
    key block); a library mask mod's captured arrays fit B, H, Q_LEN and KV_LEN
    (``mods.check_sizes``; B or H None: its arrays must not differ by example or head,
    ``check_one_table``).  Returns (B, H, Q_LEN, KV_LEN, (q block, key block)).
    Raises TypeError / ValueError."""
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: mask_mod must be callable; got {type(mask_mod).__name__}")
    sizes = []
    for name, value, optional in (("B", batch, True), ("H", heads, True), ("Q_LEN", q_len, False),
                                  ("KV_LEN", kv_len, False)):
        sizes.append(_positive("create_block_mask", name, 1 if optional and value is None else value))
    pair = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    if len(pair) != 2:
        raise ValueError(f"create_block_mask: BLOCK_SIZE must be an int or a pair of ints; got {block_size!r}")
    bq, bkv = (_positive("create_block_mask", "BLOCK_SIZE", s) for s in pair)
    check_one_table("create_block_mask", "mask_mod", mask_mod, sizes[0], sizes[1])
    library.check_sizes(mask_mod, *sizes, where="create_block_mask: mask_mod")
    return sizes[0], sizes[1], sizes[2], sizes[3], (bq, bkv)


def _positive(where: str, name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {name} must be an int; got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{where}: {name} must be >= 1; got {value}")
    return int(value)


# --------------------------------------------------------------------------- a module's mods


def check_module_mods(score_mod: Any, mask_mod: Any) -> None:
    """A module's ``score_mod`` and ``mask_mod``: None or callables.  Raises TypeError."""
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is not None and not callable(mod):
            raise TypeError(f"{name} must be callable or None; got {type(mod).__name__}")


def _narrower(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def fold_named(causal: bool, window: tuple[int | None, int | None] | None, softcap: float | None,
               score_mod: Any, mask_mod: Any) -> tuple[bool, tuple[int | None, int | None] | None, float | None,
                                                       Any, Any]:
    """A module's mods folded into its named options where they stand for them: a mask
    mod standing for ``causal`` and/or a ``window`` (``causal``, ``sliding_window``,
    ``and_masks`` of them) narrows the module's (the keys both let through); a score mod
    standing for ``softcap`` (``softcap``, ``chain(softcap(c))``) is the module's soft cap
    where it has none.  Returns (causal, window, softcap, the score mod left, the mask mod
    left): a mod left (not None) runs on the flex path or the reference math.  Exact: a
    module's mods see key positions (``library.Positioned``), as its causal and window do."""
    named = mask_mod.options if isinstance(mask_mod, Mod) else None
    if named is not None and set(named) <= {"causal", "window"}:
        causal = causal or bool(named.get("causal", False))
        extra = named.get("window")
        if extra is not None:
            window = extra if window is None else (_narrower(window[0], extra[0]), _narrower(window[1], extra[1]))
        mask_mod = None
    named = score_mod.options if isinstance(score_mod, Mod) else None
    if named is not None and set(named) <= {"softcap"} and not (softcap is not None and "softcap" in named):
        softcap = named.get("softcap", softcap)
        score_mod = None
    return causal, window, softcap, score_mod, mask_mod


def mod_blockers(options: CallOptions, *, rank: int, sinks_given: bool, dropout_mask_given: bool) -> list[str]:
    """What the flex path cannot honour of a module call with mods: the weights returned,
    another normalisation than the softmax, dropout drawn in training mode without an
    explicit dropout mask (the JAX twin's row gets no rng key: both twins leave such a
    call to the reference math, which draws it), and q, k and v of another rank than 4.
    Sinks and an explicit dropout mask it honours (``run_call`` passes them to
    ``flex_attention``); ``sinks_given`` is kept for the rows' one signature."""
    del sinks_given
    found = option_blockers(options, dropout_mask_given=False, draws_dropout=dropout_mask_given, honours_mods=True)
    if rank != 4:
        found.append(f"q of rank {rank} (the flex path takes (B, H, T, D))")
    return found


def mask_reads(mod: Any) -> tuple[bool, bool]:
    """(whether a mask mod reads ``b``, whether it reads ``h``): what a block mask made for
    it needs of the call's batch and heads (neither: one (1, 1) block mask serves every
    example and head).  Library mods say it by their arrays (per example: lengths, prefix
    lengths, document ids, a per-example offset; a dense mask or segments by their first
    two sizes); a function of the user's own may read both."""
    if isinstance(mod, library.Positioned):
        inner = mask_reads(mod.mod)
        return inner[0] or hasattr(mod.offset, "shape"), inner[1]
    if isinstance(mod, library._Combined):
        reads = [mask_reads(p) for p in mod.parts]
        return any(r[0] for r in reads), any(r[1] for r in reads)
    if isinstance(mod, library.CallMask):
        dense = [a for a in (mod.mask, mod.segments) if a is not None]
        per_example = hasattr(mod.offset, "shape") or mod.lengths is not None or any(a.shape[0] > 1 for a in dense)
        return per_example, any(a.shape[1] > 1 for a in dense)
    if isinstance(mod, (library.PrefixLM, library.Documents)):
        return bool(mod.arrays), False
    if isinstance(mod, Mod):
        return bool(mod.arrays), bool(mod.arrays)
    return True, True


def untraced_part(mod: Any, traced: Callable[[Any], bool]) -> Any:
    """What of a mask mod is known without its traced arrays (``traced(array)``: the JAX
    twin's test), a mask mod that lets through every key the whole one does, or None where
    nothing is: the mod itself where it captures no traced array; of an ``and_masks``, the
    and of its parts' such parts; of a call's mask (``CallMask``) with traced tensors, its
    band (an untraced offset); a function of the user's own as it is (its block mask says
    whether it was).  Its block mask's non-empty blocks are the blocks worth computing."""
    if isinstance(mod, library.AndMasks):
        parts = [p for p in (untraced_part(x, traced) for x in mod.parts) if p is not None]
        return None if not parts else parts[0] if len(parts) == 1 else library.and_masks(*parts)
    if isinstance(mod, library.CallMask):
        if not any(traced(a) for a in mod.arrays):
            return mod
        if traced(mod.offset) or (mod.left is None and mod.right is None and mod.chunk is None):
            return None
        if not isinstance(mod.chunk_origin, int) and traced(mod.chunk_origin):  # chunks from an unknown origin
            return library.CallMask(mod.offset, *reach(unanchored(Reach(window=(mod.left, mod.right), chunk=mod.chunk))))
        return library.CallMask(mod.offset, mod.left, mod.right, chunk=mod.chunk, chunk_origin=mod.chunk_origin)
    if isinstance(mod, Mod):
        return None if any(traced(a) for a in mod.arrays) else mod
    return mod


def call_mods(options: CallOptions, *, offset: Any, mask: Any, bias: Any, lengths: Any,
              segments: Any, chunk_origin: Any = 0) -> tuple[Any, Any]:
    """(score_mod, mask_mod) of a module call on the flex path: the call's own options and
    arrays (its band at ``offset``, lengths, mask, same-segment mask; soft cap and bias:
    ``library.CallMask`` / ``CallScore``) together with the module's mods seen at key
    positions (``library.positioned``), in the library's order: soft cap, bias, then the
    module's score mod; a key is visible where the call's mask and the module's mask mod
    both let it through (and the final score is not -inf).  ``mask_mod`` None where no
    key is hidden."""
    left, right = reach(options)
    own_mask = None
    if (left is not None or right is not None or options.chunk is not None
            or any(a is not None for a in (lengths, mask, segments))):
        own_mask = library.CallMask(offset, left, right, lengths, mask, segments, options.chunk, chunk_origin)
    user_mask = library.positioned(options.mask_mod, offset)
    mask_mod = user_mask if own_mask is None else own_mask if user_mask is None else library.and_masks(
        own_mask, user_mask)
    own_score = None if options.softcap is None and bias is None else library.CallScore(options.softcap, bias)
    user_score = library.positioned(options.score_mod, offset)
    score_mod = user_score if own_score is None else own_score if user_score is None else library.chain(
        own_score, user_score)
    return score_mod, mask_mod


# --------------------------------------------------------------------------- tables


def ordered_blocks(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A dense block mask (..., n_q, n_kv) (bool or 0/1) -> (num_blocks (..., n_q),
    indices (..., n_q, n_kv)), int32: PyTorch's ``_dense_to_ordered`` (the blocks set, in
    ascending order, then the others)."""
    dense = np.asarray(dense).astype(np.int32)
    order = np.argsort(-dense, axis=-1, kind="stable")
    return dense.sum(axis=-1).astype(np.int32), order.astype(np.int32)


def dense_blocks(num_blocks: np.ndarray, indices: np.ndarray, n_kv: int) -> np.ndarray:
    """(num_blocks (..., n_q), indices (..., n_q, n)) -> bool (..., n_q, n_kv): the
    blocks listed (the first ``num_blocks`` of each row)."""
    num_blocks, indices = np.asarray(num_blocks), np.asarray(indices)
    listed = np.arange(indices.shape[-1]) < num_blocks[..., None]
    dense = np.zeros((*indices.shape[:-1], n_kv + 1), dtype=bool)
    np.put_along_axis(dense, np.where(listed, indices, n_kv).astype(np.int64), True, axis=-1)
    return dense[..., :n_kv]


class KeyRun(NamedTuple):
    """Adjacent key blocks of one query block that are computed alike.

    ``kind``: ``"full"`` (every key visible for every (b, h): no mask), ``"partial"``
    (partial for every (b, h): the mask mod alone) or ``"mixed"`` (the kind differs by
    (b, h): ``full | (partial & mask_mod)``, the flags bool (B', H', 1, keys), ``partial``
    None where no (b, h) has a partial block here).  ``start``, ``stop``: key positions,
    ``stop - start`` keys."""

    start: int
    stop: int
    kind: str
    full: np.ndarray | None = None
    partial: np.ndarray | None = None


class QueryBlock(NamedTuple):
    """One query block: its query rows ``start:stop`` and the runs of keys it computes,
    in key order (none: every key blocked, zeros)."""

    start: int
    stop: int
    runs: tuple[KeyRun, ...]

    @property
    def key_positions(self) -> np.ndarray:
        """The key positions computed, in order (the runs' ranges, concatenated)."""
        if not self.runs:
            return np.zeros((0,), dtype=np.int64)
        return np.concatenate([np.arange(r.start, r.stop) for r in self.runs])

    @property
    def span(self) -> tuple[int, int] | None:
        """(first, stop) where the keys computed are one contiguous range, else None."""
        for a, b in zip(self.runs, self.runs[1:], strict=False):
            if a.stop != b.start:
                return None
        return (self.runs[0].start, self.runs[-1].stop) if self.runs else None


def plan_without_mask(q_len: int, kv_len: int, block: int) -> tuple[QueryBlock, ...]:
    """No block mask: query blocks of ``block`` rows, each over every key, unmasked."""
    return tuple(QueryBlock(i, min(i + block, q_len), (KeyRun(0, kv_len, "full"),)) for i in range(0, q_len, block))


def plan_blocks(kv_num_blocks: Any, kv_indices: Any, full_kv_num_blocks: Any, full_kv_indices: Any,
                block_size: tuple[int, int], seq_lengths: tuple[int, int]) -> tuple[QueryBlock, ...]:
    """The blocks a call computes, from a block mask's tables (NumPy, on the host): per
    query block, the key blocks that some (b, h) needs (partial or full), grouped into
    runs of one kind (``KeyRun``); a key block empty for every (b, h) is skipped."""
    bq, bkv = block_size
    q_len, kv_len = seq_lengths
    n_q, n_kv = -(-q_len // bq), -(-kv_len // bkv)
    partial = dense_blocks(kv_num_blocks, kv_indices, n_kv)  # (B', H', n_q, n_kv)
    if full_kv_num_blocks is None:
        full = np.zeros_like(partial)
    else:
        full = dense_blocks(full_kv_num_blocks, full_kv_indices, n_kv) & ~partial
    plan = []
    for i in range(n_q):
        runs: list[KeyRun] = []
        for j in range(n_kv):
            p, f = partial[:, :, i, j], full[:, :, i, j]  # (B', H')
            if not (p.any() or f.any()):
                continue
            kind = "full" if f.all() else "partial" if p.all() else "mixed"
            start, stop = j * bkv, min((j + 1) * bkv, kv_len)
            flags = (f[:, :, None, None], p[:, :, None, None]) if kind == "mixed" else (None, None)
            last = runs[-1] if runs else None
            if last is not None and last.stop == start and last.kind == kind:
                if kind == "mixed":
                    assert last.full is not None and last.partial is not None and flags[0] is not None
                    flags = (np.concatenate([last.full, np.repeat(flags[0], stop - start, -1)], -1),
                             np.concatenate([last.partial, np.repeat(flags[1], stop - start, -1)], -1))
                runs[-1] = KeyRun(last.start, stop, kind, *flags)
            elif kind == "mixed":
                assert flags[0] is not None and flags[1] is not None
                runs.append(KeyRun(start, stop, kind, np.repeat(flags[0], stop - start, -1),
                                   np.repeat(flags[1], stop - start, -1)))
            else:
                runs.append(KeyRun(start, stop, kind))
        plan.append(QueryBlock(i * bq, min((i + 1) * bq, q_len),
                               tuple(r._replace(partial=None) if r.kind == "mixed" and r.partial is not None
                                     and not r.partial.any() else r for r in runs)))
    return tuple(plan)


def blocks_computed(plan: Sequence[QueryBlock], block_size: tuple[int, int]) -> int:
    """How many (query block, key block) pairs a plan computes."""
    bkv = block_size[1]
    return sum(-(-(r.stop - r.start) // bkv) for qb in plan for r in qb.runs)
