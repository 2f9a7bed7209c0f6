"""Workers for ``test_distributed.py``: scripts run in subprocesses (JAX with 8 simulated
devices, PyTorch as 2 or 4 gloo processes), and the cases they share.

This module is framework-free (NumPy only): both workers import it, so both build the
same inputs for a case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_spec.rope import RopeConfig

BATCH, HEADS, SEQ, WIDTH = 2, 4, 48, 8  # 2N divides SEQ for N = 2, 4, 8
# In the huge-logit cases, key 28 is a copy of key 0 (on the other device of a ring of 2,
# contiguous or zigzag, and within every example's length): the queries whose largest
# logit is key 0's have two, and a backward that folds the row sum into the maximum (a
# log-sum-exp of 1e10, where log 2 is below float32's spacing) weighs each 1, not 1/2.
TIED = 28
# The rope of the rope cases: a small base, so that the 48 positions turn the pairs far.
ROPE = RopeConfig(theta=500.0)


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
    magnitude: float = 1.0  # q, k and v scaled by it: 1e5 gives logits of about 1e10
    sinks: float | None = None  # attention sinks (H,), uniform in [-sinks, sinks]
    rope: str | None = None  # ROPE at "default" positions (0..T-1) or at "given" ones

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
        if self.magnitude != 1.0:
            parts.append(f"x{self.magnitude:g}")
        if self.sinks is not None:
            parts.append(f"sinks{self.sinks:g}")
        if self.rope is not None:
            parts.append(f"rope-{self.rope}")
        return "-".join(parts)

    @property
    def names(self) -> tuple[str, ...]:
        """What a run reports: the output and the gradients of the case's inputs."""
        return ("out", "dq", "dk", "dv") + (("dsinks",) if self.sinks is not None else ())


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
    # huge logits (issue 24): the row maximum's subtraction must stay exact, also with
    # NaN padding and fully masked rows
    Case(2, causal=False, layout="contiguous", magnitude=1e5),
    Case(2, causal=True, layout="zigzag", lengths=(29, 0), magnitude=1e5),
    # ... and on a ring of 4, each query's maximum found on another member than its
    # first (contiguous: the tied key on member 2; lengths within member 1's chunk)
    Case(4, causal=False, layout="contiguous", lengths=(41, 0), magnitude=1e5),
    # attention sinks (with padding and fully masked rows, grouped heads, large sinks,
    # huge logits) and rope at global positions (default and given, both layouts)
    Case(2, causal=True, layout="zigzag", lengths=(29, 0), sinks=3.0),
    Case(4, causal=False, layout="contiguous", kv_heads=2, sinks=30.0),
    Case(2, causal=True, layout="zigzag", lengths=(29, 0), magnitude=1e5, sinks=3.0),
    Case(2, causal=False, layout="contiguous", lengths=(SEQ, 17), rope="default"),
    Case(4, causal=True, layout="zigzag", rope="default", sinks=3.0),
    Case(4, causal=True, layout="contiguous", lengths=(41, 6), rope="given"),
    Case(2, causal=True, layout="zigzag", kv_heads=1, rope="given", sinks=3.0),
)


# The JAX ring compiles each case (2-10 s on a 2-core CPU), so the default test run takes
# eight: seven, the fewest that hold every value of every axis above (2, 4 and 8 devices;
# causal or not; both layouts; padding, a fully masked example, grouped heads of 1 and 2,
# a wider value, shorter and longer keys, logits of 1e10, sinks of 3 and 30, rope at the
# default and at given positions), and issue 24's maximum found on another member than
# the first; ``pytest --exhaustive`` and the workers' default take all.
DEFAULT_RING_CASES = (
    "n8-causal-contiguous-dv12-kvheads2", "n2-full-contiguous-pad80-37-kvseq80", "n4-causal-zigzag-kvseq16",
    "n4-full-contiguous-kvheads2-sinks30", "n2-causal-zigzag-pad29-0-x100000-sinks3",
    "n2-full-contiguous-pad48-17-rope-default", "n2-causal-zigzag-kvheads1-sinks3-rope-given",
    "n4-full-contiguous-pad41-0-x100000",
)


def twin_cases() -> tuple[Case, ...]:
    """The cases that the JAX ring and the PyTorch ring both run on 4 members."""
    return (Case(4, causal=True, layout="zigzag", lengths=(41, 6)), Case(4, causal=False, layout="contiguous"),
            Case(4, causal=True, layout="zigzag", kv_heads=2), Case(4, causal=True, layout="zigzag", kv_seq=80),
            Case(4, causal=True, layout="zigzag", lengths=(41, 6), sinks=3.0, rope="given"),
            Case(4, causal=False, layout="contiguous", kv_heads=2, sinks=3.0, rope="default"))


def case_inputs(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) (times the case's
    magnitude), d_out (B, H, T, Dv); keys and values past the case's lengths are NaN
    (padding must never reach an output or a gradient).  With sinks, float32 ``sinks``
    (H,); with rope at given positions, int64 ``positions`` (B, T) in natural order (each
    example its own: a start and a stride)."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((BATCH, HEADS, SEQ, WIDTH)) * case.magnitude).astype(np.float32)
    k = (rng.standard_normal((BATCH, case.kv_heads, case.kv_seq, WIDTH)) * case.magnitude).astype(np.float32)
    v = (rng.standard_normal((BATCH, case.kv_heads, case.kv_seq, case.v_width)) * case.magnitude).astype(np.float32)
    d_out = rng.standard_normal((BATCH, HEADS, SEQ, case.v_width)).astype(np.float32)
    if case.magnitude != 1.0:  # key TIED equals key 0, in another device's chunk: tied row maxima
        k[:, :, TIED] = k[:, :, 0]
    if case.lengths is not None:
        for b, length in enumerate(case.lengths):
            k[b, :, length:] = np.nan
            v[b, :, length:] = np.nan
    inputs = {"q": q, "k": k, "v": v, "d_out": d_out}
    if case.sinks is not None:
        inputs["sinks"] = rng.uniform(-case.sinks, case.sinks, HEADS).astype(np.float32)
    if case.rope == "given":
        inputs["positions"] = np.stack([7 + 3 * np.arange(SEQ), 100 + np.arange(SEQ)]).astype(np.int64)
    return inputs


def case_positions(case: Case, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The positions (B or 1, T), natural order, by which rope turns q and k."""
    return inputs["positions"] if case.rope == "given" else np.arange(SEQ)[None]


def oracle_output(case: Case, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The case's output by the float64 oracle (``parity_tests.reference``), in natural
    order: what every ring must give, whatever its padding holds (read as 0 here); q and
    k turned by its float64 rope first, the sinks in the denominators."""
    from parity_tests.reference import attention, rope

    q, k, v = (np.nan_to_num(inputs[n], nan=0.0, posinf=0.0, neginf=0.0) for n in ("q", "k", "v"))
    if case.rope is not None:
        q, k = (rope(t, case_positions(case, inputs), ROPE) for t in (q, k))
    mask = None
    if case.lengths is not None:
        mask = (np.arange(case.kv_seq)[None, :] < np.asarray(case.lengths)[:, None])[:, None, None, :]
    return attention(q, k, v, scale=1 / np.sqrt(WIDTH), mask=mask, causal=case.causal, sinks=inputs.get("sinks"))[0]


def oracle_error(out: np.ndarray, expected: np.ndarray) -> dict[str, Any]:
    """For a JSON report: whether ``out`` is finite; its largest error against the
    oracle's ``expected``, and ``expected``'s largest magnitude (for a tolerance relative
    to the values' size); and the largest error in units of the float32 oracle tolerance
    ``atol + rtol * |expected|`` (at most 1: within it elementwise)."""
    from parity_tests.tolerances import ORACLE

    tol = ORACLE["float32"]
    error = np.abs(np.asarray(out, np.float64) - expected)
    return {"finite": bool(np.isfinite(out).all()), "error": float(error.max()),
            "scale": float(np.abs(expected).max()),
            "units": float((error / (tol.atol + tol.rtol * np.abs(expected))).max())}
