"""Speed and memory of the attention modules, on CPU and GPU, with results committed per
device under ``benchmarks/results/<device>/``.

    python -m benchmarks                 # the full sweep, meant for a GPU
    python -m benchmarks --quick         # CPU, about a minute
    python -m benchmarks --cpu-target    # the CPU target shape of the issue

Layout: ``configs`` (shapes, systems, FLOP count, modes), ``systems`` (each system built
for a shape), ``measure`` (timing one case), ``runner`` (a worker process per system,
the results), ``report`` (JSON, markdown, plot), ``environment`` (the machine).
Importing this package imports neither JAX nor PyTorch.
"""

from benchmarks.configs import SYSTEMS, Config, Mode, flops, fwd_bwd_flops, mode
from benchmarks.runner import run

__all__ = ["SYSTEMS", "Config", "Mode", "flops", "fwd_bwd_flops", "mode", "run"]
