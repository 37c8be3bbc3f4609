"""Proves there is one HTTP/1.1 stack on llhttp: no module outside ``sidecar/http1/`` imports
``httptools`` (the serving package, the tools wing with its lean stubs, the bench, the
connectors and the tests alike; an AST walk, so a mention in a docstring does not count).
The stubs and the load generator use ``sidecar.http1`` instead. Does not prove behaviour."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "sidecar" / "http1"


def imports_httptools(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(
            alias.name.split(".")[0] == "httptools" for alias in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "httptools":
            return True
    return False


def test_the_checker_sees_both_import_forms() -> None:
    assert imports_httptools("import httptools")
    assert imports_httptools("from httptools import HttpRequestParser")
    assert imports_httptools("def f():\n    import httptools.parser")
    assert not imports_httptools('"""built on httptools"""\nimport http')


def test_httptools_is_imported_only_under_sidecar_http1() -> None:
    outside = sorted(
        str(path.relative_to(ROOT))
        for folder in ("sidecar", "bench", "connectors", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if OWNER not in path.parents and imports_httptools(path.read_text())
    )
    assert not outside, f"httptools imported outside sidecar/http1: {outside}"
    assert any(imports_httptools(path.read_text()) for path in OWNER.glob("*.py"))
