"""The README and the docs hold together: every relative link resolves, and the public names they
promise to list are all there.

A relative link names a file of the repository (or a folder) that must exist; `#anchor` must be a
heading of the file it points into, as GitHub spells headings' anchors. Links to other sites are
not followed (nothing here may reach the network).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.config.options import OPTIONS

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", REPO / "bench" / "README.md", *(REPO / "docs").glob("*.md")])
# [text](target) — the target up to the first space or ')' (no titles are used here).
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks (a `[x](y)` in code is no link)."""
    return _FENCE.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (a repeated heading gets -1, -2, … as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_prose(path.read_text())):
        base = anchor(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links of `path` whose file, or whose anchor in that file, does not exist."""
    broken = []
    for target in _LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: …
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target} (no heading #{fragment})")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_the_docs_cite_no_file_outside_the_repository() -> None:
    cited = [str(p.relative_to(REPO)) for p in DOCS if re.search(r"\bSPEC\b", p.read_text())]
    assert cited == []


def test_cli_doc_lists_every_serve_option() -> None:
    text = (REPO / "docs" / "cli.md").read_text()
    assert [o.name for o in OPTIONS if f"| `{o.name}` |" not in text] == []


def test_anchor_spelling_matches_github() -> None:
    # The headings these docs link to, spelled as GitHub renders their anchors.
    assert anchor("What `verified` and `verdict` prove") == "what-verified-and-verdict-prove"
    assert anchor("The engines' own reset routes") == "the-engines-own-reset-routes"
    assert anchor("Request bodies (`bench/body_memory.py`)") == "request-bodies-benchbody_memorypy"
    assert anchor("`infer.cache_state`") == "infercache_state"
