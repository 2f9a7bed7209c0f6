"""Results on disk and on screen: ``<mode>.json`` (environment and every measurement),
``<mode>.md`` (the table) and ``<mode>.png`` (time and TFLOP/s against sequence length)."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import oracle_check
from benchmarks.configs import BACKWARD_FACTOR, RATIOS, SYSTEMS, Config, is_core

PHASES = (("fwd", "forward"), ("fwd_bwd", "forward+backward"))


def write_json(results: dict[str, Any], out_dir: Path) -> Path:
    """``<mode>.json`` alone (written as a run goes, so that a killed run keeps what it measured)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = (out_dir / results["mode"]).with_suffix(".json")
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


def write(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Writes the JSON, markdown and (with matplotlib installed) PNG of ``results``."""
    stem = out_dir / results["mode"]
    paths = [write_json(results, out_dir), stem.with_suffix(".md")]
    paths[1].write_text(markdown(results))
    if importlib.util.find_spec("matplotlib") is None:  # optional: the test extra has it
        print("matplotlib is not installed: no plot")
        return paths
    paths.append(stem.with_suffix(".png"))
    plot(results, paths[-1])
    return paths


# --------------------------------------------------------------------------- text


def _isa(cpu: dict[str, Any]) -> str:
    """The CPU's instruction set and the CPU kernel's build, where the results record them."""
    if cpu.get("isa") is None and cpu.get("kernel_isa") is None:
        return ""
    march = cpu.get("kernel_march") or "native"
    auto = "auto takes it" if cpu.get("auto_declines") is None else f"auto passes it by: {cpu['auto_declines']}"
    if cpu.get("auto_basis"):
        auto += f" ({cpu['auto_basis']})"
    return f"; instruction set {cpu.get('isa')}; CPU kernel built for {cpu.get('kernel_isa')} (-march={march}), {auto}"


def environment_text(env: dict[str, Any]) -> str:
    """A few lines: device, driver, CUDA/cuDNN, versions, date, load."""
    packages = env["packages"]
    versions = ", ".join(f"{name} {packages[name]}" for name in packages)
    runtime = env.get("runtime", {})
    torch_rt, jax_rt = runtime.get("torch", {}), runtime.get("jax", {})
    lines = [
        f"- device: {env['device']}; CPU: {env['cpu']['model']}, {env['cpu']['cores']} cores{_isa(env['cpu'])}",
        f"- driver: {env['driver'] or 'none (no NVIDIA GPU)'}; "
        f"torch CUDA {torch_rt.get('cuda')}, cuDNN {torch_rt.get('cudnn')}, device {torch_rt.get('device')}, "
        f"{torch_rt.get('num_threads')} threads, {torch_rt.get('cpu_capability')} kernels; "
        f"jax backend {jax_rt.get('backend')} ({jax_rt.get('platform_version')}), device {jax_rt.get('device_kind')}",
        f"- versions: {versions}; Python {env['python']}; {_git(env.get('git'))}",
        f"- date: {env['date']}; CPU busy with other work at start / end: "
        f"{_percent(env.get('cpu_busy_at_start'))} / {_percent(env.get('cpu_busy_at_end'))}; "
        f"load average (1 / 5 / 15 min) at start: {_load(env.get('load_average_at_start'))}",
    ]
    return "\n".join(lines) + "\n"


def markdown(results: dict[str, Any]) -> str:
    """The whole report: environment, the table, the ratios and the notes."""
    parts = [
        f"# Attention benchmark: {results['mode']}\n",
        environment_text(results["env"]),
        targets_text(results),
        table(results),
        ratios_text(results),
        oracle_check.wrong_text(results.get("wrong", [])),
        notes_text(results),
    ]
    return "\n".join(part for part in parts if part)


def notes_text(results: dict[str, Any]) -> str:
    return "Notes:\n\n" + "".join(f"- {note}\n" for note in results["notes"])


def table(results: dict[str, Any]) -> str:
    """One row per (config, system): median times with their spread, TFLOP/s of the
    attention core, peak memory, first-call (compile) time, error."""
    backward = results["settings"]["backward"] or any(m["fwd_bwd"] for m in results["measurements"])
    per_case = results["mode"] == "cpu-sweep"
    rates = {fw: (rt or {}).get("matmul_gflops") for fw, rt in results["env"].get("runtime", {}).items()}
    header = ["config", "system", "fwd ms (IQR)", "fwd TFLOP/s"]
    if backward:
        header += ["fwd+bwd ms (IQR)", "fwd+bwd TFLOP/s"]
    if per_case:
        header += ["fwd of matmul rate", "resident peak MiB", "host: others / steal"]
    header += ["peak MiB", "compile s (fwd / fwd+bwd)" if backward else "compile s", "error"]
    rows = []
    for m in sorted_measurements(results):
        row = [m["label"], m["system"], *_phase_cells(m["fwd"])]
        if backward:
            row += _phase_cells(m["fwd_bwd"])
        if per_case:
            rate = rates.get("jax" if m["system"].startswith(("ours-jax", "flax")) else "torch")
            achieved = m["fwd"]["tflops_incl_projections"] * 1e3 if m["fwd"] else None
            row.append("-" if rate is None or achieved is None else f"{achieved / rate:.0%}")
            growth = m.get("max_rss_growth_bytes")
            row.append("-" if growth is None else f"{growth / 2**20:,.0f}")
            share = m.get("host_share")
            row.append("-" if share is None else f"{share['others']:.0%} / {share['steal']:.0%}")
        compile_s = " / ".join(f"{m[p]['compile_s']:.2f}" for p, _ in PHASES if m[p])
        peak = "n/a" if m["peak_mem_bytes"] is None else f"{m['peak_mem_bytes'] / 2**20:,.0f}"
        row += [peak, compile_s or "-", m["error"] or _wrong_cell(m)]
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def is_wrong(m: dict[str, Any] | None) -> bool:
    """Whether measurement ``m`` is of an output the float64 oracle found wrong."""
    return bool(m and m.get("oracle") and not m["oracle"]["ok"])


def _wrong_cell(m: dict[str, Any]) -> str:
    if not is_wrong(m):
        return ""
    v = m["oracle"]
    return f"wrong: {v['max_abs_error']:.3g} off the float64 oracle (left out of the ratios)"


def _right(by_key: dict[tuple[str, str], dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The measurements whose output the oracle did not find wrong: what ratios and targets use."""
    return {key: m for key, m in by_key.items() if not is_wrong(m)}


def ratios_text(results: dict[str, Any]) -> str:
    """``a / b`` of median times for each pair in ``configs.RATIOS`` measured in this run
    (below 1.0: a is faster); where the systems were timed in turns, also the median of
    the rounds' own ratios (run i of a over run i of b, taken within one round).  A
    system that the oracle found wrong is in no ratio."""
    in_turns = results.get("settings", {}).get("in_turns", False)
    by_key = _right({(m["system"], m["label"]): m for m in results["measurements"]})
    lines = []
    for label in dict.fromkeys(m["label"] for m in sorted_measurements(results)):
        for a, b in RATIOS:
            ma, mb = by_key.get((a, label)), by_key.get((b, label))
            if ma is None or mb is None:
                continue
            parts = []
            for phase, name in PHASES:
                if ma[phase] and mb[phase]:
                    part = f"{name} {ma[phase]['median_ms'] / mb[phase]['median_ms']:.2f}"
                    times_a, times_b = ma[phase]["times_ms"], mb[phase]["times_ms"]
                    if in_turns and len(times_a) == len(times_b):
                        per_round = statistics.median(x / y for x, y in zip(times_a, times_b, strict=True))
                        part += f" (per round {per_round:.2f})"
                    parts.append(part)
            if parts:
                lines.append(f"- {label}: {a} / {b} = {', '.join(parts)}")
    if not lines:
        return ""
    return "Time ratios (median time, below 1.0 = the first is faster):\n\n" + "\n".join(lines) + "\n"


SDPA_BACKENDS = ("core-torch-sdpa-flash", "core-torch-sdpa-cudnn", "core-torch-sdpa-efficient")
# Issue 12's targets (H100, bfloat16, head_dim 128, S >= 4096, attention-core FLOPs).
TARGET_FWD_TFLOPS, TARGET_BWD_TFLOPS, TARGET_OVER_FLAX = 550.0, 450.0, 3.0


def backward_tflops(m: dict[str, Any]) -> float | None:
    """The backward pass's own rate: its FLOPs (2.5x the forward's) over the
    forward+backward time less the forward time, as FlashAttention's papers count it."""
    if not (m and m["fwd"] and m["fwd_bwd"]):
        return None
    seconds = (m["fwd_bwd"]["median_ms"] - m["fwd"]["median_ms"]) / 1e3
    config = Config.from_json(m["config"])
    return BACKWARD_FACTOR * config.flops() / seconds / 1e12 if seconds > 0 else None


def targets_text(results: dict[str, Any]) -> str:
    """Issue 12's targets, per config of bfloat16 at head_dim 128 and S >= 4096: the rate
    of ours-JAX's fused core forward and backward, its speed over the fastest SDPA
    backend on its own (core against core, above 1.0 = ours faster) and the speed of
    ours-JAX's fused module over flax.nnx.MultiHeadAttention's (module against module).
    A system that the oracle found wrong counts as not measured."""
    by_key = _right({(m["system"], m["label"]): m for m in results["measurements"]})
    rows = []
    for label in dict.fromkeys(m["label"] for m in sorted_measurements(results)):
        ours = by_key.get(("core-jax-fused", label))
        if ours is None:
            continue
        config = Config.from_json(ours["config"])
        if not (config.dtype == "bfloat16" and config.head_dim == 128 and config.seq >= 4096):
            continue
        cells = [label]
        cells.append(f"{ours['fwd']['tflops']:.0f}" if ours["fwd"] else f"- ({ours['error']})")
        bwd = backward_tflops(ours)
        cells.append("-" if bwd is None else f"{bwd:.0f}")
        kernel = by_key.get(("core-jax-cudnn", label))
        kernel_bwd = backward_tflops(kernel) if kernel else None
        cells.append("-" if not kernel or not kernel["fwd"] else
                     f"{kernel['fwd']['tflops']:.0f} / {'-' if kernel_bwd is None else f'{kernel_bwd:.0f}'}")
        for phase in ("fwd", "fwd_bwd"):
            sdpa = [(by_key[(s, label)][phase]["median_ms"], s) for s in SDPA_BACKENDS
                    if (s, label) in by_key and by_key[(s, label)][phase]]
            if sdpa and ours[phase]:
                best_ms, best = min(sdpa)
                cells.append(f"{best_ms / ours[phase]['median_ms']:.2f} ({best.removeprefix('core-torch-sdpa-')})")
            else:
                cells.append("-")
        module, flax = by_key.get(("ours-jax-fused", label)), by_key.get(("flax-nnx-mha", label))
        if module and flax and module["fwd"] and flax["fwd"]:
            cells.append(f"{flax['fwd']['median_ms'] / module['fwd']['median_ms']:.2f}")
        else:
            cells.append("-" if not flax or not flax["error"] else f"- (flax: {flax['error'][:60]})")
        rows.append(cells)
    if not rows:
        return ""
    header = ["config", "core-jax-fused fwd TFLOP/s", "bwd TFLOP/s", "core-jax-cudnn fwd / bwd TFLOP/s",
              "fwd speed / best SDPA",
              "fwd+bwd speed / best SDPA", "module fwd speed / flax-nnx-mha"]
    lines = [
        f"Issue 12's targets (bfloat16, head_dim 128, S >= 4096): forward >= {TARGET_FWD_TFLOPS:.0f} and "
        f"backward >= {TARGET_BWD_TFLOPS:.0f} TFLOP/s (attention-core FLOPs; the backward's time is "
        "forward+backward less forward), at least 1.0x the fastest SDPA backend (its time over ours) and "
        f"at least {TARGET_OVER_FLAX:.0f}x flax.nnx.MultiHeadAttention. core-jax-cudnn is the kernel "
        "that ours wraps, called alone in its own layout (B, S, H, D):\n",
        "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def progress_line(m: dict[str, Any]) -> str:
    """One line per finished measurement, printed while the benchmark runs."""
    parts = [f"{m['system']:<21} {m['label']:<36}"]
    for phase, name in PHASES:
        if m[phase]:
            parts.append(f"{name} {m[phase]['median_ms']:9.3f} ms {m[phase]['tflops']:8.3f} TFLOP/s")
    if m["error"]:
        parts.append(f"ERROR {m['error']}")
    if is_wrong(m):
        parts.append(f"WRONG {m['oracle']['max_abs_error']:.3g} off the float64 oracle ({m['oracle']['checked']})")
    return "  ".join(parts)


def sorted_measurements(results: dict[str, Any]) -> list[dict[str, Any]]:
    """By config (in run order), then system (in run order)."""
    systems = {s: i for i, s in enumerate(results["systems"])}
    configs: dict[str, int] = {}
    for m in results["measurements"]:
        configs.setdefault(m["label"], len(configs))
    return sorted(
        results["measurements"],
        key=lambda m: (configs[m["label"]], systems.get(m["system"], len(systems))),
    )


def _phase_cells(timing: dict[str, Any] | None) -> list[str]:
    if timing is None:
        return ["-", "-"]
    return [f"{timing['median_ms']:.3f} ({timing['iqr_pct']:.0f}%)", f"{timing['tflops']:.3g}"]


def _git(git: dict[str, Any] | None) -> str:
    if git is None:
        return "not a git checkout"
    modified = f", modified: {', '.join(git['modified'])}" if git["modified"] else ""
    return f"commit {git['commit'][:12]}{modified}"


def _percent(fraction: float | None) -> str:
    return "unknown" if fraction is None else f"{fraction:.0%}"


def _load(load: list[float] | None) -> str:
    return "unknown" if load is None else " / ".join(f"{x:.2f}" for x in load)


# --------------------------------------------------------------------------- plot


def plot(results: dict[str, Any], path: Path) -> None:
    """Against sequence length, a line per system: the median time (both axes
    logarithmic) and, below it, TFLOP/s; a pair of rows per (head_dim, causal, dtype)
    group, a column per phase measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measurements = sorted_measurements(results)
    groups = list(dict.fromkeys(Config.from_json(m["config"]).group for m in measurements))
    phases = [(p, name) for p, name in PHASES if any(m[p] for m in measurements)] or [PHASES[0]]
    quantities = (("median_ms", "time, ms (median)", True), ("tflops", "TFLOP/s (attention core)", False))
    fig, axes = plt.subplots(
        len(quantities) * len(groups), len(phases), figsize=(6.5 * len(phases), 3.8 * len(quantities) * len(groups)),
        squeeze=False, constrained_layout=True,
    )
    for g, group in enumerate(groups):
        head_dim, causal, dtype = group
        in_group = [m for m in measurements if Config.from_json(m["config"]).group == group]
        seqs = sorted({m["config"]["seq"] for m in in_group})
        for q, (key, label, log_y) in enumerate(quantities):
            for col, (phase, name) in enumerate(phases):
                ax = axes[len(quantities) * g + q][col]
                for system in results["systems"]:
                    points = sorted(
                        (m["config"]["seq"], m[phase][key])
                        for m in in_group if m["system"] == system and m[phase]
                    )
                    if points:
                        xs, ys = zip(*points, strict=True)
                        ax.plot(xs, ys, marker="o", color=_color(system), label=system,
                                linestyle="--" if is_core(system) else "-")
                ax.set_xscale("log", base=2)
                if log_y:
                    ax.set_yscale("log")
                ax.set_xticks(seqs, [str(s) for s in seqs])
                ax.set_xlabel("sequence length")
                ax.set_ylabel(label)
                ax.set_title(f"{name}: head_dim {head_dim}, {'causal' if causal else 'non-causal'}, {dtype}")
                ax.grid(True, alpha=0.3)
    legend: dict[str, Any] = {}  # one entry per system that appears in any subplot
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    if legend:
        fig.legend(handles=list(legend.values()), labels=list(legend), loc="outside right center")
    fig.suptitle(f"{results['env']['device']} ({results['mode']})")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _color(system: str) -> Any:
    """The same colour for a system in every plot, whichever systems a run has (the
    kernels alone are drawn dashed)."""
    import matplotlib

    return matplotlib.colormaps["tab20"](SYSTEMS.index(system) % 20) if system in SYSTEMS else "black"
