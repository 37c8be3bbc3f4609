"""Proves the house's shape from the code itself (the source is read, nothing is run):

- **rooms**: every module of the serving package (``sidecar/`` but ``sidecar/tools/``) is in
  one room of ``ROOMS`` (a concept folder, or a module of its own), and imports only from its
  own room and the rooms ``MAY_IMPORT`` names for it: the allowed imports between concepts,
  which cut the house by concept (a module may be as long as its one concept needs: there is
  no line cap; docs/extending/code-map.md draws the same table);
- **no circle**: no module imports itself through others (file by file, absolute and relative
  imports, module-level and inside functions);
- **engine knowledge in its dialect**: no engine or connector name and no hand-off key
  (``ENGINE_WORDS``) appears in the serving package outside ``sidecar/dialects/`` (tools,
  tests and the generated gRPC code aside): not as a name, a string or a comment (docstrings
  may explain, with examples);
- the serving package never loads the tools wing (only ``__main__`` does);
- the front doors reach engines only through the core's public API (the PD flow and its
  engine calls): no import of the core's upstream internals or the client type;
- the core (``request``, ``engines``) imports no front door and not the process wiring.

Each check is shown able to fail on a deliberate leak (``test_each_check_catches_a_leak``).
It does not prove behaviour (the suites of each room do), nor imports made at run time by
name (``importlib``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sidecar"
TOOLS = "sidecar.tools"
MAY_IMPORT_TOOLS = (PACKAGE / "tools", PACKAGE / "__main__.py")
#: Not part of the serving package's own code.
NOT_SERVING = (PACKAGE / "tools", PACKAGE / "grpc_gen")

#: The rooms of the serving package: a concept folder (or a module of its own) each; a
#: module is in the room of its longest listed prefix. ``base`` holds what every room may use.
ROOMS: dict[str, tuple[str, ...]] = {
    "base": ("sidecar", "sidecar.jsonutil", "sidecar.errors", "sidecar.loop", "sidecar.tasks",
             "sidecar.bounded", "sidecar.ttl_cache", "sidecar.tls", "sidecar.grpc_gen",
             "sidecar.http1", "sidecar.protocol"),
    "observability": ("sidecar.observability",),
    "dialects": ("sidecar.dialects",),
    "targets": ("sidecar.targets",),
    "kv_events": ("sidecar.kv_events",),
    "config": ("sidecar.config",),
    "workers": ("sidecar.workers",),
    "engines": ("sidecar.engines",),
    "request": ("sidecar.request",),
    "runtime": ("sidecar.runtime",),
    "http_server": ("sidecar.http_server",),
    "grpc_server": ("sidecar.grpc_server",),
    "composition": ("sidecar.serve", "sidecar.worker", "sidecar.__main__"),
}

#: What each room may import besides itself. Engine knowledge (dialects) and the prefill
#: targets are pure rooms over the base; everything that talks to an engine is ``engines``;
#: a request's decision and run is ``request``, which gets values, never the settings; only
#: the wiring (``runtime``) and the doors see the whole; the composition roots see all.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "observability": frozenset({"base"}),
    "dialects": frozenset({"base"}),
    "targets": frozenset({"base"}),
    "kv_events": frozenset({"base", "observability"}),
    "config": frozenset({"base", "dialects", "observability", "targets", "kv_events"}),
    "workers": frozenset({"base", "config", "observability"}),
    "engines": frozenset({"base", "config", "dialects", "observability", "targets"}),
    "request": frozenset({"base", "dialects", "engines", "kv_events", "observability",
                          "targets"}),
    "runtime": frozenset({"base", "config", "dialects", "engines", "kv_events",
                          "observability", "request", "targets", "workers"}),
    "http_server": frozenset({"base", "engines", "observability", "request", "runtime",
                              "targets"}),
    "grpc_server": frozenset({"base", "config", "dialects", "engines", "observability",
                              "request", "runtime", "targets"}),
    "composition": frozenset(set(ROOMS) - {"composition"}),
}

#: Engine and connector names, and the keys of their hand-offs: the dialects' knowledge.
ENGINE_WORDS = (
    "vllm", "sglang", "trtllm", "tensorrt", "mooncake", "nixl", "neuron", "shfs", "lmcache",
    "bootstrap", "kv_transfer_params", "disaggregated_params", "disagg_prefill_resp",
    "disagg_inline", "disagg_request_id", "transfer_id", "return_token_ids", "detokenize",
    "abort_request",
)
#: Where that knowledge may be written.
DIALECT_ROOM = PACKAGE / "dialects"

FRONT_DOORS = ("http_server", "grpc_server")
#: Core modules a front door may not use: the upstream calls' internals.
CORE_INTERNALS = ("sidecar.engines.failures", "sidecar.engines.models")


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


def _serving(path: Path) -> bool:
    return not any(room in path.parents for room in NOT_SERVING)


def serving_modules() -> dict[str, Path]:
    """Module name -> file, for every module of the serving package."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if _serving(path)}


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


# -- the graph --------------------------------------------------------------------------------


def import_graph(sources: Mapping[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports (``sources``: name -> (text, package))."""
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        targets = set()
        for name in imported_modules(source, module, is_package=is_package):
            # ``from a.b import c`` names a.b.c (a module or not): keep the longest known one.
            while name and name not in sources:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (each as the modules on it, one per strongly connected
    component of more than one module; Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def room_of(module: str) -> str:
    """The room in ``ROOMS`` holding ``module`` (its longest listed prefix)."""
    best, found = -1, None
    for room, names in ROOMS.items():
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), room
    if found is None:
        raise LookupError(f"{module} is in no room of ROOMS")
    return found


def forbidden_imports(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Every import from a room that ``MAY_IMPORT`` does not allow, as 'a -> b'."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  for target in targets
                  if (room := room_of(module)) != (other := room_of(target))
                  and other not in MAY_IMPORT[room])


# -- engine words -----------------------------------------------------------------------------

_WORDS = re.compile("|".join(ENGINE_WORDS), re.IGNORECASE)


def engine_words(source: str) -> list[str]:
    """Engine words in ``source``'s names, strings and comments (docstrings aside)."""
    tree = ast.parse(source)
    docstrings = {
        node.body[0].value.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.NAME, tokenize.STRING, tokenize.COMMENT):
            continue
        if token.type == tokenize.STRING and token.start[0] in docstrings:
            continue
        match = _WORDS.search(token.string)
        if match:
            found.append(f"line {token.start[0]}: {match.group(0)!r} in {token.string[:60]!r}")
    return found


# -- the tests --------------------------------------------------------------------------------


def _graph() -> dict[str, set[str]]:
    modules = serving_modules()
    return import_graph({name: (path.read_text(), path.name == "__init__.py")
                         for name, path in modules.items()})


def test_every_module_is_in_a_room_and_imports_only_what_its_room_may() -> None:
    graph = _graph()
    assert len(graph) > 80  # the walk found the package
    for module in graph:
        room_of(module)
    assert forbidden_imports(graph) == []


def test_the_allowed_imports_between_rooms_have_no_circle() -> None:
    rooms = {room: set(allowed) for room, allowed in MAY_IMPORT.items()}
    assert set(rooms) == set(ROOMS) and all(set(a) <= set(ROOMS) for a in rooms.values())
    assert circles(rooms) == []


def test_no_module_imports_itself_through_others() -> None:
    assert circles(_graph()) == []


def test_engine_knowledge_is_written_only_in_the_dialects() -> None:
    found = {
        _rel(path): words
        for path in serving_modules().values()
        if DIALECT_ROOM not in path.parents and (words := engine_words(path.read_text()))
    }
    assert found == {}


def test_the_serving_package_never_imports_the_tools_wing() -> None:
    files = [path for path in sorted(PACKAGE.rglob("*.py"))
             if not any(path == allowed or allowed in path.parents
                        for allowed in MAY_IMPORT_TOOLS)]
    assert PACKAGE / "serve.py" in files and len(files) > 20
    offenders = [
        _rel(path) for path in files
        if imports_tools(path.read_text(), module_name(path),
                         is_package=path.name == "__init__.py")
    ]
    assert offenders == [], f"these import {TOOLS}: {offenders}"


def test_the_composition_root_is_what_loads_the_tools() -> None:
    assert imports_tools((PACKAGE / "__main__.py").read_text(), "sidecar.__main__")


def _door_modules() -> list[Path]:
    return [path for room in FRONT_DOORS for path in sorted((PACKAGE / room).rglob("*.py"))]


@pytest.mark.parametrize("path", _door_modules(), ids=_rel)
def test_front_doors_use_only_the_cores_public_api(path: Path) -> None:
    imported = set(imported_modules(path.read_text(), module_name(path),
                                    is_package=path.name == "__init__.py"))
    internal = sorted(name for name in imported
                      if any(name == i or name.startswith(i + ".") for i in CORE_INTERNALS))
    assert not internal, f"{_rel(path)} imports core internals: {internal}"
    assert "sidecar.http1.EngineClient" not in imported, f"{_rel(path)} holds an engine client"
    reads = sorted(
        f"{node.value.id}.{node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id.endswith("runtime") and node.attr == "session"
    )
    assert not reads, f"{_rel(path)} reaches around the core: {reads}"


CORE_ROOMS = (PACKAGE / "request", PACKAGE / "engines")


@pytest.mark.parametrize("path", sorted(p for room in CORE_ROOMS for p in room.rglob("*.py")),
                         ids=_rel)
def test_the_core_imports_no_front_door(path: Path) -> None:
    imported = set(imported_modules(path.read_text(), module_name(path),
                                    is_package=path.name == "__init__.py"))
    doors = sorted(name for name in imported if name.startswith(
        ("sidecar.http_server", "sidecar.grpc_server", "sidecar.serve", "sidecar.runtime",
         "aiohttp.web", "grpc")
    ))
    assert not doors, f"{_rel(path)} imports a front door: {doors}"


def test_each_check_catches_a_leak() -> None:
    # An engine's key in a front door, in a name, a string and a comment; not in a docstring.
    leak = 'def f():\n    """kv_transfer_params, explained."""\n    return "kv_transfer_params"\n'
    assert len(engine_words(leak)) == 1
    assert engine_words("vllm_room = 1\n") and engine_words("x = 1  # SGLang's rooms\n")
    assert not engine_words('"""Dialects: vLLM, SGLang."""\nx = 1\n')
    # A core module importing the HTTP door is not allowed; two modules importing each other
    # are a circle, and so is a ring of three; relative imports count.
    leaks = {
        "sidecar.request.runner": ("from sidecar.http_server import pd\n", False),
        "sidecar.http_server.pd": ("from ..request import runner\n", False),
        "sidecar.config.a": ("import sidecar.config.b\n", False),
        "sidecar.config.b": ("def f():\n    from sidecar.config import c\n", False),
        "sidecar.config.c": ("from . import a\n", False),
        "sidecar.config": ("", True),
        "sidecar.http_server": ("", True),
        "sidecar.request": ("", True),
    }
    graph = import_graph(leaks)
    assert forbidden_imports(graph) == ["sidecar.request.runner -> sidecar.http_server",
                                        "sidecar.request.runner -> sidecar.http_server.pd"]
    assert circles(graph) == [
        ["sidecar.config.a", "sidecar.config.b", "sidecar.config.c"],
        ["sidecar.http_server.pd", "sidecar.request.runner"],
    ]
    with pytest.raises(LookupError):
        room_of("elsewhere.module")


def test_the_checker_sees_every_import_form() -> None:
    seen = [
        ("import sidecar.tools.stubs", "sidecar.serve", False),
        ("from sidecar.tools.route import route", "sidecar.serve", False),
        ("from sidecar import tools", "sidecar.serve", False),
        ("def f():\n    from sidecar.tools import demo", "sidecar.serve", False),
        ("from ..tools import demo", "sidecar.engines.failures", False),
        ("from . import tools", "sidecar", True),
    ]
    for source, module, is_package in seen:
        assert imports_tools(source, module, is_package=is_package), source
    unseen = [
        ("import sidecar.toolsmith", "sidecar.serve", False),
        ("from sidecar import config", "sidecar.serve", False),
        ("from .dialects import base", "sidecar.engines.failures", False),
    ]
    for source, module, is_package in unseen:
        assert not imports_tools(source, module, is_package=is_package), source
