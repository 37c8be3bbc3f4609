"""The server-sent-event shapes the sidecar reads and writes, each marker declared once.

    data: {...}\\n\\n            an event (``DATA`` + a JSON payload + a blank line)
    data: [DONE]\\n\\n           the OpenAI routes' last event (``DONE_EVENT``)
    data: {"error": ...}\\n\\n   an engine's own failure inside its stream (``ERROR_EVENT``)
    event: NAME\\ndata: {...}\\n\\n   a named event (the Responses and Messages APIs: ``EVENT``)

``StreamMarkers`` says, per API, how a finished stream's last event starts, how an in-stream
error event starts, whether events are named and how an event carrying usage is spotted; each
API module declares its own (``sidecar.protocol.apis``), and a dialect names the markers of
its engine's streams (``Dialect.stream_markers``, the API's unless an engine differs).
``answer_as_sse`` turns a whole answer into the events a streaming client expects, for the
one case without a decode stream (a prefill that already finished the answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from sidecar import jsonutil
from sidecar.protocol.context import Route

#: The SSE field an event's payload is in (as the engines write it, with one space).
DATA: Final = b"data: "
#: The field name alone (a reader accepts it without the space, as SSE allows).
DATA_FIELD: Final = b"data:"
DONE_PAYLOAD: Final = b"[DONE]"
DONE_LINE: Final = DATA + DONE_PAYLOAD
DONE_EVENT: Final = DONE_LINE + b"\n\n"
#: How an in-stream error event's payload starts (``json.dumps({"error": ...})``).
ERROR_PAYLOAD: Final = b'{"error"'
ERROR_EVENT: Final = DATA + ERROR_PAYLOAD
#: The key of an error event's payload.
ERROR_KEY: Final = "error"
#: The SSE field naming an event (the Responses and Messages APIs name every event).
EVENT: Final = b"event: "
#: How a JSON payload holding a usage object starts it (compact JSON, as engines write it;
#: ``"usage":null`` does not match). A quote inside a string is escaped, so it never
#: matches inside generated text.
USAGE_OBJECT: Final = b'"usage":{'

Markers = bytes | tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class StreamMarkers:
    """How one API's stream ends, how an engine's error event inside it starts, and how an
    event carrying usage is spotted."""

    #: How a finished stream's last event starts (``data: [DONE]``: also how it ends); a
    #: tuple when the API has several last events.
    done: Markers
    #: The start of an engine's in-stream error event (or of each kind), None: none.
    error_event: Markers | None
    #: Events carry an ``event:`` line: the relay reads the stream as whole events to
    #: know the last one (its payload alone does not say).
    named_events: bool = False
    #: An engine's error event is the stream's last (no end marker follows it).
    error_ends_stream: bool = False
    #: How a payload carrying usage is spotted (``usage`` rewriting), None: never.
    usage: bytes | None = USAGE_OBJECT


#: The OpenAI completions and chat streams.
OPENAI_STREAM: Final = StreamMarkers(done=DONE_LINE, error_event=ERROR_EVENT)


def sse_event(payload: bytes) -> bytes:
    """One ``data:`` event carrying ``payload``."""
    return DATA + payload + b"\n\n"


def answer_as_sse(answer: Mapping[str, Any], route: Route) -> bytes:
    """One chunk event carrying the whole answer, then ``[DONE]``."""
    chunk = dict(answer)
    if route is Route.CHAT:
        chunk["object"] = "chat.completion.chunk"
        choices = []
        for choice in answer.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            converted = {k: v for k, v in choice.items() if k != "message"}
            converted["delta"] = choice.get("message") or {}
            choices.append(converted)
        chunk["choices"] = choices
    return sse_event(jsonutil.dumps(chunk)) + DONE_EVENT
