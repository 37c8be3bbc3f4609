"""What the HTTP front door costs per request: the sidecar's door on aiohttp against a door on
llhttp alone, in user-space instructions under valgrind, for the decision to write one.

    python -m bench.front_door [--small 200] [--large 800]
    python -m bench.front_door serve --door aiohttp|llhttp     -> {"port": N} once listening

Each door answers ``POST /v1/completions`` with the same JSON bytes and does nothing else, so
the figure is the door's own work: accepting the request, reading its head and body, writing
the answer, keeping the connection alive. ``aiohttp`` is the sidecar's door as ``serve`` builds
it (``HeadTimeoutAppRunner`` with the PD routes' direct dispatch, the one body reader with its
limits, ``WholeAnswer``, the ``Server`` header dropped); ``llhttp`` is the project's lean
keep-alive server on ``httptools`` (the stub engines' transport) with what a production door
could not leave out: a task per request (the handler awaits engines), the headers as a
look-up, the body held to a cap, aiohttp's cached ``Date``, keep-alive as the client asks, pipelined
requests in order. Each door serves ``--small`` and then ``--large`` requests one at a time
from the bench's lean client (after a warm-up) under ``valgrind --tool=callgrind``; the
difference of the two totals over the difference of the counts is its cost per request,
start-up cancelling out. Compare with ``python -m bench.instructions`` (a whole JSON PD
request through the sidecar).

Deliberate limits: the llhttp door is the floor of a door, not one: no head deadline, no
refusals in the API's shape, no compressed bodies, no TLS, no other routes; what those would
add is the difference between this figure and the saving a real door would make.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from multidict import CIMultiDict

from bench import procs
from bench.instructions import instructions_of
from bench.lean_client import Client, Origin
from sidecar.http_server.aiohttp_private import HeadTimeoutAppRunner, WholeAnswer
from sidecar.http_server.app import drop_server_header
from sidecar.http_server.body import BodyLimits, BodyReader
from sidecar.loop import run_async
from sidecar.tools.stubs.lean.keepalive import JSON, Handled, Request, Server, ServerConnection

DOORS: Final = ("aiohttp", "llhttp")
PATH: Final = "/v1/completions"
#: A decode engine's JSON answer, as the sidecar relays it.
ANSWER: Final = json.dumps({
    "id": "cmpl-0", "object": "text_completion", "created": 0, "model": "tiny",
    "choices": [{"index": 0, "text": " the quick brown fox", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16},
}).encode()
REQUEST: Final = json.dumps({"model": "tiny", "prompt": "the quick brown fox jumps over",
                             "max_tokens": 8}).encode()
REQUEST_HEADERS: Final = {"Content-Type": "application/json",
                          "x-prefiller-host-port": "127.0.0.1:8100", "X-Request-Id": "bench"}
MAX_BODY: Final = 1 << 20
WARM_UP: Final = 50


@contextlib.asynccontextmanager
async def aiohttp_door() -> AsyncIterator[int]:
    """The sidecar's door on aiohttp, answering ``ANSWER``; yields its port."""
    reader = BodyReader(BodyLimits(max_bytes=MAX_BODY, timeout_s=30.0, max_inflation=100,
                                   inflating_budget=MAX_BODY), lambda _: None)

    async def handle(request: web.Request) -> web.StreamResponse:
        await reader.read(request)
        return WholeAnswer(ANSWER, CIMultiDict((("Content-Type", "application/json"),
                                                ("X-Request-Id", "bench"))))

    app = web.Application(client_max_size=MAX_BODY)
    app.on_response_prepare.append(drop_server_header)
    app.router.add_post(PATH, handle)
    runner = HeadTimeoutAppRunner(app, head_timeout_s=30.0, handler_cancellation=True,
                                  access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def llhttp_door() -> AsyncIterator[int]:
    """The floor of a door, answering ``ANSWER``: the project's lean llhttp server (the stub
    engines' transport, ``sidecar.tools.stubs.lean.keepalive``) with a task per request, a
    ``Date`` and the request id; yields its port."""
    async def answer(conn: ServerConnection) -> None:
        # aiohttp's own Date (formatted once a second), as the aiohttp door writes it.
        date = rfc822_formatted_time().encode()
        conn.send(200, ANSWER, JSON, b"x-request-id: bench\r\ndate: " + date + b"\r\n")

    def handle(request: Request, conn: ServerConnection) -> Handled:
        if request.method != b"POST" or request.path != PATH:
            conn.send(404, b'{"error":"not served here"}')
            return None
        return answer(conn)  # a coroutine, run as the request's task: a handler awaits engines

    server: Server[ServerConnection] = Server(handle, ServerConnection, max_body=MAX_BODY)
    port = await server.start("127.0.0.1", 0)
    try:
        yield port
    finally:
        await server.close()


async def serve(door: str) -> int:
    """Serve one door until SIGINT or SIGTERM (so callgrind writes its output)."""
    opened = aiohttp_door() if door == "aiohttp" else llhttp_door()
    async with opened as port:
        print(json.dumps({"port": port}), flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    return 0


async def send(port: int, n: int) -> int:
    """``n`` requests one at a time on one kept-alive connection, each checked; ``n``."""
    client = Client()
    origin = Origin("127.0.0.1", port)
    try:
        for _ in range(n):
            answer = await client.request(origin, "POST", PATH, REQUEST_HEADERS, REQUEST)
            if answer.status != 200 or answer.body != ANSWER:
                raise RuntimeError(f"the door answered {answer.status}")
    finally:
        await client.close()
    return n


def count(door: str, n: int, workdir: Path) -> int:
    """The door's instructions, under callgrind, serving ``n`` requests after the warm-up."""
    out = workdir / f"{door}-{n}.out"
    prefix = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    proc = procs.start_reporting(f"door-{door}-{n}", "front door",
                                 [*prefix, sys.executable, "-m", "bench.front_door", "serve",
                                  "--door", door], workdir, start_timeout_s=120.0)
    try:
        run_async(send(proc.port, WARM_UP))
        run_async(send(proc.port, n))
    finally:
        procs.stop(proc, timeout_s=60.0)
    return instructions_of(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front_door",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("action", nargs="?", choices=("measure", "serve"), default="measure")
    parser.add_argument("--door", choices=DOORS, default="aiohttp", help="serve: which door")
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--large", type=int, default=800)
    args = parser.parse_args(argv)
    if args.action == "serve":
        return run_async(serve(args.door))
    with tempfile.TemporaryDirectory(prefix="bench-door-") as tmp:
        figures = {}
        for door in DOORS:
            small = count(door, args.small, Path(tmp))
            large = count(door, args.large, Path(tmp))
            figures[door] = (large - small) / (args.large - args.small)
    for door, per_request in figures.items():
        print(f"front door on {door}: {per_request:,.0f} user-space instructions per request")
    print(f"aiohttp's door over llhttp's: {figures['aiohttp'] - figures['llhttp']:,.0f} "
          "per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
