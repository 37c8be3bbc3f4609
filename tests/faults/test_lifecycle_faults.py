"""Proves the sidecar rides through engines that die and come back, and stops cleanly with
requests in flight:

- an engine restarting between requests: while it is down the client gets a clean error, and
  once it is back the pooled keep-alive connections to the dead process do not surface as
  errors;
- an engine dying mid-stream: the stream ends with an error event;
- a burst of concurrent requests with some prefills failing: exactly those fail, the others
  succeed, nothing leaks (rooms, connections, the gauge);
- stop (SIGTERM's effect) with requests in flight: they finish, new ones get 503 draining,
  and a request that outlives the grace period is cut without leaving its upstream call open.

Does not prove the behaviour under real process signals (tests of the CLI cover SIGTERM to
the real process).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from fault_builders import PAIRS, engine_param, rig

from sidecar.protocol.context import Route

COMPLETIONS = Route.COMPLETIONS.value


@pytest.mark.parametrize(("engine", "connector"), [engine_param(e, c) for e, c in PAIRS])
async def test_decode_engine_restarts_between_requests(engine: str, connector: str) -> None:
    async with rig(engine, connector) as r:
        for stream in (False, True, False):  # warm the pool: keep-alive connections exist
            (await r.post(stream=stream)).expect_ok(stream=stream)
        await r.stop_engine("decode")
        (await r.post(stream=True)).expect_error(503, "engine_not_ready")
        await r.start_engine("decode")
        await r.check_recovered()


@pytest.mark.parametrize(("engine", "connector"), [engine_param(e, c) for e, c in PAIRS])
async def test_a_local_engine_known_down_is_refused_at_once_without_a_prefill(
    engine: str, connector: str
) -> None:
    async with rig(engine, connector) as r:
        (await r.post()).expect_ok(stream=False)
        await r.stop_engine("decode")
        async with aiohttp.ClientSession() as client:
            async with client.get(r.sidecar.url + "/ready") as ready:
                assert ready.status == 503  # the sidecar now knows the engine is down
        prefills = len(r.prefill.recorder.on_path(COMPLETIONS))
        for stream in (True, False):
            (await r.post(stream=stream)).expect_error(503, "engine_not_ready")
            # Refused before the prefill: nothing was spent on the prefill engine.
            assert len(r.prefill.recorder.on_path(COMPLETIONS)) == prefills
        await r.start_engine("decode")
        await r.check_recovered()  # known down, asked again: served at once when it is back


@pytest.mark.parametrize(("engine", "connector"), [engine_param(e, c) for e, c in PAIRS])
async def test_prefill_engine_restarts_between_requests(engine: str, connector: str) -> None:
    async with rig(engine, connector, prefill_timeout_s=2.0) as r:
        for stream in (False, True):
            (await r.post(stream=stream)).expect_ok(stream=stream)
        await r.stop_engine("prefill")
        (await r.post()).expect_error(502, "prefill_failed")
        await r.start_engine("prefill")
        await r.check_recovered()


async def test_decode_engine_dies_mid_stream() -> None:
    async with rig("vllm", "shfs", read_timeout_s=30.0) as r:
        r.decode.faults.add("stall", after_chunks=2, times=1)
        dying = asyncio.ensure_future(r.post(stream=True))
        await r.decode.recorder.next_request(COMPLETIONS)
        await r.stop_engine("decode")
        (await dying).expect_broken_stream("decode_failed")
        await r.start_engine("decode")
        await r.check_recovered()


@pytest.mark.parametrize(("engine", "connector"), [engine_param(e, c) for e, c in PAIRS])
async def test_burst_with_some_prefills_failing(engine: str, connector: str) -> None:
    # Breakers off: 8 failures in a row would open the lone target's breaker, which then
    # refuses the rest at once (tests/http/test_circuit_breaker.py proves that).
    async with rig(engine, connector, prefill_breaker_failures=0) as r:
        r.prefill.faults.add("status", status=500, times=8)
        replies = await asyncio.gather(*(r.post(stream=i % 2 == 0) for i in range(40)))
        failed = [reply for reply in replies if reply.status != 200]
        assert len(failed) == 8, [reply.status for reply in replies]
        for reply in failed:
            reply.expect_error(502, "prefill_failed")
        for i, reply in enumerate(replies):
            if reply.status == 200:
                reply.expect_ok(stream=i % 2 == 0)
        await r.check_recovered()


async def test_stop_lets_in_flight_requests_finish_and_refuses_new_ones() -> None:
    async with rig(drain_grace_s=10.0) as r:
        r.prefill.faults.add("delay", delay_s=0.3, times=1)
        in_flight = asyncio.ensure_future(r.post(stream=True))
        await r.prefill.recorder.next_request(COMPLETIONS)
        r.sidecar.stop.set()  # what SIGTERM does
        refused = await r.post()
        refused.expect_error(503, "draining")
        (await in_flight).expect_ok(stream=True)
        await r.wait_upstreams_closed()  # (the sidecar has stopped: no gauge to scrape)


async def test_stop_cuts_a_request_that_outlives_the_grace_period() -> None:
    async with rig(drain_grace_s=0.2, prefill_timeout_s=60.0) as r:
        r.prefill.faults.add("hang", times=1)
        stuck = asyncio.ensure_future(r.post())
        await r.prefill.recorder.next_request(COMPLETIONS)
        r.sidecar.stop.set()
        # The prefill stub releases hangs only when stopped: its call ends because the
        # sidecar closed it, after the grace period.
        await r.prefill.wait_idle()
        assert r.prefill.recorder.cancelled == 1
        with contextlib.suppress(Exception):
            await stuck  # the client sees its connection closed (no status to assert)
