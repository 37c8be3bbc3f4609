"""Proves every use of aiohttp's private surface (``sidecar.http_server.aiohttp_private``)
against the installed aiohttp, one test per touch, on real loopback sockets:

1. ``RequestHandler._request_count`` counts parsed heads and ``_waiter`` is unset while a
   request is handled (the head deadline's two reads);
2. ``AppRunner._make_server`` builds a ``web.Server`` whose ``_kwargs`` carry the
   application's handler arguments and whose ``_loop`` is the running loop; the re-classed
   server builds the head-timing handler with them;
3. ``_send_headers_immediately = False`` keeps a prepared stream's head back until its first
   chunk (and a plain ``StreamResponse`` does send it at once: the check can fail);
4. bytes written straight onto the client's transport between aiohttp's own writes are framed
   as aiohttp frames them: one valid chunked body for HTTP/1.1, the bare bytes for HTTP/1.0;
   and the writer's ``drain`` is there to wait on;
5. aiohttp answers a request it cannot parse through ``RequestHandler.handle_error`` (status,
   exception) and logs a broken body's lingering read through ``log_exception(...,
   exc_info=exc)``; a plain runner answers text/plain (the check can fail);
6. a bad chunk size after a body's first chunk is queued as the next message
   (``_request_count`` grows) while ``_current_request`` still reads its body: plain aiohttp
   leaves that read waiting, the runner's handler fails it;
7. ``web.Server.request_handler`` is what each connection's handler calls: wrapped, it sees
   ``CONNECT`` and ``OPTIONS *`` before routing; and the application's plain-path POST
   routes reach their handlers without the router's resolve, with the same ``request.app``,
   match info and response signals (``UrlMappingMatchInfo``, ``request._match_info``);
8. a ``WholeAnswer`` puts on the wire the bytes ``web.Response`` puts there for the same
   status, headers and body (``_serialize_headers``, ``rfc822_formatted_time``,
   ``SERVER_SOFTWARE``, ``request._prepare_hook``, the keep-alive rule), HTTP/1.0 and 1.1,
   kept alive or closed; the connection then serves its next request (``_eof_sent``,
   ``keep_alive``), and a client already gone is a reset, not an error
   (``ClientConnectionResetError``).

When one fails after an aiohttp upgrade, the module docstring of ``aiohttp_private`` says
what relies on it; pyproject.toml pins the minor versions these tests passed on.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from multidict import CIMultiDict

from sidecar.http_server.aiohttp_private import (
    ClientSocket,
    HeadTimeoutAppRunner,
    StreamWithHead,
    WholeAnswer,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(handler: Handler, runner_class: type[web.AppRunner] = web.AppRunner,
                 **options: object) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/", handler)
    runner = runner_class(app, handler_cancellation=True, **options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(address[1] for address in runner.addresses if isinstance(address, tuple))
    return runner, port


@pytest.fixture
async def raw_socket() -> AsyncIterator[Callable[[int], socket.socket]]:
    opened: list[socket.socket] = []

    def connect(port: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port))
        opened.append(sock)
        return sock

    yield connect
    for sock in opened:
        sock.close()


async def _recv_until(sock: socket.socket, end: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    data = b""
    while end not in data:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            break
        data += chunk
    return data


async def test_request_count_and_waiter_as_the_head_deadline_reads_them() -> None:
    seen: list[tuple[int, object]] = []

    async def handler(request: web.Request) -> web.Response:
        protocol = request.protocol
        assert isinstance(protocol, RequestHandler)
        seen.append((protocol._request_count, protocol._waiter))
        return web.Response(text="ok")

    runner, port = await _serve(handler)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(2):  # one kept-alive connection, two heads
                async with session.get(f"http://127.0.0.1:{port}/") as response:
                    assert await response.text() == "ok"
    finally:
        await runner.cleanup()
    assert seen == [(1, None), (2, None)]


async def test_make_server_kwargs_and_loop_rebuild_the_handler() -> None:
    app = web.Application()
    plain = web.AppRunner(app, handler_cancellation=True, access_log=None)
    server = await plain._make_server()
    assert isinstance(server, web.Server)
    assert server._kwargs["access_log"] is None
    assert server._loop is asyncio.get_running_loop()
    assert type(server()) is RequestHandler
    timed = HeadTimeoutAppRunner(app, head_timeout_s=5.0, access_log=None)
    timed_server = await timed._make_server()
    handler = timed_server()
    assert type(handler).__name__ == "_HeadTimeoutHandler"
    assert isinstance(handler, RequestHandler)


@pytest.mark.parametrize(("response_class", "head_waits"), [(StreamWithHead, True),
                                                           (web.StreamResponse, False)])
async def test_a_stream_head_waits_for_its_first_chunk(
    raw_socket: Callable[[int], socket.socket], response_class: type[web.StreamResponse],
    head_waits: bool,
) -> None:
    prepared = asyncio.Event()
    checked = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = response_class(status=200)
        await response.prepare(request)
        prepared.set()
        await checked.wait()
        await response.write(b"first")
        await response.write_eof()
        return response

    runner, port = await _serve(handler)
    try:
        sock = raw_socket(port)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await prepared.wait()
        # A head written at prepare() is in this socket's receive queue by now (loopback
        # delivers on send); one held back is not.
        sock.setblocking(False)
        try:
            early = sock.recv(65536)
        except BlockingIOError:
            early = b""
        checked.set()
        rest = await _recv_until(sock, b"0\r\n\r\n")
    finally:
        await runner.cleanup()
    assert (early == b"") is head_waits
    assert b"HTTP/1.1 200" in early + rest and (early + rest).endswith(b"0\r\n\r\n")


async def _relay_three(request: web.Request) -> web.StreamResponse:
    response = StreamWithHead(status=200, headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b"data: one\n\n")  # the head leaves with it
    client = ClientSocket(request, response)
    assert client.send(b"data: two\n\n") is True
    await client.drain()
    await response.write(b"data: three\n\n")
    await response.write_eof()
    return response


async def test_bytes_on_the_transport_are_framed_as_aiohttp_frames_them() -> None:
    runner, port = await _serve(_relay_three)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/") as response:
                assert response.headers["Transfer-Encoding"] == "chunked"
                body = await response.read()
    finally:
        await runner.cleanup()
    assert body == b"data: one\n\ndata: two\n\ndata: three\n\n"


async def test_an_http10_client_gets_the_bare_bytes(
    raw_socket: Callable[[int], socket.socket],
) -> None:
    runner, port = await _serve(_relay_three)
    try:
        sock = raw_socket(port)
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        raw = await _recv_until(sock, b"three\n\n")
    finally:
        await runner.cleanup()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head
    assert body == b"data: one\n\ndata: two\n\ndata: three\n\n"


async def _exchange(port: int, data: bytes, *, between: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if between:
            await asyncio.sleep(0)  # the first part is its own read on the server
            writer.write(between)
            await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.mark.parametrize("runner_class", [HeadTimeoutAppRunner, web.AppRunner])
async def test_parse_errors_reach_handle_error_and_are_json_with_the_runner(
        runner_class: type[web.AppRunner]) -> None:
    options: dict[str, object] = ({"head_timeout_s": None}
                                  if runner_class is HeadTimeoutAppRunner else {})
    runner, port = await _serve(_ok, runner_class, **options)
    try:
        raw = await _exchange(port, b"GET / HTTP/1.1\nHost: x\n\n")
    finally:
        await runner.cleanup()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split()[1] == b"400"
    json_answer = b"application/json" in head
    assert json_answer is (runner_class is HeadTimeoutAppRunner), raw
    if json_answer:
        assert b'"code":"invalid_request"' in body and b"GET /" not in body


async def test_a_bad_chunk_size_fails_the_body_read_only_with_the_runner() -> None:
    outcomes: list[str] = []

    async def read_body(request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(2):
                await request.read()
            outcomes.append("read")
        except TimeoutError:
            outcomes.append("waiting")
        except web.RequestPayloadError:
            outcomes.append("failed")
        return web.Response(text="done")

    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    for runner_class, options in ((HeadTimeoutAppRunner, {"head_timeout_s": None}),
                                  (web.AppRunner, {})):
        app = web.Application()
        app.router.add_post("/", read_body)
        runner = runner_class(app, handler_cancellation=True, **options)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            await writer.drain()
            assert runner.server is not None
            # The handler reads the body: no event tells it, only the handler's request.
            while not any(handler._current_request is not None  # noqa: ASYNC110
                          for handler in runner.server.connections):
                await asyncio.sleep(0.01)
            writer.write(b"zz\r\n")
            await writer.drain()
            expected = len(outcomes) + 1
            # Plain aiohttp answers only after its lingering read (10 s): wait for the handler.
            async with asyncio.timeout(5):
                while len(outcomes) < expected:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            writer.close()
        finally:
            await runner.cleanup()
    assert outcomes == ["failed", "waiting"]


async def test_the_wrapped_request_handler_sees_connect_and_asterisk_first() -> None:
    runner, port = await _serve(_ok, HeadTimeoutAppRunner, head_timeout_s=None)
    try:
        assert runner.server is not None
        assert runner.server.request_handler.__name__ == "serve"
        for line in (b"CONNECT example.com:443 HTTP/1.1", b"OPTIONS * HTTP/1.1"):
            raw = await _exchange(port, line + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert raw.split()[1] == b"400" and b'"code":"invalid_request"' in raw, raw
        raw = await _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert raw.endswith(b"ok")
    finally:
        await runner.cleanup()


async def test_plain_post_routes_skip_the_router_with_the_same_request() -> None:
    """Touch 1 (direct dispatch): a plain-path POST reaches its handler without the router's
    resolve, with the ``request.app``, ``match_info.route`` and ``on_response_prepare``
    signals the router would have given it; a query, another method, an ``Expect`` header
    go through the router (the counts can fail: the plain runner resolves every request)."""
    key = web.AppKey("key", str)
    seen: list[tuple[str, str | None]] = []

    async def post(request: web.Request) -> web.Response:
        seen.append((request.app[key], request.match_info.route.resource.canonical
                     if request.match_info.route.resource else None))
        return web.Response(text="posted")

    async def mark(_: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-signal"] = "1"

    for runner_class, resolved_posts in ((HeadTimeoutAppRunner, 2), (web.AppRunner, 4)):
        app = web.Application()
        app[key] = "app"
        app.router.add_post("/p", post)
        app.router.add_get("/p", _ok)
        app.on_response_prepare.append(mark)
        resolves: list[str] = []
        resolve = app.router.resolve

        async def counting(request: web.Request, resolve: Any = resolve,
                           resolves: list[str] = resolves) -> Any:
            resolves.append(request.method)
            return await resolve(request)

        app.router.resolve = counting  # type: ignore[method-assign]
        options: dict[str, object] = ({"head_timeout_s": None}
                                      if runner_class is HeadTimeoutAppRunner else {})
        runner = runner_class(app, handler_cancellation=True, **options)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        try:
            close = b"Host: x\r\nConnection: close\r\nContent-Length: 2\r\n"
            for head in (b"POST /p HTTP/1.1\r\n" + close,
                         b"POST /p HTTP/1.1\r\n" + close,
                         b"POST /p?q=1 HTTP/1.1\r\n" + close,
                         b"POST /p HTTP/1.1\r\nExpect: 100-continue\r\n" + close):
                raw = await _exchange(port, head + b"\r\n{}")
                assert raw.endswith(b"posted") and b"x-signal: 1" in raw.lower(), raw
            raw = await _exchange(port, b"GET /p HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert raw.endswith(b"ok")
        finally:
            await runner.cleanup()
        assert resolves == ["POST"] * resolved_posts + ["GET"], runner_class
    assert seen == [("app", "/p")] * 8


_WHOLE_CASES = {
    # name: (status, headers, body)
    "json": (200, (("Content-Type", "application/json"), ("Cache-Control", "no-cache"),
                   ("x-request-id", "r-1")), b'{"id":"cmpl-1","choices":[]}'),
    "no-type": (200, (("x-request-id", "r-2"),), b"raw"),
    "error": (503, (("x-request-id", "r-3"), ("Retry-After", "1"),
                    ("Content-Type", "application/json")), b'{"error":{}}'),
    "large": (200, (("Content-Type", "application/json"),), b"x" * 70_000),
}


def _whole_app() -> web.Application:
    """``/plain/NAME`` answers with ``web.Response``, ``/whole/NAME`` with ``WholeAnswer``;
    a signal adds a header and takes aiohttp's ``Server`` out, as the sidecar's do."""

    async def answer(request: web.Request) -> web.StreamResponse:
        status, headers, body = _WHOLE_CASES[request.match_info["case"]]
        if request.match_info["how"] == "plain":
            return web.Response(status=status, headers=headers, body=body)
        return WholeAnswer(body, CIMultiDict(headers), status)

    async def mark(_: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-signal"] = "1"
        response.headers.popall("Server", None)

    app = web.Application()
    app.router.add_post("/{how}/{case}", answer)
    app.on_response_prepare.append(mark)
    return app


def _dated(raw: bytes) -> bytes:
    """``raw`` with every answer's Date value blanked (the plain and the whole answers may
    straddle a second; a kept-alive exchange holds two heads, and the second's Date once
    did, 2026-12-07)."""
    return re.sub(rb"\r\nDate: [^\r]*", b"\r\nDate: -", raw)


async def _exchange_whole(port: int, request: bytes, answers: int) -> bytes:
    """Send ``request``, read until ``answers`` complete answers came (or the close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        data = b""
        for _ in range(answers):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            data += head + await asyncio.wait_for(reader.readexactly(length), 5)
        return data
    finally:
        writer.close()


@pytest.mark.parametrize("case", sorted(_WHOLE_CASES))
@pytest.mark.parametrize("version, connection", [
    ("1.1", ""), ("1.1", "Connection: close\r\n"),
    ("1.0", ""), ("1.0", "Connection: keep-alive\r\n"),
])
async def test_a_whole_answer_is_the_bytes_of_a_response(
        case: str, version: str, connection: str) -> None:
    """Touch 4: the same bytes as ``web.Response`` (the check can fail: a header out of order,
    a missing ``Connection`` or ``Server`` rule shows), and a kept-alive connection answers
    a second request after it."""
    runner = web.AppRunner(_whole_app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
    try:
        answers: dict[str, bytes] = {}
        for how in ("plain", "whole"):
            head = (f"POST /{how}/{case} HTTP/{version}\r\nHost: x\r\n{connection}"
                    "Content-Length: 2\r\n\r\n{}").encode()
            kept = (version == "1.1" and not connection) or "keep-alive" in connection
            raw = await _exchange_whole(port, head * 2 if kept else head, 2 if kept else 1)
            answers[how] = _dated(raw)
    finally:
        await runner.cleanup()
    assert answers["whole"] == answers["plain"]
    assert b"x-signal: 1" in answers["whole"] and b"Server:" not in answers["whole"]


async def test_a_whole_answer_to_a_client_gone_is_a_reset(
        caplog: pytest.LogCaptureFixture) -> None:
    """Touch 4: the transport closed before the answer: ``prepare`` raises
    ``ClientConnectionResetError``, which aiohttp takes as the client's disconnection (no
    ``Error handling request`` line); the answer's bytes are never written."""
    prepared: list[BaseException] = []

    class Noted(WholeAnswer):
        async def prepare(self, request: web.BaseRequest) -> None:
            try:
                await super().prepare(request)
            except ConnectionError as exc:
                prepared.append(exc)
                raise

    async def gone(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        return Noted(b"{}", CIMultiDict())

    app = web.Application()
    app.router.add_post("/", gone)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
    try:
        raw = await _exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    finally:
        await runner.cleanup()
    assert raw == b""
    assert [type(exc) for exc in prepared] == [aiohttp.ClientConnectionResetError]
    assert "Error handling request" not in caplog.text
