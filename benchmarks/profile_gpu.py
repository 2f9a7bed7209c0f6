"""Where the fused JAX path's time goes on an NVIDIA GPU: ``python -m benchmarks.profile_gpu [OUT_DIR]``.

Traces (``jax.profiler``) the attention core at issue 12's target shape (B4 H16 S4096,
head_dim 128, bfloat16, causal), forward and forward + backward, two ways: ours,
``dot_product_attention(implementation="fused")`` on (B, H, S, D) arrays, and the kernel
it wraps, ``jax.nn.dot_product_attention(implementation="cudnn")`` on its own (B, S, H, D)
layout; and writes ``gpu-profile.md``: the GPU time per call of every kernel, summed by
name, so that the difference between the two is the kernels ours adds.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import sys
import tempfile
from pathlib import Path

B, H, S, D = 4, 16, 4096, 128
CALLS = 5


def kernel_times(fn, args) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """{kernel name: GPU microseconds per call} over CALLS traced calls of ``fn``."""
    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(CALLS):
                jax.block_until_ready(fn(*args))
        path = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
    if not gpu:
        names = sorted({str(e.get("args", {}).get("name")) for e in events if e.get("name") == "process_name"})
        raise RuntimeError(f"no GPU timeline in the trace; its processes: {names}")
    totals: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            totals[e["name"][:90]] += e["dur"] / CALLS
    return dict(totals)


def main() -> None:
    import jax
    import jax.numpy as jnp

    from jax_attention import functional

    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results"
    keys = jax.random.split(jax.random.key(0), 3)
    bhsd = [jax.random.normal(k, (B, H, S, D), jnp.bfloat16) for k in keys]
    bshd = [jnp.swapaxes(t, 1, 2) for t in bhsd]

    def ours(q, k, v):  # type: ignore[no-untyped-def]
        return functional.dot_product_attention(q, k, v, causal=True, implementation="fused")

    def cudnn(q, k, v):  # type: ignore[no-untyped-def]
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def grad_of(f):  # type: ignore[no-untyped-def]
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v), dtype=jnp.float32), argnums=(0, 1, 2)))

    lines = [f"# GPU kernels of the fused path: B{B} H{H} S{S} D{D}, bfloat16, causal",
             "", f"{jax.devices()[0].device_kind}; jax {jax.__version__}. GPU microseconds per call, "
             f"from jax.profiler over {CALLS} calls, summed by kernel name.", ""]
    for what, make in (("forward", jax.jit), ("forward + backward", grad_of)):
        ours_t, cudnn_t = kernel_times(make(ours), bhsd), kernel_times(make(cudnn), bshd)
        lines += [f"## {what}", "", "| kernel | ours (B, H, S, D) | cuDNN alone (B, S, H, D) |", "|---|---|---|"]
        for name in sorted(set(ours_t) | set(cudnn_t), key=lambda n: -max(ours_t.get(n, 0), cudnn_t.get(n, 0))):
            lines.append(f"| `{name}` | {ours_t.get(name, 0):.1f} | {cudnn_t.get(name, 0):.1f} |")
        lines += [f"| **total** | **{sum(ours_t.values()):.1f}** | **{sum(cudnn_t.values()):.1f}** |", ""]
    text = "\n".join(lines)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu-profile.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
