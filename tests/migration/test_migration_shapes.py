"""Proves migration on every API shape the HTTP door serves, on stub engines:

- token-in generate continues on its own route (one ``request_id``, the ids exactly once,
  usage over the whole answer);
- Responses and Messages streams carry no token ids on any engine here: a break ends them
  with the API's own error event, naming why they did not move (``no_token_ids``), counted
  ``refused``; as JSON they run again (an answer is only known whole);
- a JSON completion whose decode engine dies before answering (a 500, a reset connection)
  runs again whole on the prefill target, counted ``migrated``;
- a request that ran whole on the local engine (not paired) moves the same way.

Completions and chat streams: test_stream_migration.py.
"""

from __future__ import annotations

import json

import pytest
from migration_builders import (
    GENERATE_IDS,
    drop,
    generations,
    metric_reaches,
    moving_pair,
    prompt_ids,
    read,
    route_body,
    text,
    tokens,
)

from sidecar.protocol.context import Route
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.textgen import PrefillKind

MAX_TOKENS = 8
CUT = 3


async def test_a_token_in_stream_continues_on_its_route() -> None:
    async with moving_pair(decode_faults=[drop(CUT)]) as pair:
        body = route_body(Route.GENERATE, max_tokens=MAX_TOKENS,
                          stream_options={"include_usage": True})
        reply = await read(pair, Route.GENERATE, body)
        first = tokens(GENERATE_IDS, MAX_TOKENS, PrefillKind.REMOTE)[:CUT]
        rest = tokens(GENERATE_IDS + first, MAX_TOKENS - CUT, PrefillKind.LOCAL)

        assert reply.status == 200 and not reply.broken and reply.done == 1
        assert reply.ids == first + rest
        assert {chunk["request_id"] for chunk in reply.chunks} == {
            reply.chunks[0]["request_id"]}
        assert reply.usage is not None
        assert (reply.usage["prompt_tokens"], reply.usage["completion_tokens"]) == (
            len(GENERATE_IDS), MAX_TOKENS)
        await pair.prefill.recorder.next_request(Route.GENERATE.value)  # the prefill leg
        continued = await pair.prefill.recorder.next_request(Route.GENERATE.value)
        assert continued.json["token_ids"] == GENERATE_IDS + first
        assert continued.json["sampling_params"]["max_tokens"] == MAX_TOKENS - CUT


@pytest.mark.parametrize("route", [Route.RESPONSES, Route.MESSAGES])
async def test_a_stream_without_token_ids_ends_with_its_apis_error_naming_why(
        route: Route) -> None:
    async with moving_pair(decode_faults=[drop(CUT)]) as pair:
        reply = await read(pair, route, route_body(route, max_tokens=MAX_TOKENS))
        raw = reply.raw.decode()

        assert reply.status == 200
        assert "event: error" in raw and "not migrated: no_token_ids" in raw
        assert generations(pair.prefill) == 1  # its prefill leg only
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="refused",
                             reason="no_token_ids")


@pytest.mark.parametrize("route", [Route.COMPLETIONS, Route.RESPONSES, Route.MESSAGES])
@pytest.mark.parametrize("fault", [Fault(kind=FaultKind.STATUS, status=500, times=1),
                                   Fault(kind=FaultKind.DROP, times=1)],
                         ids=["500", "reset"])
async def test_a_json_request_whose_decode_dies_runs_again_on_the_prefill_target(
        route: Route, fault: Fault) -> None:
    async with moving_pair(decode_faults=[fault]) as pair:
        reply = await read(pair, route, route_body(route, stream=False,
                                                   max_tokens=MAX_TOKENS))
        assert reply.status == 200, reply.raw
        # The prefill engine ran it whole: it computed the prompt itself.
        whole = [r for r in pair.prefill.recorder.on_path(route.value)
                 if r.json.get("kv_transfer_params") is None]
        assert len(whole) == 1 and whole[0].json == route_body(route, stream=False,
                                                                max_tokens=MAX_TOKENS)
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="migrated")
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="migrated")


async def test_a_json_completion_moved_answers_what_the_engine_computed() -> None:
    async with moving_pair(decode_faults=[Fault(kind=FaultKind.DROP, times=1)]) as pair:
        reply = await read(pair, Route.COMPLETIONS,
                           route_body(Route.COMPLETIONS, stream=False, max_tokens=MAX_TOKENS))
        answer = json.loads(reply.raw)
        assert answer["choices"][0]["text"] == text(
            tokens(prompt_ids(), MAX_TOKENS, PrefillKind.LOCAL))
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS


async def test_a_local_requests_stream_moves_too() -> None:
    # Every prompt runs whole on the local engine; its failure moves it to the target.
    async with moving_pair(decode_faults=[drop(CUT)],
                           local_prefill_max_tokens=100_000) as pair:
        reply = await read(pair, Route.COMPLETIONS,
                           route_body(Route.COMPLETIONS, max_tokens=MAX_TOKENS))
        first = tokens(prompt_ids(), MAX_TOKENS, PrefillKind.LOCAL)[:CUT]
        rest = tokens(prompt_ids() + first, MAX_TOKENS - CUT, PrefillKind.LOCAL)

        assert reply.status == 200 and reply.done == 1
        assert reply.text == text(first + rest)
        assert len(pair.prefill.recorder.on_path(Route.COMPLETIONS.value)) == 1
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="migrated")
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="migrated")
