"""``implementation="auto"`` on CPU, the kernel or not, decided by a measurement
(``jax_attention._cpu_measure``): made once per build and machine, cached beside the build
(a record written whole or not at all), read instead of measured again, measured again
where the record is damaged or stale; ``$TWIN_ATTENTION_CPU_AUTO`` forcing either decision;
``python -m jax_attention.build_kernel --measure`` / ``--auto``.

The suite forces ``auto``'s decision (``tests/conftest.py``); each test here unsets it and
has a cache folder of its own for the records (the kernel this process built stays
loaded: a record is named after it).  Most tests stand a counting stub in for the
measurement; ``test_a_real_measurement_asks_no_auto`` and the command's test measure."""

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

# A measurement's result (what _cpu_measure.measure returns): blockwise faster for full
# calls, the kernel for few rows.
FULL = "a causal layer's forward + backward, projections included, at B8 H4 S256 D64 float32, layout bshd"
FEW = "a decode step at B1 H8 S4096 D64 float32, one query row per head, kv_lengths"
TIMINGS = {
    "full": {"decision": "blockwise", "kernel_ms": 2.0, "blockwise_ms": 1.0, "call": FULL},
    "few_rows": {"decision": "kernel", "kernel_ms": 0.1, "reference_ms": 0.2, "call": FEW},
    "repetitions": 7, "seconds": 0.5,
}
SLOWER = ("the CPU kernel measured slower than blockwise on this machine (2 ms vs 1 ms for a causal layer's "
          "forward + backward at B8 H4 S256 D64)")


@pytest.fixture(autouse=True, scope="module")
def _kernel_built() -> None:
    import jax

    from jax_attention import _cpu_kernel

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernel runs on XLA's CPU backend")
    assert _cpu_kernel.available(), _cpu_kernel.build_error()


class Measured:
    """A test's own cache folder for the records, the override unset, no decision held in
    this process, and the measurement stubbed (``count``: how often it ran)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from jax_attention import _cpu_kernel, _cpu_measure

        self.dir = root / "cache"
        monkeypatch.setenv("TWIN_ATTENTION_CACHE", str(self.dir))
        monkeypatch.delenv("TWIN_ATTENTION_CPU_AUTO", raising=False)
        monkeypatch.setattr(_cpu_measure, "_decided", {})
        monkeypatch.setattr(_cpu_measure, "_unsaved", {})
        self.count = 0
        self.timings: dict[str, Any] = json.loads(json.dumps(TIMINGS))

        def stub(*args: Any) -> dict[str, Any]:
            self.count += 1
            return json.loads(json.dumps(self.timings))

        monkeypatch.setattr(_cpu_measure, "measure", stub)
        path = _cpu_kernel.auto_record()
        assert path is not None and path.parent == self.dir
        self.record = path

    def read(self) -> dict[str, Any]:
        return json.loads(self.record.read_text())


@pytest.fixture
def measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Measured:
    return Measured(tmp_path, monkeypatch)


def _qkv(rows: int) -> Any:
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal((1, 2, n, 8)), jnp.float32) for n in (rows, 32, 32))


def test_the_measurement_is_made_once_cached_and_read_again(measured: Measured, monkeypatch: pytest.MonkeyPatch):
    """Before it: ``route`` names the kernel (the call would measure) and nothing is
    measured by asking.  The first ``auto`` call measures, caches the record beside the
    build and runs what it found (blockwise here), and ``route`` says so from then on;
    later asks, and a new process (the decisions held here forgotten), read it: one
    measurement in all.  Few rows have their own decision (the kernel here)."""
    from jax_attention import _cpu_kernel, _cpu_measure
    from jax_attention.functional import dot_product_attention, route

    q, k, v = _qkv(32)
    assert _cpu_kernel.auto_would_decline() is None
    assert _cpu_kernel.auto_basis().startswith(f"not measured yet for this build ({measured.record} is absent)")
    assert route(q, k, v, causal=True).kernel == "cpu-kernel"
    assert measured.count == 0 and not measured.dir.exists()

    forwards: list[int] = []
    forward = _cpu_kernel.forward
    monkeypatch.setattr(_cpu_kernel, "forward", lambda *a, **kw: forwards.append(1) or forward(*a, **kw))
    got = dot_product_attention(q, k, v, causal=True)  # measures: blockwise is faster
    assert measured.count == 1 and forwards == []
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(dot_product_attention(q, k, v, causal=True, implementation="blockwise")))
    assert route(q, k, v, causal=True) == ("blockwise", "blockwise", (f"fused: {SLOWER}",))
    assert _cpu_kernel.auto_declines() == _cpu_kernel.auto_would_decline() == SLOWER
    assert _cpu_kernel.auto_declines(few_rows=True) is None and _cpu_kernel.auto_would_decline(few_rows=True) is None
    assert route(*_qkv(1), causal=True).kernel == "cpu-decode"

    record = measured.read()
    assert sorted(p.name for p in measured.dir.iterdir()) == [measured.record.name]  # no scratch file left
    assert measured.record.name == _cpu_kernel._state["path"].name + ".auto.json"
    assert record["library"] == _cpu_kernel._state["path"].name and record["source"] == "measured"
    assert record["full"] == TIMINGS["full"] and record["few_rows"] == TIMINGS["few_rows"]
    assert _cpu_kernel.auto_basis() == (f"measured on this machine for this build: kernel 2 ms, blockwise 1 ms "
                                        f"(a causal layer's forward + backward at B8 H4 S256 D64; cached in {measured.record})")
    assert _cpu_kernel.auto_basis(few_rows=True).startswith("measured on this machine for this build: kernel 0.1 ms, "
                                                            "explicit math 0.2 ms (a decode step at B1 H8 S4096 D64;")
    _cpu_measure.forget()  # as a new process
    assert _cpu_kernel.auto_would_decline() == SLOWER and _cpu_kernel.auto_declines() == SLOWER
    dot_product_attention(q, k, v, causal=True)
    assert measured.count == 1


def _valid_record() -> dict[str, Any]:
    from jax_attention import _cpu_kernel, _cpu_measure

    return _cpu_measure.measured_record(_cpu_kernel._state["path"].name, json.loads(json.dumps(TIMINGS)))


# A damaged or stale record, from a valid one (None: no file; a str: the file's text).
DAMAGED = {
    "empty": lambda r: "",
    "not-json": lambda r: "{",
    "cut-short": lambda r: json.dumps(r)[:-20],
    "a-list": lambda r: json.dumps([r]),
    "another-library": lambda r: {**r, "library": "flash_attention_cpu-0000000000000000.so"},
    "another-version": lambda r: {**r, "version": 0},
    "no-few-rows": lambda r: {k: v for k, v in r.items() if k != "few_rows"},
    "a-bad-decision": lambda r: {**r, "full": {**r["full"], "decision": "xla"}},
    "no-median": lambda r: {**r, "full": {"decision": "kernel"}},
    "a-nan-median": lambda r: {**r, "full": {**r["full"], "kernel_ms": float("nan")}},
    "another-jaxlib": lambda r: {**r, "jaxlib": "0.0.1"},
    "other-cpus": lambda r: {**r, "cpus": r["cpus"] + 1},
    "an-unknown-source": lambda r: {**r, "source": "guessed"},
    "other-races": lambda r: {**r, "few_rows": {**r["few_rows"], "call": FEW.replace("S4096", "S512")}},
}


@pytest.mark.slow  # the quick tier measures in test_the_measurement_is_made_once_cached_and_read_again
@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_or_stale_record_is_measured_again(measured: Measured, damage: str):
    """A record that cannot be read whole, is for another build, or was measured under
    another JAX or on other CPUs is as none: ``route`` takes the kernel (the call would
    measure), and the next ``auto`` call measures and replaces it."""
    from jax_attention import _cpu_kernel

    damaged = DAMAGED[damage](_valid_record())
    measured.dir.mkdir(parents=True)
    measured.record.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    assert _cpu_kernel.auto_would_decline() is None and "the cached measurement cannot be used" in _cpu_kernel.auto_basis()
    assert measured.count == 0
    assert _cpu_kernel.auto_declines() == SLOWER
    assert measured.count == 1
    assert measured.read() == {**_valid_record(), "measured_at": measured.read()["measured_at"]}
    assert _cpu_kernel.auto_declines() == SLOWER and measured.count == 1


@pytest.mark.slow  # the quick tier measures in test_the_measurement_is_made_once_cached_and_read_again
@pytest.mark.parametrize("value", ["kernel", "blockwise", "measure", ""])
def test_the_override_forces_either_decision(measured: Measured, monkeypatch: pytest.MonkeyPatch, value: str):
    """``$TWIN_ATTENTION_CPU_AUTO``: ``kernel`` and ``blockwise`` decide for full calls and
    few rows alike, over a cached record that says otherwise, measuring nothing;
    ``measure`` (or empty) leaves it to the record."""
    from jax_attention import _cpu_kernel, _cpu_measure
    from jax_attention.functional import route

    measured.timings["full"] = {"decision": "kernel", "kernel_ms": 1.0, "blockwise_ms": 2.0, "call": FULL}
    measured.timings["few_rows"] = {"decision": "reference", "kernel_ms": 0.2, "reference_ms": 0.1, "call": FEW}
    assert _cpu_kernel.auto_declines() is None and measured.count == 1  # the record: kernel, few rows: explicit math
    _cpu_measure.forget()
    monkeypatch.setenv("TWIN_ATTENTION_CPU_AUTO", value)
    full, few = route(*_qkv(32), causal=True), route(*_qkv(1), causal=True)
    if value == "kernel":
        assert (full.kernel, few.kernel) == ("cpu-kernel", "cpu-decode")
        assert _cpu_kernel.auto_declines() is None and _cpu_kernel.auto_declines(few_rows=True) is None
    elif value == "blockwise":
        why = "fused: $TWIN_ATTENTION_CPU_AUTO=blockwise passes the CPU kernel by"
        assert (full.kernel, full.reasons) == ("blockwise", (why,))
        assert few.kernel == "reference" and why in few.reasons, few.explain()
        assert _cpu_kernel.auto_declines(few_rows=True) == why[len("fused: "):]
    else:
        assert (full.kernel, few.kernel) == ("cpu-kernel", "reference")
        assert any("forward for few rows measured slower than the explicit math" in r for r in few.reasons), few
    if value in ("kernel", "blockwise"):
        assert _cpu_kernel.auto_basis() == _cpu_kernel.auto_basis(True) == f"forced by $TWIN_ATTENTION_CPU_AUTO={value}"
    assert measured.count == 1


@pytest.mark.slow  # the quick tier measures in test_the_measurement_is_made_once_cached_and_read_again
def test_a_bad_override_is_a_value_error_naming_the_variable_and_its_values(measured: Measured,
                                                                           monkeypatch: pytest.MonkeyPatch):
    from jax_attention import _cpu_kernel
    from jax_attention.functional import dot_product_attention, route

    monkeypatch.setenv("TWIN_ATTENTION_CPU_AUTO", "fast")
    message = r"\$TWIN_ATTENTION_CPU_AUTO must be one of kernel, blockwise, measure \(unset: measure\); got 'fast'"
    for ask in (_cpu_kernel.auto_declines, _cpu_kernel.auto_would_decline, _cpu_kernel.auto_basis,
                lambda: route(*_qkv(32), causal=True), lambda: dot_product_attention(*_qkv(32), causal=True)):
        with pytest.raises(ValueError, match=message):
            ask()
    dot_product_attention(*_qkv(32), causal=True, implementation="fused")  # only auto asks
    assert measured.count == 0


@pytest.mark.slow  # the quick tier measures in test_the_measurement_is_made_once_cached_and_read_again
def test_a_decision_that_cannot_be_cached_holds_for_the_process(measured: Measured):
    """A cache folder that cannot be written (here: a file where it should be): the
    decision is measured once and held for this process, and ``auto_basis`` says it is
    not cached."""
    from jax_attention import _cpu_kernel

    measured.dir.parent.mkdir(parents=True, exist_ok=True)
    measured.dir.write_text("not a folder")
    assert _cpu_kernel.auto_declines() == SLOWER and _cpu_kernel.auto_would_decline() == SLOWER
    assert _cpu_kernel.auto_declines() == SLOWER and measured.count == 1
    assert "not cached: " in _cpu_kernel.auto_basis()


@pytest.mark.slow  # the quick tier measures in test_the_measurement_is_made_once_cached_and_read_again
def test_a_measurement_that_fails_takes_blockwise_for_the_process(measured: Measured,
                                                                  monkeypatch: pytest.MonkeyPatch):
    """A measurement that raises: the process takes the blockwise path (and the explicit
    math for few rows), says why once with a RuntimeWarning, caches nothing, and the
    next process measures again."""
    from jax_attention import _cpu_kernel, _cpu_measure
    from jax_attention.functional import route

    def fails(*args: Any) -> dict[str, Any]:
        measured.count += 1
        raise ValueError("a stand-in failure")

    monkeypatch.setattr(_cpu_measure, "measure", fails)
    why = "the CPU kernel could not be measured on this machine (ValueError: a stand-in failure)"
    with pytest.warns(RuntimeWarning, match=r"takes the blockwise path on CPU: the CPU kernel could not be measured"):
        assert _cpu_kernel.auto_declines() == why
    assert _cpu_kernel.auto_declines(few_rows=True) == why == _cpu_kernel.auto_would_decline()
    assert route(*_qkv(32), causal=True) == ("blockwise", "blockwise", (f"fused: {why}",))
    assert route(*_qkv(1), causal=True).kernel == "reference"
    assert _cpu_kernel.auto_basis().startswith("the measurement failed in this process (ValueError")
    assert measured.count == 1 and not measured.record.exists()
    _cpu_measure.forget()  # as a new process
    with pytest.warns(RuntimeWarning):
        _cpu_kernel.auto_declines()
    assert measured.count == 2


@pytest.mark.slow  # measures (about a second); the quick tier runs the stub's
def test_a_real_measurement_asks_no_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The measurement itself, once, in a thread of its own: it calls only explicit
    implementations (no ``auto`` is asked while it runs, and one asked there would be
    refused, not measured again), its record holds positive medians and the faster side
    as the decision, and it is short.  Started inside a ``jax.jit`` trace, as a first
    ``auto`` call may be."""
    import jax
    import jax.numpy as jnp

    from jax_attention import _cpu_kernel, _cpu_measure
    from jax_attention.functional import dot_product_attention

    monkeypatch.setenv("TWIN_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.delenv("TWIN_ATTENTION_CPU_AUTO", raising=False)
    monkeypatch.setattr(_cpu_measure, "_decided", {})
    monkeypatch.setattr(_cpu_measure, "_unsaved", {})
    measures, asked_while_measuring = [], []
    real = _cpu_measure.measure
    monkeypatch.setattr(_cpu_measure, "measure", lambda *a: measures.append(1) or real(*a))
    for name in ("auto_declines", "auto_would_decline"):
        ask = getattr(_cpu_kernel, name)
        monkeypatch.setattr(_cpu_kernel, name, lambda *a, ask=ask, name=name: (
            asked_while_measuring.append(name) if _cpu_measure.measuring() else None) or ask(*a))

    q = jnp.ones((1, 2, 32, 8), jnp.float32)
    jax.block_until_ready(jax.jit(lambda x: dot_product_attention(x, x, x, causal=True))(q))
    assert measures == [1] and asked_while_measuring == []
    record = json.loads(Path(str(_cpu_kernel.auto_record())).read_text())
    for race, rival in (("full", "blockwise"), ("few_rows", "reference")):
        entry = record[race]
        assert entry["kernel_ms"] > 0 and entry[f"{rival}_ms"] > 0, record
        assert entry["decision"] == ("kernel" if entry["kernel_ms"] <= entry[f"{rival}_ms"] else rival), record
    assert 0 < record["seconds"] < 20, record  # about 1 s on 2 cores; a loaded machine may take longer

    def recursion(repetitions: int) -> dict[str, Any]:
        return {"asked": _cpu_kernel.auto_declines()}  # what the measurement must never do

    monkeypatch.setattr(_cpu_measure, "_measure", recursion)
    _cpu_measure.forget()
    Path(str(_cpu_kernel.auto_record())).unlink()
    with pytest.raises(RuntimeError, match="while auto's measurement runs"):
        real()
    assert asked_while_measuring == ["auto_declines"]


def _stand_in(root: Path) -> Path:
    """A compiler (``$CXX``) that copies the library this process built, so that the
    command builds without compiling."""
    from jax_attention import _cpu_kernel

    compiler = root / "fake-cxx"
    compiler.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake-cxx 1.0"; exit 0; fi\n'
        'out=""; while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done\n'
        f'cp "{_cpu_kernel._state["path"]}" "$out"\n'
    )
    compiler.chmod(0o755)
    return compiler


_ASK = """
import json, jax.numpy as jnp
from jax_attention import _cpu_kernel
from jax_attention.functional import route
q = jnp.ones((1, 2, 32, 8), jnp.float32)
print(json.dumps({"route": list(route(q, q, q, causal=True)), "basis": _cpu_kernel.auto_basis(),
                  "few": route(q[:, :, :1], q, q).kernel}))
"""


@pytest.mark.slow  # three processes, one of which measures
def test_the_command_measures_or_sets_the_decision(tmp_path: Path):
    """``build_kernel --measure`` builds, measures and caches the decision, printing it
    with the medians; ``--auto blockwise`` writes that decision instead, measuring
    nothing, and a later process's ``auto`` follows it (``route`` says why)."""
    cache = tmp_path / "cache"
    env = {**os.environ, "TWIN_ATTENTION_CACHE": str(cache), "CXX": str(_stand_in(tmp_path)),
           "JAX_PLATFORMS": "cpu"}
    for name in ("TWIN_ATTENTION_CPU_AUTO", "TWIN_ATTENTION_CPU_KERNEL"):
        env.pop(name, None)

    def run(*args: str) -> list[str]:
        done = subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()

    lines = run("-m", "jax_attention.build_kernel", "--measure")
    library = Path(lines[0])
    record = library.with_name(library.name + ".auto.json")
    assert lines[1] == f"implementation='auto' on this machine, cached in {record}:", lines
    assert lines[2].startswith("full calls: the ") and "medians of 7: kernel " in lines[2], lines
    assert lines[3].startswith("few query rows: the ") and " reference " in lines[3], lines
    assert lines[4].startswith("measured in ") and lines[4].endswith(" s, compiles included"), lines
    assert json.loads(record.read_text())["source"] == "measured"

    lines = run("-m", "jax_attention.build_kernel", "--auto", "blockwise")
    assert lines == [str(library), f"implementation='auto' on this machine, cached in {record}:",
                     "full calls: the blockwise path", "few query rows: the explicit math",
                     "set by python -m jax_attention.build_kernel --auto blockwise, not measured"]
    assert json.loads(record.read_text()) == {
        "version": 1, "library": library.name, "source": "set",
        "set_by": "python -m jax_attention.build_kernel --auto blockwise",
        "full": {"decision": "blockwise"}, "few_rows": {"decision": "reference"}}
    asked = json.loads(run("-c", _ASK)[-1])
    why = ("auto is set to blockwise for this build of the CPU kernel "
           "(python -m jax_attention.build_kernel --auto blockwise)")
    assert asked["route"] == ["blockwise", "blockwise", [f"fused: {why}"]]
    assert asked["few"] == "reference"
    assert asked["basis"] == ("set to blockwise by python -m jax_attention.build_kernel --auto blockwise "
                              f"(cached in {record})")
    assert sorted(p.name for p in cache.iterdir()) == sorted([library.name, library.name + ".sha256", record.name])
