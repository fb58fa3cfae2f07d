"""README.md and docs/*.md link only to files inside the repository, and every link target exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]+)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_stay_inside_the_repository(page):
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        assert "://" not in target, f"{page.name}: external link {target}"
        path = (page.parent / target).resolve()
        assert REPO in path.parents, f"{page.name}: {target} leaves the repository"
        assert path.exists(), f"{page.name}: {target} does not exist"
