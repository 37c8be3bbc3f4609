"""Which of the sidecar's own modules one request runs through: the request path's size.

    python -m bench.request_path              the HTTP PD pair (JSON and streamed) and the
                                              gRPC native pair, as a table
    python -m bench.request_path --json       the same as JSON (module lists included)

Two stub engines (vLLM, NixlConnector pull; each its own process) and the sidecars in this
process, on loopback ports the OS chose. After a warm-up, a profiler (``sys.setprofile``) is
switched on for one request only and records every function of the ``sidecar`` package that
runs (``sidecar/tools`` and the generated gRPC code aside); that is done twice and the two
sets are intersected, so a background task that happened to wake during one request (the
engine's health check) is not counted. The figures: the modules (files), their lines (the
whole files'), their code (those lines less blank ones, comments and docstrings), the lines of
the functions that ran (each from its first line to its last that holds code, a line two of
them share counted once), the functions; and the serving package's lines and code
(``sidecar/`` less the tools and the generated gRPC code), the size issue #33 sets a target
for.

    http-json     POST /v1/completions on a decode sidecar with x-prefiller-host-port
    http-stream   the same, streamed
    grpc-pair     Prefill on a prefill-role sidecar, then Decode on a decode-role sidecar
                  with its blocks (both sidecars' modules together)

``tests/docs/test_code_map.py`` holds docs/extending/code-map.md to the modules this finds.

Deliberate limits: one dialect (vLLM NIXL pull), no fan-out, TLS or tracing; a module counts
with all its lines however few of them ran.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import io
import json
import subprocess
import sys
import tokenize
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sidecar"
NOT_COUNTED = (PACKAGE / "tools", PACKAGE / "grpc_gen")
MODEL = "stub-model"


#: Tokens that are no code of their own: a line holding only these is blank or a comment.
_NOT_CODE = frozenset({tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                       tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER})


def docstring_lines(source: str) -> set[int]:
    """The lines of the module's, its classes' and its functions' docstrings."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(source: str) -> int:
    """How many of the source's lines hold code: not blank, a comment or a docstring (a
    string that is a statement of its own elsewhere counts as code)."""
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstring_lines(source))


def _source(module: str) -> str:
    return (ROOT / module).read_text()


@dataclass
class PathFigures:
    """One request's path through the package: module -> the functions of it that ran, and
    each such function's lines (first, last)."""

    functions: dict[str, set[str]] = field(default_factory=dict)
    spans: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    @property
    def modules(self) -> list[str]:
        return sorted(self.functions)

    @property
    def lines(self) -> int:
        return sum(len(_source(module).splitlines()) for module in self.functions)

    @property
    def code(self) -> int:
        return sum(code_lines(_source(module)) for module in self.functions)

    @property
    def ran_lines(self) -> int:
        """The lines of the functions that ran, a line of nested functions counted once."""
        by_module: dict[str, set[int]] = {}
        for (module, name), (first, last) in self.spans.items():
            if name in self.functions.get(module, ()):
                by_module.setdefault(module, set()).update(range(first, last + 1))
        return sum(len(lines) for lines in by_module.values())

    @property
    def function_count(self) -> int:
        return sum(len(names) for names in self.functions.values())

    def intersect(self, other: PathFigures) -> PathFigures:
        common = {module: names & other.functions[module]
                  for module, names in self.functions.items() if module in other.functions}
        return PathFigures({module: names for module, names in common.items() if names},
                           self.spans | other.spans)

    def summary(self) -> dict[str, Any]:
        return {"files": len(self.functions), "lines": self.lines, "code": self.code,
                "ran_lines": self.ran_lines, "functions": self.function_count,
                "modules": self.modules}


def serving_size() -> dict[str, int]:
    """The serving package's files, lines and code: ``sidecar/`` less the tools and the
    generated gRPC code."""
    modules = [path for path in sorted(PACKAGE.rglob("*.py"))
               if not any(room in path.parents for room in NOT_COUNTED)]
    sources = [path.read_text() for path in modules]
    return {"files": len(modules), "lines": sum(len(text.splitlines()) for text in sources),
            "code": sum(code_lines(text) for text in sources)}


def _counted(filename: str) -> str | None:
    """The module's path from the repository root, when it is one of the counted ones."""
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return None
    if PACKAGE not in path.parents or any(room in path.parents for room in NOT_COUNTED):
        return None
    return str(path.relative_to(ROOT))


async def profiled(run: Callable[[], Awaitable[object]]) -> PathFigures:
    """The package's functions that run while ``run()`` is awaited (this thread only)."""
    figures = PathFigures()
    seen: dict[types.CodeType, str | None] = {}

    def hook(frame: types.FrameType, event: str, _: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        module = seen.get(code, "")
        if module == "":
            module = seen[code] = _counted(code.co_filename)
        if module is not None:
            figures.functions.setdefault(module, set()).add(code.co_qualname)
            if (module, code.co_qualname) not in figures.spans:
                lines = [line for _, _, line in code.co_lines() if line is not None]
                figures.spans[module, code.co_qualname] = (code.co_firstlineno,
                                                           max(lines, default=0))

    sys.setprofile(hook)
    try:
        await run()
    finally:
        sys.setprofile(None)
    return figures


async def measured(run: Callable[[], Awaitable[object]], *, warm_up: int = 3) -> PathFigures:
    """``run``'s path: warmed up, then profiled twice, what both runs share."""
    for _ in range(warm_up):
        await run()
    first = await profiled(run)
    return first.intersect(await profiled(run))


# -- the stub engines and the sidecars ------------------------------------------------------


@contextlib.asynccontextmanager
async def stub_engine(role: str) -> AsyncIterator[int]:
    """A vLLM NIXL stub engine in its own process; its port."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar.tools.stubs", "--engine", "vllm", "--role", role,
        "--kv-connector", "shfs", "--host", "127.0.0.1", "--port", "0",
        stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        yield int(json.loads(line)["port"])
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


@contextlib.asynccontextmanager
async def sidecar(**settings: Any) -> AsyncIterator[dict[str, int]]:
    """The real sidecar (``serve.run_server``) in this process; its ports."""
    from sidecar.config.settings import Settings
    from sidecar.serve import run_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    listening: asyncio.Future[dict[str, int]] = loop.create_future()
    config = Settings(host="127.0.0.1", port=0, grpc_port=0, log_level="warning",
                      drain_grace_s=5.0, engine="vllm", kv_connector="shfs", **settings)
    server = asyncio.ensure_future(run_server(config, stop, listening.set_result))
    waiting: set[asyncio.Future[Any]] = {server, listening}
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if server.done():
        server.result()
        raise RuntimeError("the sidecar stopped before listening")
    try:
        yield listening.result()
    finally:
        stop.set()
        await server


async def http_paths(prefill: int, decode: int) -> dict[str, PathFigures]:
    async with (sidecar(engine_url=f"http://127.0.0.1:{decode}", grpc_enabled=False,
                        prefill_allowlist=(f"127.0.0.1:{prefill}",)) as ports,
                aiohttp.ClientSession() as session):
        url = f"http://127.0.0.1:{ports['http']}/v1/completions"
        headers = {"x-prefiller-host-port": f"127.0.0.1:{prefill}"}

        def request(stream: bool) -> Callable[[], Awaitable[object]]:
            body = {"model": MODEL, "prompt": "Hello there, a prompt of some words",
                    "max_tokens": 8, "stream": stream}

            async def run() -> object:
                async with session.post(url, json=body, headers=headers) as response:
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                    return await response.read()

            return run

        return {"http-json": await measured(request(False)),
                "http-stream": await measured(request(True))}


async def grpc_path(prefill: int, decode: int) -> PathFigures:
    from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc

    async with (sidecar(engine_url=f"http://127.0.0.1:{prefill}", role="prefill",
                        advertise_host="127.0.0.1") as prefill_ports,
                sidecar(engine_url=f"http://127.0.0.1:{decode}", role="decode") as decode_ports,
                grpc.aio.insecure_channel(f"127.0.0.1:{prefill_ports['grpc']}") as p_channel,
                grpc.aio.insecure_channel(f"127.0.0.1:{decode_ports['grpc']}") as d_channel):
        prefill_worker = disagg_pb2_grpc.PrefillWorkerStub(p_channel)
        decode_worker = disagg_pb2_grpc.DecodeWorkerStub(d_channel)
        token_ids = list(range(10, 50))

        async def run() -> object:
            blocks = []
            async for message in prefill_worker.Prefill(disagg_pb2.PreFillRequest(
                    request_id="path", token_ids=token_ids, max_new_tokens=1)):
                if message.done:
                    break
                blocks.append(message.block)
            tokens = [message async for message in decode_worker.Decode(
                disagg_pb2.DecodeRequest(request_id="path", kv_blocks=blocks,
                                         token_ids=token_ids, max_new_tokens=8))]
            if not tokens or not tokens[-1].done:
                raise RuntimeError("the decode did not end with done")
            return tokens

        return await measured(run)


async def all_paths() -> dict[str, PathFigures]:
    async with stub_engine("prefill") as prefill, stub_engine("decode") as decode:
        paths = await http_paths(prefill, decode)
        paths["grpc-pair"] = await grpc_path(prefill, decode)
        return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_path",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON, module lists included")
    args = parser.parse_args(argv)
    paths = asyncio.run(all_paths())
    serving = serving_size()
    if args.json:
        print(json.dumps({**{name: figures.summary() for name, figures in paths.items()},
                          "serving": serving}, indent=2))
        return 0
    print(f"{'request':<12} {'files':>5} {'lines':>6} {'code':>6} {'ran':>6} {'functions':>9}")
    for name, figures in paths.items():
        print(f"{name:<12} {len(figures.functions):>5} {figures.lines:>6} {figures.code:>6} "
              f"{figures.ran_lines:>6} {figures.function_count:>9}")
    print(f"{'serving':<12} {serving['files']:>5} {serving['lines']:>6} {serving['code']:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
