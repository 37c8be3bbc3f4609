"""The passthrough: any request the sidecar does not disaggregate goes to the local engine.

Method, path, query, headers (less hop-by-hop and routing ones) and body go as they are,
streamed both ways, and so does the answer; the call is the core's ``EngineCalls.passthrough``.
"""

from __future__ import annotations

import logging

from aiohttp import web

from sidecar.core.engine_calls import EngineCalls
from sidecar.core.upstream import forwardable_headers, response_headers
from sidecar.errors import DecodeFailed, SidecarError, Stage
from sidecar.http1 import UpstreamError
from sidecar.http_server.errors import error_response
from sidecar.protocol.request_id import REQUEST_ID_HEADER

logger = logging.getLogger(__name__)


async def proxy_to_engine(
    request: web.Request, calls: EngineCalls, request_id: str
) -> web.StreamResponse:
    """Forward ``request`` to the local engine and stream its answer back."""
    headers = forwardable_headers(request.headers.items())
    headers[REQUEST_ID_HEADER] = request_id
    body = request.content.iter_any() if request.body_exists else None
    response: web.StreamResponse | None = None
    try:
        upstream = await calls.passthrough(
            request.method, request.rel_url.raw_path_qs, list(headers.items()), body,
            request.content_length,
        )
        async with upstream:
            response = web.StreamResponse(
                status=upstream.status, headers=response_headers(upstream.headers)
            )
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            response.headers[REQUEST_ID_HEADER] = request_id
            await response.prepare(request)
            while chunk := await upstream.readany():
                await response.write(chunk)
            await response.write_eof()
            return response
    except SidecarError as exc:
        error = exc
    except (UpstreamError, TimeoutError):
        error = DecodeFailed("local engine broke the connection", stage=Stage.DECODE)
    if response is not None and response.prepared:
        # Too late for a status: end the body abruptly so the client sees the break.
        if request.transport is not None:
            request.transport.close()
        return response
    return error_response(error, request_id)
