"""The passthrough: any request the sidecar does not disaggregate goes to the local engine.

Method, path, query, headers (minus hop-by-hop and routing headers) and body are forwarded
unchanged and streamed both ways; the engine's status, headers and body come back as they are.
The engine call itself is the core's (``EngineCalls.passthrough``).

The client's body is read by the one body reader (``body.py``), held to the limits of every
request the sidecar forwards (size, inflation, deadline): a plain body streams to the engine
as it arrives; a compressed one is inflated whole first and sent with its own length, so the
engine reads exactly the bytes counted there, never the client's compressed length over
them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator

from aiohttp import web

from sidecar.engines.calls import EngineCalls
from sidecar.engines.upstream import forwardable_headers, response_headers
from sidecar.errors import (
    DecodeFailed,
    SidecarError,
    Stage,
)
from sidecar.http1 import UpstreamError
from sidecar.http_server.errors import error_response
from sidecar.http_server.keys import BODY
from sidecar.protocol.request import REQUEST_ID_HEADER

logger = logging.getLogger(__name__)

async def _once(raw: bytes) -> AsyncIterator[bytes]:
    yield raw


async def proxy_to_engine(
    request: web.Request, calls: EngineCalls, request_id: str, raw: bytes | None = None
) -> web.StreamResponse:
    """Forward ``request`` to the local engine and stream its answer back; ``raw``: its body,
    when the front door has read it already."""
    headers = forwardable_headers(request.headers.items())
    headers[REQUEST_ID_HEADER] = request_id
    reader = request.app[BODY]
    length = request.content_length
    response: web.StreamResponse | None = None
    try:
        body: AsyncIterable[bytes] | None
        if raw is None and reader.encoded(request) and request.body_exists:
            # Its length is the inflated bytes': known only once they are all here.
            raw = await reader.read(request)
        if raw is not None:  # read (and held to the limits) already
            body, length = _once(raw), len(raw)
        else:
            body = reader.stream(request)
        upstream = await calls.passthrough(
            request.method, request.rel_url.raw_path_qs, list(headers.items()), body, length,
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
