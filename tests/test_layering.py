"""Proves the house's layering from the code itself (an AST walk, nothing is run):

- the serving package never loads the tools wing: nothing under ``sidecar/`` except
  ``sidecar/tools/`` and the composition root (``sidecar/__main__.py``) imports
  ``sidecar.tools`` (stub engines, the demo, the route CLI, the gRPC regenerator); the checker
  sees absolute, ``from sidecar import tools`` and relative forms;
- the front doors (``sidecar/http_server``, ``sidecar/grpc_server``) reach engines only through
  the core's public API: no import of the core's internals (``legs``, ``engine_model``,
  ``engine_ids``), of the upstream client type, and no read of a runtime's ``handler``,
  ``agent`` or ``session``;
- the core (``sidecar/core``) imports no front door and not the process wiring;
- engine knowledge lives in ``sidecar/engines`` and ``sidecar/kv_agents``: no other serving
  module names an engine's hand-off key.

It does not prove behaviour (the suites of each room do), nor imports made at run time by name
(``importlib``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

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

FRONT_DOORS = ("http_server", "grpc_server")
#: Core modules a front door may use; the rest are the core's own business.
CORE_INTERNALS = ("sidecar.core.legs", "sidecar.core.engine_model", "sidecar.core.engine_ids")
#: Top-level body keys of the engines' hand-offs (contracts.md), and their token-id switches.
ENGINE_KEYS = frozenset({
    "kv_transfer_params", "disagg_prefill_resp", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "disaggregated_params", "return_token_ids", "detokenize",
    "disagg_inline", "transfer_id",
})
#: Where engine keys may be written: the engines' rooms, and the tools that play engines.
ENGINE_ROOMS = ("engines", "kv_agents", "tools", "stubs", "grpc_gen")


def _modules(*rooms: str) -> Iterator[Path]:
    for room in rooms:
        yield from sorted((PACKAGE / room).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


@pytest.mark.parametrize("path", list(_modules(*FRONT_DOORS)), ids=_rel)
def test_front_doors_use_only_the_cores_public_api(path: Path) -> None:
    imported = _imports(path)
    internal = sorted(name for name in imported
                      if any(name == i or name.startswith(i + ".") for i in CORE_INTERNALS))
    assert not internal, f"{_rel(path)} imports core internals: {internal}"
    assert "sidecar.http1.EngineClient" not in imported, f"{_rel(path)} holds an engine client"
    reads = sorted(
        f"{node.value.id}.{node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id.endswith("runtime") and node.attr in {"handler", "agent", "session"}
    )
    assert not reads, f"{_rel(path)} reaches around the core: {reads}"


@pytest.mark.parametrize("path", list(_modules("core")), ids=_rel)
def test_the_core_imports_no_front_door(path: Path) -> None:
    imported = _imports(path)
    doors = sorted(name for name in imported if name.startswith(
        ("sidecar.http_server", "sidecar.grpc_server", "sidecar.serve", "sidecar.runtime",
         "aiohttp.web", "grpc")
    ))
    assert not doors, f"{_rel(path)} imports a front door: {doors}"


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings
    }


def test_engine_keys_are_written_only_in_the_engines_rooms() -> None:
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    elsewhere = sorted(rooms - set(ENGINE_ROOMS))
    found = {
        _rel(path): sorted(_string_constants(path) & ENGINE_KEYS)
        for path in [*_modules(*elsewhere), *sorted(PACKAGE.glob("*.py"))]
    }
    assert {path: keys for path, keys in found.items() if keys} == {}


def test_the_walk_sees_what_it_claims() -> None:
    # The checks above would pass vacuously on an empty or misplaced tree.
    assert len(list(_modules(*FRONT_DOORS))) >= 10
    assert "sidecar.core.orchestrator" in _imports(PACKAGE / "http_server" / "pd.py")
    assert "kv_transfer_params" in _string_constants(PACKAGE / "kv_agents" / "shfs.py")


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
