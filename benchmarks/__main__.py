"""``python -m benchmarks``: see ``python -m benchmarks --help``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from benchmarks.configs import SYSTEMS, mode
from benchmarks.environment import MALLOCS, preload_for
from benchmarks.runner import run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=(
            "Speed and memory of the attention modules against flax.nnx.MultiHeadAttention, "
            "torch SDPA and torch.nn.MultiheadAttention. Without a mode flag: the full sweep "
            "(S 512..16k and 64k, float32 and bfloat16, forward and forward+backward), meant "
            "for a GPU."
        ),
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--quick", action="store_true",
        help="a CPU run of about a minute: S 256 and 512, causal, float32, forward only, 5 runs",
    )
    which.add_argument(
        "--cpu-target", action="store_true",
        help="the issue's CPU target: B=4, H=8, S=1024, head_dim 64, float32, causal, forward, 20 runs",
    )
    which.add_argument(
        "--cpu-sweep", action="store_true",
        help="issue 10's CPU sweep: S 128..32768 (float32, causal, head_dim 64), forward and forward+backward, "
             "both twins, flax.nnx.MultiHeadAttention and torch.nn.MultiheadAttention, a process per case",
    )
    which.add_argument(
        "--flex", action="store_true",
        help="flex attention's CPU targets (issue 42): python -m benchmarks.flex, given --runs, one --seq and --out",
    )
    parser.add_argument("--with-compile", action="store_true", help="add ours-torch-compile to --quick")
    parser.add_argument("--systems", type=_names, help=f"comma-separated subset of: {', '.join(SYSTEMS)}")
    parser.add_argument("--runs", type=int, help="timed runs per measurement (the mode's default otherwise)")
    parser.add_argument("--seq", type=_ints, help="comma-separated sequence lengths: only these of the mode's")
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<device>)")
    parser.add_argument(
        "--append", action="store_true",
        help="keep the measurements of an earlier run of this mode in the output folder that this run does not repeat",
    )
    parser.add_argument(
        "--budget-s", type=float,
        help="start no case after this many seconds; the cases left are recorded as not run",
    )
    parser.add_argument(
        "--malloc", choices=MALLOCS, default="system",
        help="the allocator of every worker, both frameworks: the system's (default) or tcmalloc, preloaded "
             "(JAX on CPU pays page faults for its temporaries under glibc; see benchmarks/README.md)",
    )
    args = parser.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        parser.error("--runs must be at least 1")
    try:
        preload_for(args.malloc)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.flex:  # a benchmark of its own (benchmarks/flex.py)
        from benchmarks import flex

        flex.main([*(["--runs", str(args.runs)] if args.runs else []),
                   *(["--seq", str(args.seq[0])] if args.seq else []),
                   *(["--out", str(args.out)] if args.out else [])])
        return
    name = ("quick" if args.quick else "cpu-target" if args.cpu_target
            else "cpu-sweep" if args.cpu_sweep else "full")
    chosen = mode(name, with_compile=args.with_compile)
    changes: dict = {}
    if args.systems:
        changes["systems"] = args.systems
    if args.runs:
        changes["runs"] = args.runs
    if args.seq:
        changes["configs"] = tuple(c for c in chosen.configs if c.seq in args.seq)
    run(dataclasses.replace(chosen, **changes), out_dir=args.out, append=args.append, budget_s=args.budget_s,
        malloc=args.malloc)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown system(s) {', '.join(unknown)}; expected some of {', '.join(SYSTEMS)}")
    return names


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
