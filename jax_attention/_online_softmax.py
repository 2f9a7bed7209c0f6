"""One step of the online softmax (FlashAttention's running maximum and sum), shared by
the blockwise path's unrolled blocks, its tiled loops and the ring.

The order is the library's everywhere: the running maximum ``m`` is that of the
unscaled logits z, and the scale comes after the subtraction, ``exp((z - m) * scale)``:
XLA on CPU would fuse ``z * scale - m`` into one instruction whose rounding differs from
the maximum's, which turns logits of 1e10 into NaN.  A row that has seen nothing yet
(its maximum -inf) subtracts 0, so exp(-inf) stays exactly 0 and its sum 0.  Blocked
keys come in as z = -inf.  Arrays are (..., rows, keys) for z and (..., rows, 1) for
the row statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jax import Array

State = tuple[Array, Array, Array]  # (running max m, running sum of exp, accumulated p @ v)


def seen_max(m: Array) -> Array:
    """The maximum to subtract: ``m``, or 0 for a row that has seen nothing (-inf)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def step(state: State | None, z: Array, scale: float, mix: Callable[[Array], Array]) -> State:
    """The state after also seeing the logits ``z`` (blocked keys at -inf) whose values
    ``mix`` (p -> p @ v) mixes; ``state`` None is the empty state (nothing seen: the
    block's own maximum, sum and mix, with no rescaling)."""
    block_max = z.max(axis=-1, keepdims=True)
    m_new = block_max if state is None else jnp.maximum(state[0], block_max)
    m_sub = seen_max(m_new)
    p = jnp.exp((z - m_sub) * scale)
    if state is None:
        return m_new, p.sum(axis=-1, keepdims=True), mix(p)
    m, total, acc = state
    rescale = jnp.exp((m - m_sub) * scale)
    return m_new, total * rescale + p.sum(axis=-1, keepdims=True), acc * rescale + mix(p)


def probabilities(z: Array, m: Array, scale: float) -> Array:
    """The forward's unnormalised weights recomputed from its saved row maximum ``m``
    (that of the unscaled logits, 0 for an empty row): ``exp((z - m) * scale)``."""
    return jnp.exp((z - m) * scale)
