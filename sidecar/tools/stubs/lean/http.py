"""The lean stubs' answer styles on ``lean.keepalive``: held answers and paced streams.

    HttpConnection(lean.keepalive.ServerConnection)
        send(status, body)                     a whole answer at once (the server's)
        send_later(delay_s, status, body)      the same after ``delay_s``
        send_stream(events, pacing=None)       chunked, one chunk and one write per event
        send_stream_whole(events)              chunked, every event in one write

The HTTP/1.1 server itself (parsing, keep-alive, pipelined requests in order, the idle close,
400/413) is ``lean.keepalive``; this module adds how an engine's answers are timed.
A stream's events are written as fast as the transport takes them (paused and resumed with
its flow control), unless paced.

Pacing (``Pacing``, the bench's paced mode): a stream's first ``paced`` events leave one timer
tick each, the first after ``first_s``, the next ones ``every_s`` apart on a fixed schedule
(a late tick shortens the next gap instead of shifting the schedule; one event a tick); the events
after them (usage, ``[DONE]``) follow the last paced one at once, as an engine writes them.
``send_later`` holds a whole answer back (a non-streamed answer takes its tokens' time).
No task per stream: the timers call back into the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from sidecar.tools.stubs.lean.keepalive import SSE, Server, ServerConnection

_STREAM_HEADERS: Final = b"cache-control: no-cache\r\n"


@dataclass(frozen=True, slots=True)
class Pacing:
    """When a stream's events leave: the first after ``first_s``, then every ``every_s``."""

    first_s: float
    every_s: float
    paced: int  # how many leading events are paced (the tokens); the rest follow the last


class HttpConnection(ServerConnection):
    """One client connection of a lean stub, with its engine-like answer timing."""

    def __init__(self, server: Server[Any]) -> None:
        super().__init__(server)
        self._events: Iterator[bytes] | None = None
        self._pacing: Pacing | None = None
        self._sent = 0  # events of the current stream written so far
        self._due = 0.0  # loop time the next paced event is due
        self._tick: asyncio.TimerHandle | None = None

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
        if not self.begin_chunked(200, content_type, _STREAM_HEADERS):
            return
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

    def send_stream_whole(self, events: Iterator[bytes], content_type: bytes = SSE) -> None:
        """Answer with a chunked body written whole: one write for all of ``events``."""
        self.send_chunked(200, content_type, _STREAM_HEADERS, events)

    def _on_tick(self) -> None:
        self._tick = None
        self._pump()

    def _pump(self) -> None:
        events = self._events
        if events is None or self.closed:
            return
        pacing = self._pacing
        while pacing is not None and self._sent < pacing.paced:
            # A paced token: one a tick; the next is due one interval after this one was,
            # so a late tick sends it at once but never two in one tick.
            if self.writing_paused:
                return  # on_writable goes on
            event = next(events, None)
            if event is None:
                self._end_stream()
                return
            self.write_chunk(event)
            self._sent += 1
            if self._sent < pacing.paced:
                loop = asyncio.get_running_loop()
                self._due = max(self._due + pacing.every_s, loop.time())
                self._tick = loop.call_at(self._due, self._on_tick)
                return
        # Unpaced, or the events after the last paced token: all at once.
        if self.write_chunks(events):
            self._end_stream()

    def _end_stream(self) -> None:
        self._events = None
        self._pacing = None
        self.end_chunked()

    # -- lean.keepalive hooks ---------------------------------------------------------------

    def on_writable(self) -> None:
        if self._events is not None and self._tick is None:
            self._pump()

    def on_close(self) -> None:
        self._events = None
        self._pacing = None
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
