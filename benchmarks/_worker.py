"""One system over its configs, in a process of its own (started by ``runner``):

    python -m benchmarks._worker JOB.json RESULTS.jsonl

Appends to RESULTS.jsonl a ``{"runtime": ...}`` line, then a ``{"measurement": ...}``
line per config as each finishes, so that what was measured survives a crash.

    python -m benchmarks._worker --in-turns JOB.json

One system at one config, measured a sample at a time as the runner asks, so that its
samples take turns with other systems' (``runner``'s turns).  It answers on stdout, on
lines that start with ``@@ ``: first ``{"runtime": ..., "built": ERROR-OR-NULL}``; then,
per line read from stdin, ``prepare PHASE`` -> ``{"runs": N}`` (or
``{"failed": ...}``), ``sample PHASE`` -> ``{"ok": BOOL}``, ``finish`` ->
``{"measurement": ...}``, after which it exits.
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks import report
from benchmarks.configs import Config
from benchmarks.environment import runtime_environment
from benchmarks.measure import OUT_OF_TIME, CaseTimer, empty_result, measure
from benchmarks.systems import configure_jax, configure_torch, framework_of


def main(job_path: str, results_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    system = job["system"]
    framework = framework_of(system)
    if framework == "jax":
        configure_jax()
    else:
        configure_torch()
    with open(results_path, "a") as out:

        def emit(line: dict) -> None:
            out.write(json.dumps(line) + "\n")
            out.flush()

        emit({"runtime": runtime_environment(framework)})
        deadline = job.get("deadline")
        for config in job["configs"]:
            if deadline is not None and time.time() > deadline:
                result = empty_result(system, Config.from_json(config), OUT_OF_TIME)
            else:
                result = measure(
                    system, Config.from_json(config),
                    runs=job["runs"], warmup=job["warmup"], backward=job["backward"],
                    warmup_s=job.get("warmup_s", 0.0), timed_s=job.get("timed_s", 0.0),
                )
            emit({"measurement": result})
            print(report.progress_line(result), flush=True)


REPLY = "@@ "  # marks the lines the runner reads (anything else a library prints is passed on)


def in_turns(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    system = job["system"]
    framework = framework_of(system)
    configure_jax() if framework == "jax" else configure_torch()

    def reply(line: dict) -> None:
        print(REPLY + json.dumps(line), flush=True)

    runtime = runtime_environment(framework)
    case = CaseTimer(system, Config.from_json(job["config"]), warmup=job["warmup"], warmup_s=job.get("warmup_s", 0.0))
    reply({"runtime": runtime, "built": case.result["error"]})
    for line in sys.stdin:
        command, *argument = line.split()
        if command == "prepare":
            runs = case.prepare(argument[0], job["runs"], job.get("timed_s", 0.0))
            reply({"failed": case.result["error"]} if runs is None else {"runs": runs})
        elif command == "sample":
            reply({"ok": case.sample(argument[0])})
        elif command == "finish":
            reply({"measurement": case.finish()})
            return
        else:
            raise ValueError(f"unknown command {line.strip()!r}")


if __name__ == "__main__":
    if sys.argv[1] == "--in-turns":
        in_turns(sys.argv[2])
    else:
        main(*sys.argv[1:])
