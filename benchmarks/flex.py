"""``python -m benchmarks.flex``: flex attention's speed targets on the CPU (issue 42).

One configuration (default B1 H8 S2048 D64, float32), a score mod that stands for no named
option (ALiBi, ``attention_spec.mods.alibi``: the call stays on the flex path), timed as
medians of ``--runs`` after one untimed call (JAX: after compiling):

  ours-jax-flex / ours-torch-flex  each twin's ``flex_attention``, forward and forward +
                   backward (the gradient of the output's sum with respect to q, k and v;
                   JAX jitted), with a causal block mask and with a full one (every key)
  torch-compile-flex  ``torch.compile(torch.nn.attention.flex_attention.flex_attention)``
                   with the same mods, forward (PyTorch has no flex backward on the CPU)
  named            each twin's ``flex_attention`` with mods that stand for named options
                   (``causal`` + ``softcap``), which runs as ``dot_product_attention``, and
                   that call itself, forward + backward

The ratios the issue sets: causal over full block mask, forward + backward (target 0.6);
ours-JAX flex over torch.compile's, forward (target 1.0); named flex over the named
option (1.0).  Every system's output is checked against ours-PyTorch's (float32: 1e-4)
before it reports.  Results go to ``benchmarks/results/<device>/flex/flex.{json,md}`` (or
``--out``) with the machine's description.
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

from benchmarks.environment import device_slug, host_environment

RESULTS = Path(__file__).resolve().parent / "results"
AGREEMENT = 1e-4  # float32, against ours-PyTorch
SOFTCAP = 30.0
TARGETS = {"causal / full, forward + backward": 0.6, "ours-jax flex / torch.compile flex, forward": 1.0,
           "named flex / named option, forward + backward": 1.0}


def _median_ms(fn: Callable[[], Any], runs: int) -> float:
    fn()  # untimed: compiles, allocates
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(batch: int, heads: int, seq: int, dim: int, block: int, runs: int, compile_torch: bool) -> dict[str, Any]:
    """Every system's medians (ms) and outputs' agreement; see the module's docstring."""
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf
    from attention_spec import mods

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, heads, seq, dim), dtype=np.float32) for _ in range(3))
    slopes = np.linspace(0.5, 0.01, heads, dtype=np.float32)
    alibi = mods.alibi(slopes)
    masks = {"causal": mods.causal, "full": mods.and_masks()}  # and_masks of none: every key
    times: dict[str, float] = {}
    outputs: dict[str, np.ndarray] = {}
    jq, jk, jv = (jnp.asarray(a) for a in (q, k, v))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))

    def torch_step(f: Callable[[], Any]) -> Callable[[], None]:
        def step() -> None:
            for t in (tq, tk, tv):
                t.grad = None
            f().sum().backward()
        return step

    for name, mask_mod in masks.items():
        jax_mask = jf.create_block_mask(mask_mod, None, None, seq, seq, BLOCK_SIZE=block)
        torch_mask = tf.create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=block)
        forward = jax.jit(lambda q_, k_, v_, m=jax_mask: jf.flex_attention(q_, k_, v_, score_mod=alibi, block_mask=m))
        grads = jax.jit(jax.grad(lambda q_, k_, v_, m=jax_mask: jf.flex_attention(
            q_, k_, v_, score_mod=alibi, block_mask=m).sum(), argnums=(0, 1, 2)))
        times[f"ours-jax-flex {name} forward"] = _median_ms(lambda f=forward: jax.block_until_ready(f(jq, jk, jv)), runs)
        times[f"ours-jax-flex {name} forward+backward"] = _median_ms(
            lambda g=grads: jax.block_until_ready(g(jq, jk, jv)), runs)
        outputs[f"ours-jax-flex {name}"] = np.asarray(forward(jq, jk, jv))

        def torch_forward(m: Any = torch_mask) -> Any:
            return tf.flex_attention(tq, tk, tv, score_mod=alibi, block_mask=m)

        with torch.no_grad():
            times[f"ours-torch-flex {name} forward"] = _median_ms(torch_forward, runs)
            outputs[f"ours-torch-flex {name}"] = torch_forward().numpy()
        times[f"ours-torch-flex {name} forward+backward"] = _median_ms(torch_step(torch_forward), runs)

    if compile_torch:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch_slopes = torch.tensor(slopes)

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + torch_slopes[h] * (kv_idx - q_idx)

        native_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq,
                                        device="cpu", BLOCK_SIZE=block)
        compiled = torch.compile(flex_attention)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = (tq.detach(), tk.detach(), tv.detach())  # (its CPU flex refuses inputs that need grad)
            run = lambda: compiled(*plain, score_mod=score_mod, block_mask=native_mask)  # noqa: E731
            started = time.perf_counter()
            outputs["torch-compile-flex causal"] = run().numpy()
            compile_s = time.perf_counter() - started
            times["torch-compile-flex causal forward"] = _median_ms(run, runs)
    else:
        compile_s = None

    named_mods = {"score_mod": mods.softcap(SOFTCAP)}
    jax_named = jf.create_block_mask(mods.causal, None, None, seq, seq, BLOCK_SIZE=block)
    torch_named = tf.create_block_mask(mods.causal, None, None, seq, seq, device="cpu", BLOCK_SIZE=block)
    def jax_grads(f: Callable[..., Any]) -> Callable[..., Any]:
        return jax.jit(jax.grad(lambda q_, k_, v_: f(q_, k_, v_).sum(), argnums=(0, 1, 2)))

    flex_grads = jax_grads(lambda q_, k_, v_: jf.flex_attention(q_, k_, v_, block_mask=jax_named, **named_mods))
    option_grads = jax_grads(lambda q_, k_, v_: jf.dot_product_attention(q_, k_, v_, causal=True, softcap=SOFTCAP))
    times["ours-jax-flex named forward+backward"] = _median_ms(
        lambda: jax.block_until_ready(flex_grads(jq, jk, jv)), runs)
    times["ours-jax named option forward+backward"] = _median_ms(
        lambda: jax.block_until_ready(option_grads(jq, jk, jv)), runs)
    times["ours-torch-flex named forward+backward"] = _median_ms(torch_step(
        lambda: tf.flex_attention(tq, tk, tv, block_mask=torch_named, **named_mods)), runs)
    times["ours-torch named option forward+backward"] = _median_ms(torch_step(
        lambda: tf.dot_product_attention(tq, tk, tv, causal=True, softcap=SOFTCAP)), runs)

    agreement = {}
    for name, out in outputs.items():
        reference = outputs["ours-torch-flex " + ("full" if name.endswith("full") else "causal")]
        agreement[name] = float(np.abs(out - reference).max())
        if agreement[name] > AGREEMENT:
            raise AssertionError(f"{name} differs from ours-torch-flex by {agreement[name]:.3g} (> {AGREEMENT})")
    ratios = {}
    for twin in ("jax", "torch"):
        ratios[f"ours-{twin}-flex causal / full, forward + backward"] = (
            times[f"ours-{twin}-flex causal forward+backward"] / times[f"ours-{twin}-flex full forward+backward"])
        ratios[f"ours-{twin}-flex named / named option, forward + backward"] = (
            times[f"ours-{twin}-flex named forward+backward"] / times[f"ours-{twin} named option forward+backward"])
    if compile_torch:
        ratios["ours-jax flex / torch.compile flex, forward (causal)"] = (
            times["ours-jax-flex causal forward"] / times["torch-compile-flex causal forward"])
    return {"config": {"batch": batch, "heads": heads, "seq": seq, "head_dim": dim, "block": block, "runs": runs,
                       "dtype": "float32", "score_mod": "alibi", "softcap": SOFTCAP},
            "times_ms": {name: round(t, 3) for name, t in times.items()},
            "ratios": {name: round(r, 3) for name, r in ratios.items()},
            "max_abs_diff_vs_ours_torch": agreement, "torch_compile_s": compile_s}


def markdown(record: dict[str, Any]) -> str:
    c, env = record["config"], record["environment"]
    lines = [f"# Flex attention on the CPU (B{c['batch']} H{c['heads']} S{c['seq']} D{c['head_dim']}, "
             f"float32, BLOCK_SIZE {c['block']}, medians of {c['runs']})", "",
             f"Device: {env.get('device', '?')}; {env.get('date', '')}; git {env['git'].get('commit', '')[:10]}; "
             f"CPU instruction set {env['cpu'].get('isa')}, CPU kernel built for {env['cpu'].get('kernel_isa')}.",
             "", "| system and case | ms |", "|---|---|"]
    lines += [f"| {name} | {t:.1f} |" for name, t in record["times_ms"].items()]
    lines += ["", "Ratios (targets: causal / full forward + backward <= 0.6; ours-jax flex / torch.compile flex "
                  "forward <= 1.0; named flex / named option ~1.0):", ""]
    lines += [f"- {name}: {r:.2f}" for name, r in record["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flex", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile's flex (it needs a C++ compiler)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    env = host_environment()
    record = {"environment": env, **measure(args.batch, args.heads, args.seq, args.head_dim, args.block, args.runs,
                                            not args.no_compile)}
    out = args.out or RESULTS / device_slug(env) / "flex"
    out.mkdir(parents=True, exist_ok=True)
    (out / "flex.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (out / "flex.md").write_text(markdown(record))
    print(markdown(record))
    return record


if __name__ == "__main__":
    main()
