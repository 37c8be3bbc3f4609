"""The OpenAI Responses API (``POST /v1/responses``): its prefill rules, state rule, stream
markers, usage and error event.

    prefill leg = the client body with max_output_tokens 1, stream false, store false (a
                  stored one-token answer would stay on the prefill engine), no background
                  (a background answer comes back queued, without the hand-off)
    runs whole  = previous_response_id, conversation or background: state that lives on one
                  engine (vLLM keeps stored responses in the memory of the engine that made
                  them; a prefill engine that never saw the earlier turn answers 404), so the
                  request runs whole on the local engine, whose own answer is the truth
    stream      = named events (response.created, ..., response.output_text.delta, ...,
                  response.completed or response.incomplete), no [DONE]; an engine's failure:
                  an ``error`` or ``response.failed`` event, its last
    usage       = {input_tokens, input_tokens_details: {cached_tokens, cache_write_tokens,
                   ...}, output_tokens, output_tokens_details, total_tokens}, in the answer
                  and in the last event's ``response``; ``input_tokens_details`` is the
                  prefill's (docs/driving/routes.md, "Usage")
    error event = event: error / data: {"type": "error", "code", "message", "param",
                  "sequence_number"} (the Responses API's own ``ResponseErrorEvent``)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from sidecar import jsonutil
from sidecar.errors import InvalidRequest, SidecarError
from sidecar.jsonutil import type_name
from sidecar.protocol.apis.base import (
    PREFILL_MAX_TOKENS,
    STREAM,
    STREAM_OPTIONS,
    Api,
    check_bool,
    check_int_or_null,
    check_string_or_null,
)
from sidecar.protocol.context import Route
from sidecar.protocol.sse import EVENT, StreamMarkers

MAX_OUTPUT_TOKENS: Final = "max_output_tokens"
STORE: Final = "store"
BACKGROUND: Final = "background"
PREVIOUS_RESPONSE_ID: Final = "previous_response_id"
CONVERSATION: Final = "conversation"
INPUT: Final = "input"
RESPONSE: Final = "response"
INPUT_TOKENS_DETAILS: Final = "input_tokens_details"

RESPONSES_STREAM: Final = StreamMarkers(
    done=(EVENT + b"response.completed", EVENT + b"response.incomplete"),
    error_event=(EVENT + b"error\n", EVENT + b"response.failed\n"),
    named_events=True,
    error_ends_stream=True,
)

_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":\s*(\d+)')


class ResponsesApi(Api):
    route = Route.RESPONSES
    markers = RESPONSES_STREAM
    usage_events = (EVENT + b"response.completed", EVENT + b"response.incomplete",
                    EVENT + b"response.failed")
    control_keys = frozenset({MAX_OUTPUT_TOKENS, STREAM, STORE, BACKGROUND,
                              PREVIOUS_RESPONSE_ID, CONVERSATION})
    usage_details = INPUT_TOKENS_DETAILS

    def check(self, body: dict[str, Any]) -> None:
        check_bool(body, STREAM)
        check_bool(body, STORE)
        check_bool(body, BACKGROUND)
        check_int_or_null(body, (MAX_OUTPUT_TOKENS,))
        check_string_or_null(body, PREVIOUS_RESPONSE_ID)
        prompt = body.get(INPUT)
        if prompt is not None and not isinstance(prompt, str | list):
            raise InvalidRequest(
                f"'input' must be a string or an array of items, got {type_name(prompt)}")

    def runs_whole(self, body: Mapping[str, Any]) -> str | None:
        for key in (PREVIOUS_RESPONSE_ID, CONVERSATION):
            if body.get(key) is not None:
                return key
        return BACKGROUND if body.get(BACKGROUND) is True else None

    def prefill_base(
        self, body: Mapping[str, Any], *, drop_max_completion_tokens: bool = False
    ) -> dict[str, Any]:
        prefill = dict(body)
        prefill[MAX_OUTPUT_TOKENS] = PREFILL_MAX_TOKENS
        prefill[STREAM] = False
        prefill[STORE] = False
        prefill.pop(BACKGROUND, None)
        prefill.pop(STREAM_OPTIONS, None)
        return prefill

    def usage_holder(self, name: bytes | None, payload: dict[str, Any]) -> dict[str, Any] | None:
        # The last event's response object carries the usage (completed, incomplete, failed).
        response = payload.get(RESPONSE)
        return response if isinstance(response, dict) else None

    def stream_error(self, error: SidecarError, last_event: bytes = b"") -> bytes:
        event: dict[str, Any] = {"type": "error", "code": error.code, "message": error.message,
                                 "param": None}
        numbers = _SEQUENCE_NUMBER.findall(last_event)
        if numbers:
            event["sequence_number"] = int(numbers[-1]) + 1
        return EVENT + b"error\ndata: " + jsonutil.dumps(event) + b"\n\n"
