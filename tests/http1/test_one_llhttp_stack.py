"""Proves there are two places on llhttp, one per side of the wire: the sidecar's client
(``sidecar/http1/``) and the lean keep-alive server the bench's stub engines serve on
(``sidecar/tools/stubs/lean/keepalive.py``, not part of the serving package). No other module
imports ``httptools`` (the serving package, the rest of the tools wing, the bench, the
connectors and the tests alike; an AST walk, so a mention in a docstring does not count): the
stubs' pulls and the load generator use ``sidecar.http1``. Does not prove behaviour."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "sidecar" / "http1"
SERVER = ROOT / "sidecar" / "tools" / "stubs" / "lean" / "keepalive.py"


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


def test_httptools_is_imported_only_by_the_client_and_the_stubs_server() -> None:
    outside = sorted(
        str(path.relative_to(ROOT))
        for folder in ("sidecar", "bench", "connectors", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if CLIENT not in path.parents and path != SERVER and imports_httptools(path.read_text())
    )
    assert not outside, f"httptools imported elsewhere: {outside}"
    assert any(imports_httptools(path.read_text()) for path in CLIENT.glob("*.py"))
    assert imports_httptools(SERVER.read_text())
