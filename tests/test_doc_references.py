"""A page that cites another page's section by its name (`docs/benchmarks.md, "Tokens that fit
2 GiB"`, `[results.md](results.md), "The demo"`) names a section that is there: a heading, or a
paragraph's bold title, that begins with the cited words. A section renamed or lost leaves its
citations pointing nowhere, and a reader finds nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
# a page's file name, then (after a link's close, a comma or an opening bracket) a quoted name
CITATION = re.compile(r"(\w+\.md)(?:\]\([^)]*\))?\)?,? \(?\"([^\"]{4,120})\"")


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", "")).strip()


def _sections(page: Path) -> list[str]:
    """The page's headings and its paragraphs' bold titles (`**The C kernels.** ...`)."""
    text = page.read_text()
    headings = [line.lstrip("#") for line in text.splitlines() if line.startswith("#")]
    titles = re.findall(r"(?:^|\n)(?:- )?\*\*([^*]+)\*\*", text)
    return [_plain(name) for name in headings + titles]


def citations() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text())
        for target, name in CITATION.findall(text):
            if (REPO / "docs" / target).exists() or target == "README.md":
                found.append((page.name, target, _plain(name)))
    return found


def test_pages_cite_sections():
    assert len(citations()) > 50  # the pattern finds the pages' citations


@pytest.mark.parametrize("page, target, name", citations())
def test_a_cited_section_is_there(page, target, name):
    path = REPO / "README.md" if target == "README.md" else REPO / "docs" / target
    assert any(section.startswith(name) for section in _sections(path)), (
        f'{page} cites {target}, "{name}": no heading or bold title there begins so'
    )
