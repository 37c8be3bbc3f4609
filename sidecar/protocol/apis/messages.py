"""The Anthropic Messages API (``POST /v1/messages``): its prefill rules, stream markers,
usage rule and error shapes.

    prefill leg = the client body with max_tokens 1 (required by the API), stream false
    stream      = named events: message_start, content_block_start, content_block_delta...,
                  content_block_stop, message_delta (stop reason, usage), message_stop; an
                  engine's failure: an ``error`` event, its last (no message_stop)
    usage       = {input_tokens, output_tokens, cache_creation_input_tokens,
                   cache_read_input_tokens}, where input_tokens counts the prompt tokens
                  neither read from nor written to the cache
    errors      = {"type": "error", "error": {"type", "message"}}, the sidecar's ``code`` and
                  ``stage`` added; after the first byte an ``error`` event of that shape

The usage rule (docs/driving/routes.md, "Usage"): the read and written cache figures are the prefill
leg's
own; input_tokens := the prompt (decode: input + read + creation) less those two; a prefill
that reported no cache figures makes none reported. ``message_start``'s usage (the whole
prompt, before any detail is known) is left as the engine wrote it.
"""

from __future__ import annotations

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
    check_object_list,
    is_int,
)
from sidecar.protocol.context import Route
from sidecar.protocol.sse import EVENT, StreamMarkers

MAX_TOKENS: Final = "max_tokens"
MESSAGES: Final = "messages"
INPUT_TOKENS: Final = "input_tokens"
CACHE_READ: Final = "cache_read_input_tokens"
CACHE_CREATION: Final = "cache_creation_input_tokens"
MESSAGE_DELTA: Final = b"message_delta"

MESSAGES_STREAM: Final = StreamMarkers(
    done=EVENT + b"message_stop",
    error_event=EVENT + b"error\n",
    named_events=True,
    error_ends_stream=True,
)

#: The Messages API's error types by HTTP status (its SDKs pick their exception by status).
_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    """The Messages API's error type for an HTTP status."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _count(usage: Mapping[str, Any], key: str) -> int:
    value = usage.get(key)
    return value if is_int(value) else 0


class MessagesApi(Api):
    route = Route.MESSAGES
    markers = MESSAGES_STREAM
    control_keys = frozenset({MAX_TOKENS, STREAM})
    usage_events = (EVENT + MESSAGE_DELTA,)

    def check(self, body: dict[str, Any]) -> None:
        check_bool(body, STREAM)
        limit = body.get(MAX_TOKENS)
        if limit is None:
            raise InvalidRequest("'max_tokens' is required")
        if not is_int(limit) or limit < 1:
            raise InvalidRequest(
                f"'max_tokens' must be a positive integer, got {type_name(limit)}")
        check_object_list(body, MESSAGES)

    def prefill_base(
        self, body: Mapping[str, Any], *, drop_max_completion_tokens: bool = False
    ) -> dict[str, Any]:
        prefill = dict(body)
        prefill[MAX_TOKENS] = PREFILL_MAX_TOKENS
        prefill[STREAM] = False
        prefill.pop(STREAM_OPTIONS, None)
        return prefill

    def true_usage(self, decode: Mapping[str, Any],
                   prefill: Mapping[str, Any] | None) -> dict[str, Any]:
        merged = dict(decode)
        prompt = _count(decode, INPUT_TOKENS) + _count(decode, CACHE_READ) + _count(
            decode, CACHE_CREATION)
        cached = 0
        for key in (CACHE_READ, CACHE_CREATION):
            value = prefill.get(key) if prefill is not None else None
            if is_int(value):
                merged[key] = value
                cached += value
            else:
                merged.pop(key, None)
        if INPUT_TOKENS in decode:
            merged[INPUT_TOKENS] = max(prompt - cached, 0)
        return merged

    def usage_holder(self, name: bytes | None, payload: dict[str, Any]) -> dict[str, Any] | None:
        # Only the message's last usage is told truly (message_start's is the prompt's).
        return payload if name == MESSAGE_DELTA else None

    def error_body(self, error: SidecarError) -> dict[str, Any]:
        return {"type": "error", "error": {
            "type": error_type(error.http_status), "message": error.message,
            "code": error.code, "stage": error.stage.value,
        }}

    def stream_error(self, error: SidecarError, last_event: bytes = b"") -> bytes:
        return EVENT + b"error\ndata: " + jsonutil.dumps(self.error_body(error)) + b"\n\n"
