"""One description per variant: the registry that the modules, the conversion map, the
float64 oracle and the parity matrix all read, and the frozen config every module holds.

A variant is declared once, in ``REGISTRY``: its constructor signature (positional
names, keyword-only options, defaults), its projections in creation order (each with a
weight layout and a bias rule), how it has heads, and whether it has dropout.  A module
is built from ``make_config(variant, options)``, an ``AttentionConfig`` that is frozen,
validated and hashable (so a Flax module can hold it as a static attribute that ``jit``
hashes).  Adding an option touches ``AttentionConfig`` and the signatures here, plus the
module file of each framework; nothing here imports torch or jax.

Reading the registry::

    v = variant("MultiHeadAttention")
    v.positional          # ("d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias")
    v.defaults            # {"qkv_bias": False, "out_proj": True, "out_bias": True, "scale": None, ...}
    v.has_dropout         # True
    v.projections         # (Projection("W_query", "query", "linear", "qkv_bias"), ...)
    config = make_config("Head", {"d_in": 4, "head_size": 2, "context_length": 8})
    [p.name for p in config.projections()]   # the projections this config creates, in order
    config.projection("query").name          # "query" (Head's name for it), .layout, .has_bias(config)
    config.options()      # the constructor keywords, a plain dict (``module.config``)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, cast

from attention_spec.flex import check_module_mods
from attention_spec.latent import check_indexer, check_latent_widths, check_norm_eps
from attention_spec.options import (
    check_alignment,
    check_chunk,
    check_clip_qkv,
    check_dropout_rate,
    check_head_dim,
    check_implementation,
    check_kv_heads,
    check_kv_shared,
    check_mask_strategy,
    check_normalization,
    check_optional_width,
    check_out_norm,
    check_out_width,
    check_output_gate,
    check_positive_int,
    check_qk_norm,
    check_qk_norm_offset,
    check_qk_norm_position,
    check_qk_norm_weight,
    check_query_scale,
    check_query_scale_kind,
    check_scale,
    check_softcap,
    check_v_norm,
    check_value_heads,
    check_values_from_keys,
    check_window,
)
from attention_spec.rope import check_rope, check_rope_widths

__all__ = [
    "LATENT_ROLES",
    "REGISTRY",
    "REQUIRED",
    "VARIANTS",
    "AttentionConfig",
    "Layers",
    "LatentWidths",
    "Option",
    "Projection",
    "QKTransforms",
    "Scoring",
    "Variant",
    "Widths",
    "make_config",
    "variant",
]


# Options held under another field name: the config's ``head_dim`` is the resolved width
# of one head (the option, or d_out // num_heads), so the option as given (None or an
# int) is the field ``head_dim_option``.
_FIELDS = {"head_dim": "head_dim_option"}
_OPTIONS = {field: option for option, field in _FIELDS.items()}


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of an option that has none (a required argument)


@dataclass(frozen=True)
class Option:
    """One constructor parameter: its name, its default (``REQUIRED`` if none) and
    whether it is keyword-only."""

    name: str
    default: Any = REQUIRED
    keyword_only: bool = False


@dataclass(frozen=True)
class Projection:
    """One parameter-holding child of a module.

    name: the attribute and the parameter prefix (``W_query``: ``W_query.weight`` in
      PyTorch, ``("W_query", "kernel")`` in Flax).
    role: ``"query"``, ``"key"``, ``"value"`` (from ``x``: (d_in, width)) or ``"out"``
      (mixes the merged heads: (width, out width); see ``AttentionConfig.fan_out``).
    layout: ``"linear"`` (``nn.Linear`` / ``nnx.Linear``: PyTorch weight (out, in), Flax
      kernel (in, out)) or ``"matrix"`` (a raw (d_in, width) parameter used as ``x @ W``,
      the same array in both frameworks, drawn from N(0, 1)).
    bias: ``"qkv_bias"``, ``"out_bias"`` or ``"attention_bias"`` (that option decides),
      ``"always"`` or ``"never"``.
    when: the option that must be set (True, or not None) for the projection to exist
      (None: always).
    unless: the option that must be unset (False or None) for it to exist (latent
      attention's one ``q_proj`` when ``q_lora_rank`` is None); a tuple: each must be unset
      (``W_value`` without ``values_from_keys`` and ``kv_shared``).
    """

    name: str
    role: str
    layout: str
    bias: str = "never"
    when: str | None = None
    unless: str | tuple[str, ...] | None = None

    def exists(self, config: Mapping[str, Any] | AttentionConfig) -> bool:
        unless = (self.unless,) if isinstance(self.unless, str) else self.unless or ()
        if any(_get(config, name, None) not in (None, False) for name in unless):
            return False
        return self.when is None or _get(config, self.when, True) not in (None, False)

    def has_bias(self, config: Mapping[str, Any] | AttentionConfig) -> bool:
        if self.bias in ("qkv_bias", "out_bias", "attention_bias"):
            return bool(_get(config, self.bias, self.bias == "out_bias"))
        return self.bias == "always"


@dataclass(frozen=True)
class Variant:
    """A variant's declaration.

    signature: the constructor parameters in order (without the framework's own ``dtype``,
      ``param_dtype``, ``device``, ``precision`` and ``rngs``).
    projections: in creation order (PyTorch draws its initial weights in that order).
    heads: ``"single"`` (one head), ``"split"`` (one projection split into ``num_heads``
      heads of ``head_dim``, by default ``d_out // num_heads``), ``"wrapper"`` (``num_heads`` copies of
      ``head_variant``, outputs concatenated) or ``"latent"`` (multi-head latent attention:
      keys and values expanded per head from one compressed latent; ``LATENT_ROLES``).
    width: the option that gives the projections' output width (``d_out``/``head_size``),
      None for a variant without projections (its q, k, v are ``x`` itself).
    fixed: values the variant fixes for options that it does not expose.
    """

    name: str
    signature: tuple[Option, ...]
    projections: tuple[Projection, ...]
    has_dropout: bool
    heads: str = "single"
    width: str | None = "d_out"
    head_variant: str | None = None
    fixed: tuple[tuple[str, Any], ...] = ()

    @property
    def positional(self) -> tuple[str, ...]:
        """Names of the parameters that may be given by position, in order."""
        return tuple(o.name for o in self.signature if not o.keyword_only)

    @property
    def keyword_only(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.signature if o.keyword_only)

    @property
    def options(self) -> tuple[str, ...]:
        """Every constructor keyword, in signature order (the keys of ``module.config``)."""
        return tuple(o.name for o in self.signature)

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.signature if o.default is REQUIRED)

    @property
    def defaults(self) -> dict[str, Any]:
        """{option: default} for the options that have one."""
        return {o.name: o.default for o in self.signature if o.default is not REQUIRED}


def _get(config: Mapping[str, Any] | AttentionConfig, name: str, default: Any) -> Any:
    if isinstance(config, AttentionConfig):
        return getattr(config, name)
    return config.get(name, default)


def _common(causal: bool, scale: float | None = None) -> tuple[Option, ...]:
    return (
        Option("scale", scale, True),
        Option("causal", causal, True),
        Option("mask_strategy", "fill", True),
        Option("implementation", "auto", True),
        Option("softcap", None, True),
        Option("window", None, True),
        Option("alignment", "top_left", True),
    )


def _qkv(*names: str, layout: str = "linear", bias: str = "qkv_bias") -> tuple[Projection, ...]:
    roles = {"W_query": "query", "W_key": "key", "W_value": "value",
             "query": "query", "key": "key", "value": "value"}
    return tuple(Projection(n, roles[n], layout, bias) for n in names)


_QKV = ("W_query", "W_key", "W_value")

# Multi-head latent attention's projections (DeepSeek-V2/V3, Kimi K2), with Hugging Face's
# names: queries through a low-rank pair (``q_a_proj``, normalised, ``q_b_proj``) or one
# ``q_proj`` when ``q_lora_rank`` is None; ``kv_a_proj_with_mqa`` gives the latent and the
# shared rope key, ``kv_b_proj`` expands the latent to each head's nope key and value.
# Roles (their widths: ``AttentionConfig.fan_in`` / ``fan_out``):
LATENT_ROLES = ("query", "query_a", "query_b", "latent", "latent_up", "out")
_LATENT = (
    Projection("q_proj", "query", "linear", "never", unless="q_lora_rank"),
    Projection("q_a_proj", "query_a", "linear", "attention_bias", when="q_lora_rank"),
    Projection("q_b_proj", "query_b", "linear", "never", when="q_lora_rank"),
    Projection("kv_a_proj_with_mqa", "latent", "linear", "attention_bias"),
    Projection("kv_b_proj", "latent_up", "linear", "never"),
    Projection("o_proj", "out", "linear", "attention_bias"),
)

REGISTRY: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "SimplifiedAttention",
            (
                Option("normalization", "softmax", True),
                Option("causal", False, True),
                Option("mask_strategy", "fill", True),
                Option("implementation", "auto", True),
                Option("softcap", None, True),
                Option("window", None, True),
                Option("alignment", "top_left", True),
            ),
            projections=(),
            has_dropout=False,
            width=None,
            fixed=(("scale", 1.0),),  # the tutorials' unscaled x @ x^T
        ),
        Variant(
            "SelfAttention_v1",
            (Option("d_in"), Option("d_out"), *_common(causal=False)),
            projections=_qkv(*_QKV, layout="matrix", bias="never"),
            has_dropout=False,
        ),
        Variant(
            "SelfAttention_v2",
            (Option("d_in"), Option("d_out"), Option("qkv_bias", False), *_common(causal=False)),
            projections=_qkv(*_QKV),
            has_dropout=False,
        ),
        Variant(
            "CausalAttention",
            (Option("d_in"), Option("d_out"), Option("context_length"), Option("dropout"),
             Option("qkv_bias", False), *_common(causal=True)),
            projections=_qkv(*_QKV),
            has_dropout=True,
        ),
        Variant(
            "Head",
            (Option("d_in"), Option("head_size"), Option("context_length"), Option("dropout", 0.0),
             *_common(causal=True, scale=1.0)),  # seed 002 does not scale its scores
            projections=_qkv("key", "query", "value", bias="never"),  # seed 002's creation order
            has_dropout=True,
            width="head_size",
        ),
        Variant(
            "MultiHeadAttentionWrapper",
            (Option("d_in"), Option("d_out"), Option("context_length"), Option("dropout"),
             Option("num_heads"), Option("qkv_bias", False), *_common(causal=True)),
            projections=(),  # each head holds its own (heads.i.W_query, ...)
            has_dropout=True,
            heads="wrapper",
            head_variant="CausalAttention",
        ),
        Variant(
            "MultiHeadAttention",
            (Option("d_in"), Option("d_out"), Option("context_length"), Option("dropout"),
             Option("num_heads"), Option("qkv_bias", False), Option("out_proj", True, True),
             Option("num_kv_heads", None, True), Option("kdim", None, True), Option("vdim", None, True),
             # free widths: Gemma's heads x head_dim != hidden, Llama's bias-free o_proj
             Option("head_dim", None, True), Option("out_features", None, True), Option("out_bias", True, True),
             # OLMo's clip_qkv (q, k, v clamped to [-c, c]); Qwen3-Next's output gate (W_query also
             # gives a gate per head, interleaved as q_proj's; the merged heads times its sigmoid)
             Option("clip_qkv", None, True), Option("output_gate", False, True),
             # Laguna's gate: softplus, one value per head (W_query's head_dim + 1 rows a head)
             Option("output_gate_activation", "sigmoid", True), Option("output_gate_per_head", False, True),
             Option("output_gate_bias", False, True),  # Beam's gate_bias: one a head, added before the sigmoid
             # qk-norm: Qwen3's / Phi's per-head q_norm and k_norm, OLMo 2's across heads
             Option("qk_norm", None, True), Option("qk_norm_scope", "head", True), Option("qk_norm_eps", 1e-6, True),
             Option("qk_norm_offset", 0.0, True),  # Gemma 3: scale by 1 + weight
             # nanochat's / Llama 4's weightless qk-norm; HunYuan's qk-norm after rope; Gemma 4's value
             # norm and keys as values; Llama 4's / Ministral 3's queries scaled by position (an options.QueryScale)
             Option("qk_norm_weight", True, True), Option("qk_norm_position", "before_rope", True),
             Option("v_norm", None, True),
             Option("values_from_keys", False, True), Option("query_scale", None, True),
             Option("query_scale_kind", "log", True),  # Beam's scalable softmax: "power"
             # Gemma 4's num_kv_shared_layers: no W_key / W_value / k_norm, another layer's kv=
             Option("kv_shared", False, True),
             Option("out_norm", None, True),  # BitNet's attn_sub_norm: an RMSNorm of the merged heads
             # MiMo-V2-Flash: value heads of their own width (latent attention's name), values scaled
             Option("v_head_dim", None, True), Option("v_scale", None, True),
             Option("rope", None, True),  # rotary position embeddings: a RopeConfig
             Option("sinks", False, True),  # gpt-oss's attention sinks: one learned logit per head
             # flex attention's mods (attention_spec.mods), applied to this module's scores
             Option("score_mod", None, True), Option("mask_mod", None, True),
             Option("chunk", None, True),  # Llama 4's chunked local attention (attention_chunk_size)
             *_common(causal=True)),
            projections=(*_qkv("W_query"), Projection("W_key", "key", "linear", "qkv_bias", unless="kv_shared"),
                         Projection("W_value", "value", "linear", "qkv_bias",
                                    unless=("values_from_keys", "kv_shared")),
                         Projection("out_proj", "out", "linear", "out_bias", when="out_proj")),
            has_dropout=True,
            heads="split",
        ),
        Variant(
            "MultiHeadLatentAttention",
            (Option("d_in"), Option("num_heads"), Option("kv_lora_rank"), Option("qk_nope_head_dim"),
             Option("qk_rope_head_dim"), Option("v_head_dim"), Option("q_lora_rank", None, True),
             Option("context_length", None, True), Option("dropout", 0.0, True),
             Option("attention_bias", False, True), Option("norm_eps", 1e-6, True), Option("rope", None, True),
             Option("query_scale", None, True),  # Mistral 4's llama_4_scaling_beta (an options.QueryScale)
             *_common(causal=True),
             # DeepSeek-V3.2 / GLM-5's sparse attention (DSA): an indexer keeps each query's top keys
             Option("index_topk", None, True), Option("index_heads", None, True),
             Option("index_head_dim", None, True), Option("index_rope_layout", "half", True)),
            projections=_LATENT,
            has_dropout=True,
            heads="latent",
            width=None,
        ),
    )
}

VARIANTS: tuple[str, ...] = tuple(REGISTRY)


def variant(name: str) -> Variant:
    """The declaration of a variant; ValueError naming the known ones for another name."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"no declared weight layout for {name!r}; known variants: {known}") from None


@dataclass(frozen=True)
class Widths:
    """A config's widths and heads: ``d_in``, ``d_out`` (or a ``Head``'s ``head_size``),
    the context cap, query and key/value heads, cross-attention's key and value input
    widths, the ``head_dim=`` option as given (``head_dim_option``) and
    ``out_features``."""

    d_in: int | None = None
    d_out: int | None = None
    head_size: int | None = None
    context_length: int | None = None
    num_heads: int = 1
    num_kv_heads: int | None = None
    kdim: int | None = None
    vdim: int | None = None
    head_dim_option: int | None = None  # the ``head_dim=`` option as given (``head_dim``: resolved)
    out_features: int | None = None


@dataclass(frozen=True)
class Layers:
    """Which projections a config creates beyond its declared ones, and their biases."""

    qkv_bias: bool = False
    out_proj: bool = False
    out_bias: bool = False
    attention_bias: bool = False  # latent attention's projections
    # W_query gives queries and a gate per head (2 * head_dim rows a head: the head's
    # queries, then its gate, as Qwen3-Next's q_proj); the merged heads times sigmoid(gate)
    output_gate: bool = False
    output_gate_activation: str = "sigmoid"  # "softplus": Laguna's (in float32 at least)
    output_gate_per_head: bool = False  # one gate value per head: W_query's head_dim + 1 rows a head
    output_gate_bias: bool = False  # a parameter gate_bias (num_heads,) added to each head's gate (Beam's)
    # an RMSNorm with a weight (``out_norm``) of the merged heads before out_proj (BitNet's attn_sub_norm)
    out_norm: str | None = None
    # no W_value: the values are W_key's output before k-norm and rope (Gemma 4's attention_k_eq_v)
    values_from_keys: bool = False
    # no W_key / W_value / k_norm: the call takes another layer's keys and values (Gemma 4's
    # num_kv_shared_layers, a "reuse" layer)
    kv_shared: bool = False


@dataclass(frozen=True)
class Scoring:
    """How the attention weights are made and which path computes them: the scale, the
    structure (causal, window and its alignment), soft-capping, sinks, the mask strategy
    and normalisation, dropout on the weights and the ``implementation``."""

    scale: float | None = None
    causal: bool = False
    mask_strategy: str = "fill"
    normalization: str = "softmax"
    implementation: str = "auto"
    softcap: float | None = None
    window: tuple[int | None, int | None] | None = None
    alignment: str = "top_left"
    chunk: int | None = None  # chunked local attention: a chunk's width in key positions
    sinks: bool = False  # a parameter ``sinks`` (num_heads,): each head's logit in every softmax
    dropout: float = 0.0
    # flex attention's mods (``attention_spec.mods``, or functions of the user's own):
    # ``score_mod(score, b, h, q_idx, kv_idx)``, ``mask_mod(b, h, q_idx, kv_idx)``, seeing
    # key positions
    score_mod: Any = None
    mask_mod: Any = None


@dataclass(frozen=True)
class QKTransforms:
    """What is done to queries and keys before the scores: the clamp of the projections
    (``clip_qkv``, values too), qk-norm (its kind, scope, epsilon, offset and whether it
    has a weight), the value norm, the rotary embedding (an ``attention_spec.rope.RopeConfig``)
    and the queries' scale by position (an ``attention_spec.options.QueryScale``)."""

    clip_qkv: float | None = None  # OLMo: q, k and v clamped to [-clip_qkv, clip_qkv]
    qk_norm: str | None = None
    qk_norm_scope: str = "head"
    qk_norm_eps: float = 1e-6
    qk_norm_offset: float = 0.0
    qk_norm_weight: bool = True  # False: a weightless RMS norm (nanochat, Llama 4), no q_norm / k_norm
    qk_norm_position: str = "before_rope"  # "after_rope": on the turned q and k (HunYuan)
    v_norm: str | None = None  # Gemma 4: "rms", a weightless RMS norm of each value head (qk_norm_eps)
    rope: Any = None  # an attention_spec.rope.RopeConfig (frozen, hashable), or None
    query_scale: Any = None  # an options.QueryScale: queries times 1 + beta log1p(floor((p + offset) / floor))
    query_scale_kind: str = "log"  # "power": times (1 + (p + offset) / floor) ** beta (Beam's scalable softmax)
    v_scale: float | None = None  # MiMo-V2-Flash: the values times a constant as they leave W_value


@dataclass(frozen=True)
class LatentWidths:
    """Multi-head latent attention's (``heads="latent"``) ranks, the widths of one head
    and its norms' epsilon; neutral (None) for every other variant."""

    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    norm_eps: float = 1e-6  # q_a_layernorm's and kv_a_layernorm's (and the indexer's k_norm)
    # the indexer of sparse attention (DSA; attention_spec.latent.check_indexer): None = dense
    index_topk: int | None = None
    index_heads: int | None = None
    index_head_dim: int | None = None
    index_rope_layout: str = "half"  # its rope's layout (DeepSeek-V3.2: "half", GLM-5: "interleaved")


# Each subject's record, by the config's field that holds it; every option's subject.
_SUBJECTS: dict[str, type] = {
    "widths": Widths, "layers": Layers, "scoring": Scoring, "qk": QKTransforms, "latent": LatentWidths,
}
_SUBJECT_OF: dict[str, str] = {f.name: subject for subject, record in _SUBJECTS.items() for f in fields(record)}


@dataclass(frozen=True, init=False)
class AttentionConfig:
    """Every option of a variant, validated, frozen and hashable (``module.spec``), held
    in records by subject: ``widths`` (``Widths``), ``layers`` (``Layers``), ``scoring``
    (``Scoring``), ``qk`` (``QKTransforms``) and ``latent`` (``LatentWidths``).  Each
    option reads by name too (``spec.num_heads`` is ``spec.widths.num_heads``).

    Build one with ``make_config`` (the variant's declared defaults, e.g. ``out_proj=True``
    for ``MultiHeadAttention``); direct construction takes the options by name
    (``AttentionConfig("CausalAttention", d_in=4, d_out=4)``) or whole records, with the
    neutral defaults of the records, and ``dataclasses.replace(spec, causal=False)``
    changes one option.

    Options that the variant does not expose hold the variant's fixed value or the
    neutral default (e.g. ``dropout=0.0``, ``num_heads=1`` for a single-head variant);
    setting one of them raises ``ValueError``.  ``context_length=None`` means no cap on
    the sequence length.  The ``head_dim=`` option is held as ``head_dim_option`` (None
    or the int given); ``head_dim`` is the resolved width of one head.  Raises
    ``TypeError``/``ValueError`` (the texts of ``attention_spec.options``) for a bad value.
    """

    variant: str
    widths: Widths
    layers: Layers
    scoring: Scoring
    qk: QKTransforms
    latent: LatentWidths

    if TYPE_CHECKING:  # each option by name, as ``__init__`` sets it beside its record
        d_in: int | None
        d_out: int | None
        head_size: int | None
        context_length: int | None
        num_heads: int
        num_kv_heads: int | None
        kdim: int | None
        vdim: int | None
        head_dim_option: int | None
        out_features: int | None
        qkv_bias: bool
        out_proj: bool
        out_bias: bool
        attention_bias: bool
        output_gate: bool
        values_from_keys: bool
        kv_shared: bool
        clip_qkv: float | None
        scale: float | None
        causal: bool
        mask_strategy: str
        normalization: str
        implementation: str
        softcap: float | None
        window: tuple[int | None, int | None] | None
        alignment: str
        chunk: int | None
        sinks: bool
        dropout: float
        score_mod: Any
        mask_mod: Any
        qk_norm: str | None
        qk_norm_scope: str
        qk_norm_eps: float
        qk_norm_offset: float
        qk_norm_weight: bool
        qk_norm_position: str
        output_gate_activation: str
        output_gate_per_head: bool
        output_gate_bias: bool
        out_norm: str | None
        v_norm: str | None
        rope: Any
        query_scale: Any
        query_scale_kind: str
        v_scale: float | None
        q_lora_rank: int | None
        kv_lora_rank: int | None
        qk_nope_head_dim: int | None
        qk_rope_head_dim: int | None
        v_head_dim: int | None
        norm_eps: float
        index_topk: int | None
        index_heads: int | None
        index_head_dim: int | None
        index_rope_layout: str

    def __init__(self, variant: str, widths: Widths | None = None, layers: Layers | None = None,
                 scoring: Scoring | None = None, qk: QKTransforms | None = None, latent: LatentWidths | None = None,
                 **options: Any) -> None:
        unknown = sorted(set(options) - set(_SUBJECT_OF))
        if unknown:
            raise TypeError(f"AttentionConfig() got an unexpected keyword argument {unknown[0]!r}")
        given = {"widths": widths, "layers": layers, "scoring": scoring, "qk": qk, "latent": latent}
        object.__setattr__(self, "variant", variant)
        for subject, record in _SUBJECTS.items():
            own = {name: value for name, value in options.items() if _SUBJECT_OF[name] == subject}
            base = given[subject]
            if base is None or own:
                base = record(**own) if base is None else dataclasses.replace(base, **own)
            object.__setattr__(self, subject, base)
            # each option also by name: as fast to read as a plain attribute (a decode step
            # reads the spec on every call); the records are what compares and hashes
            self.__dict__.update(vars(base))
        self.__post_init__()

    def _set(self, name: str, value: Any) -> None:
        """Writes a normalised option into its record (frozen: once, while checking)."""
        subject = _SUBJECT_OF[name]
        object.__setattr__(self, subject, dataclasses.replace(getattr(self, subject), **{name: value}))
        self.__dict__[name] = value

    def __post_init__(self) -> None:
        decl = variant(self.variant)
        exposed = {_FIELDS.get(name, name) for name in decl.options}
        fixed = dict(decl.fixed)
        for record in _SUBJECTS.values():
            for f in fields(record):
                if f.name in exposed:
                    continue
                neutral = fixed.get(f.name, f.default)
                if getattr(self, f.name) != neutral:
                    raise ValueError(f"{self.variant} has no option {_OPTIONS.get(f.name, f.name)!r}")
        set_ = AttentionConfig._set  # frozen: normalised values are written once, here
        for name in ("d_in", "d_out", "head_size"):
            if name in exposed:
                check_positive_int(name, getattr(self, name))
        if "context_length" in exposed and self.context_length is not None:
            check_positive_int("context_length", self.context_length)
        head_dim = 0  # split heads: the resolved width of one head (latent: of the rope part)
        if "num_heads" in exposed:
            if decl.heads == "split":
                head_dim = check_head_dim(self.d_out, self.num_heads, self.head_dim_option)
            else:  # each wrapped head has its own width d_out: num_heads need not divide it
                check_positive_int("num_heads", self.num_heads)
        if decl.heads == "latent":
            head_dim = check_latent_widths(self)
            set_(self, "norm_eps", check_norm_eps(self.norm_eps))
            check_indexer(self)
        if "dropout" in exposed:
            set_(self, "dropout", check_dropout_rate(self.dropout))
        if "scale" in exposed:
            set_(self, "scale", check_scale(self.scale))
        for name in ("causal", "qkv_bias", "out_proj", "out_bias", "sinks", "attention_bias", "output_gate"):
            value = getattr(self, name)
            if name in exposed and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {type(value).__name__} {value!r}")
        if "out_features" in exposed:
            check_out_width(cast(int, self.d_out), self.num_heads, head_dim,
                            out_proj=self.out_proj, out_features=self.out_features)
        check_mask_strategy(self.mask_strategy)
        check_normalization(self.normalization)
        check_implementation(self.implementation)
        set_(self, "softcap", check_softcap(self.softcap))
        set_(self, "window", check_window(self.window))  # a tuple (hashable), or None
        set_(self, "chunk", check_chunk(self.chunk))  # a Python int, or None
        check_alignment(self.alignment)
        check_module_mods(self.score_mod, self.mask_mod)
        if self.num_kv_heads is not None:
            check_kv_heads(self.num_heads, self.num_kv_heads)
        for name in ("kdim", "vdim"):
            check_optional_width(name, getattr(self, name))
        if "clip_qkv" in exposed:
            set_(self, "clip_qkv", check_clip_qkv(self.clip_qkv))
        if "qk_norm" in exposed:
            _, _, eps = check_qk_norm(self.qk_norm, self.qk_norm_scope, self.qk_norm_eps)
            set_(self, "qk_norm_eps", eps)
            set_(self, "qk_norm_offset", check_qk_norm_offset(self.qk_norm, self.qk_norm_offset))
        if "qk_norm_position" in exposed:
            check_qk_norm_position(self.qk_norm, self.qk_norm_position)
        if "output_gate_activation" in exposed:
            check_output_gate(self.output_gate, self.output_gate_activation, self.output_gate_per_head,
                              self.output_gate_bias)
        if "out_norm" in exposed:
            check_out_norm(self.out_norm)
        if "qk_norm_weight" in exposed:
            check_qk_norm_weight(self.qk_norm, self.qk_norm_weight, self.qk_norm_offset)
            check_v_norm(self.v_norm)
            check_values_from_keys(self.values_from_keys, self.vdim)
            check_kv_shared(self.kv_shared, kdim=self.kdim, vdim=self.vdim, values_from_keys=self.values_from_keys,
                            v_norm=self.v_norm)
        if "query_scale" in exposed:
            set_(self, "query_scale", check_query_scale(self.query_scale))
        if "query_scale_kind" in exposed:
            check_query_scale_kind(self.query_scale, self.query_scale_kind)
        if "v_scale" in exposed:  # split heads: value heads of their own width, a value scale
            set_(self, "v_scale", check_value_heads(self.v_head_dim, self.v_scale, output_gate=self.output_gate,
                                                    values_from_keys=self.values_from_keys, kv_shared=self.kv_shared,
                                                    out_proj=self.out_proj))
        if self.rope is not None:  # its rotary dimension must fit the heads
            check_rope(self.rope, head_dim)
            check_rope_widths(self.d_in, self.kdim, self.vdim)  # self-attention only: keys from x
        if self.sinks and self.normalization != "softmax":
            raise ValueError(
                "sinks need normalization='softmax' (a sink joins the softmax's denominator); "
                f"got {self.normalization!r}"
            )

    # ------------------------------------------------------------------ reading it

    @property
    def declaration(self) -> Variant:
        return REGISTRY[self.variant]

    @property
    def has_dropout(self) -> bool:
        return self.declaration.has_dropout

    @property
    def width(self) -> int | None:
        """Output width of the query projection, the merged heads (``d_out`` or
        ``head_size``; ``num_heads * head_dim`` when ``head_dim`` is given)."""
        if self.head_dim_option is not None:
            return self.num_heads * self.head_dim_option
        if self.declaration.heads == "latent":  # the merged heads' values, o_proj's input
            return self.num_heads * cast(int, self.v_head_dim)
        name = self.declaration.width
        return None if name is None else getattr(self, name)

    @property
    def head_dim(self) -> int | None:
        """Width of one head's queries, keys and values: the ``head_dim`` option, else
        ``d_out // num_heads`` (split heads), the projections' width, or ``d_in``."""
        if self.head_dim_option is not None:
            return self.head_dim_option
        if self.declaration.heads == "latent":  # qk_head_dim: a query's (and a key's) width
            return cast(int, self.qk_nope_head_dim) + cast(int, self.qk_rope_head_dim)
        width = self.width
        if width is None:
            return self.d_in
        return width // self.num_heads if self.declaration.heads == "split" else width

    @property
    def value_head_dim(self) -> int | None:
        """Width of one value head: ``v_head_dim`` where set (latent attention's; split heads'
        option), else ``head_dim``."""
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    @property
    def value_width(self) -> int | None:
        """The merged heads' width after attention (the output projection's input):
        ``num_heads * v_head_dim`` for split heads with value heads of their own width, else
        ``width``."""
        if self.v_head_dim is not None and self.declaration.heads == "split":
            return self.num_heads * self.v_head_dim
        return self.width

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, else ``num_heads`` (grouped-query attention
        when fewer)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def fan_in(self, role: str) -> int | None:
        """Input width of the projection of ``role``: ``kdim``/``vdim`` for key/value
        (``d_in`` when None), the merged heads' width for ``out``, else ``d_in`` (latent
        attention: ``q_lora_rank`` for ``query_b``, ``kv_lora_rank`` for ``latent_up``)."""
        if role == "query_b":
            return self.q_lora_rank
        if role == "latent_up":
            return self.kv_lora_rank
        if role == "out":
            return self.value_width
        if role == "key" and self.kdim is not None:
            return self.kdim
        if role == "value" and self.vdim is not None:
            return self.vdim
        return self.d_in

    def fan_out(self, role: str) -> int | None:
        """Output width of the projection of ``role``: key/value projections are sized for
        ``kv_heads`` heads of ``head_dim``; ``out`` maps to ``out_features`` (None:
        ``d_out``); query to the merged heads' width, twice that with ``output_gate``
        (each head's queries and its gate).  Latent attention: see ``latent_fan_out``."""
        if self.declaration.heads == "latent":
            return self.latent_fan_out(role)
        width = self.width
        if role == "query" and self.output_gate and width is not None:  # each head's queries, then its gate
            return width + (self.num_heads if self.output_gate_per_head else width)
        if role == "out":
            return self.d_out if self.out_features is None else self.out_features
        if role == "value" and self.v_head_dim is not None:
            return self.v_head_dim * self.kv_heads
        if role in ("key", "value") and width is not None and self.kv_heads != self.num_heads:
            return cast(int, self.head_dim) * self.kv_heads
        return width

    def latent_fan_out(self, role: str) -> int:
        """Latent attention's output widths: queries (``query``, ``query_b``) ``num_heads
        * qk_head_dim``, ``query_a`` ``q_lora_rank``, ``latent`` ``kv_lora_rank +
        qk_rope_head_dim`` (the latent and the shared rope key), ``latent_up`` ``num_heads
        * (qk_nope_head_dim + v_head_dim)`` (each head's nope key and value), ``out`` d_in."""
        widths = {
            "query": self.num_heads * cast(int, self.head_dim),
            "query_a": self.q_lora_rank,
            "latent": cast(int, self.kv_lora_rank) + cast(int, self.qk_rope_head_dim),
            "latent_up": self.num_heads * (cast(int, self.qk_nope_head_dim) + cast(int, self.v_head_dim)),
            "out": self.d_in,
        }
        widths["query_b"] = widths["query"]
        return cast(int, widths[role])

    def latent_norms(self) -> tuple[tuple[str, int], ...]:
        """Latent attention's RMSNorms, ``(name, width)`` (Hugging Face's names):
        ``q_a_layernorm`` over ``q_lora_rank`` (when set), ``kv_a_layernorm`` over
        ``kv_lora_rank``; none for other variants."""
        if self.declaration.heads != "latent":
            return ()
        q = (("q_a_layernorm", cast(int, self.q_lora_rank)),) if self.q_lora_rank is not None else ()
        return (*q, ("kv_a_layernorm", cast(int, self.kv_lora_rank)))

    def cache_widths(self) -> tuple[int, int, int]:
        """A KV cache's (heads, key width, value width): ``(kv_heads, head_dim, head_dim)``;
        latent attention caches one latent (``kv_lora_rank``) and one rope key
        (``qk_rope_head_dim``) a token, in the key and value fields; with an indexer (DSA)
        the key field holds the latent then the indexer's key (``index_head_dim``)."""
        if self.declaration.heads == "latent":  # (with an indexer: its key after the latent)
            return 1, cast(int, self.kv_lora_rank) + (self.index_head_dim or 0), cast(int, self.qk_rope_head_dim)
        return self.kv_heads, cast(int, self.head_dim), cast(int, self.value_head_dim)

    def qk_norms(self) -> tuple[tuple[str, str, int], ...]:
        """The query/key norms this config creates, ``(name, role, width)``: none without
        ``qk_norm`` or with ``qk_norm_weight=False`` (a weightless norm, no module); ``q_norm`` and ``k_norm`` (Hugging Face's names), each ``head_dim``
        wide (``qk_norm_scope="head"``) or as wide as its role's heads (``"all"``: the
        projection's width; the queries' without an output gate's half)."""
        if self.qk_norm is None or not self.qk_norm_weight:  # (a weightless norm has no module)
            return ()
        return tuple(
            (name, role, cast(int, self.head_dim if self.qk_norm_scope == "head"
                              else self.width if role == "query" else self.fan_out(role)))
            for name, role in (("q_norm", "query"), ("k_norm", "key"))
            if role == "query" or not self.kv_shared  # a kv_shared module's keys come normed
        )

    def gate_width(self) -> int:
        """An output gate's features a head (W_query's rows after each head's queries): 1
        with ``output_gate_per_head``, else ``head_dim``; 0 without a gate."""
        if not self.output_gate:
            return 0
        return 1 if self.output_gate_per_head else cast(int, self.head_dim)

    def out_norms(self) -> tuple[tuple[str, int], ...]:
        """The norm of the merged heads this config creates, ``(name, width)``:
        ``("out_norm", value_width)`` with ``out_norm`` (``num_heads * head_dim``, or
        ``num_heads * v_head_dim`` for value heads of their own width), else none."""
        return (("out_norm", cast(int, self.value_width)),) if self.out_norm is not None else ()

    def options(self) -> dict[str, Any]:
        """The constructor keywords, in signature order: ``cls(**config.options())``
        rebuilds the module (with the framework's own dtype/device/rngs)."""
        return {name: getattr(self, _FIELDS.get(name, name)) for name in self.declaration.options}

    def projections(self) -> tuple[Projection, ...]:
        """The projections this configuration creates, in creation order."""
        return tuple(p for p in self.declaration.projections if p.exists(self))

    def projection(self, role: str) -> Projection | None:
        """The projection of ``role`` (``"query"``, ``"key"``, ``"value"``, ``"out"``) that
        this config creates, None if it has none (``out`` with ``out_proj=False``)."""
        return next((p for p in self.projections() if p.role == role), None)

    def head(self) -> AttentionConfig:
        """A wrapper's per-head configuration (its ``head_variant`` with one head)."""
        decl = self.declaration
        if decl.head_variant is None:
            raise ValueError(f"{self.variant} does not wrap heads")
        opts = self.options()
        head_opts = {k: opts[k] for k in REGISTRY[decl.head_variant].options if k in opts}
        return make_config(decl.head_variant, head_opts)


def make_config(name: str, options: Mapping[str, Any]) -> AttentionConfig:
    """The validated config of variant ``name`` from a mapping that holds (at least) its
    constructor keywords; missing ones take the declared default, other keys are ignored
    (so a constructor can pass ``locals()``).  Raises TypeError for a missing required
    argument, TypeError/ValueError for a bad value."""
    decl = variant(name)
    values: dict[str, Any] = {}
    for option in decl.signature:
        field = _FIELDS.get(option.name, option.name)
        if option.name in options:
            values[field] = options[option.name]
        elif option.default is REQUIRED:
            raise TypeError(f"{name}() missing required argument: {option.name!r}")
        else:
            values[field] = option.default
    return AttentionConfig(name, **dict(decl.fixed), **values)
