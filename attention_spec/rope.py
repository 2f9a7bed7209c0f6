"""Rotary position embeddings (RoPE), framework-free: the configuration both twins share
(``RopeConfig``), its checks with the one text of each error (``check_rope``,
``check_rope_call``), the inverse frequencies of every scaling in float64
(``inv_freq``), and ``rope_from_hf``, which reads a ``transformers`` config.

A rotation of the first ``rotary_dim`` features of each head (the rest pass through):
feature pair ``i`` at position ``p`` turns by the angle ``p * inv_freq[i]``.  The pairs
are ``(x[i], x[i + rotary_dim / 2])`` in the layout ``"half"`` (Llama, GPT-NeoX:
``rotate_half``) and ``(x[2i], x[2i + 1])`` in the layout ``"interleaved"`` (GPT-J's
``rotate_every_two``, DeepSeek's ``rope_interleave``).

The scalings, as ``transformers.modeling_rope_utils`` computes them (``rope_type``):

- ``None``: ``inv_freq[i] = theta ** (-2i / rotary_dim)``;
- ``"linear"`` (position interpolation): ``inv_freq / factor``;
- ``"dynamic"`` (dynamic NTK): the base grows with the sequence length seen,
  ``theta * (factor * L / L0 - (factor - 1)) ** (d / (d - 2))`` with
  ``L = max(seq_len, L0)`` and ``L0 = original_max_position_embeddings``;
- ``"llama3"``: low frequencies divided by ``factor``, high ones kept, a smooth ramp
  between (``low_freq_factor``, ``high_freq_factor``);
- ``"yarn"``: a ramp between interpolated and extrapolated frequencies over the
  dimensions between ``beta_fast`` and ``beta_slow`` rotations, and an attention factor
  (``0.1 ln(factor) + 1``, or the ratio of ``mscale`` / ``mscale_all_dim``'s) that
  scales cos and sin;
- ``"longrope"``: one rescale factor per frequency, ``short_factor`` up to
  ``original_max_position_embeddings`` positions and ``long_factor`` beyond, and the
  attention factor ``sqrt(1 + ln(factor) / ln(L0))``.

``rope_from_hf`` also reads transformers' ``"proportional"`` rope (Gemma 4's global
layers) as fixed frequencies (``inv_freq``): the whole head turns in halves, its first
``int(partial_rotary_factor * head_dim / 2)`` pairs at ``theta ** (-2i / head_dim)``, the
others at frequency 0 (they never turn).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_spec.options import _is_int, _is_real

LAYOUTS = ("half", "interleaved")
SCALINGS = (None, "linear", "dynamic", "llama3", "yarn", "longrope")

# The parameters each scaling takes, and those of them it needs.
_TAKES: dict[str | None, tuple[str, ...]] = {
    None: (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
    ),
    "longrope": (
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "factor",
        "attention_factor",
    ),
}
_NEEDS: dict[str | None, tuple[str, ...]] = {
    None: (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": _TAKES["llama3"],
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
_SCALING_PARAMETERS = tuple(dict.fromkeys(p for ps in _TAKES.values() for p in ps))


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """How q and k are rotated: frozen and hashable (static under ``jax.jit``); checked
    when built (``check_rope``).

    ``theta``: the base.  ``rotary_dim`` (a number of features) or
    ``partial_rotary_factor`` (a fraction of ``head_dim``, rounded down as
    ``int(head_dim * factor)``): how many leading features turn; neither = all.
    ``layout``: ``"half"`` or ``"interleaved"``.  ``scaling`` and its parameters: see the
    module docstring; a parameter that the scaling does not take must stay None.
    ``yarn_truncate``: YaRN's ``truncate`` (round the ramp's bounds to whole dimensions).
    ``inv_freq``: the frequencies themselves, ``rotary_dim / 2`` numbers > 0 (or 0: a pair
    that never turns, as proportional rope's past its fraction), to use instead of the
    scaling's (the attention factor still comes from the scaling): a
    ported layer's own, which ``transformers`` computes in float32 arithmetic a few ulps
    from the float64 formula rounded once (4e-4 apart at position 1500).  Configuration,
    not state: the numbers travel with the module's config to its twin, and no dtype
    cast of a module rounds them.  Not with the dynamic and longrope scalings, whose
    frequencies follow the sequence length.
    """

    theta: float = 10000.0
    rotary_dim: int | None = None
    partial_rotary_factor: float | None = None
    layout: str = "half"
    scaling: str | None = None
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    yarn_truncate: bool = True
    inv_freq: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor", "inv_freq"):
            value = getattr(self, name)
            if isinstance(value, (list, np.ndarray)):  # lists from a config: hashable tuples
                object.__setattr__(self, name, tuple(float(v) for v in value))
        check_rope(self)


def rope_from_mapping(fields: Mapping[str, Any]) -> RopeConfig:
    """A ``RopeConfig`` from its fields as a mapping (a JSON object: ``{"theta": 500000.0,
    "scaling": "llama3", ...}``, lists for the tuples), checked as when built.  Raises
    ValueError naming any field that ``RopeConfig`` has not."""
    known = [f.name for f in dataclasses.fields(RopeConfig)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"rope has no field {', '.join(map(repr, unknown))}; its fields: {', '.join(known)}")
    return RopeConfig(**fields)


def rope_to_mapping(config: RopeConfig) -> dict[str, Any]:
    """The JSON form of a ``RopeConfig``: its fields that differ from the defaults, tuples
    as lists (``{"theta": 500000.0, "scaling": "llama3", ...}``); ``rope_from_mapping``
    of it (or of ``json.loads(json.dumps(it))``: Python's JSON keeps every float) is
    ``config`` again.  Raises TypeError for anything but a ``RopeConfig``."""
    if not isinstance(config, RopeConfig):
        raise TypeError(f"rope_to_mapping takes a RopeConfig; got {type(config).__name__}")
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(RopeConfig):
        value = getattr(config, field.name)
        if value != field.default:
            fields[field.name] = list(value) if isinstance(value, tuple) else value
    return fields


def _positive_real(name: str, value: Any) -> None:
    if not _is_real(value):
        raise TypeError(f"rope {name} must be a real number; got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"rope {name} must be a finite number > 0; got {value!r}")


def _positive_int(name: str, value: Any) -> None:
    if not _is_int(value):
        raise TypeError(f"rope {name} must be an int; got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"rope {name} must be >= 1; got {value!r}")


def _check_factors(name: str, value: Any, *, zeros: bool = False) -> None:
    """A non-empty tuple of finite positive numbers (``zeros``: or 0, a pair that never
    turns: proportional rope's frequencies past its fraction)."""
    if not isinstance(value, tuple) or not value:
        raise TypeError(f"rope {name} must be a non-empty list or tuple of numbers; got {value!r}")
    for v in value:
        (_nonnegative_real if zeros else _positive_real)(name + " entries", v)


def _nonnegative_real(name: str, value: Any) -> None:
    if not _is_real(value):
        raise TypeError(f"rope {name} must be a real number; got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"rope {name} must be a finite number >= 0; got {value!r}")


def _check_scaling(config: RopeConfig) -> None:
    scaling = config.scaling
    if scaling not in SCALINGS:
        options = ", ".join(repr(s) for s in SCALINGS)
        raise ValueError(f"rope scaling must be one of {options}; got {scaling!r}")
    takes = _TAKES[scaling]
    for name in _SCALING_PARAMETERS:
        value = getattr(config, name)
        if value is not None and name not in takes:
            allowed = ", ".join(takes) or "no parameters"
            raise ValueError(
                f"rope scaling {scaling!r} does not take {name} (it takes {allowed}); got {value!r}"
            )
        if value is None and name in _NEEDS[scaling]:
            raise ValueError(f"rope scaling {scaling!r} needs {name}")
    if not isinstance(config.yarn_truncate, bool):
        raise TypeError(f"rope yarn_truncate must be a bool; got {config.yarn_truncate!r}")
    if not config.yarn_truncate and scaling != "yarn":
        raise ValueError(f"rope yarn_truncate=False applies to scaling 'yarn' only; got scaling {scaling!r}")
    for name in takes:
        value = getattr(config, name)
        if value is None:
            continue
        if name == "original_max_position_embeddings":
            _positive_int(name, value)
        elif name in ("short_factor", "long_factor"):
            _check_factors(name, value)
        else:
            _positive_real(name, value)
    if scaling == "llama3" and not config.high_freq_factor > config.low_freq_factor:  # type: ignore[operator]
        raise ValueError(
            "rope scaling 'llama3' needs high_freq_factor > low_freq_factor; got "
            f"{config.high_freq_factor!r} and {config.low_freq_factor!r}"
        )
    if scaling == "longrope" and len(config.short_factor) != len(config.long_factor):  # type: ignore[arg-type]
        raise ValueError(
            "rope short_factor and long_factor must have the same length; got "
            f"{len(config.short_factor)} and {len(config.long_factor)}"  # type: ignore[arg-type]
        )


def check_rope(config: Any, head_dim: int | None = None) -> RopeConfig:
    """Checks a RoPE configuration (and, given ``head_dim``, that its rotary dimension
    fits the heads); returns it.  Raises TypeError / ValueError with the one text both
    twins share."""
    if not isinstance(config, RopeConfig):
        raise TypeError(f"rope must be a RopeConfig; got {type(config).__name__}")
    _positive_real("theta", config.theta)
    if config.layout not in LAYOUTS:
        raise ValueError(f"rope layout must be one of 'half', 'interleaved'; got {config.layout!r}")
    if config.rotary_dim is not None and config.partial_rotary_factor is not None:
        raise ValueError(
            "rope takes rotary_dim or partial_rotary_factor, not both; got "
            f"{config.rotary_dim!r} and {config.partial_rotary_factor!r}"
        )
    if config.rotary_dim is not None:
        _positive_int("rotary_dim", config.rotary_dim)
    if config.partial_rotary_factor is not None:
        _positive_real("partial_rotary_factor", config.partial_rotary_factor)
        if config.partial_rotary_factor > 1:
            raise ValueError(f"rope partial_rotary_factor must be <= 1; got {config.partial_rotary_factor!r}")
    _check_scaling(config)
    if config.inv_freq is not None:
        _check_factors("inv_freq", config.inv_freq, zeros=True)
        if needs_seq_len(config):
            raise ValueError(
                f"rope inv_freq cannot be fixed with scaling {config.scaling!r}: its frequencies follow the "
                "sequence length"
            )
    if head_dim is not None:
        rotary_dim(config, head_dim)
    return config


def rotary_dim(config: RopeConfig, head_dim: int) -> int:
    """How many leading features of a head of ``head_dim`` turn: even, >= 2, <= head_dim
    (and, for longrope, twice the number of rescale factors)."""
    _positive_int("head_dim", head_dim)
    if config.rotary_dim is not None:
        dim = int(config.rotary_dim)
    elif config.partial_rotary_factor is not None:
        dim = int(head_dim * config.partial_rotary_factor)
    else:
        dim = int(head_dim)
    if dim > head_dim:
        raise ValueError(f"rope rotary_dim must be <= head_dim {head_dim}; got {dim}")
    if dim < 2 or dim % 2:
        raise ValueError(f"rope rotary dimension must be even and >= 2; got {dim} (head_dim {head_dim})")
    if config.short_factor is not None and len(config.short_factor) != dim // 2:
        raise ValueError(
            f"rope short_factor and long_factor need rotary_dim / 2 = {dim // 2} entries; "
            f"got {len(config.short_factor)}"
        )
    if config.inv_freq is not None and len(config.inv_freq) != dim // 2:
        raise ValueError(
            f"rope inv_freq needs rotary_dim / 2 = {dim // 2} entries; got {len(config.inv_freq)}"
        )
    return dim


def needs_seq_len(config: RopeConfig) -> bool:
    """Whether the frequencies depend on the sequence length seen (dynamic, longrope)."""
    return config.scaling in ("dynamic", "longrope")


def _yarn(config: RopeConfig, base_freq: np.ndarray, dim: int) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023), as its reference code and ``transformers`` compute it."""
    factor = float(config.factor)  # type: ignore[arg-type]
    original = int(config.original_max_position_embeddings)  # type: ignore[arg-type]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = config.attention_factor
    if attention_factor is None:
        if config.mscale and config.mscale_all_dim:
            attention_factor = mscale(factor, config.mscale) / mscale(factor, config.mscale_all_dim)
        else:
            attention_factor = mscale(factor)
    beta_fast = 32.0 if config.beta_fast is None else float(config.beta_fast)
    beta_slow = 1.0 if config.beta_slow is None else float(config.beta_slow)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(config.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if config.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    inv = (base_freq / factor) * (1.0 - extrapolation) + base_freq * extrapolation
    return inv, float(attention_factor)


def _llama3(config: RopeConfig, base_freq: np.ndarray) -> np.ndarray:
    factor, low, high = float(config.factor), float(config.low_freq_factor), float(config.high_freq_factor)  # type: ignore[arg-type]
    original = float(config.original_max_position_embeddings)  # type: ignore[arg-type]
    wavelen = 2 * math.pi / base_freq
    scaled = np.where(wavelen > original / low, base_freq / factor, base_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, smoothed, scaled)


def _longrope(config: RopeConfig, base_freq: np.ndarray, seq_len: int | None) -> tuple[np.ndarray, float]:
    original = int(config.original_max_position_embeddings)  # type: ignore[arg-type]
    long = seq_len is not None and seq_len > original
    factors = np.asarray(config.long_factor if long else config.short_factor, dtype=np.float64)
    attention_factor = config.attention_factor
    if attention_factor is None:
        factor = 1.0 if config.factor is None else float(config.factor)
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return base_freq / factors, float(attention_factor)


def _attention_factor(config: RopeConfig, head_dim: int) -> float:
    """The attention factor of a static scaling (yarn's; 1.0 for the others)."""
    if config.scaling != "yarn":
        return 1.0
    return inv_freq(dataclasses.replace(config, inv_freq=None), head_dim)[1]


def inv_freq(config: RopeConfig, head_dim: int, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """The inverse frequencies (float64, ``rotary_dim / 2`` of them) and the attention
    factor that scales cos and sin (1.0 but for yarn and longrope).  ``seq_len``: the
    sequence length seen (the largest position + 1), which the dynamic and longrope
    scalings depend on; None = at most the original length."""
    check_rope(config, head_dim)
    if seq_len is not None:
        _positive_int("seq_len", seq_len)
    dim = rotary_dim(config, head_dim)
    if config.inv_freq is not None:
        return np.asarray(config.inv_freq, dtype=np.float64), _attention_factor(config, head_dim)
    theta = float(config.theta)
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    scaling = config.scaling
    if scaling == "dynamic":
        factor, original = float(config.factor), int(config.original_max_position_embeddings)  # type: ignore[arg-type]
        length = original if seq_len is None else max(int(seq_len), original)
        theta = theta * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
    base_freq = 1.0 / theta**exponents
    if scaling == "linear":
        return base_freq / float(config.factor), 1.0  # type: ignore[arg-type]
    if scaling == "llama3":
        return _llama3(config, base_freq), 1.0
    if scaling == "yarn":
        return _yarn(config, base_freq, dim)
    if scaling == "longrope":
        return _longrope(config, base_freq, seq_len)
    return base_freq, 1.0


def check_rope_call(x_shape: tuple[int, ...], positions_shape: tuple[int, ...], positions_dtype: str) -> None:
    """``apply_rope``'s arguments: x ``(B, H, T, D)``; positions integers ``(B, T)`` (or
    ``(1, T)``, shared by every example)."""
    if len(x_shape) != 4:
        raise ValueError(f"apply_rope expects x of shape (batch, heads, seq, head_dim); got shape {x_shape}")
    if "int" not in positions_dtype:
        raise TypeError(f"rope positions must be integers; got dtype {positions_dtype}")
    batch, _, seq, _ = x_shape
    if len(positions_shape) != 2 or positions_shape[1] != seq or positions_shape[0] not in (1, batch):
        raise ValueError(
            f"rope positions must have shape (batch, seq) = ({batch}, {seq}) (or (1, {seq})); "
            f"got shape {positions_shape}"
        )


_HF_TYPES = {
    "default": None,
    "linear": "linear",
    "dynamic": "dynamic",
    "llama3": "llama3",
    "yarn": "yarn",
    "longrope": "longrope",
}
_INTERLEAVED_MODELS = ("gptj", "codegen")  # rotate_every_two


def _hf_parameters(config: Any, layer_type: str | None) -> dict[str, Any]:
    """The rope parameters dict of a transformers config, old (``rope_scaling``) or new
    (``rope_parameters``), the one of ``layer_type`` where they are per layer type."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    labels = tuple(getattr(config, "layer_types", None) or ()) + tuple(params)
    nested = {k: v for k, v in params.items() if isinstance(v, dict) and k in labels}
    if nested:
        if layer_type not in nested:
            raise ValueError(
                f"rope_from_hf: this config has rope parameters per layer type ({', '.join(nested)}): "
                f"pass layer_type= one of them; got {layer_type!r}"
            )
        params = nested[layer_type]
    elif layer_type is not None and params:
        raise ValueError(
            f"rope_from_hf: this config has one set of rope parameters; got layer_type={layer_type!r}"
        )
    return dict(params)


# Whether a model type's layer honours ``partial_rotary_factor`` (transformers 5.24): its
# ``<Family>RotaryEmbedding.compute_default_rope_parameters`` computes frequencies for
# ``int(head_dim * partial_rotary_factor)`` features, and its ``apply_rotary_pos_emb`` turns
# that many (``cos.shape[-1]``), the rest passing through (GPT-NeoX, Phi, Phi-3, StableLM,
# GLM, Qwen3-Next, ...).  The model types of WHOLE_HEAD_MODEL_TYPES compute head_dim / 2
# frequencies whatever the config says, and rotate the whole head (Llama, Mistral, Qwen2/3,
# Gemma, DeepSeek, ...); their scaled rope types (linear, dynamic, llama3, yarn, longrope)
# do read the fraction, and the layer then fails (its cos is narrower than the head).  Both
# lists are every model type of transformers 5.24 with a rotary embedding, read off its
# sources (tests/functional/test_rope.py checks them against the installed transformers).
PARTIAL_MODEL_TYPES = frozenset({
    "bamba", "deepseek_v4", "diffusion_gemma", "diffusion_gemma_text", "dots3_note",
    "dots3_note_audio_encoder", "dots3_note_text", "dots3_note_vision_encoder", "efficientloftr",
    "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm4v", "glm4v_moe", "glm4v_moe_text",
    "glm4v_moe_vision", "glm4v_text", "glm4v_vision", "glm_image", "glm_image_text",
    "glm_image_vision", "glm_image_vqmodel", "glm_ocr", "glm_ocr_text", "glm_ocr_vision", "glmasr",
    "glmasr_encoder", "gpt_neox", "gpt_neox_japanese", "laguna", "mellum", "mimo_v2_flash",
    "minimax_m2", "minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3_vl_vision", "moonshine",
    "moonshine_streaming", "moonshine_streaming_encoder", "musicflamingo", "nemo_speechlm",
    "nemotron", "nemotron3_5_transcribe_asr_audio", "nemotron3_5_transcribe_audio",
    "nemotron3_5_transcribe_word_timestamp", "nemotron3_diarization", "nemotron3_diarization_audio",
    "neomme", "persimmon", "phi", "phi3", "phi4_multimodal", "phi4_multimodal_audio",
    "phi4_multimodal_vision", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_moe_vision",
    "qwen3_5_text", "qwen3_5_vision", "qwen3_next", "qwen4_exp", "qwen4_exp_text",
    "qwen4_exp_vision", "recurrent_gemma", "solar_open", "stablelm", "step3p5", "step3p5_vision",
    "step3p7", "zaya"
})
WHOLE_HEAD_MODEL_TYPES = frozenset({
    "afmoe", "apertus", "apertus1p5", "apertus1p5_text", "apertus1p5_vision_tokenizer", "arcee",
    "aria", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "bitnet", "blt",
    "blt_global_transformer", "blt_local_decoder", "blt_local_encoder", "blt_patcher", "chameleon",
    "chameleon_vqgan", "cohere", "cohere2", "cohere2_moe", "cohere_compass", "cohere_compass_text",
    "cohere_compass_vision", "cosmos3_edge", "cosmos3_edge_text", "cosmos3_edge_vision", "csm",
    "csm_depth_decoder_model", "cwm", "dbrx", "deepseek_ocr2", "deepseek_ocr2_encoder",
    "deepseek_ocr2_sam_vision_model", "deepseek_ocr2_text", "deepseek_ocr2_vision", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "dia", "dia_decoder", "dia_encoder", "diffllama", "doge", "dory",
    "dots1", "embedding_gemma2", "embedding_gemma2_text", "emu3", "emu3_text_model", "emu3_vqgan",
    "eomt_dinov3", "ernie4_5", "ernie4_5_moe", "ernie4_5_vl_moe", "ernie4_5_vl_moe_text",
    "ernie4_5_vl_moe_vision", "esm", "esmc", "eurobert", "evolla", "exaone4", "exaone_moe",
    "falcon", "falcon_h1", "flex_olmo", "flint", "gemma", "gemma2", "gemma3", "gemma3_text",
    "gemma3n", "gemma3n_audio", "gemma3n_text", "gemma3n_vision", "gemma4", "gemma4_audio",
    "gemma4_text", "gemma4_unified", "gemma4_unified_audio", "gemma4_unified_text",
    "gemma4_unified_vision", "gemma4_vision", "glm_moe_dsa", "gpt_oss", "gradium_phonon_tts",
    "granite", "granite4_vision", "granite4_vision_text", "granite_docling", "granite_docling_text",
    "granite_docling_vision", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
    "granitemoeshared", "gte", "helium", "higgs_audio_v2", "hrm_text", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hunyuan_vl", "hunyuan_vl_text", "hunyuan_vl_vision", "hy_v3", "hy_v4",
    "hy_v4_vl", "hy_v4_vl_text", "hy_v4_vl_vision", "hyperclovax", "idefics", "idefics_perciever",
    "idefics_vision", "jais2", "jetmoe", "jina_embeddings_v3", "kolibri1", "kyutai_speech_to_text",
    "lara_mini", "lasr_ctc", "lasr_encoder", "lfm2", "lfm2_moe", "lfm3", "llama", "llama4",
    "llama4_text", "llama4_vision_model", "longcat_flash", "mimi", "mimi_decoder", "mimi_encoder",
    "minicpm3", "minimax", "ministral", "ministral3", "mistral", "mistral4", "mistral_large4",
    "mistral_large4_text", "mixtral", "mllama", "mllama_text_model", "mllama_vision_model",
    "modernbert", "modernbert-decoder", "molmo2", "molmo2_adapter", "molmo2_text", "molmo2_vision",
    "moshi", "moshi_depth", "muse_glimmer", "muse_glimmer_assistant", "muse_glimmer_text",
    "muse_glimmer_vision", "muse_spark", "muse_spark_audio", "muse_spark_text", "muse_spark_vision",
    "nanochat", "neucodec", "nomic_bert", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe",
    "openai_privacy_filter", "paddleocr_vl", "paddleocr_vl_text", "paddleocr_vl_vision", "pe_audio",
    "pe_audio_encoder", "pe_audio_video", "pe_audio_video_encoder", "pe_video", "pe_video_encoder",
    "phimoe", "pocket_tts", "pocket_tts_audio_tokenizer", "pocket_tts_audio_tokenizer_decoder",
    "pocket_tts_audio_tokenizer_encoder", "pp_doclayout_v2", "qwen2", "qwen2_5_omni",
    "qwen2_5_omni_audio_encoder", "qwen2_5_omni_bigvgan", "qwen2_5_omni_dit", "qwen2_5_omni_talker",
    "qwen2_5_omni_text", "qwen2_5_omni_thinker", "qwen2_5_omni_token2wav",
    "qwen2_5_omni_vision_encoder", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_5_vl_vision",
    "qwen2_moe", "qwen2_vl", "qwen2_vl_text", "qwen2_vl_vision", "qwen3", "qwen3_moe",
    "qwen3_omni_moe", "qwen3_omni_moe_audio_encoder", "qwen3_omni_moe_talker_code_predictor",
    "qwen3_omni_moe_talker_text", "qwen3_omni_moe_text", "qwen3_omni_moe_thinker",
    "qwen3_omni_moe_vision_encoder", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "qwen3_vl_moe_vision", "qwen3_vl_text", "qwen3_vl_vision", "seed_oss", "smollm3", "starcoder2",
    "t5_gemma_module", "t5gemma", "t5gemma2", "t5gemma2_decoder", "t5gemma2_encoder",
    "t5gemma2_text", "timesfm2_5", "ultrabert", "unlimited_ocr", "unlimited_ocr_sam_vision_model",
    "unlimited_ocr_text", "unlimited_ocr_vision", "unlimited_ocr_vision_encoder", "vaultgemma",
    "voxtral_realtime", "voxtral_realtime_encoder", "voxtral_realtime_text", "xcodec2", "youtu",
    "zamba2"
})


def hf_honours_partial(config: Any) -> bool | None:
    """Whether ``transformers``' layer of this config's ``model_type`` turns only
    ``partial_rotary_factor`` of each head (True), the whole head whatever the factor
    (False), or None where the model type is not known (``PARTIAL_MODEL_TYPES``,
    ``WHOLE_HEAD_MODEL_TYPES``)."""
    model_type = getattr(config, "model_type", None)
    if model_type in PARTIAL_MODEL_TYPES:
        return True
    if model_type in WHOLE_HEAD_MODEL_TYPES:
        return False
    return None


def _hf_partial(
    config: Any, params: dict[str, Any], rope_type: str, honours_partial: bool | None
) -> tuple[int | None, float | None]:
    """(rotary_dim, partial_rotary_factor) of a config, as its model's layer turns the
    head: GPT-NeoX's ``rotary_pct`` and GPT-J's ``rotary_dim`` always turn that part; a
    ``partial_rotary_factor`` below 1 only where the model type honours it."""
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    pct = getattr(config, "rotary_pct", None)  # GPT-NeoX's older name: it turns that part
    if factor is None and pct is not None:
        return None, (None if float(pct) == 1.0 else float(pct))
    if factor is None:
        dim = getattr(config, "rotary_dim", None)
        return (None if dim is None else int(dim)), None
    if float(factor) != 1.0:
        honours = hf_honours_partial(config) if honours_partial is None else honours_partial
        model_type = getattr(config, "model_type", None)
        if honours is None:
            raise ValueError(
                f"rope_from_hf: partial_rotary_factor={float(factor)!r}, but whether transformers' layer of "
                f"model_type {model_type!r} turns that fraction of each head or the whole head (Llama's turns "
                "the whole head whatever the config says) cannot be known from the config: port the layer "
                "with torch_attention.interop.from_hf(layer), which reads its rotary embedding, or pass "
                "honours_partial=True (the fraction turns) or False (the whole head turns)"
            )
        if honours:
            return None, float(factor)
        if rope_type != "default" and honours_partial is None:
            raise ValueError(
                f"rope_from_hf: partial_rotary_factor={float(factor)!r} with rope_type {rope_type!r}: the layer of "
                f"model_type {model_type!r} rotates the whole head, but transformers computes this rope_type's "
                "frequencies for that fraction of it, and the layer fails (its cos is narrower than the head); "
                "drop partial_rotary_factor (the whole head turns) or set it to 1.0"
            )
    return None, None  # 1.0, or a layer that turns the whole head whatever the config says


def rope_from_hf(config: Any, layer_type: str | None = None, *, honours_partial: bool | None = None) -> RopeConfig:
    """The ``RopeConfig`` of a ``transformers`` model config (read by attribute, without
    importing transformers): ``rope_theta``; ``partial_rotary_factor`` / ``rotary_pct``
    / ``rotary_dim``; the ``rope_parameters`` (or older ``rope_scaling``) dict and its
    ``rope_type``; the interleaved layout of GPT-J and CodeGen and of ``rope_interleave``.
    Where the config has rope parameters per layer type (Gemma 3), ``layer_type`` picks
    one.  A yarn or longrope ``factor`` left out is ``max_position_embeddings /
    original_max_position_embeddings``, as transformers computes it; the dynamic NTK's
    original length is the config's ``max_position_embeddings``.

    ``partial_rotary_factor`` turns as the model's layer does, which the config alone does
    not say: the fraction of each head where transformers' layer of that ``model_type``
    honours it (GPT-NeoX, Phi, Phi-3, StableLM, GLM, Qwen3-Next: ``PARTIAL_MODEL_TYPES``),
    the whole head where its rotary embedding ignores it (Llama, Mistral, Qwen2/3, Gemma:
    ``WHOLE_HEAD_MODEL_TYPES``; with a scaled ``rope_type`` such a layer fails, and so is
    refused); ``honours_partial=`` True or False says it for a model type that is in
    neither list, which is otherwise refused (ValueError naming
    ``partial_rotary_factor``).  ``torch_attention.interop.from_hf(layer)`` reads the
    layer's own rotary embedding instead (as many features turn as it has frequencies for).
    GPT-NeoX's ``rotary_pct`` and GPT-J's ``rotary_dim`` always turn that part."""
    params = _hf_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "proportional":
        return _proportional_from_hf(config, params, layer_type)
    if rope_type not in _HF_TYPES:
        supported = ", ".join(repr(t) for t in _HF_TYPES)
        raise ValueError(f"rope_from_hf: rope_type {rope_type!r} is not supported (supported: {supported})")
    scaling = _HF_TYPES[rope_type]
    theta: Any = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        theta = getattr(config, "default_theta", 10000.0)
    interleaved = bool(getattr(config, "rope_interleave", False))
    interleaved = interleaved or getattr(config, "model_type", None) in _INTERLEAVED_MODELS
    dim, partial = _hf_partial(config, params, rope_type, honours_partial)
    max_positions = getattr(config, "max_position_embeddings", None)
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    original = original or max_positions
    fields: dict[str, Any] = {}
    if scaling == "dynamic":
        original = max_positions
    if scaling is not None:
        for name in _TAKES[scaling]:
            if params.get(name) is not None:
                fields[name] = params[name]
        if "original_max_position_embeddings" in _TAKES[scaling]:
            fields["original_max_position_embeddings"] = None if original is None else int(original)
        if scaling in ("yarn", "longrope") and fields.get("factor") is None and original and max_positions:
            fields["factor"] = max_positions / original
    if scaling == "yarn" and params.get("truncate") is not None:
        fields["yarn_truncate"] = bool(params["truncate"])
    return RopeConfig(
        theta=float(theta),
        rotary_dim=dim,
        partial_rotary_factor=partial,
        layout="interleaved" if interleaved else "half",
        scaling=scaling,
        **fields,
    )


def _proportional_from_hf(config: Any, params: Mapping[str, Any], layer_type: str | None) -> RopeConfig:
    """transformers' ``"proportional"`` rope (Gemma 4's global layers): the whole head
    turns in halves, its first ``int(partial_rotary_factor * head_dim // 2)`` pairs at
    ``theta ** (-2i / head_dim)`` (over the whole head's width, not the fraction's), the
    rest at frequency 0 (they never turn), all divided by ``factor``: a whole-head
    ``RopeConfig`` with those ``inv_freq``."""
    layer = config
    if layer_type is not None:
        try:  # Gemma 4: a head width per layer type
            layer = config.per_layer_config[layer_type]
        except (AttributeError, KeyError, IndexError, TypeError, ValueError):
            layer = config
    try:
        head_dim = getattr(layer, "head_dim", None)
    except Exception:  # noqa: BLE001 - Gemma 4's config refuses a global head_dim that differs per layer
        head_dim = None
    head_dim = head_dim or config.hidden_size // config.num_attention_heads
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
    factor = float(params.get("factor", 1.0) or 1.0)
    angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    turning = [1.0 / theta ** (2 * i / head_dim) / factor for i in range(angles)]
    return RopeConfig(theta=theta, inv_freq=tuple(turning + [0.0] * (head_dim // 2 - angles)))


def check_inv_freq(shape: tuple[int, ...], dtype: str, dim: int) -> None:
    """``apply_rope``'s ``inv_freq=`` override: floating point, ``rotary_dim / 2`` of them."""
    if "float" not in dtype:
        raise TypeError(f"rope inv_freq must be floating point; got dtype {dtype}")
    if tuple(shape) != (dim // 2,):
        raise ValueError(f"rope inv_freq must have shape (rotary_dim / 2,) = ({dim // 2},); got shape {tuple(shape)}")


ROPE_WITH_CONTEXT = (
    "rope= rotates the queries and keys of self-attention: a call with context= (cross-attention) has "
    "no positions for its keys"
)


def check_rope_widths(d_in: int | None, kdim: int | None, vdim: int | None) -> None:
    """A module built with ``rope=``: ``kdim`` / ``vdim`` (the key and value inputs' widths)
    must be unset or ``d_in``.  Rope refuses ``context=`` (``ROPE_WITH_CONTEXT``), so the
    keys and values are projected from x, ``d_in`` wide: a key or value projection of
    another width would fail at every call.  Raises ValueError naming the widths."""
    given = [f"{name}={width}" for name, width in (("kdim", kdim), ("vdim", vdim))
             if width is not None and width != d_in]
    if not given:
        return
    names = " and ".join(g.split("=")[0] for g in given)
    what = "is a cross-attention width" if len(given) == 1 else "are cross-attention widths"
    raise ValueError(
        f"{' and '.join(given)} {what} (of context=), but rope= rotates the queries and keys of "
        f"self-attention, whose keys and values come from x (d_in={d_in} wide): such a module could never "
        f"be called; leave {names} unset (or equal to d_in), or build the module without rope="
    )


def check_module_positions(
    has_rope: bool, positions_shape: tuple[int, ...] | None, positions_dtype: str | None,
    x_shape: tuple[int, ...], *, context: bool,
) -> None:
    """A module call's ``positions=``: only for a module built with ``rope=``; integers of
    shape ``(batch, seq)`` (or ``(1, seq)``; ``(seq,)`` for an unbatched x)."""
    if not has_rope:
        if positions_shape is not None:
            raise ValueError("positions= needs a module built with rope= (rotary position embeddings); this one has none")
        return
    if context:
        raise ValueError(ROPE_WITH_CONTEXT)
    if positions_shape is None:
        return
    if "int" not in str(positions_dtype):
        raise TypeError(f"rope positions must be integers; got dtype {positions_dtype}")
    lead = tuple(x_shape[:-1])
    allowed = [lead] + ([(1, lead[1])] if len(lead) == 2 else [])
    if tuple(positions_shape) not in allowed:
        want = " or ".join(str(s) for s in allowed)
        raise ValueError(f"positions must have shape {want} (x's leading dimensions); got shape {tuple(positions_shape)}")
