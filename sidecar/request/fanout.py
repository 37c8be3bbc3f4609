"""Several PD pairs for one client request, run concurrently, failing and ending together.

    start_all(start, [PDRequest ...]) ─▶ FanOut   every pair's decode head has arrived
        .exchanges        one PDExchange per sub-request, in choice-index order
        .read_all(cap)    every decode body (JSON answers), read concurrently
        .chunks()         (k, chunk) from every decode stream as it arrives, interleaved
        .aclose()         close every exchange (engines aborted where they have an abort)

Each sub-request is an ordinary single request of the core (``Runner.start``), with its own
hand-off context and request id; the first to fail cancels the others and its error is the
request's (docs/driving/request-shapes.md). Deliberate limits: decode streams are read into a
bounded queue, so a slow client slows every leg alike; the interleaving follows arrival.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Final

from sidecar.errors import DecodeFailed, SidecarError, Stage
from sidecar.request.legs import PDExchange, PDRequest
from sidecar.tasks import cancel_and_wait, wait_to_the_end

logger = logging.getLogger(__name__)

#: Chunks buffered from all legs before their readers wait for the client.
_QUEUE_CHUNKS: Final = 64

StartOne = Callable[[PDRequest], Awaitable[PDExchange]]


def sub_request_id(request_id: str, index: int) -> str:
    """The request id sub-request ``index`` carries to the engines (``<id>-<index>``)."""
    return f"{request_id}-{index}"


async def _first_failure(tasks: Sequence[asyncio.Task[object]]) -> None:
    """Wait for every task; on the first failure cancel the rest and raise its error."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                await cancel_and_wait(*pending)
                error = task.exception()
                assert error is not None
                raise error


class FanOut:
    """The running sub-requests of one client request."""

    def __init__(self, exchanges: list[PDExchange]) -> None:
        self.exchanges = exchanges
        self._closed = False

    async def read_all(self, max_bytes: int) -> list[bytes]:
        """Every decode body, in order; the first failure cancels the other reads."""
        tasks = [asyncio.ensure_future(self._read(exchange, max_bytes))
                 for exchange in self.exchanges]
        try:
            await _first_failure(tasks)
        finally:
            await cancel_and_wait(*tasks)
        return [task.result() for task in tasks]

    @staticmethod
    async def _read(exchange: PDExchange, max_bytes: int) -> bytes:
        if exchange.decode is None:
            return b""  # answered by its prefill: the caller reads ``exchange.answer``
        return await exchange.read_all(max_bytes)

    async def chunks(self) -> AsyncIterator[tuple[int, bytes | None]]:
        """``(k, chunk)`` from every decode stream as it arrives; ``(k, None)`` ends leg k; a
        leg's failure raises its ``SidecarError``; legs answered by their prefill yield nothing."""
        queue: asyncio.Queue[tuple[int, bytes | None] | BaseException] = asyncio.Queue(
            _QUEUE_CHUNKS)
        readers = [asyncio.ensure_future(self._pump(k, exchange, queue))
                   for k, exchange in enumerate(self.exchanges) if exchange.decode is not None]
        remaining = len(readers)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item[1] is None:
                    remaining -= 1
                yield item
        finally:
            await cancel_and_wait(*readers)

    @staticmethod
    async def _pump(k: int, exchange: PDExchange,
                    queue: asyncio.Queue[tuple[int, bytes | None] | BaseException]) -> None:
        try:
            async for chunk in exchange.chunks():
                await queue.put((k, chunk))
        except SidecarError as error:
            await queue.put(error)
            return
        except Exception:
            # Whatever ends a reader ends its leg for the consumer, or chunks() waits for ever.
            logger.exception("sub-request %d: decode stream reader failed", k)
            await queue.put(DecodeFailed("decode stream failed unexpectedly",
                                         stage=Stage.DECODE))
            return
        await queue.put((k, None))

    async def aclose(self) -> None:
        """Close every sub-request (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(exchange.aclose() for exchange in self.exchanges),
                             return_exceptions=True)


async def start_all(start: StartOne, requests: Sequence[PDRequest]) -> FanOut:
    """Start every sub-request concurrently; returns once every decode head has arrived (the
    first failure, or the caller's cancellation, cancels the others)."""
    tasks = [asyncio.ensure_future(start(request)) for request in requests]
    try:
        await _first_failure(tasks)
    except BaseException:
        try:
            await cancel_and_wait(*tasks)
        finally:  # the caller's cancellation too: pairs that had started are closed
            started = [task.result() for task in tasks
                       if not task.cancelled() and task.exception() is None]
            # All at once, each as a task of its own: another cancellation of the caller
            # cannot skip a close (each ends its legs and gives its ids and rank back).
            await wait_to_the_end(asyncio.ensure_future(FanOut(started).aclose()))
        raise
    return FanOut([task.result() for task in tasks])
