"""Build the library's CPU kernel ahead of time:
``python -m jax_attention.build_kernel [--cache DIR]`` (or ``twin-attention-build-kernel``).

JAX builds the kernel on first use (``jax_attention._cpu_kernel``).  A container image, or
an installation whose users cannot or should not compile, builds it once beforehand with
this command; processes that share the cache (the same ``$TWIN_ATTENTION_CACHE``, or
``--cache``'s folder) and the same compiler, CPU and ``$TWIN_ATTENTION_MARCH`` then load it
without compiling.  A build already in the cache is verified (its checksum record, its
symbols) rather than rebuilt.

On success it prints the library's path and exits 0; otherwise it prints why on stderr
and exits 1.  ``$TWIN_ATTENTION_CPU_KERNEL`` is not consulted: asking for a build builds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """The command: build or verify, print the path; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m jax_attention.build_kernel",
                                     description="Build the CPU kernel into its cache, or verify the build there.")
    parser.add_argument("--cache", type=Path, default=None,
                        help="the cache folder (default: $TWIN_ATTENTION_CACHE, else $XDG_CACHE_HOME/twin-attention, "
                             "else ~/.cache/twin-attention); later processes need the same")
    args = parser.parse_args(argv)
    if args.cache is not None:
        os.environ["TWIN_ATTENTION_CACHE"] = str(args.cache.resolve())

    try:
        from jax_attention import _cpu_kernel

        path = _cpu_kernel.build()
    except ImportError as error:
        print(f"the CPU kernel could not be built: JAX is needed ({error})", file=sys.stderr)
        return 1
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        print(f"the CPU kernel could not be built: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
