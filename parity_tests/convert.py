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

from attention_spec.interop import files
from attention_spec.interop.files import FORMATS, checked_config, convert_file
from attention_spec.registry import VARIANTS, variant


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
