"""The PD routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

    request ─admission─▶ target? ──no──▶ passthrough to the local engine
                            │yes
                            ▼
        read body (capped) ─▶ parse_client_body ─▶ orchestrator.start ─▶ relay ─▶ client
                                                                         JSON or SSE bytes

The relay writes the decode engine's bytes as they arrive (no re-encoding). A failure after
the first byte ends the stream with one error event and an unterminated body: no second
status, no fabricated ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from sidecar import jsonutil
from sidecar.core.orchestrator import PDExchange, PDRequest
from sidecar.core.targets import PREFILL_TARGET_HEADER
from sidecar.core.upstream import forwardable_headers
from sidecar.errors import (
    BodyTooLarge,
    ClientCancelled,
    DecodeFailed,
    RequestTimeout,
    SidecarError,
    Stage,
)
from sidecar.http_server.errors import REQUEST_ID, error_response, sse_error_event
from sidecar.http_server.keys import RUNTIME
from sidecar.http_server.proxy import proxy_to_engine
from sidecar.protocol.context import Route
from sidecar.protocol.request import parse_client_body
from sidecar.protocol.sse import answer_as_sse
from sidecar.runtime import Runtime

logger = logging.getLogger(__name__)

FRONT_DOOR = "http"
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")
_RELAYED_HEADERS = ("Content-Type", "Cache-Control")
#: Every engine ends a finished stream with this event; its absence means a cut stream.
_SSE_DONE = b"data: [DONE]"
_TAIL_BYTES = 32


class _SSEResponse(web.StreamResponse):
    """A stream whose head leaves with its first chunk: one send instead of two.

    aiohttp's own ``web.Response`` buffers its head this way; a ``StreamResponse`` sends it
    at ``prepare()`` unless told otherwise. The first chunk follows the decode engine's head
    at once, so the client waits for nothing it would not have waited for anyway.
    """

    _send_headers_immediately = False


def request_id_of(request: web.Request) -> str:
    """The client's ``X-Request-Id`` when it is sane, else a new one."""
    given = request.headers.get(REQUEST_ID)
    if given is not None and _SAFE_REQUEST_ID.match(given):
        return given
    return uuid.uuid4().hex


async def _read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    if request.content_length is not None and request.content_length > max_bytes:
        raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
    try:
        if request.content.is_eof():
            return await request.read()  # all there already: no deadline needed
        # A client trickling its body (slow loris) would hold an admission slot for ever.
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(f"request body exceeds {max_bytes} bytes") from None
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout_s:g} s") from None


def _route_handler(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await handle_pd(request, route)

    return handle


async def handle_pd(request: web.Request, route: Route) -> web.StreamResponse:
    """Serve one OpenAI request, as a PD pair when it names a prefill target."""
    runtime = request.app[RUNTIME]
    metrics = runtime.metrics
    request_id = request_id_of(request)
    started = time.perf_counter()
    outcome = "error"
    try:
        runtime.admission.enter()
    except SidecarError as error:
        _count_error(runtime, error, route, "refused")
        return error_response(error, request_id)
    inflight = metrics.labelled(metrics.inflight, FRONT_DOOR)
    inflight.inc()
    try:
        target = await runtime.selector.select(request.headers.getall(PREFILL_TARGET_HEADER, []))
        if target is None:
            outcome = "passthrough"
            return await proxy_to_engine(
                request, runtime.session, runtime.settings.engine_url.rstrip("/"), request_id
            )
        raw = await _read_body(request, runtime.settings.max_body_bytes,
                               runtime.settings.client_body_timeout_s)
        client = parse_client_body(raw, route, trusted_router=runtime.settings.trusted_router)
        headers = forwardable_headers(request.headers.items(), drop=("accept-encoding",))
        headers[REQUEST_ID] = request_id
        exchange = await runtime.orchestrator.start(
            PDRequest(
                route=route,
                body=client.body,
                stream=client.stream,
                target=target,
                request_id=request_id,
                headers=headers,
            )
        )
        try:
            _observe_stages(runtime, exchange)
            response = await _relay(request, runtime, exchange, client.stream, route, request_id)
        finally:
            await exchange.aclose()
        outcome = "fallback" if exchange.fallback_reason else "ok"
        return response
    except SidecarError as error:
        _count_error(runtime, error, route, "error")
        logger.warning("request %s failed: %s (%s)", request_id, error.code, error.message)
        return error_response(error, request_id)
    except asyncio.CancelledError:
        outcome = "cancelled"
        metrics.labelled(metrics.errors, FRONT_DOOR, ClientCancelled.default_stage.value,
                         ClientCancelled.code).inc()
        raise
    finally:
        runtime.admission.leave()
        inflight.dec()
        if outcome != "error":
            metrics.labelled(
                metrics.requests,
                FRONT_DOOR, route.value, runtime.engine_name, runtime.connector_name, outcome,
            ).inc()
        metrics.labelled(metrics.stage_seconds, FRONT_DOOR, "total").observe(
            time.perf_counter() - started
        )


def _count_error(runtime: Runtime, error: SidecarError, route: Route, outcome: str) -> None:
    metrics = runtime.metrics
    metrics.labelled(metrics.errors, FRONT_DOOR, error.stage.value, error.code).inc()
    metrics.labelled(
        metrics.requests,
        FRONT_DOOR, route.value, runtime.engine_name, runtime.connector_name, outcome,
    ).inc()


def _observe_stages(runtime: Runtime, exchange: PDExchange) -> None:
    metrics = runtime.metrics
    histogram = metrics.stage_seconds
    timings = exchange.timings
    if timings.prefill is not None:
        metrics.labelled(histogram, FRONT_DOOR, "prefill").observe(timings.prefill)
    if timings.handoff is not None:
        metrics.labelled(histogram, FRONT_DOOR, "handoff").observe(timings.handoff)
    if timings.decode_first_byte is not None:
        metrics.labelled(histogram, FRONT_DOOR, "decode_first_byte").observe(
            timings.decode_first_byte
        )


async def _relay(
    request: web.Request,
    runtime: Runtime,
    exchange: PDExchange,
    stream: bool,
    route: Route,
    request_id: str,
) -> web.StreamResponse:
    relayed = runtime.metrics.labelled(runtime.metrics.relayed_bytes, FRONT_DOOR)
    if exchange.decode is None:
        answer = exchange.answer or {}
        if stream:
            body = answer_as_sse(answer, route)
            content_type = "text/event-stream"
        else:
            body = jsonutil.dumps(answer)
            content_type = "application/json"
        relayed.inc(len(body))
        return web.Response(body=body, content_type=content_type,
                            headers={REQUEST_ID: request_id})
    headers = {name: value for name in _RELAYED_HEADERS
               if (value := exchange.decode.header(name)) is not None}
    headers[REQUEST_ID] = request_id
    if not stream:
        body = await exchange.read_all(runtime.settings.max_body_bytes)
        try:
            # A cut or garbled answer must not reach the client as a 200.
            jsonutil.loads(body)
        except jsonutil.JSONDecodeError:
            raise DecodeFailed("decode engine answered malformed JSON",
                               stage=Stage.DECODE) from None
        relayed.inc(len(body))
        return web.Response(body=body, headers=headers)
    response = _SSEResponse(status=200, headers=headers)
    await response.prepare(request)
    total = 0
    tail = b""
    try:
        async for chunk in exchange.chunks():
            await response.write(chunk)
            total += len(chunk)
            # Only the last bytes matter; slicing a long chunk alone avoids copying it whole.
            tail = chunk[-_TAIL_BYTES:] if len(chunk) >= _TAIL_BYTES else (tail + chunk)[
                -_TAIL_BYTES:]
        if not tail.rstrip().endswith(_SSE_DONE):
            # The engine closed cleanly mid-event: a cut stream, not a finished one.
            raise DecodeFailed("decode stream ended without its [DONE] event",
                               stage=Stage.DECODE)
    except SidecarError as error:
        relayed.inc(total)
        _count_error(runtime, error, route, "broken_stream")
        logger.warning("request %s: stream broke after %d bytes: %s", request_id, total, error.code)
        # A break mid-event would glue the error event onto the cut one: end that first.
        separator = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
        await response.write(separator + sse_error_event(error))
        if request.transport is not None:
            request.transport.close()
        return response
    relayed.inc(total)
    await response.write_eof()
    return response


def add_pd_routes(app: web.Application) -> None:
    for route in Route:
        app.router.add_post(route.value, _route_handler(route))
