"""Proves the documentation holds together: the MkDocs site builds with ``--strict`` (no
broken link or anchor, no page outside the navigation), a broken link does fail that build,
README stays a short front door whose links all resolve, and its hand-off table is the one
the site shows (the site includes it from README).

Does not prove the prose is right; the generated configuration reference is checked in
tests/config/test_reference_in_docs.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The front door's size bound (issue #29: "at most about 300 lines").
README_MAX_LINES = 300
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)
_HTML_ID = re.compile(r"""<a id=["']([^"']+)["']""")


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = mkdocs_build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    page = (tmp_path / "site" / "driving" / "http" / "index.html").read_text(encoding="utf-8")
    assert "NixlConnector, pull" in page, "the hand-off table is not included from README"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copy(README, copy / "README.md")
    page = copy / "docs" / "operating" / "errors.md"
    page.write_text(page.read_text(encoding="utf-8") + "\n[gone](no-such-page.md)\n",
                    encoding="utf-8")
    result = mkdocs_build(copy, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr


def slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading (the anchors MkDocs and GitHub share for
    plain words)."""
    text = re.sub(r"[`*_\[\]()]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    return {slug(h) for h in _HEADING.findall(text)} | set(_HTML_ID.findall(text))


def test_readme_is_a_short_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    links = [link for link in _LINK.findall(text) if "://" not in link]
    assert any(link.startswith("docs/") for link in links)
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        if not target.exists() or (anchor and anchor not in anchors(target)):
            broken.append(link)
    assert not broken, broken


def test_every_docs_page_is_linked_from_readme_or_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert pages
    assert not [page for page in pages if page not in nav]
