"""How a stub answer goes on the wire, with the fault switches applied.

Engine handlers return a ``JsonReply`` (one JSON body) or a ``StreamReply`` (SSE events,
each already ``data: ...\\n\\n``, written and flushed one by one, as the engines do); ``send``
writes it, bending it first when the request drew a fault (see ``faults``).

A ``StreamReply`` may say how its engine fails after the head on its route (``failure``:
the bytes the ``error_event`` fault writes then; None: the engine cuts the connection, as
vLLM's Responses stream does). Events are written as the handler made them (``data:`` lines,
or ``event:`` + ``data:`` for the Responses and Messages routes).

Deliberate limits: a dropped connection is a transport abort, so the client sees a reset or an
incomplete chunked body, never a clean end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from sidecar import jsonutil
from sidecar.tools.stubs.faults import Fault, FaultBook, FaultKind

SSE_DONE: Final = b"data: [DONE]\n\n"
JSON_CT: Final = "application/json"
SSE_CT: Final = "text/event-stream"
_MALFORMED_BODY: Final = b'{"id": "cmpl-stub", "choices": [{"text": "oops"}, ]'
_MALFORMED_EVENT: Final = b"data: {'this is': not json}\n\n"
#: vLLM's and SGLang's in-stream error event, as their ``json.dumps`` writes it.
_ERROR_EVENT: Final = ("data: " + json.dumps({"error": {
    "message": "stub fault: KV load failed", "type": "InternalServerError", "code": 500,
}}) + "\n\n").encode()

ErrorRenderer = Callable[[int, str], Any]


@dataclass(frozen=True)
class JsonReply:
    body: Any
    status: int = 200


@dataclass(frozen=True)
class StreamReply:
    events: AsyncIterator[bytes]
    #: What the ``error_event`` fault writes before the stream ends (None: a cut connection).
    failure: bytes | None = _ERROR_EVENT + SSE_DONE


Reply = JsonReply | StreamReply


def sse(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + jsonutil.dumps(obj) + b"\n\n"


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=jsonutil.dumps(body), status=status, content_type=JSON_CT)


async def send(
    request: web.Request, reply: Reply, fault: Fault | None, book: FaultBook
) -> web.StreamResponse:
    """Write ``reply``, applying ``fault`` (pre-handler faults were applied by the server)."""
    if isinstance(reply, JsonReply):
        return await _send_json(request, reply, fault, book)
    return await _send_stream(request, reply, fault, book)


async def _send_json(
    request: web.Request, reply: JsonReply, fault: Fault | None, book: FaultBook
) -> web.StreamResponse:
    kind = fault.kind if fault is not None else None
    body = reply.body
    if kind is FaultKind.OVERSIZED and fault is not None:
        if isinstance(body, dict):
            body = {**body, "stub_padding": "x" * fault.size}
        else:
            body = {"data": body, "stub_padding": "x" * fault.size}
    data = jsonutil.dumps(body)
    content_type = JSON_CT
    if kind is FaultKind.TRUNCATE:
        data = data[: max(1, len(data) // 2)]
    elif kind is FaultKind.MALFORMED:
        data = _MALFORMED_BODY
    elif kind is FaultKind.CONTENT_TYPE:
        content_type = "text/html"
    elif kind is FaultKind.DROP:
        _abort(request)
        return web.Response(status=reply.status)
    elif kind is FaultKind.STALL:
        resp = web.StreamResponse(status=reply.status)
        resp.content_type = JSON_CT
        resp.content_length = len(data)
        await resp.prepare(request)
        await book.hang()
        return resp
    return web.Response(body=data, status=reply.status, content_type=content_type)


async def _send_stream(
    request: web.Request, reply: StreamReply, fault: Fault | None, book: FaultBook
) -> web.StreamResponse:
    kind = fault.kind if fault is not None else None
    resp = web.StreamResponse(status=200)
    resp.content_type = "text/html" if kind is FaultKind.CONTENT_TYPE else SSE_CT
    resp.headers["Cache-Control"] = "no-cache"
    await resp.prepare(request)
    try:
        await _write_events(request, resp, reply.events, fault, book, reply.failure)
    finally:
        aclose = getattr(reply.events, "aclose", None)
        if aclose is not None:
            await aclose()
    return resp


async def _write_events(
    request: web.Request,
    resp: web.StreamResponse,
    events: AsyncIterator[bytes],
    fault: Fault | None,
    book: FaultBook,
    failure: bytes | None = _ERROR_EVENT + SSE_DONE,
) -> None:
    kind = fault.kind if fault is not None else None
    after = fault.after_chunks if fault is not None else 0
    index = 0
    async for event in events:
        if index == after and kind is not None:
            if kind is FaultKind.DROP:
                _abort(request)
                return
            if kind is FaultKind.STALL:
                await book.hang()
                return
            if kind is FaultKind.TRUNCATE:
                await resp.write(event[: max(1, len(event) // 2)])
                await resp.write_eof()
                return
            if kind is FaultKind.ERROR_EVENT:
                if failure is None:
                    _abort(request)
                    return
                if failure == _ERROR_EVENT + SSE_DONE and fault is not None and (
                        fault.status != 500):
                    # The OpenAI routes' error event with the fault's own code (a 4xx: the
                    # request's fault, as an engine reports one it found mid-stream).
                    failure = ("data: " + json.dumps({"error": {
                        "message": fault.message, "type": "BadRequestError",
                        "code": fault.status}}) + "\n\n").encode() + SSE_DONE
                await resp.write(failure)
                await resp.write_eof()
                return
            if kind is FaultKind.MALFORMED:
                event = _MALFORMED_EVENT
            elif kind is FaultKind.OVERSIZED and fault is not None:
                await resp.write(sse({"stub_padding": "x" * fault.size}))
        await resp.write(event)
        index += 1
    if kind is FaultKind.LINGER:
        await book.hang()
        return
    await resp.write_eof()


def _abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()
