"""One step of the online softmax (FlashAttention's running maximum and sum), shared by
the blockwise path's unrolled blocks, its tiled loops and the ring.

The order is the library's everywhere: the running maximum ``m`` is that of the
unscaled logits z, and the scale comes after the subtraction, ``exp((z - m) * scale)``:
XLA on CPU would fuse ``z * scale - m`` into one instruction whose rounding differs from
the maximum's, which turns logits of 1e10 into NaN.  A row that has seen nothing yet
(its maximum -inf) subtracts 0, so exp(-inf) stays exactly 0 and its sum 0.  Blocked
keys come in as z = -inf.  Arrays are (..., rows, keys) for z and (..., rows, 1) for
the row statistics.

Attention sinks (a logit per head with no value, in the units of the final scores,
``z * scale``) take no part in the steps: ``finish`` folds a row's sink into its
normaliser, and ``sink_probability`` recovers the sink's weight from the saved row
statistics for the backward.
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


def with_sinks(top: Array, sink: Array) -> tuple[Array, Array]:
    """The keys' and the sink's factors against m = max(top, sink), ``top`` the keys'
    scaled maximum (0 for a row that sees nothing): ``(exp(top - m), exp(sink - m))``,
    both at most 1 so that neither side overflows; a row's weights are then
    ``exp(z - top) * keys / (sum * keys + sink)``.  The side that is m gets exactly 1
    (a multiply-add fused across ``top - m`` cannot round it away from 0), and neither
    exponent is positive in a branch that ``where`` drops (its gradient stays finite)."""
    above = sink > top
    keys = jnp.where(above, jnp.exp(jnp.minimum(top - sink, 0.0)), 1.0)
    return keys, jnp.where(above, 1.0, jnp.exp(jnp.minimum(sink - top, 0.0)))


def finish(m: Array, total: Array, acc: Array, scale: float,
           sink: Array | None = None) -> tuple[Array, Array, Array]:
    """A row's (output, saved maximum, saved normaliser) from its final state: the
    output ``acc / total``, zeros for a row that has seen nothing (its maximum saved as
    0, ``seen_max``).  With ``sink`` (rows, 1) the normaliser also holds
    ``exp(sink - m * scale)``, combined with the keys' maximum (``with_sinks``); the saved
    normaliser is in the frame of the keys' maximum, so the backward's
    ``probabilities(z, m, scale) / normaliser`` are the forward's weights (infinite
    where the sink outweighs every key beyond the dtype's range: their weights are 0)."""
    row_max = seen_max(m)
    if sink is None:
        return acc / jnp.where(total == 0, 1.0, total), row_max, total
    keys, sink_weight = with_sinks(row_max * scale, sink)
    seen = total > 0
    denominator = jnp.where(seen, total * keys + sink_weight, 1.0)
    out = jnp.where(seen, acc * (keys / denominator), 0.0)
    return out, row_max, jnp.where(seen, denominator / keys, 0.0)


def sink_probability(row_max: Array, row_sum: Array, scale: float, sink: Array) -> Array:
    """The sink's weight in each row from ``finish``'s saved maximum and normaliser:
    ``exp(sink - max * scale) / normaliser``, 1 where the sink outweighs the keys beyond
    the dtype's range, 0 for a row that saw nothing (its output is 0, and so is the
    sink's gradient from it)."""
    e = jnp.exp(sink - row_max * scale)
    p = jnp.where(e < row_sum, e / jnp.where(row_sum == 0, 1.0, row_sum), 1.0)
    return jnp.where(row_sum == 0, 0.0, p)
