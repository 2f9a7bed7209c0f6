"""The parity harness itself: it passes what is right, fails what is wrong (and says
where), reports findings as data, handles training mode and a user's own modules, and
refuses what cannot be compared.

Few shapes (x is (2, 4, 8) almost everywhere, d_in = d_out = 8) so that JAX compiles
each module structure once.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both

BATCH, SEQ, D, CONTEXT = 2, 4, 8, 6
RATE = 0.3
NUMBER = r"-?\d[\d.e+-]*|-?inf|nan"
# "name[i, j, k]: torch a vs flax b (abs err e, rel err r; tolerance rtol=t, atol=u)"
FINDING_LINE = re.compile(
    rf"(?P<name>[\w .\[\]]+?)\[(?P<index>[\d, ]*)\]: torch (?P<a>{NUMBER}) vs flax (?P<b>{NUMBER}) "
    rf"\(abs err (?P<abs>{NUMBER}), rel err (?P<rel>{NUMBER}); "
    rf"tolerance rtol=(?P<rtol>{NUMBER}), atol=(?P<atol>{NUMBER}), (?P<times>{NUMBER})x its allowance\)"
)

CONFIGS: dict[str, dict[str, Any]] = {
    "SelfAttention_v2": {"d_in": D, "d_out": D, "qkv_bias": True},
    "CausalAttention": {"d_in": D, "d_out": D, "context_length": CONTEXT, "dropout": RATE, "qkv_bias": True},
    "Head": {"d_in": D, "head_size": D, "context_length": CONTEXT, "dropout": RATE},
    "MultiHeadAttentionWrapper": {"d_in": D, "d_out": D // 2, "context_length": CONTEXT, "dropout": RATE,
                                  "num_heads": 2, "qkv_bias": True},
    "MultiHeadAttention": {"d_in": D, "d_out": D, "context_length": CONTEXT, "dropout": RATE,
                           "num_heads": 2, "qkv_bias": True},
}


def torch_module(cls: str, seed: int = 0, **overrides: Any) -> Any:
    import torch

    import torch_attention

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return getattr(torch_attention, cls)(**{**CONFIGS[cls], **overrides})


def inputs(seed: int = 0, shape: tuple[int, ...] = (BATCH, SEQ, D)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def random_mask(seed: int = 0, heads: int = 1) -> np.ndarray:
    """(B, H, T, T) bool, True = may attend, every row with something to attend to."""
    mask = np.random.default_rng(seed).random((BATCH, heads, SEQ, SEQ)) < 0.6
    mask[..., 0] = True
    return mask


# --------------------------------------------------------------------------- right and wrong


def test_assert_parity_passes_for_a_correct_copy() -> None:
    from parity_tests import ParityReport, assert_parity, to_flax

    tm = torch_module("SelfAttention_v2")
    report = assert_parity(tm, to_flax(tm), inputs(), mask=random_mask(), weights=True)
    assert isinstance(report, ParityReport) and report.ok and report.failures == []
    names = {f.name for f in report.findings}
    assert {"output", "attention weights", "grad input[0]", "grad W_query.weight", "grad W_query.bias",
            "grad W_key.weight", "grad W_value.bias"} <= names
    assert all(f.max_abs <= 1e-5 for f in report.findings)


def _untransposed_copy() -> tuple[Any, Any]:
    """A Flax twin whose W_query kernel got PyTorch's weight as is (not transposed)."""
    import jax.numpy as jnp

    from parity_tests import to_flax

    tm = torch_module("SelfAttention_v2")
    fm = to_flax(tm)
    weight = tm.W_query.weight.detach().numpy()
    assert not np.allclose(weight, weight.T)  # else the mistake would be invisible
    fm.W_query.kernel[...] = jnp.asarray(weight)  # the bug: kernel must be weight.T
    return tm, fm


def test_assert_parity_catches_an_untransposed_weight_and_says_where() -> None:
    from parity_tests import ParityError, assert_parity

    tm, fm = _untransposed_copy()
    with pytest.raises(ParityError) as err:
        assert_parity(tm, fm, inputs(), mask=random_mask())
    assert isinstance(err.value, AssertionError)
    message = str(err.value)
    lines = message.splitlines()
    assert re.fullmatch(r"parity fails for \d+ of \d+ tensors; worst:", lines[0]), message
    report = err.value.report
    assert len(lines) == 1 + len(report.failures)
    failed = {f.name for f in report.failures}
    # the output, and the gradient of the very weight that was copied wrong
    assert "output" in failed and "grad W_query.weight" in failed, message
    for line in lines[1:]:
        match = FINDING_LINE.fullmatch(line.strip())
        assert match, line
        finding = next(f for f in report.failures if f.name == match["name"])
        index = tuple(int(i) for i in match["index"].split(","))
        assert index == finding.index
        # the values quoted are the ones at that index, and really differ by more than allowed
        a, b = float(match["a"]), float(match["b"])
        assert a == pytest.approx(report.torch_results[finding.name][index], rel=1e-6, abs=1e-12)
        assert b == pytest.approx(report.flax_results[finding.name][index], rel=1e-6, abs=1e-12)
        assert float(match["abs"]) == pytest.approx(abs(a - b), rel=1e-2)
        assert float(match["times"]) == pytest.approx(finding.tolerance_used, rel=1e-2) and finding.tolerance_used > 1
        assert float(match["abs"]) > float(match["atol"]) + float(match["rtol"]) * abs(b)
        assert float(match["rel"]) > 0
    output_line = next(line for line in lines if line.strip().startswith("output["))
    assert re.search(r"tolerance rtol=1e-05, atol=1e-05, [\d.e+]+x its allowance\)$", output_line)


def test_check_parity_returns_findings_as_data() -> None:
    from parity_tests import Finding, ParityReport, check_parity

    tm, fm = _untransposed_copy()
    report = check_parity(tm, fm, inputs(), mask=random_mask())  # no raise
    assert isinstance(report, ParityReport)
    assert report.ok is False
    assert report.failures and all(isinstance(f, Finding) and not f.ok for f in report.failures)
    assert set(report.failures) <= set(report.findings)
    worst = report.worst
    assert worst in report.failures
    assert worst.max_abs > worst.atol
    assert worst.torch_value != pytest.approx(worst.flax_value, abs=worst.atol)
    # the parameter that was copied right stays right
    by_name = {f.name: f for f in report.findings}
    assert by_name["grad W_query.weight"].ok is False
    assert report.message().startswith("parity fails")
    # and the same call on a correct copy holds
    from parity_tests import to_flax

    good = check_parity(tm, to_flax(tm), inputs(), mask=random_mask())
    assert good.ok and good.failures == [] and good.message() == f"parity holds for {len(good.findings)} tensors"


def _wrappers(invert: bool) -> tuple[Any, Any, dict[str, Any]]:
    """A user's own pair around our modules; the Flax one may invert the mask polarity."""
    import torch
    from flax import nnx

    from attention_spec.interop.conversion import module_rules
    from parity_tests import to_flax

    class TorchWrap(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Any, mask: Any = None) -> Any:
            return self.inner(x, mask, return_weights=True)

    class FlaxWrap(nnx.Module):
        def __init__(self, inner: Any, invert: bool) -> None:
            self.inner = inner
            self.invert = invert

        def __call__(self, x: Any, mask: Any = None) -> Any:
            return self.inner(x, ~mask if self.invert else mask, return_weights=True)

    inner = torch_module("SelfAttention_v2")
    param_map = {f"inner.{r.torch_name}": (("inner", *r.flax_path), r.transpose) for r in module_rules(inner)}
    return TorchWrap(inner), FlaxWrap(to_flax(inner), invert), param_map


def test_wrong_mask_polarity_fails_at_the_output() -> None:
    from parity_tests import ParityError, assert_parity

    x, mask = inputs(), random_mask()
    mask[..., 1] = False  # so that ~mask keeps every row alive too
    tm, fm, param_map = _wrappers(invert=False)
    good = assert_parity(tm, fm, x, mask=mask, param_map=param_map)  # the control
    assert {"output[0]", "output[1]", "grad inner.W_key.weight"} <= {f.name for f in good.findings}

    tm, fm, param_map = _wrappers(invert=True)
    with pytest.raises(ParityError) as err:
        assert_parity(tm, fm, x, mask=mask, param_map=param_map)
    failed = {f.name for f in err.value.report.failures}
    assert {"output[0]", "output[1]"} <= failed  # the output and the attention weights
    message = str(err.value)
    assert re.search(r"^  output\[0\]\[\d+, \d+, \d+\]: torch ", message, re.M), message
    assert re.search(r"^  output\[1\]\[\d+, \d+, \d+, \d+\]: torch ", message, re.M), message
    # where torch may attend and flax may not, torch has a weight and flax has none
    weights_t = err.value.report.torch_results["output[1]"]
    weights_f = err.value.report.flax_results["output[1]"]
    assert np.all(weights_t[~mask] == 0) and np.all(weights_f[mask] == 0)


# --------------------------------------------------------------------------- training mode

DROPOUT_CLASSES = ("CausalAttention", "Head", "MultiHeadAttentionWrapper", "MultiHeadAttention")


@pytest.mark.parametrize("cls", DROPOUT_CLASSES)
def test_training_mode_with_a_shared_dropout_mask(cls: str) -> None:
    from parity_tests import assert_parity, to_flax

    tm = torch_module(cls).eval()
    fm = to_flax(tm)
    heads = CONFIGS[cls].get("num_heads", 1)
    keep = np.random.default_rng(3).random((BATCH, heads, SEQ, SEQ)) >= RATE
    x = inputs(1)
    report = assert_parity(tm, fm, x, training=True, dropout_mask=keep, weights=True)
    names = {f.name for f in report.findings}
    assert "grad input[0]" in names and any(n.startswith("grad ") and n.endswith(".weight") for n in names)
    # dropout really happened: dropped weights are 0, the kept ones scaled by 1/(1 - p)
    train_w = report.torch_results["attention weights"]
    assert np.all(train_w[~keep] == 0)
    eval_report = assert_parity(tm, fm, x, grads=False, weights=True)
    eval_w = eval_report.torch_results["attention weights"]
    np.testing.assert_allclose(train_w[keep], eval_w[keep] / (1 - RATE), rtol=1e-6, atol=1e-7)
    assert not np.allclose(report.torch_results["output"], eval_report.torch_results["output"])
    # the harness put both modules back in eval mode
    assert not any(m.training for m in tm.modules())
    assert all(_dropout_flags(fm))


@pytest.mark.parametrize("cls", DROPOUT_CLASSES)
def test_training_mode_without_a_dropout_mask_is_refused(cls: str) -> None:
    from parity_tests import check_parity, to_flax

    tm = torch_module(cls)
    with pytest.raises(ValueError, match=r"training mode with dropout > 0 needs dropout_mask="):
        check_parity(tm, to_flax(tm), inputs(), training=True)


# --------------------------------------------------------------------------- a user's own modules


def _tiny_pair(transpose_right: bool = True) -> tuple[Any, Any]:
    import jax.numpy as jnp
    import torch
    from flax import nnx

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x: Any) -> Any:
            return torch.tanh(self.fc(x))

    class TinyFlax(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.dense = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return jnp.tanh(self.dense(x))

    with torch.random.fork_rng():
        torch.manual_seed(0)
        tm = Tiny()
    fm = TinyFlax(nnx.Rngs(0))
    weight = tm.fc.weight.detach().numpy()
    # by hand, as a user would; the wrong way keeps the shape but scrambles the values
    fm.dense.kernel[...] = jnp.asarray(weight.T if transpose_right else weight.reshape(4, 3))
    fm.dense.bias[...] = jnp.asarray(tm.fc.bias.detach().numpy())
    return tm, fm


USER_MAP = {"fc.weight": ("dense/kernel", True), "fc.bias": "dense/bias"}


def test_a_users_own_pair_of_modules() -> None:
    from parity_tests import assert_parity

    tm, fm = _tiny_pair()
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    report = assert_parity(tm, fm, x, param_map=USER_MAP)
    assert {f.name for f in report.findings} == {"output", "grad input[0]", "grad fc.weight", "grad fc.bias"}
    # the gradient is reported in PyTorch's layout
    assert report.flax_results["grad fc.weight"].shape == (3, 4)
    assert np.abs(report.torch_results["grad fc.weight"]).max() > 0


def test_a_users_own_pair_copied_wrong_fails() -> None:
    from parity_tests import ParityError, assert_parity

    tm, fm = _tiny_pair(transpose_right=False)
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    with pytest.raises(ParityError, match=r"output\[\d+, \d+\]: torch "):
        assert_parity(tm, fm, x, param_map=USER_MAP)


def test_a_param_map_naming_a_missing_parameter_is_refused() -> None:
    from parity_tests import check_parity

    tm, fm = _tiny_pair()
    x = np.ones((5, 4), np.float32)
    with pytest.raises(ValueError) as err:
        check_parity(tm, fm, x, param_map={**USER_MAP, "fc.scale": "dense/scale"})
    message = str(err.value)
    assert "PyTorch has no parameter 'fc.scale'" in message
    assert "Flax has no parameter 'dense/scale'" in message
    with pytest.raises(ValueError, match=r"Flax has no parameter 'dense/biases'[\s\S]*"
                                         r"Flax parameter 'dense/bias' is not in the map"):
        check_parity(tm, fm, x, param_map={"fc.weight": ("dense/kernel", True), "fc.bias": "dense/biases"})
    with pytest.raises(ValueError, match=r"'fc\.weight' \(3, 4\) does not match 'dense/kernel' \(4, 3\)"):
        check_parity(tm, fm, x, param_map={"fc.weight": "dense/kernel", "fc.bias": "dense/bias"})


def test_a_users_own_pair_needs_a_param_map() -> None:
    from parity_tests import check_parity

    tm, fm = _tiny_pair()
    with pytest.raises(ValueError, match=r"Tiny is not one of this library's modules: pass param_map="):
        check_parity(tm, fm, np.ones((5, 4), np.float32))


# --------------------------------------------------------------------------- refusals


def test_modules_of_different_variants_are_refused() -> None:
    from flax import nnx

    import jax_attention
    from parity_tests import check_parity

    tm = torch_module("MultiHeadAttention")
    fm = jax_attention.CausalAttention(**CONFIGS["CausalAttention"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"different variants: torch MultiHeadAttention vs flax CausalAttention"):
        check_parity(tm, fm, inputs())


def test_modules_of_different_configs_are_refused() -> None:
    from flax import nnx

    import jax_attention
    from parity_tests import check_parity

    tm = torch_module("MultiHeadAttention", num_heads=2)
    fm = jax_attention.MultiHeadAttention(**{**CONFIGS["MultiHeadAttention"], "num_heads": 4}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"the MultiHeadAttention modules have different configurations: "
                                         r"num_heads: torch 2 vs flax 4$"):
        check_parity(tm, fm, inputs())


@pytest.mark.parametrize(
    ("shape", "pattern"),
    [
        ((BATCH, SEQ, 5), r"x has last dimension 5 but the module expects d_in=8"),
        ((1, BATCH, SEQ, D), r"got a 4-d array of shape \(1, 2, 4, 8\)"),
        ((BATCH, CONTEXT + 1, D), r"sequence length 7 exceeds context_length 6"),
    ],
)
def test_inputs_of_the_wrong_shape_are_refused_by_the_module(shape: tuple[int, ...], pattern: str) -> None:
    from parity_tests import check_parity, to_flax

    tm = torch_module("MultiHeadAttention")
    with pytest.raises(ValueError, match=pattern):
        check_parity(tm, to_flax(tm), inputs(shape=shape))


# --------------------------------------------------------------------------- to_flax / to_torch


def _dropout_flags(fm: Any) -> list[bool]:
    from flax import nnx

    return [m.deterministic for _, m in nnx.iter_graph(fm) if isinstance(m, nnx.Dropout)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("training", [True, False])
def test_to_flax_and_back_keep_mode_and_dtype(training: bool, dtype: str) -> None:
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from parity_tests import to_flax, to_torch

    tm = torch_module("MultiHeadAttentionWrapper").to(getattr(torch, dtype)).train(training)
    fm = to_flax(tm)
    flags = _dropout_flags(fm)
    assert len(flags) == CONFIGS["MultiHeadAttentionWrapper"]["num_heads"]
    assert flags == [not training] * len(flags)
    params = [v[...] for _, v in nnx.to_flat_state(nnx.state(fm, nnx.Param))]
    assert params and all(p.dtype == getattr(jnp, dtype) for p in params)

    fm.set_attributes(deterministic=training)  # flip the mode on the Flax side
    back = to_torch(fm)
    assert back.training is (not training)
    assert all(m.training is (not training) for m in back.modules())
    assert all(p.dtype == getattr(torch, dtype) for p in back.parameters())


def test_to_flax_of_a_foreign_module_is_refused() -> None:
    import torch
    from flax import nnx

    from parity_tests import to_flax, to_torch

    with pytest.raises(ValueError, match=r"Linear is not one of this library's modules .*param_map="):
        to_flax(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"Linear is not one of this library's modules"):
        to_torch(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


# --------------------------------------------------------------------------- the path under test


def _record_paths(monkeypatch: Any) -> dict[str, list[str]]:
    """The path each framework's functional core resolved to, per call (JAX: per trace)."""
    import jax_attention.functional as jf
    import torch_attention.functional as tf

    seen: dict[str, list[str]] = {"torch": [], "flax": []}
    for side, module in (("torch", tf), ("flax", jf)):
        real = module.walk  # the table walk that routes every call

        def spy(*args: Any, _real: Any = real, _side: str = side, **kwargs: Any) -> Any:
            entry, reasons = _real(*args, **kwargs)
            seen[_side].append(entry.path)
            return entry, reasons

        monkeypatch.setattr(module, "walk", spy)
    return seen


# A sequence length no other test in this file uses, so that the jitted Flax run is traced
# (and the spy sees the path) instead of coming from the cache.
PATH_SEQ = 5


@pytest.mark.parametrize("implementation", [None, "reference", "fused", "blockwise", "auto"])
def test_the_modules_run_on_the_path_asked_for(monkeypatch: Any, implementation: str | None) -> None:
    import jax

    from parity_tests import assert_parity, to_flax

    tm = torch_module("MultiHeadAttention")
    fm = to_flax(tm)
    configured = tm.implementation
    seen = _record_paths(monkeypatch)
    x = inputs(seed=7, shape=(BATCH, PATH_SEQ, D))
    mask = np.random.default_rng(8).random((BATCH, 2, PATH_SEQ, PATH_SEQ)) < 0.6
    report = assert_parity(tm, fm, x, mask=mask, implementation=implementation)
    # weights are not asked for, so nothing moves the modules off the path under test
    assert "attention weights" not in {f.name for f in report.findings}
    assert {"output", "grad input[0]", "grad out_proj.weight"} <= {f.name for f in report.findings}
    requested = implementation or configured
    # On CPU, "auto" gives so few query rows (at most FEW_QUERY_ROWS) to the explicit math,
    # the CPU kernel declining the dense mask.
    auto = {"torch": "fused", "flax": "fused" if jax.default_backend() in ("gpu", "tpu") else "reference"}
    for side in ("torch", "flax"):
        assert seen[side], f"{side} never reached its functional core"
        assert set(seen[side]) == {auto[side] if requested == "auto" else requested}, seen
    # the modules keep their own configuration
    assert tm.implementation == configured and fm.implementation == configured
    assert tm.config["implementation"] == fm.config["implementation"] == configured


def test_weights_are_compared_on_the_reference_path_only_when_asked(monkeypatch: Any) -> None:
    from parity_tests import assert_parity, to_flax

    tm = torch_module("CausalAttention")
    fm = to_flax(tm)
    seen = _record_paths(monkeypatch)
    x = inputs(seed=9, shape=(BATCH, PATH_SEQ, D))
    report = assert_parity(tm, fm, x, weights=True, grads=False)
    assert [f.name for f in report.findings] == ["output", "attention weights"]
    assert set(seen["torch"]) == set(seen["flax"]) == {"reference"}
    weights = report.torch_results["attention weights"]
    assert weights.shape == (BATCH, 1, PATH_SEQ, PATH_SEQ)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.triu(weights[0, 0], 1) == 0)  # causal


@pytest.mark.parametrize("implementation", ["fused", "blockwise"])
def test_weights_on_a_path_that_has_none_are_refused_naming_the_option(implementation: str) -> None:
    from parity_tests import check_parity, to_flax

    tm = torch_module("SelfAttention_v2")
    with pytest.raises(ValueError, match=rf"implementation='{implementation}' cannot honour return_weights=True"):
        check_parity(tm, to_flax(tm), inputs(), implementation=implementation, weights=True)


def test_a_bug_on_one_path_is_caught_on_that_path_only(monkeypatch: Any) -> None:
    """SDPA made slightly wrong: the fused comparison fails, the reference one holds.
    (Before the harness had ``implementation=``, asking for weights hid such a bug.)"""
    import torch.nn.functional as F

    from parity_tests import ParityError, assert_parity, check_parity, to_flax

    tm = torch_module("SelfAttention_v2")
    fm = to_flax(tm)
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: real(*a, **k) * 1.001)
    x = inputs(seed=11)
    assert_parity(tm, fm, x, implementation="reference")
    assert check_parity(tm, fm, x, implementation="reference", weights=True).ok
    with pytest.raises(ParityError) as err:
        assert_parity(tm, fm, x, implementation="fused")
    assert "output" in {f.name for f in err.value.report.failures}
    assert not check_parity(tm, fm, x).ok  # the modules' own path (auto) is SDPA in PyTorch


def test_implementation_and_weights_are_refused_for_a_users_own_modules() -> None:
    from parity_tests import check_parity

    tm, fm = _tiny_pair()
    x = np.ones((5, 4), np.float32)
    for kwargs in ({"implementation": "fused"}, {"weights": True}):
        with pytest.raises(ValueError, match=r"implementation= and weights= apply to this library's modules only"):
            check_parity(tm, fm, x, param_map=USER_MAP, **kwargs)


def test_pytorchs_dtype_is_flaxs_param_dtype() -> None:
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import jax_attention
    from parity_tests import to_flax, to_torch

    tm = torch_module("MultiHeadAttention").to(torch.bfloat16)
    fm = to_flax(tm)
    assert fm.param_dtype == jnp.bfloat16 and fm.dtype is None  # computes in param_dtype
    assert to_torch(fm).W_query.weight.dtype == torch.bfloat16
    mixed = jax_attention.MultiHeadAttention(**CONFIGS["MultiHeadAttention"], dtype=jnp.bfloat16,
                                             param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"stores its parameters in float32 \(param_dtype\) but computes in "
                                         r"bfloat16 \(dtype\); a PyTorch module has one dtype"):
        to_torch(mixed)
