"""The documentation site built once for the docs tests: ``mkdocs build --strict`` into a
temporary directory (the build's result, for the tests that check it; the site's pages, for
those that read them)."""

from __future__ import annotations

import pytest
from docs_builders import ROOT, BuiltSite, mkdocs_build


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> BuiltSite:
    site = tmp_path_factory.mktemp("docs") / "site"
    return BuiltSite(mkdocs_build(ROOT, site), site)
