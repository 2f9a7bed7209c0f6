"""Every Python example in README.md runs as written (in a fresh namespace each, from an
empty working directory): the first thing a user tries must work.  A block whose first
line starts with ``# sketch:`` needs more than this machine (several devices or
processes, a user's own arrays): it is compiled, not run, and its first line says where
the tests run it in full."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import needs_both

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_examples() -> None:
    assert len(BLOCKS) >= 8


@needs_both
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = compile(BLOCKS[index], f"README.md example {index}", "exec")
    if not BLOCKS[index].startswith("# sketch:"):
        exec(code, {"__name__": "__readme__"})
