"""Proves the per-target circuit breaker of prefill targets:

- on its own (fake clock): closed -> open after the configured failures in a row (a success
  in between resets the run; 4xx-like neutral verdicts count for nothing), no leg while
  open, one trial leg at a time when half-open, closed after the configured successes, a
  failed trial opens it again for twice as long (up to 8x), verdicts of legs that began
  before it opened are ignored;
- the defaults' bound: with the defaults, a target failing every leg gets at most 10 of 40
  sequential requests even when each request takes as long as 20 s (a pool of two);
- through the HTTP door with stub engines (a pool target answering 500, resetting, or
  hanging): it gets no legs while open, one trial leg after the cool-down, and legs again
  after it heals; every change is logged with the words "circuit breaker" and the target and
  shown by ``disagg_prefill_breaker_state``; an open breaker on the only target fails the
  request at once (502 ``prefill_failed``, the breaker named) without a connection to it;
- a prefill answered 503 before any work moves to another target, and the first engine saw
  the request once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any

import aiohttp
import pytest
from openai_builders import client_body
from pd_builders import pd_pair
from sidecar_builders import RunningSidecar, decode_sidecar_settings, running_sidecar, stub_pair

from sidecar.config.settings import Settings
from sidecar.errors import PrefillBreakerOpen
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.targets.breaker import BreakerState, CircuitBreakers
from sidecar.targets.choice import TargetChoice
from sidecar.tools.stubs.server import Stub, run_stub

A, B = PrefillTarget("10.0.0.1", 8000), PrefillTarget("10.0.0.2", 8000)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _breakers(clock: FakeClock, **overrides: Any) -> tuple[CircuitBreakers, list[Any]]:
    changes: list[Any] = []
    options = {"failures": 3, "open_s": 10.0, "successes": 2, **overrides}
    breakers = CircuitBreakers(**options, clock=clock,
                               on_change=lambda t, old, new, why: changes.append((t, new)))
    return breakers, changes


def _leg(breakers: CircuitBreakers, target: PrefillTarget, ok: bool | None) -> None:
    admission = breakers.admit(target)
    assert admission is not None
    breakers.settle(target, admission, ok, "HTTP 500")


def test_a_run_of_failures_opens_it_and_a_success_resets_the_run() -> None:
    clock = FakeClock()
    breakers, changes = _breakers(clock)
    for ok in (False, False, True, False, False, None, None):  # no run of 3
        _leg(breakers, A, ok)
    assert breakers.state(A) is BreakerState.CLOSED
    _leg(breakers, A, False)
    assert breakers.state(A) is BreakerState.OPEN and changes == [(A, BreakerState.OPEN)]
    assert not breakers.allows(A) and breakers.admit(A) is None
    assert breakers.allows(B)


def test_half_open_lets_one_trial_at_a_time_and_closes_after_the_successes() -> None:
    clock = FakeClock()
    breakers, changes = _breakers(clock)
    for _ in range(3):
        _leg(breakers, A, False)
    clock.now += 9.9
    assert breakers.admit(A) is None
    clock.now += 0.1
    assert breakers.allows(A)
    trial = breakers.admit(A)
    assert trial is not None and trial.trial and breakers.state(A) is BreakerState.HALF_OPEN
    assert breakers.admit(A) is None and not breakers.allows(A)  # one trial at a time
    breakers.settle(A, trial, True)
    assert breakers.state(A) is BreakerState.HALF_OPEN
    second = breakers.admit(A)
    assert second is not None and second.trial
    breakers.settle(A, second, True)
    assert breakers.state(A) is BreakerState.CLOSED
    assert [new for _, new in changes] == [BreakerState.OPEN, BreakerState.HALF_OPEN,
                                           BreakerState.CLOSED]


def test_a_failed_trial_opens_it_twice_as_long_up_to_8x_and_a_cancelled_one_frees_it() -> None:
    clock = FakeClock()
    breakers, _ = _breakers(clock)
    for _ in range(3):
        _leg(breakers, A, False)
    waits = []
    for _ in range(5):
        waits.append(breakers.retry_in(A))
        clock.now += breakers.retry_in(A)
        trial = breakers.admit(A)
        assert trial is not None and trial.trial
        breakers.settle(A, trial, None)  # cancelled: no verdict, the trial is free again
        trial = breakers.admit(A)
        assert trial is not None and trial.trial
        breakers.settle(A, trial, False)
    assert waits == [10.0, 20.0, 40.0, 80.0, 80.0]


def test_legs_that_began_before_it_opened_say_nothing() -> None:
    clock = FakeClock()
    breakers, _ = _breakers(clock)
    early = breakers.admit(A)
    assert early is not None and not early.trial
    for _ in range(3):
        _leg(breakers, A, False)
    breakers.settle(A, early, True)  # answered late: the breaker stays open
    assert breakers.state(A) is BreakerState.OPEN


def test_a_leg_its_open_breaker_does_not_let_through_did_no_work() -> None:
    clock = FakeClock()
    breakers, _ = _breakers(clock, failures=1)
    choice = TargetChoice(cooldown_s=0, clock=clock, breakers=breakers)
    with choice.leg(A) as verdict:
        verdict.failed("connection reset")
    assert choice.pick([A, B]) == B and choice.pick([A]) is None
    with pytest.raises(PrefillBreakerOpen, match="circuit breaker of prefill target"), \
            choice.leg(A):
        pass
    assert choice.in_flight(A) == 0


def test_zero_failures_turns_breakers_off() -> None:
    choice = TargetChoice(cooldown_s=0, breakers=CircuitBreakers(failures=0, open_s=1,
                                                                  successes=1))
    assert choice.breakers is None
    for _ in range(20):
        with choice.leg(A) as verdict:
            verdict.failed("HTTP 500")
    assert choice.pick([A]) == A


@pytest.mark.parametrize("request_s", [0.001, 1.0, 5.0, 20.0])
def test_with_the_defaults_a_target_failing_every_leg_gets_at_most_10_of_40(
    request_s: float,
) -> None:
    defaults = Settings()
    clock = FakeClock()
    breakers = CircuitBreakers(failures=defaults.prefill_breaker_failures,
                               open_s=defaults.prefill_breaker_open_s,
                               successes=defaults.prefill_breaker_successes, clock=clock)
    bad, good = A, B
    for seed in range(20):
        choice = TargetChoice(cooldown_s=defaults.prefill_cooldown_s, clock=clock,
                              rng=random.Random(seed), breakers=breakers)
        breakers._breakers.clear()
        legs_to_bad = 0
        for _ in range(40):  # sequential: one request at a time, each taking request_s
            target = choice.pick([bad, good])
            assert target is not None
            with choice.leg(target) as verdict:
                if target == bad:
                    legs_to_bad += 1
                    verdict.failed("HTTP 500")
                else:
                    verdict.answered()
            clock.now += request_s
        assert legs_to_bad <= 10, (seed, legs_to_bad)


# -- through the HTTP door -------------------------------------------------------------------

BREAKER = {"prefill_breaker_failures": 2, "prefill_breaker_open_s": 0.3,
           "prefill_breaker_successes": 2, "prefill_timeout_s": 0.5}


def _legs(stub: Stub) -> int:
    return len(stub.recorder.on_path(Route.COMPLETIONS.value))


async def _post(sidecar: RunningSidecar, headers: dict[str, str] | None = None
                ) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        async with session.post(sidecar.url + Route.COMPLETIONS.value, headers=headers,
                                json=client_body(Route.COMPLETIONS)) as response:
            return response.status, await response.json()


def _lines(caplog: pytest.LogCaptureFixture, target: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "circuit breaker" in r.getMessage() and target in r.getMessage()]


async def _state(sidecar: RunningSidecar, target: str) -> float:
    return await sidecar.metric("disagg_prefill_breaker_state", target=target)


@pytest.mark.parametrize("fault", [{"kind": "status", "status": 500}, {"kind": "drop"},
                                   {"kind": "hang"}], ids=["500", "reset", "hang"])
async def test_a_sick_pool_target_is_left_out_tried_once_and_used_again_when_healed(
    fault: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with stub_pair("vllm") as (healthy, decode), \
            run_stub(engine="vllm", role="prefill") as sick:
        sick.faults.add(path="/v1/completions", **fault)
        target = f"127.0.0.1:{sick.port}"
        settings = decode_sidecar_settings("vllm", "shfs", healthy, decode,
                                           prefill_urls=(sick.url, healthy.url),
                                           prefill_cooldown_s=0, **BREAKER)
        async with running_sidecar(**settings) as sidecar:
            assert await _state(sidecar, target) == 0
            # Until it opens: the sick target's legs fail (not retried: they may have run).
            for _ in range(200):
                status, answer = await _post(sidecar)
                assert status in (200, 502, 504), answer
                if await _state(sidecar, target) == BreakerState.OPEN:
                    break
            assert _legs(sick) == BREAKER["prefill_breaker_failures"]
            # Open: every request goes to the healthy target and succeeds.
            for _ in range(6):
                status, answer = await _post(sidecar)
                assert status == 200, answer
            assert _legs(sick) == BREAKER["prefill_breaker_failures"]
            # Past the cool-down, one trial leg (still sick: open again, for longer).
            await asyncio.sleep(BREAKER["prefill_breaker_open_s"])
            for _ in range(30):
                await _post(sidecar)
                if _legs(sick) > BREAKER["prefill_breaker_failures"]:
                    break
            assert _legs(sick) == BREAKER["prefill_breaker_failures"] + 1
            assert await _state(sidecar, target) == BreakerState.OPEN
            for _ in range(6):
                status, answer = await _post(sidecar)
                assert status == 200, answer
            assert _legs(sick) == BREAKER["prefill_breaker_failures"] + 1
            # Healed: the next trials answer, the breaker closes, legs go there again.
            sick.faults.clear()
            sick.faults.release_hangs()
            await asyncio.sleep(2 * BREAKER["prefill_breaker_open_s"])
            before = _legs(sick)
            for _ in range(60):
                status, answer = await _post(sidecar)
                assert status == 200, answer
                if await _state(sidecar, target) == BreakerState.CLOSED:
                    break
            assert await _state(sidecar, target) == BreakerState.CLOSED
            assert _legs(sick) == before + BREAKER["prefill_breaker_successes"]
            for _ in range(40):
                await _post(sidecar)
            assert _legs(sick) > before + BREAKER["prefill_breaker_successes"]
    changes = _lines(caplog, target)
    assert [line.split(target)[1].split(":")[0].strip() for line in changes] == [
        "opened", "half-open", "opened", "half-open", "closed"], changes


async def test_an_open_breaker_on_the_only_target_fails_at_once_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with pd_pair("vllm", **{**BREAKER, "prefill_breaker_open_s": 60}) as pair:
        pair.prefill.faults.add("status", path="/v1/completions", status=500)
        for _ in range(BREAKER["prefill_breaker_failures"]):
            status, _, _ = await pair.send()
            assert status == 502
        status, _, text = await pair.send()
        error = json.loads(text)["error"]
        assert status == 502 and error["code"] == "prefill_failed", text
        assert "circuit breaker open" in error["message"] and pair.target in error["message"]
        assert _legs(pair.prefill) == BREAKER["prefill_breaker_failures"]  # none this time
        assert await pair.sidecar.metric("disagg_prefill_breaker_state",
                                         target="header") == BreakerState.OPEN
    assert _lines(caplog, pair.target)


async def test_a_503_before_any_work_moves_to_another_target_once() -> None:
    async with stub_pair("vllm") as (first, decode), \
            run_stub(engine="vllm", role="prefill") as second:
        first.faults.add("status", path="/v1/completions", status=503, times=1)
        settings = decode_sidecar_settings("vllm", "shfs", first, decode,
                                           prefill_urls=(first.url, second.url),
                                           prefill_cooldown_s=0)
        async with running_sidecar(**settings) as sidecar:
            for _ in range(40):  # the pick is random: until the 503 was met
                status, answer = await _post(sidecar)
                assert status == 200, answer
                if first.faults.fired:
                    break
            assert first.faults.fired == 1
            assert await sidecar.metric("disagg_prefill_retries_total") == 1
            assert await sidecar.metric("disagg_prefill_legs_total", outcome="failed") == 1
        # The engine that answered 503 saw the request once; the other served it.
        assert _legs(first) + _legs(second) == sum(
            1 for r in decode.recorder.on_path(Route.COMPLETIONS.value)) + 1


