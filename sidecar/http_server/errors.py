"""Rendering of ``SidecarError`` as OpenAI-shaped JSON, and as a mid-stream SSE error event.

    {"error": {"message": "...", "type": "prefill_error", "code": "prefill_failed"}}

One place decides what a client sees; messages are the sidecar's own, never an engine body.
"""

from __future__ import annotations

from aiohttp import web

from sidecar import jsonutil
from sidecar.errors import Overloaded, SidecarError
from sidecar.protocol.request_id import REQUEST_ID_HEADER


def error_payload(error: SidecarError) -> dict[str, dict[str, str]]:
    return {"error": {"message": error.message, "type": error.error_type, "code": error.code}}


def error_response(error: SidecarError, request_id: str | None = None) -> web.Response:
    """The HTTP response for ``error`` (Retry-After on overload)."""
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if isinstance(error, Overloaded):
        headers["Retry-After"] = "1"
    return web.Response(
        status=error.http_status,
        body=jsonutil.dumps(error_payload(error)),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(error: SidecarError) -> bytes:
    """The last event of a stream that broke after its first byte (no ``[DONE]`` follows)."""
    return b"data: " + jsonutil.dumps(error_payload(error)) + b"\n\n"
