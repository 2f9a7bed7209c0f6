"""The benchmark measures in the test's own process here (the tiny runs' workers aside), and
it collects garbage before each timed phase (``benchmarks/measure.py``), as it should in a
worker of its own. In a test process each such collection walks everything the suite has
made so far: about a second each, 10 of ``test_core_systems_time_the_function_alone``'s
24 s on a 2-core Zen 5. Here the objects that exist when a test starts are frozen
(``gc.freeze``) for its length: the collector then walks what the test made, as in a
worker, and finds the rest again once they are unfrozen (nothing is lost or pinned)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _collect_what_the_test_made() -> Iterator[None]:
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
