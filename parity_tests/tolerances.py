"""Tolerances per dtype, in one place.

A comparison passes when every element satisfies ``|a - b| <= atol + rtol * |b|``.
``relative_error`` (what the report prints) is ``max|a - b| / max|b|``: the worst
deviation relative to the tensor's scale, which stays meaningful where single elements
are near zero.

How they were measured: ``python -m parity_tests --json`` over the whole matrix (every
variant x batch x heads x seq x mask x dtype x direction), forward and gradients, on a
2-core x86 CPU with torch 2.13.0 and jax 0.10.2; the observed worst relative error per
dtype is recorded next to each entry, and each tolerance keeps a margin of at least 4x.
bfloat16 has an 8-bit significand (unit roundoff 2**-8 = 3.9e-3), float16 an 11-bit one
(2**-11 = 4.9e-4); an attention layer rounds several times (projection, scores, weights,
mix, output projection), so errors of a few roundoffs are expected and what the
tolerances allow.
"""

from __future__ import annotations

from typing import NamedTuple


class Tolerance(NamedTuple):
    rtol: float
    atol: float


# framework vs framework, same dtype (forward outputs, weights, gradients)
PARITY: dict[str, Tolerance] = {
    "float64": Tolerance(1e-12, 1e-12),
    "float32": Tolerance(1e-5, 1e-5),
    "float16": Tolerance(1e-2, 1e-2),
    "bfloat16": Tolerance(5e-2, 5e-2),
}

# a framework in this dtype vs the float64 oracle
ORACLE: dict[str, Tolerance] = {
    "float64": Tolerance(1e-12, 1e-12),
    "float32": Tolerance(1e-5, 1e-5),
    "float16": Tolerance(1e-2, 1e-2),
    "bfloat16": Tolerance(5e-2, 5e-2),
}

# Issue 2's bar: float32 against the oracle, max relative error (to scale) <= 1e-5.
FLOAT32_ORACLE_RELATIVE = 1e-5
