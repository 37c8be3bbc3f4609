"""The server-sent-event shapes the sidecar reads and writes, each marker declared once.

    data: {...}\\n\\n            an event (``DATA`` + a JSON payload + a blank line)
    data: [DONE]\\n\\n           the OpenAI routes' last event (``DONE_EVENT``)
    data: {"error": ...}\\n\\n   an engine's own failure inside its stream (``ERROR_EVENT``)

``StreamMarkers``: per API, how a finished stream ends and how an in-stream error event
starts (``Dialect.stream_markers``). ``answer_as_sse``: a whole answer as the events a
streaming client expects (a prefill that already finished the answer has no decode stream).
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


@dataclass(frozen=True, slots=True)
class StreamMarkers:
    """How one API's stream ends and how an engine's error event inside it starts."""

    #: The bytes a finished stream ends with (before trailing blank lines).
    done: bytes
    #: The start of an engine's in-stream error event, or None when the API has none.
    error_event: bytes | None


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
