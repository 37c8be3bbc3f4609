"""Both legs at once: a concurrent dialect's prefill and decode, the prefill watched.

    start(flow, request, ctx) ─▶ PDExchange
        prefill ║ open decode; a failed prefill fails the request at once (the decode is
        cancelled), a decode head that came meanwhile is closed
        a learning dialect (``Dialect.learns``):
          the decode counts as open once it is known not refused: a stream's first bytes
            are awaited (the relay's head leaves with them anyway) and an engine's error
            event there is a refusal, like a refused head
          a prefill answer that shows the hand-off stale (``answered_stale``) while the decode
            has not answered stops that decode (a decode engine that knew the old identity
            may wait on it for minutes)
          a refused or stopped decode whose prefill answer shows the hand-off stale is
            opened again from that answer (``decode_again``: the refused one wrote nothing)
          every later prefill answer is shown to the dialect (``learn``)
    background_prefill(...)     a gRPC Prefill's engine call after its hand-off, shown to a
                                learning dialect when it ends

Deliberate limits: only a refusal seen before the client saw a byte is sent again; the wait
for the prefill's answer after a refusal is bounded by the prefill leg's own deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping
from typing import Any, Final, Protocol

from sidecar.dialects import Dialect
from sidecar.engines.calls import EngineCalls, PrefillLeg
from sidecar.errors import DecodeFailed, Stage
from sidecar.http1 import UpstreamError, UpstreamResponse
from sidecar.observability.tracing import RequestTrace
from sidecar.protocol.context import HandoffContext
from sidecar.request.exchange import PDExchange, as_prefill_error, cancel_legs
from sidecar.request.pd_request import PDRequest
from sidecar.request.scope import Timings
from sidecar.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: The media type of a streamed answer (a learning dialect's decode is checked at its start).
EVENT_STREAM: Final = "text/event-stream"


class PDFlow(Protocol):
    """What the flow (``sidecar.request.runner.PDFlow``) lends these functions."""

    dialect: Dialect
    calls: EngineCalls

    def _leg(self, request: PDRequest, ctx: HandoffContext) -> PrefillLeg: ...

    def _handoff(self, response: dict[str, Any] | None, ctx: HandoffContext,
                 trace: RequestTrace) -> dict[str, Any]: ...

    def _open_decode(self, request: PDRequest, ctx: HandoffContext,
                     body: Mapping[str, Any]) -> Awaitable[UpstreamResponse]: ...

    def abort(self, ctx: HandoffContext) -> None: ...

    def end(self, ctx: HandoffContext) -> None: ...


async def start(flow: PDFlow, request: PDRequest, ctx: HandoffContext) -> PDExchange:
    """Both legs of ``request`` at once, until the decode response head has arrived."""
    dialect = flow.dialect
    timings = Timings()
    leg = flow._leg(request, ctx)
    decode_body = dialect.decode_body(
        request.body, flow._handoff(None, ctx, request.trace), ctx.decode_rank
    )
    started = time.perf_counter()
    prefill_task = asyncio.ensure_future(flow.calls.post_prefill(leg))
    opening = flow._open_decode(request, ctx, decode_body)
    if dialect.learns:
        opening = opened_unrefused(dialect, ctx, opening)
    decode_task = asyncio.ensure_future(opening)
    try:
        while not decode_task.done():
            waiting: set[asyncio.Future[Any]] = {decode_task}
            if not prefill_task.done():
                waiting.add(prefill_task)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and not prefill_task.cancelled():
                error = prefill_task.exception()
                if error is not None:
                    raise as_prefill_error(error)
                if (dialect.learns and not decode_task.done()
                        and dialect.answered_stale(prefill_task.result(), ctx)):
                    # The answer disproves the decode's hand-off before the decode answered
                    # (an engine that knew the old identity may wait on it for minutes).
                    await _drop(decode_task)
                    raise DecodeFailed("decode sent with a hand-off the prefill's answer "
                                       "disproves", stage=Stage.DECODE)
        decode = decode_task.result()
    except DecodeFailed as refused:
        if not dialect.learns:
            await cancel_and_wait(prefill_task)
            raise
        return await decode_again(flow, request, ctx, prefill_task, refused, timings)
    except BaseException:
        await cancel_legs(decode_task, prefill_task)
        raise
    timings.decode_first_byte = time.perf_counter() - started
    if prefill_task.done():
        timings.prefill = time.perf_counter() - started
    if dialect.learns:
        prefill_task.add_done_callback(lambda task: learn(dialect, task, ctx))
    exchange = PDExchange(ctx=ctx, decode=decode, timings=timings, prefill_task=prefill_task,
                          owner=flow)
    exchange.watch_prefill()
    return exchange


async def _drop(decode_task: asyncio.Task[UpstreamResponse]) -> None:
    """Stop a decode leg (closing its connection tells the engine), its head if it came."""
    await cancel_and_wait(decode_task)
    if not decode_task.cancelled() and decode_task.exception() is None:
        decode_task.result().close()


async def opened_unrefused(dialect: Dialect, ctx: HandoffContext,
                           opening: Awaitable[UpstreamResponse]) -> UpstreamResponse:
    """A learning dialect's concurrent decode, once it is known not refused: an event
    stream's first bytes are awaited (left for the relay), and an engine's error event there
    is a ``DecodeFailed`` like a refused head (an engine may fail a stream after its 200)."""
    decode = await opening
    content_type = decode.header("content-type") or ""
    if not content_type.startswith(EVENT_STREAM):
        return decode
    error_event = dialect.stream_markers(ctx.route).error_event
    try:
        first = await decode.peek()
    except (UpstreamError, TimeoutError):
        decode.close()
        raise DecodeFailed("decode engine broke its stream", stage=Stage.DECODE) from None
    except BaseException:
        decode.close()
        raise
    if error_event is not None and first.startswith(error_event):
        decode.close()
        raise DecodeFailed("decode engine failed the request in its stream's first event",
                           stage=Stage.DECODE)
    return decode


def learn(dialect: Dialect, task: asyncio.Future[dict[str, Any]], ctx: HandoffContext) -> None:
    """Show a learning dialect a concurrent prefill's answer (its news kept for later
    requests; this one's decode is already on its way)."""
    if not task.cancelled() and task.exception() is None:
        dialect.answered_stale(task.result(), ctx)


async def decode_again(
    flow: PDFlow, request: PDRequest, ctx: HandoffContext,
    prefill_task: asyncio.Task[dict[str, Any]], refused: DecodeFailed, timings: Timings,
) -> PDExchange:
    """A concurrent decode the engine refused: when the prefill's answer shows the hand-off
    was stale (a prefill engine restarted under a new identity), the decode goes again,
    built from that answer; else ``refused`` is raised."""
    try:
        response = await prefill_task
    except BaseException:
        await cancel_and_wait(prefill_task)
        raise
    if not flow.dialect.answered_stale(response, ctx):
        raise refused
    logger.info("request %s: the decode refused a stale hand-off (%s); sent again from the "
                "prefill's answer", request.request_id, refused.message)
    decode_body = flow.dialect.decode_body(
        request.body, flow._handoff(response, ctx, request.trace), ctx.decode_rank)
    decode_started = time.perf_counter()
    decode = await flow._open_decode(request, ctx, decode_body)
    timings.decode_first_byte = time.perf_counter() - decode_started
    return PDExchange(ctx=ctx, decode=decode, timings=timings, owner=flow,
                      prefill_response=response)


async def background_prefill(dialect: Dialect, calls: EngineCalls, leg: PrefillLeg,
                             ctx: HandoffContext) -> None:
    """A gRPC Prefill's engine call after its hand-off; a learning dialect sees how it
    ended (its answer, or the failure)."""
    if not dialect.learns:
        await calls.post_prefill(leg)
        return
    try:
        response = await calls.post_prefill(leg)
    except Exception as error:
        dialect.leg_failed(error, ctx)
        raise
    dialect.answered_stale(response, ctx)
