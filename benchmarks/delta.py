"""``python -m benchmarks.delta``: the gated delta rule's speed on this machine (issue 57).

Systems, each on the same float32 inputs (q, k, v of B x S x H x D, tokens before heads as
transformers' functions take them; decays in (-0.1, 0); the L2 norm in the kernel):

  ours-jax            ``jax_attention.functional.gated_delta_rule``, jitted (chunks of 64)
  ours-torch          ``torch_attention.functional.gated_delta_rule`` (chunks of 64)
  transformers        ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``
                      of transformers' Qwen3-Next (its PyTorch reference, a Python loop over
                      chunks; flash-linear-attention's kernels need a GPU)

Phases: ``forward`` (the chunked form over the whole sequence), ``forward+backward`` (the
gradient of sum(out * cotangent) with respect to q, k, v, g and beta) and ``decode`` (one
token with a state: the recurrent form's step, jitted in JAX).  Medians of ``--runs`` runs
after a warm-up, the range beside them; ratios against transformers' function.  Memory: XLA's
own accounting of the jitted JAX forward+backward (temporaries, arguments, outputs) at S,
S/2 and S/4: linear in the length where each doubling at most doubles it.

Before its times count, every system's output is checked against the float64 loop oracle
(``parity_tests.reference_delta``) on the first example's first head and the first
``--check-tokens`` tokens (a causal rule: their outputs depend on nothing later; the default
80 crosses the first chunk boundary): one of ours wrong fails the run, an outside system
wrong is recorded in ``wrong`` and left out of every ratio (``benchmarks/oracle_check.py``).
Results go to ``benchmarks/results/<device>/delta.{json,md}`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import oracle_check
from benchmarks.environment import device_slug, host_environment

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("ours-jax", "ours-torch", "transformers")
PHASES = ("forward", "forward+backward", "decode")


def _inputs(batch: int, length: int, heads: int, dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (batch, length, heads, dim)
    return {"q": rng.standard_normal(shape).astype(np.float32), "k": rng.standard_normal(shape).astype(np.float32),
            "v": rng.standard_normal(shape).astype(np.float32),
            "g": -rng.uniform(0.0, 0.1, shape[:3]).astype(np.float32),
            "beta": rng.uniform(0.0, 1.0, shape[:3]).astype(np.float32)}


def _times(run: Callable[[], Any], runs: int) -> list[float]:
    run()  # warm-up (and compile)
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        out.append(time.perf_counter() - start)
    return out


def _jax_system(x: dict[str, np.ndarray], chunk: int) -> dict[str, Callable[[], Any]]:
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import gated_delta_rule

    a = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
    forward = jax.jit(lambda *t: gated_delta_rule(*t, qk_l2norm=True, layout="bshd", chunk_size=chunk)[0])
    cot = jnp.asarray(np.random.default_rng(1).standard_normal(x["v"].shape), jnp.float32)
    grad = jax.jit(jax.grad(lambda t: jnp.sum(forward(*t) * cot)))
    batch, _, heads, dim = x["q"].shape
    state = jnp.zeros((batch, heads, dim, x["v"].shape[-1]), jnp.float32)
    step = jax.jit(lambda *t: gated_delta_rule(*t, initial_state=state, qk_l2norm=True, layout="bshd",
                                               form="recurrent"))
    one = [t[:, :1] for t in a]
    return {"output": lambda: np.asarray(forward(*a)),
            "forward": lambda: forward(*a).block_until_ready(),
            "forward+backward": lambda: jax.block_until_ready(grad(a)),
            "decode": lambda: jax.block_until_ready(step(*one))}


def _torch_system(x: dict[str, np.ndarray], chunk: int, theirs: bool) -> dict[str, Callable[[], Any]]:
    import torch

    if theirs:
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        def chunked(*t: Any) -> Any:
            return m.torch_chunk_gated_delta_rule(*t, chunk_size=chunk, use_qk_l2norm_in_kernel=True)[0]

        def recurrent(*t: Any, state: Any) -> Any:
            return m.torch_recurrent_gated_delta_rule(*t, initial_state=state, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    else:
        from torch_attention.functional import gated_delta_rule

        def chunked(*t: Any) -> Any:
            return gated_delta_rule(*t, qk_l2norm=True, layout="bshd", chunk_size=chunk)[0]

        def recurrent(*t: Any, state: Any) -> Any:
            return gated_delta_rule(*t, initial_state=state, qk_l2norm=True, layout="bshd", form="recurrent")

    a = [torch.from_numpy(x[n]) for n in ("q", "k", "v", "g", "beta")]
    cot = torch.from_numpy(np.random.default_rng(1).standard_normal(x["v"].shape).astype(np.float32))
    batch, _, heads, dim = x["q"].shape
    state = torch.zeros(batch, heads, dim, x["v"].shape[-1])
    one = [t[:, :1] for t in a]

    def backward() -> None:
        leaves = [t.clone().requires_grad_() for t in a]
        (chunked(*leaves) * cot).sum().backward()

    def forward() -> Any:
        with torch.no_grad():
            return chunked(*a)

    def decode() -> Any:
        with torch.no_grad():
            return recurrent(*one, state=state)

    return {"output": lambda: forward().numpy(), "forward": forward, "forward+backward": backward, "decode": decode}


def _memory(batch: int, length: int, heads: int, dim: int, chunk: int) -> dict[str, int]:
    """XLA's bytes for the jitted JAX forward+backward at ``length``: temporaries,
    arguments and outputs."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import gated_delta_rule

    shapes = [jax.ShapeDtypeStruct((batch, length, heads, dim), jnp.float32)] * 3
    shapes += [jax.ShapeDtypeStruct((batch, length, heads), jnp.float32)] * 2
    loss = jax.grad(lambda *t: jnp.sum(gated_delta_rule(*t, qk_l2norm=True, layout="bshd", chunk_size=chunk)[0]),
                    argnums=(0, 1, 2, 3, 4))
    stats = jax.jit(loss).lower(*shapes).compile().memory_analysis()
    return {"temp": int(stats.temp_size_in_bytes), "arguments": int(stats.argument_size_in_bytes),
            "outputs": int(stats.output_size_in_bytes)}


def _oracle(x: dict[str, np.ndarray], tokens: int) -> np.ndarray:
    from parity_tests.reference_delta import gated_delta_rule

    first = {n: np.swapaxes(a[:1, :tokens, :1], 1, 2) for n, a in x.items()}  # (1, 1, T, ...) heads first
    out, _ = gated_delta_rule(first["q"], first["k"], first["v"], first["g"], first["beta"], qk_l2norm=True)
    return out[0, 0]  # (tokens, Dv)


def run(batch: int = 1, length: int = 4096, heads: int = 8, dim: int = 128, chunk: int = 64, runs: int = 5,
        check_tokens: int = 80, systems: tuple[str, ...] = SYSTEMS, out: Path | None = None,
        memory: bool = True) -> dict[str, Any]:
    """Times every system in every phase; the record (also written where ``out`` says)."""
    warnings.filterwarnings("ignore", message=".*flash-linear-attention.*")
    x = _inputs(batch, length, heads, dim)
    want = _oracle(x, min(check_tokens, length))
    checks = oracle_check.Checks()
    times: dict[str, dict[str, list[float]]] = {}
    for system in systems:
        made = (_jax_system(x, chunk) if system == "ours-jax"
                else _torch_system(x, chunk, theirs=system == "transformers"))
        got = made["output"]()[0, : len(want), 0]
        framework = "jax" if system == "ours-jax" else "torch"
        checks.add(oracle_check.verdict(system, got, want, "float32", framework=framework,
                                        checked=f"example 0, head 0, tokens 0..{len(want) - 1}"))
        times[system] = {phase: _times(made[phase], runs) for phase in PHASES}
    medians = {s: {p: statistics.median(t) for p, t in ph.items()} for s, ph in times.items()}
    right = [s for s in systems if not checks.is_wrong(s)]
    ratios = {s: {p: medians[s][p] / medians["transformers"][p] for p in PHASES}
              for s in right if "transformers" in right and s != "transformers"}
    record: dict[str, Any] = {
        "shape": {"batch": batch, "length": length, "heads": heads, "dim": dim, "chunk": chunk}, "runs": runs,
        "seconds": times, "median_s": medians, "ratio_to_transformers": ratios, "verdicts": checks.verdicts,
        "wrong": checks.wrong, "environment": host_environment(),
    }
    if memory:
        record["jax_memory_bytes"] = {n: _memory(batch, n, heads, dim, chunk)
                                      for n in (length // 4, length // 2, length) if n >= chunk}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "delta.json").write_text(json.dumps(record, indent=1) + "\n")
        (out / "delta.md").write_text(report(record))
    return record


def report(record: dict[str, Any]) -> str:
    """The record as a Markdown table: median ms (range) per system and phase, the ratio
    to transformers' function, memory by length, the wrong systems."""
    shape = record["shape"]
    env = record["environment"]
    lines = [f"# The gated delta rule, B{shape['batch']} S{shape['length']} H{shape['heads']} D{shape['dim']}, "
             f"chunks of {shape['chunk']}, float32",
             "", f"Machine: {env.get('device')} ({env.get('cpu', {}).get('generation')}), ISA "
             f"{env.get('cpu', {}).get('isa')}; medians of {record['runs']} runs (range), ratios to transformers'.", "",
             "| system | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for system, phases in record["seconds"].items():
        cells = []
        for phase in PHASES:
            t = phases[phase]
            ratio = record["ratio_to_transformers"].get(system, {}).get(phase)
            cells.append(f"{statistics.median(t) * 1e3:.2f} ms ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f})"
                         + (f", {ratio:.2f}x" if ratio is not None else ""))
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    if "jax_memory_bytes" in record:
        lines += ["", "JAX forward+backward, XLA's bytes (temporaries / arguments / outputs) by length: "
                  + "; ".join(f"S{n}: {m['temp'] / 2**20:.1f} / {m['arguments'] / 2**20:.1f} / "
                              f"{m['outputs'] / 2**20:.1f} MiB" for n, m in record["jax_memory_bytes"].items())]
    wrong = oracle_check.wrong_text(record["wrong"])
    return "\n".join(lines) + "\n" + (f"\n{wrong}" if wrong else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--check-tokens", type=int, default=80)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or RESULTS / device_slug(host_environment())
    record = run(args.batch, args.length, args.heads, args.dim, args.chunk, args.runs, args.check_tokens, out=out)
    print(report(record), end="")
    print(f"(written to {out / 'delta.json'} and delta.md)")


if __name__ == "__main__":
    main()
