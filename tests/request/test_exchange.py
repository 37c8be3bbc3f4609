"""Proves ``PDExchange`` (sidecar/request/legs.py), the relay's side of a PD request, on a
fake decode response the test feeds and a fake owner (no sockets):

- ``chunks()`` yields the engine's reads as they come and marks the exchange completed at the
  body's end; ``pipe()`` hands the same bytes to a sink (waiting for ``catch_up`` when the
  sink is full); ``read_all()`` concatenates, and a body over its cap is a ``DecodeFailed``
  that leaves the exchange unfinished; a broken stream is ``DecodeFailed``, a stalled one
  ``DeadlineExceeded``, both at the decode stage; an exchange answered by its prefill has no
  stream to read;
- the prefill watch: a concurrent prefill that fails closes the decode, so a pending read
  fails at once with the prefill's own error (a crash as ``PrefillFailed``), in ``chunks``
  and in ``pipe``, even when the decode body had already ended; a cancelled or successful
  prefill changes nothing;
- ``aclose()``: idempotent; closes the decode, cancels a running prefill, aborts the legs only
  when a decode ran and did not complete, and always ends the dialect state.

It does not prove the flow that builds exchanges (tests/core/test_flow.py) nor the real
``UpstreamResponse`` (tests/http1).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from flow_builders import FakeUpstream, as_upstream
from protocol_builders import make_ctx

from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    PrefillFailed,
    SidecarError,
    Stage,
)
from sidecar.http1 import UpstreamBroken, UpstreamProtocolError
from sidecar.protocol.context import HandoffContext
from sidecar.request.legs import PDExchange, as_prefill_error

CTX = make_ctx()
#: Bounds a read that only the prefill watch can end (a broken watch fails, not hangs).
WATCH_BOUND_S = 5.0


class Owner:
    """Records what an exchange asks of the flow that started it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, HandoffContext]] = []

    def abort(self, ctx: HandoffContext) -> None:
        self.calls.append(("abort", ctx))

    def end(self, ctx: HandoffContext) -> None:
        self.calls.append(("end", ctx))


def exchange_of(decode: FakeUpstream | None, *, owner: Owner | None = None,
                prefill_task: asyncio.Task[Any] | None = None,
                answer: dict[str, Any] | None = None) -> PDExchange:
    exchange = PDExchange(ctx=CTX, decode=None if decode is None else as_upstream(decode),
                          answer=answer, prefill_task=prefill_task, owner=owner)
    exchange.watch_prefill()
    return exchange


async def held_prefill() -> tuple[asyncio.Future[Any], asyncio.Task[Any]]:
    """A running prefill task that ends as the returned future does."""
    held: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def prefill() -> Any:
        return await held

    return held, asyncio.ensure_future(prefill())


# -- reading the decode body ----------------------------------------------------------------


async def test_chunks_come_as_the_engine_writes_them() -> None:
    decode = FakeUpstream()
    exchange = exchange_of(decode)
    chunks = exchange.chunks()
    decode.feed(b"data: 1\n\n")
    assert await anext(chunks) == b"data: 1\n\n"
    decode.feed(b"data: 2\n\ndata: 3\n\n")
    assert await anext(chunks) == b"data: 2\n\ndata: 3\n\n"
    assert not exchange.completed
    decode.feed(b"")
    with pytest.raises(StopAsyncIteration):
        await anext(chunks)
    assert exchange.completed


async def test_pipe_hands_every_read_to_the_sink_and_waits_when_it_is_full() -> None:
    decode = FakeUpstream(b"a", b"bb", b"ccc", b"")
    exchange = exchange_of(decode)
    taken: list[bytes] = []
    caught_up: list[int] = []

    def sink(data: bytes) -> bool:
        taken.append(data)
        return len(data) != 2  # "full" after the second read

    async def catch_up() -> None:
        caught_up.append(len(taken))

    await exchange.pipe(sink, catch_up)
    assert taken == [b"a", b"bb", b"ccc"]
    assert caught_up == [2]
    assert exchange.completed


async def test_read_all_concatenates_and_caps() -> None:
    exchange = exchange_of(FakeUpstream(b'{"a"', b": 1}", b""))
    assert await exchange.read_all(8) == b'{"a": 1}'
    assert exchange.completed
    capped = exchange_of(FakeUpstream(b"12345", b"6789", b""))
    with pytest.raises(DecodeFailed) as raised:
        await capped.read_all(8)
    assert raised.value.stage is Stage.DECODE
    assert not capped.completed  # so its close aborts the legs


@pytest.mark.parametrize(("error", "expected"), [
    (UpstreamBroken("reset"), DecodeFailed),
    (UpstreamProtocolError("garbage"), DecodeFailed),
    (TimeoutError(), DeadlineExceeded),
], ids=["broken", "protocol", "stalled"])
async def test_a_broken_stream_is_a_decode_error(
    error: Exception, expected: type[SidecarError]
) -> None:
    for read in ("chunks", "pipe"):
        exchange = exchange_of(FakeUpstream(b"data: 1\n\n", error))
        with pytest.raises(expected) as raised:
            if read == "chunks":
                async for _ in exchange.chunks():
                    pass
            else:
                await exchange.pipe(lambda data: True, _nothing)
        assert raised.value.stage is Stage.DECODE
        assert not exchange.completed


async def _nothing() -> None:
    return None


async def test_an_exchange_answered_by_its_prefill_has_no_stream() -> None:
    exchange = exchange_of(None, answer={"choices": []})
    with pytest.raises(SidecarError):
        await anext(exchange.chunks())
    with pytest.raises(SidecarError):
        await exchange.pipe(lambda data: True, _nothing)


# -- the prefill watch ----------------------------------------------------------------------


@pytest.mark.parametrize("read", ["chunks", "pipe"])
async def test_a_failing_prefill_breaks_the_pending_read_with_its_error(read: str) -> None:
    held, task = await held_prefill()
    decode = FakeUpstream(b"data: 1\n\n")
    exchange = exchange_of(decode, prefill_task=task)
    got: list[bytes] = []

    def sink(data: bytes) -> bool:
        got.append(data)
        return True

    async def relay() -> None:
        if read == "chunks":
            async for chunk in exchange.chunks():
                got.append(chunk)
        else:
            await exchange.pipe(sink, _nothing)

    reader = asyncio.ensure_future(relay())
    await decode.reading.wait()  # the first read was handed over; the next one waits
    failure = PrefillFailed("prefill engine answered 503")
    held.set_exception(failure)
    with pytest.raises(PrefillFailed) as raised:
        async with asyncio.timeout(WATCH_BOUND_S):
            await reader
    assert raised.value is failure
    assert got == [b"data: 1\n\n"]
    assert decode.closed
    assert exchange.prefill_error is failure
    assert not exchange.completed


async def test_a_crashed_prefill_breaks_the_stream_as_prefill_failed() -> None:
    held, task = await held_prefill()
    decode = FakeUpstream(b"data: 1\n\n")
    exchange = exchange_of(decode, prefill_task=task)
    chunks = exchange.chunks()
    assert await anext(chunks) == b"data: 1\n\n"
    held.set_exception(RuntimeError("crash"))
    with pytest.raises(PrefillFailed) as raised:
        async with asyncio.timeout(WATCH_BOUND_S):
            await anext(chunks)
    assert raised.value.args == ("prefill leg failed unexpectedly",)  # never a class name
    assert decode.closed


async def test_a_prefill_failure_before_the_last_read_fails_a_body_that_ended() -> None:
    held, task = await held_prefill()
    decode = FakeUpstream(b"data: 1\n\n", b"")  # the whole body already arrived
    exchange = exchange_of(decode, prefill_task=task)
    failure = PrefillFailed("prefill engine answered 503")
    held.set_exception(failure)
    with pytest.raises(PrefillFailed):
        await task  # the watch's callback ran first (registered first)
    assert exchange.prefill_error is failure and decode.closed
    chunks = [chunk async for chunk in _until_error(exchange)]
    assert chunks == [b"data: 1\n\n", failure]
    assert not exchange.completed


async def _until_error(exchange: PDExchange) -> Any:
    try:
        async for chunk in exchange.chunks():
            yield chunk
    except SidecarError as error:
        yield error


async def test_a_successful_or_cancelled_prefill_leaves_the_stream_alone() -> None:
    held, task = await held_prefill()
    decode = FakeUpstream()
    exchange = exchange_of(decode, prefill_task=task)
    held.set_result({"choices": []})
    await task
    _, cancelled = await held_prefill()
    other = FakeUpstream()
    other_exchange = exchange_of(other, prefill_task=cancelled)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    decode.feed(b"x")
    decode.feed(b"")
    assert await exchange.read_all(10) == b"x"
    assert not decode.closed and not other.closed
    assert exchange.prefill_error is None and other_exchange.prefill_error is None


def test_as_prefill_error_keeps_the_taxonomy() -> None:
    error = DeadlineExceeded("prefill timed out")
    assert as_prefill_error(error) is error
    crash = as_prefill_error(KeyError("x"))
    assert isinstance(crash, PrefillFailed) and crash.stage is Stage.PREFILL


# -- aclose ---------------------------------------------------------------------------------


async def test_aclose_of_an_unfinished_decode_aborts_and_ends_once() -> None:
    owner = Owner()
    _, task = await held_prefill()
    decode = FakeUpstream(b"data: 1\n\n")
    exchange = exchange_of(decode, owner=owner, prefill_task=task)
    await exchange.aclose()
    await exchange.aclose()
    assert owner.calls == [("abort", CTX), ("end", CTX)]
    assert decode.closed
    assert task.cancelled()


async def test_aclose_of_a_completed_decode_only_ends_the_state() -> None:
    owner = Owner()
    decode = FakeUpstream(b"data: 1\n\n", b"")
    exchange = exchange_of(decode, owner=owner)
    assert await exchange.read_all(100) == b"data: 1\n\n"
    await exchange.aclose()
    assert owner.calls == [("end", CTX)]
    assert decode.closed


async def test_aclose_of_an_answer_only_ends_the_state() -> None:
    owner = Owner()
    exchange = exchange_of(None, owner=owner, answer={"choices": []})
    await exchange.aclose()
    assert owner.calls == [("end", CTX)]


async def test_aclose_without_an_owner_only_closes_the_decode() -> None:
    decode = FakeUpstream(b"data: 1\n\n")
    exchange = exchange_of(decode)
    await exchange.aclose()
    assert decode.closed and not decode.released


async def test_aclose_after_a_prefill_failure_aborts() -> None:
    owner = Owner()
    held, task = await held_prefill()
    decode = FakeUpstream()
    exchange = exchange_of(decode, owner=owner, prefill_task=task)
    held.set_exception(PrefillFailed("gone"))
    with pytest.raises(PrefillFailed):
        async for _ in exchange.chunks():
            pass
    await exchange.aclose()
    assert owner.calls == [("abort", CTX), ("end", CTX)]


async def test_aclose_cancelled_by_its_caller_still_ends_the_legs_then_raises() -> None:
    """The caller's cancellation, while the prefill is still stopping, propagates (it was
    swallowed: a cancelled relay returned normally) and the legs and state are still ended."""
    owner = Owner()
    stopping, release = asyncio.Event(), asyncio.Event()

    async def slow_prefill() -> dict[str, Any]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await release.wait()
            raise
        return {}

    task = asyncio.ensure_future(slow_prefill())
    await asyncio.sleep(0)
    exchange = exchange_of(FakeUpstream(b"data: 1\n\n"), owner=owner, prefill_task=task)
    closing = asyncio.ensure_future(exchange.aclose())
    await stopping.wait()
    closing.cancel()
    await asyncio.sleep(0)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert task.cancelled()
    assert owner.calls == [("abort", CTX), ("end", CTX)]
