"""Rendering of ``SidecarError`` in each API's error shape, and as a mid-stream error event.

    OpenAI routes, Responses, generate:  {"error": {"message", "type", "code"}}
    Messages:                            {"type": "error", "error": {"type", "message", "code",
                                                                     "stage"}}

One place decides what a client sees (the shapes are the APIs' own: ``Api.error_body``,
``Api.stream_error`` in ``sidecar.protocol.apis``); messages are the sidecar's own, never an
engine body.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from sidecar import jsonutil
from sidecar.errors import Overloaded, SidecarError
from sidecar.protocol.apis import Api
from sidecar.protocol.apis.base import openai_error
from sidecar.protocol.request import REQUEST_ID_HEADER


def error_payload(error: SidecarError) -> dict[str, Any]:
    return openai_error(error)


def error_response(error: SidecarError, request_id: str | None = None,
                   api: Api | None = None) -> web.Response:
    """The HTTP response for ``error`` in ``api``'s shape (Retry-After on overload)."""
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if isinstance(error, Overloaded):
        headers["Retry-After"] = "1"
    payload = error_payload(error) if api is None else api.error_body(error)
    return web.Response(
        status=error.http_status,
        body=jsonutil.dumps(payload),
        content_type="application/json",
        headers=headers,
    )
