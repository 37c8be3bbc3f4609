"""A lean keep-alive HTTP/1.1 server: asyncio Protocols + httptools (the stub engines' transport).

    bytes ─▶ httptools.HttpRequestParser ─▶ Request ─▶ handle(request, conn)
        ─▶ conn.send(status, body)
         | conn.begin_chunked(...), conn.write_chunk(data) | write_chunks(it)..., end_chunked()

The sidecar itself serves with aiohttp; this server is what the bench's stub engines
(``sidecar.tools.stubs.lean``) are built on, kept here so that one package owns every use of
llhttp. Its job is to cost little CPU: a handler answers synchronously when it can (no task
per request) or returns a coroutine, run as a task that is cancelled when the connection goes.
One request at a time per connection: a request that arrives before the previous answer ended
waits in a queue (pipelining stays correct, not concurrent). A chunked answer is one
``transport.write`` per chunk; ``writing_paused`` and the ``on_writable`` hook carry the
transport's flow control to whoever produces the chunks. Idle keep-alive connections close
after ``keepalive_s`` (vLLM's uvicorn: 5 s), found by one periodic sweep rather than a timer
per request.

Subclasses add answer styles (held, paced) through two hooks: ``on_writable`` (the transport
drained) and ``on_close`` (the connection is going: cancel what would still write to it).

Deliberate limits: HTTP/1.0 and 1.1 only, no TLS, no ``Expect: 100-continue``, no upgrade;
responses carry no Date or Server header; request bodies are kept in memory, capped (413).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final, Generic, TypeVar, cast

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
_SERVER_ERROR: Final = b'{"detail":"Internal Server Error"}'


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    return f"HTTP/1.1 {status} {reason}\r\n".encode()


_STATUS_LINES: Final = {s.value: _status_line(s.value) for s in HTTPStatus}


@dataclass(slots=True)
class Request:
    """One parsed request: header names lower-cased (the last of a repeated one wins), the
    body whole."""

    method: bytes
    path: str
    query: str
    headers: dict[bytes, bytes]
    body: bytes
    keep_alive: bool


#: What a handler returns: None when it answered (or will from a callback), else a coroutine
#: that will answer (run as the connection's task).
Handled = Coroutine[Any, Any, None] | None
C = TypeVar("C", bound="ServerConnection")


class ServerConnection(asyncio.Protocol):
    """One client connection: parse, dispatch, answer, keep alive."""

    def __init__(self, server: Server[Any]) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.idle_since = time.monotonic()
        #: True while the transport's write buffer is over its high-water mark.
        self.writing_paused = False
        self.closed = False
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._current: Request | None = None
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._chunked = False  # a chunked answer's head is out, its end is not
        self._too_large = False

    # -- hooks for answer styles ----------------------------------------------------------

    def on_writable(self) -> None:
        """The transport's buffer drained: a paused producer of chunks may go on."""

    def on_close(self) -> None:
        """The connection is closing: cancel whatever would still write to it."""

    # -- transport callbacks ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)
        self.server.accepted += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.on_close()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._reject(_TOO_LARGE if self._too_large else _BAD_REQUEST)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self.on_writable()

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
            work = self.server.handle(request, self)
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
        if self.closed or self._current is None:
            return
        if self._chunked:  # mid-stream: no second status, just end it
            self.close()
            return
        self.send(500, _SERVER_ERROR)

    def _reject(self, answer: bytes) -> None:
        if self.transport is not None and not self.closed:
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

    def send(self, status: int, body: bytes, content_type: bytes = JSON,
             headers: bytes = b"") -> None:
        """Answer the current request with a whole body, in one write (``headers``: extra
        lines, each ending in CRLF)."""
        if self.closed or self.transport is None:
            return
        framing = b"content-length: %d\r\n" % len(body) + headers
        self.transport.write(self._head(status, content_type, framing) + body)
        self._finish()

    def begin_chunked(self, status: int, content_type: bytes, headers: bytes = b"") -> bool:
        """Write a chunked answer's head (``headers``: extra lines, each ending in CRLF);
        False when the connection is gone (nothing to stream to)."""
        if self.closed or self.transport is None:
            return False
        framing = b"transfer-encoding: chunked\r\n" + headers
        self.transport.write(self._head(status, content_type, framing))
        self._chunked = True
        return True

    def send_chunked(self, status: int, content_type: bytes, headers: bytes,
                     chunks: Iterator[bytes]) -> None:
        """A whole chunked answer, head, chunks and end, in one write."""
        if self.closed or self.transport is None:
            return
        framing = b"transfer-encoding: chunked\r\n" + headers
        parts = [self._head(status, content_type, framing)]
        parts.extend(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
        parts.append(b"0\r\n\r\n")
        self.transport.write(b"".join(parts))
        self._finish()

    def write_chunk(self, data: bytes) -> None:
        """One non-empty chunk of the current answer, one write."""
        if self.transport is not None and not self.closed:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def write_chunks(self, chunks: Iterator[bytes]) -> bool:
        """Non-empty chunks, one write each, while the transport takes them: True once
        ``chunks`` ended, False when the transport asked to pause first (go on from
        ``on_writable``) or the connection is gone. One loop here rather than a call per
        chunk: a burst of tokens is the stubs' most frequent write."""
        transport = self.transport
        if transport is None or self.closed:
            return False
        while not self.writing_paused:
            chunk = next(chunks, None)
            if chunk is None:
                return True
            transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        return False

    def end_chunked(self) -> None:
        """The last chunk: the answer is complete (the next queued request starts)."""
        self._chunked = False
        if self.transport is not None and not self.closed:
            self.transport.write(b"0\r\n\r\n")
            self._finish()

    def close(self) -> None:
        self.closed = True
        self.on_close()
        if self.transport is not None:
            self.transport.close()

    @property
    def idle(self) -> bool:
        return self._current is None and not self._queue


class Server(Generic[C]):
    """Listens, owns the connections, closes idle ones after ``keepalive_s``.

    ``handle(request, conn)`` answers each request on its connection, a ``connection``
    (``ServerConnection`` or a subclass with answer styles of its own)."""

    def __init__(
        self,
        handle: Callable[[Request, C], Handled],
        connection: Callable[[Server[C]], C],
        *,
        keepalive_s: float = 5.0,
        max_body: int = MAX_BODY,
    ) -> None:
        self.handle = handle
        self.keepalive_s = keepalive_s
        self.max_body = max_body
        self.connections: set[ServerConnection] = set()
        self.accepted = 0
        self._connection = connection
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: OS-chosen); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: self._connection(self), host, port, backlog=1024
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
