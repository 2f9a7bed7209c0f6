"""Training-step parity: torch.optim and optax, matched, agree step by step; a wrong
optimiser setting is caught at the step where it first shows.

Targets come from a fixed "teacher" module, so the loss has somewhere to go: each test
that claims parity also checks that training moved the parameters and lowered the loss
(parity of two models that never moved would prove nothing about the optimisers).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both

B, T, D = 2, 6, 8
STEPS = 10


def _batches(teacher, n: int = 2, seed: int = 0):
    import torch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((B, T, D)).astype(np.float32)
        with torch.no_grad():
            out.append((x, teacher(torch.from_numpy(x)).numpy()))
    return out


def _pair(name: str, *, seed: int = 0, **overrides):
    import torch

    import torch_attention as ta
    from parity_tests import to_flax

    kwargs = {
        "MultiHeadAttention": {"d_in": D, "d_out": D, "context_length": 16, "dropout": 0.0, "num_heads": 2},
        "CausalAttention": {"d_in": D, "d_out": D, "context_length": 16, "dropout": 0.0},
    }[name] | overrides
    torch.manual_seed(seed)
    student = getattr(ta, name)(**kwargs).eval()
    torch.manual_seed(seed + 100)
    teacher = getattr(ta, name)(**kwargs).eval()
    return student, to_flax(student), _batches(teacher)


def _snapshot(torch_module, flax_module):
    from jax_attention.interop import flax_arrays

    return ({k: v.detach().clone().numpy() for k, v in torch_module.state_dict().items()},
            {k: np.array(v) for k, v in flax_arrays(flax_module).items()})


def _moved(report, before) -> float:
    """How far training moved the PyTorch copy from where it started."""
    after = {k: v.detach().numpy() for k, v in report.torch_module.state_dict().items()}
    return max(float(np.max(np.abs(after[k] - before[k]))) for k in before)


@pytest.mark.parametrize(
    ("variant", "optimizer", "options"),
    [
        ("MultiHeadAttention", "sgd", {"lr": 0.5}),
        ("MultiHeadAttention", "sgd", {"lr": 0.2, "momentum": 0.9}),
        ("CausalAttention", "sgd", {"lr": 0.2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
        ("MultiHeadAttention", "adam", {"lr": 1e-2}),
        ("MultiHeadAttention", "adam", {"lr": 1e-2, "weight_decay": 0.1}),  # L2 on the gradient
        ("CausalAttention", "adam", {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6}),
        ("MultiHeadAttention", "adamw", {"lr": 1e-2, "weight_decay": 0.1}),  # decoupled
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_ten_steps_agree(variant, optimizer, options):
    from parity_tests import assert_training_parity
    from parity_tests.tolerances import TRAINING_PARITY

    pt, fx, batches = _pair(variant)
    before_t, before_f = _snapshot(pt, fx)
    report = assert_training_parity(pt, fx, batches, optimizer=optimizer, steps=STEPS, **options)

    assert len(report.steps) == STEPS and report.ok
    assert len(report.max_abs) == STEPS and max(report.max_abs) < TRAINING_PARITY["float32"].atol
    assert report.steps[-1].torch_loss < 0.9 * report.steps[0].torch_loss  # it trained
    assert _moved(report, before_t) > 1e-3
    # Copies were trained: the modules passed in are as they were.
    after_t, after_f = _snapshot(pt, fx)
    for k in before_t:
        np.testing.assert_array_equal(after_t[k], before_t[k])
    for k in before_f:
        np.testing.assert_array_equal(after_f[k], before_f[k])
    # The trained Flax copy is a usable module, at the trained PyTorch copy's weights.
    from parity_tests import assert_parity

    assert_parity(report.torch_module, report.flax_module, batches[0][0])


def _linen_pair():
    """A small model on each side: our attention then a Dense/Linear head; on the Flax
    side a Linen model holding the NNX module through ``nnx.bridge.to_linen``."""
    import flax
    import jax
    import torch
    from flax import linen as nn
    from flax.nnx import bridge

    import jax_attention as ja
    import torch_attention as ta
    from attention_spec.interop.conversion import module_rules

    class TorchModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = ta.MultiHeadAttention(D, D, 16, 0.0, 2)
            self.head = torch.nn.Linear(D, 3)

        def forward(self, x):
            return self.head(self.attn(x))

    class LinenModel(nn.Module):
        @nn.compact
        def __call__(self, x):
            attn = bridge.to_linen(ja.MultiHeadAttention, D, D, 16, 0.0, 2, name="attn")
            return nn.Dense(3, name="head")(attn(x))

    torch.manual_seed(0)
    pt = TorchModel().eval()
    model = LinenModel()
    variables = model.init(jax.random.key(0), np.zeros((B, T, D), np.float32))
    param_map = {f"attn.{r.torch_name}": (("attn", *r.flax_path), r.transpose) for r in module_rules(pt.attn)}
    param_map |= {"head.weight": (("head", "kernel"), True), "head.bias": ("head/bias", False)}
    # Start from the same weights: the PyTorch ones, through the map.
    params = jax.tree_util.tree_map(np.asarray, flax.core.unfreeze(variables["params"]))
    for name, (path, transpose) in param_map.items():
        keys = path.split("/") if isinstance(path, str) else path
        node = params
        for key in keys[:-1]:
            node = node[key]
        value = pt.state_dict()[name].numpy()
        node[keys[-1]] = value.T if transpose else value
    variables = {**variables, "params": params}
    torch.manual_seed(1)
    teacher = TorchModel().eval()
    return pt, model, variables, param_map, _batches(teacher)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_inside_a_linen_model_through_to_linen(optimizer):
    from parity_tests import assert_training_parity

    pt, model, variables, param_map, batches = _linen_pair()
    report = assert_training_parity(
        pt, model, batches, flax_variables=variables, param_map=param_map, optimizer=optimizer,
        steps=STEPS, lr=0.5 if optimizer == "sgd" else 1e-2,
    )
    assert report.ok and len(report.steps) == STEPS
    assert report.steps[-1].torch_loss < 0.9 * report.steps[0].torch_loss
    # The Linen variables came back trained and the ones passed in are untouched.
    trained = report.flax_variables["params"]["attn"]["W_query"]["kernel"]
    assert float(np.max(np.abs(np.asarray(trained) - variables["params"]["attn"]["W_query"]["kernel"]))) > 1e-3
    np.testing.assert_allclose(np.asarray(trained), report.torch_module.attn.W_query.weight.detach().numpy().T,
                               rtol=0, atol=1e-5)


def test_a_linen_model_of_our_module_alone_needs_no_map():
    """The declared map is found under the submodule's name in the Linen params."""
    import jax
    import torch
    from flax import linen as nn
    from flax.nnx import bridge

    import jax_attention as ja
    import torch_attention as ta
    from parity_tests import assert_training_parity

    torch.manual_seed(0)
    pt = ta.CausalAttention(D, D, 16, 0.0).eval()

    class Wrapper(nn.Module):
        @nn.compact
        def __call__(self, x):
            return bridge.to_linen(ja.CausalAttention, D, D, 16, 0.0, name="inner")(x)

    model = Wrapper()
    variables = model.init(jax.random.key(0), np.zeros((B, T, D), np.float32))
    params = {"inner": {n: {"kernel": pt.state_dict()[f"{n}.weight"].numpy().T}
                        for n in ("W_query", "W_key", "W_value")}}
    batches = _batches(ta.CausalAttention(D, D, 16, 0.0).eval())
    report = assert_training_parity(pt, model, batches, flax_variables={**variables, "params": params},
                                    optimizer="adamw", weight_decay=0.1, lr=1e-2, steps=4)
    assert report.ok and len(report.steps) == 4


# --------------------------------------------------------------------------- mutations

def _adam_factory(lr, eps=1e-8, weight_decay=0.0):
    import torch

    return lambda params: torch.optim.Adam(params, lr=lr, eps=eps, weight_decay=weight_decay)


def _mutants():
    import optax
    import torch

    lr = 1e-2
    return {
        # The control: the hand-written matched pair passes.
        "matched": (_adam_factory(lr), optax.adam(lr, eps=1e-8, eps_root=0.0)),
        # eps inside the square root (optax's eps_root) instead of outside, as PyTorch has it.
        "eps-inside-sqrt": (_adam_factory(lr), optax.adam(lr, eps=0.0, eps_root=1e-8)),
        # a learning rate 1% off.
        "lr-off-by-1%": (lambda p: torch.optim.SGD(p, lr=0.5), optax.sgd(0.505)),
        # L2 (torch Adam's weight_decay) against decoupled decay (optax.adamw).
        "l2-vs-decoupled-decay": (_adam_factory(lr, weight_decay=0.1), optax.adamw(lr, weight_decay=0.1)),
        # no momentum on one side.
        "momentum-on-one-side": (lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9), optax.sgd(0.2)),
    }


@pytest.mark.parametrize("mutant", ["matched", "eps-inside-sqrt", "lr-off-by-1%", "l2-vs-decoupled-decay",
                                     "momentum-on-one-side"])
def test_a_wrong_optimiser_setting_is_caught_naming_the_step(mutant):
    from parity_tests import TrainingParityError, assert_training_parity, check_training_parity

    pt, fx, batches = _pair("MultiHeadAttention")
    pair = _mutants()[mutant]
    if mutant == "matched":
        assert assert_training_parity(pt, fx, batches, optimizer=pair, steps=STEPS).ok
        return
    with pytest.raises(TrainingParityError, match=r"training parity fails at step \d+ of 10 \(custom\)") as info:
        assert_training_parity(pt, fx, batches, optimizer=pair, steps=STEPS)
    report = info.value.report
    bad = report.first_failure
    assert bad is not None and f"at step {bad.step} of" in str(info.value)
    # The message names the worst parameter and both of its values.
    worst = bad.worst
    assert worst is not None and not worst.ok
    assert f"{worst.name}{list(worst.index)}: torch {worst.torch_value!r} vs flax {worst.flax_value!r}" \
        in str(info.value)
    # check_training_parity reports the same without raising, and every step before the
    # first failure held.
    again = check_training_parity(pt, fx, batches, optimizer=pair, steps=STEPS)
    assert not again.ok and again.first_failure.step == bad.step
    assert all(s.ok for s in again.steps[: bad.step - 1])


# --------------------------------------------------------------------------- options

def test_the_plot_is_written(tmp_path):
    from parity_tests import check_training_parity

    pt, fx, batches = _pair("MultiHeadAttention")
    path = tmp_path / "trajectory.png"
    report = check_training_parity(pt, fx, batches, optimizer="adam", steps=3, plot=str(path))
    assert report.ok
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_training_mode_with_dropout_needs_one_keep_mask_per_step():
    from parity_tests import assert_training_parity

    pt, fx, batches = _pair("CausalAttention", dropout=0.25)
    with pytest.raises(ValueError, match="dropout_masks="):
        assert_training_parity(pt, fx, batches, training=True, steps=3)
    rng = np.random.default_rng(3)
    masks = [rng.random((B, 1, T, T)) >= 0.25 for _ in range(3)]
    with pytest.raises(ValueError, match="3 masks for 4 steps"):
        assert_training_parity(pt, fx, batches, training=True, dropout_masks=masks, steps=4)
    report = assert_training_parity(pt, fx, batches, training=True, dropout_masks=masks, steps=3, lr=0.5)
    assert report.ok
    # The masks were applied: eval mode on the same batches trains to different weights.
    evaluated = assert_training_parity(pt, fx, batches, steps=3, lr=0.5)
    w_train = report.torch_module.W_query.weight.detach().numpy()
    w_eval = evaluated.torch_module.W_query.weight.detach().numpy()
    assert float(np.max(np.abs(w_train - w_eval))) > 1e-4


def test_a_mask_is_passed_to_both_at_every_step():
    import torch

    import torch_attention as ta
    from parity_tests import assert_training_parity

    pt, fx, batches = _pair("MultiHeadAttention")
    mask = ta.padding_mask(torch.tensor([6, 3]), T).numpy()
    masked = assert_training_parity(pt, fx, batches, mask=mask, optimizer="adam", steps=3)
    plain = assert_training_parity(pt, fx, batches, optimizer="adam", steps=3)
    assert masked.steps[0].torch_loss != plain.steps[0].torch_loss


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"optimizer": "rmsprop"}, ValueError, "optimizer must be one of"),
        ({"optimizer": "adam", "momentum": 0.9}, ValueError, "momentum= and nesterov= are SGD's"),
        ({"loss": "cross_entropy"}, ValueError, "loss must be one of"),
        ({"loss": (len,)}, TypeError, "pair of callables"),
        ({"steps": 0}, ValueError, "steps must be at least 1"),
        ({"dropout_masks": [np.ones((B, 2, T, T), bool)]}, ValueError, "training mode only"),
    ],
)
def test_bad_options_raise_before_training(kwargs, error, text):
    from parity_tests import check_training_parity

    pt, fx, batches = _pair("MultiHeadAttention")
    with pytest.raises(error, match=text):
        check_training_parity(pt, fx, batches, **kwargs)


def test_a_module_of_your_own_needs_a_param_map():
    import torch
    from flax import nnx

    from parity_tests import check_training_parity

    with pytest.raises(ValueError, match="pass param_map="):
        check_training_parity(torch.nn.Linear(D, D), nnx.Linear(D, D, rngs=nnx.Rngs(0)),
                              [np.zeros((B, D), np.float32)])
    with pytest.raises(ValueError, match="Flax parameter 'bias' is not in the map"):
        check_training_parity(torch.nn.Linear(D, D, bias=False), nnx.Linear(D, D, rngs=nnx.Rngs(0)),
                              [np.zeros((B, D), np.float32)], param_map={"weight": ("kernel", True)})


def test_a_pair_of_your_own_modules_with_a_callable_loss():
    """Inputs alone (no target) and a custom loss pair, on plain Linear layers."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from parity_tests import assert_training_parity

    torch.manual_seed(0)
    pt = torch.nn.Linear(D, 4)
    fx = nnx.Linear(D, 4, rngs=nnx.Rngs(0))
    fx.kernel[...] = jnp.asarray(pt.weight.detach().numpy().T)
    fx.bias[...] = jnp.asarray(pt.bias.detach().numpy())
    xs = [np.random.default_rng(i).standard_normal((B, D)).astype(np.float32) for i in range(3)]
    loss = (lambda out, _: (out.abs() ** 1.5).sum(), lambda out, _: jnp.sum(jnp.abs(out) ** 1.5))
    report = assert_training_parity(pt, fx, xs, loss=loss, optimizer="adam", lr=0.05, steps=6,
                                    param_map={"weight": ("kernel", True), "bias": "bias"})
    assert report.ok and report.steps[-1].torch_loss < report.steps[0].torch_loss


def test_the_command_line_prints_the_trajectory_and_plots(tmp_path, capsys):
    from parity_tests.training import main

    path = tmp_path / "sgd.png"
    assert main(["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.2", "--steps", "4",
                 "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "training parity holds for 4 sgd steps" in out and out.count("\n") >= 6
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_different_variants_or_configs_are_refused():
    import torch_attention as ta
    from parity_tests import check_training_parity, to_flax

    pt, fx, batches = _pair("MultiHeadAttention")
    other = to_flax(ta.CausalAttention(D, D, 16, 0.0))
    with pytest.raises(ValueError, match="different variants: torch MultiHeadAttention vs flax CausalAttention"):
        check_training_parity(pt, other, batches)
    _, fx4, _ = _pair("MultiHeadAttention", num_heads=4)
    with pytest.raises(ValueError, match="different configurations: num_heads"):
        check_training_parity(pt, fx4, batches)


def test_no_global_flag_is_changed():
    import jax
    import torch

    from parity_tests import check_training_parity

    before = (jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision(),
              torch.backends.cuda.matmul.allow_tf32, torch.is_grad_enabled())
    pt, fx, batches = _pair("MultiHeadAttention")
    check_training_parity(pt, fx, batches, optimizer="sgd", steps=2)
    assert (jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision(),
            torch.backends.cuda.matmul.allow_tf32, torch.is_grad_enabled()) == before
