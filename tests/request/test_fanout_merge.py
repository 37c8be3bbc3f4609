"""Proves the core's fan-out (sidecar/request/fanout.py): several PD pairs for one request,
started, read and ended together, over exchanges on fake decode responses (no sockets):

- ``start_all`` returns the exchanges in request order whatever order they started in; the
  first failure is raised as it is, cancels the starts still running and closes the
  exchanges already started; a cancelled caller does the same;
- ``FanOut.chunks`` yields ``(k, chunk)`` in arrival order across legs and ``(k, None)`` at
  each leg's end, skips legs answered by their prefill, and raises a leg's error, stopping
  the other readers;
- ``FanOut.read_all`` reads every body concurrently, in order (b"" for an answered leg); the
  first failure cancels the other reads and is raised;
- ``aclose`` closes every exchange, once; ``sub_request_id`` is ``<id>-<k>``.

It does not prove the HTTP door's merge of answers and streams (tests/http/test_fanout.py
over stubs; tests/protocol for the merge rules) nor the flow behind ``start``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from flow_builders import FakeUpstream, as_upstream, pd_request
from protocol_builders import completions_body, make_ctx

from sidecar.errors import DecodeFailed, PrefillFailed
from sidecar.http1 import UpstreamBroken
from sidecar.protocol.context import HandoffContext
from sidecar.request.fanout import FanOut, start_all, sub_request_id
from sidecar.request.legs import PDExchange, PDRequest


class Owner:
    def __init__(self) -> None:
        self.ended: list[HandoffContext] = []

    def abort(self, ctx: HandoffContext) -> None:
        pass

    def end(self, ctx: HandoffContext) -> None:
        self.ended.append(ctx)


def exchange(decode: FakeUpstream | None, owner: Owner | None = None,
             answer: dict[str, Any] | None = None) -> PDExchange:
    return PDExchange(ctx=make_ctx(), decode=None if decode is None else as_upstream(decode),
                      answer=answer, owner=owner)


def requests(count: int) -> list[PDRequest]:
    return [pd_request(completions_body(), request_id=sub_request_id("rq", k))
            for k in range(count)]


class Starts:
    """A ``start`` whose sub-requests each end as the test resolves their futures."""

    def __init__(self, count: int) -> None:
        loop = asyncio.get_running_loop()
        self.held: dict[str, asyncio.Future[Any]] = {
            sub_request_id("rq", k): loop.create_future() for k in range(count)}
        self.cancelled: list[str] = []
        #: Set once every start waits; ``returned[id]`` once that start has returned.
        self.entered = asyncio.Event()
        self.returned = {request_id: asyncio.Event() for request_id in self.held}
        self._waiting = 0

    async def __call__(self, request: PDRequest) -> PDExchange:
        held = self.held[request.request_id]
        self._waiting += 1
        if self._waiting == len(self.held):
            self.entered.set()
        try:
            outcome = await held
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        if isinstance(outcome, BaseException):
            raise outcome
        self.returned[request.request_id].set()
        return outcome  # type: ignore[no-any-return]


def test_sub_request_ids() -> None:
    assert [sub_request_id("abc", k) for k in range(3)] == ["abc-0", "abc-1", "abc-2"]


# -- start_all ------------------------------------------------------------------------------


async def test_start_all_keeps_request_order() -> None:
    starts = Starts(3)
    exchanges = [exchange(FakeUpstream()) for _ in range(3)]
    task = asyncio.ensure_future(start_all(starts, requests(3)))
    await starts.entered.wait()
    for k in (2, 0, 1):
        starts.held[f"rq-{k}"].set_result(exchanges[k])
    fanout = await task
    assert fanout.exchanges == exchanges


async def test_the_first_failure_cancels_the_others_and_closes_the_started() -> None:
    starts = Starts(3)
    owner = Owner()
    decode = FakeUpstream()
    started = exchange(decode, owner)
    task = asyncio.ensure_future(start_all(starts, requests(3)))
    await starts.entered.wait()
    failure = PrefillFailed("prefill engine answered 500")
    starts.held["rq-0"].set_result(started)
    starts.held["rq-1"].set_exception(failure)
    with pytest.raises(PrefillFailed) as raised:
        await task
    assert raised.value is failure
    assert starts.cancelled == ["rq-2"]
    assert decode.closed and owner.ended == [started.ctx]


async def test_a_cancelled_caller_cancels_every_start_and_closes_the_started() -> None:
    starts = Starts(2)
    owner = Owner()
    decode = FakeUpstream()
    started = exchange(decode, owner)
    task = asyncio.ensure_future(start_all(starts, requests(2)))
    await starts.entered.wait()
    starts.held["rq-0"].set_result(started)
    await starts.returned["rq-0"].wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert starts.cancelled == ["rq-1"]
    assert decode.closed and owner.ended == [started.ctx]


# -- chunks ---------------------------------------------------------------------------------


async def test_chunks_interleave_as_they_arrive() -> None:
    legs = [FakeUpstream(), FakeUpstream()]
    answered = exchange(None, answer={"choices": []})
    fanout = FanOut([exchange(legs[0]), answered, exchange(legs[1])])
    chunks = fanout.chunks()
    legs[1].feed(b"b1")
    assert await anext(chunks) == (2, b"b1")
    legs[0].feed(b"a1")
    assert await anext(chunks) == (0, b"a1")
    legs[1].feed(b"b2")
    assert await anext(chunks) == (2, b"b2")
    legs[1].feed(b"")
    assert await anext(chunks) == (2, None)
    legs[0].feed(b"")
    assert await anext(chunks) == (0, None)
    with pytest.raises(StopAsyncIteration):
        await anext(chunks)


async def test_a_legs_error_is_raised_and_stops_the_other_readers() -> None:
    legs = [FakeUpstream(), FakeUpstream()]
    fanout = FanOut([exchange(legs[0]), exchange(legs[1])])
    chunks = fanout.chunks()
    legs[0].feed(b"a1")
    assert await anext(chunks) == (0, b"a1")
    await legs[1].reading.wait()
    legs[0].feed(UpstreamBroken("reset"))
    with pytest.raises(DecodeFailed):
        await anext(chunks)
    assert legs[1].read_cancelled


async def test_chunks_of_legs_all_answered_by_their_prefill_end_at_once() -> None:
    fanout = FanOut([exchange(None, answer={"choices": []})])
    assert [item async for item in fanout.chunks()] == []


# -- read_all and aclose --------------------------------------------------------------------


async def test_read_all_reads_every_body_in_order() -> None:
    legs = [FakeUpstream(), FakeUpstream(b"{}", b"")]
    fanout = FanOut([exchange(legs[0]), exchange(None, answer={"choices": []}),
                     exchange(legs[1])])
    task = asyncio.ensure_future(fanout.read_all(1024))
    await legs[0].reading.wait()  # both read at once: the second is done, the first waits
    legs[0].feed(b'{"a": 1}')
    legs[0].feed(b"")
    assert await task == [b'{"a": 1}', b"", b"{}"]


async def test_the_first_failed_read_cancels_the_others() -> None:
    legs = [FakeUpstream(), FakeUpstream(b"x", b"y")]
    fanout = FanOut([exchange(legs[0]), exchange(legs[1])])
    task = asyncio.ensure_future(fanout.read_all(1))  # leg 1 goes over the cap
    with pytest.raises(DecodeFailed):
        await task
    assert legs[0].read_cancelled


async def test_aclose_closes_every_exchange_once() -> None:
    owner = Owner()
    legs = [FakeUpstream(), FakeUpstream()]
    fanout = FanOut([exchange(legs[0], owner), exchange(legs[1], owner),
                     exchange(None, owner, answer={})])
    await fanout.aclose()
    await fanout.aclose()
    assert all(leg.closed for leg in legs)
    assert len(owner.ended) == 3


async def test_a_reader_ended_by_any_exception_still_ends_its_leg() -> None:
    """Only a ``SidecarError`` reached the consumer before: a reader ended by anything else
    left ``chunks()`` waiting for ever."""
    legs = [FakeUpstream(), FakeUpstream()]
    fanout = FanOut([exchange(legs[0]), exchange(legs[1])])
    chunks = fanout.chunks()
    legs[0].feed(RuntimeError("a bug in a reader"))
    async with asyncio.timeout(5):
        with pytest.raises(DecodeFailed, match="decode stream failed unexpectedly"):
            await anext(chunks)
    assert legs[1].read_cancelled


async def test_start_all_cancelled_by_its_caller_closes_pairs_that_had_started() -> None:
    owner = Owner()
    starts = Starts(2)
    task = asyncio.ensure_future(start_all(starts, requests(2)))
    await starts.entered.wait()
    first = exchange(FakeUpstream(), owner)
    starts.held[sub_request_id("rq", 0)].set_result(first)
    await starts.returned[sub_request_id("rq", 0)].wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert starts.cancelled == [sub_request_id("rq", 1)]
    assert owner.ended == [first.ctx]  # the started pair was closed, its ids given back


async def test_a_second_cancellation_during_the_clean_up_still_closes_every_started_pair() -> (
        None):
    owner = Owner()
    starts = Starts(3)
    task = asyncio.ensure_future(start_all(starts, requests(3)))
    await starts.entered.wait()
    # The first pair's close waits for its prefill leg, which takes a while to stop.
    stopping, release = asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> dict[str, Any]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await release.wait()
            raise
        return {}

    first = exchange(FakeUpstream(), owner)
    first.prefill_task = asyncio.ensure_future(slow_to_stop())
    second = exchange(FakeUpstream(), owner)
    starts.held[sub_request_id("rq", 0)].set_result(first)
    starts.held[sub_request_id("rq", 1)].set_result(second)
    await starts.returned[sub_request_id("rq", 1)].wait()
    task.cancel()
    await stopping.wait()  # the clean-up is inside the first pair's close
    task.cancel()  # the caller is cancelled again
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(owner.ended) == 2  # both started pairs closed, their ids given back
