"""Tools for the SSRF tests: a trap listener that counts connections, a redirecting engine,
and a resolver patch for host names that resolve to chosen addresses.

    async with trap("127.0.0.1") as t:          # listens on an OS-chosen port
        ... send a request naming t.port ...
        await t.assert_untouched()               # nobody but our own marker connected

``assert_untouched`` is deterministic, with no waiting for time: it opens one marker
connection of its own and waits until the trap has accepted it. A listening socket accepts
in arrival order, so any connection the sidecar had made before the reply came back would
have been accepted first.

Deliberate limits: loopback only (127.0.0.0/8 and ::1); the resolver patch covers names
under ``.ssrf.test`` and passes every other name to the real resolver.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TEST_DOMAIN = ".ssrf.test"


@dataclass
class Trap:
    host: str
    port: int = 0
    peers: list[Any] = field(default_factory=list)
    received: int = 0
    _accepted: asyncio.Event = field(default_factory=asyncio.Event)

    async def _on_connect(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        self.peers.append(writer.get_extra_info("peername"))
        self._accepted.set()
        with contextlib.suppress(ConnectionError):
            data = await reader.read(65536)
            self.received += len(data)
        writer.close()

    async def assert_untouched(self) -> None:
        """No connection (and so no byte) reached the trap before this call."""
        before = len(self.peers)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        _, writer = await asyncio.open_connection(self.host, self.port, family=family)
        try:
            async with asyncio.timeout(10):
                while len(self.peers) == before:
                    self._accepted.clear()
                    await self._accepted.wait()
        finally:
            writer.close()
        assert before == 0, f"the trap was reached by {self.peers[:before]}"
        assert self.received == 0


@contextlib.asynccontextmanager
async def trap(host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[Trap]:
    t = Trap(host, port)
    server = await asyncio.start_server(t._on_connect, host, port)
    t.port = int(server.sockets[0].getsockname()[1])
    try:
        yield t
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def redirecting_engine(location: str) -> AsyncIterator[int]:
    """An 'engine' on 127.0.0.1 answering every request with 307 to ``location``, but
    ``GET /v1/models``: it serves stub-model (so a sidecar pairs with it, and its legs meet
    the redirect)."""

    async def redirect(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=307, headers={"Location": location})

    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [
            {"id": "stub-model", "object": "model", "root": "stub-model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/{tail:.*}", redirect)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


Answer = Callable[[int], list[str]]


@contextlib.asynccontextmanager
async def fake_names(answers: dict[str, Answer]) -> AsyncIterator[dict[str, int]]:
    """Make the running loop resolve ``name`` to ``answers[name](call_number)``.

    Yields a dict counting resolutions per name (call numbers start at 0).
    """
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo
    calls: dict[str, int] = {}

    async def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and name.endswith(TEST_DOMAIN):
            if name not in answers:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            n = calls.get(name, 0)
            calls[name] = n + 1
            out = []
            for address in answers[name](n):
                if ":" in address:
                    out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "",
                                (address, int(port), 0, 0)))
                else:
                    out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port))))
            return out
        return await real(host, port, *args, **kwargs)

    loop.getaddrinfo = getaddrinfo  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        loop.getaddrinfo = real  # type: ignore[method-assign]
