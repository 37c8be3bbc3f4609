"""Proves ``--client-header-timeout-s``: slow-header clients are closed and starve nobody.

- 64 clients that send part of a request head and stop take no admission slot: with
  ``--max-inflight 1`` and all 64 connected (the sidecar's own socket count shows them),
  normal requests are served one after another and ``disagg_inflight_requests`` stays 0.
  (Timeout 30 s here, so nothing depends on how fast the test runs.)
- With a 0.5 s timeout the sidecar itself closes each of 64 partial-head clients, a client
  that connects and sends nothing, and a kept-alive client that sent a whole request and
  then part of the next head; afterwards its open sockets on the HTTP port are back to the
  baseline. A kept-alive client that stays idle after a whole request is not closed by it
  (that is the keep-alive timeout's job): it went idle before the slow clients' timers were
  armed, so had it been timed it would have been closed first, and it is served again.
- The separate metrics port closes late heads the same way.

Socket counts come from psutil (this process's TCP sockets whose local port is the
sidecar's HTTP port); the waits are bounded polls of that count or reads of EOF, not sleeps.
Before this setting, aiohttp kept such connections for its keep-alive timeout (minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import psutil
from sidecar_builders import RunningSidecar, running_sidecar
from tls_builders import engine_stub

SLOW_CLIENTS = 64
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: applic"
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def server_sockets(port: int) -> int:
    """This process's TCP sockets with local port ``port``, the listener excluded."""
    return sum(1 for conn in psutil.Process().net_connections(kind="tcp")
               if conn.laddr and conn.laddr.port == port and conn.status != psutil.CONN_LISTEN)


async def wait_for_sockets(port: int, expected: int) -> None:
    """Poll the count until it equals ``expected`` (bounded: fails after 10 s)."""
    async with asyncio.timeout(10):
        while server_sockets(port) != expected:  # noqa: ASYNC110 (kernel state, no event)
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def slow_clients(port: int, count: int, head: bytes = PARTIAL_HEAD
                       ) -> AsyncIterator[list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]:
    clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]
    for _, writer in clients:
        if head:
            writer.write(head)
            await writer.drain()
    try:
        yield clients
    finally:
        for _, writer in clients:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server closed the connection (EOF or reset) without answering."""
    try:
        data = await reader.read(65536)
    except ConnectionError:
        return True
    return data == b""


async def keepalive_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """One GET /health on a kept-alive raw connection; returns the status."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: sidecar\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines
                  if line.lower().startswith("content-length:"))
    await reader.readexactly(length)
    return int(lines[0].split()[1])


async def served(sidecar: RunningSidecar) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.post(sidecar.url + "/v1/completions", json=BODY) as response:
            await response.read()
            return response.status


async def test_slow_header_clients_take_no_slot_and_starve_nobody() -> None:
    async with engine_stub(None) as engine, running_sidecar(
        engine="plain", engine_url=engine.url, max_inflight=1, client_header_timeout_s=30,
    ) as sidecar:
        port = sidecar.ports["http"]
        baseline = server_sockets(port)
        async with slow_clients(port, SLOW_CLIENTS):
            await wait_for_sockets(port, baseline + SLOW_CLIENTS)
            assert [await served(sidecar) for _ in range(8)] == [200] * 8
            assert await sidecar.metric("disagg_inflight_requests") == 0
            assert server_sockets(port) >= baseline + SLOW_CLIENTS  # all still connected
        await wait_for_sockets(port, baseline)
    assert len(engine.bodies) == 8


async def test_late_heads_are_closed_and_sockets_return_to_the_baseline() -> None:
    async with engine_stub(None) as engine, running_sidecar(
        engine="plain", engine_url=engine.url, client_header_timeout_s=0.5,
    ) as sidecar:
        port = sidecar.ports["http"]
        baseline = server_sockets(port)
        idle = await asyncio.open_connection("127.0.0.1", port)
        assert await keepalive_request(*idle) == 200  # now idle, kept alive
        kept = await asyncio.open_connection("127.0.0.1", port)
        assert await keepalive_request(*kept) == 200
        kept[1].write(PARTIAL_HEAD)  # the next request's head, never finished
        async with slow_clients(port, SLOW_CLIENTS) as partial, \
                slow_clients(port, 1, head=b"") as silent:
            async with asyncio.timeout(10):
                closed = await asyncio.gather(
                    *(closed_by_server(reader) for reader, _ in [*partial, *silent, kept]))
            assert closed == [True] * (SLOW_CLIENTS + 2)
            await wait_for_sockets(port, baseline + 1)  # only the idle kept-alive one
            assert await keepalive_request(*idle) == 200
            assert await served(sidecar) == 200
        idle[1].close()
        kept[1].close()
        await wait_for_sockets(port, baseline)


async def test_the_metrics_port_closes_late_heads_too() -> None:
    async with engine_stub(None) as engine, running_sidecar(
        engine="plain", engine_url=engine.url, client_header_timeout_s=0.5, metrics_port=0,
    ) as sidecar:
        port = sidecar.ports["metrics"]
        baseline = server_sockets(port)
        async with slow_clients(port, 4, head=b"GET /metrics HTTP/1.1\r\nHo") as partial:
            async with asyncio.timeout(10):
                closed = await asyncio.gather(*(closed_by_server(r) for r, _ in partial))
            assert closed == [True] * 4
            await wait_for_sockets(port, baseline)
