"""The README stays a short page for users, its links resolve, and CI can read it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_README_LINES = 320
# Pages that other branches of issue 21 write; the README links them already. Once all
# four are merged, empty this set: a link to a missing page then fails.
PENDING_PAGES: set[str] = set()
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def local_links(path: Path) -> list[str]:
    """Relative link targets of a Markdown file, as paths from the repository root."""
    targets = []
    for match in LINK.finditer(path.read_text()):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        targets.append((path.parent / target).resolve().relative_to(REPO).as_posix())
    return targets


def test_readme_is_short():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines"


def test_readme_links_resolve():
    links = local_links(README)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (REPO / link).exists()
               and link not in PENDING_PAGES]
    assert missing == []


def test_readme_links_every_pending_page():
    assert PENDING_PAGES <= set(local_links(README))


def test_docs_pages_links_resolve():
    pages = sorted((REPO / "docs").glob("*.md")) + [REPO / "CHANGELOG.md"]
    missing = [(page.name, link) for page in pages for link in local_links(page)
               if not (REPO / link).exists() and link not in PENDING_PAGES]
    assert missing == []


def test_readme_keeps_the_ci_markers():
    text = README.read_text()
    for name in ("ci:install", "ci:test"):
        block = re.search(rf"<!-- {name} -->\n```\n(.+?)\n```\n<!-- /{name} -->", text, re.S)
        assert block, f"README lost its {name} block (.ci/run reads it)"
        assert "\n" not in block.group(1).strip()
