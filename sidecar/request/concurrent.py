"""Both legs at once: a concurrent dialect's way of running a pair, the prefill watched.

    run(pair) ─▶ PDExchange
        prefill ║ open decode; a failed prefill fails the pair at once (the decode is
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
          a refusal the identity does not explain ends the pair at once, its prefill
            cancelled (its KV released), never waiting for the prefill's answer
          every later prefill answer is shown to the dialect (``learn``)

Everything a way does with the pair goes through ``Pair``'s public surface
(``sidecar.request.legs``): the prefill leg, the hand-off, the decode body and its opening.

Deliberate limits: only a refusal seen before the client saw a byte is sent again; the wait
for the prefill's answer after a refusal is bounded by the prefill leg's own deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, Final

from sidecar.dialects import Dialect
from sidecar.engines.failures import engine_reason
from sidecar.errors import DecodeFailed, Stage
from sidecar.http1 import UpstreamError, UpstreamResponse
from sidecar.protocol.context import HandoffContext
from sidecar.request.legs import Pair, PDExchange, as_prefill_error, cancel_legs
from sidecar.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: The media type of a streamed answer (a learning dialect's decode is checked at its start).
EVENT_STREAM: Final = "text/event-stream"


class StaleRefusal(DecodeFailed):
    """A decode refused or stopped on a hand-off that may be stale: the prefill's answer
    decides whether it goes again (only these wait for that answer)."""


async def run(pair: Pair) -> PDExchange:
    """Both legs of ``pair`` at once, until the decode response head has arrived."""
    dialect, ctx, timings = pair.dialect, pair.ctx, pair.timings
    decode_body = pair.decode_body(pair.handoff(None))
    started = time.perf_counter()
    prefill_task = asyncio.ensure_future(pair.calls.post_prefill(pair.prefill_leg()))
    opening = pair.open_decode(decode_body)
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
                    raise StaleRefusal("decode sent with a hand-off the prefill's answer "
                                       "disproves", stage=Stage.DECODE)
        decode = decode_task.result()
    except StaleRefusal as refused:
        return await decode_again(pair, prefill_task, refused)
    except BaseException:
        await cancel_legs(decode_task, prefill_task)
        raise
    timings.decode_first_byte = time.perf_counter() - started
    if prefill_task.done():
        timings.prefill = time.perf_counter() - started
    if dialect.learns:
        prefill_task.add_done_callback(lambda task: learn(dialect, task, ctx))
    exchange = pair.exchange(decode, prefill_task=prefill_task)
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
    is a refusal like a refused head (an engine may fail a stream after its 200). A refusal
    the dialect says the hand-off may explain is a ``StaleRefusal``; any other, a plain
    ``DecodeFailed``, ends the pair at once."""
    try:
        decode = await opening
    except DecodeFailed as head_refused:
        if dialect.refusal_may_be_stale(head_refused, ctx):
            raise StaleRefusal(head_refused.message, stage=head_refused.stage) from None
        raise
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
        refused = DecodeFailed("decode engine failed the request in its stream's first event",
                               stage=Stage.DECODE)
        refused.engine_reason = event_reason(first)
        if dialect.refusal_may_be_stale(refused, ctx):
            raise StaleRefusal(refused.message, stage=refused.stage)
        raise refused
    return decode


def event_reason(stream_start: bytes) -> str | None:
    """The engine's own words in the error event a stream starts with (None: none)."""
    event = stream_start.split(b"\n\n", 1)[0]
    data = b"\n".join(line.partition(b":")[2].strip() for line in event.split(b"\n")
                      if line.startswith(b"data:"))
    return engine_reason(data) if data else None


def learn(dialect: Dialect, task: asyncio.Future[dict[str, Any]], ctx: HandoffContext) -> None:
    """Show a learning dialect a concurrent prefill's answer (its news kept for later
    requests; this one's decode is already on its way)."""
    if not task.cancelled() and task.exception() is None:
        dialect.answered_stale(task.result(), ctx)


async def decode_again(pair: Pair, prefill_task: asyncio.Task[dict[str, Any]],
                       refused: StaleRefusal) -> PDExchange:
    """A concurrent decode refused on a hand-off that may be stale: when the prefill's answer
    shows it was (a prefill engine restarted under a new identity), the decode goes again,
    built from that answer; else the refusal is the pair's error."""
    try:
        response = await prefill_task
    except BaseException:
        await cancel_and_wait(prefill_task)
        raise
    if not pair.dialect.answered_stale(response, pair.ctx):
        raise DecodeFailed(refused.message, stage=refused.stage)
    logger.info("request %s: the decode refused a stale hand-off (%s); sent again from the "
                "prefill's answer", pair.request.request_id, refused.message)
    decode_body = pair.decode_body(pair.handoff(response))
    decode_started = time.perf_counter()
    decode = await pair.open_decode(decode_body)
    pair.timings.decode_first_byte = time.perf_counter() - decode_started
    return pair.exchange(decode, prefill_response=response)
