"""Proves cache-aware placement end to end on stub engines: the running sidecar (real app,
real server) hears a fake engine publisher on a real ZMQ socket (vLLM's wire format), and its
placement decision runs a request locally when the events say the decode engine holds all but a
few of its tokens:

- a token-in completion whose leading blocks were published runs whole on the decode stub
  (``local_cached``): the prefill stub receives nothing, the decode stub receives the client's
  body unchanged, and ``disagg_cached_prompt_tokens`` counts the cached tokens found;
- the same prompt with more uncached tokens than the limit runs as a pair;
- before any event (and after the publisher's connection closes) the index cannot answer, and
  the request runs as a pair (never a stale "cached");
- chat prompts are tokenized by the decode stub's tokenizer endpoint for the rule.

It does not prove the real engine's events (tests/real_vllm/test_cache_aware.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import zmq
import zmq.asyncio
from kv_event_builders import FakePublisher, chain
from pd_builders import PDPair, client_body, metric_reaches, pd_pair

from sidecar.protocol.context import Route

BS = 4
LIMIT = 8
WAIT_S = 10.0
PROMPT = list(range(100, 140))  # 40 tokens: 10 blocks


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def heard(pair: PDPair, publisher: FakePublisher, *events: dict[str, object],
                sequence: int = 0) -> None:
    """Publish ``events`` once the sidecar subscribed, and wait until it applied them."""
    async with asyncio.timeout(WAIT_S):
        await publisher.subscribed()
    applied = await pair.sidecar.metric("disagg_kv_event_batches_total", outcome="applied")
    await publisher.send(sequence, list(events))
    await metric_reaches(pair.sidecar, "disagg_kv_event_batches_total", applied + 1,
                         outcome="applied")


def prefill_legs(pair: PDPair) -> int:
    return len([r for r in pair.prefill.recorder.requests
                if r.method == "POST" and r.path.startswith("/v1/")])


async def test_a_mostly_cached_prompt_runs_locally(context: zmq.asyncio.Context,
                                                   tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/events"
    publisher = FakePublisher(context, endpoint, bind=True)
    async with pd_pair("vllm", kv_events_endpoint=endpoint, kv_events_topic="kv",
                       local_prefill_max_uncached_tokens=LIMIT) as pair:
        # Unknown before any event: a pair.
        status, _, text = await pair.send(body=client_body(prompt=PROMPT))
        assert status == 200, text
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="ok")
        assert prefill_legs(pair) == 1

        await heard(pair, publisher, chain(PROMPT[:36], BS))  # 9 of 10 blocks
        client = client_body(prompt=PROMPT)
        status, _, text = await pair.send(body=client)
        assert status == 200, text
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="local_cached")
        assert prefill_legs(pair) == 1  # nothing more reached the prefill stub
        seen = [r for r in pair.decode.recorder.requests if r.path == "/v1/completions"]
        assert seen[-1].json == client  # the client's body, unchanged
        assert await pair.sidecar.metric("disagg_cached_prompt_tokens_sum") == 36

        # More than LIMIT tokens uncached: a pair.
        longer = [*PROMPT, *range(500, 520)]
        status, _, text = await pair.send(body=client_body(prompt=longer))
        assert status == 200, text
        await metric_reaches(pair.sidecar, "disagg_requests_total", 2, outcome="ok")
        assert prefill_legs(pair) == 2

        # The engine goes away: forgotten at once, never a stale "cached".
        publisher.close()
        await metric_reaches(pair.sidecar, "disagg_kv_events_gaps_total", 1,
                             cause="disconnected")
        status, _, text = await pair.send(body=client_body(prompt=PROMPT))
        assert status == 200, text
        await metric_reaches(pair.sidecar, "disagg_requests_total", 3, outcome="ok")
        assert await pair.sidecar.metric("disagg_requests_total", outcome="local_cached") == 1


async def test_chat_prompts_are_tokenized_for_the_rule(context: zmq.asyncio.Context,
                                                       tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/events"
    publisher = FakePublisher(context, endpoint, bind=True)
    async with pd_pair("vllm", kv_events_endpoint=endpoint, kv_events_topic="kv",
                       local_prefill_max_uncached_tokens=LIMIT) as pair:
        client = client_body(Route.CHAT)
        ids = await tokenized(pair, client)
        whole = (len(ids) - 1) // BS * BS
        await heard(pair, publisher, chain(ids[:whole], BS))
        status, _, text = await pair.send(Route.CHAT, body=client)
        assert status == 200, text
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="local_cached")
        assert await pair.sidecar.metric("disagg_cached_prompt_tokens_sum") == whole
        assert prefill_legs(pair) == 0
    publisher.close()


async def tokenized(pair: PDPair, body: dict[str, object]) -> list[int]:
    """The decode stub's token ids of a chat body (what the sidecar's tokenize call gets)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(pair.decode.url + "/tokenize",
                                json={"messages": body["messages"]}) as response:
            answer = json.loads(await response.text())
    return list(answer["tokens"])
