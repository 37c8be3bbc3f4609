"""One keep-alive HTTP/1.1 connection to an engine: the socket, the parser, its deadlines,
and the reader's side of its exchange.

    Connection ── bytes ─▶ httptools parser ─▶ head future, body chunks
               ── flow control; its waits bounded by ``Deadlines`` (a base class)
    UpstreamResponse ── status, headers, header(), content_length
                     ── readany() / read() / pipe(sink, catch_up) ─▶ body bytes
                     ── release() (keep the connection if clean) / close() (drop it)

Why not aiohttp's client: a PD request makes two upstream exchanges, and aiohttp's client
spends about 85 us of CPU on each (request/response objects, multidicts, URL objects, timers,
the connector's bookkeeping); here an exchange is one ``transport.write`` of preformatted
bytes and a handful of parser callbacks. The parser is llhttp (through ``httptools``), the
one uvicorn and Node use, so no HTTP parsing is written here.

Body chunks are queued as they arrive and handed out together: a reader that falls behind
(a busy loop relaying SSE) gets every queued token in one ``readany()``, one write downstream.
Reading pauses when more than ``_HIGH_WATER`` bytes wait, so a slow client cannot make the
sidecar buffer an engine's whole answer. With a sink set (``pipe()``) each read's body goes
to it from ``data_received``; a sink that refuses pauses reading until it caught up.

Deliberate limits: one exchange at a time per connection (no pipelining); no ``Expect:
100-continue``; a ``HEAD`` response closes its connection afterwards (no body framing to
trust); informational (1xx) responses are not expected from engines and are refused.

Deadlines: the read deadline is ``read_timeout_s`` after the connection's last received
bytes (as aiohttp's ``sock_read`` counts it); the whole exchange's is ``deadline`` (loop time),
from the request's start, body included. Both are served by one timer per connection,
re-armed lazily: a relayed stream waits once per chunk, and a timer created and cancelled per
wait would cost more than the wait itself. A wait past its deadline fails with the builtin
``TimeoutError``. ``Deadlines`` is a base of ``Connection`` rather than an object it holds: the
read path stamps ``_last_io`` on every read (once per token of a relayed stream), and on the
same object that stays one attribute store.

``pipe(sink, catch_up)`` is the relay's way: the body bytes of each read go to ``sink`` from
the read callback itself, with no future resolved, no task woken and no coroutine resumed per
read (at an engine's pace every token is its own read: those wake-ups were most of the
relay's cost per token). A sink that cannot take more (the client's socket is full, or it
needs an ``await``) answers False: reading pauses and ``catch_up()`` runs in the piping task
before reading resumes. Either way the connection goes back to its pool (``release``)
exactly once: when the body ended, or when the caller releases or closes the response.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import cast

import httptools

from sidecar.http1.errors import UpstreamBroken, UpstreamError, UpstreamProtocolError

#: Queued body bytes above which the socket stops being read until the reader catches up.
_HIGH_WATER = 256 * 1024


class Deadlines:
    """The deadline state and the bounded waits of one connection."""

    __slots__ = ("_deadline", "_last_io", "_loop", "_read_timeout_s", "_timed", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._read_timeout_s: float | None = None
        self._deadline: float | None = None
        self._last_io = 0.0  # loop time of the last received bytes (or of the request)
        self._timed: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def set_deadlines(self, read_timeout_s: float | None, deadline: float | None) -> None:
        """A new exchange starts now, bounded per read and (``deadline``) as a whole."""
        self._read_timeout_s = read_timeout_s
        self._deadline = deadline
        self._last_io = self._loop.time()

    async def _wait_for(self, future: asyncio.Future[None]) -> None:
        """Await ``future``, failing it with ``TimeoutError`` at the read or total deadline.

        The read deadline counts from the connection's last received bytes (as aiohttp's
        ``sock_read`` does), the total one from the request's start.
        """
        when = self._expiry()
        if when is None:
            await future
            return
        self._timed = future
        if self._timer is None:
            self._timer = self._loop.call_at(when, self._on_timer)
        try:
            await future
        finally:
            self._timed = None

    def _expiry(self) -> float | None:
        when = None if self._read_timeout_s is None else self._last_io + self._read_timeout_s
        if self._deadline is not None and (when is None or self._deadline < when):
            when = self._deadline
        return when

    def _on_timer(self) -> None:
        self._timer = None
        future = self._timed
        if future is None or future.done():
            return  # nobody waits now; the next wait arms a new timer
        when = self._expiry()
        if when is None:
            return
        if when <= self._loop.time():
            expire_future(future)
        else:
            self._timer = self._loop.call_at(when, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def expire_future(future: asyncio.Future[None]) -> None:
    """A timer's callback: end a wait with ``TimeoutError`` unless it already ended."""
    if not future.done():
        future.set_exception(TimeoutError())


class Connection(Deadlines, asyncio.Protocol):
    """The protocol object of one pooled connection; owned by the pool between exchanges."""

    __slots__ = (
        "_buffered",
        "_busy",
        "_chunks",
        "_complete",
        "_drain",
        "_error",
        "_head",
        "_head_only",
        "_headers",
        "_keep_alive",
        "_named",
        "_on_lost",
        "_parser",
        "_paused",
        "_sink",
        "_sink_full",
        "_status",
        "_until_close",
        "_waiter",
        "closed",
        "holds_slot",
        "idle_since",
        "key",
        "transport",
    )

    def __init__(
        self,
        key: tuple[str, str, int, str],
        loop: asyncio.AbstractEventLoop,
        on_lost: Callable[[Connection], None],
    ) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.holds_slot = True  # counted against the pool's limit until forgotten
        Deadlines.__init__(self, loop)
        self._on_lost = on_lost
        self._parser = httptools.HttpResponseParser(self)
        self._busy = False
        self._head_only = False
        self._head: asyncio.Future[None] | None = None
        self._status = 0
        self._headers: list[tuple[str, str]] = []
        self._named: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._complete = False
        self._keep_alive = False
        self._until_close = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        # pipe(): where each read's body goes, and whether it asked to stop for a while.
        self._sink: Callable[[bytes], bool] | None = None
        self._sink_full = False

    # ---- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._last_io = self._loop.time()
        if not self._busy:
            # Bytes nobody asked for: the connection's framing can no longer be trusted.
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("engine switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"malformed HTTP response: {exc}"))
        sink = self._sink
        if sink is not None and not self._sink_full:
            # pipe(): this read's body straight to the sink (take_body inlined: this runs
            # once per token at an engine's pace).
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()  # the same list again: no new object for the collector
                self._buffered = 0
                try:
                    taken = sink(data)
                except Exception as exc:
                    # The sink's own failure (rewriting the stream), not the engine's: raised
                    # as itself by pipe(). Escaping here it became asyncio's "fatal error"
                    # and read as "engine closed the connection".
                    self._fail(exc)
                    return
                if not taken:
                    self.sink_refused()
                elif not self._complete and self._error is None:
                    return  # all of it went to the sink: nothing to wake the piping task for
        if self._waiter is not None:
            self._wake()

    def eof_received(self) -> bool:
        return False  # let the transport close; connection_lost settles the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._busy and not self._complete:
            if self._until_close and self._head is not None and self._head.done():
                self._complete = True  # a body delimited by the connection's end
            else:
                self._fail(UpstreamBroken("engine closed the connection mid-response"))
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(UpstreamBroken("engine closed the connection"))
        self._wake()
        self._on_lost(self)

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # ---- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._headers = []
        self._named = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1")
        text = value.decode("utf-8", "surrogateescape")
        self._headers.append((key, text))
        # Each name lowered once, here: the framing check, the body's length and every
        # ``header()`` look-up read this instead of lowering every name again.
        self._named.setdefault(key.lower(), text)

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            raise UpstreamProtocolError(f"unexpected informational response {status}")
        self._status = status
        named = self._named
        self._until_close = "content-length" not in named and "transfer-encoding" not in named
        if self._head_only:
            self._complete = True
            self._keep_alive = False
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()

    # ---- the exchange --------------------------------------------------------------------

    def start(
        self, head_only: bool, read_timeout_s: float | None, deadline: float | None
    ) -> asyncio.Future[None]:
        """Prepare for a new response; returns the future resolved when its head arrives.

        ``read_timeout_s`` bounds each wait for bytes; ``deadline`` (loop time) the whole
        exchange, body included.
        """
        self._busy = True
        self._head_only = head_only
        self.set_deadlines(read_timeout_s, deadline)
        self._status = 0
        self._headers = []
        self._named = {}
        self._chunks = []
        self._buffered = 0
        self._complete = False
        self._keep_alive = False
        self._until_close = False
        self._error = None
        self._head = self._loop.create_future()
        return self._head

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark."""
        if self._drain is not None and not self._drain.done():
            await self._drain

    async def wait_head(self) -> None:
        head = self._head
        assert head is not None
        if not head.done():
            await self._wait_for(head)
        head.result()  # raises the exchange's error, if any

    def take_body(self) -> bytes:
        """Every queued body byte, as one bytes object (b"" when none is queued)."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def peek_body(self) -> bytes:
        """Every queued body byte, left queued (the next ``take_body`` returns them too)."""
        chunks = self._chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @property
    def has_body(self) -> bool:
        return bool(self._chunks)

    def set_sink(self, sink: Callable[[bytes], bool] | None) -> None:
        """Hand each read's body bytes to ``sink`` from now on (None: queue them again)."""
        self._sink = sink
        self._sink_full = False

    @property
    def sink_full(self) -> bool:
        return self._sink_full

    def sink_refused(self) -> None:
        """The sink takes no more for now: stop reading until ``sink_caught_up``."""
        self._sink_full = True
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def sink_caught_up(self) -> None:
        """The sink takes bytes again: resume reading."""
        self._sink_full = False
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    @property
    def complete(self) -> bool:
        return self._complete

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def status(self) -> int:
        return self._status

    @property
    def headers(self) -> list[tuple[str, str]]:
        return self._headers

    @property
    def named(self) -> dict[str, str]:
        """The head's headers by lowercase name, each name's first value."""
        return self._named

    async def wait_body(self) -> None:
        """Wait until body bytes, the end of the response or an error is there."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await self._wait_for(waiter)
        finally:
            self._waiter = None

    def finish(self) -> bool:
        """End the exchange; True when the connection may carry another one."""
        self._busy = False
        self._sink = None
        self._cancel_timer()
        head, self._head = self._head, None
        if head is not None and head.done() and not head.cancelled():
            head.exception()  # retrieved: an error nobody awaited is not "never retrieved"
        self.idle_since = self._loop.time()
        return (
            self._complete and self._error is None and self._keep_alive and not self.closed
            and not self._chunks
        )

    def close(self) -> None:
        """Drop the connection; a reader waiting on an unfinished response fails at once."""
        if self._busy and not self._complete and self._error is None:
            self._fail(UpstreamBroken("connection closed before the response ended"))
            return
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self._wake()

    # ---- internals -----------------------------------------------------------------------

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (
            self._chunks or self._complete or self._error is not None or self._sink_full
        ):
            waiter.set_result(None)



class UpstreamResponse:
    """A response whose head has arrived; read its body, then release or close it."""

    __slots__ = ("_conn", "_named", "_release", "content_length", "headers", "status")

    def __init__(
        self, conn: Connection, release: Callable[[Connection], None]
    ) -> None:
        self.status = conn.status
        self.headers = conn.headers
        self._named = named = conn.named
        self.content_length: int | None = None
        length = named.get("content-length")
        if length is not None:
            try:
                self.content_length = int(length)
            except ValueError:
                self.content_length = None
        self._conn: Connection | None = conn
        self._release = release

    def header(self, name: str) -> str | None:
        """The first header called ``name`` (case-insensitive), or None."""
        return self._named.get(name.lower())

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some); b"" once the body ended.

        Raises ``UpstreamBroken``/``UpstreamProtocolError`` when the connection failed and
        ``TimeoutError`` when no byte came within the read deadline.
        """
        conn = self._conn
        if conn is None:
            return b""
        while True:
            # A complete response stands even if bytes after it broke the connection (the
            # error then only keeps the connection out of the pool).
            if conn.has_body:
                data = conn.take_body()
                if conn.complete:
                    self._give_back(conn)
                return data
            if conn.complete:
                self._give_back(conn)
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait_body()

    async def peek(self) -> bytes:
        """The body bytes that have arrived (waiting for some), left for the next read;
        b"" once the body ended without any. Raises as ``readany()`` does."""
        conn = self._conn
        if conn is None:
            return b""
        while not conn.has_body:
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait_body()
        return conn.peek_body()

    async def pipe(
        self, sink: Callable[[bytes], bool], catch_up: Callable[[], Awaitable[None]]
    ) -> None:
        """Give the rest of the body to ``sink``, each read's bytes from the read callback.

        ``sink(data)`` returns False when it takes no more for now; reading then pauses until
        ``await catch_up()`` (run here, in the caller's task) returns. The first bytes are
        awaited here and given to ``sink`` from this task (what a sink needs an await for is
        usually the first bytes: a response head to send with them). Returns when the body
        ended; raises as ``readany()`` does, and whatever ``catch_up`` raises.
        """
        # The first bytes are awaited as readany() would: a sink usually needs an await for
        # them (the client's response head leaves with them), and reading need not pause.
        first = await self.readany()
        if first and not sink(first):
            await catch_up()
        conn = self._conn
        if conn is None:  # the body ended with its first bytes: readany() gave it back
            return
        conn.set_sink(sink)
        try:
            while True:
                error = conn.error
                if error is not None and not isinstance(error, UpstreamError):
                    raise error  # the sink's own failure in the read callback, as itself
                if conn.has_body:  # bytes that arrived before the sink was set
                    if not sink(conn.take_body()):
                        conn.sink_refused()
                    continue
                if conn.sink_full:
                    await catch_up()
                    conn.sink_caught_up()
                    continue
                if conn.complete:
                    break
                if conn.error is not None:
                    raise conn.error
                await conn.wait_body()
        finally:
            conn.set_sink(None)
        self._give_back(conn)

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; with ``max_bytes``, stops once more than that has arrived."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.readany():
            parts.append(chunk)
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                break
        return b"".join(parts)

    def release(self) -> None:
        """Done with this response: keep the connection when it ended cleanly, else close."""
        conn = self._conn
        if conn is not None:
            self._give_back(conn)

    def close(self) -> None:
        """Drop the connection now (the engine sees the client go away). Idempotent."""
        conn = self._conn
        if conn is not None:
            conn.close()
            self._give_back(conn)

    def _give_back(self, conn: Connection) -> None:
        self._conn = None
        self._release(conn)

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()
