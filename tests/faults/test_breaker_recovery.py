"""Proves that an open circuit breaker keeps a recovered engine out no longer than it must:

- a leg admitted before an open, half-open, closed cycle that settles after it is no fresh
  failure (it reopened the breaker);
- ``disagg_prefill_breaker_state`` numbers states by severity (0 closed, 1 half-open, 2
  open), so the highest over several targets or workers is the worst (it was 1 open,
  2 half-open);
- probes: health that never failed does not end a cool-down (an engine that answers
  ``/health`` but fails its prefills keeps its doubled cool-downs); a healthy answer after a
  down one does, and the next leg is a trial; a failed trial needs a new down answer;
- end to end, with a pool of two prefill engines and a 120 s cool-down: the engine is
  killed, its breaker opens, every request meanwhile is served by the other engine, and once
  the engine is back on its port it gets legs again within 3 s and its breaker closes; the
  probes stop when the breaker leaves open and when the sidecar stops;
- a leg that fails because of the client's own request (the engine answers 4xx: a body it
  cannot read) never counts against the target.

Does not prove the same against real vLLM (tests/real_vllm/test_prefill_restart.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import aiohttp
from fault_builders import (
    COMPLETIONS,
    A,
    B,
    Clock,
    breakers_of,
    client_body,
    fail,
    faults,
    sidecar_settings_for,
    started_stub,
    stub_config,
)
from sidecar_builders import running_sidecar

from sidecar.protocol.context import PrefillTarget
from sidecar.targets.breaker import BreakerState
from sidecar.targets.choice import TargetChoice


def test_a_leg_admitted_before_a_whole_cycle_is_no_fresh_failure() -> None:
    clock = Clock()
    breakers = breakers_of(clock)
    early = breakers.admit(A)
    assert early is not None
    fail(breakers, A)  # opens
    clock.now += 10
    trial = breakers.admit(A)
    assert trial is not None and trial.trial
    breakers.settle(A, trial, True)  # closed again
    assert breakers.state(A) is BreakerState.CLOSED
    breakers.settle(A, early, False, "reset")  # admitted two states ago
    assert breakers.state(A) is BreakerState.CLOSED
    fail(breakers, A)  # a leg of this epoch still counts
    assert breakers.state(A) is BreakerState.OPEN


def test_states_are_numbered_by_severity_and_the_worst_shows() -> None:
    assert (BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN) == (0, 1, 2)
    clock = Clock()
    breakers = breakers_of(clock)
    choice = TargetChoice(cooldown_s=0, clock=clock, breakers=breakers)
    fail(breakers, A)
    clock.now += 10
    assert breakers.admit(A) is not None  # A half-open (its trial running)
    fail(breakers, B)  # B open
    assert choice.breaker_state("header") is BreakerState.OPEN
    assert max(BreakerState.HALF_OPEN, BreakerState.OPEN) is BreakerState.OPEN


def test_only_a_healthy_answer_after_a_down_one_ends_the_cool_down() -> None:
    clock = Clock()
    breakers = breakers_of(clock)
    fail(breakers, A)
    breakers.probed(A, True)  # /health never failed: says nothing about its legs
    assert breakers.state(A) is BreakerState.OPEN and breakers.admit(A) is None
    breakers.probed(A, False)
    breakers.probed(A, True)
    assert breakers.state(A) is BreakerState.HALF_OPEN
    trial = breakers.admit(A)
    assert trial is not None and trial.trial
    breakers.settle(A, trial, False, "HTTP 500")  # open again, for twice as long
    breakers.probed(A, True)
    assert breakers.state(A) is BreakerState.OPEN and breakers.retry_in(A) == 20.0


async def test_a_restarted_pool_engine_gets_legs_within_3_s_and_probes_stop() -> None:
    async with (
        started_stub(stub_config("vllm", "prefill", "shfs")) as steady,
        started_stub(stub_config("vllm", "prefill", "shfs")) as flaky,
        started_stub(stub_config("vllm", "decode", "shfs")) as decode,
    ):
        settings = sidecar_settings_for(
            "vllm", "shfs", steady, decode, prefill_urls=(flaky.url, steady.url),
            prefill_cooldown_s=0, prefill_breaker_failures=2, prefill_breaker_open_s=120.0,
            prefill_breaker_successes=1)
        flaky_label = f"127.0.0.1:{flaky.port}"
        async with running_sidecar(**settings) as sidecar, aiohttp.ClientSession() as client:

            async def post() -> int:
                async with client.post(sidecar.url + COMPLETIONS,
                                       json=client_body()) as response:
                    await response.read()
                    return response.status

            async def state() -> float:
                return await sidecar.metric("disagg_prefill_breaker_state", target=flaky_label)

            await flaky.stop()  # killed: refused connects, each retried on the steady engine
            while await state() != BreakerState.OPEN:
                assert await post() == 200
            for _ in range(10):  # open: it costs the others nothing
                assert await post() == 200
            served_before = len(steady.recorder.on_path(COMPLETIONS))
            loop = asyncio.get_running_loop()
            restarted = await stack_restart(flaky)
            back_at = loop.time()
            async with asyncio.timeout(10):
                while not restarted.recorder.on_path(COMPLETIONS):
                    assert await post() == 200
            assert loop.time() - back_at < 3.0  # against a 120 s cool-down
            async with asyncio.timeout(10):
                while await state() != BreakerState.CLOSED:
                    assert await post() == 200
            assert len(steady.recorder.on_path(COMPLETIONS)) > served_before
            await restarted.stop()
    assert not [task for task in asyncio.all_tasks()
                if "BreakerProbes._probe" in repr(task.get_coro())]


async def stack_restart(stopped: Any) -> Any:
    """The same engine started again on its port (the caller stops it)."""
    from sidecar.tools.stubs.server import Stub

    fresh = Stub(replace(stopped.config, port=stopped.port))
    await fresh.start()
    return fresh


async def test_legs_refused_for_the_clients_own_request_never_open_the_breaker() -> None:
    async with (
        started_stub(stub_config("vllm", "prefill", "shfs", faults=faults(
            {"kind": "status", "status": 415, "path": COMPLETIONS}))) as prefill,
        started_stub(stub_config("vllm", "decode", "shfs")) as decode,
    ):
        settings = sidecar_settings_for("vllm", "shfs", prefill, decode,
                                        prefill_breaker_failures=2)
        async with running_sidecar(**settings) as sidecar, aiohttp.ClientSession() as client:
            for _ in range(6):
                async with client.post(sidecar.url + COMPLETIONS, json=client_body(),
                                       headers={"x-prefiller-host-port":
                                                f"127.0.0.1:{prefill.port}"}) as response:
                    assert response.status == 400
                    assert (await response.json())["error"]["code"] == "engine_rejected_request"
            assert await sidecar.metric("disagg_prefill_breaker_state", target="header") == 0
            assert len(prefill.recorder.on_path(COMPLETIONS)) == 6


def test_the_cool_down_maps_are_bounded_like_the_breakers() -> None:
    """50,000 distinct refused targets (and failed ranks) left 50,000 entries."""
    from sidecar.targets.choice import MAX_COOLING, RankChoice

    clock = Clock()
    choice = TargetChoice(cooldown_s=5.0, clock=clock)
    ranks = RankChoice(cooldown_s=5.0, clock=clock)
    for n in range(50_000):
        target = PrefillTarget(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}", 8000)
        choice.refused(target)
        ranks.rank_failed(target, 1)
    assert len(choice._cooling) <= MAX_COOLING and len(ranks._rank_cooling) <= MAX_COOLING
    newest = PrefillTarget("10.0.195.79", 8000)  # n = 49,999
    assert choice.cooling(newest) and ranks.rank_cooling(newest, 1)
    clock.now += 5
    choice.refused(A)
    assert not choice.cooling(newest) and choice.cooling(A)
