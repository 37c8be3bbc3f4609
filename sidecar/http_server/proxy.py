"""The passthrough: any request the sidecar does not disaggregate goes to the local engine.

Method, path, query, headers (minus hop-by-hop and routing headers) and body are forwarded
unchanged and streamed both ways; the engine's status, headers and body come back as they are.
The engine call itself is the core's (``EngineCalls.passthrough``).

The client's body is held to the limits of every request the sidecar forwards:
``--max-body-bytes`` (a declared length over it is refused before the engine is called; a
chunked body that grows past it is cut, 413) and ``--client-body-timeout-s`` (the whole body
within the deadline, else 408), so a client trickling a body cannot hold an admission slot
for ever. A body aiohttp inflated (``body_encoding``) is read whole first and sent with its
own length: the engine reads exactly the bytes counted here, never the client's compressed
length over them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator

from aiohttp import StreamReader, web

from sidecar.engines.calls import EngineCalls
from sidecar.engines.upstream import forwardable_headers, response_headers
from sidecar.errors import (
    BodyTooLarge,
    DecodeFailed,
    InvalidRequest,
    RequestTimeout,
    SidecarError,
    Stage,
)
from sidecar.http1 import UpstreamError
from sidecar.http_server.body_encoding import BodyCoding, body_coding
from sidecar.http_server.errors import error_response
from sidecar.http_server.keys import RUNTIME
from sidecar.protocol.request import REQUEST_ID_HEADER

logger = logging.getLogger(__name__)

#: A body whose chunked framing or content coding breaks while it is read (aiohttp's
#: ``RequestPayloadError``): the client's fault, told without its bytes.
MALFORMED_BODY = InvalidRequest("request body framing or content coding is malformed")


async def _limited_body(
    content: StreamReader, max_bytes: int, timeout_s: float
) -> AsyncIterator[bytes]:
    """The client's body as it arrives, refused past ``max_bytes`` or the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    received = 0
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await content.readany()
        except TimeoutError:
            raise RequestTimeout(f"request body not received within {timeout_s:g} s") from None
        except web.RequestPayloadError:
            raise MALFORMED_BODY from None
        if not chunk:
            return
        received += len(chunk)
        if received > max_bytes:
            raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
        yield chunk


async def _once(raw: bytes) -> AsyncIterator[bytes]:
    yield raw


async def proxy_to_engine(
    request: web.Request, calls: EngineCalls, request_id: str, raw: bytes | None = None
) -> web.StreamResponse:
    """Forward ``request`` to the local engine and stream its answer back; ``raw``: its body,
    when the front door has read it already."""
    headers = forwardable_headers(request.headers.items())
    headers[REQUEST_ID_HEADER] = request_id
    settings = request.app[RUNTIME].settings
    max_bytes = settings.max_body_bytes
    length = request.content_length
    response: web.StreamResponse | None = None
    try:
        if request.content_length is not None and request.content_length > max_bytes:
            raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
        inflated = body_coding(request.headers) is BodyCoding.INFLATED
        body: AsyncIterable[bytes] | None
        if raw is None and inflated and request.body_exists:
            # Its length is the inflated bytes': known only once they are all here.
            raw = b"".join([chunk async for chunk in _limited_body(
                request.content, max_bytes, settings.client_body_timeout_s)])
        if raw is not None:  # read (and held to the limits) already
            body, length = _once(raw), len(raw)
        else:
            body = (_limited_body(request.content, max_bytes, settings.client_body_timeout_s)
                    if request.body_exists else None)
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
