"""The parity harness and the test suite for the twin attention modules.

``to_flax`` / ``to_torch`` build a module's twin with its weights copied exactly;
``assert_parity`` / ``check_parity`` prove that a PyTorch module and a Flax NNX module
compute the same function, forward and backward, for this library's modules or, with a
``param_map`` (names, or ``attention_spec.interop.specs.Rule``s for packed, transposed,
reshaped and prefixed weights) and ``torch_call`` / ``flax_call``, for any pair, on the path you choose (``implementation=``), comparing
attention weights only when asked (``weights=True``).  ``full_precision`` is the context
they run in (full-precision matmuls, global flags restored); ``copy_params`` copies
weights through the same map, and ``infer_param_map`` derives that map for a whole model
and its port from module types and names.  ``check_causal_lm_parity`` proves a whole
causal LM port in one call (logits and gradients at the real rows of a padded batch,
training steps, greedy decoding with the port's caches; on failure, where it parts).
``assert_training_parity`` /
``check_training_parity`` train copies of both with matched ``torch.optim`` / ``optax``
optimisers and compare the parameters after every step.  ``locate_divergence`` says where
a whole ported model parts from its original: the innermost module whose inputs agree and
whose output does not, or, backward, whose output cotangent agrees and whose input
cotangent does not.  ``python -m parity_tests``
prints the parity report.
"""

from parity_tests.causal_lm import CausalLMReport, check_causal_lm_parity
from parity_tests.divergence import Divergence, DivergenceReport, ModulePair, locate_divergence
from parity_tests.harness import (
    Finding,
    ParityError,
    ParityReport,
    assert_parity,
    check_parity,
    compare,
    copy_params,
    full_precision,
    to_flax,
    to_torch,
)
from parity_tests.param_map import infer_param_map
from parity_tests.training import (
    TrainingParityError,
    TrainingReport,
    assert_training_parity,
    check_training_parity,
)

__all__ = [
    "Finding",
    "ParityError",
    "ParityReport",
    "assert_parity",
    "check_parity",
    "compare",
    "copy_params",
    "full_precision",
    "to_flax",
    "to_torch",
    "TrainingParityError",
    "TrainingReport",
    "assert_training_parity",
    "check_training_parity",
    "Divergence",
    "DivergenceReport",
    "ModulePair",
    "locate_divergence",
    "infer_param_map",
    "CausalLMReport",
    "check_causal_lm_parity",
]
