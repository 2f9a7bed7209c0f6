"""The plan of one module call, made once before any work: which checks it passes (in the
order that gives every bad call its one error), and whether an explicit ``implementation``
can honour its options.

Both twins' modules ask it; a twin keeps only its array work (converting masks and
lengths, reading values, adding the batch dimension).
"""

from __future__ import annotations

from attention_spec.routing import resolve_implementation

# Why an explicit "fused" refuses float64 (both frameworks, one behaviour): JAX's fused
# attention computes float64 with float32 accuracy; "auto" sends float64 to a path that
# stays float64.
FUSED_FLOAT64_BLOCKER = "float64 inputs (the fused kernel does not guarantee float64 accuracy)"

SOFTCAP_FUSED_BLOCKER = "softcap (the fused kernel has no logit soft-capping)"


def fused_blockers(float64: bool, softcap: float | None) -> tuple[str, ...]:
    """What the fused kernels of both twins cannot honour beyond ``resolve_implementation``'s
    common list: float64 inputs (``float64``) and soft-capping."""
    return ((FUSED_FLOAT64_BLOCKER,) if float64 else ()) + ((SOFTCAP_FUSED_BLOCKER,) if softcap is not None else ())


def check_explicit_path(
    implementation: str,
    *,
    fused_draws_dropout: bool,
    float64: bool,
    softcap: float | None,
    return_weights: bool,
    normalization: str,
    dropout_active: bool,
    dropout_mask_given: bool,
) -> None:
    """Raises the ``ValueError`` that ``dot_product_attention`` raises for an explicit
    ``implementation`` that cannot honour these options, from the options alone: a
    module asks it before any work, a cached call before it writes its cache.  (An
    explicit path's refusals do not depend on the preference order of ``"auto"``;
    ``fused_draws_dropout`` is the twin's: SDPA draws it, JAX's fused kernels cannot.)"""
    if implementation in ("auto", "reference"):
        return  # they refuse nothing: "auto" falls back to the reference math
    resolve_implementation(
        implementation, preference=(), return_weights=return_weights, normalization=normalization,
        dropout_active=dropout_active, dropout_mask_given=dropout_mask_given,
        fused_draws_dropout=fused_draws_dropout, fused_blockers=fused_blockers(float64, softcap),
    )
