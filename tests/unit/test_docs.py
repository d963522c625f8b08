"""The documentation stands alone: every relative link resolves to a file and heading in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = ("http://", "https://", "mailto:")


def prose(text: str) -> str:
    """The text outside code, where a link is a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces become hyphens."""
    text = INLINE_CODE.sub(lambda m: m[0].strip("`"), heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = anchor(m[1])
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(page: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(prose(page.read_text()))]


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "ARCHITECTURE.md", "docs/protocol.md", "docs/operations.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    broken = []
    for target in links(page):
        if target.startswith(EXTERNAL):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(ROOT):
            broken.append(f"{target}: leaves the repository")
        elif not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_nothing_points_outside_the_repository() -> None:
    """The design notes live in docs/protocol.md: no page or module refers to a copy outside the clone."""
    files = PAGES + sorted((ROOT / "sidecar").rglob("*.py"))
    stale = [f"{f.relative_to(ROOT)}:{n}" for f in files
             for n, line in enumerate(f.read_text().splitlines(), 1)
             if "../shared" in line or "PROTOCOL.md" in line]
    assert not stale, "refers to design notes outside the repository (use docs/protocol.md): " + ", ".join(stale)


def test_the_anchor_rule_matches_github() -> None:
    assert anchor("Is it protecting commits? `walsidecar check`") == "is-it-protecting-commits-walsidecar-check"
    assert anchor("Commits are waiting: the limbo") == "commits-are-waiting-the-limbo"
    assert anchor("`--link-security auth-only`") == "--link-security-auth-only"
