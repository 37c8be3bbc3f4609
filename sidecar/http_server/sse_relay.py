"""The one relay of a streamed answer to the client, for a single stream and a fanned-out one.

    relay = SSERelay(request, headers, markers, api=api, usage=prefill_usage)
    single stream:  await relay.start(); await exchange.pipe(relay.feed, relay.catch_up)
    fanned out:     await relay.send(event) ... (the head leaves with the first event)
    the end:        relay.ended_with_done() ─▶ await relay.finish()
                    a break after the first byte ─▶ await relay.break_off(error)
    relay.total, relay.engine_error          what the stream is counted by
                                             (``stream_broke``, ``engine_error_reported``)

``feed`` runs in the upstream connection's read callback (``PDExchange.pipe``): it writes the
bytes straight onto the client's socket (``aiohttp_private.ClientSocket``: aiohttp's framing,
byte for byte) and does the stream's bookkeeping: bytes relayed, an engine's error event in
the stream (``markers.error_event``), the last bytes (for the ``markers.done`` check). At an
engine's pace every token is its own read, so this is the path each token takes; it
resolves no future, wakes no task and touches no metric. What needs an ``await`` runs in
``catch_up`` (the piping task): the first chunk goes through aiohttp's ``response.write`` so
the head leaves with it in one send; a full client socket is waited out; a client that went
away makes ``response.write`` raise as it always did.

Named-event APIs (Responses, Messages) and streams whose usage is told truly (``usage``:
the prefill's, the usage rule) are read as whole events first (``stream_events.WholeEvents``:
the end and error checks look at each event's head, a usage event is rewritten before it
leaves); an OpenAI stream without usage to rewrite takes the bare path above.

A failure after the first byte cannot change the status: ``break_off`` ends the stream with
one error event in the API's own shape (``Api.stream_error``; after the cut event's end, so
the two are not glued together) and closes the connection, never a fabricated end marker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from aiohttp import web

from sidecar.errors import DecodeFailed, SidecarError, Stage
from sidecar.http_server.aiohttp_private import ClientSocket, StreamWithHead
from sidecar.http_server.stream_events import PrefillUsage, WholeEvents
from sidecar.observability.tracing import NOOP_SPAN, RELAYED_BYTES, LegSpan
from sidecar.protocol.apis import Api, api_of
from sidecar.protocol.context import Route
from sidecar.protocol.sse import DATA, StreamMarkers
from sidecar.request.scope import RequestScope

logger = logging.getLogger(__name__)

#: Bytes of the stream's end kept for the end-marker check and the error-event seam.
TAIL_BYTES = 32


class SSERelay:
    """One streamed response's relay state (see the module docstring)."""

    __slots__ = ("_api", "_error_event", "_events", "_held", "_request", "_socket", "_started",
                 "engine_error", "markers", "response", "tail", "total")

    def __init__(self, request: web.BaseRequest, headers: Mapping[str, str],
                 markers: StreamMarkers, *, api: Api | None = None,
                 usage: PrefillUsage | None = None) -> None:
        self._request = request
        self.response = StreamWithHead(status=200, headers=headers)
        self.markers = markers
        self._api = api if api is not None else api_of(Route.COMPLETIONS)
        error_event = markers.error_event
        bare = (usage is None and not markers.named_events and isinstance(markers.done, bytes)
                and (error_event is None or isinstance(error_event, bytes)))
        self._events = None if bare else WholeEvents(markers, self._api, usage)
        self._error_event = error_event if bare and isinstance(error_event, bytes) else None
        self._socket: ClientSocket | None = None
        self._held: bytes | None = None  # bytes waiting for catch_up (head not sent, or gone)
        self._started = False  # the first chunk (with the head) went through aiohttp
        self.total = 0
        self.tail = b""
        self.engine_error = False

    @property
    def prepared(self) -> bool:
        """True once the response is prepared (its head leaves with the first bytes)."""
        return self._socket is not None

    async def start(self) -> None:
        """Prepare the response (its head waits for the first bytes)."""
        await self.response.prepare(self._request)
        self._socket = ClientSocket(self._request, self.response)

    # -- a single stream: bytes as the engine's reads bring them ---------------------------

    def feed(self, chunk: bytes) -> bool:
        """Write ``chunk`` to the client now; False when ``catch_up`` must run first."""
        events = self._events
        if events is not None:
            whole = events.take(chunk)
            if events.engine_error:
                self.engine_error = True
            if whole is None:
                return False  # an event waits for the prefill's usage: catch_up
            if not whole:
                return True
            chunk = whole
        socket = self._socket
        transport = socket.open() if socket is not None else None
        if not self._started or self._held is not None or transport is None:
            self._held = chunk if self._held is None else self._held + chunk
            return False
        assert socket is not None
        room = socket.write(transport, chunk)
        self._account(chunk)
        return room  # False past the high-water mark: reading stops until the bytes drain

    async def catch_up(self) -> None:
        """Send what ``feed`` held back (through aiohttp), then wait out a full socket."""
        held = self._held
        if held is not None:
            self._held = None
            await self.response.write(held)  # raises when the client has gone
            self._started = True
            self._account(held)
        events = self._events
        if events is not None and events.waiting:
            whole = await events.resume()
            await self.response.write(whole)
            self._started = True
            self._account(whole)
        if self._socket is not None:
            await self._socket.drain()

    # -- a fanned-out stream: whole events, merged ----------------------------------------

    async def send(self, event: bytes) -> None:
        """Write one event (the first one prepares the response and carries its head)."""
        if self._socket is None:
            await self.start()
        await self.response.write(event)
        self._started = True
        self._account(event)

    # -- the end ----------------------------------------------------------------------------

    def ended_with_done(self) -> bool:
        """True when the stream ended the way its API ends one (its end marker, or an
        engine's error event where that is the API's last)."""
        if self._events is not None:
            return self._events.ended()
        done = self.markers.done
        return isinstance(done, bytes) and self.tail.rstrip().endswith(done)

    async def finish(self) -> None:
        await self.response.write_eof()

    async def break_off(self, error: SidecarError) -> None:
        """End a stream that broke after its first byte: one error event in the API's shape,
        then the connection closed (no end marker)."""
        events = self._events
        if events is not None:
            # Only whole events left: the cut one (if any) is dropped.
            await self.response.write(self._api.stream_error(error, events.last_event))
        else:
            tail = self.tail
            # A break mid-event would glue the error event onto the cut one: end that first.
            separator = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
            await self.response.write(separator + self._api.stream_error(error))
        if self._request.transport is not None:
            self._request.transport.close()

    def _account(self, chunk: bytes) -> None:
        self.total += len(chunk)
        tail = self.tail
        marker = self._error_event
        if marker is not None and not self.engine_error and (chunk.find(marker) >= 0 or (
                tail and not chunk.startswith(DATA) and carries_error_event(tail, chunk,
                                                                            marker))):
            self.engine_error = True
        # Only the last bytes matter; slicing a long chunk alone avoids copying it whole.
        self.tail = chunk[-TAIL_BYTES:] if len(chunk) >= TAIL_BYTES else (tail + chunk)[
            -TAIL_BYTES:]


def carries_error_event(tail: bytes, chunk: bytes, marker: bytes) -> bool:
    """True when ``chunk`` holds (or completes) an engine's error event starting ``marker``
    (event text is JSON, where a quote is escaped: the marker never occurs inside a token)."""
    if marker in chunk:
        return True
    if chunk.startswith(DATA) or not tail:
        return False
    seam = len(marker) - 1
    return marker in tail[-seam:] + chunk[:seam]


def stream_broke(scope: RequestScope, relay: SSERelay, error: SidecarError,
                 span: LegSpan = NOOP_SPAN) -> None:
    """Count and log a stream that broke after its first byte."""
    scope.relayed_bytes.inc(relay.total)
    span.set(RELAYED_BYTES, relay.total)
    span.fail(error)
    scope.broken(error)
    logger.warning("request %s: stream broke after %d bytes: %s", scope.request_id,
                   relay.total, error.code)


def engine_error_reported(scope: RequestScope, span: LegSpan = NOOP_SPAN) -> None:
    """Count and log a stream relayed as the engine wrote it (its error event, then its end
    marker): a decode that failed after its head."""
    reported = DecodeFailed("decode engine reported an error in its stream", stage=Stage.DECODE)
    span.fail(reported)
    scope.failed(reported)
    logger.warning("request %s: the decode engine's stream carried an error event",
                   scope.request_id)
