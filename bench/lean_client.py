"""A minimal keep-alive HTTP/1.1 client for the bench: asyncio Protocols + httptools.

    client = Client()                              # one per closed-loop worker (like wrk)
    answer = await client.request(origin, b"POST", "/v1/completions", headers, body,
                                  count_events=True)
    answer.status, answer.body, answer.first_byte_s, answer.events
    await client.close()

Each ``Client`` keeps its own idle connections per origin and opens another only when two of
its requests to one origin overlap (the concurrent flows send prefill and decode at once, to
two origins). ``count_events``: the body of an SSE stream is not kept, its events are counted
as they arrive (``EventCounter``: blank-line ends, across read boundaries); with
``time_events`` each event's arrival is stamped too (events of one read share its stamp), and
the answer carries its token events' inter-arrival gaps (the paced mode's inter-token latency).

A connection idle longer than ``idle_s`` (below the engines' 5 s keep-alive) is not reused,
so a request never races the server's idle close.

Deliberate limits: http only (no TLS), no redirects, no proxies, no compression, no
pipelining, response bodies kept in memory; a request that fails is not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, cast

import httptools

IDLE_S: Final = 4.0


@dataclass(frozen=True, slots=True)
class Origin:
    """Where requests go: host and port, with the Host header prebuilt."""

    host: str
    port: int
    host_header: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        host = f"[{self.host}]" if ":" in self.host else self.host
        object.__setattr__(self, "host_header", f"host: {host}:{self.port}\r\n".encode())

    @classmethod
    def of_url(cls, url: str) -> Origin:
        """``http://host:port`` (a path after it is ignored)."""
        rest = url.split("://", 1)[-1].split("/", 1)[0]
        host, _, port = rest.rpartition(":")
        return cls(host.strip("[]"), int(port))


@dataclass(slots=True)
class Answer:
    status: int
    body: bytes
    first_byte_s: float
    latency_s: float
    events: int
    # Gaps between consecutive token events' arrivals (seconds; the final ``[DONE]`` event
    # excluded); only when the request asked for ``time_events``.
    gaps: list[float] | None = None


class EventCounter:
    """Counts SSE events (each ends with a blank line, ``\\n\\n``) fed in arbitrary pieces."""

    __slots__ = ("_carry", "events")

    def __init__(self) -> None:
        self.events = 0
        self._carry = False  # the stream so far ends with one unpaired "\n"

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self._carry and chunk[0] == 10:
            self.events += 1
            chunk = chunk[1:]
            self._carry = False
            if not chunk:
                return
        self.events += chunk.count(b"\n\n")
        # An odd run of trailing newlines leaves one waiting for its partner.
        run = 0
        for byte in reversed(chunk):
            if byte != 10:
                break
            run += 1
        self._carry = run % 2 == 1


class EventTally:
    """SSE events counted by every connection sharing it, as they arrive (a window's tokens
    are read from it without waiting for the streams to end)."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events = 0


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request in flight at a time."""

    def __init__(self, tally: EventTally | None = None) -> None:
        self.tally = tally
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.last_used = time.monotonic()
        self._waiter: asyncio.Future[None] | None = None
        self._body: list[bytes] = []
        self._counter: EventCounter | None = None
        self._stamps: list[float] | None = None
        self._started = 0.0
        self.first_byte = 0.0
        self.status = 0
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake(exc or ConnectionResetError("connection closed before the answer ended"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._wake(ValueError(f"malformed HTTP answer: {exc}"))
            self.abort()

    # parser callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.first_byte:
            self.first_byte = time.perf_counter()
        counter = self._counter
        if counter is not None:
            before = counter.events
            counter.feed(body)
            arrived = counter.events - before
            if arrived:
                if self.tally is not None:
                    self.tally.events += arrived
                if self._stamps is not None:
                    self._stamps.extend([time.perf_counter()] * arrived)
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = bool(self.parser.should_keep_alive())
        self._wake(None)

    def _wake(self, exc: BaseException | None) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    async def exchange(
        self, data: bytes, count_events: bool, timeout_s: float, time_events: bool = False
    ) -> Answer:
        transport = self.transport
        if transport is None or self.closed:
            raise ConnectionResetError("connection closed")
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        self._body = []
        self._counter = EventCounter() if count_events else None
        self._stamps = [] if count_events and time_events else None
        self.first_byte = 0.0
        self.status = 0
        started = time.perf_counter()
        transport.write(data)
        timer = loop.call_later(timeout_s, self._timed_out)
        try:
            await waiter
        finally:
            timer.cancel()
        done = time.perf_counter()
        self.last_used = time.monotonic()
        first = (self.first_byte or done) - started
        events = self._counter.events if self._counter is not None else 0
        gaps = None
        if self._stamps is not None:
            stamps = self._stamps[:-1]  # the last event is [DONE], not a token
            gaps = [later - earlier for earlier, later in itertools.pairwise(stamps)]
        return Answer(self.status, b"".join(self._body), first, done - started, events, gaps)

    def _timed_out(self) -> None:
        self._wake(TimeoutError("no complete answer in time"))
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Client:
    """Keep-alive connections of one user of the client (a closed-loop worker)."""

    def __init__(
        self, *, timeout_s: float = 60.0, idle_s: float = IDLE_S, tally: EventTally | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.tally = tally
        self.idle_s = idle_s
        self.connects = 0
        self._idle: dict[Origin, list[_Connection]] = {}
        self._all: set[_Connection] = set()

    async def _take(self, origin: Origin) -> _Connection:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.last_used < self.idle_s:
                return conn
            self._drop(conn)
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: _Connection(self.tally), origin.host, origin.port),
            self.timeout_s,
        )
        self.connects += 1
        self._all.add(conn)
        return conn

    def _drop(self, conn: _Connection) -> None:
        conn.abort()
        self._all.discard(conn)

    async def request(
        self,
        origin: Origin,
        method: bytes,
        path: str,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
        *,
        count_events: bool = False,
        time_events: bool = False,
    ) -> Answer:
        """One exchange; raises on a transport failure, a timeout or a malformed answer.

        ``time_events`` (with ``count_events``): the answer carries its tokens' gaps."""
        head = [method, b" ", path.encode(), b" HTTP/1.1\r\n", origin.host_header]
        if headers:
            for name, value in headers.items():
                head.append(f"{name}: {value}\r\n".encode())
        if body or method == b"POST":
            head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"\r\n")
        head.append(body)
        conn = await self._take(origin)
        try:
            answer = await conn.exchange(
                b"".join(head), count_events, self.timeout_s, time_events
            )
        except BaseException:
            self._drop(conn)
            raise
        if conn.keep_alive and not conn.closed:
            self._idle.setdefault(origin, []).append(conn)
        else:
            self._drop(conn)
        return answer

    async def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._all.clear()
        self._idle.clear()
        # Let the transports' close callbacks run before the loop may go away.
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)
