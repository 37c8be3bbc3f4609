"""The passthrough: any request the sidecar does not disaggregate goes to the local engine.

Method, path, query, headers (minus hop-by-hop and routing headers) and body are forwarded
unchanged and streamed both ways; the engine's status, headers and body come back as they are.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from sidecar.core.upstream import forwardable_headers, response_headers
from sidecar.errors import DecodeFailed, EngineNotReady, SidecarError, Stage
from sidecar.http_server.errors import REQUEST_ID, error_response

logger = logging.getLogger(__name__)


async def proxy_to_engine(
    request: web.Request, session: aiohttp.ClientSession, engine_url: str, request_id: str
) -> web.StreamResponse:
    """Forward ``request`` to the local engine and stream its answer back."""
    headers = forwardable_headers(request.headers.items())
    headers[REQUEST_ID] = request_id
    data = request.content if request.body_exists else None
    url = engine_url + request.rel_url.raw_path_qs
    response: web.StreamResponse | None = None
    try:
        async with session.request(
            request.method, url, data=data, headers=headers, allow_redirects=False
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                reason=upstream.reason,
                headers=response_headers(upstream.headers.items()),
            )
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            response.headers[REQUEST_ID] = request_id
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except aiohttp.ClientConnectorError:
        error: SidecarError = EngineNotReady("local engine refused the connection")
    except (aiohttp.ClientError, TimeoutError):
        error = DecodeFailed("local engine broke the connection", stage=Stage.DECODE)
    if response is not None and response.prepared:
        # Too late for a status: end the body abruptly so the client sees the break.
        if request.transport is not None:
            request.transport.close()
        return response
    return error_response(error, request_id)
