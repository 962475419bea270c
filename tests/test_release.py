"""What PyPI shows: the README as the long description, its links, the project URLs, the changelog.

PyPI renders README.md away from the repository: a relative link there goes
nowhere. So every link is absolute, and each one into the documentation
site names a page (and heading) that the docs really have. The build and
the wheels-only installs are `make release-check` (scripts/release_check.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
DOCS_SITE = "https://django-dlock.readthedocs.io/en/latest/"
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LINK = re.compile(r"\]\(([^)\s]+)\)|<(https?://[^>]+)>")


def _links(text: str) -> list[str]:
    return [a or b for a, b in LINK.findall(text)]


def _anchors(page: Path) -> set[str]:
    """The ids Sphinx gives the page's headings (docutils' make_id of their text)."""
    from docutils.nodes import make_id

    headings = re.findall(r"^#{1,6} +(.+?) *$", page.read_text(), flags=re.MULTILINE)
    return {make_id(re.sub(r"[`*]", "", h)) for h in headings}


def test_every_readme_link_is_absolute() -> None:
    relative = [link for link in _links(README) if not link.startswith(("https://", "http://"))]
    assert relative == [], "PyPI cannot resolve these"


@pytest.mark.parametrize(
    "link", sorted({link for link in _links(README) if link.startswith(DOCS_SITE)})
)
def test_each_link_into_the_docs_names_a_page_and_heading_they_have(link: str) -> None:
    path, _, anchor = link[len(DOCS_SITE) :].partition("#")
    page = ROOT / "docs" / (path.removesuffix(".html") + ".md")
    assert page.is_file(), f"{link}: no {page.relative_to(ROOT)}"
    if anchor:
        assert anchor in _anchors(page), f"{link}: no heading #{anchor} in {page.name}"


def test_the_long_description_opens_with_what_it_is_and_pip_install() -> None:
    assert PYPROJECT["project"]["readme"] == "README.md"
    lines = README.splitlines()
    assert lines[0] == "# django-dlock"
    first_paragraph = README.split("\n\n")[1]
    assert "distributed locks for Django and Celery" in first_paragraph
    pip = next(i for i, line in enumerate(lines) if line.startswith("pip install django-dlock"))
    make = next(i for i, line in enumerate(lines) if line.startswith("make "))
    assert pip < make < 30, "pip install first; the repository's make targets on the first screen"


def test_the_project_urls_and_the_changelog_entry() -> None:
    urls = PYPROJECT["project"]["urls"]
    assert set(urls) == {"Documentation", "Source", "Changelog", "Issues"}
    assert all(url.startswith("https://") for url in urls.values())
    version = PYPROJECT["project"]["version"]
    assert re.search(rf"^## {re.escape(version)} \(\d{{4}}-\d\d-\d\d\)$",
                     (ROOT / "CHANGELOG.md").read_text(), flags=re.MULTILINE)  # fmt: skip
