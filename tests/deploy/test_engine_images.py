"""Proves the overlays run the engine versions the docs say were checked (issue #29: the
SGLang overlay pinned v0.5.3 while the routes were checked against SGLang 0.5.23).

The table in docs/operating/kubernetes.md names each overlay's engine image; every engine
container of each rendered overlay must run exactly that image, and the vLLM and SGLang tags
must be the versions the docs and fixtures were checked against (vLLM 0.32.0: the real-engine
suite and tests/fixtures/vllm/0.32.0; SGLang 0.5.23: the sources the routes were read from).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from deploy_render import OVERLAYS, render_overlay

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = DOCS / "operating" / "kubernetes.md"
#: Versions the docs name as checked, and the fixtures that hold them.
CHECKED = {"vllm": "v0.32.0", "sglang": "v0.5.23"}


def documented_images() -> dict[str, str]:
    rows = re.findall(r"^\| `deploy/overlays/([\w-]+)`[^|]*\| `([^`]+)` \|", PAGE.read_text(),
                      re.MULTILINE)
    return dict(rows)


def engine_images(overlay: str) -> set[str]:
    images = set()
    for obj in render_overlay(overlay):
        if obj["kind"] != "Deployment":
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            if container["name"] == "engine":
                images.add(container["image"])
    return images


def test_the_docs_table_names_every_overlay() -> None:
    assert set(documented_images()) == set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_runs_the_documented_engine_image(overlay: str) -> None:
    assert engine_images(overlay) == {documented_images()[overlay]}


@pytest.mark.parametrize(("overlay", "tag"), CHECKED.items())
def test_checked_engines_run_the_checked_version(overlay: str, tag: str) -> None:
    (image,) = engine_images(overlay)
    assert image.rsplit(":", 1)[1] == tag, image
    assert (DOCS.parent / "tests" / "fixtures" / "vllm" / "0.32.0").is_dir()
    version = tag.removeprefix("v")
    mentions = " ".join(p.read_text() for p in DOCS.rglob("*.md"))
    assert re.search(rf"\b{re.escape(version)}\b", mentions), f"no page names {version}"
