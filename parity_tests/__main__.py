"""``python -m parity_tests``: the parity report.

Builds every variant in both frameworks, copies weights (both directions), runs the
parity matrix of ``cases.py`` forward and backward on each case's path (reference, fused,
blockwise, auto), then the functional cores' table, and prints one line per case: its
path, the worst absolute and relative error twin-vs-twin and against the float64
references, and pass/fail (or, for a path that must refuse a variant's option, whether
both frameworks refused it).  Exit status 1 if any case fails.

  python -m parity_tests                      # the whole matrix
  python -m parity_tests --quick              # a subset
  python -m parity_tests --variant mha --dtype bfloat16
  python -m parity_tests --variant fn --implementation fused   # the functional cores
  python -m parity_tests --json report.json --plot weights.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from parity_tests.cases import (
    DTYPES,
    IMPLEMENTATIONS,
    VARIANTS,
    Case,
    FunctionalCase,
    functional_matrix,
    matrix,
    quick,
    quick_functional,
)

FUNCTIONAL = "fn"  # --variant fn: the functional cores' table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m parity_tests", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="run a subset of the matrix")
    parser.add_argument("--variant", action="append", choices=sorted([*VARIANTS, FUNCTIONAL]),
                        help=f"only these variants ({FUNCTIONAL}: the functional cores)")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="only these dtypes")
    parser.add_argument("--implementation", action="append", choices=IMPLEMENTATIONS, help="only these paths")
    parser.add_argument("--no-grads", action="store_true", help="forward only")
    parser.add_argument("--json", metavar="PATH", help="write every finding as JSON")
    parser.add_argument("--plot", metavar="PATH", help="save a PNG of one case's attention weights")
    return parser.parse_args(argv)


def select(args: argparse.Namespace) -> list[Case | FunctionalCase]:
    cases = [*quick(), *quick_functional()] if args.quick else [*matrix(), *functional_matrix()]
    return [c for c in cases
            if (not args.variant or c.variant in args.variant) and (not args.dtype or c.dtype in args.dtype)
            and (not args.implementation or c.implementation in args.implementation)]


def have_both_frameworks() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("torch", "jax", "flax"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not have_both_frameworks():
        print("the parity report needs both PyTorch and JAX/Flax installed (see README)", file=sys.stderr)
        return 2
    # No global flag is set here: check_parity and the functional runs set full-precision
    # matmuls (JAX "highest", PyTorch TF32 off) in a context of their own.
    from parity_tests.matrix import run_case

    cases = select(args)
    if not cases:
        print("no case matches the filters", file=sys.stderr)
        return 2
    width = max(len(c.id) for c in cases)
    header = (f"{'case':<{width}} {'path':<9} {'twin abs':>9} {'twin rel':>9} {'ref abs':>9} {'ref rel':>9}"
              "  result")
    print(f"parity matrix: {len(cases)} cases, {'forward' if args.no_grads else 'forward and gradients'}")
    print(header)
    print("-" * len(header))
    records: list[dict[str, Any]] = []
    failures = 0
    start = time.perf_counter()
    for i, case in enumerate(cases, 1):
        result = run_case(case, grads=not args.no_grads)
        twin_abs, twin_rel = result.worst("parity")
        ref_abs, ref_rel = result.worst("oracle")
        failures += not result.ok
        status = "pass" if result.ok else "FAIL"
        if case.refusal is not None:
            status = f"{'refused' if result.ok else 'FAIL'} ({case.refusal})"
        print(f"{case.id:<{width}} {case.implementation:<9} {twin_abs:9.2e} {twin_rel:9.2e} {ref_abs:9.2e} "
              f"{ref_rel:9.2e}  {status}   [{i}/{len(cases)} {time.perf_counter() - start:5.0f}s]", flush=True)
        if not result.ok:
            for problem in result.problems:
                print(f"    {problem}")
            for finding in result.findings:
                if not finding.ok:
                    print(f"    {finding.describe()}")
        axes = ({"batch": case.batch, "heads": case.heads, "seq": case.seq, "direction": case.direction}
                if isinstance(case, Case) else
                {"q_len": case.q_len, "kv_len": case.kv_len, "causal": case.causal, "lengths": case.lengths})
        records.append({
            "id": case.id, "variant": case.variant, **axes, "mask": case.mask, "dtype": case.dtype,
            "implementation": case.implementation, "weights": case.weights, "refusal": case.refusal,
            "ok": result.ok, "problems": result.problems,
            "findings": [
                {"name": f.name, "ok": f.ok, "max_abs": f.max_abs, "max_rel": f.max_rel,
                 "index": list(f.index), "torch": f.torch_value, "flax": f.flax_value,
                 "rtol": f.rtol, "atol": f.atol, "needed": f.needed}
                for f in result.findings
            ],
        })
    print_summary(records)
    print(f"{len(cases) - failures} passed, {failures} failed in {time.perf_counter() - start:.0f}s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cases": records}, fh, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(_plot_case(cases), args.plot)
        print(f"wrote {args.plot}")
    return 1 if failures else 0


def print_summary(records: list[dict[str, Any]]) -> None:
    """Per dtype and per path, the smallest rtol = atol that every case would pass with
    (how the tolerances in tolerances.py are measured): twin vs twin and vs float64."""
    print()
    print("tolerance needed (rtol = atol):")
    print(f"{'':<10} {'twin fwd':>9} {'twin grad':>10} {'ref fwd':>9} {'ref grad':>10}")
    groups = [("dtype", d) for d in DTYPES] + [("implementation", p) for p in IMPLEMENTATIONS]
    for key, value in groups:
        rows = [r for r in records if r[key] == value]
        if not rows:
            continue

        def worst(twin: bool, grad: bool, rows: list[dict[str, Any]] = rows) -> float:
            values = [f["needed"] for r in rows for f in r["findings"]
                      if (("vs" not in f["name"]) == twin) and (("grad" in f["name"]) == grad)]
            return max(values, default=0.0)

        print(f"{value:<10} {worst(True, False):9.2e} {worst(True, True):10.2e} "
              f"{worst(False, False):9.2e} {worst(False, True):10.2e}")
    print()


def _plot_case(cases: list[Case | FunctionalCase]) -> Case:
    """The case to plot: the first module case with more than one token (weights are
    taken on the reference path whatever the case's own path)."""
    module_cases = [c for c in cases if isinstance(c, Case)] or list(quick())
    return next((c for c in module_cases if c.seq > 1), module_cases[0])


def plot(case: Case, path: str) -> None:
    """One case's attention weights (first example, first head) in both frameworks and
    their difference, on the reference path (the only one that has weights)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from parity_tests.harness import check_parity
    from parity_tests.matrix import build_pair

    torch_m, flax_m = build_pair(case)
    x, mask = case.inputs()
    report = check_parity(torch_m, flax_m, x, mask=mask, grads=False, implementation="reference", weights=True)
    t = np.asarray(report.torch_results["attention weights"], np.float64)[0, 0]
    f = np.asarray(report.flax_results["attention weights"], np.float64)[0, 0]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, data, title, cmap in (
        (axes[0], t, "PyTorch", "viridis"), (axes[1], f, "Flax NNX", "viridis"),
        (axes[2], f - t, "Flax - PyTorch", "RdBu"),
    ):
        limit = max(float(np.abs(data).max()), 1e-30)
        image = ax.imshow(data, cmap=cmap, vmin=-limit if cmap == "RdBu" else 0, vmax=limit)
        ax.set_title(title)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"attention weights, {case.id} (example 0, head 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
