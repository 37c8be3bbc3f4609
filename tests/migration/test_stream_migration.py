"""Proves a stream whose decode engine dies mid-answer continues on another engine, for every
API shape that can carry token ids (completions, chat, token-in generate), and that the
client sees one stream: one id, one ``[DONE]``, the text and ids the engines produced exactly
once, usage counting the whole answer once.

The stub decode closes its connection after some events (``drop``: an engine killed); the
sidecar continues on the request's prefill target (a vLLM prefill engine runs requests
whole) with the prompt's ids and the answer's so far as a token-id prompt. The stubs
generate from the prompt's ids, so what the continuation answers is known: the test computes
both halves and asserts the joined stream, and the continuation's body as the engine got it.

Does not prove that a real engine reproduces the greedy answer's rest (tests/real_vllm
does), nor the join at an unfinished character (the stubs' tokens are whole characters).
"""

from __future__ import annotations

import re

import pytest
from migration_builders import (
    PDPair,
    chat_prompt_ids,
    drop,
    metric_reaches,
    moving_pair,
    prompt_ids,
    read,
    route_body,
    text,
    tokens,
)
from openai_builders import client_body
from sidecar_builders import decode_sidecar_settings, running_sidecar, stub_pair

from sidecar.protocol.context import Route
from sidecar.tools.stubs.textgen import PrefillKind

MAX_TOKENS = 8
CUT = 3


async def test_a_completions_stream_continues_on_the_prefill_target() -> None:
    async with moving_pair(decode_faults=[drop(CUT)]) as pair:
        body = client_body(Route.COMPLETIONS, stream=True, max_tokens=MAX_TOKENS,
                           stream_options={"include_usage": True})
        reply = await read(pair, Route.COMPLETIONS, body)
        prompt = prompt_ids()
        first = tokens(prompt, MAX_TOKENS, PrefillKind.REMOTE)[:CUT]
        rest = tokens(prompt + first, MAX_TOKENS - CUT, PrefillKind.LOCAL)

        assert reply.status == 200 and not reply.broken
        assert reply.text == text(first + rest)
        assert reply.done == 1 and reply.events[-1] == "[DONE]"
        assert {chunk["id"] for chunk in reply.chunks} == {reply.chunks[0]["id"]}
        assert all(choice["token_ids"] is None and choice["prompt_token_ids"] is None
                   for chunk in reply.chunks for choice in chunk["choices"])
        assert reply.usage == {"prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                               "total_tokens": len(prompt) + MAX_TOKENS,
                               "prompt_tokens_details": None}
        continued = [r for r in pair.prefill.recorder.requests
                     if r.method == "POST" and isinstance(r.json.get("prompt"), list)]
        assert len(continued) == 1
        assert continued[0].json["prompt"] == prompt + first
        assert continued[0].json["max_tokens"] == MAX_TOKENS - CUT
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="migrated")
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="migrated")


async def test_a_chat_stream_continues_as_chat_chunks() -> None:
    async with moving_pair(decode_faults=[drop(CUT + 1)]) as pair:  # the role chunk first
        body = client_body(Route.CHAT, stream=True, max_tokens=MAX_TOKENS)
        reply = await read(pair, Route.CHAT, body)
        prompt = chat_prompt_ids()
        first = tokens(prompt, MAX_TOKENS, PrefillKind.REMOTE)[:CUT]
        rest = tokens(prompt + first, MAX_TOKENS - CUT, PrefillKind.LOCAL)

        assert reply.status == 200 and not reply.broken
        assert reply.text == text(first + rest)
        assert reply.done == 1
        assert {chunk["object"] for chunk in reply.chunks} == {"chat.completion.chunk"}
        assert {chunk["id"] for chunk in reply.chunks} == {reply.chunks[0]["id"]}
        contents = [chunk for chunk in reply.chunks if chunk["choices"]][1:]
        assert [c["choices"][0]["finish_reason"] for c in contents] == (
            [None] * (MAX_TOKENS - 1) + ["length"])
        assert all(c["choices"][0]["token_ids"] is None for c in contents)


@pytest.mark.parametrize("asked", [False, True])
async def test_token_ids_reach_the_client_only_when_it_asked(asked: bool) -> None:
    async with moving_pair(decode_faults=[drop(CUT)]) as pair:
        body = client_body(Route.COMPLETIONS, stream=True, max_tokens=MAX_TOKENS)
        if asked:
            body["return_token_ids"] = True
        reply = await read(pair, Route.COMPLETIONS, body)
        prompt = prompt_ids()
        first = tokens(prompt, MAX_TOKENS, PrefillKind.REMOTE)[:CUT]
        rest = tokens(prompt + first, MAX_TOKENS - CUT, PrefillKind.LOCAL)

        assert reply.ids == (first + rest if asked else [])
        prompts = [choice["prompt_token_ids"] for chunk in reply.chunks
                   for choice in chunk["choices"]]
        assert prompts == ([prompt] if asked else [None]) + [None] * (MAX_TOKENS - 1)


@pytest.mark.parametrize(("engine", "route", "extra"), [
    ("vllm", Route.COMPLETIONS, {}),
    ("vllm", Route.COMPLETIONS, {"stream_options": {"include_usage": True}}),
    ("vllm", Route.COMPLETIONS, {"return_token_ids": True}),
    ("vllm", Route.CHAT, {}),
    ("vllm", Route.CHAT, {"return_token_ids": True}),
    ("vllm", Route.GENERATE, {}),
    ("sglang", Route.COMPLETIONS, {}),
    ("sglang", Route.COMPLETIONS, {"return_token_ids": True}),
])
async def test_without_a_failure_the_client_sees_what_it_saw_without_migration(
        engine: str, route: Route, extra: dict[str, object]) -> None:
    """The ids asked for the sidecar's own sake never reach a client that did not ask: its
    stream is the very bytes a sidecar without migration relays."""
    async with stub_pair(engine) as (prefill, decode):
        replies = []
        for limit in (0, 1):
            settings = decode_sidecar_settings(engine, "shfs", prefill, decode,
                                               migration_limit=limit)
            async with running_sidecar(**settings) as sidecar:
                pair = PDPair(prefill, decode, sidecar)
                reply = await read(pair, route, route_body(route, **extra),
                                   headers={"X-Request-Id": "same"})
                replies.append(_comparable(reply.raw))
        assert replies[0] == replies[1]
        asked = [r for r in decode.recorder.on_path(route.value)]
        if route is not Route.GENERATE and "return_token_ids" not in extra:
            assert [r.json.get("return_token_ids") for r in asked] == [None, True]


def _comparable(raw: bytes) -> bytes:
    """``raw`` with what differs between two runs of one request (the clock, an engine's
    random room in SGLang's ids) made equal."""
    raw = re.sub(rb'"created":\d+', b'"created":0', raw)
    return re.sub(rb'"id":"same-\d+"', b'"id":"same"', raw)


@pytest.mark.parametrize("route", [Route.COMPLETIONS, Route.CHAT])
async def test_a_stream_that_broke_before_its_first_event_runs_again_whole(
        route: Route) -> None:
    # The head left, no event did (a local run dies while computing the prompt): the
    # client's own request, whole on the target, relayed as that engine writes it.
    async with moving_pair(decode_faults=[drop(0)]) as pair:
        reply = await read(pair, route, route_body(route, max_tokens=MAX_TOKENS))
        prompt = prompt_ids() if route is Route.COMPLETIONS else chat_prompt_ids()

        assert reply.status == 200 and reply.done == 1
        assert reply.text == text(tokens(prompt, MAX_TOKENS, PrefillKind.LOCAL))
        assert reply.ids == []  # not asked: written as the engine writes them unasked
        whole = [r.json for r in pair.prefill.recorder.on_path(route.value)
                 if r.json.get("kv_transfer_params") is None]
        assert whole == [{**route_body(route, max_tokens=MAX_TOKENS), "return_token_ids": True}]
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="migrated")
