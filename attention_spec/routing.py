"""Which path computes a call, and why not a faster one: the policy both twins route by.

A twin's table of paths (``_paths.py``) is a list of ``PathEntry`` rows, each saying
when it declines a call and which options it cannot honour (``option_blockers``);
``functional.route()`` walks it (``walk``), and ``dot_product_attention`` runs the row
that ``route()`` names, so a user who asks gets the answer the call will act on.
A module's planner asks the same table before any work, on the call's shapes
(``planning.plan_call``, a twin's ``check_route``).  ``resolve_implementation`` (and
``resolve_route``, its form with reasons) is the policy over a bare preference of paths,
for a caller with no table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from attention_spec.mods import Mod
from attention_spec.options import CallOptions, check_implementation


class _Fields(NamedTuple):
    path: str
    kernel: str
    reasons: tuple[str, ...] = ()


class Route(_Fields):
    """The route of one call: ``(path, kernel, reasons)``, and ``basis``.

    path: ``"reference"``, ``"fused"`` or ``"blockwise"``, the path that computes it.
    kernel: what runs that path here (``route()`` of each twin lists its kernels).
    reasons: for each faster path not taken, ``"<path>: <why>"``, fastest first.
    basis: for ``"auto"``, what decided between paths by their speed on this machine
    where a measurement did (JAX on CPU: the library's kernel against the blockwise
    path, measured once per build, or forced), else empty.  An attribute beside the
    three fields: a route unpacks, and compares, as ``(path, kernel, reasons)``.
    """

    basis: str

    def __new__(cls, path: str, kernel: str, reasons: tuple[str, ...] = (), basis: str = "") -> Route:
        route = super().__new__(cls, path, kernel, reasons)
        route.basis = basis
        return route

    def __repr__(self) -> str:
        extra = f", basis={self.basis!r}" if self.basis else ""
        return f"Route(path={self.path!r}, kernel={self.kernel!r}, reasons={self.reasons!r}{extra})"

    def explain(self) -> str:
        """One line per fact: the path and kernel, each reason, then what decided."""
        return "\n".join([f"{self.path} ({self.kernel})", *(f"  not {reason}" for reason in self.reasons),
                          *([f"  decided by: {self.basis}"] if self.basis else [])])


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
    if path == "reference":
        return []
    fused = path == "fused"
    return _blockers(return_weights, normalization, dropout_active, dropout_mask_given,
                     draws_dropout=fused and fused_draws_dropout, lacks=fused_blockers if fused else ())


def _blockers(return_weights: bool, normalization: str, dropout_active: bool, dropout_mask_given: bool, *,
              draws_dropout: bool, lacks: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    if return_weights:
        found.append("return_weights=True (the weights are never materialised)")
    if normalization != "softmax":
        found.append(f"normalization={normalization!r}")
    if dropout_mask_given:
        found.append("an explicit dropout_mask")
    elif dropout_active and not draws_dropout:
        found.append("dropout in training mode")
    return found + list(lacks)


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


def mod_names(options: CallOptions) -> list[str]:
    """The mods of a call that only the flex path and the reference math apply, each as
    its blocker text names it, e.g. ``"score_mod (Alibi, which stands for no named option)"``, the
    mask mod first."""
    found = []
    for role in ("mask_mod", "score_mod"):  # flex_attention's order: the block mask's, then the score's
        mod = getattr(options, role)
        if mod is not None:
            what = type(mod).__name__ if isinstance(mod, Mod) else "a function of its own"
            found.append(f"{role} ({what}, which stands for no named option)")
    return found


def option_blockers(options: CallOptions, *, dropout_mask_given: bool, draws_dropout: bool = False,
                    lacks: tuple[str, ...] = (), honours_mods: bool = False) -> list[str]:
    """What a path other than the reference math cannot honour of a call's options
    (``path_blockers``'s list, from the ``CallOptions``): the weights returned, another
    normalisation than the softmax, an explicit dropout mask, dropout it does not draw
    (``draws_dropout``), then what its kernel lacks (``lacks``), then a module's mods that
    stand for no named option, unless it ``honours_mods`` (the flex path)."""
    found = _blockers(options.return_weights, options.normalization, options.dropout_active, dropout_mask_given,
                      draws_dropout=draws_dropout, lacks=lacks)
    if not honours_mods and (options.score_mod is not None or options.mask_mod is not None):
        found += mod_names(options)
    return found


class PathEntry(NamedTuple):
    """One row of a twin's table of paths: a way to compute a call, and what it honours.

    path: the ``implementation`` it answers to (``"fused"``, ``"blockwise"``,
    ``"reference"``; several rows may answer to one, tried in order).  ``declines(q, k, v,
    call)``: why this row does not take the call whatever its options (the machine, the
    call's shapes or arrays), None where it does; an explicit request then tries the next
    row of its path.  ``blockers(q, k, v, call)``: the options it cannot honour (an explicit
    request for it raises naming them).  ``kernel(q, k, v, call)``: what runs it.
    ``run``: the work (the twin's signature).  ``auto``: whether ``"auto"`` may take it.
    ``basis(q, k, v, call)``: where a measurement on this machine decides whether
    ``"auto"`` takes the row, what decided (``Route.basis``), else empty; asked by
    ``route()`` only, never by a call.
    q, k and v are read for their shapes and dtypes, (..., H, S, D); ``call`` is the twin's
    checked call (its ``options`` a ``CallOptions``)."""

    path: str
    declines: Callable[[Any, Any, Any, Any], str | None]
    blockers: Callable[[Any, Any, Any, Any], list[str]]
    kernel: Callable[[Any, Any, Any, Any], str]
    run: Callable[..., Any]
    auto: bool = True
    basis: Callable[[Any, Any, Any, Any], str] | None = None
    # Whether the row is for this call at all (None: every call): a row that is not is
    # passed by without a reason (the flex path, for a call without mods).
    applies: Callable[[Any], bool] | None = None


def walk(table: Sequence[PathEntry], q: Any, k: Any, v: Any, call: Any) -> tuple[PathEntry, tuple[str, ...]]:
    """The row of ``table`` that computes ``call`` (``call.options.implementation``), and
    for ``"auto"`` why each row before it was passed by (``"<path>: <why>"``, in the
    table's order, fastest first).  ``"auto"`` takes the first row it may take that
    neither declines nor is blocked; an explicit path the first of its rows that does not
    decline, and raises ``ValueError`` naming the options that row cannot honour."""
    requested = call.options.implementation
    if requested == "auto":
        reasons: list[str] = []
        for entry in table:
            if not entry.auto or (entry.applies is not None and not entry.applies(call)):
                continue
            why = entry.declines(q, k, v, call)
            if why is None:
                found = entry.blockers(q, k, v, call)
                if not found:
                    return entry, tuple(reasons)
                why = "; ".join(found)
            reasons.append(f"{entry.path}: {why}")
        raise AssertionError("the table's reference row takes every call")
    for entry in table:
        if entry.path == requested and entry.declines(q, k, v, call) is None:
            found = entry.blockers(q, k, v, call)
            if found:
                raise ValueError(
                    f"implementation={requested!r} cannot honour {'; '.join(found)}; "
                    "use implementation='reference' or 'auto'"
                )
            return entry, ()
    raise AssertionError(f"the table has no row for implementation={requested!r} that takes the call")
