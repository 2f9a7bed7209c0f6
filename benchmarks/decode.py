"""``python -m benchmarks.decode``: KV-cache decoding speed, tokens per second.

Each system prefills a prompt into an empty cache once (in chunks, outside the clock),
then each timed run decodes one token at a time (``B`` sequences in parallel) from a copy
of that cache; the clock covers the decode loop only, each step's output made ready
before the next (``block_until_ready``), and a step's cost does not depend on the token
values, so the input tokens are random.

Systems:
  ours-torch     ``torch_attention.MultiHeadAttention``, ``module(x, cache=cache)`` (auto path)
  ours-jax       ``jax_attention.MultiHeadAttention``: one jitted step (``nnx.split`` once,
                 ``jax.jit`` of the merged module's call, the cache donated), compiled once
                 before the clock starts; the cache is a fixed-shape pytree of max_len positions
  ours-jax-loop  the same module, the whole decode loop in one compiled call: a
                 ``jax.lax.fori_loop`` over the new tokens inside one ``jax.jit`` (the cache
                 the loop's carry and donated, the step's token read from the token array)
  torch-sdpa     a plain PyTorch loop: the same projections (our module's weights), a
                 preallocated cache written with slice assignment and
                 ``F.scaled_dot_product_attention`` over the filled prefix (new shapes each
                 step; the fastest eager loop without a library)

The JAX systems use only the module's public API (``init_cache``, ``module(x, cache=...)``,
``nnx.split`` / ``nnx.merge``) and treat the cache as an opaque pytree.  Every system
decodes the same tokens with the same weights, and each one's outputs are checked against
the float64 loop oracle (``benchmarks/oracle_check.py``: the module's projections and
``reference.attention``, at ``ORACLE``'s float32 tolerance) at the first sequence of the
batch and the new tokens that ``oracle_check.rows`` picks (all of them at small sizes; a few,
the last among them, where the prompt is long).  One of ours that is wrong fails the run;
torch-sdpa, where it is wrong, is recorded in ``wrong`` (its error, the tolerance, the
device, PyTorch's CPU capability, the ISA) and is then in no ratio (the "x torch-sdpa"
column is left empty, and it has no max_len row).  Cases: every ``--batches`` x ``--prompts``, a
cache of prompt + new tokens; and the max_len row: for each of ``--max-len-batches``,
with the first prompt, a cache of ``--long-max-len`` positions against that case's (a
step's cost should follow the filled part, not max_len), the two caches run together,
round by round (``run_together``), so that their ratio is not a drift of the machine
between them.  Cases past 64 x 1024 cached
tokens run ``--long-runs`` times (batch 64 with a 4096-token prompt), and a system whose
run passes ``--budget-s`` seconds runs no more in its case.  Results go to
``benchmarks/results/<device>/decode.{json,md}`` (or ``--out``) with the CPU's
instruction set and the CPU kernel's build; the medians of the runs are reported, with the range.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from benchmarks import oracle_check
from benchmarks.environment import device_slug, host_environment

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("ours-torch", "ours-jax", "ours-jax-loop", "torch-sdpa")
REFERENCE = "torch-sdpa"  # the baseline of the speed column (where the oracle finds it right)
PREFILL_CHUNK = 256  # prompt tokens per prefill call (a long prompt at batch 64 stays small)

# A prepared system: each call decodes the new tokens once from a fresh copy of the
# prefilled cache and returns (seconds, outputs (B, new_tokens, d_model)).
Runner = Callable[[], tuple[float, np.ndarray]]


class Case(NamedTuple):
    batch: int
    prompt_len: int
    max_len: int
    runs: int


def _torch_setup(d_model: int, heads: int, kv_heads: int, seed: int = 0) -> Any:
    import torch

    import torch_attention

    torch.manual_seed(seed)
    return torch_attention.MultiHeadAttention(d_model, d_model, None, 0.0, heads, True, num_kv_heads=kv_heads).eval()


def _chunks(prompt: np.ndarray) -> list[np.ndarray]:
    return [prompt[:, i : i + PREFILL_CHUNK] for i in range(0, prompt.shape[1], PREFILL_CHUNK)]


def ours_torch(module: Any, prompt: np.ndarray, tokens: np.ndarray, max_len: int) -> Runner:
    import torch

    with torch.no_grad():
        filled = module.init_cache(prompt.shape[0], max_len)
        for chunk in _chunks(prompt):
            _, filled = module(torch.from_numpy(chunk), cache=filled)
    steps = [torch.from_numpy(tokens[:, i : i + 1]) for i in range(tokens.shape[1])]

    def run() -> tuple[float, np.ndarray]:
        with torch.no_grad():
            cache = type(filled)(*(t.clone() for t in filled))
            outs = []
            start = time.perf_counter()
            for token in steps:
                out, cache = module(token, cache=cache)
                outs.append(out)
            elapsed = time.perf_counter() - start
        return elapsed, torch.cat(outs, 1).numpy()

    return run


def torch_sdpa(module: Any, prompt: np.ndarray, tokens: np.ndarray, max_len: int) -> Runner:
    """A user's own decode loop on SDPA with the module's weights (no library code)."""
    import torch
    import torch.nn.functional as F

    heads, kv_heads = module.spec.num_heads, module.spec.kv_heads
    head_dim = module.spec.head_dim
    wq, wk, wv, wo = module.W_query, module.W_key, module.W_value, module.out_proj

    def split(t: Any, h: int) -> Any:
        return t.view(t.shape[0], t.shape[1], h, head_dim).transpose(1, 2)

    batch, prompt_len = prompt.shape[:2]
    with torch.no_grad():
        k_filled = torch.zeros(batch, kv_heads, max_len, head_dim)
        v_filled = torch.zeros(batch, kv_heads, max_len, head_dim)
        for i, chunk in zip(range(0, prompt_len, PREFILL_CHUNK), _chunks(prompt), strict=True):
            x = torch.from_numpy(chunk)
            k_filled[:, :, i : i + x.shape[1]] = split(wk(x), kv_heads)
            v_filled[:, :, i : i + x.shape[1]] = split(wv(x), kv_heads)
    steps = [torch.from_numpy(tokens[:, i : i + 1]) for i in range(tokens.shape[1])]

    def run() -> tuple[float, np.ndarray]:
        with torch.no_grad():
            k_cache, v_cache, n = k_filled.clone(), v_filled.clone(), prompt_len
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

    return run


def _jax_prefilled(module: Any, prompt: np.ndarray, max_len: int) -> Callable[[], Any]:
    """The prompt prefilled once (eager calls, chunk by chunk); returns a function that
    gives a fresh copy of that cache (a donated cache is consumed by the call it enters)."""
    import jax
    import jax.numpy as jnp

    cache = module.init_cache(prompt.shape[0], max_len)
    for chunk in _chunks(prompt):
        _, cache = module(jnp.asarray(chunk), cache=cache)
    jax.block_until_ready(cache)
    return lambda: jax.tree.map(jnp.copy, cache)


def ours_jax(module: Any, fresh: Callable[[], Any], tokens: np.ndarray) -> Runner:
    """One jitted step per token, the cache donated (updated in place where XLA can);
    ``fresh`` gives a copy of the prefilled cache (``_jax_prefilled``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    # Flax's fast pattern for a loop: split the module once, jit a pure step (nnx.jit
    # would split and merge the module's graph in Python on every call).
    graphdef, state = nnx.split(module)

    def step_fn(state: Any, token: Any, cache: Any) -> Any:
        return nnx.merge(graphdef, state)(token, cache=cache)

    step = jax.jit(step_fn, donate_argnums=(2,))
    steps = [jnp.asarray(tokens[:, i : i + 1]) for i in range(tokens.shape[1])]
    jax.block_until_ready(step(state, steps[0], fresh()))  # compile once, outside the clock

    def run() -> tuple[float, np.ndarray]:
        cache = fresh()
        jax.block_until_ready(cache)
        outs = []
        start = time.perf_counter()
        for token in steps:
            out, cache = step(state, token, cache)
            out.block_until_ready()
            outs.append(out)
        elapsed = time.perf_counter() - start
        return elapsed, np.asarray(jnp.concatenate(outs, 1))

    return run


def ours_jax_loop(module: Any, fresh: Callable[[], Any], tokens: np.ndarray) -> Runner:
    """Every step in one compiled call: ``fori_loop`` over the new tokens, the cache the
    loop's carry (and donated), each step's output written into a preallocated array."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(module)

    def decode_all(state: Any, tokens: Any, cache: Any) -> Any:
        model = nnx.merge(graphdef, state)
        out_shape = jax.eval_shape(lambda: model(tokens[:, :1], cache=cache)[0])
        outs = jnp.zeros((tokens.shape[0], tokens.shape[1], out_shape.shape[-1]), out_shape.dtype)

        def body(i: Any, carry: Any) -> Any:
            cache, outs = carry
            token = jax.lax.dynamic_slice_in_dim(tokens, i, 1, axis=1)
            out, cache = model(token, cache=cache)
            return cache, jax.lax.dynamic_update_slice_in_dim(outs, out, i, axis=1)

        cache, outs = jax.lax.fori_loop(0, tokens.shape[1], body, (cache, outs))
        return outs, cache

    new = jnp.asarray(tokens)
    # compiled ahead of time, outside the clock (a warm-up call would decode every token once more)
    loop = jax.jit(decode_all, donate_argnums=(2,)).lower(state, new, fresh()).compile()

    def run() -> tuple[float, np.ndarray]:
        cache = fresh()
        jax.block_until_ready(cache)
        start = time.perf_counter()
        outs, cache = loop(state, new, cache)
        outs.block_until_ready()
        elapsed = time.perf_counter() - start
        return elapsed, np.asarray(outs)

    return run


def prepare(systems: tuple[str, ...], torch_module: Any, prompt: np.ndarray, tokens: np.ndarray,
            max_len: int) -> dict[str, Runner]:
    """Each system's runner; the JAX systems share one prefill of the module's twin."""
    runners: dict[str, Runner] = {}
    if "ours-jax" in systems or "ours-jax-loop" in systems:
        from parity_tests.harness import to_flax

        jax_module = to_flax(torch_module)
        fresh = _jax_prefilled(jax_module, prompt, max_len)
    for name in systems:
        if name == "ours-torch":
            runners[name] = ours_torch(torch_module, prompt, tokens, max_len)
        elif name == "torch-sdpa":
            runners[name] = torch_sdpa(torch_module, prompt, tokens, max_len)
        else:
            runners[name] = (ours_jax if name == "ours-jax" else ours_jax_loop)(jax_module, fresh, tokens)
    return runners


def run_together(cases: list[Case], d_model: int, heads: int, kv_heads: int, new_tokens: int,
                 systems: tuple[str, ...] = SYSTEMS, budget_s: float = math.inf) -> dict[Case, dict[str, Any]]:
    """Cases of one batch and prompt (a max_len pair: the same tokens and weights, two
    caches): every system of every case prepared, then rounds, each (case, system) once
    per round while it has runs left (interleaved: a slow moment of the machine hits
    every system and both caches alike, so that a ratio between the cases is not a
    drift of the machine), except that a system with a run past ``budget_s`` runs no
    more in its case (its row says how many it had); each system's outputs checked
    against the float64 oracle (``decode_oracle``)."""
    first = cases[0]
    assert all((c.batch, c.prompt_len) == (first.batch, first.prompt_len) for c in cases), cases
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((first.batch, first.prompt_len, d_model)).astype(np.float32)
    tokens = rng.standard_normal((first.batch, new_tokens, d_model)).astype(np.float32)
    module = _torch_setup(d_model, heads, kv_heads)
    runners = {case: prepare(systems, module, prompt, tokens, case.max_len) for case in cases}
    times: dict[Case, dict[str, list[float]]] = {case: {name: [] for name in systems} for case in cases}
    outputs: dict[Case, dict[str, np.ndarray]] = {case: {} for case in cases}
    for round_ in range(max(case.runs for case in cases)):
        for case in cases:
            for name, runner in runners[case].items():
                done = times[case][name]
                if round_ >= case.runs or (done and max(done) > budget_s):
                    continue
                elapsed, out = runner()
                done.append(elapsed)
                outputs[case][name] = out
    oracle = decode_oracle(module, prompt, tokens)
    return {case: _summary(case, times[case], outputs[case], d_model, heads, kv_heads, new_tokens, systems, oracle)
            for case in cases}


def decode_oracle(module: Any, prompt: np.ndarray, tokens: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The new tokens checked (indices into them) and the float64 oracle's outputs there
    for the batch's first sequence: causal attention over the prompt and the tokens before,
    with ``module``'s weights (``oracle_check.module_rows``)."""
    spec = module.spec
    prompt_len, new = prompt.shape[1], tokens.shape[1]
    at = oracle_check.rows(new, prompt_len + new, spec.num_heads, causal=True, offset=prompt_len)
    weights = {f"{w}{kind}": None if getattr(getattr(module, layer), name) is None else
               getattr(getattr(module, layer), name).detach().numpy().astype(np.float64).T
               for kind, layer in (("q", "W_query"), ("k", "W_key"), ("v", "W_value"), ("o", "out_proj"))
               for w, name in (("w", "weight"), ("b", "bias"))}
    x0 = np.concatenate([prompt[0], tokens[0]]).astype(np.float64)
    want = oracle_check.module_rows(x0, weights, heads=spec.num_heads, kv_heads=spec.kv_heads,
                                    head_dim=spec.head_dim, causal=True, at=[prompt_len + i for i in at],
                                    scale=spec.scale)
    return at, want


def _summary(case: Case, times: dict[str, list[float]], outputs: dict[str, np.ndarray], d_model: int, heads: int,
             kv_heads: int, new_tokens: int, systems: tuple[str, ...],
             oracle: tuple[list[int], np.ndarray]) -> dict[str, Any]:
    """A case's record: each system's outputs checked against the oracle (AssertionError
    for one of ours that is wrong), each system's median."""
    at, want = oracle
    checks = oracle_check.Checks()
    for name in systems:
        if name in outputs:
            checks.check(name, outputs[name][0, at], want, "float32",
                         framework="torch" if "torch" in name else "jax",
                         checked=f"batch {case.batch}, prompt {case.prompt_len}, max_len {case.max_len}: sequence 0, "
                                 f"{len(at)} of {new_tokens} new tokens")
    verdicts = {v["system"]: v for v in checks.verdicts}
    reference = REFERENCE if REFERENCE in outputs and not checks.is_wrong(REFERENCE) else None
    rows = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rows.append({
            "system": name, "median_s": median, "min_s": min(ts), "max_s": max(ts),
            "tokens_per_s": case.batch * new_tokens / median, "ms_per_step": 1e3 * median / new_tokens,
            "max_abs_error": verdicts[name]["max_abs_error"], "wrong": not verdicts[name]["ok"], "runs": len(ts),
        })
    return {
        "config": {"batch": case.batch, "d_model": d_model, "num_heads": heads, "num_kv_heads": kv_heads,
                   "prompt_len": case.prompt_len, "new_tokens": new_tokens, "max_len": case.max_len,
                   "runs": case.runs, "dtype": "float32", "reference": reference},
        "rows": rows, "wrong": checks.wrong,
    }


def cases(batches: list[int], prompts: list[int], new_tokens: int, runs: int, long_runs: int,
          long_max_len: int, max_len_batches: list[int] | None = None) -> tuple[list[Case], list[tuple[Case, Case]]]:
    """The main cases (every batch x prompt, a cache of prompt + new tokens; ``long_runs``
    runs where batch x (prompt + new) passes 64 x 1024 tokens) and the max_len pairs for
    each of ``max_len_batches`` among ``batches`` (None: all): the first prompt's case,
    and the same with a cache of ``long_max_len``, as many runs; none where it is 0 or
    not longer."""
    def runs_for(batch: int, max_len: int) -> int:
        return long_runs if batch * max_len > 64 * 1024 else runs

    main = [Case(b, p, p + new_tokens, runs_for(b, p + new_tokens)) for b in batches for p in prompts]
    pairs = []
    if long_max_len > prompts[0] + new_tokens:
        for b in (batches if max_len_batches is None else [b for b in batches if b in max_len_batches]):
            short = next(c for c in main if c.batch == b and c.prompt_len == prompts[0])
            pairs.append((short, short._replace(max_len=long_max_len)))
    return main, pairs


def max_len_rows(pairs: list[tuple[Case, Case]], results: dict[Case, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch and system: the median time with the long cache over the short one's."""
    rows = []
    for short, long in pairs:
        by_system = {r["system"]: r["median_s"] for r in results[short]["rows"] if not r["wrong"]}
        for r in results[long]["rows"]:
            if r["wrong"] or r["system"] not in by_system:
                continue  # a system the oracle found wrong is in no ratio
            rows.append({"batch": short.batch, "prompt_len": short.prompt_len, "short_max_len": short.max_len,
                         "long_max_len": long.max_len, "system": r["system"], "short_s": by_system[r["system"]],
                         "long_s": r["median_s"], "ratio": r["median_s"] / by_system[r["system"]]})
    return rows


def instruction_sets(env: dict[str, Any]) -> dict[str, Any]:
    """The CPU's instruction set (from its flags: ``isa``), the CPU kernel's build
    (``kernel_isa``, predicted without building, and ``kernel_isa_built``, as the built
    library reports it), ``$TWIN_ATTENTION_MARCH``, whether ``auto`` takes the kernel,
    and PyTorch's CPU capability."""
    import torch

    out = {k: env["cpu"].get(k) for k in ("isa", "kernel_isa", "kernel_march", "auto_declines", "auto_basis")}
    out["kernel_isa_built"] = None
    try:
        from jax_attention import _cpu_kernel
    except ImportError:
        pass
    else:
        out["kernel_isa_built"] = _cpu_kernel.instruction_set()  # (None where it cannot be built)
    out["twin_attention_march"] = os.environ.get("TWIN_ATTENTION_MARCH")
    out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return out


def markdown(results: list[dict[str, Any]], max_len: list[dict[str, Any]], env: dict[str, Any]) -> str:
    isa = env.get("instruction_sets", {})
    lines = ["# KV-cache decoding", "",
             f"Device: {env.get('device')}; {env.get('date')}; git {(env.get('git') or {}).get('commit', '?')[:10]}.",
             f"CPU instruction set: {isa.get('isa')}; CPU kernel built for {isa.get('kernel_isa_built') or isa.get('kernel_isa')}"
             f" (TWIN_ATTENTION_MARCH={isa.get('twin_attention_march') or 'unset'}); torch CPU capability "
             f"{isa.get('torch_cpu_capability')}; load average at start {env.get('load_average_at_start')}.", "",
             "| batch | prompt | max_len | new tokens | system | tokens/s | x torch-sdpa | ms/step | range (s) | runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["config"]
        base = {row["system"]: row["tokens_per_s"] for row in r["rows"] if not row["wrong"]}.get(REFERENCE)
        for row in r["rows"]:
            rel = "wrong" if row["wrong"] else f"{row['tokens_per_s'] / base:.2f}" if base else "-"
            lines.append(
                f"| {c['batch']} | {c['prompt_len']} | {c['max_len']} | {c['new_tokens']} | {row['system']} | "
                f"{row['tokens_per_s']:.0f} | {rel} | {row['ms_per_step']:.3f} | {row['min_s']:.3f}-{row['max_s']:.3f} | "
                f"{row['runs']} |")
    if max_len:
        lines += ["", "max_len: the decode time with a long cache over a short one (the same prompt and tokens; "
                  "target: within 1.2x)", "",
                  "| batch | prompt | max_len | system | short (s) | long (s) | ratio |", "|---|---|---|---|---|---|---|"]
        for m in max_len:
            lines.append(f"| {m['batch']} | {m['prompt_len']} | {m['long_max_len']} vs {m['short_max_len']} | "
                         f"{m['system']} | {m['short_s']:.3f} | {m['long_s']:.3f} | {m['ratio']:.2f} |")
    wrong = oracle_check.wrong_text([v for r in results for v in r["wrong"]])
    return "\n".join(lines) + "\n" + ("\n" + wrong if wrong else "")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=_ints, default=[1, 8, 64], help="comma-separated (default 1,8,64)")
    parser.add_argument("--prompts", type=_ints, default=[128, 4096], help="prompt lengths (default 128,4096)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--long-max-len", type=int, default=4096,
                        help="the max_len row's long cache, with the first prompt (0: no row)")
    parser.add_argument("--max-len-batches", type=_ints, default=[1, 8],
                        help="the batches of the max_len row (default 1,8: the issue's decoding targets)")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--long-runs", type=int, default=2, help="runs of a case past 64 x 1024 cached tokens")
    parser.add_argument("--budget-s", type=float, default=10.0,
                        help="a system with a run longer than this runs no more in that case (default 10)")
    parser.add_argument("--systems", type=lambda s: tuple(s.split(",")), default=SYSTEMS,
                        help=f"comma-separated, of {','.join(SYSTEMS)}")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    env = host_environment()
    main_cases, pairs = cases(args.batches, args.prompts, args.new_tokens, args.runs, args.long_runs,
                              args.long_max_len, args.max_len_batches)
    long_of = dict(pairs)  # a case of the max_len row runs together with its long twin
    results: dict[Case, dict[str, Any]] = {}
    for case in main_cases:
        together = [case, long_of[case]] if case in long_of else [case]
        results.update(run_together(together, args.d_model, args.heads, args.kv_heads, args.new_tokens,
                                    args.systems, args.budget_s))
    env["instruction_sets"] = instruction_sets(env)
    env["load_average_at_end"] = os.getloadavg()
    record: dict[str, Any] = {"environment": env, "results": [results[c] for c in main_cases],
                              "max_len": max_len_rows(pairs, results),
                              "wrong": [v for c in main_cases + [long for _, long in pairs] for v in results[c]["wrong"]]}
    out_dir = args.out or RESULTS / device_slug(env)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode.json").write_text(json.dumps(record, indent=1) + "\n")
    text = markdown(record["results"], record["max_len"], env)
    (out_dir / "decode.md").write_text(text)
    print(text)
    return record


if __name__ == "__main__":
    main()
