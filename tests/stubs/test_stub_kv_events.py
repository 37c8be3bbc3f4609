"""Proves the vLLM stub's prefix cache (sidecar/tools/stubs/prefix_cache.py) and its KV events
(kv_events.py), and that the sidecar's own subscriber and index read them:

- the cache: a prompt's full blocks are stored (never counted for the block of its last
  token), a second turn finds the first turn's blocks (``prompt_tokens_details`` says so), a
  cache salt keys the blocks; at its size, the least recently used blocks go (a prompt's tail
  before its head), a prefix every request uses stays, each eviction a BlockRemoved;
- the wire, byte for byte the layout vLLM 0.32 sends: three frames (topic, an 8-byte
  big-endian sequence counting from 0, the msgpack batch ``[ts, events, 0]``), each event a
  map whose keys come in vLLM's order (BlockStored: type, block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
  kv_cache_spec_kind; BlockRemoved: type, block_hashes, medium, group_idx), 32-byte hashes;
- the side: with the sidecar's ``tcp://127.0.0.1:PORT`` the stub connects to the port the
  sidecar's subscriber binds; ``ipc://`` it binds;
- end to end: the sidecar's index, fed by a stub on ``--kv-events-endpoint``, finds a second
  turn's cached tokens equal to what the stub reports, and forgets what the stub evicted; a
  running sidecar in front of a stub pair runs a chat's first turn as a pair and its second
  turn whole on the decode stub (``local_cached``), the prefill stub seeing nothing of it;
- the command line: the flags build the config, each with a help text; a refused endpoint
  exits 2 with one line.

It does not prove the stub against vLLM's own encoder (tests/real_vllm/test_kv_events_format.py
does).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from sidecar_builders import decode_sidecar_settings, running_sidecar, stub_pair
from stub_builders import chat

from sidecar.kv_events.subscriber import KVEventsSubscriber, open_kv_events
from sidecar.tools.stubs import run_stub
from sidecar.tools.stubs.cli import add_stub_arguments, config_from_args
from sidecar.tools.stubs.kv_events import KVEventsPublisher
from sidecar.tools.stubs.prefix_cache import PrefixCache, block_hashes

BS = 4
WAIT_S = 10.0
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
               "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
               "kv_cache_spec_kind"]
REMOVED_KEYS = ["type", "block_hashes", "medium", "group_idx"]


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


class Recorded(list[list[dict[str, Any]]]):
    """A publisher stand-in that keeps each batch's events."""

    def publish(self, events: list[dict[str, Any]]) -> None:
        self.append(events)


def test_a_second_turn_finds_the_first_turns_blocks() -> None:
    cache = PrefixCache(BS, capacity=100)
    first = list(range(10, 21))  # 11 tokens: 2 full blocks
    figures = cache.use(first)
    assert (figures.cached, figures.created) == (0, 8)
    second = [*first, 1, 2, 3, 4, 5]  # 16 tokens: 4 blocks, 2 of them turn 1's
    figures = cache.use(second)
    assert (figures.cached, figures.created) == (8, 8)
    # Every block cached: the block of the last token is computed again, not read.
    assert cache.use(second).cached == 12
    # Another salt, other blocks.
    assert cache.use(second, salt="tenant-a").cached == 0
    assert cache.use(second, salt="tenant-a").cached == 12


def test_the_least_recently_used_blocks_go_tail_first() -> None:
    events = Recorded()
    cache = PrefixCache(BS, capacity=6, publisher=events)  # type: ignore[arg-type]
    shared = list(range(100, 108))  # 2 blocks every prompt starts with
    one = [*shared, *range(200, 208), 9]  # + 2 blocks
    two = [*shared, *range(300, 308), 9]
    cache.use(one)
    cache.use(two)  # 6 blocks held: shared, one's 2, two's 2
    assert len(cache) == 6 and not any(e["type"] == "BlockRemoved" for b in events for e in b)
    three = [*shared, *range(400, 408), 9]
    cache.use(three)  # needs 2: one's blocks, least recently used, go (its tail first)
    removed = [e["block_hashes"][0] for e in events[-1] if e["type"] == "BlockRemoved"]
    one_hashes = block_hashes(one, BS)
    assert removed == [one_hashes[3], one_hashes[2]]
    assert all(cache.holds(h) for h in block_hashes(shared, BS))  # used by every prompt
    assert cache.use(one).cached == 8  # the shared blocks only
    assert cache.evicted == 4  # two's blocks went for one's
    stored = events[-1][-1]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] == one_hashes[1]
    assert stored["block_hashes"] == one_hashes[2:4]
    assert stored["token_ids"] == one[8:16]


def test_a_prompt_longer_than_the_cache_keeps_its_beginning() -> None:
    cache = PrefixCache(BS, capacity=2)
    prompt = list(range(20))
    assert cache.use(prompt).created == 8
    assert cache.use(prompt).cached == 8


def decode_raw(frames: list[bytes]) -> tuple[bytes, int, float, list[dict[str, Any]], Any]:
    topic, sequence, payload = frames
    assert len(sequence) == 8
    ts, events, rank = msgspec.msgpack.decode(payload)
    return topic, int.from_bytes(sequence, "big"), ts, events, rank


async def first_batch(context: zmq.asyncio.Context, sub: zmq.asyncio.Socket,
                      publisher: KVEventsPublisher, cache: PrefixCache) -> list[bytes]:
    """Publish (new prompts) until the SUB socket hears one: a PUB drops what it sends before
    its connection is up, as vLLM's does."""
    for attempt in range(100):
        cache.use(list(range(1000 * attempt, 1000 * attempt + 9)))
        if await sub.poll(100):
            return list(await sub.recv_multipart())
    raise AssertionError("no batch arrived")


async def test_the_wire_is_vllms(context: zmq.asyncio.Context) -> None:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0")  # as the sidecar does: the stub connects
    publisher = KVEventsPublisher(sub.getsockopt_string(zmq.LAST_ENDPOINT), topic="kv")
    cache = PrefixCache(BS, capacity=3, publisher=publisher)
    try:
        topic, sequence, ts, events, rank = decode_raw(await first_batch(context, sub,
                                                                         publisher, cache))
        assert topic == b"kv" and rank == 0 and ts > 0
        # Evictions first (earlier prompts' batches may have been dropped), then the blocks.
        assert {e["type"] for e in events[:-1]} <= {"BlockRemoved"}
        stored = events[-1]
        assert list(stored) == STORED_KEYS
        assert all(isinstance(h, bytes) and len(h) == 32 for h in stored["block_hashes"])
        assert stored["parent_block_hash"] is None and stored["block_size"] == BS
        assert stored["medium"] == "GPU" and stored["lora_id"] is None
        assert stored["lora_name"] is None and stored["group_idx"] == 0
        assert stored["extra_keys"] == [None, None]
        assert stored["kv_cache_spec_kind"] == "full_attention"
        cache.use(list(range(5000, 5009)))  # evicts the earlier prompts' blocks
        _, next_sequence, _, events, _ = decode_raw(list(await sub.recv_multipart()))
        assert next_sequence == sequence + 1
        removed = [e for e in events if e["type"] == "BlockRemoved"]
        assert removed and all(list(e) == REMOVED_KEYS for e in removed)
        assert all(len(e["block_hashes"]) == 1 for e in removed)
        assert events[-1]["type"] == "BlockStored"  # evictions, then the new blocks
        cache.clear()
        _, _, _, events, _ = decode_raw(list(await sub.recv_multipart()))
        assert events == [{"type": "AllBlocksCleared"}]
        cache.use([1, 2, 3, 4, 5], salt="s")
        _, _, _, events, _ = decode_raw(list(await sub.recv_multipart()))
        assert events[0]["extra_keys"] == [["s"]]
    finally:
        publisher.close()
        sub.close(linger=0)


async def test_an_ipc_endpoint_is_bound_by_the_stub(context: zmq.asyncio.Context,
                                                    tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"
    publisher = KVEventsPublisher(endpoint)
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        frames = await first_batch(context, sub, publisher, PrefixCache(BS, 10, publisher))
        assert decode_raw(frames)[0] == b""
    finally:
        publisher.close()
        sub.close(linger=0)


async def learned(subscriber: KVEventsSubscriber, session: aiohttp.ClientSession, url: str,
                  ) -> None:
    """Send new prompts until the sidecar's index heard one (the stub's first batches may be
    dropped before its connection is up)."""
    for attempt in range(100):
        body = {"model": "stub-model", "prompt": list(range(9000 + 40 * attempt,
                                                            9000 + 40 * attempt + 20)),
                "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200
        try:
            async with asyncio.timeout(0.2):
                await subscriber.wait_until(lambda: subscriber.cache.index.known)
            return
        except TimeoutError:
            continue
    raise AssertionError("the sidecar heard no batch")


async def test_the_sidecars_index_follows_the_stub(session: aiohttp.ClientSession) -> None:
    async with open_kv_events("tcp://127.0.0.1:0", None, topic="kv",
                              max_blocks=1000) as subscriber:
        index = subscriber.cache
        async with run_stub(engine="vllm", role="both", block_size=BS, kv_cache_blocks=12,
                            prompt_tokens_details=True,
                            kv_events_endpoint=subscriber.endpoint,
                            kv_events_topic="kv") as stub:
            await learned(subscriber, session, stub.url)
            ids = (await (await session.post(stub.url + "/tokenize", json=chat(
                "turn one of a conversation"))).json())["tokens"]
            applied = index._sequence.expected
            async with session.post(stub.url + "/v1/chat/completions",
                                    json=chat("turn one of a conversation")) as response:
                first = await response.json()
            async with asyncio.timeout(WAIT_S):
                await subscriber.wait_until(lambda: index._sequence.expected != applied)
            turn_two = [*ids, 7, 7, 7, 7, 7]
            found = index.cached_tokens(turn_two)
            assert found == len(ids) // BS * BS > 0
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            async with session.post(stub.url + "/v1/completions", json={
                    "model": "stub-model", "prompt": turn_two, "max_tokens": 1}) as response:
                second = await response.json()
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == found
            # Prompts that fill the stub's 12 blocks evict turn one's: the index forgets them.
            for n in range(3):
                applied = index._sequence.expected
                async with session.post(stub.url + "/v1/completions", json={
                        "model": "stub-model", "prompt": list(range(500 * n + 40, 500 * n + 57)),
                        "max_tokens": 1}):
                    pass
                async with asyncio.timeout(WAIT_S):
                    await subscriber.wait_until(lambda a=applied: index._sequence.expected != a)
            assert index.cached_tokens(turn_two) == 0


def test_the_flags_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_stub_arguments(parser)
    config = config_from_args(parser.parse_args([
        "--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-topic", "kv",
        "--kv-cache-blocks", "40", "--block-size", "32", "--enable-prompt-tokens-details"]))
    assert config.kv_events_endpoint == "tcp://127.0.0.1:5557"
    assert config.prompt_tokens_details is True
    assert (config.kv_events_topic, config.kv_cache_blocks, config.block_size) == ("kv", 40, 32)
    defaults = config_from_args(parser.parse_args([]))
    assert defaults.kv_events_endpoint is None
    for action in parser._actions:
        if action.dest in ("kv_events_endpoint", "kv_events_topic", "kv_cache_blocks"):
            assert action.help and len(action.help) > 30


async def test_a_refused_endpoint_exits_2() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar.tools.stubs", "--kv-events-endpoint", "tcp://nowhere",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    assert stderr.decode().startswith("stub-engine: --kv-events-endpoint tcp://nowhere")


async def test_a_second_turn_runs_locally_through_the_sidecar(
    session: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"  # the stub binds, the sidecar connects
    decode = {"block_size": BS, "kv_events_endpoint": endpoint, "kv_events_topic": "kv",
              "prompt_tokens_details": True}
    async with stub_pair("vllm", decode=decode) as (prefill, decode_stub):
        settings = decode_sidecar_settings(
            "vllm", "shfs", prefill, decode_stub, kv_events_endpoint=endpoint,
            # The stub's tokens are bytes: the reply and the next message are ~50 tokens.
            kv_events_topic="kv", local_prefill_max_uncached_tokens=16 * BS)
        async with running_sidecar(**settings) as sidecar:
            # The stub's first batches may go before the sidecar's subscription is up.
            for attempt in range(100):
                async with session.post(decode_stub.url + "/v1/completions", json={
                        "model": "stub-model", "prompt": [attempt + 1] * 9,
                        "max_tokens": 1}):
                    pass
                if await sidecar.metric("disagg_kv_event_batches_total", outcome="applied"):
                    break
                await asyncio.sleep(0.01)
            headers = {"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}

            def prefill_legs_run() -> int:
                # Not the sidecar's GETs (its kinship check of the target, its probes).
                return sum(r.method == "POST" for r in prefill.recorder.requests)

            first = chat("a first turn that the decode engine will hold", max_tokens=4)
            applied = await sidecar.metric("disagg_kv_event_batches_total", outcome="applied")
            async with session.post(sidecar.url + "/v1/chat/completions", json=first,
                                    headers=headers) as response:
                reply = (await response.json())["choices"][0]["message"]["content"]
            assert prefill_legs_run() == 1  # turn one: a pair
            # The batch of turn one's blocks travels on its own, maybe after the answer.
            async with asyncio.timeout(WAIT_S):
                # Metrics are only observable by scraping: there is no event to wait on.
                while await sidecar.metric(  # noqa: ASYNC110
                        "disagg_kv_event_batches_total", outcome="applied") == applied:
                    await asyncio.sleep(0.01)
            second = {**first, "messages": [*first["messages"],
                                            {"role": "assistant", "content": reply},
                                            {"role": "user", "content": "and?"}]}
            prefill_legs = prefill_legs_run()
            async with session.post(sidecar.url + "/v1/chat/completions", json=second,
                                    headers=headers) as response:
                answer = await response.json()
            assert prefill_legs_run() == prefill_legs  # nothing for the prefill
            assert await sidecar.metric("disagg_requests_total", outcome="local_cached") == 1
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == await sidecar.metric("disagg_cached_prompt_tokens_sum") > 0
