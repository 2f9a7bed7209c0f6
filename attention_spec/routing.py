"""Which path computes a call, and why not a faster one: the policy both twins route by.

A twin's ``functional.route()`` asks its machine what it has (the fast paths in order,
and the ones it declines, with why) and hands that here with the call's options;
``resolve_route`` picks the path and keeps the reasons.  ``dot_product_attention`` runs
the path that ``route()`` names, so a user who asks gets the answer the call will act on.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from attention_spec.options import check_implementation


class Route(NamedTuple):
    """The route of one call.

    path: ``"reference"``, ``"fused"`` or ``"blockwise"``, the path that computes it.
    kernel: what runs that path here (``route()`` of each twin lists its kernels).
    reasons: for each faster path not taken, ``"<path>: <why>"``, fastest first.
    """

    path: str
    kernel: str
    reasons: tuple[str, ...] = ()

    def explain(self) -> str:
        """One line per fact: the path and kernel, then each reason."""
        return "\n".join([f"{self.path} ({self.kernel})", *(f"  not {reason}" for reason in self.reasons)])


def path_blockers(
    path: str,
    *,
    return_weights: bool,
    normalization: str,
    dropout_active: bool,
    dropout_mask_given: bool,
    fused_draws_dropout: bool,
    fused_blockers: tuple[str, ...] = (),
) -> list[str]:
    """The options that ``path`` cannot honour (empty: it can run the call).  The
    reference math honours everything; the others never materialise the weights, compute
    only the softmax, and draw dropout only where the fused kernel does
    (``fused_draws_dropout``); ``fused_blockers`` is what the twin's fused kernel lacks."""
    found: list[str] = []
    if path == "reference":
        return found
    if return_weights:
        found.append("return_weights=True (the weights are never materialised)")
    if normalization != "softmax":
        found.append(f"normalization={normalization!r}")
    if dropout_mask_given:
        found.append("an explicit dropout_mask")
    elif dropout_active and not (path == "fused" and fused_draws_dropout):
        found.append("dropout in training mode")
    if path == "fused":
        found += fused_blockers
    return found


def resolve_route(
    requested: str,
    *,
    preference: tuple[str, ...],
    declined: tuple[tuple[str, str], ...] = (),
    return_weights: bool,
    normalization: str,
    dropout_active: bool,
    dropout_mask_given: bool,
    fused_draws_dropout: bool,
    fused_blockers: tuple[str, ...] = (),
) -> tuple[str, tuple[str, ...]]:
    """(path, reasons): ``resolve_implementation``'s path, and for ``"auto"`` why each
    faster path was passed by: the machine's (``declined``: (path, why) for the fast
    paths it has but does not take for this call) and the options' (``path_blockers``)."""
    blockers = functools.partial(
        path_blockers, return_weights=return_weights, normalization=normalization,
        dropout_active=dropout_active, dropout_mask_given=dropout_mask_given,
        fused_draws_dropout=fused_draws_dropout, fused_blockers=fused_blockers,
    )
    check_implementation(requested)
    if requested != "auto":
        found = blockers(requested)
        if found:
            raise ValueError(
                f"implementation={requested!r} cannot honour {'; '.join(found)}; "
                "use implementation='reference' or 'auto'"
            )
        return requested, ()
    reasons = [f"{path}: {why}" for path, why in declined]
    for path in preference:
        found = blockers(path)
        if not found:
            return path, tuple(reasons)
        reasons.append(f"{path}: {'; '.join(found)}")
    return "reference", tuple(reasons)


def resolve_implementation(
    requested: str,
    *,
    preference: tuple[str, ...],
    return_weights: bool,
    normalization: str,
    dropout_active: bool,
    dropout_mask_given: bool,
    fused_draws_dropout: bool,
    fused_blockers: tuple[str, ...] = (),
) -> str:
    """Which path computes a call: ``"reference"``, ``"fused"`` or ``"blockwise"``.

    ``"auto"`` takes the first path of ``preference`` (the framework's fast paths on this
    device, fastest first) that honours every option asked for, else the reference
    math (attention weights returned, ``normalization="sum"``, dropout that the path
    cannot draw, an explicit dropout mask, or what the framework's fused kernel lacks,
    ``fused_blockers``).  An explicit ``"fused"`` or ``"blockwise"`` that cannot honour
    an option raises ``ValueError`` naming it.
    """
    return resolve_route(
        requested, preference=preference, return_weights=return_weights, normalization=normalization,
        dropout_active=dropout_active, dropout_mask_given=dropout_mask_given,
        fused_draws_dropout=fused_draws_dropout, fused_blockers=fused_blockers,
    )[0]
