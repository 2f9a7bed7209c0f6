"""Any pair of modules in the harness, and the declarative conversion specs.

A user's own PyTorch attention with a packed q/k/v ``nn.Linear(d, 3d)`` against our Flax
``MultiHeadAttention``; a Hugging Face-style block (Conv1D-packed weights, a tuple output,
an additive mask) through ``torch_call``; ``nn.MultiheadAttention`` against Flax's own
``nnx.MultiHeadAttention`` (packed, transposed and head-shaped kernels) through both
calls; prefixes; each step's round trip; wrong specs caught by the parity check and bad
specs refused before anything runs.  One shape throughout (x is (2, 5, 8), 2 heads), so
that JAX compiles each structure once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from attention_spec.interop.specs import (
    Concat,
    JoinQKV,
    MergeAxes,
    Rule,
    Split,
    SplitAxis,
    SplitQKV,
    Transpose,
    add_prefix,
    apply_specs,
    check_specs,
    linear_rules,
    packed_qkv_rules,
    strip_prefix,
)
from tests.support import needs_both

B, T, D, H = 2, 5, 8, 2
QKV = ["W_query/kernel", "W_key/kernel", "W_value/kernel"]
QKV_BIAS = ["W_query/bias", "W_key/bias", "W_value/bias"]


def _x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((B, T, D)).astype(np.float32)


# --------------------------------------------------------------------------- the specs alone

STEP_CASES = [
    (Transpose(), (3, 4), lambda a: [a.T]),
    (Transpose((1, 2, 0)), (2, 3, 4), lambda a: [a.transpose(1, 2, 0)]),
    (SplitAxis(1, (2, -1)), (3, 8), lambda a: [a.reshape(3, 2, 4)]),
    (MergeAxes(0, (2, 4)), (2, 4, 3), lambda a: [a.reshape(8, 3)]),
    (Split(0, 3), (12,), lambda a: [a[:4], a[4:8], a[8:]]),
    (Split(1, 3), (2, 12), lambda a: [a[:, :4], a[:, 4:8], a[:, 8:]]),
    (SplitQKV("out_in"), (12, 5), lambda a: [a[:4], a[4:8], a[8:]]),
    (SplitQKV("in_out"), (5, 12), lambda a: [a[:, :4].T, a[:, 4:8].T, a[:, 8:].T]),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("step", "shape", "expect"), STEP_CASES, ids=lambda v: repr(v) if not callable(v) else "")
def test_each_step_does_what_it_says_and_round_trips_bit_exactly(step: Any, shape: Any, expect: Any,
                                                                   dtype: str) -> None:
    import ml_dtypes

    source = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    source = source.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else source
    wanted = expect(source)
    targets = [f"t{i}" for i in range(len(wanted))]
    rule = Rule("w", targets if len(targets) > 1 else targets[0], (step,))
    flax = apply_specs({"w": source}, [rule], "to_flax")
    for i, want in enumerate(wanted):
        got = flax[(f"t{i}",)]
        assert got.dtype == source.dtype and got.shape == want.shape and np.array_equal(got, want)
        assert not np.shares_memory(got, source)
    back = apply_specs(flax, [rule], "to_torch")
    assert back["w"].dtype == source.dtype and np.array_equal(back["w"], source)


def test_a_rule_of_several_steps_and_the_join_direction_round_trip() -> None:
    rng = np.random.default_rng(1)
    kernels = {(f"k{i}",): rng.standard_normal((8, 2, 4)).astype(np.float32) for i in range(3)}
    # three Flax head-shaped kernels joined into one packed (3d, d_in) weight: the rule is
    # written PyTorch -> Flax, the other direction is its exact inverse
    rule = Rule("in_proj_weight", ["k0", "k1", "k2"], (SplitQKV("out_in"), Transpose(), SplitAxis(1, (2, -1))))
    packed = apply_specs(kernels, [rule], "to_torch")["in_proj_weight"]
    assert packed.shape == (24, 8)
    np.testing.assert_array_equal(packed[8:16], kernels[("k1",)].reshape(8, 8).T)
    again = apply_specs({"in_proj_weight": packed}, [rule], "to_flax")
    assert all(np.array_equal(again[k], v) for k, v in kernels.items())
    # Concat / JoinQKV written as the forward steps are the inverses of Split / SplitQKV
    three = {f"p{i}": rng.standard_normal((4, 5)).astype(np.float32) for i in range(3)}
    join = Rule(["p0", "p1", "p2"], "packed", (JoinQKV("in_out"),))
    cat = Rule(["p0", "p1", "p2"], "cat", (Concat(0, 3),))
    out = apply_specs(three, [join], "to_flax")[("packed",)]
    np.testing.assert_array_equal(out, np.concatenate([three[f"p{i}"] for i in range(3)]).T)
    assert np.array_equal(apply_specs({"cat": apply_specs(three, [cat], "to_flax")[("cat",)]}, [cat],
                                      "to_torch")["p2"], three["p2"])


def test_prefixes_are_stripped_and_added() -> None:
    state = {"module.qkv.weight": np.ones((24, 8), np.float32), "module.qkv.bias": np.zeros(24, np.float32)}
    rules = packed_qkv_rules("qkv.weight", QKV, layout="out_in", bias="qkv.bias", biases=QKV_BIAS)
    flax = apply_specs(state, rules, "to_flax", prefix="module.")  # as DDP saves it
    assert set(flax) == {tuple(p.split("/")) for p in QKV + QKV_BIAS}
    back = apply_specs(flax, rules, "to_torch", prefix="transformer.h.0.attn.")
    assert set(back) == {"transformer.h.0.attn.qkv.weight", "transformer.h.0.attn.qkv.bias"}
    assert strip_prefix(add_prefix({"a": 1}, "module."), "module.") == {"a": 1}
    with pytest.raises(ValueError, match=r"do not start with the prefix 'module\.': 'qkv\.bias'"):
        apply_specs({"module.qkv.weight": state["module.qkv.weight"], "qkv.bias": state["module.qkv.bias"]},
                    rules, "to_flax", prefix="module.")


def test_malformed_rules_are_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"layout must be 'in_out' .* got 'io'"):
        SplitQKV("io")
    with pytest.raises(ValueError, match=r"Transpose axes must be a permutation of 0\.\.2; got \(0, 0, 1\)"):
        Transpose((0, 0, 1))
    with pytest.raises(ValueError, match=r"at most one -1"):
        SplitAxis(1, (-1, -1))
    with pytest.raises(ValueError, match=r"Split parts must be at least 2"):
        Split(0, 1)
    with pytest.raises(ValueError, match=r"the steps give 3 array\(s\) for 2 Flax path\(s\)"):
        Rule("w", ["a", "b"], (Split(0, 3),))
    with pytest.raises(ValueError, match=r"step Split\(axis=0, parts=3\) cannot take the 2 array\(s\)"):
        Rule(["w", "v"], ["a", "b", "c"], (Split(0, 3),))
    with pytest.raises(TypeError, match=r"Rule step 'transpose' is not one of Transpose"):
        Rule("w", "a", ("transpose",))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"a Flax path is a 'a/b/c' string or a tuple"):
        Rule("w", [("a", 1.5)])
    with pytest.raises(ValueError, match=r"PyTorch name 'w' is in two rules"):
        check_specs([Rule("w", "a"), Rule("w", "b")])
    with pytest.raises(ValueError, match=r"packed q/k/v needs three kernels"):
        packed_qkv_rules("w", ["a", "b"], layout="in_out")


def test_apply_specs_checks_everything_before_converting_anything() -> None:
    rules = [*packed_qkv_rules("qkv.weight", QKV, layout="in_out"), *linear_rules("out", "out_proj")]
    good = {"qkv.weight": np.ones((8, 24), np.float32), "out.weight": np.ones((8, 8), np.float32),
            "out.bias": np.ones(8, np.float32)}
    bad = {**good, "qkv.weight": np.ones((8, 20), np.float32), "extra": np.ones(1, np.float32)}
    del bad["out.bias"]
    with pytest.raises(ValueError) as err:
        apply_specs(bad, rules, "to_flax")
    message = str(err.value)
    assert "missing: 'out.bias'" in message
    assert "not in any rule: 'extra'" in message
    assert "'qkv.weight' -> 'W_query/kernel', 'W_key/kernel', 'W_value/kernel'" in message
    assert "the packed width of shape (8, 20) is not divisible by 3" in message
    with pytest.raises(ValueError, match=r"'out_proj/kernel' would be \(8, 8\) but \(4, 8\) is expected"):
        apply_specs(good, rules, "to_flax", expected={**{p: (8, 8) for p in QKV}, "out_proj/kernel": (4, 8),
                                                      "out_proj/bias": (8,)})
    with pytest.raises(ValueError, match=r"direction must be 'to_flax' or 'to_torch'; got 'flax'"):
        apply_specs(good, rules, "flax")
    with pytest.raises(ValueError, match=r"MergeAxes\(1, \(2, 4\)\) on shape \(8, 3, 4\): axes 1\.\.2 are \(3, 4\)"):
        apply_specs({"w": np.ones((8, 3, 4), np.float32)}, [Rule("w", "k", (MergeAxes(1, (2, 4)),))], "to_flax")
    with pytest.raises(ValueError, match=r"an axis of length 3 cannot be split into \(2, 4\)"):
        apply_specs({"k": np.ones((8, 3), np.float32)}, [Rule("w", "k", (MergeAxes(1, (2, 4)),))], "to_torch")


# --------------------------------------------------------------------------- the harness


def _torch_modules() -> dict[str, Any]:
    import torch

    class PackedAttention(torch.nn.Module):
        """A user's causal multi-head attention: one packed nn.Linear(d, 3d) for q/k/v."""

        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(d, 3 * d, bias=True)
            self.out = torch.nn.Linear(d, d)

        def scores(self, x: Any) -> tuple[Any, Any]:
            b, t, d = x.shape
            q, k, v = (p.reshape(b, t, self.heads, -1).transpose(1, 2) for p in self.qkv(x).split(d, dim=-1))
            return q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), v

        def forward(self, x: Any) -> Any:
            s, v = self.scores(x)
            t = x.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            w = s.masked_fill(~causal, float("-inf")).softmax(-1)
            return self.out((w @ v).transpose(1, 2).reshape(x.shape))

    class Conv1D(torch.nn.Module):
        """GPT-2's Conv1D: weight (in, out), applied as x @ W + b."""

        def __init__(self, d_in: int, d_out: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(d_in, d_out) * 0.3)
            self.bias = torch.nn.Parameter(torch.randn(d_out) * 0.1)

        def forward(self, x: Any) -> Any:
            return x @ self.weight + self.bias

    class HFStyleAttention(torch.nn.Module):
        """Hugging Face's shape of things: Conv1D-packed c_attn, an additive mask
        (B, 1, 1, S) of 0 / large negative, a tuple output (hidden states, present)."""

        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.c_attn = Conv1D(d, 3 * d)
            self.c_proj = Conv1D(d, d)

        def forward(self, hidden_states: Any, attention_mask: Any = None) -> tuple[Any, Any]:
            b, t, d = hidden_states.shape
            q, k, v = (p.reshape(b, t, self.heads, -1).transpose(1, 2)
                       for p in self.c_attn(hidden_states).split(d, dim=-1))
            s = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
            s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), torch.finfo(s.dtype).min)
            if attention_mask is not None:
                s = s + attention_mask
            w = s.softmax(-1)
            return self.c_proj((w @ v).transpose(1, 2).reshape(b, t, d)), (k, v)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = HFStyleAttention(D, H)

        def forward(self, x: Any, attention_mask: Any = None) -> Any:
            return self.attn(x, attention_mask=attention_mask)

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return {"packed": PackedAttention(D, H), "hf": Block()}


def _ours(qkv_bias: bool = True) -> Any:
    from flax import nnx

    import jax_attention

    return jax_attention.MultiHeadAttention(D, D, None, 0.0, H, qkv_bias=qkv_bias, rngs=nnx.Rngs(0))


PACKED_RULES = [*packed_qkv_rules("qkv.weight", QKV, layout="out_in", bias="qkv.bias", biases=QKV_BIAS),
                *linear_rules("out", "out_proj")]
HF_RULES = [*packed_qkv_rules("attn.c_attn.weight", QKV, layout="in_out", bias="attn.c_attn.bias",
                              biases=QKV_BIAS),
            Rule("attn.c_proj.weight", "out_proj/kernel"),  # Conv1D is (in, out) like a kernel
            Rule("attn.c_proj.bias", "out_proj/bias")]


@needs_both
def test_a_users_packed_qkv_module_against_our_flax_module() -> None:
    from parity_tests import assert_parity
    from parity_tests.harness import copy_params

    tm, fm = _torch_modules()["packed"], _ours()
    copy_params(tm, fm, PACKED_RULES)
    report = assert_parity(tm, fm, _x(), param_map=PACKED_RULES)
    names = {f.name for f in report.findings}
    assert names == {"output", "grad input[0]", "grad qkv.weight", "grad qkv.bias", "grad out.weight",
                     "grad out.bias"}
    # the Flax kernels' gradients packed back into the torch layout, and not trivially zero
    assert report.flax_results["grad qkv.weight"].shape == (3 * D, D)
    assert np.abs(report.torch_results["grad qkv.weight"]).max() > 1e-3
    # and back: a fresh torch module loaded from the Flax one computes the same
    fresh = _torch_modules()["packed"]
    copy_params(fresh, fm, PACKED_RULES, to="torch")
    assert all(np.array_equal(fresh.state_dict()[k].numpy(), v.numpy()) for k, v in tm.state_dict().items())


@needs_both
def test_a_hugging_face_style_block_through_torch_call() -> None:
    import torch

    from parity_tests import assert_parity
    from parity_tests.harness import copy_params

    def additive(mask: Any) -> Any:  # True = attend -> 0, False -> a large negative
        return None if mask is None else torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)

    def hf_call(m: Any, x: Any, mask: Any = None) -> Any:
        return m(x, attention_mask=additive(mask))[0]

    tm, fm = _torch_modules()["hf"], _ours()
    copy_params(tm, fm, HF_RULES)
    mask = np.ones((B, 1, 1, T), bool)
    mask[1, ..., 3:] = False  # the second example has 3 tokens
    report = assert_parity(tm, fm, _x(), mask=mask, param_map=HF_RULES, torch_call=hf_call)
    assert "grad attn.c_attn.weight" in {f.name for f in report.findings}
    assert report.flax_results["grad attn.c_attn.weight"].shape == (D, 3 * D)
    # without the adapter the tuple and the mask keyword do not fit: refused by the module
    with pytest.raises(TypeError, match="mask"):
        assert_parity(tm, fm, _x(), mask=mask, param_map=HF_RULES)


@needs_both
def test_nn_multihead_against_flax_own_attention_through_both_calls() -> None:
    import torch
    from flax import nnx

    from parity_tests import assert_parity
    from parity_tests.harness import copy_params

    with torch.random.fork_rng():
        torch.manual_seed(0)
        tm = torch.nn.MultiheadAttention(D, H, batch_first=True)
        torch.nn.init.normal_(tm.in_proj_bias, std=0.1)
    fm = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=nnx.Rngs(0))
    heads = SplitAxis(1, (H, -1))  # (in, heads*head_dim) -> (in, heads, head_dim)
    rules = [
        Rule("in_proj_weight", ["query/kernel", "key/kernel", "value/kernel"],
             (SplitQKV("out_in"), Transpose(), heads)),
        Rule("in_proj_bias", ["query/bias", "key/bias", "value/bias"], (Split(0, 3), SplitAxis(0, (H, -1)))),
        Rule("out_proj.weight", "out/kernel", (Transpose(), SplitAxis(0, (H, -1)))),
        Rule("out_proj.bias", "out/bias"),
    ]
    copy_params(tm, fm, rules)
    report = assert_parity(tm, fm, _x(), param_map=rules,
                           torch_call=lambda m, x: m(x, x, x, need_weights=False)[0],
                           flax_call=lambda m, x: m(x))
    assert {"grad in_proj_weight", "grad out_proj.weight"} <= {f.name for f in report.findings}


@needs_both
@pytest.mark.parametrize("wrong", ["missing transpose", "split order"])
def test_a_wrong_spec_is_caught(wrong: str) -> None:
    from parity_tests import ParityError, assert_parity, check_parity
    from parity_tests.harness import copy_params

    if wrong == "missing transpose":  # out is square, so the shapes still fit
        bad = [*PACKED_RULES[:2], Rule("out.weight", "out_proj/kernel"), PACKED_RULES[3]]
    else:  # key and query swapped
        bad = [*packed_qkv_rules("qkv.weight", [QKV[1], QKV[0], QKV[2]], layout="out_in", bias="qkv.bias",
                                 biases=[QKV_BIAS[1], QKV_BIAS[0], QKV_BIAS[2]]), *PACKED_RULES[2:]]
    tm, fm = _torch_modules()["packed"], _ours()
    copy_params(tm, fm, bad)
    with pytest.raises(ParityError) as err:
        assert_parity(tm, fm, _x(), param_map=bad)
    assert "output" in {f.name for f in err.value.report.failures}
    # weights copied right but gradients mapped through the wrong spec: the output holds,
    # the gradients do not
    copy_params(tm, fm, PACKED_RULES)
    report = check_parity(tm, fm, _x(), param_map=bad)
    failed = {f.name for f in report.failures}
    assert "output" not in failed
    assert failed & {"grad out.weight", "grad qkv.weight"}


@needs_both
def test_bad_specs_are_refused_before_anything_runs() -> None:
    from parity_tests import check_parity
    from parity_tests.harness import copy_params

    tm, fm = _torch_modules()["packed"], _ours()
    before = _flax_arrays(fm)
    wrong_layout = [*packed_qkv_rules("qkv.weight", QKV, layout="in_out", bias="qkv.bias", biases=QKV_BIAS),
                    *PACKED_RULES[2:]]  # (24, 8) read as (d_in, 3*d_out): 8 is not divisible by 3
    with pytest.raises(ValueError, match=r"\(param_map\) does not match[\s\S]*'qkv\.weight'[\s\S]*not divisible by 3"):
        copy_params(tm, fm, wrong_layout)
    no_bias = PACKED_RULES[:1] + PACKED_RULES[2:]
    with pytest.raises(ValueError, match=r"PyTorch parameter 'qkv\.bias' is not in the map[\s\S]*"
                                         r"Flax parameter 'W_query/bias' is not in the map"):
        check_parity(tm, fm, _x(), param_map=no_bias)
    with pytest.raises(ValueError, match=r"'out\.weight' \(8, 8\) does not match 'out_proj/kernel' \(8, 8\) "
                                         r"\(through SplitAxis\(axis=0, sizes=\(2, 4\)\), which gives \(2, 4, 8\)\)"):
        check_parity(tm, fm, _x(), param_map=[*PACKED_RULES[:2], Rule("out.weight", "out_proj/kernel",
                                                                      (SplitAxis(0, (2, 4)),)), PACKED_RULES[3]])
    with pytest.raises(TypeError, match=r"param_map is a mapping .* got int"):
        check_parity(tm, fm, _x(), param_map=3)
    with pytest.raises(TypeError, match=r"torch_call must be a callable"):
        check_parity(tm, fm, _x(), param_map=PACKED_RULES, torch_call="forward")
    after = _flax_arrays(fm)
    assert all(np.array_equal(before[k], after[k]) for k in before)


@needs_both
def test_implementation_is_refused_when_either_side_is_not_ours() -> None:
    from parity_tests import check_parity

    tm, fm = _torch_modules()["packed"], _ours()
    with pytest.raises(ValueError, match=r"apply to this library's modules only; PackedAttention"):
        check_parity(tm, fm, _x(), param_map=PACKED_RULES, implementation="reference")


def _flax_arrays(module: Any) -> dict[Any, np.ndarray]:
    from flax import nnx

    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


@needs_both
def test_our_torch_module_against_flax_own_attention_with_a_mask() -> None:
    import torch
    from flax import nnx

    import torch_attention
    from parity_tests import assert_parity, check_parity
    from parity_tests.harness import copy_params

    with torch.random.fork_rng():
        torch.manual_seed(0)
        tm = torch_attention.MultiHeadAttention(D, D, None, 0.0, H, qkv_bias=True, causal=False)
    fm = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=nnx.Rngs(0))
    heads = SplitAxis(1, (H, -1))
    rules = [Rule(f"W_{role}.weight", f"{role}/kernel", (Transpose(), heads)) for role in ("query", "key", "value")]
    rules += [Rule(f"W_{role}.bias", f"{role}/bias", (SplitAxis(0, (H, -1)),)) for role in ("query", "key", "value")]
    rules += [Rule("out_proj.weight", "out/kernel", (Transpose(), SplitAxis(0, (H, -1)))),
              Rule("out_proj.bias", "out/bias")]
    copy_params(tm, fm, rules)
    mask = np.ones((B, 1, 1, T), bool)
    mask[0, ..., 2:] = False  # True = may attend in both
    report = assert_parity(tm, fm, _x(), mask=mask, param_map=rules)  # both take mask= as it is
    assert "grad W_key.weight" in {f.name for f in report.findings}
    # the mask matters: without it both agree on a different output
    free = check_parity(tm, fm, _x(), param_map=rules, grads=False)
    assert free.ok and not np.allclose(free.torch_results["output"], report.torch_results["output"])


@needs_both
def test_training_parity_through_rules() -> None:
    """``assert_training_parity`` takes the same Rules as the harness: a user's packed-q/k/v
    module trains step for step with our Flax module (SGD with momentum, 4 steps), every
    parameter compared in PyTorch's names and layouts after each step.  (Not Adam: the
    key bias's gradient is exactly zero in exact arithmetic, softmax being blind to a
    constant per row, so Adam would divide rounding noise by rounding noise.)"""
    from parity_tests import assert_training_parity
    from parity_tests.harness import copy_params

    tm, fm = _torch_modules()["packed"], _ours()
    copy_params(tm, fm, PACKED_RULES)
    rng = np.random.default_rng(4)
    batches = [(rng.standard_normal((2, T, D)).astype(np.float32), rng.standard_normal((2, T, D)).astype(np.float32))
               for _ in range(2)]
    report = assert_training_parity(tm, fm, batches, optimizer="sgd", steps=4, lr=5e-2, momentum=0.9,
                                    param_map=PACKED_RULES)
    assert len(report.steps) == 4
    assert {f.name for f in report.steps[-1].findings} == {"loss", "qkv.weight", "qkv.bias", "out.weight", "out.bias"}
    # the packed weight really moved, so the comparison is not of the initial values
    assert not np.allclose(report.torch_module.qkv.weight.detach().numpy(), tm.qkv.weight.detach().numpy())


@needs_both
def test_training_parity_rules_that_do_not_fit_are_listed() -> None:
    from parity_tests import assert_training_parity

    tm, fm = _torch_modules()["packed"], _ours()
    bad = PACKED_RULES[:-1]  # out.bias left out
    with pytest.raises(ValueError, match=r"(?s)the parameter map \(param_map\) does not match.*PyTorch parameter 'out.bias' is not"):
        assert_training_parity(tm, fm, [_x()], param_map=bad)
