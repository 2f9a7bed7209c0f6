"""Selection parity for sparse attention (DSA): where two sides (the twins, or a twin and
the oracle) choose different keys, say which queries, how many keys differ and the score
margin at the k-th key, and tell a tie within the scores' rounding (both sides right) from
a divergence; then compare the outputs given one side's choice at the normal tolerance.

Two implementations that round the indexer's float32 scores differently keep different
keys where two keys' scores tie within that rounding, and their outputs then differ by far
more than any float tolerance while both are right: a harness that calls that a divergence
cries wolf, one that loosens its tolerance hides real bugs.  So the choice is data,
compared apart from the numbers: a difference is a tie when the margin at the k-th key
(the gap between the last key kept and the first left out, the larger of the two sides')
is within the rounding; every other difference, and scores that differ beyond their
rounding, diverge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["QueryDifference", "SelectionReport", "compare_selections", "sparse_parity"]

# The scores' rounding, per query row: atol + rtol * the row's largest |score| (float32
# scores of a few dot products each: a few ulps of the largest term).
SCORE_RTOL, SCORE_ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class QueryDifference:
    """One query whose two choices differ: ``keys`` kept by one side and not the other
    (per side: the choices have one size), ``margin`` at the k-th key, ``rounding`` of its
    scores; a ``tie`` where the margin is within the rounding."""

    batch: int
    query: int
    keys: int
    margin: float
    rounding: float

    @property
    def tie(self) -> bool:
        return self.margin <= self.rounding


@dataclass(frozen=True)
class SelectionReport:
    """Two choices of keys compared: the queries compared, those that differ, the largest
    score difference over the keys both sides see and its allowance."""

    queries: int
    differences: tuple[QueryDifference, ...]
    score_error: float
    score_rounding: float

    @property
    def divergent(self) -> tuple[QueryDifference, ...]:
        """The differences that are no tie: a margin beyond the scores' rounding."""
        return tuple(d for d in self.differences if not d.tie)

    @property
    def ok(self) -> bool:
        """No divergent difference, and the scores agree within their rounding."""
        return not self.divergent and self.score_error <= self.score_rounding

    def summary(self) -> str:
        lines = [f"{len(self.differences)} of {self.queries} queries chose different keys "
                 f"({len(self.divergent)} beyond the scores' rounding); scores differ by "
                 f"{self.score_error:.3g} (allowed {self.score_rounding:.3g})"]
        lines += [f"  query (b={d.batch}, t={d.query}): {d.keys} keys differ, margin at the k-th key "
                  f"{d.margin:.3g} ({'a tie' if d.tie else 'DIVERGES'}: rounding {d.rounding:.3g})"
                  for d in self.differences[:20]]
        return "\n".join(lines)


def _gaps(scores: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query row of scores (N, S) (-inf: hidden): the gap between the k-th and the
    (k+1)-th visible score (inf where every visible key is kept) and the largest |score|."""
    visible = np.isfinite(scores)
    ordered = -np.sort(-np.where(visible, scores, -np.inf), axis=-1)
    count = visible.sum(-1)
    k = min(topk, scores.shape[-1])
    gap = np.full(scores.shape[0], np.inf)
    rows = count > k
    if k < scores.shape[-1]:
        gap[rows] = ordered[rows, k - 1] - ordered[rows, k]
    scale = np.where(visible, np.abs(scores), 0.0).max(-1, initial=0.0)
    return gap, scale


def compare_selections(chosen_a: Any, chosen_b: Any, scores_a: Any, scores_b: Any, topk: int, *,
                       rtol: float = SCORE_RTOL, atol: float = SCORE_ATOL) -> SelectionReport:
    """Two choices (bool (B, T, S), True = selected) and the scores each side chose by
    ((B, T, S), -inf at the keys hidden from a query), for ``topk`` keys a query:
    which queries differ, by how many keys, the margin at the k-th key (the larger of the
    two sides' gaps between the k-th and the next score; inf where every visible key is
    kept: a difference there always diverges) against the rounding ``atol + rtol *``
    the row's largest |score|; and the largest score difference over the keys both see.
    Raises ValueError for shapes that differ."""
    a, b = np.asarray(chosen_a, bool), np.asarray(chosen_b, bool)
    sa, sb = np.asarray(scores_a, np.float64), np.asarray(scores_b, np.float64)
    if not (a.shape == b.shape == sa.shape == sb.shape) or a.ndim != 3:
        raise ValueError(f"compare_selections takes choices and scores of one shape (B, T, S); got {a.shape}, "
                         f"{b.shape}, {sa.shape}, {sb.shape}")
    batch, seq, keys = a.shape
    gap_a, scale_a = _gaps(sa.reshape(-1, keys), topk)
    gap_b, scale_b = _gaps(sb.reshape(-1, keys), topk)
    margin, rounding = np.maximum(gap_a, gap_b), atol + rtol * np.maximum(scale_a, scale_b)
    differ = (a != b).reshape(-1, keys)
    rows = np.flatnonzero(differ.any(-1))
    differences = tuple(
        QueryDifference(int(r // seq), int(r % seq), int((a.reshape(-1, keys)[r] & ~b.reshape(-1, keys)[r]).sum()),
                        float(margin[r]), float(rounding[r]))
        for r in rows)
    both = np.isfinite(sa) & np.isfinite(sb)
    error = float(np.abs(sa[both] - sb[both]).max(initial=0.0))
    allowed = float(atol + rtol * max(float(scale_a.max(initial=0.0)), float(scale_b.max(initial=0.0))))
    return SelectionReport(batch * seq, differences, error, allowed)


def sparse_parity(torch_module: Any, flax_module: Any, x: Any, *, positions: Any = None,
                  tolerance: Any = None) -> tuple[SelectionReport, float, bool]:
    """The twins of a sparse attention module (``index_topk``) on x (B, T, d_in), no
    cache: their choices compared (``compare_selections``), then both run on the PyTorch
    twin's choice (``selection=``) and their outputs compared at ``tolerance`` (None:
    ``tolerances.PARITY`` of the module's dtype).  -> (report, the outputs' largest
    difference, whether the outputs agree within tolerance); the choices diverge where
    ``not report.ok``."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from parity_tests.tolerances import PARITY

    xt = torch.as_tensor(np.asarray(x))
    xf = jnp.asarray(np.asarray(x))
    pos_t = None if positions is None else torch.as_tensor(np.asarray(positions))
    pos_f = None if positions is None else jnp.asarray(np.asarray(positions))
    chosen_t, scores_t = torch_module.select_keys(xt, positions=pos_t)
    # the Flax twin under nnx.jit, as the harness runs it (one compile, not op by op)
    chosen_f, scores_f = nnx.jit(lambda m, xs, pos: m.select_keys(xs, positions=pos))(flax_module, xf, pos_f)
    report = compare_selections(chosen_t.numpy(), np.asarray(chosen_f), scores_t.numpy(), np.asarray(scores_f),
                                int(torch_module.spec.index_topk))
    with torch.no_grad():
        out_t = torch_module(xt, positions=pos_t, selection=chosen_t).numpy()
    run = nnx.jit(lambda m, xs, pos, chosen: m(xs, positions=pos, selection=chosen))
    out_f = np.asarray(run(flax_module, xf, pos_f, jnp.asarray(chosen_t.numpy())))
    tol = tolerance if tolerance is not None else PARITY[str(out_t.dtype)]
    error = float(np.abs(out_t.astype(np.float64) - out_f).max(initial=0.0))
    agree = bool(np.all(np.abs(out_t.astype(np.float64) - out_f) <= tol.atol + tol.rtol * np.abs(out_f)))
    return report, error, agree
