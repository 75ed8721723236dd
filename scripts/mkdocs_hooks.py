"""MkDocs hook (mkdocs.yml `hooks:`): the site's home page is the README, its links into
docs/ made relative to the site (the README is the one front page; no copy to keep in step)."""
from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

README = Path(__file__).resolve().parent.parent / "README.md"


def site_text(readme: str) -> str:
    """The README as a page of the site: `](docs/x.md)` -> `](x.md)`."""
    return readme.replace("](docs/", "](")


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=site_text(README.read_text())))
    return files
