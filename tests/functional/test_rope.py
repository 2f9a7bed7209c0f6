"""Rotary position embeddings: ``attention_spec.rope`` (``RopeConfig``, ``inv_freq``,
``rope_from_hf``) and each twin's ``apply_rope``.

- the inverse frequencies of every scaling against its published formula, written out
  here (float64, 1e-12), and against ``transformers``' own ``ROPE_INIT_FUNCTIONS`` for
  the same config (float32: transformers computes them in float32, a few ulps off);
- ``apply_rope`` against ``transformers``' rotary embeddings and ``apply_rotary_pos_emb``
  (Llama's ``rotate_half``, GPT-NeoX's partial rotary, GPT-J's ``rotate_every_two``,
  DeepSeek-V3's ``rope_interleave``, Phi-3's LongRoPE, YaRN, dynamic NTK) at positions
  400..1500 with per-example offsets;
- against a float64 NumPy oracle of the rotation, twin against twin, gradients, jit,
  the errors (one text, both twins), and ``rope_from_hf`` on tiny real configs.

Precision.  Both twins round the float64 frequencies to float32 (correctly rounded);
transformers computes them in float32 arithmetic, 1 to 5 ulps away in 40% of the entries
(measured, torch 2.13 / transformers 5.24).  At position p an angle then differs by
``p * |d inv_freq|`` (about 4e-4 at p = 1500), more than any float32 tolerance: the
comparisons with transformers' own frequencies are held to that bound, computed from the
two sets of frequencies, and with transformers given our float32 frequencies (its
``inv_freq`` buffer) the outputs agree to the float32 parity tolerance (bit for bit on
PyTorch).  The float32 oracle takes the angles as float32 computes them
(``fl32(fl32(p) * fl32(inv_freq))``) and does the rest in float64.
"""

from __future__ import annotations

import importlib
import math
import pathlib
import re
from typing import Any

import numpy as np
import pytest

from attention_spec.rope import RopeConfig, inv_freq, rope_from_hf
from parity_tests.tolerances import GRAD_PARITY, ORACLE, PARITY
from tests.support import needs_both, needs_jax, needs_torch

HEAD_DIM = 16
EPS32 = 2.0**-24

# One configuration per scaling (and layout, partial rotary), small enough for tiny heads.
CONFIGS: dict[str, RopeConfig] = {
    "default": RopeConfig(theta=10000.0),
    "theta-1e6": RopeConfig(theta=1_000_000.0),
    "interleaved": RopeConfig(layout="interleaved"),
    "partial-0.25": RopeConfig(partial_rotary_factor=0.25),
    "rotary_dim-6-interleaved": RopeConfig(rotary_dim=6, layout="interleaved"),
    "linear": RopeConfig(scaling="linear", factor=4.0),
    "dynamic": RopeConfig(scaling="dynamic", factor=2.0, original_max_position_embeddings=512),
    "llama3": RopeConfig(
        theta=500000.0,
        scaling="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
    ),
    "yarn": RopeConfig(scaling="yarn", factor=4.0, original_max_position_embeddings=256),
    "yarn-mscale": RopeConfig(
        scaling="yarn",
        factor=40.0,
        original_max_position_embeddings=128,
        beta_fast=16.0,
        beta_slow=2.0,
        mscale=1.0,
        mscale_all_dim=0.707,
        layout="interleaved",
    ),
    "longrope": RopeConfig(
        scaling="longrope",
        short_factor=(1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0),
        long_factor=(1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0),
        original_max_position_embeddings=512,
        factor=8.0,
    ),
}


# ----------------------------------------------------------------------------------
# The published formulas, written out
# ----------------------------------------------------------------------------------


def formula_inv_freq(c: RopeConfig, head_dim: int, seq_len: int | None = None) -> tuple[list[float], float]:
    """Each scaling's inverse frequencies, one dimension at a time, as published: RoPE (Su
    et al.), position interpolation (Chen et al.), dynamic NTK (bloc97 / emozilla), Llama
    3.1's ``apply_scaling`` (Meta's llama-models), YaRN's reference code (Peng et al.),
    LongRoPE (Ding et al., Phi-3)."""
    if c.rotary_dim is not None:
        d = c.rotary_dim
    elif c.partial_rotary_factor is not None:
        d = int(head_dim * c.partial_rotary_factor)
    else:
        d = head_dim
    base = c.theta
    if c.scaling == "dynamic":
        l0 = c.original_max_position_embeddings
        length = max(seq_len or l0, l0)
        base = base * ((c.factor * length / l0) - (c.factor - 1)) ** (d / (d - 2))
    theta = [base ** (-2 * i / d) for i in range(d // 2)]
    if c.scaling == "linear":
        return [t / c.factor for t in theta], 1.0
    if c.scaling == "llama3":
        old, lo, hi = c.original_max_position_embeddings, c.low_freq_factor, c.high_freq_factor
        out = []
        for t in theta:
            wavelen = 2 * math.pi / t
            if wavelen < old / hi:
                out.append(t)
            elif wavelen > old / lo:
                out.append(t / c.factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * t / c.factor + smooth * t)
        return out, 1.0
    if c.scaling == "yarn":
        l0, s = c.original_max_position_embeddings, c.factor
        fast, slow = c.beta_fast or 32, c.beta_slow or 1

        def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times in l0
            return d * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(c.theta))

        low, high = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), d - 1)
        if c.mscale and c.mscale_all_dim:
            mscale = (0.1 * c.mscale * math.log(s) + 1) / (0.1 * c.mscale_all_dim * math.log(s) + 1)
        else:
            mscale = 0.1 * math.log(s) + 1
        out = []
        for i, t in enumerate(theta):
            gamma = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
            out.append(t * (1 - gamma) + (t / s) * gamma)
        return out, mscale
    if c.scaling == "longrope":
        l0 = c.original_max_position_embeddings
        lam = c.long_factor if seq_len is not None and seq_len > l0 else c.short_factor
        return [t / lam[i] for i, t in enumerate(theta)], math.sqrt(1 + math.log(c.factor) / math.log(l0))
    return theta, 1.0


@pytest.mark.parametrize("seq_len", [None, 100, 2000])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_inv_freq_is_the_published_formula(name: str, seq_len: int | None) -> None:
    config = CONFIGS[name]
    ours, factor = inv_freq(config, HEAD_DIM, seq_len)
    expected, expected_factor = formula_inv_freq(config, HEAD_DIM, seq_len)
    assert ours.dtype == np.float64 and ours.shape == (len(expected),)
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


def test_dynamic_and_longrope_change_beyond_the_original_length() -> None:
    for name in ("dynamic", "longrope"):
        short, _ = inv_freq(CONFIGS[name], HEAD_DIM, 512)
        long, _ = inv_freq(CONFIGS[name], HEAD_DIM, 513)
        np.testing.assert_array_equal(short, inv_freq(CONFIGS[name], HEAD_DIM)[0])
        assert np.all(long[1:] < short[1:]), name  # lower frequencies: longer wavelengths


def test_yarn_truncate_false_is_the_continuous_ramp() -> None:
    config = RopeConfig(scaling="yarn", factor=4.0, original_max_position_embeddings=256, yarn_truncate=False)
    d, l0 = HEAD_DIM, 256
    low = d * math.log(l0 / (32 * 2 * math.pi)) / (2 * math.log(10000.0))
    high = d * math.log(l0 / (1 * 2 * math.pi)) / (2 * math.log(10000.0))
    low, high = max(low, 0), min(high, d - 1)
    theta = [10000.0 ** (-2 * i / d) for i in range(d // 2)]
    gammas = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(d // 2)]
    expected = [t * (1 - g) + t / 4.0 * g for t, g in zip(theta, gammas, strict=True)]
    np.testing.assert_allclose(inv_freq(config, d)[0], expected, rtol=1e-12, atol=0)
    assert not np.allclose(expected, inv_freq(CONFIGS["yarn"], d)[0])


# ----------------------------------------------------------------------------------
# transformers' own frequencies and configs
# ----------------------------------------------------------------------------------


def _hf_llama(rope_parameters: dict[str, Any], **kwargs: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    kwargs.setdefault("max_position_embeddings", 1024)
    return transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_parameters=dict(rope_parameters),
        **kwargs,
    )


HF_CASES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 500000.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 10000.0,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "rope_theta": 10000.0,
    },
    "yarn-untruncated": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "truncate": False,
        "rope_theta": 10000.0,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0],
        "long_factor": [1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
        "original_max_position_embeddings": 256,
        "rope_theta": 10000.0,
    },
}


def _close_float32(ours: np.ndarray, theirs: np.ndarray) -> None:
    """float32 against float64: relative, PARITY's float32 rtol (the frequencies span
    decades, so an absolute tolerance would be meaningless for the small ones)."""
    np.testing.assert_allclose(ours, theirs, rtol=PARITY["float32"].rtol, atol=0)


@needs_torch
@pytest.mark.parametrize("seq_len", [None, 200, 1500])
@pytest.mark.parametrize("name", list(HF_CASES))
def test_inv_freq_matches_transformers_rope_init_functions(name: str, seq_len: int | None) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_llama(HF_CASES[name])
    theirs, their_factor = ROPE_INIT_FUNCTIONS[HF_CASES[name]["rope_type"]](hf, None, seq_len=seq_len)
    ours, factor = inv_freq(rope_from_hf(hf), HEAD_DIM, seq_len)
    _close_float32(ours, theirs.double().numpy())
    assert factor == pytest.approx(float(their_factor), rel=1e-12)


@needs_torch
def test_inv_freq_default_matches_transformers_default() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for theta in (10000.0, 500000.0, 1_000_000.0):
        hf = _hf_llama({"rope_type": "default", "rope_theta": theta})
        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
        _close_float32(inv_freq(rope_from_hf(hf), HEAD_DIM)[0], theirs.double().numpy())


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def test_rope_from_hf_on_real_configs() -> None:
    tf = _transformers()
    llama = tf.LlamaConfig(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rope_theta=500000.0,
        max_position_embeddings=131072,
    )
    assert rope_from_hf(llama) == RopeConfig(
        theta=500000.0,
        scaling="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert rope_from_hf(tf.Qwen2Config(rope_theta=1_000_000.0)) == RopeConfig(theta=1_000_000.0)
    assert rope_from_hf(tf.GPTNeoXConfig(rotary_pct=0.25)) == RopeConfig(partial_rotary_factor=0.25)
    assert rope_from_hf(tf.PhiConfig(partial_rotary_factor=0.4)) == RopeConfig(partial_rotary_factor=0.4)
    assert rope_from_hf(tf.GemmaConfig()) == RopeConfig(theta=10000.0)
    qwen_yarn = tf.Qwen2Config(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        max_position_embeddings=131072,
    )
    assert rope_from_hf(qwen_yarn) == RopeConfig(
        scaling="yarn", factor=4.0, original_max_position_embeddings=32768
    )
    assert rope_from_hf(tf.GPTJConfig(rotary_dim=16)) == RopeConfig(rotary_dim=16, layout="interleaved")
    assert rope_from_hf(tf.DeepseekV3Config()).layout == "interleaved"


def test_rope_from_hf_phi3_longrope_and_its_attention_factor() -> None:
    tf = _transformers()
    short, long = [1.0 + 0.1 * i for i in range(8)], [2.0 + i for i in range(8)]
    phi3 = tf.Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        original_max_position_embeddings=512,
        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long},
    )
    config = rope_from_hf(phi3)
    assert config == RopeConfig(
        scaling="longrope",
        short_factor=tuple(short),
        long_factor=tuple(long),
        original_max_position_embeddings=512,
        factor=8.0,  # max_position_embeddings / original, as transformers computes it
    )
    assert inv_freq(config, HEAD_DIM)[1] == pytest.approx(math.sqrt(1 + math.log(8.0) / math.log(512)))
    hash(config)  # the factor lists became tuples: hashable, static under jit


def test_rope_from_hf_gemma3_per_layer_type_and_refusals() -> None:
    tf = _transformers()
    gemma3 = tf.Gemma3TextConfig()
    assert rope_from_hf(gemma3, layer_type="sliding_attention") == RopeConfig(theta=10000.0)
    assert rope_from_hf(gemma3, layer_type="full_attention").theta == 1_000_000.0
    with pytest.raises(ValueError, match="per layer type"):
        rope_from_hf(gemma3)
    with pytest.raises(ValueError, match="one set of rope parameters"):
        rope_from_hf(tf.Qwen2Config(), layer_type="full_attention")

    class Axial:  # a rope_type this library does not have
        rope_parameters = {"rope_type": "axial", "rope_theta": 10000.0}

    with pytest.raises(ValueError, match=r"rope_type 'axial' is not supported \(supported: 'default'"):
        rope_from_hf(Axial())


def test_rope_from_hf_reads_old_style_attributes() -> None:
    """Duck-typed: a config of an older transformers (``rope_theta`` and ``rope_scaling``
    as attributes, the old ``type`` key) reads the same."""

    class Old:
        rope_theta = 20000.0
        rope_scaling = {"type": "linear", "factor": 2.0}
        rotary_pct = 0.5
        max_position_embeddings = 2048

    assert rope_from_hf(Old()) == RopeConfig(
        theta=20000.0, partial_rotary_factor=0.5, scaling="linear", factor=2.0
    )


@needs_both
def test_a_module_built_from_a_llama_config_with_partial_rotary_factor_turns_as_llama_does() -> None:
    """Issue 55, item 4: ``LlamaConfig(partial_rotary_factor=0.5)``'s layer turns the whole
    head (its rotary embedding ignores the factor), but ``rope_from_hf`` of the config
    turned half of it: a module built the documented way (``rope=rope_from_hf(config)``,
    the layer's weights loaded) was 8.9e-2 off ``LlamaAttention`` at positions 400..407.
    Now it follows the layer: the whole head turns, and the module and its Flax twin match
    the layer within float32 parity (transformers' float32 frequencies are a few ulps from
    ours: well inside it at these positions)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    import torch_attention
    from parity_tests import to_flax

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         partial_rotary_factor=0.5, attention_bias=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    llama = LlamaAttention(config, layer_idx=0).eval()
    rotary = LlamaRotaryEmbedding(config)
    assert 2 * rotary.inv_freq.numel() == 16  # the layer's rotary embedding: the whole head
    rope = rope_from_hf(config)
    assert rope == RopeConfig(theta=10000.0)
    ours = torch_attention.MultiHeadAttention(64, 64, None, 0.0, 4, num_kv_heads=2, out_bias=False, rope=rope)
    ours.load_state_dict({"W_query.weight": llama.q_proj.weight, "W_key.weight": llama.k_proj.weight,
                          "W_value.weight": llama.v_proj.weight, "out_proj.weight": llama.o_proj.weight})
    x = torch.randn(2, 8, 64)
    positions = torch.arange(400, 408)[None]
    causal = torch.full((8, 8), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = llama(x, position_embeddings=rotary(x, positions), attention_mask=causal)[0]
        got = ours(x, positions=positions)
    tol = PARITY["float32"]
    torch.testing.assert_close(got, want, rtol=tol.rtol, atol=tol.atol)
    got_flax = np.asarray(to_flax(ours)(x.numpy(), positions=positions.numpy()))
    np.testing.assert_allclose(got_flax, want.numpy(), rtol=tol.rtol, atol=tol.atol)


def test_rope_from_hf_follows_each_model_types_layer_on_partial_rotary_factor() -> None:
    """Which model types honour ``partial_rotary_factor`` (Phi, StableLM, GLM, Qwen3-Next,
    ...) and which turn the whole head whatever it says (Llama, Mistral, Qwen3, Gemma):
    ``rope_from_hf`` turns as many features as each family's own rotary embedding has
    frequencies for; a whole-head layer with a scaled rope type (which fails in
    transformers: its cos is half the head) and a model type in neither list are
    refused, naming ``partial_rotary_factor``; ``honours_partial=`` says it."""
    torch = pytest.importorskip("torch")
    tf = _transformers()

    def rotary_features(config: Any) -> int:  # as many as the family's rotary embedding turns
        module = importlib.import_module(type(config).__module__.replace("configuration_", "modeling_"))
        rotary = getattr(module, type(config).__name__.removesuffix("Config") + "RotaryEmbedding")
        return 2 * rotary(config).inv_freq.numel()

    heads: dict[str, Any] = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
    configs = [tf.LlamaConfig(**heads, partial_rotary_factor=0.5), tf.MistralConfig(**heads, partial_rotary_factor=0.5),
               tf.Qwen3Config(**heads, head_dim=16, partial_rotary_factor=0.5),
               tf.GemmaConfig(**heads, head_dim=16, partial_rotary_factor=0.5),
               tf.PhiConfig(**heads, partial_rotary_factor=0.5), tf.StableLmConfig(**heads, partial_rotary_factor=0.5),
               tf.GlmConfig(**heads, head_dim=16, partial_rotary_factor=0.5),
               tf.Qwen3NextConfig(**heads, head_dim=16, partial_rotary_factor=0.5)]
    with torch.device("cpu"):
        for config in configs:
            features = rotary_features(config)
            rope = rope_from_hf(config)
            assert rope.partial_rotary_factor == (0.5 if features == 8 else None), config.model_type
            assert features in (8, 16), config.model_type

    scaled = tf.LlamaConfig(partial_rotary_factor=0.5,
                            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5 with rope_type 'linear': the layer of "
                                         r"model_type 'llama' rotates the whole head"):
        rope_from_hf(scaled)
    assert rope_from_hf(scaled, honours_partial=True).partial_rotary_factor == 0.5

    class Unknown:  # a config of a family this library does not know
        model_type = "my_model"
        partial_rotary_factor = 0.5

    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5, but whether transformers' layer of "
                                         r"model_type 'my_model' turns"):
        rope_from_hf(Unknown())
    assert rope_from_hf(Unknown(), honours_partial=True) == RopeConfig(partial_rotary_factor=0.5)
    assert rope_from_hf(Unknown(), honours_partial=False) == RopeConfig()


def test_the_model_type_lists_agree_with_the_installed_transformers() -> None:
    """``PARTIAL_MODEL_TYPES`` / ``WHOLE_HEAD_MODEL_TYPES`` were read off transformers
    5.24's sources: a model type's ``compute_default_rope_parameters`` reads
    ``partial_rotary_factor`` or does not.  Each model type of either list whose sources
    the installed transformers has must still say what its list says."""
    tf = _transformers()
    from attention_spec.rope import PARTIAL_MODEL_TYPES, WHOLE_HEAD_MODEL_TYPES

    models = pathlib.Path(tf.__file__).parent / "models"
    default = re.compile(r"def compute_default_rope_parameters\((.*?)\n    @", re.S)
    model_type = re.compile(r'^    model_type\s*=\s*"([^"]+)"', re.M)
    seen, wrong = 0, []
    for folder in sorted(models.iterdir()):
        bodies = [m.group(1) for f in folder.glob("modeling_*.py") for m in default.finditer(f.read_text())]
        if not bodies:
            continue
        honours = {"partial_rotary_factor" in b for b in bodies}
        for name in {t for f in folder.glob("configuration_*.py") for t in model_type.findall(f.read_text())}:
            listed = True if name in PARTIAL_MODEL_TYPES else False if name in WHOLE_HEAD_MODEL_TYPES else None
            if listed is not None:
                seen += 1
                if honours != {listed}:
                    wrong.append(name)
    assert not wrong, f"these model types honour partial_rotary_factor otherwise than listed: {wrong}"
    assert seen >= 50  # the installed transformers has (most of) the listed families


# ----------------------------------------------------------------------------------
# The configuration's checks (framework-free) and the call's (both twins, one text)
# ----------------------------------------------------------------------------------

BAD_CONFIGS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"theta": -1.0}, ValueError, "rope theta must be a finite number > 0; got -1.0"),
    ({"theta": "big"}, TypeError, "rope theta must be a real number; got str 'big'"),
    ({"layout": "neox"}, ValueError, "rope layout must be one of 'half', 'interleaved'; got 'neox'"),
    (
        {"scaling": "ntk"},
        ValueError,
        "rope scaling must be one of None, 'linear', 'dynamic', 'llama3', 'yarn', 'longrope'; got 'ntk'",
    ),
    ({"scaling": "linear"}, ValueError, "rope scaling 'linear' needs factor"),
    ({"factor": 2.0}, ValueError, "rope scaling None does not take factor (it takes no parameters); got 2.0"),
    (
        {"scaling": "linear", "factor": 2.0, "beta_fast": 32.0},
        ValueError,
        "rope scaling 'linear' does not take beta_fast (it takes factor); got 32.0",
    ),
    (
        {"rotary_dim": 8, "partial_rotary_factor": 0.5},
        ValueError,
        "rope takes rotary_dim or partial_rotary_factor, not both; got 8 and 0.5",
    ),
    ({"partial_rotary_factor": 1.5}, ValueError, "rope partial_rotary_factor must be <= 1; got 1.5"),
    ({"rotary_dim": 0}, ValueError, "rope rotary_dim must be >= 1; got 0"),
    ({"rotary_dim": 4.0}, TypeError, "rope rotary_dim must be an int; got float 4.0"),
    (
        {
            "scaling": "llama3",
            "factor": 8.0,
            "low_freq_factor": 4.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8,
        },
        ValueError,
        "rope scaling 'llama3' needs high_freq_factor > low_freq_factor; got 1.0 and 4.0",
    ),
    (
        {
            "scaling": "longrope",
            "short_factor": (1.0,),
            "long_factor": (1.0, 2.0),
            "original_max_position_embeddings": 8,
        },
        ValueError,
        "rope short_factor and long_factor must have the same length; got 1 and 2",
    ),
    (
        {"scaling": "yarn", "factor": 0.0, "original_max_position_embeddings": 8},
        ValueError,
        "rope factor must be a finite number > 0; got 0.0",
    ),
    (
        {"yarn_truncate": False},
        ValueError,
        "rope yarn_truncate=False applies to scaling 'yarn' only; got scaling None",
    ),
]


@pytest.mark.parametrize(("fields", "error", "text"), BAD_CONFIGS)
def test_bad_configs_are_refused_when_built(
    fields: dict[str, Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(text)}$"):
        RopeConfig(**fields)


def test_config_is_hashable_and_frozen() -> None:
    a = RopeConfig(
        scaling="longrope",
        short_factor=[1.0, 2.0],
        long_factor=[3.0, 4.0],
        original_max_position_embeddings=8,
    )
    b = RopeConfig(
        scaling="longrope",
        short_factor=(1.0, 2.0),
        long_factor=(3.0, 4.0),
        original_max_position_embeddings=8,
    )
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.theta = 1.0  # type: ignore[misc]


# (x shape, positions shape, positions dtype, config, error, text): one text, both twins
BAD_CALLS: list[tuple[tuple[int, ...], tuple[int, ...], str, Any, type[Exception], str]] = [
    (
        (2, 5, 8),
        (2, 5),
        "int32",
        RopeConfig(),
        ValueError,
        "apply_rope expects x of shape (batch, heads, seq, head_dim); got shape (2, 5, 8)",
    ),
    (
        (2, 1, 5, 8),
        (2, 5),
        "float32",
        RopeConfig(),
        TypeError,
        "rope positions must be integers; got dtype float32",
    ),
    (
        (2, 1, 5, 8),
        (5,),
        "int32",
        RopeConfig(),
        ValueError,
        "rope positions must have shape (batch, seq) = (2, 5) (or (1, 5)); got shape (5,)",
    ),
    (
        (2, 1, 5, 8),
        (3, 5),
        "int32",
        RopeConfig(),
        ValueError,
        "rope positions must have shape (batch, seq) = (2, 5) (or (1, 5)); got shape (3, 5)",
    ),
    ((2, 1, 5, 8), (2, 5), "int32", {"theta": 1e4}, TypeError, "rope must be a RopeConfig; got dict"),
    (
        (2, 1, 5, 8),
        (2, 5),
        "int32",
        RopeConfig(rotary_dim=10),
        ValueError,
        "rope rotary_dim must be <= head_dim 8; got 10",
    ),
    (
        (2, 1, 5, 8),
        (2, 5),
        "int32",
        RopeConfig(rotary_dim=3),
        ValueError,
        "rope rotary dimension must be even and >= 2; got 3 (head_dim 8)",
    ),
    (
        (2, 1, 5, 6),
        (2, 5),
        "int32",
        RopeConfig(partial_rotary_factor=0.25),
        ValueError,
        "rope rotary dimension must be even and >= 2; got 1 (head_dim 6)",
    ),
    (
        (2, 1, 5, 8),
        (2, 5),
        "int32",
        RopeConfig(
            scaling="longrope", short_factor=(1.0,), long_factor=(1.0,), original_max_position_embeddings=8
        ),
        ValueError,
        "rope short_factor and long_factor need rotary_dim / 2 = 4 entries; got 1",
    ),
]


@needs_torch
@pytest.mark.parametrize(("x_shape", "p_shape", "p_dtype", "config", "error", "text"), BAD_CALLS)
def test_bad_calls_torch(
    x_shape: Any, p_shape: Any, p_dtype: str, config: Any, error: Any, text: str
) -> None:
    import torch

    from torch_attention.functional import apply_rope

    positions = torch.zeros(p_shape, dtype=getattr(torch, p_dtype))
    with pytest.raises(error, match=f"^{re.escape(text)}$"):
        apply_rope(torch.zeros(x_shape), positions, config)


@needs_jax
@pytest.mark.parametrize(("x_shape", "p_shape", "p_dtype", "config", "error", "text"), BAD_CALLS)
def test_bad_calls_jax(x_shape: Any, p_shape: Any, p_dtype: str, config: Any, error: Any, text: str) -> None:
    import jax.numpy as jnp

    from jax_attention.functional import apply_rope

    positions = jnp.zeros(p_shape, dtype=p_dtype)
    with pytest.raises(error, match=f"^{re.escape(text)}$"):
        apply_rope(jnp.zeros(x_shape), positions, config)


# ----------------------------------------------------------------------------------
# apply_rope: the float64 oracle, transformers' layers, twin against twin
# ----------------------------------------------------------------------------------

BATCH, HEADS, SEQ = 3, 2, 9


def make_inputs(seed: int = 0, head_dim: int = HEAD_DIM) -> tuple[np.ndarray, np.ndarray]:
    """x (B, H, T, D) float64 and positions (B, T) int64 beyond 400: each example starts
    at its own offset (400, 700, 1491), so positions reach 1499."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, HEADS, SEQ, head_dim))
    positions = np.array([400, 700, 1491])[:, None] + np.arange(SEQ)[None, :]
    return x, positions.astype(np.int64)


def oracle_rope(
    x: np.ndarray, positions: np.ndarray, config: RopeConfig, float32_angles: bool, seq_len: int | None = None
) -> np.ndarray:
    """The rotation in float64, pair by pair, as the definition reads.  With
    ``float32_angles`` the angles are those float32 computes (``fl32(fl32(p) *
    fl32(inv_freq))``), and cos and sin times the attention factor are rounded to float32,
    as the twins (and transformers) do; everything else is float64.  ``seq_len``: the
    length the dynamic and longrope scalings see (default: the largest position + 1)."""
    head_dim = x.shape[-1]
    freqs, factor = inv_freq(config, head_dim, seq_len or int(positions.max()) + 1)
    dim = 2 * len(freqs)
    if float32_angles:
        angles = (positions[..., None].astype(np.float32) * freqs.astype(np.float32)).astype(np.float64)
        cos = (np.cos(angles).astype(np.float32) * np.float32(factor)).astype(np.float64)
        sin = (np.sin(angles).astype(np.float32) * np.float32(factor)).astype(np.float64)
    else:
        angles = positions[..., None].astype(np.float64) * freqs
        cos, sin = np.cos(angles) * factor, np.sin(angles) * factor
    out = x.copy()
    for i in range(dim // 2):
        a, b = (i, i + dim // 2) if config.layout == "half" else (2 * i, 2 * i + 1)
        c, s = cos[:, None, :, i], sin[:, None, :, i]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def run_torch(x: np.ndarray, positions: np.ndarray, config: RopeConfig, dtype: str = "float32") -> np.ndarray:
    import torch

    from torch_attention.functional import apply_rope

    xt = torch.as_tensor(x).to(getattr(torch, dtype))
    return apply_rope(xt, torch.as_tensor(positions), config).double().numpy()


def run_jax(x: np.ndarray, positions: np.ndarray, config: RopeConfig, dtype: str = "float32") -> np.ndarray:
    import jax.numpy as jnp

    from jax_attention.functional import apply_rope

    out = apply_rope(jnp.asarray(x, dtype=dtype), jnp.asarray(positions, dtype=jnp.int32), config)
    return np.asarray(out.astype(jnp.float32), dtype=np.float64)


def assert_within(actual: np.ndarray, expected: np.ndarray, tol: Any) -> None:
    np.testing.assert_allclose(actual, expected, rtol=tol.rtol, atol=tol.atol)


@needs_both
@pytest.mark.parametrize("name", list(CONFIGS))
def test_both_twins_against_the_float64_oracle_and_each_other(name: str) -> None:
    config = CONFIGS[name]
    x, positions = make_inputs()
    x32 = x.astype(np.float32).astype(np.float64)  # the inputs as float32 sees them
    expected = oracle_rope(x32, positions, config, float32_angles=True)
    pt, jx = run_torch(x, positions, config), run_jax(x, positions, config)
    assert_within(pt, expected, ORACLE["float32"])
    assert_within(jx, expected, ORACLE["float32"])
    assert_within(jx, pt, PARITY["float32"])
    # The float32 angles themselves: within p * eps32 of the exact ones (the whole gap).
    exact = oracle_rope(x32, positions, config, float32_angles=False)
    pair_norm = np.sqrt(2) * np.abs(x32).max()
    bound = pair_norm * inv_freq(config, HEAD_DIM, 1500)[1] * 2 * (1500 * EPS32 + EPS32) + 1e-6
    assert np.abs(pt - exact).max() <= bound
    if config.rotary_dim or config.partial_rotary_factor:  # the features past rotary_dim pass through
        dim = config.rotary_dim or int(HEAD_DIM * config.partial_rotary_factor)
        np.testing.assert_array_equal(pt[..., dim:], x32[..., dim:])


@needs_both
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["default", "interleaved", "yarn", "partial-0.25"])
def test_half_precision_twin_against_twin(name: str, dtype: str) -> None:
    x, positions = make_inputs(1)
    pt, jx = run_torch(x, positions, CONFIGS[name], dtype), run_jax(x, positions, CONFIGS[name], dtype)
    assert_within(jx, pt, PARITY[dtype])
    assert_within(pt, oracle_rope(x, positions, CONFIGS[name], float32_angles=False), ORACLE[dtype])


@needs_both
def test_float64_is_float64_throughout() -> None:
    """float64 x: angles, cos and sin in float64 (transformers would round them to
    float32); both twins against the exact rotation at the float64 tolerance."""
    import jax
    import jax.numpy as jnp
    import torch

    from jax_attention.functional import apply_rope as jax_rope
    from torch_attention.functional import apply_rope as torch_rope

    x, positions = make_inputs(2)
    for config in (CONFIGS["llama3"], CONFIGS["yarn-mscale"], CONFIGS["partial-0.25"]):
        exact = oracle_rope(x, positions, config, float32_angles=False)
        pt = torch_rope(torch.as_tensor(x), torch.as_tensor(positions), config).numpy()
        with jax.enable_x64(True):
            jx = np.asarray(jax_rope(jnp.asarray(x), jnp.asarray(positions), config))
        assert_within(pt, exact, ORACLE["float64"])
        assert_within(jx, exact, ORACLE["float64"])


@needs_both
def test_shared_positions_broadcast_over_the_batch() -> None:
    x, _ = make_inputs(3)
    shared = (np.arange(SEQ) + 1000)[None, :]
    for run in (run_torch, run_jax):
        np.testing.assert_array_equal(
            run(x, shared, CONFIGS["default"]), run(x, np.repeat(shared, BATCH, axis=0), CONFIGS["default"])
        )


@needs_both
def test_an_empty_sequence_passes_through() -> None:
    x, positions = np.zeros((2, 1, 0, HEAD_DIM)), np.zeros((2, 0), dtype=np.int64)
    for name in ("default", "dynamic", "longrope"):
        assert run_torch(x, positions, CONFIGS[name]).shape == x.shape
        assert run_jax(x, positions, CONFIGS[name]).shape == x.shape


# transformers' layers ---------------------------------------------------------------


def hf_bound(
    x: np.ndarray, positions: np.ndarray, ours: np.ndarray, theirs: np.ndarray, factor: float
) -> float:
    """How far two float32 rotations may be apart when their float32 frequencies differ
    (transformers' by a few ulps): each angle by ``p * |d inv_freq|`` plus the float32
    rounding of both products, times the pair's length and the attention factor; plus the
    float32 parity tolerance."""
    ours32 = ours.astype(np.float32).astype(np.float64)
    p = float(positions.max())
    d_angle = p * np.abs(ours32 - theirs).max() + 2 * EPS32 * p * ours32.max()
    return float(np.sqrt(2) * np.abs(x).max() * factor * d_angle + PARITY["float32"].atol)


def twins_against(
    x: np.ndarray, positions: np.ndarray, config: RopeConfig, expected: np.ndarray, atol: float
) -> None:
    for out in (run_torch(x, positions, config), run_jax(x, positions, config)):
        np.testing.assert_allclose(out, expected, rtol=0, atol=atol)


@needs_both
@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "yarn-mscale", "dynamic"])
def test_llama_rotary_embedding_and_apply_rotary_pos_emb(name: str) -> None:
    """transformers' Llama rotary embedding (every rope_type) and ``apply_rotary_pos_emb``
    (``rotate_half``): with its own frequencies within the bound of their difference; with
    ours in its buffer to the float32 parity tolerance (PyTorch: bit for bit).  Dynamic NTK
    is recomputed by transformers for the positions seen (1500 > 1024)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = {"rope_type": "default", "rope_theta": 10000.0} if name == "default" else HF_CASES[name]
    hf = _hf_llama(params)
    config = rope_from_hf(hf)
    x, positions = make_inputs(4)
    xt, pt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(positions)
    x32 = xt.double().numpy()
    rotary = LlamaRotaryEmbedding(hf)
    cos, sin = rotary(xt, pt)
    theirs = apply_rotary_pos_emb(xt, xt, cos, sin)[0].double().numpy()
    ours, factor = inv_freq(config, HEAD_DIM, int(positions.max()) + 1)
    their_freqs = rotary.inv_freq.double().numpy()
    twins_against(x, positions, config, theirs, hf_bound(x32, positions, ours, their_freqs, factor))
    if name != "dynamic":  # (its forward recomputes the buffer)
        rotary.inv_freq = torch.as_tensor(ours, dtype=torch.float32)
        cos, sin = rotary(xt, pt)
        same = apply_rotary_pos_emb(xt, xt, cos, sin)[0].double().numpy()
        np.testing.assert_array_equal(run_torch(x, positions, config), same)
        assert_within(run_jax(x, positions, config), same, PARITY["float32"])


@needs_both
def test_gpt_neox_partial_rotary() -> None:
    """GPT-NeoX's rotary_pct: the first quarter of each head turns, the rest passes."""
    import torch
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    hf = GPTNeoXConfig(hidden_size=128, num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=2048)
    config = rope_from_hf(hf)
    x, positions = make_inputs(5, head_dim=32)
    xt, pt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(positions)
    rotary = GPTNeoXRotaryEmbedding(hf)
    ours, factor = inv_freq(config, 32)
    assert ours.shape == (4,)
    cos, sin = rotary(xt, pt)
    theirs = apply_rotary_pos_emb(xt, xt, cos, sin)[0].double().numpy()
    twins_against(
        x, positions, config, theirs, hf_bound(x, positions, ours, rotary.inv_freq.double().numpy(), factor)
    )
    rotary.inv_freq = torch.as_tensor(ours, dtype=torch.float32)
    cos, sin = rotary(xt, pt)
    np.testing.assert_array_equal(
        run_torch(x, positions, config), apply_rotary_pos_emb(xt, xt, cos, sin)[0].numpy()
    )


@needs_both
def test_phi_partial_rotary_factor() -> None:
    """Phi's partial_rotary_factor (its attention turns ``q[..., :rotary_ndims]`` and
    passes the rest): head_dim 80 x 0.4 = 32 features turn."""
    import torch
    from transformers import PhiConfig
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding, apply_rotary_pos_emb

    hf = PhiConfig(
        hidden_size=160, num_attention_heads=2, partial_rotary_factor=0.4, max_position_embeddings=2048
    )
    config = rope_from_hf(hf)
    assert config == RopeConfig(partial_rotary_factor=0.4)
    x, positions = make_inputs(14, head_dim=80)
    xt, pt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(positions)
    rotary = PhiRotaryEmbedding(hf)
    ours, factor = inv_freq(config, 80)
    assert ours.shape == (16,)
    rotary.inv_freq = torch.as_tensor(ours, dtype=torch.float32)
    cos, sin = rotary(xt, pt)
    rot = apply_rotary_pos_emb(xt[..., :32], xt[..., :32], cos, sin)[0]
    theirs = torch.cat((rot, xt[..., 32:]), dim=-1).double().numpy()
    np.testing.assert_array_equal(run_torch(x, positions, config), theirs)
    assert_within(run_jax(x, positions, config), theirs, PARITY["float32"])


@needs_both
def test_gptj_rotate_every_two() -> None:
    """GPT-J's interleaved pairs (``rotate_every_two``) on its partial ``rotary_dim``;
    its tensors are (B, T, H, D) there."""
    import torch
    from transformers import GPTJConfig
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    hf = GPTJConfig(n_embd=64, n_head=4, rotary_dim=8, n_positions=2048)
    config = rope_from_hf(hf)
    assert config == RopeConfig(rotary_dim=8, layout="interleaved")
    x, positions = make_inputs(6)
    xt, pt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(positions)
    sincos = create_sinusoidal_positions(2048, 8)[pt]
    sin, cos = torch.split(sincos, 4, dim=-1)
    rot = xt[..., :8].transpose(1, 2)  # (B, T, H, 8)
    theirs = (
        torch.cat((apply_rotary_pos_emb(rot, sin, cos).transpose(1, 2), xt[..., 8:]), dim=-1).double().numpy()
    )
    their_freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.int64) / 8))
    ours, factor = inv_freq(config, HEAD_DIM)
    twins_against(
        x, positions, config, theirs, hf_bound(x, positions, ours, their_freqs.double().numpy(), factor)
    )


@needs_both
def test_deepseek_v3_rope_interleave() -> None:
    """DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` turns the same pairs and returns
    them de-interleaved (evens' results, then odds'): ours keeps the layout, so it equals
    theirs after that permutation, and q . k is the same."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    hf = DeepseekV3Config(
        qk_rope_head_dim=HEAD_DIM, hidden_size=64, num_attention_heads=4, max_position_embeddings=2048
    )
    config = rope_from_hf(hf)
    assert config.layout == "interleaved" and config.scaling is None
    x, positions = make_inputs(7)
    xt, pt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(positions)
    rotary = DeepseekV3RotaryEmbedding(hf)
    ours, _ = inv_freq(config, HEAD_DIM)
    rotary.inv_freq = torch.as_tensor(ours, dtype=torch.float32)
    cos, sin = rotary(xt, pt)
    theirs = apply_rotary_pos_emb_interleave(xt, xt, cos, sin)[0].double().numpy()
    deinterleave = np.concatenate((np.arange(0, HEAD_DIM, 2), np.arange(1, HEAD_DIM, 2)))
    for out in (run_torch(x, positions, config), run_jax(x, positions, config)):
        assert_within(out[..., deinterleave], theirs, PARITY["float32"])


@needs_both
@pytest.mark.parametrize("last_position", [300, 1499])
def test_phi3_longrope(last_position: int) -> None:
    """Phi-3's LongRoPE: short factors up to the original 512 positions, long ones beyond,
    the attention factor on cos and sin."""
    import torch
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    short, long = HF_CASES["longrope"]["short_factor"], HF_CASES["longrope"]["long_factor"]
    hf = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        original_max_position_embeddings=512,
        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long},
    )
    config = rope_from_hf(hf)
    x, positions = make_inputs(8)
    positions = positions - positions.max() + last_position
    xt, pt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(positions)
    rotary = Phi3RotaryEmbedding(hf)
    cos, sin = rotary(xt, pt)
    theirs = apply_rotary_pos_emb(xt, xt, cos, sin)[0].double().numpy()
    ours, factor = inv_freq(config, HEAD_DIM, last_position + 1)
    assert factor == pytest.approx(rotary.attention_scaling)
    bound = hf_bound(x, positions, ours, rotary.inv_freq.double().numpy(), factor)
    twins_against(x, positions, config, theirs, bound)


# gradients and jit -------------------------------------------------------------------


@needs_both
@pytest.mark.parametrize("name", ["default", "interleaved", "partial-0.25", "yarn-mscale", "longrope"])
def test_gradients_torch_autograd_against_jax_grad(name: str) -> None:
    """d sum(g * rope(x)) / dx: the inverse rotation of g (the float64 oracle at negated
    angles), both twins, to the float32 gradient tolerance."""
    import jax
    import jax.numpy as jnp
    import torch

    from jax_attention.functional import apply_rope as jax_rope
    from torch_attention.functional import apply_rope as torch_rope

    config = CONFIGS[name]
    x, positions = make_inputs(9)
    g = np.random.default_rng(10).standard_normal(x.shape)
    xt = torch.as_tensor(x, dtype=torch.float32).requires_grad_(True)
    (
        torch_rope(xt, torch.as_tensor(positions), config) * torch.as_tensor(g, dtype=torch.float32)
    ).sum().backward()
    pt_grad = xt.grad.double().numpy()

    def loss(xj: Any) -> Any:
        return jnp.sum(
            jax_rope(xj, jnp.asarray(positions, dtype=jnp.int32), config) * jnp.asarray(g, dtype=jnp.float32)
        )

    jx_grad = np.asarray(jax.grad(loss)(jnp.asarray(x, dtype=jnp.float32)), dtype=np.float64)
    # The transpose of a rotation by a turns by -a: the oracle at negated positions (the
    # frequencies those of the positions seen), times the attention factor once more.
    g32 = g.astype(np.float32).astype(np.float64)
    expected = oracle_rope(g32, -positions, config, float32_angles=True, seq_len=int(positions.max()) + 1)
    tol = GRAD_PARITY["float32"]
    atol = tol.atol + tol.rtol * np.abs(pt_grad).max()  # normwise
    np.testing.assert_allclose(jx_grad, pt_grad, rtol=0, atol=atol)
    np.testing.assert_allclose(pt_grad, expected, rtol=0, atol=atol)


@needs_jax
@pytest.mark.parametrize("name", list(CONFIGS))
def test_jit_with_static_config_equals_eager(name: str) -> None:
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import apply_rope

    config = CONFIGS[name]
    x, positions = make_inputs(11)
    xj, pj = jnp.asarray(x, dtype=jnp.float32), jnp.asarray(positions, dtype=jnp.int32)
    eager = apply_rope(xj, pj, config)
    seq_len = int(positions.max()) + 1 if config.scaling == "dynamic" else None
    jitted = jax.jit(apply_rope, static_argnames=("config", "seq_len"))(
        xj, pj, config=config, seq_len=seq_len
    )
    # not bit for bit: under jit XLA fuses the rotation and its cos / sin (2 ulps measured)
    assert_within(np.asarray(jitted), np.asarray(eager), PARITY["float32"])


@needs_jax
def test_jit_picks_dynamic_and_longrope_frequencies_from_traced_positions() -> None:
    """Issue 40, probe item 1: under jit, with traced positions and no ``seq_len``, dynamic
    NTK was refused ("pass seq_len=", which neither a module call nor a ring takes).  Now
    both scalings read the length from the traced positions: at or below the original
    length (512 here) the very frequencies of an eager call, bit for bit; past it,
    dynamic's are computed from the traced length in float32 (as transformers computes
    them), within PARITY of the eager float64 ones rounded once."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import apply_rope

    x, positions = make_inputs(12)
    xj = jnp.asarray(x, dtype=jnp.float32)
    rope = jax.jit(apply_rope, static_argnames=("config", "seq_len"))
    for name in ("dynamic", "longrope"):
        for last in (200, 1499):  # within the original length, then past it
            shifted = jnp.asarray(positions - positions.max() + last, dtype=jnp.int32)
            jitted, eager = rope(xj, shifted, config=CONFIGS[name]), apply_rope(xj, shifted, CONFIGS[name])
            assert_within(np.asarray(jitted), np.asarray(eager), PARITY["float32"])
    from jax_attention._rope import _freqs

    short = jnp.asarray(positions - positions.max() + 200, dtype=jnp.int32)
    traced = jax.jit(lambda p: _freqs(p, CONFIGS["dynamic"], HEAD_DIM, None, np.float32)[0])(short)
    np.testing.assert_array_equal(np.asarray(traced), inv_freq(CONFIGS["dynamic"], HEAD_DIM)[0].astype(np.float32))


@needs_torch
def test_cached_decoding_equals_the_full_forward_for_dynamic_rope_only_within_the_original_length() -> None:
    """Issue 40, probe item 9 (docs/training-stack.md says so now): decoding step by step
    with a cache equals the full forward, but for dynamic NTK (and longrope) once positions
    pass ``original_max_position_embeddings`` (8 here): the full forward turns every key
    by the frequencies of the whole length, a step its new key by those of its own, and
    the keys cached keep theirs (transformers decodes so too)."""
    import torch

    import torch_attention as ta

    rope = RopeConfig(scaling="dynamic", factor=2.0, original_max_position_embeddings=8)
    torch.manual_seed(0)
    module = ta.MultiHeadAttention(16, 16, None, 0.0, 2, rope=rope).eval()
    gaps = {}
    for length in (8, 12):
        x = torch.randn(1, length, 16)
        with torch.no_grad():
            out, cache = module(x[:, :4], cache=module.init_cache(1, length))
            steps = [out] + [module(x[:, t : t + 1], cache=cache)[0] for t in range(4, length)]
            gaps[length] = float((torch.cat(steps, 1) - module(x)).abs().max())
    assert gaps[8] < 1e-6 and gaps[12] > 1e-3, gaps


@needs_both
def test_a_module_and_a_ring_with_dynamic_rope_compile() -> None:
    """Issue 40, probe item 1: ``MultiHeadAttention(rope=dynamic)`` under ``nnx.jit`` and
    ``ring_attention(rope=dynamic)`` under ``jax.jit`` were refused at any positions.  Both
    compile, and agree with the eager call, at positions within and past the original length."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention as ja
    from jax_attention.parallel import ring_attention

    rope = CONFIGS["dynamic"]
    module = ja.MultiHeadAttention(16, 16, 8, 0.0, 2, rope=rope, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 16)), jnp.float32)
    step = nnx.jit(lambda m, x, p: m(x, positions=p))
    for start in (0, 600):
        positions = jnp.arange(start, start + 8)[None]
        assert_within(np.asarray(step(module, x, positions)), np.asarray(module(x, positions=positions)),
                      PARITY["float32"])
    from jax.sharding import Mesh

    q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 2, 8, 8)), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    for start in (0, 600):
        positions = jnp.arange(start, start + 8)[None]

        def ring(q: Any, p: Any) -> Any:
            return ring_attention(q, q, q, mesh=mesh, axis_name="seq", causal=True, rope=rope, positions=p)

        assert_within(np.asarray(jax.jit(ring)(q, positions)), np.asarray(ring(q, positions)), PARITY["float32"])


@needs_torch
@pytest.mark.slow  # the quick tier shows this feature in another test
def test_torch_compile_equals_eager() -> None:
    import torch

    from torch_attention.functional import apply_rope

    x, positions = make_inputs(13)
    xt, pt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(positions)
    config = CONFIGS["yarn"]
    compiled = torch.compile(lambda a, b: apply_rope(a, b, config))
    torch.testing.assert_close(
        compiled(xt, pt), apply_rope(xt, pt, config), rtol=0, atol=PARITY["float32"].atol
    )
