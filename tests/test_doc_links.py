"""Every relative markdown link in README and docs/ names a file of the repo, and every link to a
heading (`[…](file.md#anchor)`, `[…](#anchor)`) one that exists, as GitHub spells its anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces → '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def links():
    for doc in DOCS:
        text = FENCE.sub("", doc.read_text(encoding="utf-8"))
        for m in LINK.finditer(text):
            target = (doc.parent / m.group(1)).resolve() if m.group(1) else doc
            if target.suffix == ".md":
                yield doc, target, m.group(2)


LINKS = list(links())


def test_there_are_links_to_check():
    assert len(LINKS) > 10


@pytest.mark.parametrize("doc,target,anchor", LINKS,
                         ids=[f"{d.name}->{t.name}#{a}" for d, t, a in LINKS])
def test_the_anchor_names_a_heading(doc, target, anchor):
    assert target.is_file(), f"{doc.name}: {target} does not exist"
    assert anchor in anchors(target), f"{doc.name}: no heading #{anchor} in {target.name}"


def test_slug_follows_github():
    assert slug("Unpacking on the GPU: `lop3` and the 0x6400 magic number") == \
        "unpacking-on-the-gpu-lop3-and-the-0x6400-magic-number"
    assert slug("GGUF sources: per-tensor formats") == "gguf-sources-per-tensor-formats"


FILE_LINK = re.compile(r"\]\(([^)#\s:]+)(?:#[^)\s]*)?(?:\s+\"[^\"]*\")?\)")


def file_links():
    for doc in DOCS:
        text = FENCE.sub("", doc.read_text(encoding="utf-8"))
        for m in FILE_LINK.finditer(text):
            yield doc, m.group(1)


@pytest.mark.parametrize("doc,target", list(file_links()), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_a_relative_link_names_a_file_of_the_repo(doc, target):
    assert (doc.parent / target).exists(), f"{doc.name}: {target} does not exist"
