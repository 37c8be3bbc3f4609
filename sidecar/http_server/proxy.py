"""The passthrough: any request the sidecar does not disaggregate goes to the local engine.

Method, path, query, headers (minus hop-by-hop and routing headers) and body are forwarded
unchanged and streamed both ways; the engine's status, headers and body come back as they are.
"""

from __future__ import annotations

import logging

from aiohttp import web

from sidecar.core.upstream import forwardable_headers, response_headers
from sidecar.errors import DecodeFailed, EngineNotReady, SidecarError, Stage
from sidecar.http1 import EngineClient, UpstreamConnectError, UpstreamError
from sidecar.http_server.errors import REQUEST_ID, error_response

logger = logging.getLogger(__name__)


async def proxy_to_engine(
    request: web.Request, session: EngineClient, engine_url: str, request_id: str
) -> web.StreamResponse:
    """Forward ``request`` to the local engine and stream its answer back."""
    headers = forwardable_headers(request.headers.items())
    headers[REQUEST_ID] = request_id
    body = request.content.iter_any() if request.body_exists else None
    url = engine_url + request.rel_url.raw_path_qs
    response: web.StreamResponse | None = None
    try:
        upstream = await session.request(
            request.method, url, headers=headers.items(), body=body,
            content_length=request.content_length,
        )
        async with upstream:
            response = web.StreamResponse(
                status=upstream.status, headers=response_headers(upstream.headers)
            )
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            response.headers[REQUEST_ID] = request_id
            await response.prepare(request)
            while chunk := await upstream.readany():
                await response.write(chunk)
            await response.write_eof()
            return response
    except UpstreamConnectError:
        error: SidecarError = EngineNotReady("local engine refused the connection")
    except (UpstreamError, TimeoutError):
        error = DecodeFailed("local engine broke the connection", stage=Stage.DECODE)
    if response is not None and response.prepared:
        # Too late for a status: end the body abruptly so the client sees the break.
        if request.transport is not None:
            request.transport.close()
        return response
    return error_response(error, request_id)
