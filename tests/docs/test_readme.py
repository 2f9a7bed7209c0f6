"""Every Python example in README.md and in every page of docs/ runs as written (in a fresh
namespace each, from an empty working directory): the first thing a user tries must work.
A block whose first line starts with ``# sketch:`` needs more than this machine (several
devices or processes, a user's own arrays): it is compiled, not run, and its first line
says where the tests run it in full.  A test's id names the page and the block's number
on it, e.g. ``docs/porting.md-2``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import needs_both

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


BLOCKS = {name(page): BLOCK.findall(page.read_text()) for page in PAGES}
EXAMPLES = [(page, index) for page, blocks in BLOCKS.items() for index in range(len(blocks))]


def test_the_readme_and_the_docs_have_examples() -> None:
    assert len(BLOCKS["README.md"]) >= 3
    assert len(BLOCKS) >= 9, "README.md and the pages of docs/"
    assert len(EXAMPLES) >= 15


@needs_both
@pytest.mark.parametrize(("page", "index"), EXAMPLES, ids=[f"{page}-{index}" for page, index in EXAMPLES])
def test_example_runs(page: str, index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = BLOCKS[page][index]
    monkeypatch.chdir(tmp_path)
    code = compile(source, f"{page} example {index}", "exec")
    if not source.startswith("# sketch:"):
        exec(code, {"__name__": "__readme__"})


def test_the_stated_case_counts_are_the_reports() -> None:
    """The README and docs/parity.md state how many cases the report runs, whole and
    ``--quick``: the module matrix plus the functional one, as ``python -m parity_tests``
    counts them."""
    from parity_tests.cases import functional_matrix, matrix, quick, quick_functional

    whole, fast = len(matrix()) + len(functional_matrix()), len(quick()) + len(quick_functional())
    for page in ("README.md", "docs/parity.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert f"{whole} cases in about" in text, page
        assert f"(`--quick`: {fast} cases," in text, page
