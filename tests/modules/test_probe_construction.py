"""A ``MultiHeadAttention`` that could be built but never called (issue 40, item 5):
``rope=`` with ``kdim`` / ``vdim`` other than ``d_in``.  Rope rotates the queries and keys
of self-attention and refuses ``context=``; without a context the keys and values are
projected from x, which is ``d_in`` wide, so a key or value projection of another width
fails at every call.  The registry's configuration check refuses it at construction,
with one text for ``make_config`` and both twins; ``kdim`` / ``vdim`` equal to ``d_in``
(as an importer may spell them) stay allowed and callable."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from attention_spec.rope import RopeConfig
from tests.support import constructor_errors, needs_both, random_x

D_IN = 16
BASE = {"d_in": D_IN, "d_out": D_IN, "context_length": None, "dropout": 0.0, "num_heads": 2,
        "rope": RopeConfig(theta=10000.0)}
LEAVE = "leave {names} unset (or equal to d_in), or build the module without rope="
# (widths given, text)
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"kdim": 8}, f"kdim=8 is a cross-attention width (of context=), but rope= rotates the queries and keys of "
                  f"self-attention, whose keys and values come from x (d_in={D_IN} wide): such a module could "
                  f"never be called; " + LEAVE.format(names="kdim")),
    ({"vdim": 12}, f"vdim=12 is a cross-attention width (of context=), but rope= rotates the queries and keys of "
                   f"self-attention, whose keys and values come from x (d_in={D_IN} wide): such a module could "
                   f"never be called; " + LEAVE.format(names="vdim")),
    ({"kdim": 8, "vdim": 12}, f"kdim=8 and vdim=12 are cross-attention widths (of context=), but rope= rotates the "
                              f"queries and keys of self-attention, whose keys and values come from x (d_in={D_IN} "
                              f"wide): such a module could never be called; " + LEAVE.format(names="kdim and vdim")),
    ({"kdim": D_IN, "vdim": 12}, f"vdim=12 is a cross-attention width (of context=), but rope= rotates the queries "
                                 f"and keys of self-attention, whose keys and values come from x (d_in={D_IN} wide): "
                                 f"such a module could never be called; " + LEAVE.format(names="vdim")),
]


@needs_both
@pytest.mark.parametrize(("widths", "text"), REFUSED, ids=["kdim", "vdim", "kdim-vdim", "vdim-only-differs"])
def test_rope_with_cross_attention_widths_is_refused_at_construction(widths: dict[str, Any], text: str) -> None:
    assert constructor_errors({**BASE, **widths}) == [(ValueError, text)] * 3


@needs_both
def test_the_same_widths_without_rope_still_build() -> None:
    from attention_spec.registry import make_config

    spec = make_config("MultiHeadAttention", {**BASE, "rope": None, "kdim": 8, "vdim": 12})
    assert (spec.kdim, spec.vdim) == (8, 12)


@needs_both
def test_rope_with_kdim_and_vdim_equal_to_d_in_builds_and_runs_in_both_twins() -> None:
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import jax_attention
    import torch_attention

    options = {**BASE, "kdim": D_IN, "vdim": D_IN}
    x = random_x((2, 5, D_IN))
    for out in (torch_attention.MultiHeadAttention(**options)(torch.from_numpy(x)).detach().numpy(),
                np.asarray(jax_attention.MultiHeadAttention(**options, rngs=nnx.Rngs(0))(jnp.asarray(x)))):
        assert out.shape == (2, 5, D_IN) and np.isfinite(out).all()
    with pytest.raises(ValueError, match=re.escape("rope= rotates the queries and keys of self-attention")):
        torch_attention.MultiHeadAttention(**options)(torch.from_numpy(x), context=torch.from_numpy(x))
