"""Builders of the docs tests: a strict MkDocs build of a docs tree, and its result with the
built pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


class BuiltSite:
    """A strict build of this repository's docs: its result and where the pages are."""

    def __init__(self, result: subprocess.CompletedProcess[str], site: Path) -> None:
        self.result = result
        self.site = site

    def page(self, path: str) -> str:
        """The built HTML of ``path`` (``operating/configuration/index.html``)."""
        assert self.result.returncode == 0, self.result.stderr[-4000:]
        return (self.site / path).read_text(encoding="utf-8")
