"""Holds docs/extending/code-map.md to the code: the path lists name the modules one request
really runs through.

An HTTP PD request (JSON and streamed) and a gRPC Prefill/Decode pair are run against stub
engines (vLLM NIXL pull, each its own process) with the profiler of ``bench.request_path``
switched on for one request at a time (twice, intersected). The test fails when a module on a
path is missing from that path's list, or a listed module is no file of the package; each
check is shown able to fail. It does not prove the one-line descriptions, nor the order.
"""

from __future__ import annotations

import re
from pathlib import Path

from bench.request_path import all_paths

ROOT = Path(__file__).resolve().parents[2]
CODE_MAP = ROOT / "docs" / "extending" / "code-map.md"
_BLOCK = re.compile(r"<!-- code-map:(\w+) -->(.*?)<!-- code-map:end -->", re.DOTALL)
_MODULE = re.compile(r"^\| `(sidecar/[\w/]+\.py)` \|", re.MULTILINE)


def listed(text: str) -> dict[str, list[str]]:
    """The modules each path list of the page names: {"http": [...], "grpc": [...]}."""
    return {name: _MODULE.findall(block) for name, block in _BLOCK.findall(text)}


def mismatches(lists: dict[str, list[str]], paths: dict[str, set[str]]) -> list[str]:
    """What the page gets wrong: modules a path runs that its list leaves out, and listed
    modules that are no file."""
    wrong = [f"{name}: {module} is on the path but not listed"
             for name, modules in paths.items()
             for module in sorted(modules - set(lists.get(name, ())))]
    wrong += [f"{name}: {module} is listed but no file"
              for name, modules in lists.items() for module in modules
              if not (ROOT / module).is_file()]
    return wrong


async def test_the_code_map_lists_every_module_on_each_path() -> None:
    paths = await all_paths()
    measured = {"http": set(paths["http-json"].modules) | set(paths["http-stream"].modules),
                "grpc": set(paths["grpc-pair"].modules)}
    lists = listed(CODE_MAP.read_text())
    assert set(lists) == {"http", "grpc"}
    assert len(measured["http"]) > 10 and len(measured["grpc"]) > 10  # the paths were run
    assert mismatches(lists, measured) == []


def test_each_check_catches_a_wrong_map() -> None:
    page = ("<!-- code-map:http -->\n| `sidecar/request/runner.py` | runs |\n"
            "| `sidecar/gone.py` | was |\n<!-- code-map:end -->\n")
    lists = listed(page)
    assert lists == {"http": ["sidecar/request/runner.py", "sidecar/gone.py"]}
    assert mismatches(lists, {"http": {"sidecar/request/runner.py", "sidecar/request/legs.py"}}
                      ) == ["http: sidecar/request/legs.py is on the path but not listed",
                            "http: sidecar/gone.py is listed but no file"]
