"""The parity matrix, defined once: used by the test suite and by ``python -m parity_tests``.

Axes: variant x batch {1, 2, 7} x heads {1, 2, 4, 8} x seq {1, 6, 17, 64} x mask {none,
causal, padding, causal+padding, random, rows fully masked} x dtype {float32, bfloat16,
float16} x direction (PyTorch -> Flax, Flax -> PyTorch).  The full product is ~14k
cases; per variant a greedy pairwise covering design keeps every pair of axis values
(and so every value of every axis) at least once, ~35 cases per variant.  Each case has
a readable id such as ``mha-b2-h4-T17-causal-bf16-pt2fx``.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

D_IN = 16
HEAD_DIM = 8
CONTEXT_LENGTH = 64

BATCHES = (1, 2, 7)
HEADS = (1, 2, 4, 8)
SEQS = (1, 6, 17, 64)
MASKS = ("none", "causal", "padding", "causal+padding", "random", "fully-masked")
DTYPES = ("float32", "bfloat16", "float16")
DIRECTIONS = ("pt2fx", "fx2pt")
DTYPE_IDS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


@dataclass(frozen=True)
class Variant:
    """A variant under test: its short id, class name, and whether it has several heads."""

    id: str
    cls: str
    multihead: bool
    extra: tuple[tuple[str, Any], ...] = ()
    # Input scale.  SelfAttention_v1's N(0, 1) matrices (the tutorial's init) give scores
    # of size ~d_in with unit inputs: near one-hot softmaxes whose conditioning, not the
    # code, dominates half-precision error.  Inputs of size 1/sqrt(d_in) give O(1) scores,
    # as the Linear variants have with unit inputs.
    input_scale: float = 1.0

    def config(self, heads: int) -> dict[str, Any]:
        """Constructor keywords (the same for both frameworks) for ``heads`` heads."""
        extra = dict(self.extra)
        if self.cls == "SimplifiedAttention":
            return extra
        if self.cls == "SelfAttention_v1":
            return {"d_in": D_IN, "d_out": HEAD_DIM, **extra}
        if self.cls == "SelfAttention_v2":
            return {"d_in": D_IN, "d_out": HEAD_DIM, "qkv_bias": True, **extra}
        if self.cls == "CausalAttention":
            return {"d_in": D_IN, "d_out": HEAD_DIM, "context_length": CONTEXT_LENGTH,
                    "dropout": 0.1, "qkv_bias": True, **extra}
        if self.cls == "Head":
            return {"d_in": D_IN, "head_size": HEAD_DIM, "context_length": CONTEXT_LENGTH,
                    "dropout": 0.1, **extra}
        if self.cls == "MultiHeadAttentionWrapper":
            return {"d_in": D_IN, "d_out": HEAD_DIM, "context_length": CONTEXT_LENGTH,
                    "dropout": 0.1, "num_heads": heads, "qkv_bias": True, **extra}
        return {"d_in": D_IN, "d_out": HEAD_DIM * heads, "context_length": CONTEXT_LENGTH,
                "dropout": 0.1, "num_heads": heads, "qkv_bias": True, **extra}


VARIANTS: dict[str, Variant] = {
    v.id: v
    for v in (
        Variant("simplified", "SimplifiedAttention", False),
        Variant("sa1", "SelfAttention_v1", False, input_scale=D_IN**-0.5),
        Variant("sa2", "SelfAttention_v2", False),
        Variant("causal", "CausalAttention", False),
        Variant("causal-renorm", "CausalAttention", False, (("mask_strategy", "renormalize"),)),
        Variant("head", "Head", False),
        Variant("mhaw", "MultiHeadAttentionWrapper", True),
        Variant("mha", "MultiHeadAttention", True),
        Variant("mha-noproj", "MultiHeadAttention", True, (("out_proj", False),)),
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

    @property
    def id(self) -> str:
        return (f"{self.variant}-b{self.batch}-h{self.heads}-T{self.seq}-{self.mask}"
                f"-{DTYPE_IDS[self.dtype]}-{self.direction}")

    @property
    def spec(self) -> Variant:
        return VARIANTS[self.variant]

    @property
    def config(self) -> dict[str, Any]:
        return self.spec.config(self.heads)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    def inputs(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(x (B, T, d_in) float32, mask bool broadcastable to (B, H, T, T) or None)."""
        rng = np.random.default_rng(self.seed)
        x = rng.standard_normal((self.batch, self.seq, D_IN)) * self.spec.input_scale
        x = x.astype(np.float32)
        return x, make_mask(self.mask, self.batch, self.heads, self.seq, rng)


def make_mask(kind: str, batch: int, heads: int, seq: int, rng: np.random.Generator) -> np.ndarray | None:
    """A bool mask (True = may attend) of the given kind, broadcastable to (B, H, T, T)."""
    causal = np.tril(np.ones((seq, seq), dtype=bool))
    lengths = rng.integers(1, seq + 1, size=batch)
    lengths[0] = seq  # one example unpadded
    padding = (np.arange(seq)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    if kind == "none":
        return None
    if kind == "causal":
        return causal
    if kind == "padding":
        return padding
    if kind == "causal+padding":
        return causal & padding
    random = rng.random((batch, heads, seq, seq)) < 0.7
    if kind == "random":
        return random
    if kind == "fully-masked":
        random[:, :, rng.integers(0, seq)] = False  # one query row per (b, h) sees nothing
        return random
    raise ValueError(f"unknown mask kind {kind!r}")


def _pairwise(axes: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A greedy covering array of strength 2: every pair of values of every two axes
    appears in at least one row.  Deterministic (ties broken by product order)."""
    uncovered = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(axes)), 2)
        for a in axes[i]
        for b in axes[j]
    }
    candidates = list(itertools.product(*axes))
    rows: list[tuple[Any, ...]] = []
    pairs = list(itertools.combinations(range(len(axes)), 2))
    while uncovered:
        best = max(candidates, key=lambda row: sum((i, row[i], j, row[j]) in uncovered for i, j in pairs))
        rows.append(best)
        uncovered -= {(i, best[i], j, best[j]) for i, j in pairs}
    return rows


@cache
def matrix() -> tuple[Case, ...]:
    """Every case of the parity matrix."""
    cases = []
    for variant in VARIANTS.values():
        heads = HEADS if variant.multihead else (1,)
        for row in _pairwise([BATCHES, heads, SEQS, MASKS, DTYPES, DIRECTIONS]):
            cases.append(Case(variant.id, *row))
    return tuple(cases)


def quick() -> tuple[Case, ...]:
    """A subset for ``--quick``: float32 and bfloat16, every variant, one direction each."""
    return tuple(c for c in matrix() if c.dtype != "float16" and c.seq <= 17)[::3]
