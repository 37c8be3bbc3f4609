"""The lean HTTP/1.1 server (``sidecar.tools.stubs.lean.keepalive``) against raw loopback sockets.

Proves: a request is parsed whole (method, path, query, lower-cased headers, body) and
answered from the handler synchronously or from its coroutine; answers are framed exactly
(content-length, chunked, ``connection: close`` only when the request did not keep alive);
pipelined requests are answered one at a time in order, a coroutine's answer included; a
handler that raises answers 500 before its head and cuts the stream after it; malformed HTTP
answers 400 and an oversized body 413, both closing; the handler's task is cancelled when the
client goes; idle connections close after the keep-alive, and a subclass's ``on_close``
runs when they do. Does not prove speed (``bench.engine_rate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable

import pytest

from sidecar.tools.stubs.lean.keepalive import Handled, Request, Server, ServerConnection

Handler = Callable[[Request, ServerConnection], Handled]


@contextlib.asynccontextmanager
async def serving(handle: Handler, max_body: int = 1 << 20) -> AsyncIterator[int]:
    """A server answering with ``handle`` on an OS-chosen port; yields the port."""
    server = Server(handle, ServerConnection, max_body=max_body)
    port = await server.start("127.0.0.1", 0)
    try:
        yield port
    finally:
        await server.close()


async def exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


GET_CLOSE = b"GET /x HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n"


async def test_request_is_parsed_whole_and_answered_framed() -> None:
    seen: list[Request] = []

    def handle(request: Request, conn: ServerConnection) -> Handled:
        seen.append(request)
        conn.send(201, b'{"ok":1}')
        return None

    async with serving(handle) as port:
        raw = await exchange(port, b"POST /p/q?a=1&b=2 HTTP/1.1\r\nHost: h\r\nX-Thing: V\r\n"
                                     b"Content-Length: 3\r\nConnection: close\r\n\r\nabc")
    assert raw == (b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
                   b'content-length: 8\r\nconnection: close\r\n\r\n{"ok":1}')
    (request,) = seen
    assert (request.method, request.path, request.query) == (b"POST", "/p/q", "a=1&b=2")
    assert request.headers[b"x-thing"] == b"V" and request.body == b"abc"
    assert not request.keep_alive


async def test_pipelined_requests_answer_in_order_a_coroutine_included() -> None:
    def handle(request: Request, conn: ServerConnection) -> Handled:
        if request.path == "/slow":
            async def later() -> None:
                await asyncio.sleep(0)  # answered from the task, after the others were read
                conn.send(200, b"slow")
            return later()
        if request.path == "/stream":
            assert conn.begin_chunked(200, b"text/event-stream", b"x-extra: 1\r\n")
            conn.write_chunk(b"one")
            assert conn.write_chunks(iter([b"two"]))  # True: they ended, nothing paused
            conn.end_chunked()
            return None
        conn.send(200, request.path.encode())
        return None

    async with serving(handle) as port:
        raw = await exchange(port, b"GET /slow HTTP/1.1\r\nhost: h\r\n\r\n"
                                     b"GET /stream HTTP/1.1\r\nhost: h\r\n\r\n" + GET_CLOSE)
    assert raw == (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4\r\n\r\nslow"
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"x-extra: 1\r\n\r\n3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
        b"connection: close\r\n\r\n/x"
    )


async def test_a_failing_handler_answers_500_or_cuts_its_stream() -> None:
    def handle(request: Request, conn: ServerConnection) -> Handled:
        if request.path == "/sync":
            raise RuntimeError("boom")
        if request.path == "/async":
            async def fail() -> None:
                raise RuntimeError("boom")
            return fail()
        conn.begin_chunked(200, b"text/plain")
        conn.write_chunk(b"part")
        raise RuntimeError("boom mid-stream")

    async with serving(handle) as port:
        sync = await exchange(port, b"GET /sync HTTP/1.1\r\nconnection: close\r\n\r\n")
        async_ = await exchange(port, b"GET /async HTTP/1.1\r\nconnection: close\r\n\r\n")
        cut = await exchange(port, b"GET /stream HTTP/1.1\r\nhost: h\r\n\r\n")
    for raw in (sync, async_):
        assert raw.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert raw.endswith(b'{"detail":"Internal Server Error"}')
    assert cut.startswith(b"HTTP/1.1 200 OK\r\n") and cut.endswith(b"4\r\npart\r\n")
    assert b"500" not in cut


@pytest.mark.parametrize(("data", "status"), [
    (b"GARBAGE\r\n\r\n", b"400"),
    (b"POST / HTTP/1.1\r\ncontent-length: nope\r\n\r\n", b"400"),
    (b"POST / HTTP/1.1\r\ncontent-length: 11\r\n\r\nhello world", b"413"),
])
async def test_malformed_or_oversized_requests_are_refused_and_closed(
    data: bytes, status: bytes
) -> None:
    def handle(request: Request, conn: ServerConnection) -> Handled:
        conn.send(200, b"")
        return None

    async with serving(handle, max_body=10) as port:
        raw = await exchange(port, data)
    assert re.findall(rb"^HTTP/1\.1 (\d{3}) ", raw) == [status]
    assert b"connection: close\r\n" in raw


async def test_the_handlers_task_is_cancelled_when_the_client_goes() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    def handle(request: Request, conn: ServerConnection) -> Handled:
        async def wait_forever() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return wait_forever()

    async with serving(handle) as port:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
        await asyncio.wait_for(started.wait(), 10)
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 10)


class Noting(ServerConnection):
    closes = 0

    def on_close(self) -> None:
        Noting.closes += 1


async def test_idle_connections_close_after_the_keepalive_and_run_on_close() -> None:
    def handle(request: Request, conn: ServerConnection) -> Handled:
        conn.send(200, b"ok")
        return None

    closes_before = Noting.closes
    server = Server(handle, Noting, keepalive_s=0.05)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 10)  # until the sweep closes it
        writer.close()
    finally:
        await server.close()
    assert raw.endswith(b"\r\n\r\nok") and b"connection: close" not in raw
    assert Noting.closes > closes_before and server.accepted == 1 and not server.connections
