"""Every variant, PyTorch -> Flax with weights copied, over batch {1, 3}, seq {1, 5,
context_length}, heads {1, 2, 4}, with and without a mask: outputs and attention weights,
on the reference path (the only one that has weights; the other paths are in the matrix,
test_matrix.py).  (Gradients are compared across the larger matrix in test_matrix.py; here they would
double the compile time for no extra coverage.)"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.cases import VARIANTS, make_mask
from tests.support import needs_both

pytestmark = needs_both

CONTEXT_LENGTH = 8


def heads_of(spec):
    return (1, 2, 4) if spec.multihead else (1,)


def grid():
    for variant_id, spec in VARIANTS.items():
        for batch in (1, 3):
            for seq in (1, 5, CONTEXT_LENGTH):
                for heads in heads_of(spec):
                    for masked in (False, True):
                        # the quick tier (``-m "not slow"``) runs one point per variant
                        quick = (batch, seq, masked) == (3, 5, True) and heads == max(heads_of(spec))
                        yield pytest.param(
                            variant_id, batch, seq, heads, masked,
                            id=f"{variant_id}-b{batch}-T{seq}-h{heads}-{'mask' if masked else 'nomask'}",
                            marks=() if quick else pytest.mark.slow,
                        )


@pytest.mark.parametrize("variant_id,batch,seq,heads,masked", list(grid()))
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
