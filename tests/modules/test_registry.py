"""The variant registry and the config every module holds (``module.spec``), and the
module-level behaviour that rests on them: one dtype rule, the wrapper's per-head keys,
loading a full Flax state, initialising without a dropout stream, no context cap.

The registry is the single description of a variant, so every test here compares it
with what the modules of *both* frameworks actually are: their parameters (names,
shapes, creation order), their constructor signatures, their config.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import numpy as np
import pytest

from attention_spec.interop.conversion import LAYOUTS, VARIANTS, rules_for
from attention_spec.registry import REGISTRY, REQUIRED, AttentionConfig, make_config, variant
from tests.support import needs_both, needs_jax, needs_torch

D_IN, WIDTH, CONTEXT = 8, 4, 6

# Small constructor keywords per variant (d_in != width: a missing transpose would show).
CONFIGS: dict[str, dict[str, Any]] = {
    "SimplifiedAttention": {},
    "SelfAttention_v1": {"d_in": D_IN, "d_out": WIDTH},
    "SelfAttention_v2": {"d_in": D_IN, "d_out": WIDTH, "qkv_bias": True},
    "CausalAttention": {"d_in": D_IN, "d_out": WIDTH, "context_length": CONTEXT, "dropout": 0.5, "qkv_bias": True},
    "Head": {"d_in": D_IN, "head_size": WIDTH, "context_length": CONTEXT, "dropout": 0.5},
    "MultiHeadAttentionWrapper": {"d_in": D_IN, "d_out": WIDTH, "context_length": CONTEXT, "dropout": 0.5,
                                  "num_heads": 2, "qkv_bias": True},
    "MultiHeadAttention": {"d_in": D_IN, "d_out": WIDTH, "context_length": CONTEXT, "dropout": 0.5,
                           "num_heads": 2, "qkv_bias": True},
    "MultiHeadLatentAttention": {"d_in": D_IN, "num_heads": 2, "kv_lora_rank": 6, "qk_nope_head_dim": 3,
                                 "qk_rope_head_dim": 2, "v_head_dim": 5, "q_lora_rank": 7, "context_length": CONTEXT,
                                 "dropout": 0.5, "attention_bias": True},
}
# The framework's own constructor keywords, outside the registry's signature.
FRAMEWORK_KEYWORDS = {"self", "dtype", "param_dtype", "device", "precision", "rngs"}


def torch_module(name: str, **overrides: Any) -> Any:
    import torch

    import torch_attention

    torch.manual_seed(0)
    return getattr(torch_attention, name)(**{**CONFIGS[name], **overrides})


def flax_module(name: str, seed: int = 0, **overrides: Any) -> Any:
    from flax import nnx

    import jax_attention

    return getattr(jax_attention, name)(**{**CONFIGS[name], **overrides}, rngs=nnx.Rngs(seed))


def x_array(shape: tuple[int, ...] = (2, 5, D_IN), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------- the registry


def test_registry_lists_every_variant_once() -> None:
    assert VARIANTS == tuple(REGISTRY) and len(set(VARIANTS)) == 8
    assert set(LAYOUTS) == set(VARIANTS) - {"MultiHeadAttentionWrapper"}
    with pytest.raises(ValueError, match="no declared weight layout for 'Nope'; known variants: CausalAttention"):
        variant("Nope")


def test_registry_declares_the_tutorials_defaults() -> None:
    assert variant("Head").defaults["scale"] == 1.0  # seed 002: unscaled
    assert variant("Head").defaults["dropout"] == 0.0
    assert variant("CausalAttention").defaults["causal"] is True
    assert variant("SelfAttention_v2").defaults["causal"] is False
    assert variant("MultiHeadAttention").defaults["out_proj"] is True
    assert variant("MultiHeadAttention").positional == (
        "d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias")
    assert [p.name for p in variant("Head").projections] == ["key", "query", "value"]  # seed 002's order
    assert {name: d.has_dropout for name, d in REGISTRY.items()} == {
        "SimplifiedAttention": False, "SelfAttention_v1": False, "SelfAttention_v2": False,
        "CausalAttention": True, "Head": True, "MultiHeadAttentionWrapper": True, "MultiHeadAttention": True,
        "MultiHeadLatentAttention": True,
    }
    # has_dropout and the "dropout" option go together
    assert all(d.has_dropout == ("dropout" in d.options) for d in REGISTRY.values())


@pytest.mark.parametrize("fw", [pytest.param("torch", marks=needs_torch), pytest.param("flax", marks=needs_jax)])
@pytest.mark.parametrize("name", VARIANTS)
def test_constructor_signature_is_the_registry_s(fw: str, name: str) -> None:
    """Positional names in order, keyword-only options, defaults: as declared."""
    package = __import__("torch_attention" if fw == "torch" else "jax_attention")
    params = [p for p in inspect.signature(getattr(package, name).__init__).parameters.values()
              if p.name not in FRAMEWORK_KEYWORDS]
    decl = variant(name)
    assert [p.name for p in params] == list(decl.options)
    for p, option in zip(params, decl.signature, strict=True):
        assert (p.kind is inspect.Parameter.KEYWORD_ONLY) == option.keyword_only, p.name
        expected = inspect.Parameter.empty if option.default is REQUIRED else option.default
        assert p.default == expected, p.name


@needs_torch
@pytest.mark.parametrize("out_proj", [True, False])
@pytest.mark.parametrize("name", VARIANTS)
def test_declared_parameters_are_the_torch_module_s(name: str, out_proj: bool) -> None:
    """Names, shapes and creation order (named_parameters is in creation order, which
    torch's RNG follows) equal the registry's, via the conversion rules."""
    overrides = {"out_proj": out_proj} if name == "MultiHeadAttention" else {}
    module = torch_module(name, **overrides)
    rules = rules_for(name, module.config)
    assert [(r.torch_name, r.torch_shape) for r in rules] == [
        (k, tuple(v.shape)) for k, v in module.named_parameters()]
    spec = module.spec
    if name != "MultiHeadAttentionWrapper":
        declared = [p.name for p in spec.projections()]
        created = list(dict.fromkeys(k.split(".")[0] for k, _ in module.named_parameters()))
        norms = [name for name, _ in spec.latent_norms()]  # latent attention's RMSNorms, after
        assert created == declared + norms  # in the declared order
        for proj in spec.projections():
            layer = getattr(module, proj.name)
            has_bias = getattr(layer, "bias", None) is not None
            assert has_bias == proj.has_bias(spec), proj.name
        if name == "MultiHeadAttention" and not out_proj:
            assert module.out_proj is None


@needs_jax
@pytest.mark.parametrize("out_proj", [True, False])
@pytest.mark.parametrize("name", VARIANTS)
def test_declared_parameters_are_the_flax_module_s(name: str, out_proj: bool) -> None:
    from flax import nnx

    overrides = {"out_proj": out_proj} if name == "MultiHeadAttention" else {}
    module = flax_module(name, **overrides)
    params = {tuple(p): v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    rules = rules_for(name, module.config)
    assert {r.flax_path: r.flax_shape for r in rules} == params
    assert len(rules) == len(params)


@needs_jax
def test_flax_initial_weights_are_jax_random_draws_of_their_shapes() -> None:
    """The JAX twin draws its initial weights flat (one compiled program per power of two,
    not per shape); the numbers are those of the draw of each shape itself, and a
    projection's lie in nn.Linear's +-1/sqrt(fan_in)."""
    import jax
    import jax.numpy as jnp

    from jax_attention._projections import draw

    cases = [(jax.random.uniform, (3, 5, 7), jnp.float32, -0.5, 0.5), (jax.random.uniform, (33, 31), jnp.float32),
             (jax.random.uniform, (0, 3), jnp.float32), (jax.random.normal, (8, 4), jnp.bfloat16)]

    @jax.jit  # one program for all: each draw compiled on its own took 0.6 s
    def both(key: Any) -> Any:
        return [(draw(sample, key, shape, dtype, *bounds), sample(key, shape, dtype, *bounds))
                for sample, shape, dtype, *bounds in cases]

    for (got, want), case in zip(both(jax.random.key(7)), cases, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=str(case[:3]))
    # and the flat draw is the one taken under the default PRNG: 33 x 31 = 1023 numbers as 1024
    assert "1024" in str(jax.make_jaxpr(lambda k: draw(jax.random.uniform, k, (33, 31), jnp.float32))(jax.random.key(7)))
    kernel = flax_module("MultiHeadAttention").W_query.kernel.get_value()
    assert kernel.shape == (D_IN, WIDTH) and float(jnp.abs(kernel).max()) <= 1 / np.sqrt(D_IN)
    assert float(jnp.abs(kernel).max()) > 0.5 / np.sqrt(D_IN)


# --------------------------------------------------------------------------- the config


def test_config_is_frozen_hashable_and_validated() -> None:
    spec = make_config("MultiHeadAttention", CONFIGS["MultiHeadAttention"])
    assert isinstance(spec, AttentionConfig)
    assert spec == make_config("MultiHeadAttention", dict(CONFIGS["MultiHeadAttention"]))
    assert hash(spec) == hash(make_config("MultiHeadAttention", dict(CONFIGS["MultiHeadAttention"])))
    assert spec != dataclasses.replace(spec, causal=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.causal = False  # type: ignore[misc]
    assert spec.head_dim == WIDTH // 2 and spec.width == WIDTH and spec.has_dropout
    assert [p.name for p in spec.projections()] == ["W_query", "W_key", "W_value", "out_proj"]
    assert [p.name for p in dataclasses.replace(spec, out_proj=False).projections()] == [
        "W_query", "W_key", "W_value"]
    # validation, the same texts as attention_spec.options
    with pytest.raises(ValueError, match=re.escape("d_out must be divisible by num_heads; got d_out=4, num_heads=3")):
        dataclasses.replace(spec, num_heads=3)
    with pytest.raises(ValueError, match=re.escape("dropout must be in [0, 1); got 1.0")):
        dataclasses.replace(spec, dropout=1.0)
    with pytest.raises(TypeError, match=re.escape("qkv_bias must be a bool; got int 1")):
        dataclasses.replace(spec, qkv_bias=1)
    with pytest.raises(ValueError, match="SelfAttention_v1 has no option 'dropout'"):
        AttentionConfig("SelfAttention_v1", d_in=2, d_out=2, dropout=0.5)
    with pytest.raises(TypeError, match="CausalAttention\\(\\) missing required argument: 'dropout'"):
        make_config("CausalAttention", {"d_in": 2, "d_out": 2, "context_length": 3})


def test_config_holds_its_options_in_records_by_subject() -> None:
    """Each option lives in one record (widths, layers, scoring, qk, latent) and reads by
    name through it; a record replaces as a whole, an option changes alone, and a
    normalised value (the window's tuple) is written into its record."""
    from attention_spec.registry import LatentWidths, Layers, QKTransforms, Scoring, Widths

    records = {"widths": Widths, "layers": Layers, "scoring": Scoring, "qk": QKTransforms, "latent": LatentWidths}
    assert [f.name for f in dataclasses.fields(AttentionConfig)] == ["variant", *records]
    names = [f.name for record in records.values() for f in dataclasses.fields(record)]
    assert len(names) == len(set(names)), "an option in two records"
    spec = make_config("MultiHeadAttention", {**CONFIGS["MultiHeadAttention"], "window": [3, 0], "softcap": 5.0})
    for subject, record in records.items():
        held = getattr(spec, subject)
        assert isinstance(held, record)
        for f in dataclasses.fields(record):
            assert getattr(spec, f.name) == getattr(held, f.name)
    assert spec.scoring.window == (3, 0) and spec.widths.num_heads == 2 and spec.latent == LatentWidths()
    changed = dataclasses.replace(spec, causal=False)
    assert changed.scoring == dataclasses.replace(spec.scoring, causal=False) and changed.widths is spec.widths
    assert dataclasses.replace(spec, scoring=changed.scoring) == changed
    assert set(spec.options()) <= {*names, "head_dim"}  # every constructor keyword is a field of a record
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        AttentionConfig("MultiHeadAttention", heads=2)
    # values are normalised: an int rate is a float, so equal configs hash equal
    assert make_config("Head", {"d_in": 2, "head_size": 2, "context_length": 3, "dropout": 0}).dropout == 0.0
    # the fixed scale of the parameterless variant
    assert make_config("SimplifiedAttention", {}).scale == 1.0


@needs_both
@pytest.mark.parametrize("name", VARIANTS)
def test_spec_and_config_agree_across_frameworks(name: str) -> None:
    import torch_attention

    tm, fm = torch_module(name), flax_module(name)
    assert tm.spec == fm.spec and hash(tm.spec) == hash(fm.spec)
    assert tm.config == fm.config
    assert list(tm.config) == list(variant(name).options)  # every constructor keyword, in order
    assert type(tm.config) is dict
    assert getattr(torch_attention, name)(**tm.config).spec == tm.spec  # cls(**config) rebuilds


@needs_jax
@pytest.mark.parametrize("name", ["MultiHeadAttention", "SelfAttention_v1", "MultiHeadAttentionWrapper"])
def test_spec_is_static_under_nnx_jit(name: str) -> None:
    """``spec`` is part of the graphdef (static, hashed), not of the state (traced): a
    second call with new values does not retrace."""
    import chex
    import jax.numpy as jnp
    from flax import nnx

    module = flax_module(name)
    module.eval()
    graphdef, state = nnx.split(module)
    leaves = nnx.to_flat_state(state)
    assert all("spec" not in path for path, _ in leaves)
    assert module.spec in [v.value for _, v in graphdef.attributes if hasattr(v, "value")]

    chex.clear_trace_counter()

    @nnx.jit
    @chex.assert_max_traces(n=1)
    def forward(m: Any, x: Any) -> Any:
        return m(x)

    a = forward(module, jnp.asarray(x_array(seed=1)))
    b = forward(module, jnp.asarray(x_array(seed=2)))  # would raise if it retraced
    assert not np.array_equal(np.asarray(a), np.asarray(b))


@needs_both
@pytest.mark.parametrize("name", ["MultiHeadAttention", "CausalAttention", "SelfAttention_v2"])
def test_per_call_implementation_override(name: str) -> None:
    """``implementation=`` at the call takes that path for that call only; a bad name is
    refused before any work, with the same text in both frameworks."""
    import jax.numpy as jnp
    import torch

    tm, fm = torch_module(name, implementation="reference").eval(), flax_module(name, implementation="reference")
    fm.eval()
    x = x_array()
    for impl in ("blockwise", "auto", "reference"):
        t_out = tm(torch.from_numpy(x), implementation=impl)
        np.testing.assert_allclose(t_out.detach().numpy(), tm(torch.from_numpy(x)).detach().numpy(),
                                   rtol=1e-5, atol=1e-6)
        f_out = fm(jnp.asarray(x), implementation=impl)
        np.testing.assert_allclose(np.asarray(f_out), np.asarray(fm(jnp.asarray(x))), rtol=1e-5, atol=1e-6)
    assert tm.spec.implementation == fm.spec.implementation == "reference"  # unchanged
    texts = []
    for module, arr in ((tm, torch.from_numpy(x)), (fm, jnp.asarray(x))):
        with pytest.raises(ValueError) as err:
            module(arr, implementation="magic")
        texts.append(str(err.value))
    assert texts[0] == texts[1] and "implementation must be one of" in texts[0]
    # an explicit path that cannot honour an option says so
    for module, arr in ((tm, torch.from_numpy(x)), (fm, jnp.asarray(x))):
        with pytest.raises(ValueError, match="implementation='fused' cannot honour return_weights=True"):
            module(arr, return_weights=True, implementation="fused")


@needs_both
def test_wrapper_checks_a_call_once() -> None:
    """The wrapper validates the call; its heads run on the checked input (no second check)."""
    import jax.numpy as jnp
    import torch

    import attention_spec.planning as planning
    import jax_attention._base as jb
    import torch_attention._base as tb

    for base, module, x in ((tb, torch_module("MultiHeadAttentionWrapper", num_heads=3).eval(),
                             torch.from_numpy(x_array())),
                            (jb, flax_module("MultiHeadAttentionWrapper", num_heads=3), jnp.asarray(x_array()))):
        calls = []
        original = planning.check_input  # both twins' calls are planned by plan_call

        def counting(*args: Any, original: Any = original, calls: list[int] = calls, **kwargs: Any) -> Any:
            calls.append(1)
            return original(*args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(planning, "check_input", counting)
            out = module(x, deterministic=True) if base is jb else module(x)
        assert tuple(out.shape) == (2, 5, 3 * WIDTH)
        assert len(calls) == 1


# --------------------------------------------------------------------------- dtypes


@needs_both
@pytest.mark.parametrize("module_dtype,x_dtype", [("float16", "float32"), ("float32", "bfloat16"),
                                                  ("bfloat16", "float16")])
@pytest.mark.parametrize("name", ["SelfAttention_v1", "MultiHeadAttention", "MultiHeadAttentionWrapper"])
def test_mixed_dtypes_one_rule_one_message(name: str, module_dtype: str, x_dtype: str) -> None:
    """x in another dtype than the module computes in: TypeError, same text in both
    frameworks, raised before any work (nothing projected, no parameter touched)."""
    import jax.numpy as jnp
    import torch

    import jax_attention
    import torch_attention

    tm = torch_module(name).to(getattr(torch, module_dtype))
    fm = flax_module(name, param_dtype=getattr(jnp, module_dtype))
    x = x_array()
    texts = []
    for module, arr, lib in ((tm, torch.from_numpy(x).to(getattr(torch, x_dtype)), torch_attention),
                             (fm, jnp.asarray(x).astype(getattr(jnp, x_dtype)), jax_attention)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lib._base.AttentionModule, "_project", lambda *a: pytest.fail("work started"))
            with pytest.raises(TypeError) as err:
                module(arr)
        texts.append(str(err.value))
    assert texts[0] == texts[1] == (
        f"x has dtype {x_dtype} but the module computes in {module_dtype}; cast x first")


@needs_both
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_simplified_attention_computes_in_the_input_dtype(dtype: str) -> None:
    import jax.numpy as jnp
    import torch

    import jax_attention
    import torch_attention

    x = x_array((2, 5, 3))
    t_out = torch_attention.SimplifiedAttention()(torch.from_numpy(x).to(getattr(torch, dtype)))
    f_out = jax_attention.SimplifiedAttention()(jnp.asarray(x).astype(getattr(jnp, dtype)))
    assert str(t_out.dtype) == f"torch.{dtype}" and str(f_out.dtype) == dtype


@needs_jax
def test_flax_dtype_is_computation_param_dtype_is_storage() -> None:
    """As Flax's own modules: ``param_dtype`` stores, ``dtype`` computes (None: as stored)."""
    import jax.numpy as jnp
    from flax import nnx

    x = jnp.asarray(x_array())
    stored = flax_module("MultiHeadAttention", param_dtype=jnp.bfloat16)
    assert {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(stored, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    assert stored(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    mixed = flax_module("MultiHeadAttention", dtype=jnp.bfloat16)  # float32 storage, bfloat16 compute
    assert {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(mixed, nnx.Param))} == {jnp.dtype(jnp.float32)}
    mixed.eval()
    out = mixed(x.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="x has dtype float32 but the module computes in bfloat16; cast x first"):
        mixed(x)
    # the same weights computed in float32 are close to the bfloat16 computation
    full = flax_module("MultiHeadAttention")  # same seed, same float32 weights
    full.eval()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(full(x)), atol=5e-2)
    # the raw-matrix variant follows the same rule
    v1 = flax_module("SelfAttention_v1", dtype=jnp.float16)
    assert v1.W_query.get_value().dtype == jnp.float32 and v1(x.astype(jnp.float16)).dtype == jnp.float16


# --------------------------------------------------------------------------- dropout and keys


@needs_jax
@pytest.mark.parametrize("key_kind", ["raw-key", "Rngs"])
def test_wrapper_heads_draw_different_masks(key_kind: str) -> None:
    """With every head holding the same weights, only dropout can tell heads apart: a raw
    JAX key at the call gives each head its own mask (folded with the head index)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    module = flax_module("MultiHeadAttentionWrapper")
    nnx.update(module.heads[1], nnx.state(module.heads[0], nnx.Param))  # identical heads
    module.train()
    x = jnp.asarray(x_array())

    def rngs() -> Any:
        return jax.random.key(3) if key_kind == "raw-key" else nnx.Rngs(dropout=3)

    _, weights = module(x, return_weights=True, rngs=rngs())
    weights = np.asarray(weights)  # (B, 2, T, T)
    module.eval()
    _, clean = module(x, return_weights=True)
    clean = np.asarray(clean)
    np.testing.assert_array_equal(clean[:, 0], clean[:, 1])  # the heads are identical...
    dropped = weights == 0
    assert not np.array_equal(dropped[:, 0], dropped[:, 1])  # ...but drop differently
    module.train()
    _, again = module(x, return_weights=True, rngs=rngs())
    np.testing.assert_array_equal(np.asarray(again), weights)  # the same key: the same masks


@needs_both
@pytest.mark.parametrize("name", ["CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention"])
def test_load_flax_arrays_accepts_a_full_state(name: str) -> None:
    """``nnx.state(module)`` holds the dropout streams' RngKey/RngCount besides the
    parameters: both loaders take it, skipping the non-parameters."""
    import jax
    import torch
    from flax import nnx

    import jax_attention
    import torch_attention

    source = flax_module(name, seed=1)
    full = nnx.state(source)
    assert any(isinstance(v, nnx.RngKey) for _, v in nnx.to_flat_state(full))  # the case at hand
    target = flax_module(name, seed=2)
    counts_before = jax.tree.map(np.asarray, nnx.state(target, nnx.RngCount))
    jax_attention.interop.load_flax_arrays(target, full)
    expected = jax_attention.interop.torch_state_dict(source)
    got = jax_attention.interop.torch_state_dict(target)
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)
    # the target's own dropout streams are its own still
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), counts_before,
                                     nnx.state(target, nnx.RngCount)))
    tm = torch_module(name)
    torch_attention.interop.load_flax_arrays(tm, full)
    assert all(torch.equal(tm.state_dict()[k], torch.from_numpy(np.array(expected[k]))) for k in expected)
    assert jax_attention.interop.state_to_torch(full, name, source.config).keys() == expected.keys()


@needs_jax
@pytest.mark.parametrize("name", ["CausalAttention", "Head", "MultiHeadAttentionWrapper", "MultiHeadAttention"])
def test_rate_zero_needs_no_dropout_stream(name: str) -> None:
    """Dropout 0: no 'dropout' stream taken, so ``nnx.bridge.to_linen(...).init`` works
    with a params key alone (as for nnx.MultiHeadAttention); with dropout > 0 the stream
    is taken at construction."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention

    config = {**CONFIGS[name], "dropout": 0.0}
    module = getattr(jax_attention, name)(**config, rngs=nnx.Rngs(params=0))  # no dropout stream given
    assert not any(isinstance(v, nnx.RngState) for _, v in nnx.to_flat_state(nnx.state(module)))
    assert module.spec.dropout == 0.0
    x = jnp.asarray(x_array())
    bridged = nnx.bridge.to_linen(getattr(jax_attention, name), **config)
    variables = bridged.init(jax.random.key(0), x)  # one key: the params stream only
    y = bridged.apply(variables, x)
    assert y.shape == module(x).shape and np.isfinite(np.asarray(y)).all()
    # and with a rate, the module owns a stream (from rngs' dropout or default key)
    with_rate = flax_module(name)
    assert any(isinstance(v, nnx.RngKey) for _, v in nnx.to_flat_state(nnx.state(with_rate)))


@needs_both
@pytest.mark.parametrize("name", ["SelfAttention_v1", "SimplifiedAttention"])
def test_dropout_mask_without_dropout_same_text(name: str) -> None:
    """A variant without dropout refuses a dropout_mask (its rate is 0) with one text."""
    import jax.numpy as jnp
    import torch

    shape = (2, 5, D_IN) if name != "SimplifiedAttention" else (2, 5, 3)
    keep = np.ones((5, 5), bool)
    texts = []
    for module, x, k in ((torch_module(name), torch.from_numpy(x_array(shape)), torch.from_numpy(keep)),
                         (flax_module(name), jnp.asarray(x_array(shape)), jnp.asarray(keep))):
        with pytest.raises(ValueError) as err:
            module(x, dropout_mask=k)
        texts.append(str(err.value))
    assert texts[0] == texts[1] and "dropout rate is 0.0" in texts[0]


# --------------------------------------------------------------------------- context_length=None


@needs_both
@pytest.mark.parametrize("name", ["CausalAttention", "Head", "MultiHeadAttentionWrapper", "MultiHeadAttention"])
def test_context_length_none_means_no_cap(name: str) -> None:
    import jax.numpy as jnp
    import torch

    from parity_tests import to_flax

    tm = torch_module(name, context_length=None).eval()
    assert tm.config["context_length"] is None and tm.context_length is None
    x = x_array((1, 3 * CONTEXT, D_IN))  # longer than any cap used elsewhere here
    t_out = tm(torch.from_numpy(x)).detach().numpy()
    fm = to_flax(tm)
    assert fm.config == tm.config
    np.testing.assert_allclose(np.asarray(fm(jnp.asarray(x))), t_out, rtol=1e-5, atol=1e-6)
    capped = torch_module(name)
    with pytest.raises(ValueError, match=f"sequence length {3 * CONTEXT} exceeds context_length {CONTEXT}"):
        capped(torch.from_numpy(x))


@needs_both
@pytest.mark.parametrize("name", ["MultiHeadAttention", "MultiHeadAttentionWrapper", "Head"])
def test_explicit_path_refusal_leaves_random_state_alone(name: str) -> None:
    """Training mode, dropout > 0, ``implementation="blockwise"`` at the call: the path
    cannot draw dropout and refuses, with one text, before any random stream advances
    (the Flax module's own stream included: the key is drawn only after the refusal)."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    def stream_state(module: Any) -> list[np.ndarray]:
        leaves = jax.tree.leaves(nnx.state(module, nnx.RngState))
        return [np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
                for a in leaves]

    tm, fm = torch_module(name).train(), flax_module(name)
    fm.train()
    x = x_array()
    torch_rng, flax_rng = torch.get_rng_state(), stream_state(fm)
    assert flax_rng  # the module has a stream that a premature draw would advance
    texts = []
    for module, arr in ((tm, torch.from_numpy(x)), (fm, jnp.asarray(x))):
        with pytest.raises(ValueError) as err:
            module(arr, implementation="blockwise")
        texts.append(str(err.value))
    assert texts[0] == texts[1] == (
        "implementation='blockwise' cannot honour dropout in training mode; "
        "use implementation='reference' or 'auto'")
    assert torch.equal(torch.get_rng_state(), torch_rng)
    assert all(np.array_equal(a, b) for a, b in zip(stream_state(fm), flax_rng, strict=True))
    fm(jnp.asarray(x))  # a good call does draw: the check above can fail
    assert not all(np.array_equal(a, b) for a, b in zip(stream_state(fm), flax_rng, strict=True))
