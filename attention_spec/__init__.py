"""The framework-free contract that both twins share.

``attention_spec.registry`` declares every variant once (signature, projections, dropout)
and the frozen ``AttentionConfig`` that every module holds as ``module.spec``.

``torch_attention`` and ``jax_attention`` import this package (and never each other's
framework) so that every check and every error message exists exactly once: the same bad
input gives the same exception type and the same text in both frameworks.  Nothing here
imports torch or jax; checks work on shapes (tuples of ints) and dtype names (strings).

``attention_spec.interop`` (the weight map, packed q/k/v, checkpoint files, the native
allow-lists, Hugging Face's options) builds on this contract for the twins' interop, the
parity harness and the examples; nothing in the contract imports it at import time.
"""

from typing import TYPE_CHECKING, Any

from attention_spec.arrays import (
    check_bool,
    check_compute_dtype,
    check_floating,
    check_input,
    check_qkv,
    dtype_name,
)
from attention_spec.masks import ADDITIVE_BIAS_MESSAGE, check_dropout_mask, check_kv_lengths, check_mask
from attention_spec.options import (
    IMPLEMENTATIONS,
    MASK_STRATEGIES,
    NORMALIZATIONS,
    CallOptions,
    call_options,
    check_config,
    check_dropout_rate,
    check_heads,
    check_implementation,
    check_mask_strategy,
    check_normalization,
    check_positive_int,
    check_scale,
    zero_row_sum_message,
)
from attention_spec.registry import REGISTRY, AttentionConfig, make_config, variant
from attention_spec.routing import Route, resolve_implementation, resolve_route

if TYPE_CHECKING:  # at run time, __getattr__ below imports it on first use
    from attention_spec.interop.huggingface import window_from_hf

__all__ = [
    "REGISTRY",
    "AttentionConfig",
    "make_config",
    "variant",
    "check_compute_dtype",
    "CallOptions",
    "call_options",
    "ADDITIVE_BIAS_MESSAGE",
    "check_bool",
    "check_config",
    "check_floating",
    "IMPLEMENTATIONS",
    "MASK_STRATEGIES",
    "NORMALIZATIONS",
    "check_dropout_mask",
    "check_dropout_rate",
    "check_heads",
    "check_implementation",
    "check_input",
    "check_kv_lengths",
    "check_mask",
    "check_mask_strategy",
    "check_normalization",
    "check_positive_int",
    "check_qkv",
    "check_scale",
    "dtype_name",
    "Route",
    "resolve_implementation",
    "resolve_route",
    "zero_row_sum_message",
    "window_from_hf",
]


def __getattr__(name: str) -> Any:
    """``window_from_hf`` (Hugging Face's ``sliding_window`` as our ``window``), looked up in
    ``attention_spec.interop.huggingface`` on first use: the contract imports no interop."""
    if name == "window_from_hf":
        from attention_spec.interop.huggingface import window_from_hf

        return window_from_hf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
