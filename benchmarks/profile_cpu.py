"""Where the CPU target's time goes: ``python -m benchmarks.profile_cpu``.

Times the pieces of MultiHeadAttention's forward at the CPU target's shape (B=4, H=8,
S=1024, head_dim 64, causal, float32) in both frameworks (a process each): the three q/k/v projections, the attention core of every
path, and the matrix products of the JAX blockwise path alone (its floor: the same
GEMMs with no softmax), batched over (batch x heads) and one slice at a time.  Writes ``cpu-profile.md`` next to the other CPU results.
Each attention core's output is checked against the float64 oracle first
(``benchmarks/oracle_check.py``: the first example, its first and last head, the rows
``oracle_check.rows`` picks): one of ours that is wrong fails the run, PyTorch's SDPA, where
it is wrong, is marked so in the table and named under it.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks import oracle_check

B, H, S, D = 4, 8, 1024, 64
E = H * D
RUNS = 20
PROCESSES = 3


def median_ms(call: Callable[[], object], runs: int = RUNS) -> float:
    call()
    call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def inputs() -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, S, E)).astype(np.float32)
    ws = [(rng.standard_normal((E, E)) / np.sqrt(E)).astype(np.float32) for _ in range(3)]
    qkv = [rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(3)]
    return x, ws, qkv


def core_verdict(system: str, out: object, qkv: list[np.ndarray]) -> dict[str, object]:
    """An attention core's output (B, H, S, D) against the float64 oracle on ``inputs()``' q, k, v."""
    heads = [0, H - 1]
    q0, k0, v0 = (np.asarray(a, np.float64)[0][heads] for a in qkv)
    at = oracle_check.rows(S, S, len(heads), causal=True)
    want = oracle_check.attention_rows(q0, k0, v0, at, scale=1 / np.sqrt(D), causal=True)
    got = np.asarray(out, np.float64)[0][heads][:, at]
    return oracle_check.verdict(system, got, want, "float32", framework="torch" if system.startswith("torch") else "jax",
                                ours=not system.startswith("torch"),
                                checked=f"batch 0, heads {heads}, {len(at)} of {S} rows")


def torch_rows() -> tuple[list[tuple[str, str, float]], list[dict[str, object]]]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    x, ws, qkv = inputs()
    xt, wt = torch.from_numpy(x), [torch.from_numpy(w) for w in ws]
    qt, kt, vt = (torch.from_numpy(a) for a in qkv)
    with torch.no_grad():
        sdpa = (lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True))  # noqa: E731
        verdicts = [core_verdict("torch SDPA (is_causal)", sdpa().numpy(), qkv)]
        return [
            ("projections q, k, v", "torch", median_ms(lambda: [xt @ w for w in wt])),
            ("attention core", "torch SDPA (is_causal)", median_ms(sdpa)),
        ], verdicts


def jax_rows() -> tuple[list[tuple[str, str, float]], list[dict[str, object]]]:
    import jax
    import jax.numpy as jnp

    from jax_attention import functional as jf

    jax.config.update("jax_default_matmul_precision", "highest")
    x, ws, qkv = inputs()
    xj, wj = jnp.asarray(x), [jnp.asarray(w) for w in ws]
    qj, kj, vj = (jnp.asarray(a) for a in qkv)
    rows = []
    verdicts = []
    projections = jax.jit(lambda x, a, b, c: (x @ a, x @ b, x @ c))
    rows.append(("projections q, k, v", "jax", median_ms(lambda: jax.block_until_ready(projections(xj, *wj)))))
    for path in ("blockwise", "reference", "fused"):
        core = jax.jit(lambda q, k, v, path=path: jf.dot_product_attention(
            q, k, v, causal=True, implementation=path))
        verdicts.append(core_verdict(f"jax {path}", core(qj, kj, vj), qkv))
        rows.append(("attention core", f"jax {path}", median_ms(lambda core=core: core(qj, kj, vj).block_until_ready())))
    block = jf.default_block_size(S)
    def batched_gemms(q, k, v):  # the blockwise products, batched over (batch x heads)
        q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
        outs = []
        for r0 in range(0, S, block):
            r1 = r0 + block
            scores = jnp.einsum("bqd,bkd->bqk", q3[:, r0:r1], k3[:, :r1])
            outs.append(jnp.einsum("bqk,bkd->bqd", scores, v3[:, :r1]))
        return jnp.concatenate(outs, axis=1)

    def sliced_gemms(q, k, v):  # the same products, one (batch, head) slice at a time
        def one(t):
            qh, kh, vh = t
            return jnp.concatenate(
                [(qh[r0:r0 + block] @ kh[:r0 + block].T) @ vh[:r0 + block] for r0 in range(0, S, block)], axis=0)

        return jax.lax.map(one, tuple(t.reshape(B * H, S, D) for t in (q, k, v)))

    for name, fn in (("batched over (batch x heads)", batched_gemms), ("lax.map over slices", sliced_gemms)):
        gemms = jax.jit(fn)
        rows.append(("blockwise GEMMs only", name, median_ms(lambda gemms=gemms: gemms(qj, kj, vj).block_until_ready())))
    return rows, verdicts


def main() -> int:
    import concurrent.futures
    import multiprocessing

    import jax
    import torch

    from benchmarks.environment import cpu_busy, device_slug, host_environment

    # Each framework in a process of its own: PyTorch's OpenMP threads keep spinning after
    # its calls and would slow XLA's threads down in a shared process.
    # Each part runs in PROCESSES fresh processes: on this project's 2-core machines one
    # process's timings can sit in a slow mode (a few pieces 1.6x slower for the process's
    # whole life), so the table shows every process's median.
    rows: dict[tuple[str, str], list[float]] = {}
    checks = oracle_check.Checks()  # one of ours that is wrong raises
    context = multiprocessing.get_context("spawn")
    for part in (torch_rows, jax_rows):
        for _ in range(PROCESSES):
            with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                measured, verdicts = pool.submit(part).result()
                for v in verdicts:
                    checks.add(v)
                for piece, system, ms in measured:
                    rows.setdefault((piece, system), []).append(ms)

    env = host_environment()
    core_flops = 4 * B * H * S * S * D // 2
    lines = [
        "# Where the CPU target's time goes",
        "",
        f"MultiHeadAttention forward pieces at B={B}, H={H}, S={S}, head_dim {D}, causal, float32; "
        f"median of {RUNS} runs in each of {PROCESSES} fresh processes per framework (`python -m benchmarks.profile_cpu`).",
        f"Device: {env.get('device')}; CPU busy with other work: {cpu_busy()}; "
        f"jax {jax.__version__}, torch {torch.__version__}.",
        "",
        f"| piece | system | ms (the median of each of {PROCESSES} processes) | GFLOP/s (best) |",
        "|---|---|---|---|",
    ]
    for (piece, system), times in rows.items():
        flops = 3 * 2 * B * S * E * E if piece.startswith("projections") else core_flops
        cells = " / ".join(f"{ms:.1f}" for ms in times) + (" (wrong)" if checks.is_wrong(system) else "")
        lines.append(f"| {piece} | {system} | {cells} | {flops / min(times) / 1e6:.0f} |")
    lines.append("")
    lines.append("GFLOP/s count the useful work: 3 projections, or the causal core 2·B·H·S²·D.")
    wrong = oracle_check.wrong_text(list({v["system"]: v for v in checks.wrong}.values()))  # one per system
    if wrong:
        lines += ["", wrong]
    text = "\n".join(lines) + "\n"
    out = Path(__file__).parent / "results" / device_slug(env) / "cpu-profile.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
