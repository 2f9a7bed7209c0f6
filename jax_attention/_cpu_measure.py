"""``implementation="auto"`` on a CPU: the library's CPU kernel or the blockwise path (and,
for a call of few query rows, the kernel's forward for few rows or the explicit math),
decided by a short measurement on the machine, made once per build of the kernel and
cached beside it.  ``_cpu_kernel`` asks here (``auto_declines``, ``auto_would_decline``,
``auto_basis``); nothing here builds or loads the kernel, and nothing runs at import.  The
races' programs are the table's (``_paths.races``, handed over by ``use_races``): this
module imports nothing of the library.

The measurement (``measure``: 2.3-2.8 s with its compiles on the 2-core Zen 5, about half
of it compiling the blockwise path's forward + backward) times two races, each side jitted, compiled and run once before the clock,
then run ``REPETITIONS`` times in turns (the order alternating round by round, so that a
slow spell of a shared machine falls on both), medians; the faster median wins, a tie
goes to the kernel:

- full calls: a training step of a causal attention layer, forward + backward
  (``jax.value_and_grad`` of the output's sum with respect to x and the four weights):
  x (B, S, H * D) projected to q, k and v, the causal core (layout ``"bshd"``), the output
  projected again, on ``FULL_CALL`` (B, S, H, D) float32, every product and the core on
  the rows of the table of paths (``_paths.races``) that ``implementation="fused"`` takes
  (the kernel and its matrix product) against ``"blockwise"``'s (XLA's dot): the work ``auto`` decides for
  a module, whose projections follow the same decision (``_linear``).  Forward +
  backward because a training step is what ``auto`` mostly serves (a decode step is the
  other race).  The projections are in because they are most of a module's time at
  short sequences, and on a build narrower than the CPU they decide it: the first form
  of this race timed the core alone (B1 H4 S256), and on the 2-core Zen 5 it took a
  kernel built for AVX2 (``$TWIN_ATTENTION_MARCH=x86-64-v3``, XLA capped at AVX2) whose
  module then ran 1.07-1.27x the blockwise module's time (B32 S128 and B4 S1024).  B8 H4
  S256 D64 (about 15-25 ms a step): the shape where the two builds' ranks were surest.
  Ratios of the kernel's median to the blockwise path's on that Zen 5, three processes
  each (medians of 7): native build B8 H4 S256 0.69-0.75, B32 H4 S128 0.72-0.86, B2 H4
  S512 0.68-0.70, B1 H4 S4096 0.56; the AVX2 build 1.14-1.24, 1.13-1.32, 1.04-1.24 and
  1.02 (a tie), while its module sweep had the blockwise module ahead at every shape,
  S16384 and S32768 included (forward 0.78-0.79x, forward + backward 0.86-0.93x the
  kernel's time).  The second form of this race, at B2 H4 S512, was the closest shape
  on the AVX2 build and went either way; one race at a shorter shape decides long
  sequences too, as those sweeps rank them on both builds.
- few query rows: a decode step over a long cache, ``FEW_ROWS_CALL`` (B, H, S, D): one
  query row per head over S cached keys with ``kv_lengths``, heads first as a module's
  cache holds them, forward only: ``"fused"`` (the kernel's forward for few rows,
  ``"cpu-decode"``) against ``"reference"`` (the explicit math, which ``auto`` runs there
  otherwise).  4096 keys (the decode benchmark's long prompt) because a decoding loop's
  time goes to long caches, and because over a short one the race is within its noise
  (B4 H8 S512 on the Zen 5: 0.7-1.05x, the winner changing from run to run), while the
  decoding loop, which gives the explicit math buckets of the cache and the kernel the
  whole cache read to each length, has the kernel ahead (``benchmarks/results``).

The record, a small JSON file ``<library>.auto.json`` beside the library
(``record_path``), names the library (its name is a hash of the sources, compiler, flags
and CPU), and for a measurement also the races it timed (``CALLS``), the JAX and jaxlib
versions and the CPUs this process may use: a record that does not match them, or that
cannot be read or parsed, is as none, and the next call that needs it measures again
(two kinds of machine sharing one cache and one build would measure in turn).  ``python -m jax_attention.build_kernel
--measure`` measures ahead of time, ``--auto kernel|blockwise`` writes a decision without
measuring (kept whatever the versions and CPUs).  ``$TWIN_ATTENTION_CPU_AUTO``
(``kernel`` or ``blockwise``) forces the decision for full calls and few rows alike,
ahead of any record; ``measure`` or unset leaves it to the record.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

OVERRIDE = "TWIN_ATTENTION_CPU_AUTO"
OVERRIDES = ("kernel", "blockwise", "measure")
VERSION = 1
SUFFIX = ".auto.json"

FULL_CALL = (8, 256, 4, 64)  # (B, S, H, D): a causal layer's forward + backward, float32, "bshd"
FEW_ROWS_CALL = (1, 8, 4096, 64)  # (B, H, S, D): one query row per head, kv_lengths, float32, "bhsd"
REPETITIONS = 7

# What each race decides between: (the kernel's rival, its name in the texts).
_RIVALS = {"full": ("blockwise", "blockwise"), "few_rows": ("reference", "the explicit math")}
# What each race times, as its record says: a record of other races is stale.
CALLS = {
    "full": "a causal layer's forward + backward, projections included, at B{} H{} S{} D{} float32, layout bshd".format(
        *(FULL_CALL[i] for i in (0, 2, 1, 3))),
    "few_rows": "a decode step at B{} H{} S{} D{} float32, one query row per head, kv_lengths".format(*FEW_ROWS_CALL),
}

# The races' sides and arguments (``_paths.races``: the rows of the table of paths that
# ``auto`` decides between, and the projections' two products), handed over by the table
# when it is imported (``use_races``): they run the kernel, which asks this module for its
# decision, so this module imports none of them.
_races: Callable[..., dict[str, Any]] | None = None

_lock = threading.Lock()  # one measurement at a time in a process; the others wait for its record
_decided: dict[str, dict[str, Any]] = {}  # record path -> the record in force (read, measured or set)
_unsaved: dict[str, str] = {}  # record path -> why a decision made here could not be cached
_local = threading.local()  # .measuring: this thread is the measurement's


def forced() -> str | None:
    """``$TWIN_ATTENTION_CPU_AUTO``: ``"kernel"`` or ``"blockwise"`` (the decision forced,
    for full calls and few rows alike), or None (``measure``, empty or unset: the cached
    measurement).  ValueError, naming the variable and its values, for another value."""
    value = os.environ.get(OVERRIDE) or "measure"
    if value not in OVERRIDES:
        raise ValueError(f"${OVERRIDE} must be one of {', '.join(OVERRIDES)} (unset: measure); got {value!r}")
    return None if value == "measure" else value


def record_path(library: Path) -> Path:
    """The record of ``auto``'s decision for a build: beside the library, named after it."""
    return library.with_name(library.name + SUFFIX)


def measuring() -> bool:
    """Whether this thread is running the measurement (which must not ask ``auto``)."""
    return bool(getattr(_local, "measuring", False))


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _versions() -> dict[str, Any]:
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", None), "cpus": _cpus()}


def _problem(record: Any, library: str) -> str | None:
    """What keeps a parsed record from being a whole one for this library (and, if
    measured, for this JAX and these CPUs), as the end of a sentence about the file ("is
    ...", "was ..."), or None where it can be used."""
    if not isinstance(record, dict):
        return "is unreadable: not a JSON object"
    if record.get("version") != VERSION:
        return f"is a record of another version ({record.get('version')!r}; this library reads {VERSION})"
    if record.get("library") != library:
        return f"is for another build of the CPU kernel ({record.get('library')})"
    source = record.get("source")
    if source not in ("measured", "set"):
        return f"is of an unknown source ({source!r}: neither measured nor set)"
    for race, (rival, _) in _RIVALS.items():
        entry = record.get(race)
        if not isinstance(entry, dict):
            return f"is incomplete: no decision for {race}"
        if entry.get("decision") not in ("kernel", rival):
            return f"is malformed: the decision for {race} is {entry.get('decision')!r}, not kernel or {rival}"
        if source == "measured":
            if entry.get("call") != CALLS[race]:
                return f"timed another race for {race} ({entry.get('call')!r})"
            bad = [f"{side}_ms" for side in ("kernel", rival) if not (
                isinstance(entry.get(f"{side}_ms"), (int, float)) and math.isfinite(entry[f"{side}_ms"])
                and entry[f"{side}_ms"] > 0)]
            if bad:
                return f"is malformed: {race} has no positive median {bad[0]} ({entry.get(bad[0])!r})"
    if source == "set":
        return None if isinstance(record.get("set_by"), str) else "is malformed: a set decision without set_by"
    ours = _versions()
    for key in ("jax", "jaxlib"):
        if record.get(key) != ours[key]:
            return (f"was measured under another JAX version ({key} {record.get(key)}; this process runs "
                    f"{key} {ours[key]})")
    if record.get("cpus") != ours["cpus"]:
        return f"was measured on other CPUs ({record.get('cpus')} CPUs; this process may use {ours['cpus']})"
    return None


def _valid(record: Any, library: str) -> bool:
    """Whether a parsed record is a whole one for this library (``_problem``: nothing)."""
    return _problem(record, library) is None


def _parsed(path: Path) -> tuple[Any, str | None]:
    """(the parsed record, None), or (None, what keeps the file at ``path`` from being
    read, as the end of a sentence about it: "is absent", "is unreadable: ...")."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, "is absent"
    except UnicodeDecodeError:
        return None, "is unreadable: not text"
    except OSError as error:
        return None, f"is unreadable: {error.strerror or error}"
    if not text.strip():
        return None, "is unreadable: empty"
    try:
        return json.loads(text), None
    except ValueError as error:
        if isinstance(error, json.JSONDecodeError) and error.pos >= len(text.rstrip()):
            return None, "is unreadable: cut short (its JSON ends early)"
        return None, "is unreadable: not JSON"


def read(path: Path, library: str) -> dict[str, Any] | None:
    """The record at ``path`` for ``library``, or None: absent, unreadable, not JSON, cut
    short, for another library, or measured otherwise (other races, another JAX, other
    CPUs); ``unusable`` says which."""
    record, _ = _parsed(path)
    return record if record is not None and _valid(record, library) else None


def unusable(path: Path, library: str) -> str | None:
    """Why there is no record for ``library`` at ``path`` to use, as the end of a sentence
    about the file: "is absent", "is unreadable: not JSON", "was measured under another
    JAX version (...)", "was measured on other CPUs (...)", "is for another build of the
    CPU kernel (...)", ...; None where ``read`` finds a record."""
    record, why = _parsed(path)
    return why if why is not None else _problem(record, library)


def write(path: Path, record: dict[str, Any]) -> str | None:
    """Write a record atomically (a file of its own beside it, renamed into place: a
    reader sees the old record or the new one, whole); None, or why it could not be
    written (a read-only cache: the decision then holds for this process only)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=".auto-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1, sort_keys=True)
                f.write("\n")
            os.chmod(scratch, 0o644)  # as readable as the library (mkstemp makes it 0600)
            os.replace(scratch, path)
        except BaseException:
            Path(scratch).unlink(missing_ok=True)
            raise
    except OSError as error:
        return str(error)
    return None


def set_record(library: str, decision: str) -> dict[str, Any]:
    """A record that sets ``decision`` (``"kernel"`` or ``"blockwise"``) without measuring
    (``build_kernel --auto``); few rows follow it (``"blockwise"``: the explicit math)."""
    if decision not in ("kernel", "blockwise"):
        raise ValueError(f"auto's decision is kernel or blockwise, not {decision!r}")
    decisions = {race: {"decision": "kernel" if decision == "kernel" else rival} for race, (rival, _) in _RIVALS.items()}
    return {"version": VERSION, "library": library, "source": "set",
            "set_by": f"python -m jax_attention.build_kernel --auto {decision}", **decisions}


def failed_record(library: str, error: str) -> dict[str, Any]:
    """The decision of a measurement that failed, held for this process only: blockwise
    (few rows: the explicit math)."""
    return {"version": VERSION, "library": library, "source": "failed", "error": error,
            **{race: {"decision": rival} for race, (rival, _) in _RIVALS.items()}}


def measured_record(library: str, timings: dict[str, Any]) -> dict[str, Any]:
    """The record of a measurement (``measure``'s result) for ``library``."""
    return {"version": VERSION, "library": library, "source": "measured", **_versions(),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **timings}


def decide(path: Path, library: str, *, may_measure: bool) -> dict[str, Any] | None:
    """The record in force for ``library`` (its record at ``path``): held in this
    process, else read, else, where ``may_measure``, measured now, cached at ``path``
    and held; None where there is none and it may not measure.  One measurement at a
    time: a thread that finds one under way waits for its record.

    A measurement that fails (it raises) is cached nowhere: this process takes the
    blockwise path, says why with a ``RuntimeWarning``, and the next process measures
    again.  Asked to measure from the measurement's own thread (an ``"auto"`` call inside
    it, which it never makes), RuntimeError: it would wait for itself."""
    key = str(path)
    if key in _decided:
        return _decided[key]
    record = read(path, library)
    if record is not None:
        return _decided.setdefault(key, record)
    if not may_measure:
        return None
    if measuring():
        raise RuntimeError("implementation='auto' asked for the CPU kernel while auto's measurement runs "
                           "(the measurement calls explicit implementations only)")
    with _lock:
        if key in _decided:
            return _decided[key]
        record = read(path, library)  # another process may have measured meanwhile
        if record is None:
            try:
                record = measured_record(library, measure())
            except Exception as error:  # any failure of the measurement: not the kernel, here
                record = failed_record(library, f"{type(error).__name__}: {error}")
                _unsaved[key] = "the measurement failed"
                warnings.warn(f"implementation='auto' takes the blockwise path on CPU: {reason(record, False)}",
                              RuntimeWarning, stacklevel=2)
            else:
                why = write(path, record)
                if why is not None:
                    _unsaved[key] = why
        _decided[key] = record
        return record


def remember(path: Path, record: dict[str, Any], unsaved: str | None = None) -> None:
    """Hold ``record`` as the decision in force for ``path`` in this process."""
    _decided[str(path)] = record
    if unsaved is None:
        _unsaved.pop(str(path), None)
    else:
        _unsaved[str(path)] = unsaved


def unsaved(path: Path) -> str | None:
    """Why the decision held for ``path`` in this process could not be cached (None: it
    was, or was read from there)."""
    return _unsaved.get(str(path))


def forget() -> None:
    """Forget the decisions held in this process (the records stay): the next ask reads
    them again, as a new process does."""
    _decided.clear()
    _unsaved.clear()


# ---------------------------------------------------------------------- the texts

def _call_text(race: str) -> str:
    if race == "full":
        b, s, h, d = FULL_CALL
        return f"a causal layer's forward + backward at B{b} H{h} S{s} D{d}"
    b, h, s, d = FEW_ROWS_CALL
    return f"a decode step at B{b} H{h} S{s} D{d}"


def forced_reason(decision: str, few_rows: bool) -> str | None:
    """``auto``'s reason to pass the kernel by under ``$TWIN_ATTENTION_CPU_AUTO``."""
    return None if decision == "kernel" else f"${OVERRIDE}={decision} passes the CPU kernel by"


def reason(record: dict[str, Any], few_rows: bool) -> str | None:
    """Why ``auto`` passes the kernel by on this record's word (None: it takes it)."""
    race = "few_rows" if few_rows else "full"
    entry = record[race]
    if entry["decision"] == "kernel":
        return None
    rival, rival_name = _RIVALS[race]
    if record.get("source") == "set":
        return f"auto is set to blockwise for this build of the CPU kernel ({record.get('set_by')})"
    if record.get("source") == "failed":
        return f"the CPU kernel could not be measured on this machine ({record.get('error')})"
    kernel = "the CPU kernel's forward for few rows" if few_rows else "the CPU kernel"
    return (f"{kernel} measured slower than {rival_name} on this machine ({entry['kernel_ms']:.3g} ms vs "
            f"{entry[rival + '_ms']:.3g} ms for {_call_text(race)})")


def basis(record: dict[str, Any] | None, few_rows: bool, path: Path) -> str:
    """One line: what decides ``auto`` for this build (the record's word, or none yet)."""
    why = unsaved(path)
    where = f"cached in {path}" if why is None else f"not cached: {why}"
    if record is None:
        problem = unusable(path, path.name[:-len(SUFFIX)] if path.name.endswith(SUFFIX) else path.name)
        if problem is not None and problem != "is absent":
            return (f"the cached measurement cannot be used ({path} {problem}): auto takes the CPU kernel, and its "
                    "first call builds the kernel if need be, measures it again against the blockwise path and "
                    "replaces the record")
        return (f"not measured yet for this build ({path} is absent): auto takes the CPU kernel, and its first "
                "call builds the kernel if need be and measures it against the blockwise path")
    if record.get("source") == "set":
        return f"set to {record['full']['decision']} by {record.get('set_by')} ({where})"
    if record.get("source") == "failed":
        return (f"the measurement failed in this process ({record.get('error')}): the blockwise path, "
                "not cached (the next process measures again)")
    race = "few_rows" if few_rows else "full"
    entry = record[race]
    rival, rival_name = _RIVALS[race]
    rival_name = "explicit math" if few_rows else rival_name
    return (f"measured on this machine for this build: kernel {entry['kernel_ms']:.3g} ms, {rival_name} "
            f"{entry[rival + '_ms']:.3g} ms ({_call_text(race)}; {where})")


_NAMES = {"kernel": "the CPU kernel", "blockwise": "the blockwise path", "reference": "the explicit math"}


def summary(record: dict[str, Any]) -> str:
    """The decisions (and medians) of a record, a line each, for the build command."""
    lines = []
    for race, label in (("full", "full calls"), ("few_rows", "few query rows")):
        entry = record[race]
        line = f"{label}: {_NAMES[entry['decision']]}"
        if record.get("source") == "measured":
            rival, _ = _RIVALS[race]
            line += (f" (medians of {record.get('repetitions')}: kernel {entry['kernel_ms']:.3g} ms, {rival} "
                     f"{entry[rival + '_ms']:.3g} ms; {_call_text(race)})")
        lines.append(line)
    if record.get("source") == "measured":
        lines.append(f"measured in {record.get('seconds'):.2f} s, compiles included")
    else:
        lines.append(f"set by {record.get('set_by')}, not measured")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the measurement

def use_races(races: Callable[..., dict[str, Any]]) -> None:
    """Time ``races`` (``_paths.races``) when measuring: ``races(FULL_CALL,
    FEW_ROWS_CALL)`` gives ``{"full": (sides, args), "few_rows": (sides, args)}``, each
    side's program jitted (``"kernel"`` and its rival, ``_RIVALS``)."""
    global _races
    _races = races


def measure(repetitions: int = REPETITIONS) -> dict[str, Any]:
    """Time both races (the module's docstring) and return what the record keeps of them:
    ``{"full": {"decision", "kernel_ms", "blockwise_ms", "call"}, "few_rows": {"decision",
    "kernel_ms", "reference_ms", "call"}, "repetitions", "seconds"}``.  The kernel must be
    built and registered (``_cpu_kernel.available()``).

    It runs in a thread of its own, which carries no trace of its caller's: the first
    ``"auto"`` call may come inside a ``jax.jit`` (or ``jax.disable_jit``, or another
    device's context), and the races must run as programs of their own on the CPU.
    Only explicit implementations are called, so no ``"auto"`` asks to measure again."""
    result: dict[str, Any] = {}
    failed: list[BaseException] = []

    def run() -> None:
        _local.measuring = True
        try:
            result.update(_measure(repetitions))
        except BaseException as error:  # raised again in the caller's thread
            failed.append(error)
        finally:
            _local.measuring = False

    thread = threading.Thread(target=run, name="twin-attention-cpu-auto", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return result


def _race(programs: dict[str, Callable[..., Any]], args: tuple[Any, ...], repetitions: int) -> dict[str, float]:
    """Median milliseconds of each program on ``args``: each compiled and run once first,
    then run in turns, the order alternating round by round."""
    import jax

    for program in programs.values():
        jax.block_until_ready(program(*args))
    names = list(programs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repetitions):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            jax.block_until_ready(programs[name](*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(taken) * 1e3 for name, taken in times.items()}


def _measure(repetitions: int) -> dict[str, Any]:
    import jax

    if _races is None:  # (not reached: importing any module of the package imports the table)
        raise RuntimeError("auto's measurement has no races: jax_attention._paths hands them over when imported")
    started = time.perf_counter()
    with jax.default_device(jax.devices("cpu")[0]):
        races = _races(FULL_CALL, FEW_ROWS_CALL)
        full = _race(*races["full"], repetitions)
        few = _race(*races["few_rows"], repetitions)
    return {
        "full": {"decision": "kernel" if full["kernel"] <= full["blockwise"] else "blockwise",
                 "kernel_ms": round(full["kernel"], 4), "blockwise_ms": round(full["blockwise"], 4),
                 "call": CALLS["full"]},
        "few_rows": {"decision": "kernel" if few["kernel"] <= few["reference"] else "reference",
                     "kernel_ms": round(few["kernel"], 4), "reference_ms": round(few["reference"], 4),
                     "call": CALLS["few_rows"]},
        "repetitions": repetitions,
        "seconds": round(time.perf_counter() - started, 3),
    }
