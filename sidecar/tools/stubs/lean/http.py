"""A lean HTTP/1.1 keep-alive server for the bench engine: asyncio Protocols + httptools.

    bytes ─▶ httptools.HttpRequestParser ─▶ Request ─▶ app.handle(request, conn)
                                                        ─▶ conn.send(...) | conn.send_stream(...)

A handler answers synchronously when it can (no task per request: the zero-latency fast
path) or returns a coroutine, run as a task that is cancelled when the connection goes.
One request at a time per connection: a request that arrives before the previous answer
ended waits in a queue (pipelining stays correct, not concurrent). Streams are chunked,
one ``transport.write`` per event, paused and resumed with the transport's flow control.
Idle keep-alive connections close after ``keepalive_s`` (vLLM's uvicorn: 5 s), found by one
periodic sweep rather than a timer per request.

Pacing (``Pacing``, the bench's paced mode): a stream's first ``paced`` events leave one timer
tick each, the first after ``first_s``, the next ones ``every_s`` apart on a fixed schedule
(a late tick shortens the next gap instead of shifting the schedule; one event a tick); the events
after them (usage, ``[DONE]``) follow the last paced one at once, as an engine writes them.
``send_later`` holds a whole answer back (a non-streamed answer takes its tokens' time).

Deliberate limits: HTTP/1.0 and 1.1 only, no TLS, no ``Expect: 100-continue``, no upgrade;
responses carry no Date or Server header; request bodies are kept in memory, capped (413).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final, Protocol, cast

import httptools

logger = logging.getLogger(__name__)

JSON: Final = b"application/json"
SSE: Final = b"text/event-stream"
TEXT: Final = b"text/plain; charset=utf-8"
MAX_BODY: Final = 64 * 1024 * 1024
_BAD_REQUEST: Final = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
    b'content-length: 34\r\nconnection: close\r\n\r\n{"detail":"Invalid HTTP request."}'
)
_TOO_LARGE: Final = (
    b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-type: application/json\r\n"
    b'content-length: 35\r\nconnection: close\r\n\r\n{"detail":"Request body too large."}'
)


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    return f"HTTP/1.1 {status} {reason}\r\n".encode()


_STATUS_LINES: Final = {s.value: _status_line(s.value) for s in HTTPStatus}


@dataclass(frozen=True, slots=True)
class Pacing:
    """When a stream's events leave: the first after ``first_s``, then every ``every_s``."""

    first_s: float
    every_s: float
    paced: int  # how many leading events are paced (the tokens); the rest follow the last


@dataclass(slots=True)
class Request:
    """One parsed request: header names lower-cased, the body whole."""

    method: bytes
    path: str
    query: str
    headers: dict[bytes, bytes]
    body: bytes
    keep_alive: bool


class App(Protocol):
    def handle(
        self, request: Request, conn: HttpConnection
    ) -> Coroutine[Any, Any, None] | None:
        """Answer ``request`` on ``conn`` now, or return a coroutine that will."""
        ...


class HttpConnection(asyncio.Protocol):
    """One client connection: parse, dispatch, answer, keep alive."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.idle_since = time.monotonic()
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._current: Request | None = None
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._events: Iterator[bytes] | None = None
        self._pacing: Pacing | None = None
        self._sent = 0  # events of the current stream written so far
        self._due = 0.0  # loop time the next paced event is due
        self._tick: asyncio.TimerHandle | None = None
        self._paused = False
        self._closed = False
        self._too_large = False

    # -- transport callbacks ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)
        self.server.accepted += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.server.connections.discard(self)
        self._stop_stream()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._reject(_TOO_LARGE if self._too_large else _BAD_REQUEST)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._events is not None and self._tick is None:
            self._pump()

    # -- parser callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body:
            self._too_large = True
            raise httptools.HttpParserError("body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        path, _, query = self._url.decode("latin-1").partition("?")
        request = Request(
            self.parser.get_method(),
            path,
            query,
            self._headers,
            b"".join(self._body),
            self.parser.should_keep_alive(),
        )
        if self._current is None:
            self._start(request)
        else:
            self._queue.append(request)

    # -- dispatch -----------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self._current = request
        try:
            work = self.server.app.handle(request, self)
        except Exception:
            logger.exception("handler failed")
            self._fail()
            return
        if work is not None:
            self._task = asyncio.get_running_loop().create_task(work)
            self._task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            logger.error("handler failed", exc_info=exc)
            self._fail()

    def _fail(self) -> None:
        if self._closed or self._current is None:
            return
        if self._events is not None:  # mid-stream: no second status, just end it
            self.close()
            return
        self.send(500, b'{"detail":"Internal Server Error"}')

    def _reject(self, answer: bytes) -> None:
        if self.transport is not None and not self._closed:
            self.transport.write(answer)
            self.close()

    def _finish(self) -> None:
        request = self._current
        self._current = None
        self.idle_since = time.monotonic()
        if request is None or not request.keep_alive:
            self.close()
            return
        if self._queue:
            self._start(self._queue.popleft())

    # -- answering ----------------------------------------------------------------------

    def _head(self, status: int, content_type: bytes, framing: bytes) -> bytes:
        keep = self._current is not None and self._current.keep_alive
        line = _STATUS_LINES.get(status) or _status_line(status)
        return b"".join((
            line, b"content-type: ", content_type, b"\r\n", framing,
            b"" if keep else b"connection: close\r\n", b"\r\n",
        ))

    def send(self, status: int, body: bytes, content_type: bytes = JSON) -> None:
        """Answer the current request with a whole body."""
        if self._closed or self.transport is None:
            return
        framing = b"content-length: %d\r\n" % len(body)
        self.transport.write(self._head(status, content_type, framing) + body)
        self._finish()

    def send_later(self, delay_s: float, status: int, body: bytes) -> None:
        """``send`` after ``delay_s`` (at once when it is 0): a paced non-streamed answer."""
        if delay_s <= 0:
            self.send(status, body)
            return
        self._tick = asyncio.get_running_loop().call_later(delay_s, self._send_held, status, body)

    def _send_held(self, status: int, body: bytes) -> None:
        self._tick = None
        self.send(status, body)

    def send_stream(
        self, events: Iterator[bytes], content_type: bytes = SSE, pacing: Pacing | None = None
    ) -> None:
        """Answer with a chunked body: one chunk, one write, per item of ``events``."""
        if self._closed or self.transport is None:
            return
        framing = b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n"
        self.transport.write(self._head(200, content_type, framing))
        self._events = events
        self._sent = 0
        if pacing is not None and pacing.paced > 0 and (pacing.first_s > 0 or pacing.every_s > 0):
            self._pacing = pacing
            loop = asyncio.get_running_loop()
            self._due = loop.time() + pacing.first_s
            self._tick = loop.call_at(self._due, self._on_tick)
            return
        self._pacing = None
        self._pump()

    def _on_tick(self) -> None:
        self._tick = None
        self._pump()

    def _pump(self) -> None:
        transport = self.transport
        events = self._events
        if transport is None or events is None:
            return
        pacing = self._pacing
        while not self._paused:
            event = next(events, None)
            if event is None:
                self._events = None
                self._pacing = None
                transport.write(b"0\r\n\r\n")
                self._finish()
                return
            transport.write(b"%x\r\n%s\r\n" % (len(event), event))
            self._sent += 1
            if pacing is not None and self._sent < pacing.paced:
                # The next token is due one interval after this one was; a late tick
                # sends it at once but never two in one tick.
                loop = asyncio.get_running_loop()
                self._due = max(self._due + pacing.every_s, loop.time())
                self._tick = loop.call_at(self._due, self._on_tick)
                return

    def _stop_stream(self) -> None:
        self._events = None
        self._pacing = None
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def close(self) -> None:
        self._closed = True
        self._stop_stream()
        if self.transport is not None:
            self.transport.close()

    @property
    def idle(self) -> bool:
        return self._current is None and not self._queue


class Server:
    """Listens, owns the connections, closes idle ones after ``keepalive_s``."""

    def __init__(self, app: App, *, keepalive_s: float = 5.0, max_body: int = MAX_BODY) -> None:
        self.app = app
        self.keepalive_s = keepalive_s
        self.max_body = max_body
        self.connections: set[HttpConnection] = set()
        self.accepted = 0
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: OS-chosen); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpConnection(self), host, port, backlog=1024
        )
        self._schedule_sweep()
        return int(self._server.sockets[0].getsockname()[1])

    def _schedule_sweep(self) -> None:
        interval = min(1.0, self.keepalive_s / 2)
        self._sweeper = asyncio.get_running_loop().call_later(interval, self._sweep)

    def _sweep(self) -> None:
        cutoff = time.monotonic() - self.keepalive_s
        for conn in [c for c in self.connections if c.idle and c.idle_since <= cutoff]:
            conn.close()
        self._schedule_sweep()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
