"""Tolerances per dtype, in one place.

A comparison passes when every element satisfies ``|a - b| <= atol + rtol * |b|``, or,
for a normwise tolerance (gradients), ``|a - b| <= atol + rtol * max|b|``.

How they were measured: ``python -m parity_tests`` over the whole matrix (66 module cases:
one pairwise design over 10 variants x batch {1, 2, 7} x heads {1, 2, 4, 8} x seq {1, 6,
17, 64} x 6 masks x 3 dtypes x both directions x 4 paths {reference, fused, blockwise,
auto}; and 31 functional cases with q_len != kv_len, masks and kv_lengths), forward and
gradients, on a 2-core x86 CPU with torch 2.13.0 (CPU) and jax 0.10.2, 2026-11-22 (the
first measurement, 2026-11-21, was of the reference path alone).  The report prints, per
dtype and per path, the smallest t with rtol = atol = t that every case passes; the
measured worst values are in the comments, and each tolerance keeps a margin of about 4x
or more over them.
bfloat16 has an 8-bit significand (unit roundoff 2**-8 = 3.9e-3), float16 an 11-bit one
(2**-11 = 4.9e-4); an attention layer rounds several times in a row (projection, scores,
weights, mix, output projection), so errors of a few roundoffs are expected.
"""

from __future__ import annotations

from typing import NamedTuple


class Tolerance(NamedTuple):
    rtol: float
    atol: float
    # normwise: |a - b| <= atol + rtol * max|b| (the tensor's scale) instead of |b|.  Used
    # for gradients: a parameter gradient is a sum over batch and sequence whose terms
    # can cancel, so its rounding error scales with the terms, not with the result.
    normwise: bool = False


# jit against eager, float32, off the CPU: bit for bit on XLA's CPU backend, but its GPU
# backend fuses differently under jit and rounds a few ulps apart.
JIT_OFF_CPU = Tolerance(2e-6, 2e-6)  # measured 4.8e-7 (H100, jax 0.11.2, 2026-11-23)

# framework vs framework, same dtype: outputs and attention weights
PARITY: dict[str, Tolerance] = {
    "float64": Tolerance(1e-12, 1e-12),
    "float32": Tolerance(1e-5, 1e-5),  # measured 4.1e-7
    "float16": Tolerance(1e-2, 1e-2),  # measured 7.5e-4
    "bfloat16": Tolerance(5e-2, 5e-2),  # measured 5.3e-3
}

# a framework in this dtype vs the float64 loop oracle (inputs and weights as it saw them)
ORACLE: dict[str, Tolerance] = {
    "float64": Tolerance(1e-12, 1e-12),
    "float32": Tolerance(1e-5, 1e-5),  # measured 2.8e-7
    "float16": Tolerance(1e-2, 1e-2),  # measured 8.3e-4 (1.9e-3 on 11-21)
    "bfloat16": Tolerance(5e-2, 5e-2),  # measured 5.0e-3 (1.3e-2 on 11-21)
}

# gradients w.r.t. every input and parameter, framework vs framework and vs the same
# module's float64 autograd
GRAD_PARITY: dict[str, Tolerance] = {
    "float64": Tolerance(1e-12, 1e-12, normwise=True),
    "float32": Tolerance(2e-5, 2e-5, normwise=True),  # measured 1.0e-6 (2.9e-6 on 11-21)
    "float16": Tolerance(4e-2, 4e-2, normwise=True),  # measured 2.5e-3 (7.7e-3 on 11-21)
    "bfloat16": Tolerance(1e-1, 1e-1, normwise=True),  # measured 1.4e-2 (2.3e-2 on 11-21)
}
GRAD_ORACLE: dict[str, Tolerance] = {
    "float64": Tolerance(1e-12, 1e-12, normwise=True),
    "float32": Tolerance(2e-5, 2e-5, normwise=True),  # measured 7.6e-7 (2.7e-6 on 11-21)
    "float16": Tolerance(4e-2, 4e-2, normwise=True),  # measured 2.4e-3 (6.8e-3 on 11-21)
    "bfloat16": Tolerance(1e-1, 1e-1, normwise=True),  # measured 1.4e-2 (2.2e-2 on 11-21)
}

# Issue 2's bar: float32 against the oracle, max relative error (to scale) <= 1e-5.
FLOAT32_ORACLE_RELATIVE = 1e-5

# Training-step parity (parity_tests/training.py): every parameter after each optimiser
# step, torch.optim vs optax, normwise against the parameter's largest magnitude (the
# loss of each step elementwise, same numbers).  Measured with check_training_parity at
# rtol = atol = 0, 10 steps each of SGD (momentum 0 and 0.9), Adam (weight decay 0 and
# 0.1) and AdamW (weight decay 0.1) on MultiHeadAttention, CausalAttention and
# SelfAttention_v1, batches (2, 6, 8), targets random and from a teacher module, same
# machine and versions as above plus optax 0.2.8, 2026-11-22.  The smallest t with
# rtol = atol = t that every run passes: float32 6e-6 (SGD, momentum 0.9, lr 0.05 on
# SelfAttention_v1 with random targets, whose N(0, 1) matrices give the largest
# gradients; Adam and AdamW 6.2e-7; the divergence relative to a parameter's own scale
# peaked at 9.5e-6, Adam on a 0.09-scale out_proj.bias), float64 5.7e-15; the tolerances
# keep about 8x and 100x over them.  Not given for float16 / bfloat16: 10 steps diverged
# by up to 5e-2 relative there (training amplifies their rounding), which proves nothing;
# pass rtol= / atol= to compare them.
TRAINING_PARITY: dict[str, Tolerance] = {
    "float64": Tolerance(1e-12, 1e-12, normwise=True),
    "float32": Tolerance(5e-5, 5e-5, normwise=True),
}

# flex_attention (tests/functional/test_flex.py), both twins, measured as the smallest t with
# rtol = atol = t that every case passes (10 cases of mods and block masks, B 2, H 4,
# L = S = 32, blocks of 8; torch 2.13.0 CPU, jax 0.10.2, 2-core x86, 2026-11-29): against the float64
# loop oracle, out and lse, float32 2.5e-7 and float64 5.6e-16; the margins as ORACLE's.
FLEX_ORACLE: dict[str, Tolerance] = {
    "float64": Tolerance(1e-12, 1e-12),
    "float32": Tolerance(1e-5, 1e-5),  # measured 2.5e-7
}
# The PyTorch twin against PyTorch's own flex_attention (eager, CPU), float32, out and lse:
# measured 1.7e-7 (PyTorch's own against the oracle: 3.1e-7).
FLEX_TORCH = Tolerance(1e-5, 1e-5)
# flex with a library mod against dot_product_attention with the option it stands for
# (implementation="reference"), float64: measured 4.0e-16.
FLEX_OPTION = Tolerance(1e-12, 1e-12)
# float64 gradients (q, k, v, a captured bias table or ALiBi slopes) against directional
# central differences of the oracle (eps 1e-6): |<grad, u> - fd| / (sum |grad_i u_i| + |fd|),
# measured 5.3e-12 (the differences' own error dominates); as test_gradient_oracle's RTOL.
FLEX_GRAD_ORACLE = 1e-9

# The gated delta rule and KDA (tests/functional/test_delta_rule.py), both twins, both forms:
# out and the final state against the float64 loop oracle (parity_tests/reference_delta.py),
# relative to the reference's largest magnitude; measured (torch 2.13.0 CPU, jax 0.10.2,
# 2-core AMD EPYC Zen 5, AVX-512, 2026-12-02) float32 2.7e-7, bfloat16 (out rounded once;
# the state float32) 1.9e-3, float64 3.9e-16.
DELTA_ORACLE: dict[str, Tolerance | float] = {
    "float64": 1e-12,
    "float32": 1e-5,
    "bfloat16": 2e-2,
}
# twin against twin, and each twin against transformers' functions (Qwen3-Next's gated delta
# rule, Kimi Linear's KDA), float32, out, state and gradients: measured 3.4e-7.
DELTA_TWINS = 1e-5
# float64 gradients against directional central differences of the oracle (eps 1e-6), as
# test_gradient_oracle's RTOL: measured 2.7e-11.
DELTA_GRAD_ORACLE = 1e-9
