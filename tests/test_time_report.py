"""``pytest --time-report`` (tests/time_report.py): what it measures per test, and the report."""

from __future__ import annotations

import gc
import subprocess
import sys

from tests.support import needs_jax
from tests.time_report import _Clock, render


@needs_jax
def test_a_test_is_charged_its_compiles_its_subprocesses_and_its_collections() -> None:
    import jax
    import jax.numpy as jnp
    from jax._src import compiler

    compile_and_load = compiler.backend_compile_and_load
    clock = _Clock()
    try:
        measuring = clock.measure("t::a")
        next(measuring)
        jax.jit(lambda x: jnp.sin(x) * 3.0)(jnp.arange(7.0)).block_until_ready()  # a program of a new shape
        subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], check=True)
        gc.collect()
        next(measuring, None)
    finally:
        clock.close()
    assert compiler.backend_compile_and_load is compile_and_load and clock._on_gc not in gc.callbacks
    wall, compiling, compiles, children, collecting = clock.rows["t::a"]
    assert compiles >= 1 and 0 < compiling < wall
    assert 0 < children and 0 < collecting < wall
    assert clock.current is None  # nothing is charged between tests


def test_the_report_sums_each_file_and_lists_the_slowest_tests() -> None:
    rows = {
        "tests/a.py::one": [2.0, 1.0, 3, 0.5, 0.25],
        "tests/a.py::two[x]": [1.0, 0.5, 1, 0.0, 0.0],
        "tests/b.py::three": [4.0, 0.0, 0, 3.5, 0.0],
    }
    text = render(rows, workers=2, slowest=2)
    assert "3 tests, 7 s of test time (2 workers' together): XLA compiling 2 s (4 programs;" in text
    assert "subprocesses" in text
    assert "| tests/b.py | 1 | 4.0 | 0.0 | 0 | 3.5 | 0.0 |" in text
    assert "| tests/a.py | 2 | 3.0 | 1.5 | 4 | 0.5 | 0.2 |" in text
    assert text.index("| tests/b.py |") < text.index("| tests/a.py |")  # by time
    slowest = text.split("The 2 slowest tests:")[1]
    assert "tests/b.py::three" in slowest and "tests/a.py::one" in slowest and "two[x]" not in slowest
    assert "(one process)" in render(rows)
