"""The table of paths for PyTorch: each row says what it does not honour
(``attention_spec.routing.PathEntry``) and runs it.  ``functional.route`` walks the
table; ``dot_product_attention`` runs the row it names.

In the order ``"auto"`` tries them: ``F.scaled_dot_product_attention`` (SDPA, PyTorch's
fast path on every device, on CPU a fused blockwise kernel), the blockwise path, the
reference math.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attention_spec.flex import mod_blockers
from attention_spec.mods import positioned
from attention_spec.planning import fused_blockers
from attention_spec.routing import PathEntry, option_blockers
from torch_attention import _blockwise, _flex, _fused, _reference
from torch_attention._canonical import Call, structure
from torch_attention.masks import _and_masks as combine_masks

# SDPA draws dropout itself (JAX's fused kernel cannot).
FUSED_DRAWS_DROPOUT = True


def _never(q: Any, k: Any, v: Any, call: Call) -> None:
    return None


def _explicit_blockers(q: Any, k: Any, v: Any, call: Call) -> list[str]:
    return option_blockers(call.options, dropout_mask_given=call.dropout_mask is not None)


def _fused_blockers(q: Any, k: Any, v: Any, call: Call) -> list[str]:
    lacks = fused_blockers(call.options, float64=q.dtype == torch.float64, sinks_given=call.sinks is not None)  # SDPA has none
    return option_blockers(call.options, dropout_mask_given=call.dropout_mask is not None,
                           draws_dropout=FUSED_DRAWS_DROPOUT, lacks=lacks)


# ---------------------------------------------------------------------- what each row runs
# q, k and v (..., H, S, D); ``scale`` resolved.

def _dropout_rate(call: Call) -> float:
    return call.options.dropout_rate if call.options.training else 0.0


def _run_fused(q: Tensor, k: Tensor, v: Tensor, call: Call, *, scale: float) -> Tensor:
    o = call.options
    if (not o.causal and o.window is None and o.chunk is None and all(t is None for t in (call.mask, call.bias, call.kv_lengths,
                                                                          call.segments))
            and isinstance(call.offset, int)):
        # every query sees every key (a decoded token over the filled prefix): nothing to
        # structure, no key to zero, straight to SDPA
        return _fused._fused(q, k, v, mask=None, causal=False, lengths=None, scale=scale,
                             dropout_rate=_dropout_rate(call))
    s = structure(q, k, v, call, "fused")
    return _fused._fused(q, s.k, s.v, mask=s.mask, causal=s.causal, lengths=s.lengths, scale=scale,
                         dropout_rate=_dropout_rate(call), bias=call.bias)


def _repeated(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The explicit paths repeat each key/value head for its group of queries."""
    groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
    if groups > 1:
        return k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    return k, v


def _run_blockwise(q: Tensor, k: Tensor, v: Tensor, call: Call, *, scale: float) -> Tensor:
    s = structure(q, k, v, call, "blockwise")
    k, v = _repeated(q, s.k, s.v)
    return _blockwise.blockwise(q, k, v, s, call, scale=scale)


def _run_reference(q: Tensor, k: Tensor, v: Tensor, call: Call, *, scale: float) -> Tensor | tuple[Tensor, Tensor]:
    """The reference math: the weights (``attention_weights``), dropout, the values mixed."""
    s = structure(q, k, v, call, "reference")
    k, v = _repeated(q, s.k, s.v)
    o = call.options
    mask = combine_masks(s.mask, s.lengths)
    weights = _reference.attention_weights(
        q, k, mask=mask, causal=s.causal, scale=scale, mask_strategy=o.mask_strategy,
        normalization=o.normalization, bias=call.bias, softcap=o.softcap, sinks=call.sinks,
        score_mod=positioned(o.score_mod, call.offset), mask_mod=positioned(o.mask_mod, call.offset),
    )
    weights = _reference.dropout_weights(weights, o.dropout_rate, training=o.training, dropout_mask=call.dropout_mask)
    # mixed in the compute dtype: half-precision weights would add a rounding per weight
    out = torch.matmul(weights, v.to(weights.dtype)).to(v.dtype)  # (..., T, Dv)
    return (out, weights.to(v.dtype)) if o.return_weights else out


def _has_mods(call: Call) -> bool:
    return call.options.score_mod is not None or call.options.mask_mod is not None


def _flex_blockers(q: Any, k: Any, v: Any, call: Call) -> list[str]:
    return mod_blockers(call.options, rank=q.dim(), sinks_given=call.sinks is not None,
                        dropout_mask_given=call.dropout_mask is not None)


def _run_flex(q: Tensor, k: Tensor, v: Tensor, call: Call, *, scale: float) -> Tensor:
    return _flex.run_call(q, k, v, call, scale=scale)


FUSED = PathEntry("fused", declines=_never, blockers=_fused_blockers,
                  kernel=lambda q, k, v, call: "sdpa", run=_run_fused)
BLOCKWISE = PathEntry("blockwise", declines=_never, blockers=_explicit_blockers,
                      kernel=lambda q, k, v, call: "blockwise", run=_run_blockwise)
# A module's mods that stand for no named option: query blocks over the key blocks they
# leave visible (``_flex``); an explicit path cannot ask for it ("auto" alone takes it).
FLEX = PathEntry("flex", declines=lambda q, k, v, call: None, blockers=_flex_blockers,
                 kernel=lambda q, k, v, call: "flex-blocks", run=_run_flex, applies=_has_mods)
REFERENCE = PathEntry("reference", declines=_never, blockers=lambda q, k, v, call: [],
                      kernel=lambda q, k, v, call: "reference", run=_run_reference)

TABLE = (FUSED, BLOCKWISE, FLEX, REFERENCE)
