"""One keep-alive HTTP/1.1 connection to an engine: the socket, the parser and the exchange.

    Connection ── bytes ─▶ httptools parser ─▶ head future, body chunks
               ── flow control; its waits bounded by ``deadlines.Deadlines`` (a base class)

The reader's side of an exchange is ``response.UpstreamResponse``, on the state kept here.

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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import httptools

from sidecar.http1.deadlines import Deadlines
from sidecar.http1.errors import UpstreamBroken, UpstreamProtocolError

#: Queued body bytes above which the socket stops being read until the reader catches up.
_HIGH_WATER = 256 * 1024


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

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append(
            (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            raise UpstreamProtocolError(f"unexpected informational response {status}")
        self._status = status
        until_close = True
        for name, _ in self._headers:  # a loop, not any(): no generator per response
            if name.lower() in ("content-length", "transfer-encoding"):
                until_close = False
                break
        self._until_close = until_close
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
