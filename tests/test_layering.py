"""Which parts of ``sidecar/`` may import which: a plain AST walk over the source files.

Proves: nothing under ``sidecar/`` except the tools wing itself (``sidecar/tools/``) and the
composition root (``sidecar/__main__.py``) imports ``sidecar.tools``, so the serving package
that ``serve`` loads never loads stub engines, the demo, the route CLI or the gRPC
regenerator; the checker itself sees absolute, ``from sidecar import tools`` and relative
forms. Does not prove anything about imports made at run time by name (``importlib``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sidecar"
TOOLS = "sidecar.tools"
MAY_IMPORT_TOOLS = (PACKAGE / "tools", PACKAGE / "__main__.py")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, *, is_package: bool) -> Iterator[str]:
    """Every module an import statement in ``source`` names, made absolute."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            # ``from sidecar import tools`` names the module in the alias.
            yield from (f"{base}.{alias.name}" for alias in node.names)


def imports_tools(source: str, module: str, *, is_package: bool = False) -> bool:
    return any(
        name == TOOLS or name.startswith(TOOLS + ".")
        for name in imported_modules(source, module, is_package=is_package)
    )


def serving_files() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(path == allowed or allowed in path.parents for allowed in MAY_IMPORT_TOOLS)
    ]


def test_the_serving_package_never_imports_the_tools_wing() -> None:
    files = serving_files()
    assert PACKAGE / "serve.py" in files and len(files) > 20  # the walk found the package
    offenders = [
        str(path.relative_to(ROOT))
        for path in files
        if imports_tools(
            path.read_text(encoding="utf-8"),
            module_name(path),
            is_package=path.name == "__init__.py",
        )
    ]
    assert offenders == [], f"these import {TOOLS}: {offenders}"


def test_the_composition_root_is_what_loads_the_tools() -> None:
    main = PACKAGE / "__main__.py"
    assert imports_tools(main.read_text(encoding="utf-8"), "sidecar.__main__")


def test_the_checker_sees_every_import_form() -> None:
    seen = [
        ("import sidecar.tools.stubs", "sidecar.serve", False),
        ("from sidecar.tools.route import route", "sidecar.serve", False),
        ("from sidecar import tools", "sidecar.serve", False),
        ("def f():\n    from sidecar.tools import demo", "sidecar.serve", False),
        ("from ..tools import demo", "sidecar.core.legs", False),
        ("from . import tools", "sidecar", True),
    ]
    for source, module, is_package in seen:
        assert imports_tools(source, module, is_package=is_package), source
    unseen = [
        ("import sidecar.toolsmith", "sidecar.serve", False),
        ("from sidecar import settings", "sidecar.serve", False),
        ("from .engines import base", "sidecar.core.legs", False),
    ]
    for source, module, is_package in unseen:
        assert not imports_tools(source, module, is_package=is_package), source
