"""Build the library's CPU kernel ahead of time:
``python -m jax_attention.build_kernel [--cache DIR] [--measure | --auto {kernel,blockwise}]``
(or ``twin-attention-build-kernel``).

JAX builds the kernel on first use (``jax_attention._cpu_kernel``).  A container image, or
an installation whose users cannot or should not compile, builds it once beforehand with
this command; processes that share the cache (the same ``$TWIN_ATTENTION_CACHE``, or
``--cache``'s folder) and the same compiler, CPU and ``$TWIN_ATTENTION_MARCH`` then load it
without compiling.  A build already in the cache is verified (its checksum record, its
symbols) rather than rebuilt.

``implementation="auto"`` takes the kernel or the blockwise path as a short measurement
of this build on this machine says, made by the first call that needs it and cached
beside the library (``jax_attention._cpu_measure``).  ``--measure`` makes it now (again,
if one is cached), caches it and prints the decisions and the medians; ``--auto kernel``
or ``--auto blockwise`` caches that decision for this build instead, measuring nothing
(for full calls and few query rows alike; it stands until the build changes or another
``--measure`` or ``--auto``).  ``$TWIN_ATTENTION_CPU_AUTO`` still overrides either at run
time.

On success it prints the library's path (then, with ``--measure`` or ``--auto``, the
record's path and the decisions) and exits 0; otherwise it prints why on stderr and
exits 1.  ``$TWIN_ATTENTION_CPU_KERNEL`` is not consulted by a plain build (asking for a
build builds); ``--measure`` needs the kernel loaded, which ``off`` refuses.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """The command: build or verify, print the path (and measure or set ``auto``'s
    decision); the exit status."""
    parser = argparse.ArgumentParser(prog="python -m jax_attention.build_kernel",
                                     description="Build the CPU kernel into its cache, or verify the build there.")
    parser.add_argument("--cache", type=Path, default=None,
                        help="the cache folder (default: $TWIN_ATTENTION_CACHE, else $XDG_CACHE_HOME/twin-attention, "
                             "else ~/.cache/twin-attention); later processes need the same")
    decision = parser.add_mutually_exclusive_group()
    decision.add_argument("--measure", action="store_true",
                          help="then measure the kernel against the blockwise path on this machine now (about a "
                               "second), cache implementation='auto''s decision beside the build and print it")
    decision.add_argument("--auto", choices=("kernel", "blockwise"), default=None,
                          help="then cache this decision for implementation='auto' beside the build, measuring nothing")
    args = parser.parse_args(argv)
    if args.cache is not None:
        os.environ["TWIN_ATTENTION_CACHE"] = str(args.cache.resolve())

    try:
        from jax_attention import _cpu_kernel, _cpu_measure

        path = _cpu_kernel.build()
    except ImportError as error:
        print(f"the CPU kernel could not be built: JAX is needed ({error})", file=sys.stderr)
        return 1
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        print(f"the CPU kernel could not be built: {error}", file=sys.stderr)
        return 1
    print(path, flush=True)
    if args.auto is None and not args.measure:
        return 0
    try:
        record_path, record = _cpu_kernel.set_auto(args.auto) if args.auto else _cpu_kernel.measure_auto()
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        print(f"implementation='auto''s decision could not be {'cached' if args.auto else 'measured'}: {error}",
              file=sys.stderr)
        return 1
    unsaved = _cpu_measure.unsaved(record_path)
    print(f"implementation='auto' on this machine, {'not cached: ' + unsaved if unsaved else f'cached in {record_path}'}:")
    print(_cpu_measure.summary(record))
    override = os.environ.get(_cpu_measure.OVERRIDE)
    if override not in (None, "", "measure"):
        print(f"(${_cpu_measure.OVERRIDE}={override} overrides it in the processes that set it)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
