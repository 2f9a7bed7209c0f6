"""Weights in and out of the PyTorch twins, in either framework's layout.  Needs no JAX.

Twin of ``jax_attention/interop.py``: both offer ``torch_state_dict``, ``flax_arrays``,
``load_torch_state_dict`` and ``load_flax_arrays`` for their own modules, plus
array-level converters for checkpoints.  The map is declared in
``attention_spec.interop.conversion`` (names, transposes, shapes); a load checks everything
before it writes anything, so a failed load leaves the module as it was.

Native PyTorch and packed checkpoints: ``from_nn_multihead`` / ``to_nn_multihead`` go
between ``torch.nn.MultiheadAttention`` and our ``MultiHeadAttention`` through the rules
of ``attention_spec.interop.packing.nn_multihead_rules``, and
``load_packed_qkv`` loads a packed q/k/v checkpoint (GPT-2's ``c_attn``/``c_proj``,
``nn.Linear`` packing) with the split of ``attention_spec.interop.packing``.

Hugging Face: ``from_hf(layer)`` / ``to_hf(ours, layer)`` (in ``torch_attention._hf``) go
between the attention layer of a ``transformers`` model (``supported_hf_classes()``) and
our ``MultiHeadAttention``, options read from the layer and its config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from attention_spec.interop.conversion import (
    Path,
    as_numpy,
    flatten_paths,
    flax_to_torch,
    rules_for,
    torch_to_flax,
)
from attention_spec.interop.native import ANY, Check, native_options, refusals, spec_refusals
from attention_spec.interop.packing import nn_multihead_rules, not_ours_message, packed_state_dict
from attention_spec.interop.specs import run_rules
from attention_spec.registry import AttentionConfig
from torch_attention._base import AttentionModule
from torch_attention._hf import from_hf, supported_hf_classes, to_hf
from torch_attention._state import (
    _tensor,
    flax_arrays,
    load_flax_arrays,
    load_torch_state_dict,
    torch_state_dict,
)
from torch_attention.multihead import MultiHeadAttention

__all__ = [
    "flax_arrays",
    "from_hf",
    "from_nn_multihead",
    "load",
    "load_flax_arrays",
    "load_packed_qkv",
    "load_torch_state_dict",
    "state_dict_from_flax",
    "state_dict_to_flax",
    "save",
    "supported_hf_classes",
    "to_hf",
    "to_nn_multihead",
    "torch_state_dict",
]


def state_dict_to_flax(
    state_dict: Mapping[str, Any], variant: str, config: Mapping[str, Any]
) -> dict[Path, np.ndarray]:
    """A PyTorch ``state_dict`` (tensors or arrays) -> {Flax path: NumPy array}."""
    return torch_to_flax({k: as_numpy(v) for k, v in state_dict.items()}, rules_for(variant, config))


def state_dict_from_flax(
    arrays: Mapping[Any, Any], variant: str, config: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """Flax arrays ({path: array}, {"a/b": array} or nested) -> PyTorch-named arrays."""
    return flax_to_torch(flatten_paths(arrays), rules_for(variant, config))


# --------------------------------------------------------------------------- packed checkpoints


def load_packed_qkv(
    module: nn.Module,
    qkv_weight: Any,
    qkv_bias: Any = None,
    *,
    layout: str,
    packing: str = "thirds",
    out_weight: Any = None,
    out_bias: Any = None,
) -> nn.Module:
    """Loads a packed q/k/v checkpoint into one of our modules with its own q/k/v
    projections (``MultiHeadAttention``, ``CausalAttention``, ``SelfAttention_v2``, ...),
    cast to the module's dtype; returns the module.

    ``layout`` (keyword, required: a square weight cannot tell) applies to both weights:
      ``"in_out"``: ``qkv_weight`` (d_in, 3*d_out), ``out_weight`` (d_out, d_out) as (in, out),
      applied as ``x @ W``: GPT-2's ``Conv1D`` (``c_attn.weight``, ``c_proj.weight``);
      ``"out_in"``: ``qkv_weight`` (3*d_out, d_in), ``out_weight`` as (out, in), applied as
      ``x @ W.T``: ``nn.Linear`` and ``nn.MultiheadAttention.in_proj_weight``.
    ``packing`` orders the packed axis (``attention_spec.interop.packing.split_qkv``):
      ``"thirds"`` (the default): ``[q; k; v]`` in equal blocks, heads contiguous within
      each (GPT-2, ``nn.MultiheadAttention``); ``"per_head"``: each head's query, key and
      value rows in turn, ``(num_heads, 3, head_dim)`` (GPT-NeoX's ``query_key_value``,
      ``layout="out_in"``); ``"grouped"``: ``[q; k; v]`` with the module's ``num_heads``
      query heads and ``num_kv_heads`` key/value heads (Phi-3's ``qkv_proj``,
      ``layout="out_in"``).  ``qkv_weight`` is then (num_heads + 2*num_kv_heads)*head_dim
      wide along the packed axis.
    ``qkv_bias`` (3*d_out,) must be given exactly when the module has q/k/v biases.
    ``out_weight=None`` leaves ``out_proj`` as it is; ``out_weight`` without ``out_bias``
    loads a zero bias (our ``out_proj`` always has one).

    Everything is checked before anything is written (a failure leaves the module as it
    was): TypeError for a module that is not one of ours or non-floating arrays;
    ValueError for a bad ``layout`` or ``packing``, shapes that do not fit the module
    (d_in, d_out; the packed shape that ``packing`` expects), ``"thirds"`` for a module
    with grouped-query heads, a
    ``qkv_bias`` for a module without q/k/v biases or none for one with them, an
    ``out_weight`` for a module without ``out_proj``, an ``out_bias`` without ``out_weight``,
    or a variant without q/k/v projections of its own.
    """
    if not isinstance(module, AttentionModule):
        raise TypeError(not_ours_message(module))
    parts = packed_state_dict(
        module.spec, qkv_weight, qkv_bias, layout=layout, packing=packing, out_weight=out_weight,
        out_bias=out_bias,
    )
    # The parts not in the checkpoint (out_proj when out_weight is None) keep their values;
    # load_torch_state_dict checks the whole set again and writes only after every check.
    return load_torch_state_dict(module, {**torch_state_dict(module), **parts})


# --------------------------------------------------------------------------- nn.MultiheadAttention


# What our MultiHeadAttention reproduces of nn.MultiheadAttention's constructor options
# (those it keeps as attributes; ``bias`` and ``add_bias_kv`` are read from its
# parameters): any other one not at its default (``add_zero_attn=True``, an option added
# to torch later) is refused by name.
_FROM_NN_MULTIHEAD_CARRIES: dict[str | tuple[str, ...], Check] = {
    "embed_dim": ANY,
    "num_heads": ANY,
    "dropout": ANY,
    "kdim": ANY,
    "vdim": ANY,
    "batch_first": ANY,  # ours is batch-first: the caller transposes (see below)
}


def from_nn_multihead(mha: nn.MultiheadAttention) -> MultiHeadAttention:
    """A ``torch.nn.MultiheadAttention`` -> our ``MultiHeadAttention`` with the same
    weights (copied exactly), dropout rate, dtype, device and train/eval mode:
    ``d_in = d_out = embed_dim``, ``causal=False``, ``context_length=None`` (no cap),
    ``qkv_bias`` = whether ``in_proj_bias`` exists, scale ``1/sqrt(head_dim)`` as torch's,
    and its ``kdim``/``vdim`` (cross-attention: call ours as ``module(query,
    context=(key, value))`` where torch's is ``mha(query, key, value)``).

    Inputs: ours is always batch-first, (batch, seq, embed_dim) or unbatched (seq,
    embed_dim).  For a ``batch_first=False`` module, transpose (seq, batch, embed_dim)
    inputs and outputs yourself (``x.transpose(0, 1)``); the result is one of our modules
    (not a wrapper), so that the harness, ``to_flax`` and ``to_nn_multihead`` take it.
    Masks: ``key_padding_mask`` goes through ``from_key_padding_mask``, a bool
    ``attn_mask`` (True = blocked) through ``from_blocked_mask``; combine them with
    ``combine_masks`` and pass the result as ``mask=``.  A module built with ``bias=False``
    has no ``out_proj`` bias, ours always has one: it is imported as zeros (the same
    function; ``to_nn_multihead`` maps it back to ``bias=False``).

    Raises TypeError for another class; ValueError, naming each option, for
    ``add_bias_kv=True`` and ``add_zero_attn=True`` (no equivalent here), and for any
    constructor option outside the allow-list (``_FROM_NN_MULTIHEAD_CARRIES``) that is not
    at its default.  Separate q/k/v
    weights (``q_proj_weight``, ...; torch's layout when kdim/vdim differ from embed_dim)
    are read like ``in_proj_weight``'s three blocks.
    The call draws no random numbers (the new module is built on the meta device).
    """
    if not isinstance(mha, nn.MultiheadAttention):
        raise TypeError(f"from_nn_multihead takes a torch.nn.MultiheadAttention; got {type(mha).__name__}")
    embed_dim, num_heads = int(mha.embed_dim), int(mha.num_heads)
    problems = refusals(*native_options(mha, nn.MultiheadAttention), _FROM_NN_MULTIHEAD_CARRIES, mha,
                        "our MultiHeadAttention")
    if mha.bias_k is not None or mha.bias_v is not None:  # add_bias_kv is kept as these parameters
        problems.insert(0, "add_bias_kv=True (learned bias key/value rows appended to the sequence)")
    kdim, vdim = int(mha.kdim), int(mha.vdim)
    if mha.in_proj_weight is None:
        shapes = [tuple(w.shape) for w in (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)]
        expected = [(embed_dim, embed_dim), (embed_dim, kdim), (embed_dim, vdim)]
        if not problems and shapes != expected:
            problems.append(f"q/k/v projection weights of shapes {shapes}, not {expected}")
    if problems:
        raise ValueError(
            "this nn.MultiheadAttention cannot be expressed as MultiHeadAttention: " + "; ".join(problems)
        )
    out_weight = mha.out_proj.weight.detach()
    module = MultiHeadAttention(
        embed_dim, embed_dim, None, float(mha.dropout), num_heads, qkv_bias=mha.in_proj_bias is not None,
        causal=False, kdim=None if kdim == embed_dim else kdim, vdim=None if vdim == embed_dim else vdim,
        dtype=out_weight.dtype, device="meta",
    ).to_empty(device=out_weight.device)
    rules = nn_multihead_rules(packed=mha.in_proj_weight is not None, qkv_bias=mha.in_proj_bias is not None,
                               out_bias=mha.out_proj.bias is not None)
    native = {tuple(name.split(".")): as_numpy(p) for name, p in mha.named_parameters()}
    state = run_rules(native, rules, "to_torch")
    if mha.out_proj.bias is None:  # ours always has an output bias: a bias-free projection is a zero one
        state["out_proj.bias"] = np.zeros(embed_dim, as_numpy(out_weight).dtype)
    load_torch_state_dict(module, state)
    return module.train(mha.training)


def _linears(module: MultiHeadAttention) -> tuple[list[nn.Linear], nn.Linear | None]:
    """W_query, W_key, W_value and out_proj (None with out_proj=False), typed as what they are."""
    qkv = [cast(nn.Linear, getattr(module, name)) for name in ("W_query", "W_key", "W_value")]
    return qkv, cast("nn.Linear | None", module.out_proj)


def _nn_multihead_scale(spec: AttentionConfig) -> str | None:
    head_dim = cast(int, spec.head_dim)
    if spec.scale is None or math.isclose(spec.scale, 1.0 / math.sqrt(head_dim), rel_tol=1e-12):
        return None
    return f"scale={spec.scale!r} (nn.MultiheadAttention scales by 1/sqrt(head_dim) = {1.0 / math.sqrt(head_dim)!r})"


def _nn_multihead_widths(spec: AttentionConfig) -> str | None:
    if spec.width == spec.d_out and spec.fan_out("out") == spec.d_out:
        return None
    return (f"head_dim={spec.head_dim}, out_features={spec.fan_out('out')} with d_out={spec.d_out} "
            "(nn.MultiheadAttention's heads split embed_dim, and its out_proj maps embed_dim to embed_dim)")


# What nn.MultiheadAttention reproduces of our MultiHeadAttention, option by option (the
# allow-list of ``attention_spec.interop.native``): any other option of ours that is not at its
# default is refused by name, so an option added later is refused until declared here.
_NN_MULTIHEAD_CARRIES: dict[str | tuple[str, ...], Check] = {
    "causal": lambda s: None if not s.causal else (
        "causal=True (nn.MultiheadAttention takes a causal mask per call, attn_mask or is_causal; "
        "build the module with causal=False)"),
    "out_proj": lambda s: None if s.out_proj else "out_proj=False (nn.MultiheadAttention always has an output "
                                                  "projection)",
    ("d_in", "d_out"): lambda s: None if s.d_in == s.d_out else (
        f"d_in={s.d_in} != d_out={s.d_out} (nn.MultiheadAttention maps embed_dim to embed_dim)"),
    "scale": _nn_multihead_scale,
    "num_kv_heads": lambda s: None if s.kv_heads == s.num_heads else (
        f"num_kv_heads={s.num_kv_heads} (grouped-query heads; nn.MultiheadAttention has one key/value head per "
        "query head)"),
    ("head_dim", "out_features"): _nn_multihead_widths,
    # one bias switch: a bias-free out_proj with qkv_bias=False, or (checked on the
    # weights) a zero one, goes out as bias=False
    ("qkv_bias", "out_bias"): lambda s: None if s.out_bias or not s.qkv_bias else (
        "out_bias=False with qkv_bias=True (nn.MultiheadAttention's one bias switch gives both or neither)"),
    "num_heads": ANY,
    "dropout": ANY,
    "kdim": ANY,
    "vdim": ANY,
    "context_length": ANY,  # a cap on the input, not part of the computation: not kept
    "mask_strategy": ANY,  # every path computes "renormalize" in the "fill" form: the same numbers
    "implementation": ANY,  # which of our paths computes it; all of them are under the parity harness
}


def to_nn_multihead(module: MultiHeadAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """Our ``MultiHeadAttention`` -> a ``torch.nn.MultiheadAttention`` with the same weights
    (copied exactly, ``in_proj_weight`` = [W_query; W_key; W_value]), dropout rate,
    dtype, device and train/eval mode.  ``batch_first`` is the new module's (ours is
    batch-first; the default keeps it so).  ``bias`` = ``qkv_bias``; with ``qkv_bias=False``
    the ``out_proj`` bias must be all zeros (``nn.MultiheadAttention`` has one ``bias``
    switch for both) and is dropped.  ``context_length`` (a cap on the input, not part of
    the computation) is not kept: ``nn.MultiheadAttention`` has none.

    What is exported is decided by an allow-list (``_NN_MULTIHEAD_CARRIES``): the options
    that ``nn.MultiheadAttention`` reproduces, with the values it supports; every other
    option of ours that is not at its default (``softcap``, ``window``, ``qk_norm``,
    ``rope``, ``sinks``, ..., and any option added later) is refused by name.

    Raises TypeError for another class; ValueError naming every option that
    ``nn.MultiheadAttention`` cannot express: ``causal=True`` (it takes the causal mask per
    call: pass ``attn_mask``/``is_causal`` there, or build ours with ``causal=False``),
    ``out_proj=False``, ``d_in != d_out``, a ``scale`` other than 1/sqrt(head_dim), a
    nonzero ``out_proj`` bias with ``qkv_bias=False``, ``out_bias=False`` with
    ``qkv_bias=True``, a ``head_dim`` or ``out_features`` other than ``d_out``'s, and any
    option outside the allow-list that is not at its default.  Nothing is built before
    every check passed; the call draws no random numbers.
    """
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"to_nn_multihead takes torch_attention.MultiHeadAttention; got {type(module).__name__}")
    spec = module.spec
    qkv, out_proj = _linears(module)
    problems = spec_refusals(spec, _NN_MULTIHEAD_CARRIES, "nn.MultiheadAttention")
    if not spec.qkv_bias and out_proj is not None and out_proj.bias is not None and bool(
            out_proj.bias.detach().ne(0).any()):
        problems.append(
            "a nonzero out_proj bias with qkv_bias=False (nn.MultiheadAttention's one bias switch "
            "gives both or neither)"
        )
    if problems:
        raise ValueError("nn.MultiheadAttention cannot express this MultiHeadAttention: " + "; ".join(problems))
    assert out_proj is not None
    weight = qkv[0].weight
    mha = nn.MultiheadAttention(
        spec.d_out, spec.num_heads, dropout=float(spec.dropout), bias=bool(spec.qkv_bias),
        batch_first=batch_first, kdim=spec.kdim, vdim=spec.vdim, dtype=weight.dtype, device="meta",
    ).to_empty(device=weight.device)
    # kdim / vdim: torch keeps three separate weights instead of in_proj_weight
    rules = nn_multihead_rules(packed=mha.in_proj_weight is not None, qkv_bias=bool(spec.qkv_bias),
                               out_bias=bool(spec.qkv_bias))
    params = dict(mha.named_parameters())
    ready = {name: _tensor(array, params[name]) for name, array in
             ((".".join(path), array) for path, array in run_rules(torch_state_dict(module), rules, "to_flax").items())}
    with torch.no_grad():
        for name, tensor in ready.items():
            params[name].copy_(tensor)
    return mha.train(module.training)


# --------------------------------------------------------------------------- files


def save(module: nn.Module, path: Any, *, format: str | None = None, layout: str = "torch") -> None:
    """Writes one of our modules' parameters to ``path``, atomically (a temporary name in
    the same directory, renamed when complete; an existing file is untouched on failure).
    A directory ``path`` is refused; a symlink ``path`` is written through.

    ``format``: ``"safetensors"`` or ``"pt"`` (a ``torch.save`` state dict), else from the
    extension (``.safetensors``, ``.pt``/``.pth``).  ``layout``: ``"torch"`` (``W_query.weight``,
    (out, in)) or ``"flax"`` (safetensors only: ``W_query/kernel``, (in, out), what
    ``jax_attention.interop.load`` reads as well).  Flax msgpack and Orbax need flax: write
    them with ``jax_attention.interop.save`` or ``python -m parity_tests.convert``.
    Raises ``attention_spec.interop.files.CheckpointError`` (a ValueError) for an unknown format, a
    format that cannot hold the layout or a ``path`` that is a directory, before anything
    is written; OSError naming ``path`` when the write fails.
    """
    from attention_spec.interop.files import flax_names, write_arrays

    _torch_formats(path, format, "save")
    if layout == "flax":
        write_arrays(flax_names(flax_arrays(module)), path, layout="flax", format=format)
    else:
        write_arrays(torch_state_dict(module), path, layout=layout, format=format)


def load(module: nn.Module, path: Any, *, format: str | None = None) -> nn.Module:
    """Reads ``path`` into one of our modules (cast to its dtype) and returns it.

    Reads safetensors in either layout (a name with ``/`` means Flax's: ``W_query/kernel``,
    transposed on the way) and ``.pt``/``.pth`` state dicts (``torch.load(...,
    weights_only=True)``).  Raises ``attention_spec.interop.files.CheckpointError`` for an
    unreadable or truncated file, an unknown format, or msgpack/Orbax (they need flax);
    the map's ValueError listing missing, unexpected and misshaped parameters; TypeError
    for non-floating arrays.  Nothing is written to the module unless every check passed.
    """
    from attention_spec.interop.files import read_arrays

    layout, arrays = read_arrays(path, _torch_formats(path, format, "load"))
    if layout == "flax":
        return load_flax_arrays(module, arrays)
    return load_torch_state_dict(module, arrays)


def _torch_formats(path: Any, format: str | None, what: str) -> str:
    from attention_spec.interop.files import CheckpointError, format_for

    fmt = format_for(path, format)
    if fmt not in ("safetensors", "pt"):
        raise CheckpointError(
            f"torch_attention.interop.{what} handles safetensors and .pt files; {fmt} needs flax: use "
            "jax_attention.interop or python -m parity_tests.convert"
        )
    return fmt
