"""No dead links in README.md and docs/: every relative link names a file that exists, and a
link to a section (``page.md#section``) names a heading of that page, by the anchors that
GitHub gives headings.  Links to other sites are not followed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```.*?```", re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """The page without its code blocks (a ``[x](y)`` in code is not a link)."""
    return FENCE.sub("", page.read_text())


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped except
    hyphens and underscores, spaces as hyphens."""
    found = set()
    for line in prose(page).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            text = heading.group(1).strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page)) if not re.match(r"[a-z]+:", target)]


def test_the_pages_link_to_each_other() -> None:
    readme = links(ROOT / "README.md")
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in {target.split("#")[0] for target in readme}, page.name


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(ROOT).as_posix() for page in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    dead = []
    for target in links(page):
        path, _, section = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{target}: no such file")
        elif section and file.suffix == ".md" and section not in anchors(file):
            dead.append(f"{target}: no heading with that anchor")
    assert not dead, f"{page.relative_to(ROOT)}: " + "; ".join(dead)
