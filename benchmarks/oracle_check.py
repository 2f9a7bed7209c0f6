"""Every benchmarked system's output against the float64 loop oracle (``parity_tests.reference``),
before its times count (issue 55).

A system's verdict (``verdict``) holds its largest error against the oracle, the tolerance
of its dtype (``parity_tests.tolerances.ORACLE``, or ``FLEX_ORACLE`` for flex), and the
machine it ran on: the device, the CPU capability PyTorch reports
(``torch.backends.cpu.get_cpu_capability()``, which ``$ATEN_CPU_CAPABILITY`` lowers) and
the CPU's instruction set.  One of ours (``is_ours``) that is wrong fails the run
(``Checks.add`` raises AssertionError naming it); an outside system that is wrong is
recorded as wrong, left out of every ratio, and the run goes on.  Outside systems can be
wrong: ``torch.compile`` of PyTorch's own ``flex_attention`` with BLOCK_SIZE 8 is 1.31 off
on a CPU whose PyTorch kernels are AVX2 (docs/performance.md, Known issues).

What is checked, so that a check is cheap at benchmark sizes: the oracle is a Python loop,
about 2.5 us per (query, key) pair, so a check walks at most ``PAIRS`` pairs (about 0.2 s):
the benchmark's own call at its own shape and inputs, its output for the first example
(batch 0) only, at every head a module mixes (a core's heads are independent: the first
and the last), at the query rows ``rows`` picks: every row where they fit, else the last
row (it sees every key), the first, the middle, the quarters, the second and the last
but one, as many as fit in that order; at least one row (a non-causal row of H heads
and S keys is H * S pairs: at S 16k and H 32 about 1.3 s, the dearest check of the full
sweep).  A causal row i walks its keys 0..i only, and a module's keys and values are
projected (float64) only as far as the rows checked reach.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from parity_tests.tolerances import ORACLE, Tolerance

PAIRS = 2**16  # (query, key) pairs a check walks at most (but at least one row)
OURS_CORES = ("core-jax-fused", "core-torch-fused")  # ours without the "ours-" prefix


def is_ours(system: str) -> bool:
    """Whether ``system`` is one of this library's (``ours-...``, or its cores alone)."""
    return system.startswith("ours-") or system in OURS_CORES


def rows(q_len: int, kv_len: int, heads: int, causal: bool, offset: int = 0, budget: int = PAIRS) -> list[int]:
    """The query rows to check (see the module's docstring); a causal row i sees keys
    0 .. i + offset."""

    def cost(i: int) -> int:
        return heads * (min(kv_len, i + offset + 1) if causal else kv_len)

    if sum(cost(i) for i in range(q_len)) <= budget:
        return list(range(q_len))
    candidates = [i for i in dict.fromkeys((q_len - 1, 0, q_len // 2, q_len // 4, 3 * q_len // 4, 1, q_len - 2))
                  if 0 <= i < q_len]
    chosen, spent = [], 0
    for i in candidates:
        if spent + cost(i) <= budget:
            chosen.append(i)
            spent += cost(i)
    return sorted(chosen) or [min(candidates, key=cost)]


def attention_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, at: Sequence[int], *, scale: float, causal: bool,
                   offset: int = 0, **options: Any) -> np.ndarray:
    """The oracle's output (float64) at query rows ``at`` of q (..., T, D) against k, v
    (..., S, D) (grouped heads as ``reference.attention`` takes them): (..., len(at), Dv).
    Causal: query i sits at key position i + offset and only its keys 0 .. i + offset
    are walked.  ``options`` go to ``reference.attention`` (``softcap=``, say)."""
    from parity_tests import reference

    outs = []
    for i in at:
        n = min(k.shape[-2], i + offset + 1) if causal else k.shape[-2]
        out, _ = reference.attention(q[..., i : i + 1, :], k[..., :n, :], v[..., :n, :], scale=scale, **options)
        outs.append(out)
    return np.concatenate(outs, axis=-2)


def flex_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, at: Sequence[int], *, scale: float,
              score_mod: Any = None, mask_mod: Any = None, causal: bool = False) -> np.ndarray:
    """``reference.flex_attention``'s output (float64) at query rows ``at`` of q (B, H, L, E):
    (B, H, len(at), Ev).  The mods see each row's own index; ``causal`` (the mask_mod
    blocks keys past the query) walks keys 0 .. i only.  Library mods are given NumPy
    copies of their arrays (``attention_spec.mods.portable``)."""
    from attention_spec.mods import portable
    from parity_tests import reference

    score_mod, mask_mod = portable("score_mod", score_mod), portable("mask_mod", mask_mod)
    outs = []
    for i in at:
        row = np.int64(i)
        shifted_score = None if score_mod is None else (
            lambda s, b, h, _q, j, m=score_mod, r=row: m(s, b, h, r, j))
        shifted_mask = None if mask_mod is None else (lambda b, h, _q, j, m=mask_mod, r=row: m(b, h, r, j))
        n = i + 1 if causal else k.shape[-2]
        out, _ = reference.flex_attention(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], score_mod=shifted_score,
                                          mask_mod=shifted_mask, scale=scale)
        outs.append(out)
    return np.concatenate(outs, axis=-2)


def module_rows(x: np.ndarray, weights: dict[str, np.ndarray | None], *, heads: int, kv_heads: int, head_dim: int,
                causal: bool, at: Sequence[int], scale: float | None = None, offset: int = 0) -> np.ndarray:
    """The oracle's output (float64) of multi-head attention at rows ``at`` of one example
    x (T, d_in): ``weights`` holds ``wq``, ``wk``, ``wv``, ``wo`` as ``x @ w`` takes them
    and the biases ``bq``, ``bk``, ``bv``, ``bo`` (None: none); heads split the projection's
    width, ``kv_heads`` of them for keys and values; scale None: 1/sqrt(head_dim).
    Returns (len(at), d_out)."""
    x = np.asarray(x, np.float64)
    reach = max(at) + offset + 1 if causal else x.shape[0]  # the keys the rows see

    def project(name: str, t: np.ndarray, n_heads: int) -> np.ndarray:
        w, b = weights["w" + name], weights.get("b" + name)
        y = t @ np.asarray(w, np.float64)
        y = y if b is None else y + np.asarray(b, np.float64)
        return y.reshape(t.shape[0], n_heads, head_dim).transpose(1, 0, 2)  # (heads, T, D)

    q = project("q", x[list(at)], heads)
    k, v = project("k", x[:reach], kv_heads), project("v", x[:reach], kv_heads)
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    # each row is row r of its own (heads, 1, D) query: its key position is at[r] + offset
    out = np.concatenate([attention_rows(q[:, r : r + 1], k, v, [0], scale=scale, causal=causal, offset=i + offset)
                          for r, i in enumerate(at)], axis=-2)  # (heads, R, D)
    mixed = out.transpose(1, 0, 2).reshape(len(at), heads * head_dim) @ np.asarray(weights["wo"], np.float64)
    return mixed if weights.get("bo") is None else mixed + np.asarray(weights["bo"], np.float64)


def machine(framework: str | None = None, isa: str | None = None) -> dict[str, Any]:
    """Where a verdict was reached: the framework's device (``"cpu"``, a GPU's name), the
    CPU capability PyTorch reports (None where PyTorch is not loaded: a JAX worker does
    not import it) and the CPU's instruction set (``isa``, or the library's reading of
    the CPU's flags where ``jax_attention`` is loaded; else None: the runner adds it)."""
    torch = sys.modules.get("torch")
    device = None
    if framework == "torch" and torch is not None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    elif framework == "jax" and "jax" in sys.modules:
        device = sys.modules["jax"].devices()[0].device_kind
    if isa is None and "jax_attention" in sys.modules:
        from jax_attention import _cpu_kernel

        isa = _cpu_kernel.cpu_instruction_set()
    return {"device": device, "torch_cpu_capability": None if torch is None else torch.backends.cpu.get_cpu_capability(),
            "isa": isa}


def verdict(system: str, got: Any, want: np.ndarray, dtype: str, *, checked: str = "", framework: str | None = None,
            tolerance: Tolerance | None = None, ours: bool | None = None, isa: str | None = None) -> dict[str, Any]:
    """``got`` against the oracle's ``want``: elementwise ``|got - want| <= atol + rtol |want|``
    at ``tolerance`` (default: ``ORACLE[dtype]``) and finite.  A dict that JSON holds:
    ``system``, ``ours``, ``ok``, ``max_abs_error`` (inf where ``got`` has NaN or inf:
    ``non_finite`` counts them), ``dtype``, ``tolerance`` (rtol, atol), ``checked`` (what
    was compared) and ``machine``'s keys."""
    tol = ORACLE[dtype] if tolerance is None else tolerance
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise ValueError(f"{system}: output rows of shape {got.shape} against the oracle's {want.shape}")
    diff = np.abs(got - want)
    non_finite = int((~np.isfinite(got)).sum())
    finite = non_finite == 0
    ok = finite and bool((diff <= tol.atol + tol.rtol * np.abs(want)).all())
    return {"system": system, "ours": is_ours(system) if ours is None else ours, "ok": ok,
            "max_abs_error": float(diff.max()) if finite else float("inf"), "non_finite": non_finite, "dtype": dtype,
            "tolerance": {"rtol": tol.rtol, "atol": tol.atol}, "checked": checked, **machine(framework, isa)}


def fail_if_ours(v: dict[str, Any]) -> None:
    """Raises AssertionError, naming the system, where ``v`` is one of ours and wrong."""
    if v["ours"] and not v["ok"]:
        raise AssertionError(f"{v['system']} (ours) is wrong against the float64 oracle: max abs error "
                             f"{v['max_abs_error']:.3g} over rtol {v['tolerance']['rtol']:g}, atol "
                             f"{v['tolerance']['atol']:g} ({v['dtype']}; {v['checked']}; device {v['device']}, "
                             f"torch CPU capability {v['torch_cpu_capability']}, ISA {v['isa']})")


class Checks:
    """The verdicts of one run: ``add`` each (raising for one of ours that is wrong),
    then ``wrong`` (the outside systems that are) and ``is_wrong``."""

    def __init__(self) -> None:
        self.verdicts: list[dict[str, Any]] = []

    def add(self, v: dict[str, Any]) -> bool:
        """Records ``v``; whether the system is right.  Raises for one of ours that is wrong."""
        fail_if_ours(v)
        self.verdicts.append(v)
        return v["ok"]

    def check(self, system: str, got: Any, want: np.ndarray, dtype: str, **kwargs: Any) -> bool:
        """``add(verdict(system, got, want, dtype, **kwargs))``."""
        return self.add(verdict(system, got, want, dtype, **kwargs))

    @property
    def wrong(self) -> list[dict[str, Any]]:
        return [v for v in self.verdicts if not v["ok"]]

    def is_wrong(self, system: str) -> bool:
        return any(v["system"] == system for v in self.wrong)


def wrong_text(wrong: list[dict[str, Any]]) -> str:
    """A markdown section naming each wrong system (empty where none is)."""
    if not wrong:
        return ""
    lines = ["Wrong on this machine (against the float64 oracle; left out of every ratio):", "",
             "| system | max abs error | tolerance (rtol / atol) | dtype | checked | device | torch CPU capability | "
             "ISA |", "|---|---|---|---|---|---|---|---|"]
    for v in wrong:
        system = v["system"] + (f" at {v['label']}" if v.get("label") else "")
        error = f"{v['max_abs_error']:.3g}" + (f" ({v['non_finite']} NaN or inf)" if v.get("non_finite") else "")
        lines.append(f"| {system} | {error} | {v['tolerance']['rtol']:g} / "
                     f"{v['tolerance']['atol']:g} | {v['dtype']} | {v['checked']} | {v['device']} | "
                     f"{v['torch_cpu_capability']} | {v['isa']} |")
    return "\n".join(lines) + "\n"


def timed(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``check()`` with the seconds it took (``check_s``): what the check costs, in the record."""
    import time

    start = time.perf_counter()
    v = check()
    return {**v, "check_s": round(time.perf_counter() - start, 3)}
