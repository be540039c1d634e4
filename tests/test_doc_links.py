"""Every relative link of the README, ``docs/`` and the GPU runs' READMEs leads somewhere: the file exists
and, for ``page.md#section``, the page has that heading (GitHub's anchors: lowercase, punctuation dropped,
spaces as hyphens, ``-1``, ``-2`` for repeats). Renaming a heading that another page links to fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "bench" / "results").rglob("README.md"))]
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for m in HEADING.finditer(FENCED.sub("", page.read_text())):
        a = anchor(m.group(2))
        seen[a] = seen.get(a, -1) + 1
    return {a if i == 0 else f"{a}-{i}" for a, n in seen.items() for i in range(n + 1)}


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCED.sub("", page.read_text())) if not re.match(r"^[a-z]+:", t)]


def test_anchor_follows_githubs_rules():
    heading = "Keyformer's noise with its own `log`, and a shorter CI (2026-12-02, nineteenth session)"
    want = "keyformers-noise-with-its-own-log-and-a-shorter-ci-2026-12-02-nineteenth-session"
    assert anchor(heading) == want
    assert anchor("Passkey variants: the gaps of issue 16, explained (~1k tokens, 24 samples)") == \
        "passkey-variants-the-gaps-of-issue-16-explained-1k-tokens-24-samples"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: {dest.relative_to(ROOT)} has no heading with that anchor")
    assert not broken, "\n".join(broken)
