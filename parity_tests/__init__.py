"""The parity harness and the test suite for the twin attention modules.

``to_flax`` / ``to_torch`` build a module's twin with its weights copied exactly;
``assert_parity`` / ``check_parity`` prove that a PyTorch module and a Flax NNX module
compute the same function, forward and backward, for this library's modules or, with a
``param_map``, for your own, on the path you choose (``implementation=``), comparing
attention weights only when asked (``weights=True``).  ``full_precision`` is the context
they run in (full-precision matmuls, global flags restored).  ``python -m parity_tests``
prints the parity report.
"""

from parity_tests.harness import (
    Finding,
    ParityError,
    ParityReport,
    assert_parity,
    check_parity,
    compare,
    full_precision,
    to_flax,
    to_torch,
)

__all__ = [
    "Finding",
    "ParityError",
    "ParityReport",
    "assert_parity",
    "check_parity",
    "compare",
    "full_precision",
    "to_flax",
    "to_torch",
]
