"""``python -m benchmarks.decode``: KV-cache decoding speed, tokens per second.

Each system prefills a prompt into an empty cache, then decodes one token at a time
(``B`` sequences in parallel); the clock covers the decode loop only, each step's output
made ready before the next (``block_until_ready`` / ``torch.cuda.synchronize``), and a
step's cost does not depend on the token values, so the input tokens are random.

Systems:
  ours-torch   ``torch_attention.MultiHeadAttention``, ``module(x, cache=cache)`` (auto path)
  ours-jax     ``jax_attention.MultiHeadAttention``: one jitted step (``nnx.split`` once,
               ``jax.jit`` of the merged module's call), compiled once before the clock
               starts; the cache is a fixed-shape pytree of max_len positions
  torch-sdpa   a plain PyTorch loop: the same projections (our module's weights), a
               preallocated cache written with slice assignment and
               ``F.scaled_dot_product_attention`` over the filled prefix (new shapes each
               step; the fastest eager loop without a library)

Every system decodes the same tokens with the same weights, and the script checks that
their outputs agree (float32: 1e-4) before it reports.  Results go to
``benchmarks/results/<device>/decode.{json,md}``; the medians of ``--runs`` repeats of
the whole loop are reported, with the range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.environment import device_slug, host_environment

RESULTS = Path(__file__).resolve().parent / "results"


def _torch_setup(d_model: int, heads: int, kv_heads: int, seed: int = 0) -> Any:
    import torch

    import torch_attention

    torch.manual_seed(seed)
    return torch_attention.MultiHeadAttention(d_model, d_model, None, 0.0, heads, True, num_kv_heads=kv_heads).eval()


def decode_ours_torch(module: Any, prompt: np.ndarray, tokens: np.ndarray, max_len: int) -> tuple[float, np.ndarray]:
    import torch

    with torch.no_grad():
        cache = module.init_cache(prompt.shape[0], max_len)
        module(torch.from_numpy(prompt), cache=cache)
        steps = [torch.from_numpy(tokens[:, i : i + 1]) for i in range(tokens.shape[1])]
        outs = []
        start = time.perf_counter()
        for token in steps:
            out, cache = module(token, cache=cache)
            outs.append(out)
        elapsed = time.perf_counter() - start
    return elapsed, torch.cat(outs, 1).numpy()


def decode_torch_sdpa(module: Any, prompt: np.ndarray, tokens: np.ndarray, max_len: int) -> tuple[float, np.ndarray]:
    """A user's own decode loop on SDPA with the module's weights (no library code)."""
    import torch
    import torch.nn.functional as F

    heads, kv_heads = module.spec.num_heads, module.spec.kv_heads
    head_dim = module.spec.head_dim
    wq, wk, wv, wo = module.W_query, module.W_key, module.W_value, module.out_proj

    def split(t: Any, h: int) -> Any:
        return t.view(t.shape[0], t.shape[1], h, head_dim).transpose(1, 2)

    with torch.no_grad():
        batch = prompt.shape[0]
        k_cache = torch.zeros(batch, kv_heads, max_len, head_dim)
        v_cache = torch.zeros(batch, kv_heads, max_len, head_dim)
        x = torch.from_numpy(prompt)
        n = x.shape[1]
        k_cache[:, :, :n] = split(wk(x), kv_heads)
        v_cache[:, :, :n] = split(wv(x), kv_heads)
        steps = [torch.from_numpy(tokens[:, i : i + 1]) for i in range(tokens.shape[1])]
        outs = []
        start = time.perf_counter()
        for token in steps:
            q = split(wq(token), heads)
            k_cache[:, :, n : n + 1] = split(wk(token), kv_heads)
            v_cache[:, :, n : n + 1] = split(wv(token), kv_heads)
            n += 1
            o = F.scaled_dot_product_attention(q, k_cache[:, :, :n], v_cache[:, :, :n], enable_gqa=True)
            outs.append(wo(o.transpose(1, 2).reshape(batch, 1, heads * head_dim)))
        elapsed = time.perf_counter() - start
    return elapsed, torch.cat(outs, 1).numpy()


def decode_ours_jax(module: Any, prompt: np.ndarray, tokens: np.ndarray, max_len: int) -> tuple[float, np.ndarray]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    # Flax's fast pattern for a loop: split the module once, jit a pure step (nnx.jit
    # would split and merge the module's graph in Python on every call).
    graphdef, state = nnx.split(module)

    @jax.jit
    def step(state: Any, token: Any, cache: Any) -> Any:
        return nnx.merge(graphdef, state)(token, cache=cache)

    cache = module.init_cache(prompt.shape[0], max_len)
    _, cache = module(jnp.asarray(prompt), cache=cache)
    steps = [jnp.asarray(tokens[:, i : i + 1]) for i in range(tokens.shape[1])]
    jax.block_until_ready(step(state, steps[0], cache))  # compile once, outside the clock
    outs = []
    start = time.perf_counter()
    for token in steps:
        out, cache = step(state, token, cache)
        out.block_until_ready()
        outs.append(out)
    elapsed = time.perf_counter() - start
    return elapsed, np.asarray(jnp.concatenate(outs, 1))


def run(batch: int, d_model: int, heads: int, kv_heads: int, prompt_len: int, new_tokens: int,
        runs: int) -> dict[str, Any]:
    from parity_tests.harness import to_flax

    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((batch, prompt_len, d_model)).astype(np.float32)
    tokens = rng.standard_normal((batch, new_tokens, d_model)).astype(np.float32)
    max_len = prompt_len + new_tokens
    torch_module = _torch_setup(d_model, heads, kv_heads)
    jax_module = to_flax(torch_module)
    systems = {
        "ours-torch": lambda: decode_ours_torch(torch_module, prompt, tokens, max_len),
        "ours-jax": lambda: decode_ours_jax(jax_module, prompt, tokens, max_len),
        "torch-sdpa": lambda: decode_torch_sdpa(torch_module, prompt, tokens, max_len),
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, np.ndarray] = {}
    for _ in range(runs):  # interleaved: a slow moment of the machine hits every system
        for name, call in systems.items():
            elapsed, out = call()
            times[name].append(elapsed)
            outputs[name] = out
    for name, out in outputs.items():
        err = float(np.max(np.abs(out - outputs["torch-sdpa"])))
        if not err < 1e-4:
            raise AssertionError(f"{name} decodes differently from the plain SDPA loop: max abs diff {err:.3g}")
    rows = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rows.append({
            "system": name, "median_s": median, "min_s": min(ts), "max_s": max(ts),
            "tokens_per_s": batch * new_tokens / median,
            "ms_per_step": 1e3 * median / new_tokens,
        })
    return {
        "config": {"batch": batch, "d_model": d_model, "num_heads": heads, "num_kv_heads": kv_heads,
                   "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": runs, "dtype": "float32"},
        "rows": rows,
    }


def markdown(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = ["# KV-cache decoding", "", f"Device: {env.get('device')}; {env.get('date')}; git {(env.get('git') or {}).get('commit', '?')[:10]}.", "",
             "| batch | d_model | heads / kv heads | prompt | new tokens | system | tokens/s | ms/step | range (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["config"]
        for row in r["rows"]:
            lines.append(
                f"| {c['batch']} | {c['d_model']} | {c['num_heads']} / {c['num_kv_heads']} | {c['prompt_len']} | "
                f"{c['new_tokens']} | {row['system']} | {row['tokens_per_s']:.0f} | {row['ms_per_step']:.3f} | "
                f"{row['min_s']:.3f}-{row['max_s']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    env = host_environment()
    results = [run(b, args.d_model, args.heads, args.kv_heads, args.prompt, args.new_tokens, args.runs)
               for b in args.batch]
    out_dir = args.out or RESULTS / device_slug(env)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode.json").write_text(json.dumps({"environment": env, "results": results}, indent=1) + "\n")
    text = markdown(results, env)
    (out_dir / "decode.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
