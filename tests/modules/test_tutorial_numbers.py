"""The tutorials' printed tensors, reproduced to their 4 printed decimals.

The PyTorch classes create their parameters in the tutorials' order with PyTorch's
default initialisation, so ``torch.manual_seed(123)`` and the same constructor give the
tutorials' weights.  The Flax twin, given those weights by ``to_flax``, must print the
same numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import TUTORIAL_INPUTS, needs_both

torch = pytest.importorskip("torch")
import torch_attention as ta  # noqa: E402

PRINTED = 5e-5  # half a unit in the 4th decimal


def inputs():
    return torch.tensor(TUTORIAL_INPUTS)


def close(got, printed):
    got = got.detach().numpy() if hasattr(got, "detach") else np.asarray(got)
    np.testing.assert_allclose(got, np.array(printed), rtol=0, atol=PRINTED)


def seeded(seed, build):
    torch.manual_seed(seed)
    return build()


# seed 004 / 003: simplified attention
SIMPLIFIED_WEIGHTS = [
    [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
    [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
    [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
    [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
    [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
]
SIMPLIFIED_CONTEXT = [
    [0.4421, 0.5931, 0.5790],
    [0.4419, 0.6515, 0.5683],
    [0.4431, 0.6496, 0.5671],
    [0.4304, 0.6298, 0.5510],
    [0.4671, 0.5910, 0.5266],
    [0.4177, 0.6503, 0.5645],
]
SA_V1 = [[0.2845, 0.4071], [0.2854, 0.4081], [0.2854, 0.4075],
         [0.2864, 0.3974], [0.2863, 0.3910], [0.2860, 0.4039]]
SA_V2 = [[0.1059, 0.9296], [0.1144, 0.9353], [0.1143, 0.9353],
         [0.1181, 0.9369], [0.1138, 0.9343], [0.1188, 0.9375]]
SA_V2_WEIGHTS = [
    [0.1838, 0.1672, 0.1678, 0.1557, 0.1745, 0.1511],
    [0.1780, 0.1756, 0.1750, 0.1552, 0.1547, 0.1615],
    [0.1780, 0.1754, 0.1749, 0.1553, 0.1550, 0.1614],
    [0.1733, 0.1770, 0.1761, 0.1572, 0.1497, 0.1667],
    [0.1770, 0.1734, 0.1731, 0.1569, 0.1585, 0.1611],
    [0.1731, 0.1780, 0.1769, 0.1568, 0.1478, 0.1674],
]
SA_V2_RENORMALIZED = [  # the causal mask applied after the softmax, rows renormalised
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5034, 0.4966, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3369, 0.3320, 0.3310, 0.0000, 0.0000, 0.0000],
    [0.2535, 0.2589, 0.2576, 0.2300, 0.0000, 0.0000],
    [0.2110, 0.2067, 0.2063, 0.1871, 0.1890, 0.0000],
    [0.1731, 0.1780, 0.1769, 0.1568, 0.1478, 0.1674],
]
CAUSAL = [[-0.4519, 0.2216], [-0.5874, 0.0058], [-0.6300, -0.0632],
          [-0.5675, -0.0843], [-0.5526, -0.0981], [-0.5299, -0.1081]]
WRAPPER = [
    [-0.4519, 0.2216, 0.4772, 0.1063],
    [-0.5874, 0.0058, 0.5891, 0.3257],
    [-0.6300, -0.0632, 0.6202, 0.3860],
    [-0.5675, -0.0843, 0.5478, 0.3589],
    [-0.5526, -0.0981, 0.5321, 0.3428],
    [-0.5299, -0.1081, 0.5077, 0.3493],
]
MHA = [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
       [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]]
# seed 002: wei[0] of one unscaled causal head, torch.manual_seed(1337), B, T, C = 4, 8, 2
HEAD_WEI0 = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5599, 0.4401, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3220, 0.2016, 0.4764, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.1640, 0.0815, 0.2961, 0.4585, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.2051, 0.3007, 0.1894, 0.1808, 0.1241, 0.0000, 0.0000, 0.0000],
    [0.0600, 0.1273, 0.0291, 0.0169, 0.0552, 0.7114, 0.0000, 0.0000],
    [0.1408, 0.1025, 0.1744, 0.2038, 0.1690, 0.0669, 0.1426, 0.0000],
    [0.0223, 0.1086, 0.0082, 0.0040, 0.0080, 0.7257, 0.0216, 0.1016],
]


def cases():
    """(name, build the module, call it -> (output or weights), printed tensor)."""
    batch = lambda: torch.stack((inputs(), inputs()))  # noqa: E731

    def weights(m, x, **kw):
        return m(x, return_weights=True, **kw)[1]

    return [
        ("simplified-weights", lambda: ta.SimplifiedAttention(), lambda m, fw: weights(m, fw(inputs()))[0],
         SIMPLIFIED_WEIGHTS),
        ("simplified-context", lambda: ta.SimplifiedAttention(), lambda m, fw: m(fw(inputs())), SIMPLIFIED_CONTEXT),
        ("simplified-sum-row2", lambda: ta.SimplifiedAttention(normalization="sum"),
         lambda m, fw: weights(m, fw(inputs()))[0, 1], [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656]),
        ("sa-v1", lambda: seeded(123, lambda: ta.SelfAttention_v1(3, 2)), lambda m, fw: m(fw(inputs())), SA_V1),
        ("sa-v2", lambda: seeded(123, lambda: ta.SelfAttention_v2(3, 2, qkv_bias=True)),
         lambda m, fw: m(fw(inputs())), SA_V2),
        ("sa-v2-weights", lambda: seeded(123, lambda: ta.SelfAttention_v2(3, 2, qkv_bias=True)),
         lambda m, fw: weights(m, fw(inputs()))[0], SA_V2_WEIGHTS),
        ("sa-v2-renormalized", lambda: seeded(
            123, lambda: ta.SelfAttention_v2(3, 2, qkv_bias=True, causal=True, mask_strategy="renormalize")),
         lambda m, fw: weights(m, fw(inputs()))[0], SA_V2_RENORMALIZED),
        ("causal", lambda: seeded(123, lambda: ta.CausalAttention(3, 2, 6, 0.0)),
         lambda m, fw: m(fw(batch())), [CAUSAL, CAUSAL]),
        ("wrapper", lambda: seeded(123, lambda: ta.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)),
         lambda m, fw: m(fw(batch())), [WRAPPER, WRAPPER]),
        ("mha", lambda: seeded(123, lambda: ta.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)),
         lambda m, fw: m(fw(batch())), [MHA, MHA]),
    ]


CASES = cases()


@pytest.mark.parametrize("name,build,call,printed", CASES, ids=[c[0] for c in CASES])
def test_pytorch_reproduces_the_tutorial(name, build, call, printed):
    close(call(build(), lambda t: t), printed)


@needs_both
@pytest.mark.parametrize("name,build,call,printed", CASES, ids=[c[0] for c in CASES])
def test_flax_twin_reproduces_the_tutorial(name, build, call, printed):
    import jax.numpy as jnp

    from parity_tests import to_flax

    flax_module = to_flax(build())
    close(call(flax_module, lambda t: jnp.asarray(t.numpy())), printed)


def test_seed_002_head_weights():
    torch.manual_seed(1337)
    x = torch.randn(4, 8, 2)
    head = ta.Head(2, 16, 8)  # key, query, value drawn after x, as in the tutorial
    _, wei = head(x, return_weights=True)
    close(wei[0, 0], HEAD_WEI0)


def test_seed_004_dropout_stream():
    """nn.Dropout(0.5) after torch.manual_seed(123) on ones(6, 6), as printed in seed 004,
    equals our functional dropout on the same RNG stream."""
    from torch_attention.functional import dropout_weights

    torch.manual_seed(123)
    got = dropout_weights(torch.ones(6, 6), 0.5, training=True)
    expected = [[2, 2, 0, 2, 2, 0], [0, 0, 0, 2, 0, 2], [2, 2, 2, 2, 0, 2],
                [0, 2, 2, 0, 0, 2], [0, 2, 0, 2, 0, 2], [0, 2, 2, 2, 2, 0]]
    assert got.tolist() == expected
