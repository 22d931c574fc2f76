"""chapters/glossary.md stays a glossary the chapters can link to.

Every `glossary.md#anchor` link in the chapters and in HowToApproachvLLM.md names an existing heading
(GitHub's anchor rules: lowercase, punctuation dropped, spaces to hyphens), the entries are in
alphabetical order, no link sits inside a code block (it would not render), and every chapter 00-14
links the glossary at least once, unless it is in EXEMPT below. Pure file reads: no engine, no GPU.
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = REPO / "chapters"
GLOSSARY = CHAPTERS / "glossary.md"
CHAPTER_FILES = sorted(p for p in CHAPTERS.glob("*.md") if re.match(r"\d\d[a-z]?_", p.name))
LINKING_DOCS = CHAPTER_FILES + [GLOSSARY, REPO / "HowToApproachvLLM.md"]
LINK = re.compile(r"\]\((?:\.\./)?(?:chapters/)?glossary\.md#([^)\s]+)\)")

# Chapters not linked to the glossary, each with its reason (none now).
EXEMPT: dict[str, str] = {}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def glossary_terms() -> list[str]:
    return [line[3:].strip() for line in GLOSSARY.read_text().splitlines() if line.startswith("## ")]


def without_code_blocks(text: str) -> str:
    """The text with every fenced code block blanked out."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def test_anchor_rule():
    assert github_anchor("NCCL and gloo") == "nccl-and-gloo"
    assert github_anchor("Memory-bound") == "memory-bound"
    assert github_anchor("Inductor (torch.compile's compiler)") == "inductor-torchcompiles-compiler"


def test_glossary_has_entries_in_alphabetical_order():
    terms = glossary_terms()
    assert len(terms) >= 30
    assert terms == sorted(terms, key=str.casefold), "glossary entries must be in alphabetical order"
    anchors = [github_anchor(t) for t in terms]
    assert len(set(anchors)) == len(anchors), "two entries with the same anchor"


def test_every_entry_has_text():
    sections = re.split(r"^## .*$", GLOSSARY.read_text(), flags=re.M)[1:]
    empty = [t for t, body in zip(glossary_terms(), sections) if not body.strip()]
    assert not empty, f"entries without text: {empty}"


@pytest.mark.parametrize("doc", LINKING_DOCS, ids=lambda p: p.name)
def test_glossary_links_point_at_headings(doc):
    anchors = {github_anchor(t) for t in glossary_terms()}
    broken = sorted(set(LINK.findall(doc.read_text())) - anchors)
    assert not broken, f"{doc.name} links glossary anchors that no heading has: {broken}"


@pytest.mark.parametrize("doc", LINKING_DOCS, ids=lambda p: p.name)
def test_no_glossary_link_inside_code(doc):
    text = doc.read_text()
    assert len(LINK.findall(without_code_blocks(text))) == len(LINK.findall(text)), (
        f"{doc.name} has a glossary link inside a code block")


def test_the_course_overview_points_to_the_glossary():
    assert "chapters/glossary.md" in (REPO / "HowToApproachvLLM.md").read_text()


def test_exempt_chapters_exist():
    numbers = {p.name.split("_")[0] for p in CHAPTER_FILES}
    assert set(EXEMPT) <= numbers


@pytest.mark.parametrize("chapter", CHAPTER_FILES, ids=lambda p: p.name)
def test_every_chapter_links_the_glossary(chapter):
    number = chapter.name.split("_")[0]
    if number in EXEMPT:
        pytest.skip(f"chapter {number} exempt: {EXEMPT[number]}")
    assert LINK.search(chapter.read_text()), f"{chapter.name} never links chapters/glossary.md"
