"""One system over its configs, in a process of its own (started by ``runner``):

    python -m benchmarks._worker JOB.json RESULTS.jsonl

Appends to RESULTS.jsonl a ``{"runtime": ...}`` line, then a ``{"measurement": ...}``
line per config as each finishes, so that what was measured survives a crash.
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks import report
from benchmarks.configs import Config
from benchmarks.environment import runtime_environment
from benchmarks.measure import OUT_OF_TIME, empty_result, measure
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


if __name__ == "__main__":
    main(*sys.argv[1:])
