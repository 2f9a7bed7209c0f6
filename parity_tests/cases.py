"""The parity matrix, defined once: used by the test suite and by ``python -m parity_tests``.

Two tables.

Module cases: variant x batch {1, 2, 7} x heads {1, 2, 4, 8} x seq {1, 6, 17, 64} x mask
{none, causal, padding, causal+padding, random, rows fully masked} x dtype {float32,
bfloat16, float16} x direction (PyTorch -> Flax, Flax -> PyTorch) x path {reference,
fused, blockwise, auto}.  The full product is ~69k cases; one greedy pairwise covering
design over all eight axes (107 cases with the refusals) holds every pair of values that
can go together at least once: every variant meets every path, mask, dtype, size and
direction; every path meets every mask, dtype, size and direction.  Constraints: a
single-head variant has one head, and a variant runs only on the paths that can honour
its options (``REFUSED``); each path that refuses a variant by design gets one case that
asserts the refusal (a ValueError naming the option) instead.  Attention weights are
compared on the reference path only: asking for them anywhere else would change the path
under test.

Functional cases: ``dot_product_attention`` of both frameworks on q, k, v directly, with
q_len != kv_len (where top-left and bottom-right causal alignment differ), causal x mask
x kv_lengths x path x dtype, pairwise, plus causal alignment under a mask and lengths on
every path (31 cases).

Every case has a readable id that shows its path, e.g. ``mha-b2-h4-T17-causal-bf16-fused-pt2fx``
or ``fn-T5-S9-causal-random-lenempty-f16-blockwise``.  The variants' constructor keywords come
from the variant registry (``attention_spec.registry``), not from a copy kept here.
"""

from __future__ import annotations

import collections
import functools
import itertools
import zlib
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from attention_spec.options import QueryScale
from attention_spec.registry import variant as declaration
from attention_spec.rope import RopeConfig

D_IN = 16
HEAD_DIM = 8
CONTEXT_LENGTH = 64

BATCHES = (1, 2, 7)
HEADS = (1, 2, 4, 8)
SEQS = (1, 6, 17, 64)
MASKS = ("none", "causal", "padding", "causal+padding", "random", "fully-masked")
DTYPES = ("float32", "bfloat16", "float16")
IMPLEMENTATIONS = ("reference", "fused", "blockwise", "auto")
DIRECTIONS = ("pt2fx", "fx2pt")
DTYPE_IDS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}

# Options that an explicit fast path cannot honour, by design (DESIGN: "an explicit path
# that cannot honour an option raises, naming it"): {option: paths that refuse it}.  A
# variant configured with such an option gets a refusal case on those paths.
# (mask_strategy="renormalize" is not here: it equals "fill" in exact arithmetic and
# every path computes it, stably; the causal-renorm variant runs on all four.)
# A module's flex mod that stands for no named option (any such value of the option).
NOT_NAMED = "a mod standing for no named option"
REFUSED: dict[tuple[str, Any], tuple[str, ...]] = {
    ("normalization", "sum"): ("fused", "blockwise"),
    ("sinks", True): ("fused",),  # SDPA and jax.nn.dot_product_attention have no sinks
    # the flex path ("auto") and the reference math apply it; the kernels refuse it by name
    ("mask_mod", NOT_NAMED): ("fused", "blockwise"),
}
# The refusals that one framework may honour instead, where its path can: the JAX twin's
# "fused" on CPU is the library's kernel, which takes sinks (its refusal case then checks
# the JAX output against the oracle instead).
MAY_HONOUR: dict[tuple[str, Any], tuple[str, ...]] = {
    ("sinks", True): ("flax",),
}


@dataclass(frozen=True)
class Variant:
    """A variant under test: its short id, class name and the options it is built with
    beyond the registry's required ones (``extra``)."""

    id: str
    cls: str
    extra: tuple[tuple[str, Any], ...] = ()
    # Input scale.  SelfAttention_v1's N(0, 1) matrices (the tutorial's init) give scores
    # of size ~d_in with unit inputs: near one-hot softmaxes whose conditioning, not the
    # code, dominates half-precision error.  Inputs of size 1/sqrt(d_in) give O(1) scores,
    # as the Linear variants have with unit inputs.
    input_scale: float = 1.0
    # |x|: for normalization="sum", whose row sums of x @ x^T must stay away from 0 (a row
    # summing to 0 is an error; near 0 the result is ill-conditioned, not wrong).
    positive: bool = False
    # Grouped-query attention at every head count: num_kv_heads = max(1, heads // kv_group)
    # (0: the variant's own num_kv_heads, if any).
    kv_group: int = 0
    # Rotary variants are called at positions from here on (beyond 400, where RoPE's
    # errors show), example b shifted by 7b: ``positions(batch, seq)``.
    first_position: int | None = None
    # Options that depend on the number of query heads (a score mod with one slope per
    # head): ``per_heads(heads)`` -> ((option, value), ...), added to ``extra``.
    per_heads: Any = None

    def positions(self, batch: int, seq: int) -> np.ndarray | None:
        """The ``positions=`` of a call, integers (B, T), or None (the variant takes none)."""
        if self.first_position is None:
            return None
        return self.first_position + 7 * np.arange(batch)[:, None] + np.arange(seq)[None]

    @property
    def multihead(self) -> bool:
        return declaration(self.cls).heads != "single"

    def config(self, heads: int) -> dict[str, Any]:
        """Constructor keywords (the same for both frameworks) for ``heads`` heads: the
        registry's options of the variant, set to the sizes of the matrix."""
        decl = declaration(self.cls)
        width = HEAD_DIM * (heads if decl.heads == "split" else 1)
        values: dict[str, Any] = {
            "d_in": D_IN, "context_length": CONTEXT_LENGTH, "num_heads": heads, "qkv_bias": True,
            "dropout": 0.1,
        }
        if decl.width is not None:
            values[decl.width] = width
        config = {name: value for name, value in values.items() if name in decl.options}
        if self.kv_group:
            config["num_kv_heads"] = max(1, heads // self.kv_group)
        return {**config, **dict(self.extra), **dict(self.per_heads(heads) if self.per_heads else ())}

    def refusal(self, implementation: str) -> str | None:
        """The option ``implementation`` refuses for this variant (as the error names
        it, e.g. ``normalization='sum'``), or None if the path runs it."""
        for (option, value), paths in REFUSED.items():
            if _given(dict(self.extra).get(option), value) and implementation in paths:
                named_alone = value is True or value is NOT_NAMED  # a switch, a mod: named alone
                return option if named_alone else f"{option}={value!r}"
        return None

    def may_honour(self, side: str) -> bool:
        """Whether ``side`` ("torch" or "flax") may run this variant's refused path
        instead of refusing it (``MAY_HONOUR``)."""
        return any(_given(dict(self.extra).get(option), value) and side in sides
                   for (option, value), sides in MAY_HONOUR.items())

    def runs_on(self, implementation: str) -> bool:
        return self.refusal(implementation) is None

    def make_inputs(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        """x of ``shape`` + (d_in,), float64, at this variant's scale."""
        x = rng.standard_normal((*shape, D_IN)) * self.input_scale
        return np.abs(x) if self.positive else x


def _given(value: Any, refused: Any) -> bool:
    """Whether an option's ``value`` is the ``refused`` one (``NOT_NAMED``: a mod that
    stands for no named option)."""
    if refused is NOT_NAMED:
        return value is not None and getattr(value, "options", None) is None
    return bool(value == refused)


def _alibi(heads: int) -> tuple[tuple[str, Any], ...]:
    """ALiBi's slopes for ``heads`` query heads (2^(-8 (h + 1) / heads)), as a score mod."""
    from attention_spec import mods

    return (("score_mod", mods.alibi(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads))),)


def _flex_mods() -> Any:
    from attention_spec import mods

    return mods


VARIANTS: dict[str, Variant] = {
    v.id: v
    for v in (
        Variant("simplified", "SimplifiedAttention"),
        Variant("simplified-sum", "SimplifiedAttention", (("normalization", "sum"),), positive=True),
        Variant("sa1", "SelfAttention_v1", input_scale=D_IN**-0.5),
        Variant("sa2", "SelfAttention_v2"),
        Variant("causal", "CausalAttention"),
        Variant("causal-renorm", "CausalAttention", (("mask_strategy", "renormalize"),)),
        Variant("head", "Head"),
        Variant("mhaw", "MultiHeadAttentionWrapper"),
        Variant("mha", "MultiHeadAttention"),
        Variant("mha-noproj", "MultiHeadAttention", (("out_proj", False),)),
        # training-stack options (issue 9) that self-attention modules take: one key/value
        # head for all query heads (MQA, any head count) in Llama 4's chunks of 4 key
        # positions (chunked local attention), a causal window, a two-sided one
        Variant("mqa-chunk", "MultiHeadAttention", (("num_kv_heads", 1), ("chunk", 4))),
        Variant("mha-window", "MultiHeadAttention", (("window", (3, None)),)),
        Variant("sa2-window", "SelfAttention_v2", (("window", (2, 1)),)),
        # free widths: heads of 2 * HEAD_DIM (q/k/v 2x as wide as d_out) in groups of 2
        # key/value heads, out_proj back to d_out (Gemma's heads x head_dim != hidden);
        # out_proj without bias to a width of its own (Llama's o_proj)
        Variant("mha-headdim-gqa", "MultiHeadAttention", (("head_dim", 2 * HEAD_DIM),), kv_group=2),
        Variant("mha-outwidth-nobias", "MultiHeadAttention", (("out_features", D_IN + HEAD_DIM), ("out_bias", False))),
        # qk-norm: Qwen3's RMSNorm of each head with grouped heads; OLMo-2-like norm across
        # all heads, here a LayerNorm (weight and bias)
        Variant("mha-qknorm-rms-gqa", "MultiHeadAttention", (("qk_norm", "rms"),), kv_group=2),
        Variant("mha-qknorm-layer-all", "MultiHeadAttention", (("qk_norm", "layer"), ("qk_norm_scope", "all"))),
        # rotary position embeddings (Llama's theta and layout), half of each head turning
        # (partial rotary, as Phi and GPT-NeoX): q and k turned after the head split
        Variant("mha-rope", "MultiHeadAttention", (("rope", RopeConfig(theta=10000.0, partial_rotary_factor=0.5)),),
                first_position=480),
        # GPT-J / DeepSeek's interleaved pairs with YaRN's frequencies and attention factor
        Variant("mha-rope-yarn", "MultiHeadAttention",
                (("rope", RopeConfig(theta=500.0, layout="interleaved", scaling="yarn", factor=4.0,
                                     original_max_position_embeddings=128)),), first_position=480),
        # OLMo's clip_qkv (q, k and v clamped, about a fifth of the projections' outputs here),
        # before a qk-norm that the clamp changes
        Variant("mha-clip-qknorm", "MultiHeadAttention", (("clip_qkv", 0.75), ("qk_norm", "rms"))),
        # Qwen3-Next's full-attention layer: W_query gives each head's queries and its output
        # gate, grouped heads, 1 + w qk-norm per head, half of each head turning
        Variant("mha-gate-gqa", "MultiHeadAttention",
                (("output_gate", True), ("qk_norm", "rms"), ("qk_norm_offset", 1.0),
                 ("rope", RopeConfig(theta=10000.0, partial_rotary_factor=0.5))), kv_group=2, first_position=480),
        # 2026's projection mechanisms together: Gemma 4's global layer (no W_value: the values
        # are W_key's output before its norm and rope; a weightless value norm), nanochat's /
        # Llama 4's weightless qk-norm, queries scaled by position (Llama 4's temperature
        # tuning, Ministral 3's beta; past every 4th position here, so at 480.. it bites)
        Variant("mha-k-eq-v-qscale", "MultiHeadAttention",
                (("values_from_keys", True), ("v_norm", "rms"), ("qk_norm", "rms"), ("qk_norm_weight", False),
                 ("query_scale", QueryScale(0.5, 4, 1)), ("rope", RopeConfig(theta=10000.0, partial_rotary_factor=0.5))),
                kv_group=2, first_position=480),
        # 2026's output mechanisms together: HunYuan's qk-norm on the turned q and k, Laguna's
        # softplus gate of one value a head with Beam's gate bias per head, BitNet's RMSNorm of
        # the merged heads before out_proj
        Variant("mha-afterrope-softplus-outnorm", "MultiHeadAttention",
                (("qk_norm", "rms"), ("qk_norm_position", "after_rope"), ("output_gate", True),
                 ("output_gate_activation", "softplus"), ("output_gate_per_head", True), ("output_gate_bias", True),
                 ("out_norm", "rms"), ("rope", RopeConfig(theta=10000.0))), kv_group=2, first_position=480),
        # MiMo-V2-Flash's value heads of their own width scaled as they leave W_value; Beam's
        # scalable softmax (queries times (1 + (p + 1) / 4) ** 0.5: a power of the position)
        Variant("mha-vheads-vscale-power", "MultiHeadAttention",
                (("v_head_dim", HEAD_DIM + 2), ("v_scale", 0.75), ("query_scale", QueryScale(0.5, 4, 1)),
                 ("query_scale_kind", "power")), kv_group=2, first_position=480),
        # gpt-oss's attention sinks (one logit per head in every softmax) with grouped heads
        Variant("mha-sinks-gqa", "MultiHeadAttention", (("sinks", True),), kv_group=2),
        # flex attention's mods: a window written as a mask mod (it stands for window=(3, 1):
        # every path runs it as that option); ALiBi over a prefix LM with grouped heads,
        # which stand for no option (the flex path under "auto", the reference math)
        Variant("mha-flexwindow", "MultiHeadAttention",
                (("causal", False), ("mask_mod", _flex_mods().sliding_window(3, 1)))),
        Variant("mha-flex-alibi-gqa", "MultiHeadAttention",
                (("causal", False), ("mask_mod", _flex_mods().prefix_lm(2))), kv_group=2, per_heads=_alibi),
        # DeepSeek-V3's multi-head latent attention: queries through a low-rank pair, keys
        # and values expanded from a latent of rank 12 with one shared rope key, nope 6 +
        # rope 4 wide queries and keys, values 5 wide, interleaved YaRN with mscale
        Variant("latent", "MultiHeadLatentAttention",
                (("kv_lora_rank", 12), ("qk_nope_head_dim", 6), ("qk_rope_head_dim", 4), ("v_head_dim", 5),
                 ("q_lora_rank", 10), ("attention_bias", True),
                 ("rope", RopeConfig(theta=10000.0, layout="interleaved", scaling="yarn", factor=4.0,
                                     original_max_position_embeddings=32, mscale=0.707, mscale_all_dim=0.707))),
                first_position=480),
    )
}


@dataclass(frozen=True)
class Case:
    variant: str
    batch: int
    heads: int
    seq: int
    mask: str
    dtype: str
    direction: str
    implementation: str = "reference"

    @property
    def id(self) -> str:
        return (f"{self.variant}-b{self.batch}-h{self.heads}-T{self.seq}-{self.mask}"
                f"-{DTYPE_IDS[self.dtype]}-{self.implementation}-{self.direction}")

    @property
    def spec(self) -> Variant:
        return VARIANTS[self.variant]

    @property
    def config(self) -> dict[str, Any]:
        return self.spec.config(self.heads)

    @property
    def weights(self) -> bool:
        """Compare attention weights: on the reference path, the only one that has them."""
        return self.implementation == "reference"

    @property
    def refusal(self) -> str | None:
        """The option this case's path must refuse, naming it (None: a numbers case)."""
        return self.spec.refusal(self.implementation)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    def inputs(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(x (B, T, d_in) float32, mask bool broadcastable to (B, H, T, T) or None)."""
        rng = np.random.default_rng(self.seed)
        x = self.spec.make_inputs(rng, (self.batch, self.seq)).astype(np.float32)
        return x, make_mask(self.mask, self.batch, self.heads, self.seq, rng)


def make_mask(kind: str, batch: int, heads: int, seq: int, rng: np.random.Generator,
              kv_len: int | None = None) -> np.ndarray | None:
    """A bool mask (True = may attend) of the given kind, broadcastable to (B, H, T, S)
    (S = ``kv_len``, default ``seq``)."""
    kv_len = seq if kv_len is None else kv_len
    causal = np.tril(np.ones((seq, kv_len), dtype=bool))
    lengths = rng.integers(1, kv_len + 1, size=batch)
    lengths[0] = kv_len  # one example unpadded
    padding = (np.arange(kv_len)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    if kind == "none":
        return None
    if kind == "causal":
        return causal
    if kind == "padding":
        return padding
    if kind == "causal+padding":
        return causal & padding
    random = rng.random((batch, heads, seq, kv_len)) < 0.7
    if kind == "random":
        return random
    if kind == "fully-masked":
        random[:, :, rng.integers(0, seq)] = False  # one query row per (b, h) sees nothing
        return random
    raise ValueError(f"unknown mask kind {kind!r}")


def covering(axes: list[tuple[Any, ...]], valid: Any = None, strength: int = 2,
             start: tuple[tuple[Any, ...], ...] = ()) -> list[tuple[Any, ...]]:
    """A covering array: with ``strength=2`` (pairwise), every pair of values of every two
    axes that some valid row can hold appears in at least one row; with ``strength=1``,
    every value of every axis does.  ``valid(partial)`` says whether a partial row ({axis
    index: value}) breaks no constraint.  Rows in ``start`` count as chosen already (a
    pairwise design grown from a smaller one).  Greedy and deterministic: each row starts
    from the first uncovered pair (value) and takes, axis by axis, the value that covers
    the most new ones (ties to the earlier value)."""
    if strength not in (1, 2):
        raise ValueError(f"strength must be 1 or 2, got {strength}")
    valid = valid or (lambda partial: True)
    if strength == 1:
        # a value is a pair of an axis with itself: the same bookkeeping covers both strengths
        pairs = [(i, i) for i in range(len(axes))]
        uncovered = {(i, a, i, a) for i in range(len(axes)) for a in axes[i] if valid({i: a})}
    else:
        pairs = list(itertools.combinations(range(len(axes)), 2))
        uncovered = {
            (i, a, j, b) for i, j in pairs for a in axes[i] for b in axes[j] if valid({i: a, j: b})
        }
    for full in start:
        uncovered -= {(i, full[i], j, full[j]) for i, j in pairs}
    rows: list[tuple[Any, ...]] = []
    while uncovered:
        i, a, j, b = min(uncovered, key=lambda p: (p[0], axes[p[0]].index(p[1]), p[2], axes[p[2]].index(p[3])))
        row: dict[int, Any] = {i: a, j: b}
        for axis in range(len(axes)):
            if axis in row:
                continue

            options = [v for v in axes[axis] if valid({**row, axis: v})]
            row[axis] = max(options, key=functools.partial(_gain, row, axis, uncovered))  # first of equals
        full = tuple(row[axis] for axis in range(len(axes)))
        rows.append(full)
        uncovered -= {(i, full[i], j, full[j]) for i, j in pairs}
    return rows


def _pairwise(axes: list[tuple[Any, ...]], valid: Any = None) -> list[tuple[Any, ...]]:
    """The matrix's design: ``covering(axes, valid)``, every feasible pair once at least."""
    return covering(axes, valid)


AXES = ("variant", "batch", "heads", "seq", "mask", "dtype", "direction", "implementation")


def _valid(partial: dict[int, Any]) -> bool:
    """The constraints of the module design: a single-head variant has one head, and a
    variant runs only on the paths that honour its options."""
    values = {AXES[i]: v for i, v in partial.items()}
    spec = VARIANTS.get(values.get("variant", ""))
    if spec is None:
        return True
    if not spec.multihead and values.get("heads", 1) != 1:
        return False
    return "implementation" not in values or spec.runs_on(values["implementation"])


def _gain(row: dict[int, Any], axis: int, uncovered: set[tuple[Any, ...]], value: Any) -> int:
    """How many uncovered pairs ``value`` on ``axis`` would cover, with the partial ``row``
    (a value alone counts as the pair of its axis with itself)."""
    own = (axis, value, axis, value) in uncovered
    return own + sum(((min(axis, o), value if axis < o else row[o], max(axis, o), row[o] if axis < o else value)
                      in uncovered) for o in row)


@cache
def matrix() -> tuple[Case, ...]:
    """Every module case of the parity matrix: one pairwise design over all the axes, the
    variant and the path included (so every variant meets every path, mask, dtype, size
    and direction, and every path meets every mask, dtype, size...), then one refusal case
    per path that refuses a variant by design."""
    axes = [tuple(VARIANTS), BATCHES, HEADS, SEQS, MASKS, DTYPES, DIRECTIONS, IMPLEMENTATIONS]
    cases = [Case(*row) for row in _pairwise(axes, _valid)]
    for variant in VARIANTS.values():
        heads = HEADS[-1] if variant.multihead else 1
        for i, path in enumerate(p for p in IMPLEMENTATIONS if not variant.runs_on(p)):
            cases.append(Case(variant.id, 2, heads, 6, MASKS[1 + i], DTYPES[i], DIRECTIONS[i % 2], path))
    return tuple(sorted(cases, key=lambda c: (list(VARIANTS).index(c.variant), c.refusal is not None)))


def quick() -> tuple[Case, ...]:
    """A subset for ``--quick`` (under 30 s): each variant once, on the path run least so
    far (so that every path runs several variants), short sequences, float32 or bfloat16
    where the variant has such a case; and every refusal (they cost nothing)."""
    chosen: list[Case] = []
    for variant in VARIANTS:
        runnable = [c for c in matrix() if c.variant == variant and c.refusal is None and c.seq <= 17]
        runnable.sort(key=lambda c: c.dtype == "float16")  # float16 only where nothing else is

        runs = collections.Counter(c.implementation for c in chosen if c.refusal is None)
        chosen.append(min(runnable, key=lambda c: runs[c.implementation]))  # least run so far; first of equals
        chosen += [c for c in matrix() if c.variant == variant and c.refusal is not None]
    return tuple(chosen)


# --------------------------------------------------------------------------- functional cases

FN_BATCH, FN_HEADS, FN_DIM = 2, 2, 8
# (q_len, kv_len): fewer and more queries than keys (causal alignment matters), one query
# (a decoding step), and equal lengths.
FN_SHAPES = ((5, 9), (9, 5), (1, 7), (6, 6))
FN_MASKS = ("none", "padding", "random", "fully-masked", "shared")
FN_LENGTHS = ("none", "partial", "empty")
# issue 9 items 4 and 7: an additive bias, soft-capping, both ("none" for the pairwise rows)
FN_EXTRAS = ("bias", "softcap", "bias-softcap")
FN_SOFTCAP = 2.0
# issue 9's structure options (an extra block of cases, "structure" in the ids): key/value
# heads (grouped-query attention: FN_HEADS query heads read 1 key/value head), a window
# (left, right) (None = no window), where query 0 sits among the keys ("q_offset": a
# per-example (B,) array; "top_left" and "bottom_right" by alignment=), and packed
# segments (segment ids, on the shapes with q_len == kv_len).
FN_KV_HEADS = (FN_HEADS, 1)
FN_WINDOWS: tuple[tuple[int | None, int | None] | None, ...] = (None, (2, None), (1, 1), (None, 0))
FN_POSITIONS = ("top_left", "bottom_right", "q_offset")
FN_SEGMENTS = (False, True)


@dataclass(frozen=True)
class FunctionalCase:
    """``dot_product_attention(q, k, v, mask=, causal=, kv_lengths=, implementation=)``
    of both frameworks, q (B, H, T, D), k and v (B, Hkv, S, D); ``extra`` adds ``bias=``
    and/or ``softcap=``.  The structure options (defaults: none, so the ids of the cases
    without them stay as they were): ``kv_heads`` (Hkv, grouped-query attention when
    below H), ``window=``, ``position`` (``alignment=`` "top_left" / "bottom_right", or
    "q_offset": a per-example ``q_offset=`` array) and ``segments`` (packed sequences,
    ``segment_ids=``; q_len == kv_len)."""

    q_len: int
    kv_len: int
    causal: bool
    mask: str
    lengths: str
    dtype: str
    implementation: str
    extra: str = "none"
    kv_heads: int = FN_HEADS
    window: tuple[int | None, int | None] | None = None
    position: str = "top_left"
    segments: bool = False

    variant = "fn"
    direction = "-"
    weights = False
    refusal = None

    @property
    def id(self) -> str:
        return (f"fn-T{self.q_len}-S{self.kv_len}-{'causal' if self.causal else 'full'}-{self.mask}"
                f"-len{self.lengths}-{DTYPE_IDS[self.dtype]}-{self.implementation}"
                + ("" if self.extra == "none" else f"-{self.extra}") + self._structure_id)

    @property
    def _structure_id(self) -> str:
        """The structure options in the id, e.g. ``-kv1-win2_inf-bottomright-seg``."""
        parts = []
        if self.kv_heads != FN_HEADS:
            parts.append(f"kv{self.kv_heads}")
        if self.window is not None:
            parts.append("win" + "_".join("inf" if w is None else str(w) for w in self.window))
        if self.position != "top_left":
            parts.append(self.position.replace("_", ""))
        if self.segments:
            parts.append("seg")
        return "".join(f"-{p}" for p in parts)

    @property
    def structured(self) -> bool:
        """Uses a structure option (grouped heads, window, alignment, offsets, segments)."""
        return bool(self._structure_id)

    @property
    def softcap(self) -> float | None:
        return FN_SOFTCAP if "softcap" in self.extra else None

    def bias(self) -> np.ndarray | None:
        """float32 (1, H, T, S) or (B, 1, T, S) (by the seed's parity), or None."""
        if "bias" not in self.extra:
            return None
        rng = np.random.default_rng(self.seed + 1)
        shape = (1, FN_HEADS) if self.seed % 2 else (FN_BATCH, 1)
        return rng.standard_normal((*shape, self.q_len, self.kv_len)).astype(np.float32)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(q, k, v float32, mask bool broadcastable to (B, H, T, S) or None, kv_lengths
        int (B,) or None)."""
        rng = np.random.default_rng(self.seed)
        q = rng.standard_normal((FN_BATCH, FN_HEADS, self.q_len, FN_DIM)).astype(np.float32)
        k = rng.standard_normal((FN_BATCH, self.kv_heads, self.kv_len, FN_DIM)).astype(np.float32)
        v = rng.standard_normal((FN_BATCH, self.kv_heads, self.kv_len, FN_DIM)).astype(np.float32)
        mask: np.ndarray | None
        if self.mask == "shared":  # (T, S): one mask for every example and head
            mask = rng.random((self.q_len, self.kv_len)) < 0.7
        else:
            mask = make_mask(self.mask, FN_BATCH, FN_HEADS, self.q_len, rng, kv_len=self.kv_len)
        lengths = {
            "none": None,
            "partial": np.array([self.kv_len, max(1, self.kv_len // 2)]),
            "empty": np.array([self.kv_len - 1, 0]),  # an example with no keys at all
        }[self.lengths]
        return q, k, v, mask, lengths

    def structure(self) -> dict[str, Any]:
        """The structure keywords of the call, the same for both frameworks: ``window``,
        ``alignment`` (Python values), ``q_offset`` (int (B,) or None) and ``segment_ids``
        (int (B, T) or None; the keys' ids default to them, q_len == kv_len)."""
        rng = np.random.default_rng(self.seed + 2)
        q_offset = segment_ids = None
        if self.position == "q_offset":  # example 0 bottom-right aligned, example 1 anywhere
            q_offset = np.array([self.kv_len - self.q_len, rng.integers(0, self.kv_len)], dtype=np.int32)
        if self.segments:  # 3 packed segments in example 0, 2 in example 1
            rows = []
            for count in (3, 2):
                cuts = np.sort(rng.choice(np.arange(1, self.q_len), size=count - 1, replace=False))
                rows.append(np.searchsorted(cuts, np.arange(self.q_len), side="right"))
            segment_ids = np.stack(rows).astype(np.int32)
        alignment = "bottom_right" if self.position == "bottom_right" else "top_left"
        return {"window": self.window, "alignment": alignment, "q_offset": q_offset, "segment_ids": segment_ids}

    def oracle_structure(self) -> dict[str, Any]:
        """``structure()`` in the oracle's keywords (``reference.attention``): the key
        position of query 0 as ``offset`` (an int, or the (B,) array)."""
        s = self.structure()
        offset = s["q_offset"] if s["q_offset"] is not None else (
            self.kv_len - self.q_len if s["alignment"] == "bottom_right" else 0)
        return {"window": s["window"], "offset": offset, "segment_ids": s["segment_ids"]}

    def oracle_mask(self) -> np.ndarray | None:
        """The mask and the lengths as one bool (B, H, T, S) mask, for the oracle."""
        _, _, _, mask, lengths = self.inputs()
        full = np.ones((FN_BATCH, FN_HEADS, self.q_len, self.kv_len), dtype=bool)
        if mask is not None:
            full &= np.broadcast_to(mask, full.shape)
        if lengths is not None:
            full &= (np.arange(self.kv_len)[None, :] < lengths[:, None])[:, None, None, :]
        return full


@cache
def functional_matrix() -> tuple[FunctionalCase, ...]:
    """The functional cases: pairwise over shape x causal x mask x lengths x dtype x path,
    and causal alignment under a mask and lengths on every path."""
    rows = _pairwise([FN_SHAPES, (True, False), FN_MASKS, FN_LENGTHS, DTYPES, IMPLEMENTATIONS])
    cases = [FunctionalCase(t, s, causal, mask, lengths, dtype, path)
             for (t, s), causal, mask, lengths, dtype, path in rows]
    # Causal alignment together with a mask and lengths, on every path, fewer and more
    # queries than keys: where a top-left / bottom-right mix-up shows (pairs alone do not
    # guarantee these combinations).
    for i, path in enumerate(IMPLEMENTATIONS):
        for (t, s), mask in (((5, 9), "random"), ((9, 5), "padding")):
            case = FunctionalCase(t, s, True, mask, "partial", DTYPES[i % 2], path)
            if case not in cases:
                cases.append(case)
    # Bias and soft-capping on every path that honours them (fused refuses softcap, by
    # name: test_bias_softcap.py), with masks, lengths and causal alignment.
    for i, path in enumerate(IMPLEMENTATIONS):
        for j, extra in enumerate(FN_EXTRAS):
            if "softcap" in extra and path == "fused":
                continue
            (t, s), mask, lengths = FN_SHAPES[(i + j) % 4], FN_MASKS[(i + 2 * j) % 5], FN_LENGTHS[(i + j) % 3]
            cases.append(FunctionalCase(t, s, (i + j) % 2 == 0, mask, lengths, DTYPES[(i + j) % 3], path, extra))
    cases += structure_cases()
    return tuple(cases)


def structure_cases() -> list[FunctionalCase]:
    """The structure block: pairwise over window x position x kv heads x segments x
    causal x path (the rows without a structure option are the table's other cases, and
    left out); the shape follows (q_len == kv_len with segments, else q_len !=
    kv_len, where the alignment matters), mask, lengths and dtype rotate.  Grouped heads
    get a per-head mask ((B, H, T, S): "random" or "fully-masked") on every path.  Then,
    for every path and every option value, a case whose output would change by far more
    than its tolerance if a path ignored it (``ignored_options_visible``), where the
    pairwise rows alone did not give one."""
    rows = _pairwise([FN_WINDOWS, FN_POSITIONS, FN_KV_HEADS, FN_SEGMENTS, (True, False), IMPLEMENTATIONS])
    unequal = [shape for shape in FN_SHAPES if shape[0] != shape[1]]
    cases: list[FunctionalCase] = []
    grouped = 0
    # a row without any structure option is a case of the table above: left out
    rows = [r for r in rows if r[:4] != (None, "top_left", FN_HEADS, False)]
    for n, (window, position, kv_heads, segments, causal, path) in enumerate(rows):
        t, s = (6, 6) if segments else unequal[n % len(unequal)]
        if kv_heads < FN_HEADS:
            mask = ("random", "fully-masked")[grouped % 2]
            grouped += 1
        else:
            mask = FN_MASKS[n % len(FN_MASKS)]
        cases.append(FunctionalCase(t, s, causal, mask, FN_LENGTHS[(n + n // 3) % 3], DTYPES[n % 3],
                                    path, kv_heads=kv_heads, window=window, position=position, segments=segments))
    for i, path in enumerate(IMPLEMENTATIONS):
        (t, s), dtype, kv_heads = unequal[i % 2], DTYPES[i % 2], FN_KV_HEADS[i % 2]
        wanted: dict[tuple[str, Any], FunctionalCase] = {
            **{("position", p): FunctionalCase(t, s, True, "random", "partial", dtype, path, kv_heads=kv_heads,
                                               window=FN_WINDOWS[1 + i % 3], position=p)
               for p in FN_POSITIONS[1:]},
            **{("window", w): FunctionalCase(t, s, False, "padding", "partial", dtype, path, kv_heads=kv_heads,
                                             window=w) for w in FN_WINDOWS[1:]},
            ("segments", True): FunctionalCase(6, 6, False, "none", "none", dtype, path, kv_heads=kv_heads,
                                               segments=True),
        }
        for option, fallback in wanted.items():
            if not any(c.implementation == path and option in ignored_options_visible(c) for c in cases):
                cases.append(fallback)
    return cases


def ignored_options_visible(case: FunctionalCase) -> set[tuple[str, Any]]:
    """The structure options of ``case`` that a path ignoring them would fail on: those
    whose removal changes the float64 oracle's output by more than 10x the case's oracle
    tolerance somewhere.  ("window", w): the window dropped; ("position", p): query 0 at
    key 0 instead; ("segments", True): the segment ids dropped."""
    import math

    from parity_tests import reference
    from parity_tests.tolerances import ORACLE

    q, k, v, _, _ = case.inputs()

    def oracle(**changes: Any) -> np.ndarray:
        options = {**case.oracle_structure(), **changes}
        return reference.attention(q, k, v, scale=1.0 / math.sqrt(FN_DIM), mask=case.oracle_mask(),
                                   causal=case.causal, **options)[0]

    want, tol = oracle(), ORACLE[case.dtype]
    changes: dict[tuple[str, Any], dict[str, Any]] = {}
    if case.window is not None:
        changes[("window", case.window)] = {"window": None}
    if case.position != "top_left":
        changes[("position", case.position)] = {"offset": 0}
    if case.segments:
        changes[("segments", True)] = {"segment_ids": None}
    return {option for option, change in changes.items()
            if np.any(np.abs(oracle(**change) - want) > 10 * (tol.atol + tol.rtol * np.abs(want)))}


def quick_functional() -> tuple[FunctionalCase, ...]:
    """Every path once with a causal mask and q_len != kv_len, and once with a window and
    query 0 placed off key 0 (bottom-right or per-example offsets), for ``--quick``."""
    chosen: dict[str, FunctionalCase] = {}
    structured: dict[str, FunctionalCase] = {}
    for case in functional_matrix():
        if case.causal and case.mask != "none" and case.q_len != case.kv_len and not case.structured:
            chosen.setdefault(case.implementation, case)
        if case.window is not None and case.position != "top_left":
            structured.setdefault(case.implementation, case)
    return (*chosen.values(), *structured.values())
