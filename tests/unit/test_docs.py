"""The documentation: every relative link of the README and docs/ leads somewhere (a file of
the tree, and a heading for a `#anchor` into a page), and the pages build as a site with
MkDocs in strict mode (a broken link, a missing page or a bad anchor fails it)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _links(page: Path) -> list[str]:
    """The page's link targets outside code (fenced blocks and `inline code`)."""
    text = _FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _slug(heading: str) -> str:
    """A heading's anchor, as GitHub and MkDocs' default toc make it."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def test_pages_are_found():
    assert len(PAGES) > 10 and (ROOT / "docs" / "user-guide.md") in PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading '#{anchor}' in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_readme_stays_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 350, (f"README.md has {lines} lines: keep it a front page (what and why, "
                          f"the headline figures, the quick start, links) and put the rest "
                          f"into docs/")


def test_the_site_builds_in_strict_mode(tmp_path):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"))
    build(config)  # strict (mkdocs.yml): any warning, e.g. a broken link, raises
    home = (tmp_path / "site" / "index.html").read_text()
    assert "ParallaxStrategy" in home and 'href="user-guide/"' in home
