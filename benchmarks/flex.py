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
option (1.0).  Every system's forward output, ours and PyTorch's, is checked against the
float64 loop oracle (``benchmarks/oracle_check.py``: ``reference.flex_attention``, and
``reference.attention`` for the named option, at ``FLEX_ORACLE`` / ``ORACLE``'s float32
tolerance, 1e-5) on batch 0, every head and the rows ``oracle_check.rows`` picks (all of them
at small sizes; at S 2048, H 8 a few, the last, which sees every key, among them).  One of
ours that is wrong fails the run; torch.compile's flex, where it is wrong (on a CPU whose
PyTorch kernels are AVX2, with BLOCK_SIZE 8: docs/performance.md, Known issues), is recorded
in ``wrong`` (its error, the tolerance, the device, PyTorch's CPU capability and the ISA)
and left out of the ratios, and the run goes on.  Results go to ``benchmarks/results/<device>/flex/flex.{json,md}`` (or
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

from benchmarks import oracle_check
from benchmarks.environment import device_slug, host_environment

RESULTS = Path(__file__).resolve().parent / "results"
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

    outputs["ours-jax-flex named"] = np.asarray(jax.jit(
        lambda q_, k_, v_: jf.flex_attention(q_, k_, v_, block_mask=jax_named, **named_mods))(jq, jk, jv))
    outputs["ours-jax named option"] = np.asarray(jax.jit(
        lambda q_, k_, v_: jf.dot_product_attention(q_, k_, v_, causal=True, softcap=SOFTCAP))(jq, jk, jv))
    with torch.no_grad():
        outputs["ours-torch-flex named"] = tf.flex_attention(tq, tk, tv, block_mask=torch_named, **named_mods).numpy()
        outputs["ours-torch named option"] = tf.dot_product_attention(tq, tk, tv, causal=True, softcap=SOFTCAP).numpy()
    checks = check_outputs(outputs, q, k, v, alibi)
    ratios = {}
    for twin in ("jax", "torch"):
        ratios[f"ours-{twin}-flex causal / full, forward + backward"] = (
            times[f"ours-{twin}-flex causal forward+backward"] / times[f"ours-{twin}-flex full forward+backward"])
        ratios[f"ours-{twin}-flex named / named option, forward + backward"] = (
            times[f"ours-{twin}-flex named forward+backward"] / times[f"ours-{twin} named option forward+backward"])
    if compile_torch and not checks.is_wrong("torch-compile-flex causal"):
        ratios["ours-jax flex / torch.compile flex, forward (causal)"] = (
            times["ours-jax-flex causal forward"] / times["torch-compile-flex causal forward"])
    return {"config": {"batch": batch, "heads": heads, "seq": seq, "head_dim": dim, "block": block, "runs": runs,
                       "dtype": "float32", "score_mod": "alibi", "softcap": SOFTCAP},
            "times_ms": {name: round(t, 3) for name, t in times.items()},
            "ratios": {name: round(r, 3) for name, r in ratios.items()},
            "oracle": checks.verdicts, "wrong": checks.wrong, "torch_compile_s": compile_s}


def check_outputs(outputs: dict[str, np.ndarray], q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  alibi: Any) -> oracle_check.Checks:
    """Every system's forward output against the float64 oracle (batch 0, every head, the
    rows ``oracle_check.rows`` picks): the flex systems against ``reference.flex_attention``
    with the ALiBi mod (causal: the keys up to the query), the named ones against
    ``reference.attention`` with causal and softcap.  Raises AssertionError for one of ours
    that is wrong; the verdicts, the outside systems' wrong ones among them, are returned."""
    from parity_tests.tolerances import FLEX_ORACLE, ORACLE

    _, heads, seq, dim = q.shape
    scale = 1 / np.sqrt(dim)
    q0, k0, v0 = (a[:1] for a in (q, k, v))  # batch 0
    at = {causal: oracle_check.rows(seq, seq, heads, causal) for causal in (True, False)}
    want = {"causal": oracle_check.flex_rows(q0, k0, v0, at[True], scale=scale, score_mod=alibi, causal=True),
            "full": oracle_check.flex_rows(q0, k0, v0, at[False], scale=scale, score_mod=alibi),
            "named": oracle_check.attention_rows(q0, k0, v0, at[True], scale=scale, causal=True, softcap=SOFTCAP)}
    checks = oracle_check.Checks()
    for name, out in outputs.items():
        case = "full" if name.endswith("full") else "causal" if name.endswith("causal") else "named"
        rows = at[case != "full"]
        checks.check(name, out[:1, :, rows], want[case], "float32", framework="torch" if "torch" in name else "jax",
                     tolerance=ORACLE["float32"] if case == "named" else FLEX_ORACLE["float32"],
                     checked=f"batch 0, {heads} heads, {len(rows)} of {seq} rows")
    return checks


def markdown(record: dict[str, Any]) -> str:
    c, env = record["config"], record["environment"]
    lines = [f"# Flex attention on the CPU (B{c['batch']} H{c['heads']} S{c['seq']} D{c['head_dim']}, "
             f"float32, BLOCK_SIZE {c['block']}, medians of {c['runs']})", "",
             f"Device: {env.get('device', '?')}; {env.get('date', '')}; git {env['git'].get('commit', '')[:10]}; "
             f"CPU instruction set {env['cpu'].get('isa')}, CPU kernel built for {env['cpu'].get('kernel_isa')}.",
             "", "| system and case | ms |", "|---|---|"]
    wrong = {v["system"] for v in record["wrong"]}
    lines += [f"| {name} | {t:.1f}{' (wrong)' if name.rsplit(' ', 1)[0] in wrong else ''} |"
              for name, t in record["times_ms"].items()]
    lines += ["", "Ratios (targets: causal / full forward + backward <= 0.6; ours-jax flex / torch.compile flex "
                  "forward <= 1.0; named flex / named option ~1.0):", ""]
    lines += [f"- {name}: {r:.2f}" for name, r in record["ratios"].items()]
    errors = ", ".join(f"{v['system']} {v['max_abs_error']:.2g}" for v in record["oracle"])
    lines += ["", "Max abs error against the float64 oracle (batch 0, every head, the rows of 'checked' in the "
                  f"JSON's 'oracle'): {errors}."]
    text = oracle_check.wrong_text(record["wrong"])
    return "\n".join(lines) + "\n" + ("\n" + text if text else "")


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
