"""Every variant, PyTorch -> Flax with weights copied, over batch {1, 3}, seq {1, 5,
context_length}, heads {1, 2, 4}, with and without a mask (one covering of the values; every
pair, and the full product, with ``--exhaustive``): outputs and attention weights,
on the reference path (the only one that has weights; the other paths are in the matrix,
test_matrix.py).  (Gradients are compared across the larger matrix in test_matrix.py; here they would
double the compile time for no extra coverage.)"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.cases import VARIANTS, make_mask
from tests.support import needs_both, tiered

pytestmark = needs_both

CONTEXT_LENGTH = 8


def _valid(row):
    """A single-head variant has one head."""
    spec = VARIANTS.get(row.get("variant_id", ""))
    return spec is None or spec.multihead or row.get("heads", 1) == 1


# One covering of the five axes (tests/support.py, tiered, strength=0): every variant once,
# every batch, length (the context length included), head count and mask with several
# variants; the matrix (test_matrix.py) runs every pair of these axes, weights compared on
# the reference path. The pairs, then the full product (564 cases), with --exhaustive.
GRID = tiered("variant_id,batch,seq,heads,masked", list(VARIANTS), (1, 3), (1, 5, CONTEXT_LENGTH), (1, 2, 4),
              (False, True), valid=_valid, strength=0)


@pytest.mark.parametrize("variant_id,batch,seq,heads,masked", GRID)
def test_twins_agree(variant_id, batch, seq, heads, masked):
    import torch

    import torch_attention
    from parity_tests import assert_parity, to_flax

    spec = VARIANTS[variant_id]
    config = spec.config(heads)
    if "context_length" in config:
        config["context_length"] = CONTEXT_LENGTH
    rng = np.random.default_rng(batch * 100 + seq * 10 + heads)
    x = spec.make_inputs(rng, (batch, seq)).astype(np.float32)
    mask = make_mask("random", batch, heads, seq, rng) if masked else None
    torch.manual_seed(0)
    torch_module = getattr(torch_attention, spec.cls)(**config).eval()
    report = assert_parity(torch_module, to_flax(torch_module), x, mask=mask, grads=False, weights=True)
    assert [f.name for f in report.findings] == ["output", "attention weights"]
