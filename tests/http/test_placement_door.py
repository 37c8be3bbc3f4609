"""Proves, from outside, that a request's fate is decided once and in the right order:

- a local decision (stored Responses state, a short prompt) never consults a prefill target's
  circuit breaker: with the only target's breaker open such requests still run whole on the
  local engine, answered by it;
- with ``--on-prefill-failure local`` the named policy keeps working once the breaker opens:
  every request is answered, the ones the open breaker kept from the target counted as
  fallbacks with reason ``breaker_open``;
- routing headers (``x-prefiller-host-port``, ``x-data-parallel-rank``) reach no engine on
  any path: passthrough, local route, local state, short prompt, the PD legs.

It does not prove the decision's order of rules one by one (tests/core/test_placement.py).
"""

from __future__ import annotations

import json

import pytest
from pd_builders import PDPair, client_body, metric_reaches, pd_pair
from route_builders import route_body

from sidecar.protocol.context import Route
from sidecar.targets.breaker import BreakerState
from sidecar.tools.stubs.recorder import RecordedRequest

BREAKER = {"prefill_breaker_failures": 2, "prefill_breaker_open_s": 60.0,
           "prefill_breaker_successes": 2}
OPEN_FOR_LONG = BREAKER
ROUTING = {"x-data-parallel-rank": "0"}


async def _open_the_breaker(pair: PDPair) -> None:
    pair.prefill.faults.add("status", path="/v1/completions", status=500)
    for _ in range(BREAKER["prefill_breaker_failures"]):
        status, _, _ = await pair.send()
        assert status == 502
    assert await pair.sidecar.metric("disagg_prefill_breaker_state",
                                     target="header") == BreakerState.OPEN


async def test_stored_state_runs_locally_whatever_the_breaker_says() -> None:
    async with pd_pair("vllm", **OPEN_FOR_LONG) as pair:
        await _open_the_breaker(pair)
        client = route_body(Route.RESPONSES, previous_response_id="resp_earlier")
        status, _, text = await pair.send(Route.RESPONSES, body=client)
        assert status == 404, text  # the decode stub's own answer: it holds no such state
        assert "circuit breaker" not in text
        seen = await pair.decode.recorder.next_request(Route.RESPONSES.value)
        assert seen.json == client
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1,
                             route=Route.RESPONSES.value, outcome="local_state")


async def test_a_short_prompt_runs_locally_whatever_the_breaker_says() -> None:
    async with pd_pair("vllm", local_prefill_max_tokens=8, **OPEN_FOR_LONG) as pair:
        # Long prompts open the breaker; a short one is the local engine's alone.
        pair.prefill.faults.add("status", path="/v1/completions", status=500)
        for _ in range(BREAKER["prefill_breaker_failures"]):
            status, _, _ = await pair.send(body=client_body(prompt=list(range(40))))
            assert status == 502
        status, _, text = await pair.send(body=client_body(prompt=[1, 2, 3]))
        assert status == 200, text
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="local_short")


async def test_the_local_policy_keeps_answering_once_the_breaker_opens() -> None:
    async with pd_pair("vllm", on_prefill_failure="local", **OPEN_FOR_LONG) as pair:
        pair.prefill.faults.add("status", path="/v1/completions", status=500)
        for _ in range(3 * BREAKER["prefill_breaker_failures"]):
            status, _, text = await pair.send()
            assert status == 200, text
        assert await pair.sidecar.metric("disagg_prefill_breaker_state",
                                         target="header") == BreakerState.OPEN
        # The legs before it opened failed and fell back; then no leg reached the target.
        legs = [r for r in pair.prefill.recorder.requests if r.path == "/v1/completions"]
        assert len(legs) == BREAKER["prefill_breaker_failures"]
        assert await pair.sidecar.metric("disagg_prefill_fallbacks_total",
                                         reason="breaker_open") == (
            2 * BREAKER["prefill_breaker_failures"])
        assert await pair.sidecar.metric("disagg_requests_total", outcome="fallback") == (
            3 * BREAKER["prefill_breaker_failures"])


@pytest.mark.parametrize(("engine", "connector"),
                         [("sglang", "shfs"), ("vllm", "mooncake"), ("vllm", "nixl-push")])
async def test_every_breaker_open_runs_locally_for_a_concurrent_dialect_too(
    engine: str, connector: str,
) -> None:
    # A concurrent dialect cannot fall back once its legs went; before any leg it can.
    async with pd_pair(engine, connector, on_prefill_failure="local", **OPEN_FOR_LONG) as pair:
        status, _, text = await pair.send()  # nixl-push learns its identity: both legs at once
        assert status == 200, text          # from now on (the first runs them in turn)
        await _open_the_breaker(pair)
        legs_before = len(pair.prefill.recorder.requests)
        body = client_body()
        status, _, text = await pair.send(body=body)
        assert status == 200, text
        assert len(pair.prefill.recorder.requests) == legs_before
        assert await pair.sidecar.metric("disagg_prefill_fallbacks_total",
                                         reason="breaker_open") == 1
        assert await pair.sidecar.metric("disagg_requests_total", outcome="fallback") == 1


async def test_without_the_local_policy_an_open_breaker_refuses_the_pair() -> None:
    async with pd_pair("vllm", **OPEN_FOR_LONG) as pair:
        await _open_the_breaker(pair)
        status, _, text = await pair.send()
        error = json.loads(text)["error"]
        assert status == 502 and error["code"] == "prefill_failed", text
        assert "circuit breaker open" in error["message"]


def _carries_routing(request: RecordedRequest) -> list[str]:
    headers = request.headers
    return [name for name in ("x-data-parallel-rank", "x-prefiller-host-port")
            if name in {key.lower() for key in headers}]


async def test_routing_headers_reach_no_engine_on_a_passthrough() -> None:
    async with pd_pair("vllm") as pair:
        status, _, text = await pair.send(body=client_body(), headers=ROUTING,
                                          with_target=False)
        assert status == 200, text
        seen = await pair.decode.recorder.next_request("/v1/completions")
        assert _carries_routing(seen) == []


@pytest.mark.parametrize(("connector", "route", "extra"), [
    ("nixl", Route.RESPONSES, {}),  # Neuron: Responses served, not as a pair
    ("shfs", Route.RESPONSES, {"previous_response_id": "resp_earlier"}),
], ids=["local-route", "local-state"])
async def test_routing_headers_reach_no_engine_on_a_local_run(
    connector: str, route: Route, extra: dict[str, str]
) -> None:
    async with pd_pair("vllm", connector) as pair:
        await pair.send(route, body=route_body(route, **extra), headers=ROUTING)
        seen = await pair.decode.recorder.next_request(route.value)
        assert _carries_routing(seen) == []
        assert not pair.prefill.recorder.on_path(route.value)


async def test_routing_headers_reach_no_engine_on_a_short_prompt_or_a_pair() -> None:
    async with pd_pair("vllm", local_prefill_max_tokens=8) as pair:
        for prompt in ([1, 2, 3], list(range(40))):
            status, _, text = await pair.send(body=client_body(prompt=prompt), headers=ROUTING)
            assert status == 200, text
        for stub in (pair.prefill, pair.decode):
            for seen in stub.recorder.on_path("/v1/completions"):
                assert _carries_routing(seen) == []
