"""Checkpoint conversion between the twins' layouts and file formats.

    python -m parity_tests.convert IN OUT --to flax|torch --variant NAME [--config JSON]
        [--format FMT] [--input-format FMT]

Reads ``IN`` in either layout (a ``.pt`` state dict, a ``.safetensors`` file with PyTorch
names ``W_query.weight`` or Flax paths ``W_query/kernel``, Flax ``.msgpack``, an Orbax
directory), checks every name and shape against the declared map of ``--variant`` with the
constructor keywords of ``--config`` (a JSON object, e.g. ``'{"d_in": 16, "d_out": 16,
"context_length": 32, "dropout": 0.0, "num_heads": 4}'``; a ``rope`` as the object of its
``RopeConfig`` fields, ``{"rope": {"theta": 500000.0}}``: it adds no weight, and the map
checks the config it is part of) and writes ``OUT`` in the layout
of ``--to``: ``torch`` to ``.safetensors`` or ``.pt``/``.pth``, ``flax`` to
``.safetensors``, ``.msgpack`` or an Orbax directory (``--format orbax``).  The formats
come from the extensions unless ``--format`` (OUT) or ``--input-format`` (IN) names them.
Arrays are copied bit for bit (only renamed and transposed), in their own dtype.

A safetensors ``IN``'s own ``__metadata__`` is carried into a safetensors ``OUT``, every
key as it is, beside the converter's one key, ``format`` (``"pt"`` or ``"flax"``: the
layout written).  Where ``IN``'s ``format`` names the other layout (Hugging Face writes
``{"format": "pt"}``), ``OUT``'s names the layout written (a round trip gives the input's
metadata back); any other value of ``IN``'s ``format`` is kept as
``converted_from_format``.  The command says what it chose.  A ``.pt``, msgpack or Orbax ``OUT`` has
no place for it: the command says it was not kept.

A whole model (a ``transformers`` model and its Flax NNX port, say) converts from code in
one call, ``convert_model(torch_model, flax_model, OUT, to=...)``: the weight map is the one
``infer_param_map`` derives from the two models (or ``param_map=``), and the file holds every
parameter of the side converted from, in the layout of ``to`` (PyTorch's names, such as
``model.layers.0.self_attn.q_proj.weight``, or Flax's ``/``-joined paths, such as
``model/layers/0/self_attn/W_query/kernel``).  It checks everything before it writes
anything, with the same file rules as the command.  (The command converts files of one
attention module; a whole model needs both models built, so it has no command.)

Exit status: 0 on success; 2, with one line on stderr naming the problem, for an
unreadable or truncated file, missing, unexpected or misshaped parameters, an unknown
variant, format or extension, a bad config, an ``OUT`` that must not be replaced, or a
failed write.  ``OUT`` is written under a temporary name and renamed only when complete:
on failure no partial ``OUT`` is left and an existing ``OUT`` is unchanged.  An existing
directory is replaced only by an Orbax checkpoint and only when it is an Orbax checkpoint
that this library wrote (``.`` or any other directory is refused); a file format refuses
a directory.  A symlink ``OUT`` is written through; a new file gets the mode ``open()``
gives one (0666 less the umask).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attention_spec.interop import files
from attention_spec.interop.files import FORMATS, checked_config, convert_file
from attention_spec.registry import VARIANTS, variant


def convert_model(torch_model: Any, flax_model: Any, path: str | os.PathLike[str], *, to: str = "flax",
                  param_map: Any = None, format: str | None = None) -> dict[str, Any]:
    """Writes a whole model's weights as one checkpoint file, in one call, given both models.

    ``to="flax"``: the PyTorch model's parameters in the Flax model's layout (``/``-joined
    paths, Flax kernels), to safetensors, msgpack or Orbax; ``to="torch"``: the Flax model's
    parameters in the PyTorch model's layout (its ``named_parameters`` names: a tied weight
    once, as PyTorch lists it), to safetensors or ``.pt`` / ``.pth``.  The format comes from
    the extension unless ``format`` names it.  ``param_map``: the rules or the mapping form
    ``check_parity`` takes; None: ``infer_param_map(torch_model, flax_model)``.  Arrays are
    copied bit for bit (renamed, transposed, split or merged as the rules say), in their
    own dtypes.

    Refuses before writing anything when the conversion cannot be complete: a parameter of
    either model paired with nothing, a shape that the rules do not carry to the other
    side's, an array that is not floating point (ValueError / TypeError listing every
    problem), an unknown ``to`` or format, a layout the format cannot hold, or a
    destination that must not be replaced (``CheckpointError``: a directory for a file
    format, a directory that is not an Orbax checkpoint this library wrote).  The file is
    written under a temporary name and renamed when complete: on failure no partial file is
    left and an existing one is unchanged; nothing this library did not write is removed.
    Returns what was written, {name: NumPy array}."""
    from flax import nnx

    from attention_spec.interop.numpy_arrays import check_float_arrays
    from attention_spec.interop.specs import apply_specs
    from parity_tests.harness import _resolve_param_map, as_numpy, flax_param_shapes
    from parity_tests.param_map import infer_param_map

    if to not in ("flax", "torch"):
        raise ValueError(f"to must be 'flax' or 'torch'; got {to!r}")
    fmt = files.format_for(path, format)
    files._check_layout(fmt, to)
    files._destination(path, fmt)  # one that must not be replaced, before any array is read
    rules = _resolve_param_map(torch_model, flax_model, infer_param_map(torch_model, flax_model)
                               if param_map is None else param_map)
    if to == "flax":
        source = {n: as_numpy(p) for n, p in torch_model.named_parameters()}
        check_float_arrays(source, "the PyTorch model")
        arrays = files.flax_names(apply_specs(source, rules, "to_flax", expected=flax_param_shapes(flax_model)))
    else:
        source_flax = {tuple(p): as_numpy(v[...]) for p, v in nnx.to_flat_state(nnx.state(flax_model, nnx.Param))}
        check_float_arrays(source_flax, "the Flax model")
        shapes = {n: tuple(p.shape) for n, p in torch_model.named_parameters()}
        arrays = apply_specs(source_flax, rules, "to_torch", expected=shapes)
    written = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    files.write_arrays(written, path, layout=to, format=fmt)
    return written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parity_tests.convert",
        description="Convert an attention checkpoint between the PyTorch and Flax layouts and file formats.",
    )
    parser.add_argument("input", metavar="IN", help="checkpoint to read (.safetensors, .pt, .pth, .msgpack, "
                        "or an Orbax directory)")
    parser.add_argument("output", metavar="OUT", help="checkpoint to write")
    parser.add_argument("--to", required=True, choices=("flax", "torch"), help="layout of OUT")
    parser.add_argument("--variant", required=True, metavar="NAME", help=f"one of {', '.join(VARIANTS)}")
    parser.add_argument("--config", default="{}", metavar="JSON",
                        help="the module's constructor keywords as a JSON object (rope: an object of RopeConfig fields)")
    parser.add_argument("--format", choices=FORMATS, default=None, help="format of OUT (default: its extension)")
    parser.add_argument("--input-format", choices=FORMATS, default=None,
                        help="format of IN (default: its extension)")
    return parser


def _one_line(error: BaseException) -> str:
    """The map's errors list one problem a line under a heading ending in ':'."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    head, rest = lines[0], lines[1:]
    if not rest:
        return head
    return f"{head} {'; '.join(rest)}" if head.endswith(":") else "; ".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the converter; returns the exit status (0, or 2 after one line on stderr)."""
    args = _parser().parse_args(argv)
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as e:
        print(f"convert: error: --config is not valid JSON: {e}", file=sys.stderr)
        return 2
    if not isinstance(config, dict):
        print(f"convert: error: --config must be a JSON object of constructor keywords; got {args.config}",
              file=sys.stderr)
        return 2
    try:
        variant(args.variant)
    except ValueError as e:
        print(f"convert: error: unknown variant: {_one_line(e)}", file=sys.stderr)
        return 2
    try:
        spec = checked_config(args.variant, config)
    except (ValueError, TypeError) as e:
        print(f"convert: error: bad --config for {args.variant}: {_one_line(e)}", file=sys.stderr)
        return 2
    try:
        kept = _input_metadata(args.input, args.input_format)
        if kept and files.format_for(args.output, args.format) == "safetensors":
            metadata, notes = _merged_metadata(kept, args.to)
            arrays = _convert_keeping(args.input, args.output, to=args.to, variant_name=args.variant, config=spec,
                                      src_format=args.input_format, metadata=metadata)
        else:
            arrays = convert_file(args.input, args.output, to=args.to, variant_name=args.variant, config=spec,
                                  src_format=args.input_format, dst_format=args.format)
            notes = ([f"the input's __metadata__ ({_keys(kept)}) is not kept: a "
                      f"{files.format_for(args.output, args.format)} checkpoint has no place for it"] if kept else [])
    except (ValueError, TypeError, OSError) as e:  # OSError: OUT's directory unwritable, a full disk
        print(f"convert: error: {_one_line(e)}", file=sys.stderr)
        return 2
    print(f"wrote {len(arrays)} arrays of {args.variant} in {args.to} layout to {args.output}")
    for note in notes:
        print(f"note: {note}")
    return 0


def _input_metadata(path: str, input_format: str | None) -> dict[str, str]:
    """A safetensors file's own ``__metadata__`` ({} for another format, or none); a file
    that cannot be read is left to the conversion, which names what is wrong with it."""
    try:
        if files.format_for(path, input_format) != "safetensors" or not os.path.isfile(path):
            return {}
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size > 100_000_000:  # not a safetensors file: the reader says so
                return {}
            header = json.loads(f.read(size).decode("utf-8"))
    except (ValueError, OSError, UnicodeDecodeError):
        return {}
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return {}  # malformed: the reader refuses it, naming it
    return {str(k): v for k, v in metadata.items()}


def _keys(metadata: Mapping[str, str]) -> str:
    return f"{len(metadata)} key" + ("" if len(metadata) == 1 else "s")


def _merged_metadata(kept: Mapping[str, str], to: str) -> tuple[dict[str, str], list[str]]:
    """(OUT's metadata, what the command says about it): ``kept`` as it is, beside the
    converter's ``format`` (the layout written); a ``format`` of ``kept`` that is not a
    layout's name (``pt``, ``flax``) is kept as ``converted_from_format``."""
    own = "pt" if to == "torch" else "flax"
    merged = dict(kept)
    notes = [f"kept the input's __metadata__ ({_keys(kept)})"]
    theirs = kept.get("format")
    if theirs in ("pt", "flax") and theirs != own:  # a layout's name: the input's, which the conversion changed
        notes.append(f"the input's __metadata__ says {{'format': {theirs!r}}}, the layout it held: OUT's is {own!r}, "
                     "the layout written")
    elif theirs is not None and theirs != own:  # a value of the user's own: kept under another key
        if "converted_from_format" in kept:
            notes.append(f"the input's __metadata__ says {{'format': {theirs!r}}}: OUT's format is {own!r}, the "
                         "layout written (its converted_from_format is kept as it was)")
        else:
            merged["converted_from_format"] = theirs
            notes.append(f"the input's __metadata__ says {{'format': {theirs!r}}}: OUT's format is {own!r}, the "
                         "layout written, and the input's value is kept as converted_from_format")
    merged["format"] = own
    return merged, notes


def _convert_keeping(src: str, dst: str, *, to: str, variant_name: str, config: Any, src_format: str | None,
                     metadata: Mapping[str, str]) -> dict[str, Any]:
    """``convert_file`` to a safetensors ``dst`` whose header holds ``metadata``: the same
    checks before anything is written (the destination, the config, the whole input
    against the map), the same atomic write (a temporary name, renamed when complete)."""
    files._check_layout("safetensors", to)
    target = files._destination(dst, "safetensors")  # one that must not be replaced, before the input is read
    checked_config(variant_name, config)
    arrays = files.read_checkpoint(src, variant_name, config, to=to, format=src_format)
    files._guarded(os.fspath(dst), target, lambda: files._replace_file(
        target, os.path.dirname(target), lambda tmp: files.write_safetensors(arrays, tmp, metadata)))
    return arrays


if __name__ == "__main__":
    sys.exit(main())
