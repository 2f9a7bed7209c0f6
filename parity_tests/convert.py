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
import sys
from collections.abc import Sequence

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
        arrays = convert_file(args.input, args.output, to=args.to, variant_name=args.variant, config=spec,
                              src_format=args.input_format, dst_format=args.format)
    except (ValueError, TypeError, OSError) as e:  # OSError: OUT's directory unwritable, a full disk
        print(f"convert: error: {_one_line(e)}", file=sys.stderr)
        return 2
    print(f"wrote {len(arrays)} arrays of {args.variant} in {args.to} layout to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
