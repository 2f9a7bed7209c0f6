"""Workers for ``test_distributed.py``: scripts run in subprocesses (JAX with 8 simulated
devices, PyTorch as 2 or 4 gloo processes), and the cases they share.

This module is framework-free (NumPy only): both workers import it, so both build the
same inputs for a case.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BATCH, HEADS, SEQ, WIDTH = 2, 4, 48, 8  # 2N divides SEQ for N = 2, 4, 8


@dataclass(frozen=True)
class Case:
    """One ring call: ``devices`` ring members (JAX devices or torch ranks)."""

    devices: int
    causal: bool
    layout: str
    lengths: tuple[int, ...] | None = None  # kv_lengths (B,); padded keys hold NaN
    v_width: int = WIDTH
    kv_heads: int = HEADS  # fewer than HEADS: grouped-query attention
    kv_seq: int = SEQ  # another length than SEQ: cross-attention

    @property
    def id(self) -> str:
        parts = [f"n{self.devices}", "causal" if self.causal else "full", self.layout]
        if self.lengths is not None:
            parts.append("pad" + "-".join(map(str, self.lengths)))
        if self.v_width != WIDTH:
            parts.append(f"dv{self.v_width}")
        if self.kv_heads != HEADS:
            parts.append(f"kvheads{self.kv_heads}")
        if self.kv_seq != SEQ:
            parts.append(f"kvseq{self.kv_seq}")
        return "-".join(parts)


CASES = tuple(
    case
    for n in (2, 4, 8)
    for case in (
        Case(n, causal=False, layout="contiguous", lengths=(SEQ, 17)),
        Case(n, causal=True, layout="contiguous"),
        Case(n, causal=True, layout="zigzag", lengths=(29, 0)),  # example 1: every row fully masked
    )
) + (
    Case(4, causal=False, layout="zigzag", v_width=12),
    Case(4, causal=True, layout="zigzag", lengths=(SEQ, 9)),
    Case(2, causal=False, layout="contiguous", kv_heads=2),
    Case(4, causal=True, layout="zigzag", lengths=(33, 0), kv_heads=1),
    Case(8, causal=True, layout="contiguous", kv_heads=2, v_width=12),
    # cross-attention: 48 queries over 80 keys, and 48 over 16 (causal: rows past 15 see every key)
    Case(2, causal=False, layout="contiguous", kv_seq=80, lengths=(80, 37)),
    Case(4, causal=True, layout="zigzag", kv_seq=80, kv_heads=1),
    Case(8, causal=True, layout="contiguous", kv_seq=16, lengths=(16, 5)),
    Case(4, causal=True, layout="zigzag", kv_seq=16),
)


def twin_cases() -> tuple[Case, ...]:
    """The cases that the JAX ring and the PyTorch ring both run on 4 members."""
    return (Case(4, causal=True, layout="zigzag", lengths=(41, 6)), Case(4, causal=False, layout="contiguous"),
            Case(4, causal=True, layout="zigzag", kv_heads=2), Case(4, causal=True, layout="zigzag", kv_seq=80))


def case_inputs(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), d_out (B, H, T, Dv); keys
    and values past the case's lengths are NaN (padding must never reach an output or a
    gradient)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, HEADS, SEQ, WIDTH)).astype(np.float32)
    k = rng.standard_normal((BATCH, case.kv_heads, case.kv_seq, WIDTH)).astype(np.float32)
    v = rng.standard_normal((BATCH, case.kv_heads, case.kv_seq, case.v_width)).astype(np.float32)
    d_out = rng.standard_normal((BATCH, HEADS, SEQ, case.v_width)).astype(np.float32)
    if case.lengths is not None:
        for b, length in enumerate(case.lengths):
            k[b, :, length:] = np.nan
            v[b, :, length:] = np.nan
    return {"q": q, "k": k, "v": v, "d_out": d_out}
