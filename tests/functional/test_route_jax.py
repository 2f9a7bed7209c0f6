"""``jax_attention.functional.route``: which path and kernel a call takes, and why not a
faster one.  It checks its arguments as ``dot_product_attention`` does (the same errors),
the call runs the route it names (spied here), and asking builds nothing (a process with
an empty kernel cache asks, and the cache stays empty)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import needs_jax

pytestmark = needs_jax

REPO = Path(__file__).resolve().parents[2]


def _qkv(q_len: int = 20, kv_len: int = 20, dtype: str = "float32", heads: int = 2, kv_heads: int = 2) -> Any:
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((2, heads, q_len, 8)), dtype),
            jnp.asarray(rng.standard_normal((2, kv_heads, kv_len, 8)), dtype),
            jnp.asarray(rng.standard_normal((2, kv_heads, kv_len, 8)), dtype))


def test_auto_on_cpu_float32_follows_the_machine():
    """float32 ``auto`` on CPU: the CPU kernel where its decision takes it
    (``_cpu_kernel.auto_would_decline``: forced by the suite, or measured), else
    blockwise, with the kernel's reason."""
    import jax

    from jax_attention import _cpu_kernel
    from jax_attention.functional import route

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU route")
    got = route(*_qkv(), causal=True)
    why = _cpu_kernel.auto_would_decline()
    if why is None:
        assert (got.path, got.kernel, got.reasons) == ("fused", "cpu-kernel", ())
    else:
        assert (got.path, got.kernel, got.reasons) == ("blockwise", "blockwise", (f"fused: {why}",))
    masked = route(*_qkv(), mask=np.tril(np.ones((20, 20), bool)))  # a dense mask: not the kernel's
    assert (masked.path, masked.kernel) == ("blockwise", "blockwise")
    assert masked.reasons == ("fused: the CPU kernel takes no dense mask, bias or segment ids",)
    assert route(*_qkv(), implementation="reference") == ("reference", "reference", ())
    assert route(*_qkv(), implementation="blockwise").kernel == "blockwise"


def test_float64_takes_the_blockwise_path():
    import jax

    from jax_attention.functional import route

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU route")
    with jax.enable_x64(True):
        got = route(*_qkv(dtype="float64"), causal=True)
    assert (got.path, got.kernel) == ("blockwise", "blockwise")
    assert got.reasons == ("fused: the CPU kernel takes float32, bfloat16 or float16, not float64",)


def test_return_weights_takes_the_reference_path_and_says_why():
    from jax_attention.functional import route

    got = route(*_qkv(), causal=True, return_weights=True)
    assert (got.path, got.kernel) == ("reference", "reference")
    assert any(r.startswith("blockwise: ") and "return_weights" in r for r in got.reasons), got.reasons
    assert got.explain().splitlines()[0] == "reference (reference)"


def test_long_keys_take_the_tiled_loops():
    from jax_attention._paths import LONG_SEQUENCE as _LONG_SEQUENCE
    from jax_attention.functional import route

    got = route(*_qkv(q_len=1, kv_len=_LONG_SEQUENCE), implementation="blockwise")
    assert (got.path, got.kernel) == ("blockwise", "blockwise-tiled")
    assert route(*_qkv(q_len=1, kv_len=_LONG_SEQUENCE - 1), implementation="blockwise").kernel == "blockwise"


BAD_CALLS = [
    ({"softcap": 5.0, "implementation": "fused"}, ValueError),
    ({"implementation": "fast"}, ValueError),
    ({"mask": np.ones((20, 20), np.float32)}, TypeError),
    ({"kv_lengths": [3, 30]}, ValueError),
    ({"window": (-1, 2)}, ValueError),
    ({"q_offset": 1, "alignment": "bottom_right"}, ValueError),
    ({"return_weights": True, "implementation": "blockwise"}, ValueError),
]


@pytest.mark.parametrize(("options", "kind"), BAD_CALLS, ids=[str(sorted(o)) for o, _ in BAD_CALLS])
def test_route_checks_as_the_call_does(options: dict[str, Any], kind: type):
    """The same exception, with the same text, from ``route`` as from the call."""
    from jax_attention.functional import dot_product_attention, route

    q, k, v = _qkv()
    with pytest.raises(kind) as asked:
        route(q, k, v, **options)
    with pytest.raises(kind) as called:
        dot_product_attention(q, k, v, **options)
    assert str(asked.value) == str(called.value)


def _ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Spies on every path's entry: the list of kernels that ran, as ``route`` names them."""
    from jax_attention import _blockwise, _cpu_fused, _fused, _reference

    ran: list[str] = []

    def spy(real: Any, name: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ran.append(name(kwargs) if callable(name) else name)
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(_reference, "attention_weights", spy(_reference.attention_weights, "reference"))
    monkeypatch.setattr(_blockwise, "blockwise", spy(
        _blockwise.blockwise, lambda kw: "blockwise" if kw["plan"][1] is None else "blockwise-tiled"))
    monkeypatch.setattr(_fused, "attend", spy(_fused.attend, lambda kw: kw["kernel"]))
    monkeypatch.setattr(_cpu_fused, "attend", spy(_cpu_fused.attend, "cpu-kernel"))
    return ran


CALLS = [
    {"causal": True},
    {"window": (3, 2), "alignment": "bottom_right"},
    {"kv_lengths": [20, 7]},
    {"mask": np.tril(np.ones((20, 20), bool))},
    {"bias": np.zeros((20, 20), np.float32), "softcap": 4.0},
    {"q_offset": [0, 3], "causal": True},
    {"segment_ids": np.repeat(np.arange(2)[None], 10, axis=1)},
    {"return_weights": True},
    {"dropout_rate": 0.5, "deterministic": False, "dropout_mask": np.ones((20, 20), bool)},
    {"normalization": "sum"},
]


@pytest.mark.parametrize("implementation", ["auto", "fused", "blockwise", "reference"])
@pytest.mark.parametrize("options", CALLS, ids=[str(sorted(o)) for o in CALLS])
def test_the_call_runs_its_route(monkeypatch, implementation: str, options: dict[str, Any]):
    """Whatever ``route`` names is the one kernel the call runs (grouped heads here)."""
    from jax_attention.functional import dot_product_attention, route

    q, k, v = _qkv(heads=4, kv_heads=2)
    try:
        said = route(q, k, v, implementation=implementation, **options)
    except ValueError:  # an explicit path that cannot honour an option: the call refuses too
        with pytest.raises(ValueError):
            dot_product_attention(q, k, v, implementation=implementation, **options)
        return
    ran = _ran(monkeypatch)
    dot_product_attention(q, k, v, implementation=implementation, **options)
    assert ran == [said.kernel], (said, ran)


def test_the_tiled_loops_run_where_route_says(monkeypatch):
    from jax_attention import _paths
    from jax_attention.functional import dot_product_attention, route

    monkeypatch.setattr(_paths, "LONG_SEQUENCE", 16)
    monkeypatch.setattr(_paths, "LONG_TILE", (8, 8))
    monkeypatch.setattr(_paths, "LONG_BACKWARD_TILE", (8, 8))
    q, k, v = _qkv()
    said = route(q, k, v, causal=True, implementation="blockwise")
    ran = _ran(monkeypatch)
    dot_product_attention(q, k, v, causal=True, implementation="blockwise")
    assert said.kernel == "blockwise-tiled" and ran == ["blockwise-tiled"]


# Asks every question of the kernel in a process of its own, with an empty cache: nothing
# may be built (nor the kernel loaded); then, where asked, a call that builds it.
_ASK = """
import json, os, sys, warnings, numpy as np, jax.numpy as jnp
from jax_attention import _cpu_kernel
from jax_attention.functional import cpu_kernel_supports, dot_product_attention, route
q = jnp.ones((1, 2, 32, 8), jnp.float32)  # more than FEW_QUERY_ROWS rows
asked = {i: list(route(q, q, q, causal=True, implementation=i)) for i in ("auto", "fused", "blockwise", "reference")}
asked["supports"] = [cpu_kernel_supports(q, implementation=i) for i in ("fused", "auto")]
result = {"asked": asked, "cache": sorted(os.listdir(os.environ["TWIN_ATTENTION_CACHE"])),
          "state": sorted(_cpu_kernel._state), "predicted": _cpu_kernel.predicted_instruction_set()}
if sys.argv[1] == "call":
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dot_product_attention(q, q, q, causal=True, implementation="fused")
    result["warned"] = [str(w.message) for w in caught]
    result["after"] = {i: list(route(q, q, q, causal=True, implementation=i)) for i in ("auto", "fused")}
print(json.dumps(result))
"""


def _ask(tmp_path: Path, then: str = "ask", **env: str) -> dict[str, Any]:
    cache = tmp_path / "cache"
    cache.mkdir(parents=True)
    environment = {**os.environ, "TWIN_ATTENTION_CACHE": str(cache), "JAX_PLATFORMS": "cpu",
                   "PYTHONPATH": str(REPO), **env}
    environment.pop("TWIN_ATTENTION_CPU_KERNEL", None)
    environment.update(env)
    done = subprocess.run([sys.executable, "-c", _ASK, then], env=environment, capture_output=True, text=True,
                          timeout=300, check=False, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_asking_builds_nothing(tmp_path):
    """``route`` and ``cpu_kernel_supports``, for every implementation, in a process with
    an empty cache: the cache stays empty and the kernel is neither built nor loaded;
    the explicit ``"fused"`` names the CPU kernel (the call would build it)."""
    got = _ask(tmp_path)
    assert got["cache"] == [] and "ok" not in got["state"], got
    assert got["asked"]["fused"] == ["fused", "cpu-kernel", []]
    assert got["asked"]["reference"] == ["reference", "reference", []]
    assert got["asked"]["supports"][0] is True
    auto = got["asked"]["auto"]
    if os.environ.get("TWIN_ATTENTION_CPU_AUTO") == "blockwise":
        assert auto[:2] == ["blockwise", "blockwise"] and got["asked"]["supports"][1] is False
    else:  # forced to the kernel (tests/conftest.py), or no measurement in this empty cache yet
        assert auto == ["fused", "cpu-kernel", []] and got["asked"]["supports"][1] is True


def test_asking_for_another_target_builds_nothing(tmp_path):
    """With ``$TWIN_ATTENTION_MARCH`` naming another target, the compiler's preprocessor
    tells it, and nothing is built or measured: with no measurement cached for that build
    ``auto`` names the kernel (its first call builds and measures it), and
    ``$TWIN_ATTENTION_CPU_AUTO=blockwise`` passes it by, saying so."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86-64 target")
    for march, isa in (("x86-64", "SSE2"), ("x86-64-v3", "AVX2")):
        got = _ask(tmp_path / march, TWIN_ATTENTION_MARCH=march, TWIN_ATTENTION_CPU_AUTO="measure")
        assert got["cache"] == [] and "ok" not in got["state"], got
        assert got["predicted"] == isa
        assert got["asked"]["auto"] == ["fused", "cpu-kernel", []]
        assert got["asked"]["supports"] == [True, True]
    got = _ask(tmp_path / "forced", TWIN_ATTENTION_MARCH="x86-64", TWIN_ATTENTION_CPU_AUTO="blockwise")
    assert got["cache"] == [] and "ok" not in got["state"], got
    assert got["asked"]["auto"] == [
        "blockwise", "blockwise", ["fused: $TWIN_ATTENTION_CPU_AUTO=blockwise passes the CPU kernel by"]]
    assert got["asked"]["supports"] == [True, False]


def test_a_build_that_fails_at_the_call_falls_back(tmp_path):
    """The route names the CPU kernel; the call builds it, the build fails (a compiler
    that fails), and the call runs XLA's kernel with the RuntimeWarning; from then on
    the route says so without building: XLA's kernel for ``"fused"``, blockwise for
    ``"auto"``, with the build's error as the reason."""
    got = _ask(tmp_path, "call", CXX="false")
    assert got["asked"]["fused"] == ["fused", "cpu-kernel", []]
    assert len(got["warned"]) == 1 and "runs XLA's kernel" in got["warned"][0], got["warned"]
    assert got["after"]["fused"] == ["fused", "xla", []]
    path, kernel, reasons = got["after"]["auto"]
    assert (path, kernel) == ("blockwise", "blockwise")
    assert len(reasons) == 1 and reasons[0].startswith("fused: the CPU kernel is not available: ") and "failed" in reasons[0]
    assert got["cache"] == []


def test_turned_off_the_route_says_so(tmp_path):
    got = _ask(tmp_path, TWIN_ATTENTION_CPU_KERNEL="off")
    assert got["asked"]["fused"] == ["fused", "xla", []]
    assert got["asked"]["auto"] == [
        "blockwise", "blockwise",
        ["fused: the CPU kernel is not available: turned off ($TWIN_ATTENTION_CPU_KERNEL=off)"]]
    assert got["cache"] == []


def test_route_says_what_decided_auto_on_cpu(monkeypatch):
    """``Route.basis``: for ``"auto"`` on CPU, what decided between the library's kernel
    and the blockwise path (here the suite's ``$TWIN_ATTENTION_CPU_AUTO``; a measurement
    cached for the build otherwise, ``tests/kernels/test_cpu_auto.py``), and
    ``explain()`` prints it; empty where no measurement decides (a call the kernel
    cannot take, an explicit path)."""
    import jax

    from jax_attention import _cpu_kernel
    from jax_attention.functional import route

    if jax.default_backend() != "cpu" or _cpu_kernel.known_unavailable() is not None:
        pytest.skip("the CPU kernel on XLA's CPU backend")
    q, k, v = _qkv()
    for forced, path in (("kernel", "fused"), ("blockwise", "blockwise")):
        monkeypatch.setenv("TWIN_ATTENTION_CPU_AUTO", forced)
        got = route(q, k, v, causal=True)
        assert (got.path, got.basis) == (path, f"forced by $TWIN_ATTENTION_CPU_AUTO={forced}")
        assert got.explain().endswith(f"  decided by: forced by $TWIN_ATTENTION_CPU_AUTO={forced}")
    assert route(q, k, v, mask=np.ones((20, 20), bool)).basis == ""  # no measurement decides: a dense mask
    assert route(q, k, v, causal=True, implementation="fused").basis == ""


# A cached measurement that exists but cannot be used (issue 55 c), from a valid record
# (a str: the file's text), and what route's basis says is wrong with it.
_UNUSABLE = {
    "empty": (lambda r: "", "is unreadable: empty"),
    "cut-short": (lambda r: json.dumps(r)[:-20], "is unreadable: cut short (its JSON ends early)"),
    "not-json": (lambda r: "auto: kernel\n", "is unreadable: not JSON"),
    "a-list": (lambda r: json.dumps([r]), "is unreadable: not a JSON object"),
    "another-jax": (lambda r: {**r, "jax": "0.0.1"}, "was measured under another JAX version (jax 0.0.1; this "
                    "process runs jax {jax})"),
    "another-jaxlib": (lambda r: {**r, "jaxlib": "0.0.1"}, "was measured under another JAX version (jaxlib 0.0.1; "
                       "this process runs jaxlib {jaxlib})"),
    "another-cpu": (lambda r: {**r, "cpus": r["cpus"] + 1}, "was measured on other CPUs ({more} CPUs; this process "
                    "may use {cpus})"),
    "another-build": (lambda r: {**r, "library": "flash_attention_cpu-0.so"}, "is for another build of the CPU "
                      "kernel (flash_attention_cpu-0.so)"),
    "another-version": (lambda r: {**r, "version": 0}, "is a record of another version (0; this library reads 1)"),
    "no-few-rows": (lambda r: {k: v for k, v in r.items() if k != "few_rows"},
                    "is incomplete: no decision for few_rows"),
    "other-races": (lambda r: {**r, "full": {**r["full"], "call": "another race"}},
                    "timed another race for full ('another race')"),
}


@pytest.mark.parametrize("damage", sorted(_UNUSABLE))
def test_route_says_why_a_cached_measurement_cannot_be_used(tmp_path, monkeypatch, damage):
    """A record of ``auto``'s CPU measurement that exists but cannot be used is not
    "absent": ``route``'s basis says what is wrong with it (the next ``auto`` call measures
    again, ``tests/kernels/test_cpu_auto.py``)."""
    import jax

    from jax_attention import _cpu_kernel, _cpu_measure
    from jax_attention.functional import route

    if jax.default_backend() != "cpu" or _cpu_kernel.known_unavailable() is not None:
        pytest.skip("the CPU kernel on XLA's CPU backend")
    monkeypatch.setenv("TWIN_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.delenv("TWIN_ATTENTION_CPU_AUTO", raising=False)
    monkeypatch.setattr(_cpu_measure, "_decided", {})
    monkeypatch.setattr(_cpu_measure, "_unsaved", {})
    path = _cpu_kernel.auto_record()
    if path is None:
        pytest.skip("no C++ compiler: no record is looked for")
    timings = {"full": {"decision": "blockwise", "kernel_ms": 2.0, "blockwise_ms": 1.0, "call": _cpu_measure.CALLS["full"]},
               "few_rows": {"decision": "kernel", "kernel_ms": 0.1, "reference_ms": 0.2,
                            "call": _cpu_measure.CALLS["few_rows"]}, "repetitions": 7, "seconds": 0.5}
    record = _cpu_measure.measured_record(path.name[:-len(_cpu_measure.SUFFIX)], timings)
    make, said = _UNUSABLE[damage]
    damaged = make(record)
    path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    said = said.format(jax=record["jax"], jaxlib=record["jaxlib"], cpus=record["cpus"], more=record["cpus"] + 1)
    basis = route(*_qkv(), causal=True).basis
    assert basis.startswith(f"the cached measurement cannot be used ({path} {said}): "), basis
    assert "absent" not in basis
    assert _cpu_measure.basis(None, False, tmp_path / "none.auto.json").startswith(
        f"not measured yet for this build ({tmp_path / 'none.auto.json'} is absent)")
