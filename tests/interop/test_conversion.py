"""Weight conversion between the twins: round trips, the array-level converters, bad
state, the declared map, and each side working without the other framework.

No forward passes here (so no JAX compilation beyond parameter initialisation): every
check is on the arrays themselves, and exact (``torch.equal`` / ``np.array_equal``
including dtype).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from attention_spec.interop.conversion import module_rules, rules_for
from parity_tests.cases import VARIANTS
from tests.support import needs_both, needs_jax, needs_torch

DTYPES = ("float32", "bfloat16", "float16")

# A non-square configuration (d_in != d_out) so that a missing or extra transpose cannot
# go unnoticed: a Linear weight is (8, 16) and its kernel (16, 8).
D_IN, D_OUT, CONTEXT = 16, 8, 6
MHA_CONFIG = {"d_in": D_IN, "d_out": D_OUT, "context_length": CONTEXT, "dropout": 0.0,
              "num_heads": 2, "qkv_bias": True}
MHA_SHAPES = {  # torch name: torch shape
    "W_query.weight": (D_OUT, D_IN), "W_query.bias": (D_OUT,),
    "W_key.weight": (D_OUT, D_IN), "W_key.bias": (D_OUT,),
    "W_value.weight": (D_OUT, D_IN), "W_value.bias": (D_OUT,),
    "out_proj.weight": (D_OUT, D_OUT), "out_proj.bias": (D_OUT,),
}


# --------------------------------------------------------------------------- helpers


def torch_module(cls: str, config: dict[str, Any], dtype: str = "float32", seed: int = 0) -> Any:
    import torch

    import torch_attention

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = getattr(torch_attention, cls)(**config)
    return module.to(getattr(torch, dtype))


def flax_module(cls: str, config: dict[str, Any], dtype: str = "float32", seed: int = 0) -> Any:
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention

    # param_dtype: the parameters' storage dtype (Flax's convention; PyTorch's ``dtype``).
    kwargs = {} if cls == "SimplifiedAttention" else {"param_dtype": getattr(jnp, dtype)}
    return getattr(jax_attention, cls)(**config, **kwargs, rngs=nnx.Rngs(seed))


def torch_params(module: Any) -> dict[str, Any]:
    """{name: a detached copy} of every parameter."""
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def flax_params(module: Any) -> dict[tuple[Any, ...], np.ndarray]:
    """{path: NumPy copy} of every nnx.Param."""
    from flax import nnx

    return {tuple(p): np.array(v[...]) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def assert_torch_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def assert_arrays_equal(a: dict[Any, np.ndarray], b: dict[Any, np.ndarray]) -> None:
    assert sorted(a, key=str) == sorted(b, key=str)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert np.array_equal(a[key], b[key]), key


def to_f32(array: Any) -> np.ndarray:
    """Exact float32 view of a NumPy array or tensor of any float dtype (bfloat16 included)."""
    from attention_spec.interop.conversion import as_numpy

    return np.asarray(as_numpy(array)).astype(np.float32)


# --------------------------------------------------------------------------- round trips

VARIANT_IDS = list(VARIANTS)


def variant_config(variant: str) -> dict[str, Any]:
    """The variant's config with two heads, its widths narrowed to d_in 16, d_out 8: the
    parameter shapes (16, 8), (8,), (8, 8) are then the same for every variant and every
    test in this file, so JAX compiles its initialisers once per dtype."""
    spec = VARIANTS[variant]
    config = spec.config(2)
    if spec.cls == "MultiHeadAttention":
        config["d_out"] = D_OUT
    return config


@needs_both
# Every variant in two of the three dtypes by default, the dtypes in turn (each on 14
# variants: one code keeps the dtype for every variant); all three with --exhaustive.
@pytest.mark.parametrize(("variant", "dtype"), [
    pytest.param(variant, dtype, id=f"{variant}-{dtype}",
                 marks=() if (j - i) % 3 in (0, 1) else (pytest.mark.slow, pytest.mark.exhaustive))
    for i, variant in enumerate(VARIANT_IDS) for j, dtype in enumerate(DTYPES)])
def test_round_trip_torch_flax_torch(variant: str, dtype: str) -> None:
    import torch

    from parity_tests import to_flax, to_torch

    spec = VARIANTS[variant]
    tm = torch_module(spec.cls, variant_config(variant), dtype, seed=1)
    fm = to_flax(tm)
    back = to_torch(fm)
    assert type(fm).__name__ == type(back).__name__ == spec.cls
    assert fm.config == back.config == tm.config
    assert_torch_equal(torch_params(tm), torch_params(back))
    # and the Flax copy in between holds exactly the declared arrays
    flat = flax_params(fm)
    if spec.cls == "SimplifiedAttention":
        assert flat == {} and torch_params(tm) == {}
    assert set(flat) == {rule.flax_path for rule in module_rules(tm)}
    for rule in module_rules(tm):
        got = flat[rule.flax_path]
        assert got.dtype.name == dtype
        expected = tm.state_dict()[rule.torch_name]
        expected = expected.T if rule.transpose else expected
        assert torch.equal(torch.from_numpy(to_f32(got)), expected.float())


@needs_both
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_round_trip_flax_torch_flax(variant: str, dtype: str) -> None:
    import torch

    from parity_tests import to_flax, to_torch

    spec = VARIANTS[variant]
    fm = flax_module(spec.cls, variant_config(variant), dtype, seed=2)
    tm = to_torch(fm)
    back = to_flax(tm)
    assert type(tm).__name__ == type(back).__name__ == spec.cls
    assert back.config == tm.config == fm.config
    for p in tm.parameters():
        assert p.dtype == getattr(torch, dtype)
    assert_arrays_equal(flax_params(fm), flax_params(back))
    if spec.cls == "SimplifiedAttention":
        assert flax_params(fm) == {} and torch_params(tm) == {}


@needs_both
def test_simplified_attention_converts_to_an_empty_map() -> None:
    import jax_attention
    import torch_attention

    assert rules_for("SimplifiedAttention", {}) == []
    tm = torch_attention.SimplifiedAttention()
    fm = flax_module("SimplifiedAttention", {})
    assert torch_attention.interop.torch_state_dict(tm) == {}
    assert torch_attention.interop.flax_arrays(tm) == {}
    assert jax_attention.interop.flax_arrays(fm) == {}
    assert jax_attention.interop.torch_state_dict(fm) == {}
    assert torch_attention.interop.state_dict_to_flax({}, "SimplifiedAttention", {}) == {}
    assert torch_attention.interop.state_dict_from_flax({}, "SimplifiedAttention", {}) == {}
    assert jax_attention.interop.state_to_torch({}, "SimplifiedAttention", {}) == {}
    # and something where nothing is expected is refused
    with pytest.raises(ValueError, match=r"unexpected: W_query\.weight \(2, 2\)"):
        torch_attention.interop.state_dict_to_flax({"W_query.weight": np.zeros((2, 2))},
                                                   "SimplifiedAttention", {})


# --------------------------------------------------------------------------- array level


def mha_state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in MHA_SHAPES.items()}


@needs_torch
def test_torch_array_converters_round_trip_numpy_and_tensors() -> None:
    import torch

    from torch_attention.interop import state_dict_from_flax, state_dict_to_flax

    sd = mha_state_dict()
    flat = state_dict_to_flax(sd, "MultiHeadAttention", MHA_CONFIG)
    assert sorted(flat, key=str) == sorted(
        [(n, k) for n in ("W_query", "W_key", "W_value", "out_proj") for k in ("kernel", "bias")], key=str
    )
    assert flat[("W_query", "kernel")].shape == (D_IN, D_OUT)
    # a Linear weight is transposed: kernel[i, j] == weight[j, i]
    assert flat[("W_query", "kernel")][3, 5] == sd["W_query.weight"][5, 3]
    assert flat[("W_key", "kernel")][15, 0] == sd["W_key.weight"][0, 15]
    assert np.array_equal(flat[("out_proj", "bias")], sd["out_proj.bias"])
    back = state_dict_from_flax(flat, "MultiHeadAttention", MHA_CONFIG)
    assert_arrays_equal(back, sd)

    # tensors in give the same NumPy arrays out
    as_tensors = {k: torch.from_numpy(v) for k, v in sd.items()}
    assert_arrays_equal(state_dict_to_flax(as_tensors, "MultiHeadAttention", MHA_CONFIG), flat)
    # Flax-side arrays in every accepted spelling: {path: array}, {"a/b": array}, nested
    slashed = {"/".join(p): v for p, v in flat.items()}
    nested: dict[str, dict[str, np.ndarray]] = {}
    for (child, leaf), v in flat.items():
        nested.setdefault(child, {})[leaf] = v
    for spelling in (slashed, nested):
        assert_arrays_equal(state_dict_from_flax(spelling, "MultiHeadAttention", MHA_CONFIG), sd)


@needs_jax
def test_jax_array_converters_round_trip_numpy_and_state() -> None:
    import jax.numpy as jnp
    from flax import nnx

    from jax_attention.interop import state_from_torch, state_to_torch

    sd = mha_state_dict(1)
    state = state_from_torch(sd, "MultiHeadAttention", MHA_CONFIG)
    assert isinstance(state, nnx.State)
    flat = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}
    assert flat[("W_value", "kernel")].shape == (D_IN, D_OUT)
    assert flat[("W_value", "kernel")][7, 2] == sd["W_value.weight"][2, 7]
    assert flat[("out_proj", "kernel")][1, 6] == sd["out_proj.weight"][6, 1]
    assert_arrays_equal(state_to_torch(state, "MultiHeadAttention", MHA_CONFIG), sd)
    # a plain {path: array} (JAX or NumPy) works too
    assert_arrays_equal(
        state_to_torch({p: jnp.asarray(v) for p, v in flat.items()}, "MultiHeadAttention", MHA_CONFIG), sd
    )
    # and the State drops straight into a module of that config
    fm = flax_module("MultiHeadAttention", MHA_CONFIG)
    nnx.update(fm, state)
    assert_arrays_equal(flax_params(fm), flat)


@needs_jax
def test_jax_state_from_torch_knows_every_variant() -> None:
    """``state_from_torch`` builds each variant of the registry as the package names it."""
    import jax_attention
    from attention_spec.registry import VARIANTS
    from jax_attention import interop

    assert {name: interop._MODULES[name] for name in VARIANTS} == {name: getattr(jax_attention, name) for name in VARIANTS}


@needs_jax
def test_jax_state_from_torch_accepts_tensors() -> None:
    pytest.importorskip("torch")
    import torch
    from flax import nnx

    from jax_attention.interop import state_from_torch

    sd = mha_state_dict(2)
    state = state_from_torch({k: torch.from_numpy(v) for k, v in sd.items()}, "MultiHeadAttention", MHA_CONFIG)
    flat = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}
    assert np.array_equal(flat[("W_query", "kernel")], sd["W_query.weight"].T)
    assert np.array_equal(flat[("W_query", "bias")], sd["W_query.bias"])


@needs_both
def test_self_attention_v1_matrix_is_not_transposed() -> None:
    import jax_attention
    import torch_attention

    config = {"d_in": D_IN, "d_out": D_OUT}
    tm = torch_module("SelfAttention_v1", config)
    flat = torch_attention.interop.state_dict_to_flax(tm.state_dict(), "SelfAttention_v1", config)
    assert sorted(flat) == [("W_key",), ("W_query",), ("W_value",)]
    for name in ("W_query", "W_key", "W_value"):
        assert flat[(name,)].shape == (D_IN, D_OUT)  # (d_in, d_out) on both sides
        assert np.array_equal(flat[(name,)], tm.state_dict()[name].numpy())
    assert flat[("W_query",)][3, 5] == tm.W_query[3, 5].item()
    state = jax_attention.interop.state_from_torch(tm.state_dict(), "SelfAttention_v1", config)
    back = jax_attention.interop.state_to_torch(state, "SelfAttention_v1", config)
    assert_arrays_equal(back, {k: v.numpy() for k, v in tm.state_dict().items()})


@needs_both
def test_wrapper_paths_and_names() -> None:
    import jax_attention
    import torch_attention

    config = {"d_in": D_IN, "d_out": D_OUT, "context_length": CONTEXT, "dropout": 0.0, "num_heads": 3,
              "qkv_bias": True}
    tm = torch_module("MultiHeadAttentionWrapper", config)
    flat = torch_attention.interop.state_dict_to_flax(tm.state_dict(), "MultiHeadAttentionWrapper", config)
    for i in range(3):
        for n in ("W_query", "W_key", "W_value"):
            kernel = flat[("heads", i, n, "kernel")]
            weight = tm.state_dict()[f"heads.{i}.{n}.weight"].numpy()
            assert kernel.shape == (D_IN, D_OUT) and weight.shape == (D_OUT, D_IN)
            assert kernel[9, 1] == weight[1, 9]
            assert np.array_equal(flat[("heads", i, n, "bias")], tm.state_dict()[f"heads.{i}.{n}.bias"].numpy())
    rules = rules_for("MultiHeadAttentionWrapper", config)
    assert {r.torch_name: r.flax_path for r in rules}["heads.2.W_query.weight"] == ("heads", 2, "W_query", "kernel")
    assert len(flat) == len(rules) == 3 * 3 * 2
    state = jax_attention.interop.state_from_torch(tm.state_dict(), "MultiHeadAttentionWrapper", config)
    names = jax_attention.interop.state_to_torch(state, "MultiHeadAttentionWrapper", config)
    assert "heads.1.W_value.bias" in names
    assert_arrays_equal(names, {k: v.numpy() for k, v in tm.state_dict().items()})


# --------------------------------------------------------------------------- bad state

TORCH_BAD = {
    "missing": (lambda sd: sd.pop("W_key.weight"),
                [r"missing: W_key\.weight \(8, 16\)"]),
    "unexpected": (lambda sd: sd.__setitem__("extra.weight", np.zeros((3, 3), np.float32)),
                   [r"unexpected: extra\.weight \(3, 3\)"]),
    "misshaped": (lambda sd: sd.__setitem__("W_value.weight", np.zeros((16, 8), np.float32)),
                  [r"misshaped: W_value\.weight is \(16, 8\), expected \(8, 16\)"]),
}
FLAX_BAD = {
    "missing": (lambda fl: fl.pop(("W_key", "kernel")),
                [r"missing: W_key/kernel \(16, 8\)"]),
    "unexpected": (lambda fl: fl.__setitem__(("extra", "kernel"), np.zeros((3, 3), np.float32)),
                   [r"unexpected: extra/kernel \(3, 3\)"]),
    "misshaped": (lambda fl: fl.__setitem__(("W_value", "kernel"), np.zeros((8, 16), np.float32)),
                  [r"misshaped: W_value/kernel is \(8, 16\), expected \(16, 8\)"]),
}
BAD_KINDS = ("missing", "unexpected", "misshaped", "all")


def _spoil(arrays: dict[Any, np.ndarray], table: dict[str, Any], kind: str) -> list[str]:
    kinds = ("missing", "unexpected", "misshaped") if kind == "all" else (kind,)
    patterns = []
    for k in kinds:
        spoil, expected = table[k]
        spoil(arrays)
        patterns += expected
    return patterns


def _check_message(message: str, patterns: list[str], what: str) -> None:
    assert message.startswith(f"{what} does not match the declared weight layout:"), message
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    assert len(message.splitlines()) == 1 + len(patterns), message  # nothing else listed


@needs_jax
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_torch_state_into_flax_leaves_module_unchanged(kind: str) -> None:
    from jax_attention.interop import load_torch_state_dict

    fm = flax_module("MultiHeadAttention", MHA_CONFIG, seed=3)
    before = flax_params(fm)
    sd = mha_state_dict(4)  # different values from fm's: a partial write would show
    patterns = _spoil(sd, TORCH_BAD, kind)
    with pytest.raises(ValueError) as err:
        load_torch_state_dict(fm, sd)
    _check_message(str(err.value), patterns, "the PyTorch state_dict")
    assert_arrays_equal(flax_params(fm), before)


@needs_jax
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_flax_arrays_into_flax_leaves_module_unchanged(kind: str) -> None:
    from jax_attention.interop import load_flax_arrays

    fm = flax_module("MultiHeadAttention", MHA_CONFIG, seed=3)
    before = flax_params(fm)
    flat = {r.flax_path: (v.T if r.transpose else v)
            for r in rules_for("MultiHeadAttention", MHA_CONFIG)
            for v in [mha_state_dict(4)[r.torch_name]]}
    patterns = _spoil(flat, FLAX_BAD, kind)
    with pytest.raises(ValueError) as err:
        load_flax_arrays(fm, flat)
    _check_message(str(err.value), patterns, "the Flax state")
    assert_arrays_equal(flax_params(fm), before)


@needs_torch
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_torch_state_into_torch_leaves_module_unchanged(kind: str) -> None:
    import torch

    from torch_attention.interop import load_torch_state_dict

    tm = torch_module("MultiHeadAttention", MHA_CONFIG, seed=3)
    before = torch_params(tm)
    sd = {k: torch.from_numpy(v) for k, v in mha_state_dict(4).items()}
    patterns = _spoil(sd, TORCH_BAD, kind)
    with pytest.raises(ValueError) as err:
        load_torch_state_dict(tm, sd)
    _check_message(str(err.value), patterns, "the PyTorch state_dict")
    assert_torch_equal(torch_params(tm), before)


@needs_torch
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_flax_arrays_into_torch_leaves_module_unchanged(kind: str) -> None:
    from torch_attention.interop import load_flax_arrays, state_dict_to_flax

    tm = torch_module("MultiHeadAttention", MHA_CONFIG, seed=3)
    before = torch_params(tm)
    flat = state_dict_to_flax(mha_state_dict(4), "MultiHeadAttention", MHA_CONFIG)
    patterns = _spoil(flat, FLAX_BAD, kind)
    with pytest.raises(ValueError) as err:
        load_flax_arrays(tm, flat)
    _check_message(str(err.value), patterns, "the Flax state")
    assert_torch_equal(torch_params(tm), before)


@needs_torch
def test_good_load_into_torch_changes_every_parameter() -> None:
    """The control for the tests above: the same arrays, unspoiled, are written."""
    import torch

    from torch_attention.interop import load_flax_arrays, load_torch_state_dict, state_dict_to_flax

    sd = mha_state_dict(4)
    for load, arrays in ((load_torch_state_dict, sd),
                         (load_flax_arrays, state_dict_to_flax(sd, "MultiHeadAttention", MHA_CONFIG))):
        tm = torch_module("MultiHeadAttention", MHA_CONFIG, seed=3)
        assert load(tm, arrays) is tm
        assert_torch_equal(torch_params(tm), {k: torch.from_numpy(v) for k, v in sd.items()})


@needs_torch
def test_wrong_dtype_is_cast_to_the_module_dtype_torch() -> None:
    """Documented behaviour: arrays of another float dtype are accepted and rounded to the
    module's parameter dtype (round to nearest, as ``Tensor.to``); the module keeps its
    dtype, nothing warns."""
    import torch

    from torch_attention.interop import load_torch_state_dict

    sd64 = {k: np.random.default_rng(5).standard_normal(s) for k, s in MHA_SHAPES.items()}  # float64
    tm = torch_module("MultiHeadAttention", MHA_CONFIG)
    load_torch_state_dict(tm, sd64)
    for name, p in tm.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), torch.from_numpy(sd64[name]).to(torch.float32))
    # and into a bfloat16 module, float32 arrays are rounded to bfloat16
    tm16 = torch_module("MultiHeadAttention", MHA_CONFIG, "bfloat16")
    sd32 = {k: v.astype(np.float32) for k, v in sd64.items()}
    load_torch_state_dict(tm16, sd32)
    for name, p in tm16.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), torch.from_numpy(sd32[name]).to(torch.bfloat16))


@needs_jax
def test_wrong_dtype_is_cast_to_the_module_dtype_flax() -> None:
    """As for PyTorch: float64 / float32 arrays into a bfloat16 Flax module are rounded to
    bfloat16 (``jnp.asarray(..., dtype=param dtype)``); the parameter dtype is kept."""
    import jax.numpy as jnp
    import ml_dtypes

    from jax_attention.interop import load_torch_state_dict

    sd64 = {k: np.random.default_rng(6).standard_normal(s) for k, s in MHA_SHAPES.items()}
    fm = flax_module("MultiHeadAttention", MHA_CONFIG, "bfloat16")
    load_torch_state_dict(fm, sd64)
    params = flax_params(fm)
    for (child, leaf), value in params.items():
        assert value.dtype == jnp.bfloat16
        source = sd64[f"{child}.{'weight' if leaf == 'kernel' else 'bias'}"]
        source = source.T if leaf == "kernel" else source
        assert np.array_equal(value, source.astype(ml_dtypes.bfloat16))


# --------------------------------------------------------------------------- declared map

# d_in != d_out throughout (the same shapes as above: no new compilation).
MAP_CASES: list[tuple[str, dict[str, Any]]] = [
    ("SimplifiedAttention", {}),
    ("SelfAttention_v1", {"d_in": D_IN, "d_out": D_OUT}),
    ("Head", {"d_in": D_IN, "head_size": D_OUT, "context_length": CONTEXT, "dropout": 0.0}),
]
for _bias in (False, True):
    MAP_CASES += [
        ("SelfAttention_v2", {"d_in": D_IN, "d_out": D_OUT, "qkv_bias": _bias}),
        ("CausalAttention", {"d_in": D_IN, "d_out": D_OUT, "context_length": CONTEXT, "dropout": 0.0,
                             "qkv_bias": _bias}),
        ("MultiHeadAttentionWrapper", {"d_in": D_IN, "d_out": D_OUT, "context_length": CONTEXT,
                                       "dropout": 0.0, "num_heads": 3, "qkv_bias": _bias}),
    ]
    for _proj in (False, True):
        MAP_CASES.append(("MultiHeadAttention", {**MHA_CONFIG, "qkv_bias": _bias, "out_proj": _proj}))


def _case_id(case: tuple[str, dict[str, Any]]) -> str:
    cls, config = case
    flags = [k for k in ("qkv_bias", "out_proj") if k in config and config[k]]
    flags += [f"no-{k}" for k in ("qkv_bias", "out_proj") if k in config and not config[k]]
    return "-".join([cls, *flags])


@needs_torch
@pytest.mark.parametrize("case", MAP_CASES, ids=_case_id)
def test_declared_map_names_exactly_the_torch_parameters(case: tuple[str, dict[str, Any]]) -> None:

    cls, config = case
    rules = rules_for(cls, config)
    params = dict(torch_module(cls, config).named_parameters())
    assert {r.torch_name: r.torch_shape for r in rules} == {k: tuple(v.shape) for k, v in params.items()}
    assert len({r.torch_name for r in rules}) == len(rules)  # each exactly once
    has_bias = any(r.torch_name.endswith(".bias") and "out_proj" not in r.torch_name for r in rules)
    assert has_bias == bool(config.get("qkv_bias", False))
    assert any(r.torch_name.startswith("out_proj.") for r in rules) == (
        cls == "MultiHeadAttention" and config["out_proj"])


@needs_jax
@pytest.mark.parametrize("case", MAP_CASES, ids=_case_id)
def test_declared_map_names_exactly_the_flax_parameters(case: tuple[str, dict[str, Any]]) -> None:

    cls, config = case
    rules = rules_for(cls, config)
    params = flax_params(flax_module(cls, config))
    assert {r.flax_path: r.flax_shape for r in rules} == {k: v.shape for k, v in params.items()}
    assert len({r.flax_path for r in rules}) == len(rules)
    for r in rules:
        assert r.transpose == (r.flax_path[-1] == "kernel")


def test_unknown_variant_raises() -> None:

    with pytest.raises(ValueError, match=r"no declared weight layout for 'Transformer'; known variants: .*"
                                         r"MultiHeadAttentionWrapper"):
        rules_for("Transformer", {"d_in": 4})


# --------------------------------------------------------------------------- framework-free


JAX_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import numpy as np
import jax_attention.interop as ji
config = {"d_in": 4, "d_out": 2, "context_length": 3, "dropout": 0.0, "num_heads": 2,
          "qkv_bias": True, "out_proj": False}
rng = np.random.default_rng(0)
sd = {n: rng.standard_normal((2, 4) if n.endswith("weight") else (2,)).astype(np.float32)
      for n in ("W_query.weight", "W_query.bias", "W_key.weight", "W_key.bias",
                "W_value.weight", "W_value.bias")}
state = ji.state_from_torch(sd, "MultiHeadAttention", config)
back = ji.state_to_torch(state, "MultiHeadAttention", config)
assert sorted(back) == sorted(sd)
assert all(np.array_equal(back[k], sd[k]) for k in sd)
assert sys.modules["torch"] is None
print("ok", len(back))
"""

TORCH_WITHOUT_JAX = """
import sys
for name in ("jax", "jaxlib", "flax"):
    sys.modules[name] = None  # any import of them now raises ImportError
import numpy as np
import torch_attention.interop as ti
config = {"d_in": 4, "d_out": 2, "context_length": 3, "dropout": 0.0, "num_heads": 2,
          "qkv_bias": True, "out_proj": False}
rng = np.random.default_rng(0)
flat = {(n, leaf): rng.standard_normal((4, 2) if leaf == "kernel" else (2,)).astype(np.float32)
        for n in ("W_query", "W_key", "W_value") for leaf in ("kernel", "bias")}
sd = ti.state_dict_from_flax(flat, "MultiHeadAttention", config)
again = ti.state_dict_to_flax(sd, "MultiHeadAttention", config)
assert all(np.array_equal(again[k], flat[k]) for k in flat) and sorted(again) == sorted(flat)
import torch_attention
m = torch_attention.MultiHeadAttention(**config)
ti.load_flax_arrays(m, flat)
assert np.array_equal(m.W_key.weight.detach().numpy(), flat[("W_key", "kernel")].T)
assert sys.modules["jax"] is None and sys.modules["flax"] is None
print("ok", len(sd))
"""


@pytest.fixture(scope="module")
def blocked_runs() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Both subprocesses, started together (each spends ~2 s importing its framework)."""
    procs = {
        name: subprocess.Popen([sys.executable, "-W", "error", "-c", script],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, script in (("jax", JAX_WITHOUT_TORCH), ("torch", TORCH_WITHOUT_JAX))
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _result(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@needs_jax
def test_jax_interop_works_without_torch(blocked_runs: dict[str, subprocess.Popen[str]]) -> None:
    code, out, err = _result(blocked_runs["jax"])
    assert code == 0, err
    assert out.strip() == "ok 6"


@needs_torch
def test_torch_interop_works_without_jax(blocked_runs: dict[str, subprocess.Popen[str]]) -> None:
    code, out, err = _result(blocked_runs["torch"])
    assert code == 0, err
    assert out.strip() == "ok 6"


@needs_both
@pytest.mark.parametrize("loader", ["torch", "flax"])
def test_a_value_that_cannot_convert_writes_nothing(loader):
    """Names and shapes right, one array not floating point: TypeError naming it, the
    same text from either framework's loader, and no parameter written before it."""
    import torch
    from flax import nnx

    import jax_attention
    import torch_attention

    config = dict(d_in=4, d_out=4, context_length=3, dropout=0.0, num_heads=2, qkv_bias=True)
    source = torch_attention.MultiHeadAttention(**config)
    state = {k: np.ones(tuple(v.shape), np.float32) for k, v in source.state_dict().items()}
    state["W_value.weight"] = np.full((4, 4), "a")
    if loader == "torch":
        module = torch_attention.MultiHeadAttention(**config)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        with pytest.raises(TypeError) as error:
            torch_attention.interop.load_torch_state_dict(module, state)
        assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    else:
        module = jax_attention.MultiHeadAttention(**config, rngs=nnx.Rngs(0))
        before = jax_attention.interop.torch_state_dict(module)
        with pytest.raises(TypeError) as error:
            jax_attention.interop.load_torch_state_dict(module, state)
        after = jax_attention.interop.torch_state_dict(module)
        assert all(np.array_equal(before[k], after[k]) for k in before)
    assert str(error.value) == (
        "the PyTorch state_dict holds arrays that are not floating point:\n  W_value.weight: dtype <U1"
    )
