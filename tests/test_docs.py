"""The README and docs/ stand on their own: every relative link points at a file of the repository
(and, for README anchors, at a heading that exists), and nothing points outside the clone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(m[1]) for m in re.finditer(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.is_relative_to(ROOT) or "shared" in path.relative_to(ROOT).parts[:1]:
            broken.append(f"{target} (outside the repository)")
        elif not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def test_the_anchor_rule() -> None:
    assert _anchor("A-EDiT against a consistent straggler (virtual time)") == \
        "a-edit-against-a-consistent-straggler-virtual-time"
    assert _anchor("Streaming DiLoCo and CoCoDC over 36 periods, with the workers' own models scored") == \
        "streaming-diloco-and-cocodc-over-36-periods-with-the-workers-own-models-scored"
