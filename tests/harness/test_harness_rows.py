"""The harness compares only the query rows it is told to (``rows=``), and trains a module
through the caller's own call (``torch_call`` / ``flax_call`` of ``check_training_parity``).

The PyTorch side here is called the way a Hugging Face layer behaves on a padded query
row that may attend to no key: it attends to every key instead (HF's softmax over a row
of equal, very negative scores), where this library gives a row of zeros (the output
bias). So the two sides differ at those rows by construction, and agree everywhere else.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both

B, T, D = 2, 5, 8
LENGTHS = (5, 3)


def _valid() -> np.ndarray:
    """(B, T) bool: the real (unpadded) positions."""
    return np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]


def _mask() -> np.ndarray:
    """(B, 1, T, T) bool: real queries see real keys; a padded query sees nothing."""
    valid = _valid()
    return valid[:, None, :, None] & valid[:, None, None, :]


def _hf_like(module, x, mask=None, **kwargs):
    """The module, except that a query row that may attend to no key attends to every key
    (as Hugging Face's layers do): different from ours at those rows only."""
    import torch

    dead = ~mask.any(-1)  # (B, 1, T)
    own = module(x, mask=mask, **kwargs)
    every = module(x, mask=mask | dead[..., None], **kwargs)
    rows = dead[:, 0, :, None]  # (B, T, 1)
    if isinstance(own, tuple):  # (output, attention weights (B, H, T, S))
        return torch.where(rows, every[0], own[0]), torch.where(dead[..., None], every[1], own[1])
    return torch.where(rows, every, own)


def _pair(seed: int = 0):
    import torch

    import torch_attention as ta
    from parity_tests import to_flax

    torch.manual_seed(seed)
    pt = ta.MultiHeadAttention(d_in=D, d_out=D, context_length=16, dropout=0.0, num_heads=2).eval()
    return pt, to_flax(pt)


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((B, T, D)).astype(np.float32)


# --------------------------------------------------------------------------- check_parity


def test_padded_rows_fail_without_rows_outputs_and_gradients():
    from parity_tests import check_parity

    pt, fx = _pair()
    report = check_parity(pt, fx, _x(), mask=_mask(), torch_call=_hf_like)
    failed = {f.name for f in report.failures}
    assert "output" in failed
    assert "grad input[0]" in failed
    # the padded rows' outputs enter the loss, so they move the parameter gradients too
    assert {"grad W_query.weight", "grad W_key.weight", "grad out_proj.weight"} <= failed
    assert "query rows left out" not in report.message()
    # where they lie, and what to do (issue 40: a bare "fails for 26 of 26 tensors" before)
    assert ("the outputs differ in 2 of 10 query rows (example 1: rows 3-4) and nowhere else, every one a row "
            "the mask leaves without a key") in report.message()
    assert "pass rows=" in report.message() and "x its allowance" in report.message()


def test_rows_leave_the_padded_rows_out_gradients_included():
    from parity_tests import assert_parity

    pt, fx = _pair()
    report = assert_parity(pt, fx, _x(), mask=_mask(), torch_call=_hf_like, rows=_valid())
    names = {f.name for f in report.findings}
    assert {"output", "grad input[0]", "grad W_query.weight", "grad out_proj.bias"} <= names
    assert report.rows_left_out == 2 and report.rows_total == B * T
    assert report.message() == f"parity holds for {len(report.findings)} tensors (2 of 10 query rows left out)"
    by_name = {f.name: f for f in report.findings}
    assert by_name["output"].rows_left_out == 2
    assert by_name["grad input[0]"].rows_left_out == 2
    assert by_name["grad W_query.weight"].rows_left_out == 0  # compared whole
    # the outputs at the left-out rows really differ (so they were left out, not equal)
    t_out, f_out = report.torch_results["output"], report.flax_results["output"]
    assert np.abs(t_out[1, 3:] - f_out[1, 3:]).max() > 1e-2
    # and the left-out rows are in no gradient: the input gradient there is zero on both sides
    np.testing.assert_array_equal(report.torch_results["grad input[0]"][1, 3:], 0.0)


def test_rows_with_attention_weights_use_the_query_axis():
    from parity_tests import assert_parity, check_parity

    pt, fx = _pair()
    report = check_parity(pt, fx, _x(), mask=_mask(), torch_call=_hf_like, weights=True)
    assert "attention weights" in {f.name for f in report.failures}
    report = assert_parity(pt, fx, _x(), mask=_mask(), torch_call=_hf_like, weights=True, rows=_valid())
    weights = {f.name: f for f in report.findings}["attention weights"]
    assert weights.ok and weights.rows_left_out == 2 and weights.shape == (B, 2, T, T)


def test_failures_name_the_left_out_rows():
    from parity_tests import ParityError, assert_parity, copy_params

    pt, fx = _pair()
    other, _ = _pair(seed=1)
    copy_params(other, fx)  # different weights: fails at every row
    with pytest.raises(ParityError, match=r"\(2 of 10 query rows left out\); worst:") as err:
        assert_parity(pt, fx, _x(), mask=_mask(), rows=_valid())
    assert "; 2 query rows left out)" in str(err.value)
    output = {f.name: f for f in err.value.report.findings}["output"]
    assert not output.ok and output.index[:2] in {(0, t) for t in range(T)} | {(1, 0), (1, 1), (1, 2)}


def test_rows_none_is_todays_behaviour():
    from parity_tests import check_parity

    pt, fx = _pair()
    report = check_parity(pt, fx, _x(), mask=_mask())
    assert report.ok and report.rows_left_out == 0 and report.rows_total == 0
    assert report.message() == f"parity holds for {len(report.findings)} tensors"
    assert all(f.rows_left_out == 0 and "left out" not in f.describe() for f in report.findings)
    every = check_parity(pt, fx, _x(), mask=_mask(), rows=np.ones((B, T), dtype=bool))
    for a, b in zip(report.findings, every.findings, strict=True):
        assert (a.name, a.max_abs, a.index) == (b.name, b.max_abs, b.index)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (np.ones((B, T - 1), dtype=bool), r"rows= is a bool array \(batch, seq\) = \(2, 5\).*got bool of shape \(2, 4\)"),
        (np.ones((B, T, 1), dtype=bool), r"got bool of shape \(2, 5, 1\)"),
        (np.ones((B, T), dtype=np.int32), r"got int32 of shape \(2, 5\)"),
        (np.zeros((B, T), dtype=bool), "rows= leaves out every query row: nothing would be compared"),
    ],
    ids=["short", "rank-3", "integers", "none-kept"],
)
def test_wrong_rows_raise_clearly(rows, match):
    from parity_tests import check_parity

    pt, fx = _pair()
    with pytest.raises(ValueError, match=match):
        check_parity(pt, fx, _x(), mask=_mask(), rows=rows)


def test_rows_on_an_output_without_query_rows_raise():
    from parity_tests import check_parity

    pt, fx = _pair()
    with pytest.raises(ValueError, match=r"rows= \(2, 5\) cannot be applied to the first output of shape \(2, 8\)"):
        check_parity(pt, fx, _x(), torch_call=lambda m, x, **kw: m(x, **kw).mean(1),
                     flax_call=lambda m, x, **kw: m(x, **kw).mean(1), rows=_valid())


def test_compare_where_keeps_the_index_of_the_whole_array():
    from parity_tests import compare
    from parity_tests.tolerances import PARITY

    a = np.zeros((2, 3, 4))
    b = np.zeros((2, 3, 4))
    a[1, 2, 0] = 5.0  # left out
    a[0, 1, 3] = 1.0  # kept
    keep = np.ones((2, 3, 1), dtype=bool)
    keep[1, 2] = False
    finding = compare("output", a, b, PARITY["float32"], where=keep, rows_left_out=1)
    assert not finding.ok and finding.index == (0, 1, 3) and finding.max_abs == 1.0
    assert finding.rows_left_out == 1 and "; 1 query rows left out)" in finding.describe()
    a[0, 1, 3] = 0.0
    assert compare("output", a, b, PARITY["float32"], where=keep).ok


# --------------------------------------------------------------------------- check_training_parity


def _batches(n: int = 2):
    rng = np.random.default_rng(3)
    return [(rng.standard_normal((B, T, D)).astype(np.float32), rng.standard_normal((B, T, D)).astype(np.float32))
            for _ in range(n)]


def _calls(mask: np.ndarray, hf_like: bool = False):
    """torch_call / flax_call that give the module a mask the harness does not know of."""
    import jax.numpy as jnp
    import torch

    t_mask, f_mask = torch.from_numpy(mask), jnp.asarray(mask)
    if hf_like:
        def torch_call(m, x, **kw):
            return _hf_like(m, x, mask=t_mask, **kw)
    else:
        def torch_call(m, x, **kw):
            return m(x, mask=t_mask, **kw)

    def flax_call(m, x, **kw):
        return m(x, mask=f_mask, **kw)

    return torch_call, flax_call


def test_training_calls_pass_the_mask_to_both():
    from parity_tests import assert_training_parity, check_training_parity

    pt, fx = _pair()
    padding = _mask()
    torch_call, flax_call = _calls(padding)
    report = assert_training_parity(pt, fx, _batches(), optimizer="sgd", lr=0.5, steps=3,
                                    torch_call=torch_call, flax_call=flax_call)
    # the calls are used: the trained model is the one trained with the mask (the harness's own mask=)
    same = check_training_parity(pt, fx, _batches(), optimizer="sgd", lr=0.5, steps=3, mask=padding)
    assert [s.torch_loss for s in report.steps] == pytest.approx([s.torch_loss for s in same.steps], rel=1e-6)
    unmasked = check_training_parity(pt, fx, _batches(), optimizer="sgd", lr=0.5, steps=3)
    assert abs(report.steps[0].torch_loss - unmasked.steps[0].torch_loss) > 1e-3
    # one side with the mask, the other without: they train apart, from the first loss on
    apart = check_training_parity(pt, fx, _batches(), optimizer="sgd", lr=0.5, steps=3, torch_call=torch_call)
    assert not apart.ok and apart.first_failure is not None and apart.first_failure.step == 1


def test_training_rows_leave_the_padded_rows_out():
    from parity_tests import assert_training_parity, check_training_parity

    pt, fx = _pair()
    torch_call, flax_call = _calls(_mask(), hf_like=True)
    apart = check_training_parity(pt, fx, _batches(), optimizer="adam", lr=1e-2, steps=3,
                                  torch_call=torch_call, flax_call=flax_call)
    assert not apart.ok
    report = assert_training_parity(pt, fx, _batches(), optimizer="adam", lr=1e-2, steps=3,
                                    torch_call=torch_call, flax_call=flax_call, rows=_valid())
    assert len(report.steps) == 3 and report.steps[-1].torch_loss < report.steps[0].torch_loss


def test_training_call_and_rows_errors():
    from parity_tests import check_training_parity

    pt, fx = _pair()
    with pytest.raises(TypeError, match=r"torch_call must be a callable \(module, x, \*\*kwargs\) -> output"):
        check_training_parity(pt, fx, _batches(), torch_call="m(x)")
    with pytest.raises(ValueError, match=r"rows= is a bool array \(batch, seq\) = \(2, 5\)"):
        check_training_parity(pt, fx, _batches(), rows=np.ones((B, T + 1), dtype=bool))


def test_training_flax_call_reaches_a_linen_model():
    """A Linen model whose call needs an argument the harness does not pass (``gain``):
    ``flax_call`` receives the bound model."""
    import jax
    import torch
    from flax import linen as nn

    from parity_tests import assert_training_parity

    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x, gain):
            return gain * nn.Dense(D, name="dense")(x)

    torch.manual_seed(0)
    pt = torch.nn.Linear(D, D)
    model = Scaled()
    variables = model.init(jax.random.key(0), np.zeros((B, T, D), np.float32), 1.0)
    params = {"dense": {"kernel": pt.weight.detach().numpy().T, "bias": pt.bias.detach().numpy()}}
    kwargs = {"flax_variables": {**variables, "params": params}, "optimizer": "sgd", "lr": 0.1, "steps": 2,
              "param_map": {"weight": (("dense", "kernel"), True), "bias": ("dense/bias", False)}}
    report = assert_training_parity(pt, model, _batches(), torch_call=lambda m, x: 2.0 * m(x),
                                    flax_call=lambda m, x: m(x, gain=2.0), **kwargs)
    assert report.ok and len(report.steps) == 2
    with pytest.raises(TypeError, match="gain"):  # without the call, the model misses its argument
        assert_training_parity(pt, model, _batches(), torch_call=lambda m, x: 2.0 * m(x), **kwargs)
