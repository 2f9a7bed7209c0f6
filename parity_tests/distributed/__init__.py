"""Workers for ``test_distributed.py``: scripts run in subprocesses (JAX with 8 simulated
devices, PyTorch as 2 or 4 gloo processes), and the cases they share.

This module is framework-free (NumPy only): both workers import it, so both build the
same inputs for a case.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BATCH, HEADS, SEQ, WIDTH = 2, 2, 48, 8  # 2N divides SEQ for N = 2, 4, 8


@dataclass(frozen=True)
class Case:
    """One ring call: ``devices`` ring members (JAX devices or torch ranks)."""

    devices: int
    causal: bool
    layout: str
    lengths: tuple[int, ...] | None = None  # kv_lengths (B,); padded keys hold NaN
    v_width: int = WIDTH

    @property
    def id(self) -> str:
        parts = [f"n{self.devices}", "causal" if self.causal else "full", self.layout]
        if self.lengths is not None:
            parts.append("pad" + "-".join(map(str, self.lengths)))
        if self.v_width != WIDTH:
            parts.append(f"dv{self.v_width}")
        return "-".join(parts)


CASES = tuple(
    case
    for n in (2, 4, 8)
    for case in (
        Case(n, causal=False, layout="contiguous", lengths=(SEQ, 17)),
        Case(n, causal=True, layout="contiguous"),
        Case(n, causal=True, layout="zigzag", lengths=(29, 0)),  # example 1: every row fully masked
    )
) + (Case(4, causal=False, layout="zigzag", v_width=12), Case(4, causal=True, layout="zigzag", lengths=(SEQ, 9)))


def twin_cases() -> tuple[Case, ...]:
    """The cases that the JAX ring and the PyTorch ring both run on 4 members."""
    return (Case(4, causal=True, layout="zigzag", lengths=(41, 6)), Case(4, causal=False, layout="contiguous"))


def case_inputs(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 q, k (B, H, S, D), v, d_out (B, H, S, Dv); keys and values past the case's
    lengths are NaN (padding must never reach an output or a gradient)."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((BATCH, HEADS, SEQ, WIDTH)).astype(np.float32) for _ in range(2))
    v, d_out = (rng.standard_normal((BATCH, HEADS, SEQ, case.v_width)).astype(np.float32) for _ in range(2))
    if case.lengths is not None:
        for b, length in enumerate(case.lengths):
            k[b, :, length:] = np.nan
            v[b, :, length:] = np.nan
    return {"q": q, "k": k, "v": v, "d_out": d_out}
