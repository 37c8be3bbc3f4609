"""The one relay of a streamed answer to the client, for a single stream and a fanned-out one.

    relay = SSERelay(request, headers, markers, api=api, usage=prefill_usage)
    single stream:  await relay.start(); await exchange.pipe(relay.feed, relay.catch_up)
    fanned out:     await relay.send(event) ... (the head leaves with the first event)
    the end:        relay.ended_with_done() ─▶ await relay.finish()
                    a break after the first byte ─▶ await relay.break_off(error)
    relay.total, relay.engine_error          what the stream is counted by
                                             (``stream_delivered``, ``stream_broke``)

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
the prefill's, the usage rule) are read as whole events first (``WholeEvents``):

    events = WholeEvents(markers, api, usage)      usage: the prefill's (``PrefillUsage``) or None
    events.take(chunk)  ─▶ bytes                    the whole events it completes, to send now
                                                    (usage-carrying ones rewritten by the API's
                                                    usage rule); b"": none yet
                        ─▶ None                     an event needs the prefill's usage, not known
                                                    yet: ``await events.resume()`` gives its bytes
    events.ended()      the stream's last event is one the API ends a stream with (or an
                        engine's error event, where that ends the API's streams)

Why whole events: the Responses and Messages APIs name their events (``event:`` lines), so
only the last event's head says whether a stream finished, and an event's usage can only be
rewritten before any byte of that event has left. The bytes of an event not yet ended wait
for its end (an event cut in two is of no use to a client before its end anyway); an event
that grows past ``MAX_EVENT_BYTES`` goes out as it is. Events are split on blank lines
(``\\n\\n``, as every engine here writes them); a ``\\r\\n`` stream is kept whole per read.
The usage-carrying events are spotted by ``markers.usage`` (one substring search per read);
only those are parsed and written again, every other byte leaves as the engine wrote it. An
OpenAI stream without usage to rewrite takes the bare path above.

A stream that may move to another engine (``sidecar.request.migration``) is kept
(``KeptStream``): whole events only reach the client (a cut event never does, so a
continuation joins cleanly), the engine's own bytes are kept up to a cap (parsed only if the
engine dies: the cost per read is one search and one reference), the token ids the engine was asked
for and the client was not are written as the engine writes them unasked (one substitution
per read), and an engine's own failure event (a 5xx) stops the stream before the client sees
it, so the stream can move instead. Once moved, the continuation's events are written as the
client's stream by its join (``follow``: parsed and written again, event by event).

A failure after the first byte cannot change the status: ``break_off`` ends the stream with
one error event in the API's own shape (``Api.stream_error``; after the cut event's end, so
the two are not glued together) and closes the connection, never a fabricated end marker.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final

from aiohttp import web

from sidecar import jsonutil
from sidecar.errors import DecodeFailed, SidecarError, Stage
from sidecar.http_server.aiohttp_private import ClientSocket, StreamWithHead
from sidecar.observability.tracing import NOOP_SPAN, RELAYED_BYTES, LegSpan
from sidecar.protocol.apis import Api, api_of, usage_of
from sidecar.protocol.context import Route
from sidecar.protocol.continuation import Diverged, Join, data_payloads, engine_fault_event
from sidecar.protocol.sse import (
    DATA,
    DATA_FIELD,
    DONE_PAYLOAD,
    ERROR_EVENT,
    ERROR_PAYLOAD,
    EVENT,
    StreamMarkers,
)
from sidecar.request.legs import PDExchange
from sidecar.request.scope import RequestScope

logger = logging.getLogger(__name__)

#: At least this many bytes of the stream's end are kept for the end-marker check and the
#: error-event seam.
TAIL_BYTES = 32


class SSERelay:
    """One streamed response's relay state (see the module docstring)."""

    __slots__ = ("_api", "_continued", "_error_event", "_events", "_held", "_request",
                 "_socket", "_started", "engine_error", "kept", "markers", "response", "tail",
                 "total")

    def __init__(self, request: web.BaseRequest, headers: Mapping[str, str],
                 markers: StreamMarkers, *, api: Api | None = None,
                 usage: PrefillUsage | None = None, kept: KeptStream | None = None) -> None:
        self._request = request
        self.response = StreamWithHead(status=200, headers=headers)
        self.markers = markers
        self._api = api if api is not None else api_of(Route.COMPLETIONS)
        error_event = markers.error_event
        bare = (usage is None and not markers.named_events and isinstance(markers.done, bytes)
                and (error_event is None or isinstance(error_event, bytes)))
        self._events = None if bare else WholeEvents(markers, self._api, usage)
        # A kept stream's reads are searched for an engine's error event by ``KeptStream``.
        self._error_event = (error_event if bare and isinstance(error_event, bytes)
                             and kept is None else None)
        self._socket: ClientSocket | None = None
        self._held: bytes | None = None  # bytes waiting for catch_up (head not sent, or gone)
        self._started = False  # the first chunk (with the head) went through aiohttp
        self.total = 0
        self.tail = b""
        self.engine_error = False
        #: The stream's engine bytes, kept while it may move (None: it may not).
        self.kept = kept
        self._continued: ContinuedEvents | None = None

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
        """Write ``chunk`` to the client now; False when ``catch_up`` must run first. Raises
        the engine's failure a kept stream (or a continuation) reported, after writing what
        came before it."""
        continued = self._continued
        if continued is not None:
            chunk = continued.take(chunk)
            room = self._write(chunk) if chunk else True
            if continued.failure is not None:
                raise continued.failure
            return room
        kept = self.kept
        if kept is not None:
            chunk = kept.take(chunk)
            if kept.failure is not None:
                if chunk:
                    self._relay(chunk)
                raise kept.failure
            if kept.reported:
                self.engine_error = True
            if not chunk:
                return True
        if self._events is None:  # the bare path (``_relay`` without its events' step)
            return self._write(chunk)
        return self._relay(chunk)

    def follow(self, join: Join) -> None:
        """Relay a continuation from now on: its events written by ``join`` as this client's
        stream (``feed`` takes its bytes)."""
        self._continued = ContinuedEvents(join)

    def _relay(self, chunk: bytes) -> bool:
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
        return self._write(chunk)

    def _write(self, chunk: bytes) -> bool:
        socket = self._socket
        if self._started and self._held is None and socket is not None:
            room = socket.send(chunk)
            if room is not None:
                self._account(chunk)
                return room  # False past the high-water mark: reading stops until it drains
        # Not yet (the head leaves with the first chunk, through aiohttp), or the client has
        # gone (``catch_up``'s write through aiohttp raises): held for ``catch_up``.
        self._held = chunk if self._held is None else self._held + chunk
        return False

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
        if self._continued is not None:
            return self._continued.done
        if self._events is not None:
            return self._events.ended()
        done = self.markers.done
        return isinstance(done, bytes) and self.tail[-TAIL_BYTES:].rstrip().endswith(done)

    async def finish(self) -> None:
        """End the response; a client that hung up after the last event is no error (its
        answer was delivered: only debug says so)."""
        try:
            await self.response.write_eof()
        except ConnectionResetError:
            logger.debug("the client closed its connection after the stream's last event")

    async def break_off(self, error: SidecarError) -> None:
        """End a stream that broke after its first byte: one error event in the API's shape,
        then the connection closed (no end marker)."""
        held = self._held
        if held is not None and self._socket is not None:
            self._held = None  # what came before the failure goes first
            await self.response.write(held)
            self._account(held)
        events = self._events
        if self.kept is not None or self._continued is not None:
            # Whole events only reached the client: nothing to end first.
            await self.response.write(self._api.stream_error(error))
        elif events is not None:
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
        # Only the last bytes matter: a chunk that long is kept as it is (a reference, not a
        # copy of its end), a shorter one is joined to the tail before it.
        self.tail = chunk if len(chunk) >= TAIL_BYTES else (tail + chunk)[-TAIL_BYTES:]


class KeptStream:
    """A stream that may move (see the module docstring): ``take`` turns each read into the
    whole events the client gets, keeping the engine's bytes (up to ``cap``); ``failure`` is
    set once the engine reported a failure of its own (the events before it are returned)."""

    __slots__ = ("_cap", "_partial", "_reads", "_size", "_strip", "failure", "overflowed",
                 "reported")

    def __init__(self, cap: int, strip: Callable[[bytes], bytes] | None = None) -> None:
        self._cap = cap
        self._strip = strip
        self._partial = b""
        # The reads themselves, not a copy: appending a reference costs a read far less than
        # growing one buffer (a copy, and a move of all of it each time it outgrows its room).
        self._reads: list[bytes] = []
        self._size = 0
        #: Past the cap: the stream is no longer kept (it may not move).
        self.overflowed = False
        self.failure: SidecarError | None = None
        #: An error event about the request (a 4xx) left as the engine wrote it.
        self.reported = False

    @property
    def kept(self) -> bytes:
        """The engine's bytes kept so far (b"" once past the cap)."""
        return b"".join(self._reads)

    def take(self, chunk: bytes) -> bytes:
        partial = self._partial
        data = partial + chunk if partial else chunk
        if data.endswith(b"\n\n"):  # the usual read: whole events, nothing left over
            whole = data
            if partial:
                self._partial = b""
        else:
            end = _boundary(data)
            if not end:
                self._partial = data
                if len(data) <= MAX_EVENT_BYTES:
                    return b""
                self._give_up()  # one event past any sane size: relayed as it is
                self._partial = b""
                return data
            whole, self._partial = data[:end], data[end:]
        # ``find``, not ``in``: ``bytes.__contains__`` first tries its operand as an integer,
        # and formats and clears a TypeError on every call.
        at = whole.find(ERROR_EVENT)
        if at >= 0:
            if engine_fault_event(whole[at:]):
                self.failure = DecodeFailed("decode engine reported a failure in its stream",
                                            stage=Stage.DECODE)
                whole = whole[:at]
            else:
                self.reported = True
        # Each kept read counts with what holding it costs, so the cap bounds the memory
        # whatever the engine's read sizes.
        size = self._size + len(whole) + _KEPT_READ_COST
        if size <= self._cap:
            self._reads.append(whole)
            self._size = size
        elif not self.overflowed:
            self._give_up()
        strip = self._strip
        return strip(whole) if strip is not None and whole else whole

    def _give_up(self) -> None:
        self.overflowed = True
        self._reads = []
        self._cap = -1  # nothing is kept any more


#: What holding one read costs besides its bytes: the bytes object's header and the list's
#: reference to it.
_KEPT_READ_COST: Final = sys.getsizeof(b"") + 8


class ContinuationDiverged(DecodeFailed):
    """A continuation's output differed from the answer it was to regenerate (never the
    engine's fault: a nondeterministic engine, or a sampled answer)."""

    engine_fault = False


class ContinuedEvents:
    """A continuation's bytes as the client's events (``Join``): whole events, each written
    again; ``failure`` once the continuation's engine reported one of its own, or its output
    differed from the answer it regenerates; ``done`` once its end event came."""

    __slots__ = ("_join", "_partial", "done", "failure")

    def __init__(self, join: Join) -> None:
        self._join = join
        self._partial = b""
        self.done = False
        self.failure: SidecarError | None = None

    @property
    def join(self) -> Join:
        return self._join

    def take(self, chunk: bytes) -> bytes:
        if self.failure is not None:
            return b""
        data = self._partial + chunk if self._partial else chunk
        end = _boundary(data)
        if not end:
            self._partial = data
            if len(data) > MAX_EVENT_BYTES:
                self.failure = DecodeFailed("continuation event exceeds the size cap",
                                            stage=Stage.DECODE)
            return b""
        whole, self._partial = data[:end], data[end:]
        out: list[bytes] = []
        for payload in data_payloads(whole):
            if payload.startswith(ERROR_PAYLOAD):
                if engine_fault_event(DATA + payload):
                    self.failure = DecodeFailed(
                        "the engine the request moved to reported a failure in its stream",
                        stage=Stage.DECODE)
                    break
                out.append(DATA + payload + b"\n\n")  # about the request: as it came
                continue
            try:
                out.append(self._join.event(payload))
            except (Diverged, jsonutil.JSONDecodeError) as exc:
                self.failure = ContinuationDiverged(
                    f"the continuation diverged from the answer ({exc})", stage=Stage.DECODE)
                break
            if payload == DONE_PAYLOAD:
                self.done = True
        return b"".join(out)


def carries_error_event(tail: bytes, chunk: bytes, marker: bytes) -> bool:
    """True when ``chunk`` holds (or completes) an engine's error event starting ``marker``
    (event text is JSON, where a quote is escaped: the marker never occurs inside a token)."""
    # ``find``, not ``in`` (``KeptStream.take`` says why).
    if chunk.find(marker) >= 0:
        return True
    if chunk.startswith(DATA) or not tail:
        return False
    seam = len(marker) - 1
    return (tail[-seam:] + chunk[:seam]).find(marker) >= 0


def stream_broke(scope: RequestScope, relay: SSERelay, error: SidecarError,
                 span: LegSpan = NOOP_SPAN) -> None:
    """Count and log a stream that broke after its first byte."""
    scope.relayed_bytes.inc(relay.total)
    span.set(RELAYED_BYTES, relay.total)
    span.fail(error)
    scope.broken(error)
    logger.warning("request %s: stream broke after %d bytes: %s", scope.request_id,
                   relay.total, error.code)


def stream_delivered(scope: RequestScope, relay: SSERelay, span: LegSpan = NOOP_SPAN) -> None:
    """Count a stream whose end event reached the client: bytes relayed, an engine's error
    event carried in it; a close from the client now is no cancellation (``delivered``)."""
    scope.delivered()
    scope.relayed_bytes.inc(relay.total)
    if span.recording:
        span.set(RELAYED_BYTES, relay.total)
    if relay.engine_error:
        engine_error_reported(scope, span)


def engine_error_reported(scope: RequestScope, span: LegSpan = NOOP_SPAN) -> None:
    """Count and log a stream relayed as the engine wrote it (its error event, then its end
    marker): a decode that failed after its head."""
    reported = DecodeFailed("decode engine reported an error in its stream", stage=Stage.DECODE)
    span.fail(reported)
    scope.failed(reported)
    logger.warning("request %s: the decode engine's stream carried an error event",
                   scope.request_id)


# -- whole events: named-event APIs, and usage told truly -----------------------------

#: An event is held for its end up to this size, then relayed as it is.
MAX_EVENT_BYTES: Final = 8 * 1024 * 1024
#: How much of an event's start the end and error checks look at.
HEAD_BYTES: Final = 64
_ENDS: Final = (b"\n\n", b"\n\r\n")
_EVENT_FIELD: Final = EVENT.rstrip()


class PrefillUsage:
    """The prefill leg's usage, as its exchange knows it (at once, or once it answers)."""

    __slots__ = ("_exchange",)

    def __init__(self, exchange: PDExchange) -> None:
        self._exchange = exchange

    @property
    def pending(self) -> bool:
        return self._exchange.prefill_reply_pending()

    def now(self) -> Mapping[str, Any] | None:
        return usage_of(self._exchange.prefill_reply_now())

    async def wait(self) -> Mapping[str, Any] | None:
        return usage_of(await self._exchange.prefill_reply())


def _boundary(data: bytes) -> int:
    """The index just after the last event separator in ``data`` (0: none)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _split(data: bytes) -> list[bytes]:
    """``data`` (whole events) as one item per event, each with its separator."""
    first = data.find(b"\n\n")
    if first < 0 or first == len(data) - 2:
        return [data]
    events = []
    start = 0
    while first >= 0:
        end = first + 2
        # Blank lines between events belong to the event before them.
        while data.startswith(b"\n", end):
            end += 1
        events.append(data[start:end])
        start = end
        first = data.find(b"\n\n", start)
    if start < len(data):
        events.append(data[start:])
    return events


class WholeEvents:
    """One stream's event bookkeeping (see the module docstring)."""

    __slots__ = (
        "_api",
        "_done",
        "_error_ends",
        "_errors",
        "_partial",
        "_usage",
        "_usage_events",
        "_usage_marker",
        "_waiting",
        "engine_error",
        "last_event",
        "last_head",
    )

    def __init__(self, markers: StreamMarkers, api: Api,
                 usage: PrefillUsage | None = None) -> None:
        self._api = api
        self._done = markers.done
        self._errors = markers.error_event
        self._error_ends = markers.error_ends_stream
        self._usage = usage
        self._usage_marker = markers.usage if usage is not None else None
        self._usage_events = api.usage_events
        self._partial = b""
        self._waiting: list[bytes] | None = None
        self.engine_error = False
        self.last_event = b""
        self.last_head = b""

    @property
    def waiting(self) -> bool:
        """True when whole events wait for the prefill's usage (``resume``)."""
        return self._waiting is not None

    def take(self, chunk: bytes) -> bytes | None:
        """The whole events ``chunk`` completes (see the module docstring)."""
        data = self._partial + chunk if self._partial else chunk
        if data.endswith(_ENDS):
            self._partial = b""
        else:
            end = _boundary(data)
            self._partial = data[end:]
            data = data[:end]
            if len(self._partial) > MAX_EVENT_BYTES:
                data, self._partial = data + self._partial, b""
            if not data:
                return b""
        events = _split(data)
        for event in events:
            self._note(event)
        self.last_event = events[-1]
        marker = self._usage_marker
        if marker is None or data.find(marker) < 0 or not any(map(self._told, events)):
            return data
        assert self._usage is not None
        if self._usage.pending:
            self._waiting = events
            return None
        return self._rewritten(events, self._usage.now())

    async def resume(self) -> bytes:
        """The events that waited, once the prefill's usage is known."""
        events, self._waiting = self._waiting or [], None
        assert self._usage is not None
        return self._rewritten(events, await self._usage.wait())

    def rest(self) -> bytes:
        """The bytes of an event that had not ended when the stream did."""
        rest, self._partial = self._partial, b""
        return rest

    def ended(self) -> bool:
        """True when the stream ended the way the API ends one."""
        if self._partial:
            return False
        if self.last_head.startswith(self._done):
            return True
        return self.engine_error and self._error_ends

    def _note(self, event: bytes) -> None:
        head = event[:HEAD_BYTES]
        self.last_head = head
        errors = self._errors
        if errors is not None and head.startswith(errors):
            self.engine_error = True

    def _told(self, event: bytes) -> bool:
        """True when ``event`` carries usage the API's rule tells."""
        marker = self._usage_marker
        heads = self._usage_events
        return marker is not None and event.find(marker) >= 0 and (
            heads is None or event.startswith(heads))

    def _rewritten(self, events: list[bytes], usage: Mapping[str, Any] | None) -> bytes:
        return b"".join(self._rewrite(event, usage) if self._told(event) else event
                        for event in events)

    def _rewrite(self, event: bytes, usage: Mapping[str, Any] | None) -> bytes:
        """``event`` with the usage it carries told truly (as it was when nothing changes)."""
        lines = event.rstrip(b"\n").split(b"\n")
        name: bytes | None = None
        data: list[bytes] = []
        at = -1
        for i, line in enumerate(lines):
            if line.startswith(_EVENT_FIELD):
                name = line[len(_EVENT_FIELD):].strip()
            elif line.startswith(DATA_FIELD):
                if at < 0:
                    at = i
                data.append(line[len(DATA_FIELD):].removeprefix(b" "))
        if at < 0:
            return event
        try:
            payload = jsonutil.loads(b"\n".join(data))
        except jsonutil.JSONDecodeError:
            return event
        if not isinstance(payload, dict) or not self._api.event_with_true_usage(
                name, payload, usage):
            return event
        kept = [line for line in lines if not line.startswith(DATA_FIELD)]
        kept.insert(sum(1 for line in lines[:at] if not line.startswith(DATA_FIELD)),
                    DATA_FIELD + b" " + jsonutil.dumps(payload))
        return b"\n".join(kept) + b"\n\n"
