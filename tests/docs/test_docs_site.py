"""Proves the documentation holds together: the MkDocs site builds with ``--strict`` (no
broken link or anchor, no page outside the navigation), a broken link does fail that build,
README stays a short front door whose links all resolve and that links the site's first
page (Getting started) and every page of the site, and its diagram, quick start and hand-off
table are the ones the site shows (the site includes them from README). The ``docs`` extra
holds only MkDocs and Material, and what mkdocs.yml names (theme, Markdown extensions) comes
with them. What the docs say about deploying holds (issue #36): no code in the site shows a
table's escaping backslash, the image the Dockerfile and the pages build is the one the
manifests pull, deploy/README lists every overlay, and no command block runs the standalone
kustomize where the walkthrough says kubectl is all it needs.

Does not prove the prose is right; the generated configuration reference is checked in
tests/config/test_reference_in_docs.py.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from docs_builders import BuiltSite, mkdocs_build
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The front door's size bound (issue #29: "at most about 300 lines").
README_MAX_LINES = 300
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)
_HTML_ID = re.compile(r"""<a id=["']([^"']+)["']""")
_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
#: An image reference to the sidecar: an optional registry path, the name, a tag.
_SIDECAR_IMAGE = re.compile(r"(?:[\w.-]+/)*disagg-sidecar:[\w.-]+")


def test_the_site_builds_strictly(built_site: BuiltSite) -> None:
    assert built_site.result.returncode == 0, built_site.result.stderr[-4000:]
    page = built_site.page("driving/http/index.html")
    assert "NixlConnector, pull" in page, "the hand-off table is not included from README"


def test_the_first_page_shows_readmes_diagram_and_quick_start(built_site: BuiltSite) -> None:
    html = built_site.page("index.html")
    assert '<h1 id="getting-started">Getting started' in html
    text = re.sub(r"<[^>]+>", "", html)
    assert "decode pod" in text and "PrefillWorker" in text, "the diagram is not included"
    assert "$U/inference/v1/generate" in text, "the quick start is not included"
    assert "The output to expect" in text and "If it does not start" in text


def test_readme_links_the_first_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert "[Getting started](docs/index.md)" in text.split("## Two commands")[0]


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


def test_readmes_documentation_table_lists_every_page_of_the_site() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    pages: list[str] = []

    def walk(items: list[Any]) -> None:
        for item in items:
            for value in item.values():
                walk(value) if isinstance(value, list) else pages.append(value)

    walk(nav)
    table = README.read_text(encoding="utf-8").split("## Documentation", 1)[1]
    assert "index.md" in pages and len(pages) > 20
    assert not [page for page in pages if f"(docs/{page})" not in table]


def _closure(names: list[str]) -> set[str]:
    """The installed distributions ``names`` need, themselves included (normalised names)."""
    seen: set[str] = set()
    todo = [canonicalize_name(name) for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def test_the_docs_extra_is_all_the_site_build_needs() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["optional-dependencies"]
    assert "disagg-sidecar[docs]" in extras["dev"]
    docs = [Requirement(text).name for text in extras["docs"]]
    assert docs == ["mkdocs", "mkdocs-material"]
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    modules = {"mkdocs", config["theme"]["name"]}
    for entry in config["markdown_extensions"]:
        name = entry if isinstance(entry, str) else next(iter(entry))
        modules.add(name.split(".")[0] if "." in name else "markdown")  # built-ins: Markdown's
    modules |= {next(iter(p)) if isinstance(p, dict) else p for p in config.get("plugins", [])}
    owners = metadata.packages_distributions()
    needed = {canonicalize_name(owners[module][0]) for module in modules}
    assert needed <= _closure(docs), needed - _closure(docs)


def test_no_code_in_the_site_shows_an_escaping_backslash(built_site: BuiltSite) -> None:
    # A `\|` in a table's code span reaches the reader as a backslash (copy-paste breaks).
    shown = [f"{page.relative_to(built_site.site)}: {code}"
             for page in sorted(built_site.site.rglob("*.html"))
             for code in _CODE.findall(page.read_text(encoding="utf-8")) if "\\|" in code]
    assert not shown, shown


def _sidecar_images(text: str) -> set[str]:
    """``disagg-sidecar:TAG`` of every image named in ``text``, any registry stripped."""
    return {match.rsplit("/", 1)[-1] for match in _SIDECAR_IMAGE.findall(text)}


def test_the_image_the_docs_build_is_the_one_the_manifests_pull() -> None:
    pulled = set()
    for manifest in (ROOT / "deploy").rglob("*.yaml"):
        pulled |= {line.split("image:", 1)[1].strip() for line in
                   manifest.read_text(encoding="utf-8").splitlines()
                   if "image:" in line and "disagg-sidecar" in line}
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["version"]
    assert pulled == {f"disagg-sidecar:{version}"}
    for path in [ROOT / "Dockerfile", ROOT / "deploy" / "README.md",
                 *sorted((ROOT / "docs").rglob("*.md"))]:
        named = _sidecar_images(path.read_text(encoding="utf-8"))
        assert named <= pulled, (path, named)
    built = (ROOT / "Dockerfile").read_text(encoding="utf-8").split("# Build:", 1)[1]
    assert _sidecar_images(built.splitlines()[0]) == pulled


def test_deploy_readme_lists_every_overlay() -> None:
    text = (ROOT / "deploy" / "README.md").read_text(encoding="utf-8")
    overlays = sorted(p.name for p in (ROOT / "deploy" / "overlays").iterdir() if p.is_dir())
    assert "vllm-nixl-push" in overlays
    assert not [name for name in overlays if f"deploy/overlays/{name}/" not in text]


def test_the_walkthroughs_commands_need_only_kubectl() -> None:
    # kubernetes.md says kubectl is all it needs; the standalone kustomize may only be named
    # as an alternative, never run in a command block.
    for path in [ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        blocks = re.findall(r"```(?:sh|bash)?\n(.*?)```", path.read_text(encoding="utf-8"),
                            re.DOTALL)
        commands = [line for block in blocks for line in block.splitlines()
                    if line.lstrip().startswith("kustomize ")]
        assert not commands, (path, commands)
