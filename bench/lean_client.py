"""The bench's lean load-generator client: ``sidecar.http1.EngineClient`` read as the bench
measures.

    client = Client()                              # one per closed-loop worker (like wrk)
    answer = await client.request(origin, "POST", "/v1/completions", headers, body,
                                  count_events=True)
    answer.status, answer.body, answer.first_byte_s, answer.events
    await client.close()

Each ``Client`` is one pool of its own (an ``EngineClient``): idle connections per origin,
another one opened only when two of its requests to one origin overlap (the concurrent flows
send prefill and decode at once, to two origins). ``count_events``: the body of an SSE stream
is not kept, its events are counted as they arrive (``EventCounter``: blank-line ends, across
read boundaries), from the read callback itself (``UpstreamResponse.pipe``: no task woken per
read); with ``time_events`` each event's arrival is stamped too (events of one read share its
stamp), and the answer carries its token events' inter-arrival gaps (the paced mode's
inter-token latency). ``first_byte_s`` is the first body bytes' arrival, as the reading task
sees it.

A connection idle longer than ``idle_s`` (below the engines' 5 s keep-alive) is not reused,
so a request never races the server's idle close.

Deliberate limits: http only (no TLS), no redirects, no proxies, no compression, no
pipelining, non-streamed bodies kept in memory; a request that fails is not retried; failures
are the upstream client's (``sidecar.http1.UpstreamError``, ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from sidecar.http1 import EngineClient

IDLE_S: Final = 4.0
#: Connections one worker may hold: it never has more than two requests in flight.
_CONNECTIONS: Final = 8


@dataclass(frozen=True, slots=True)
class Origin:
    """Where requests go: host and port, with the URL prefix prebuilt."""

    host: str
    port: int
    url: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        host = f"[{self.host}]" if ":" in self.host else self.host
        object.__setattr__(self, "url", f"http://{host}:{self.port}")

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
    """SSE events counted by every client sharing it, as they arrive (a window's tokens
    are read from it without waiting for the streams to end)."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events = 0


class _EventSink:
    """What a streamed answer's reads go to (``UpstreamResponse.pipe``): counted, stamped."""

    __slots__ = ("counter", "first_byte", "stamps", "tally")

    def __init__(self, tally: EventTally | None, time_events: bool) -> None:
        self.counter = EventCounter()
        self.tally = tally
        self.stamps: list[float] | None = [] if time_events else None
        self.first_byte = 0.0

    def __call__(self, data: bytes) -> bool:
        now = time.perf_counter()
        if not self.first_byte:
            self.first_byte = now
        counter = self.counter
        before = counter.events
        counter.feed(data)
        arrived = counter.events - before
        if arrived:
            if self.tally is not None:
                self.tally.events += arrived
            if self.stamps is not None:
                self.stamps.extend([now] * arrived)
        return True  # never full: the load generator reads as fast as bytes come

    def gaps(self) -> list[float] | None:
        if self.stamps is None:
            return None
        stamps = self.stamps[:-1]  # the last event is [DONE], not a token
        return [later - earlier for earlier, later in itertools.pairwise(stamps)]


async def _never_full() -> None:
    """``pipe``'s catch-up, which an ``_EventSink`` never asks for."""


class Client:
    """The keep-alive connections of one user of the client (a closed-loop worker); create it
    inside the running loop."""

    def __init__(
        self, *, timeout_s: float = 60.0, idle_s: float = IDLE_S, tally: EventTally | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.tally = tally
        self._http = EngineClient(
            limit=_CONNECTIONS,
            keepalive_s=idle_s,
            connect_timeout_s=timeout_s,
            read_timeout_s=None,  # the request's own deadline bounds every read
        )

    async def request(
        self,
        origin: Origin,
        method: str,
        path: str,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
        *,
        count_events: bool = False,
        time_events: bool = False,
    ) -> Answer:
        """One exchange, bounded by ``timeout_s`` as a whole; raises on a transport failure,
        the timeout or a malformed answer.

        ``time_events`` (with ``count_events``): the answer carries its tokens' gaps."""
        started = time.perf_counter()
        response = await self._http.request(
            method, origin.url + path, headers=headers or (),
            body=body if body or method == "POST" else None, timeout_s=self.timeout_s,
        )
        try:
            if count_events:
                sink = _EventSink(self.tally, time_events)
                await response.pipe(sink, _never_full)
                done = time.perf_counter()
                first = sink.first_byte or done
                return Answer(response.status, b"", first - started, done - started,
                              sink.counter.events, sink.gaps())
            parts: list[bytes] = []
            first = 0.0
            while chunk := await response.readany():
                if not first:
                    first = time.perf_counter()
                parts.append(chunk)
            done = time.perf_counter()
            return Answer(response.status, b"".join(parts), (first or done) - started,
                          done - started, 0)
        finally:
            response.release()  # a no-op after a clean end; closes a failed exchange

    async def close(self) -> None:
        await self._http.close()
        # Let the transports' close callbacks run before the loop may go away.
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)
