"""``examples/port_flex.py``: a tiny language model on PyTorch's own flex attention
(packed documents, causal, a window, a soft cap) ported to Flax NNX on the JAX twin's
flex attention, the mods written once: logits and every parameter's gradient agree at 512
positions (the PyTorch side's gradients on the PyTorch twin's flex: PyTorch's own has no
CPU backward)."""

from __future__ import annotations

from parity_tests.tolerances import FLEX_TORCH
from tests.support import needs_both

pytestmark = needs_both


def test_the_flex_port_agrees_in_logits_and_every_gradient() -> None:
    from examples import port_flex

    found = port_flex.prove()
    assert set(found) == {"logits", "grad embed.weight", "grad q_proj.weight", "grad k_proj.weight",
                          "grad v_proj.weight", "grad o_proj.weight"}
    assert all(diff <= FLEX_TORCH.rtol for diff in found.values()), found  # measured 1.6e-6 at most
