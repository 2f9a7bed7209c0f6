"""``auto`` against the paths it chooses between, for one build of the CPU kernel:
``python -m benchmarks.cpu_isa`` (``--march x86-64-v3`` by default: AVX2, no AVX-512).

``auto`` takes the kernel where it measured faster than the blockwise path on the machine
(once per build, cached; ``jax_attention._cpu_kernel.auto_declines``, ``auto_basis``).  This times JAX's
attention core, ``dot_product_attention(causal=True)`` under jit, on ``auto``,
``blockwise`` and ``fused`` (the kernel), and PyTorch's ``F.scaled_dot_product_attention``
beside them (``torch``: with ``$ATEN_CPU_CAPABILITY=avx2`` its AVX2 kernels), forward
and forward + backward, float32, at B4 H8 S1024 and B32 H4 S128 (head_dim 64), with the
kernel built for ``--march`` (a cache of its own per target, under
``$TWIN_ATTENTION_CACHE``).  ``--march native`` times this CPU's own build.  Each path's
forward output is checked against the float64 loop oracle first (``benchmarks/oracle_check.py``:
the first example, its first and last head, the rows ``oracle_check.rows`` picks): a JAX path
(ours) that is wrong fails the run; PyTorch's, where it is wrong, has ``wrong`` for its times
and is named, with its error and PyTorch's CPU capability, under the table.  One process, the paths alternating run by run in a rotating order; run it on
a quiet machine (``uptime``'s load well under 1), it prints the load it started at.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from benchmarks import oracle_check

SHAPES = ((4, 8, 1024, 64), (32, 4, 128, 64))  # (B, H, S, D)
PATHS = ("auto", "blockwise", "fused", "torch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_isa", description=__doc__.split("\n\n")[0])
    parser.add_argument("--march", default="x86-64-v3", help="the kernel's -march (default x86-64-v3, AVX2)")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per path and phase (median)")
    args = parser.parse_args(argv)
    # Read when the kernel is first built, below: set before any call.
    os.environ["TWIN_ATTENTION_MARCH"] = args.march
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import torch

    from jax_attention import _cpu_kernel
    from jax_attention.functional import dot_product_attention

    assert _cpu_kernel.available(), _cpu_kernel.build_error()
    print(f"load average at start: {os.getloadavg()[0]:.2f}; CPU: {_cpu_kernel.cpu_instruction_set()}; "
          f"-march={args.march}: kernel built for {_cpu_kernel.instruction_set()}; "
          f"auto: {_cpu_kernel.auto_declines() or 'takes the kernel'}; torch: {torch.backends.cpu.get_cpu_capability()}")
    print(f"median ms of {args.runs} runs (jit, float32, causal)\n")
    print("| B H S D | phase | " + " | ".join(PATHS) + " |")
    print("|---|---|" + "---|" * len(PATHS))
    rng = np.random.default_rng(0)
    checks = oracle_check.Checks()
    for batch, heads, seq, width in SHAPES:
        q, k, v = (jnp.asarray(rng.standard_normal((batch, heads, seq, width)), jnp.float32) for _ in range(3))
        calls: dict[str, dict[str, Callable[..., object]]] = {"forward": {}, "forward+backward": {}}
        for path in PATHS[:-1]:
            def attend(q_: jax.Array, k_: jax.Array, v_: jax.Array, path: str = path) -> jax.Array:
                out = dot_product_attention(q_, k_, v_, causal=True, implementation=path)
                assert isinstance(out, jax.Array)
                return out

            def loss(q_: jax.Array, k_: jax.Array, v_: jax.Array, attend: Callable[..., jax.Array] = attend) -> jax.Array:
                return attend(q_, k_, v_).sum()

            calls["forward"][path] = jax.jit(attend)
            calls["forward+backward"][path] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        calls["forward"]["torch"], calls["forward+backward"]["torch"] = _torch_calls(q, k, v)
        wrong = check_paths(checks, calls["forward"], q, k, v)
        for phase, by_path in calls.items():
            times: dict[str, list[float]] = {path: [] for path in PATHS}
            for fn in by_path.values():  # compile and warm up
                jax.block_until_ready(fn(q, k, v))
                jax.block_until_ready(fn(q, k, v))
            # JAX's paths interleaved, the order rotating so that no path always runs right
            # after the same other (a path timed just after the kernel's cold exit was
            # measured up to 18% slower); then PyTorch's runs on their own, after them:
            # interleaved, its OpenMP threads, spinning after each call, took the cores from
            # the JAX call after it (the same program, auto and fused, timed 1.3x apart).
            jax_paths = PATHS[:-1]
            for run in range(args.runs):
                for path in jax_paths[run % len(jax_paths):] + jax_paths[:run % len(jax_paths)]:
                    times[path].append(_seconds(by_path[path], q, k, v))
            times["torch"] = [_seconds(by_path["torch"], q, k, v) for _ in range(args.runs)]
            cells = " | ".join("wrong" if path in wrong else f"{statistics.median(times[path]) * 1e3:.1f}"
                               for path in PATHS)
            print(f"| {batch} {heads} {seq} {width} | {phase} | {cells} |")
    text = oracle_check.wrong_text(checks.wrong)
    if text:
        print("\n" + text, end="")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


def check_paths(checks: oracle_check.Checks, forward: dict[str, Callable[..., object]], q: object, k: object,
                v: object) -> set[str]:
    """Each path's forward output against the float64 oracle (the first example, its first
    and last head, ``oracle_check.rows``' rows); the paths that are wrong (only PyTorch's
    can be: one of ours that is wrong raises AssertionError, naming it)."""
    q0, k0, v0 = (np.asarray(a, np.float64)[0] for a in (q, k, v))  # (H, S, D)
    heads, seq, width = q0.shape
    checked = sorted({0, heads - 1})
    at = oracle_check.rows(seq, seq, len(checked), causal=True)
    want = oracle_check.attention_rows(q0[checked], k0[checked], v0[checked], at, scale=1 / np.sqrt(width), causal=True)
    wrong = set()
    for path, fn in forward.items():
        got = np.asarray(fn(q, k, v), np.float64)[0][checked][:, at]
        system = "torch-sdpa" if path == "torch" else f"ours-jax-{path}"
        if not checks.check(system, got, want, "float32", framework="torch" if path == "torch" else "jax",
                            checked=f"B{np.shape(q)[0]} H{heads} S{seq} D{width}: batch 0, heads "
                                    f"{checked}, {len(at)} of {seq} rows"):
            wrong.add(path)
    return wrong


def _seconds(fn: Callable[..., object], *args: object) -> float:
    """One call's wall time, the result made ready."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _torch_calls(q: object, k: object, v: object) -> tuple[Callable[..., object], Callable[..., object]]:
    """PyTorch's SDPA on copies of the same inputs: forward, and forward + backward (the
    gradients of q, k and v), as callables of the JAX arrays' signature."""
    import torch
    import torch.nn.functional as F

    tq, tk, tv = (torch.from_numpy(np.asarray(a).copy()) for a in (q, k, v))

    def forward(*_: object) -> object:
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    def forward_backward(*_: object) -> object:
        leaves = [t.detach().requires_grad_() for t in (tq, tk, tv)]
        F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
        return [t.grad for t in leaves]

    return forward, forward_backward


if __name__ == "__main__":
    sys.exit(main())
