"""Position biases shared by both twins: the ALiBi head slopes (each twin's
``alibi_bias`` scales the key-minus-query distances by them)."""

from __future__ import annotations

import math

from attention_spec.options import check_positive_int


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
