"""A stream read as whole events: the relay's way for named-event APIs and for usage told truly.

    events = WholeEvents(markers, api, usage)      usage: the prefill's (``PrefillUsage``) or None
    events.take(chunk)  ─▶ bytes                    the whole events it completes, to send now
                                                    (usage-carrying ones rewritten by the API's
                                                    usage rule); b"": none yet
                        ─▶ None                     an event needs the prefill's usage, not known
                                                    yet: ``await events.resume()`` gives its bytes
    events.ended()      the stream's last event is one the API ends a stream with (or an
                        engine's error event, where that ends the API's streams)
    events.engine_error an engine's error event passed; events.last_event: the last one sent

Why whole events: the Responses and Messages APIs name their events (``event:`` lines), so
only the last event's head says whether a stream finished, and an event's usage can only be
rewritten before any byte of that event has left. The bytes of an event not yet ended wait
for its end (an event cut in two is of no use to a client before its end anyway); an event
that grows past ``MAX_EVENT_BYTES`` goes out as it is. Events are split on blank lines
(``\\n\\n``, as every engine here writes them); a ``\\r\\n`` stream is kept whole per read.

The usage-carrying events are spotted by ``markers.usage`` (one substring search per read);
only those are parsed and written again, every other byte leaves as the engine wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from sidecar import jsonutil
from sidecar.protocol.apis import Api, usage_of
from sidecar.protocol.sse import DATA_FIELD, EVENT, StreamMarkers
from sidecar.request.legs import PDExchange

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
        if marker is None or marker not in data or not any(map(self._told, events)):
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
        return marker is not None and marker in event and (
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
