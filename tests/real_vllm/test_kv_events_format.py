"""Proves the sidecar reads vLLM 0.32's KV events as vLLM itself builds and sends them: the
events are made by vLLM's classes in the engine venv (kv_events_publisher.py), no engine runs.

- the decoder reads vLLM's encoding of every event kind (bytes and int hashes, extra keys
  published through vLLM's ``to_event_extra_keys``), and the index built from them finds a
  plain prompt's blocks but none stored with a LoRA adapter, a cache salt or a multimodal
  input; the recorded batch of tests/kv_events/test_wire.py is what vLLM encodes today;
- vLLM's own ``ZmqEventPublisher`` given the sidecar's non-wildcard TCP endpoint connects to
  the sidecar's bound SUB socket, and its batches reach the index in order; its replay ROUTER
  answers the sidecar's DEALER with the batches it buffered, in order, which the sidecar reads
  (the four-frame answers and the end mark).

- the vLLM stub (sidecar/tools/stubs/kv_events.py) encodes a batch byte for byte as vLLM
  does: the same events (a salted prompt's blocks as the engine's KV-cache manager annotates
  them, a removal, a reset), the same stamp.

It does not prove a running engine publishes when it caches blocks (the cache-aware suite).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from kv_event_builders import VLLM_0_32_BATCH

from real_vllm.harness import EngineEnv
from real_vllm.kv_events_publisher import VllmEventPublisher
from sidecar.kv_events.index import PrefixIndex
from sidecar.kv_events.subscriber import open_kv_events
from sidecar.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from sidecar.tools.stubs import kv_events as stub_events

TOKENS = list(range(500, 532))
BS = 8
WAIT_S = 60.0


@pytest.fixture(scope="module")
def vllm_events(engine_env: EngineEnv) -> Iterator[VllmEventPublisher]:
    with VllmEventPublisher(engine_env) as helper:
        yield helper


def stored(hashes: list[object], parent: object, first_block: int, **more: object) -> dict[
        str, object]:
    tokens = TOKENS[first_block * BS:(first_block + len(hashes)) * BS]
    return {"stored": {"hashes": hashes, "parent": parent, "tokens": tokens, "block_size": BS,
                       **more}}


def test_vllm_encoding_decodes_and_indexes(vllm_events: VllmEventPublisher) -> None:
    first, second = "b:" + "11" * 32, "b:" + "22" * 32
    payload = vllm_events.encode([
        stored([first, second], None, 0, extra=[None, None]),
        stored([3], second, 2),
        {"removed": {"hashes": [3]}},
        {"cleared": {}},
    ])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 0
    kinds = [type(event) for event in batch.events]
    assert kinds == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    head = batch.events[0]
    assert isinstance(head, BlockStored)
    assert head.block_hashes == [bytes.fromhex("11" * 32), bytes.fromhex("22" * 32)]
    assert head.extra_keys == [None, None]
    index = PrefixIndex(100)
    index.apply(batch.events[:2])
    assert index.cached_tokens(TOKENS) == 24
    index.apply(batch.events[2:3])
    assert index.cached_tokens(TOKENS) == 16


@pytest.mark.parametrize(
    "more",
    [
        {"lora_name": "adapter", "lora_id": 1, "extra": [[["lora", "adapter"]]]},
        {"extra": [[["salt", "tenant-a"]]]},
        {"extra": [[["mm", "image-hash", 0]]]},
    ],
    ids=["lora", "cache-salt", "multimodal"],
)
def test_keyed_blocks_never_match(vllm_events: VllmEventPublisher,
                                  more: dict[str, object]) -> None:
    batch = decode_batch(vllm_events.encode([stored([1], None, 0, **more),
                                             stored([2], 1, 1)]))
    first = batch.events[0]
    assert isinstance(first, BlockStored) and first.extra_keys not in (None, [None])
    index = PrefixIndex(100)
    index.apply(batch.events)
    assert index.cached_tokens(TOKENS) == 0


def test_the_recorded_batch_is_vllms_encoding(vllm_events: VllmEventPublisher) -> None:
    # tests/kv_events/test_wire.py's VLLM_0_32_BATCH, rebuilt by vLLM now (ts aside).
    again = decode_batch(vllm_events.encode([
        {"stored": {"hashes": ["b:" + "01" * 32, 7], "parent": None, "tokens": [1, 2, 3, 4],
                    "block_size": 2, "extra": [None, None]}},
        {"removed": {"hashes": [7]}},
        {"cleared": {}},
    ]))
    recorded = decode_batch(VLLM_0_32_BATCH)
    assert again.events == recorded.events
    assert again.data_parallel_rank == recorded.data_parallel_rank


async def test_vllms_publisher_and_replay(vllm_events: VllmEventPublisher,
                                          tmp_path: Path) -> None:
    replay = f"ipc://{tmp_path}/replay"
    async with open_kv_events("tcp://127.0.0.1:0", replay, topic="kv",
                              max_blocks=100) as subscriber:
        cache = subscriber.cache
        await asyncio.to_thread(vllm_events.call, "start", subscriber.endpoint, replay, "kv")
        # A PUB drops what it sends before the connection is up: publish (empty batches)
        # until one arrived; the loop reads while each publish call runs in a thread.
        async with asyncio.timeout(WAIT_S):
            while cache.cached_tokens(TOKENS) is None:
                await asyncio.to_thread(vllm_events.call, "publish", [])
        await asyncio.to_thread(vllm_events.call, "publish", [stored([1, 2], None, 0)])
        await asyncio.to_thread(vllm_events.call, "publish", [stored([3], 2, 2)])
        async with asyncio.timeout(WAIT_S):
            await subscriber.wait_until(lambda: cache.cached_tokens(TOKENS) == 24)
        after = cache._sequence.expected
        assert after is not None
        answers = await subscriber._ask_replay(after - 2)
        assert answers is not None
        assert [m.sequence for m in answers] == [after - 2, after - 1]
        assert {m.topic for m in answers} == {b"kv"}
        stored_events = answers[1].batch.events
        assert isinstance(stored_events[0], BlockStored)
        assert stored_events[0].block_hashes == [3]


def test_the_stub_encodes_as_vllm_does(vllm_events: VllmEventPublisher) -> None:
    first, second = b"\x11" * 32, b"\x22" * 32
    ts = 1765000000.25
    vllm = vllm_events.encode([
        {"stored": {"hashes": ["b:" + first.hex(), "b:" + second.hex()], "parent": None,
                    "tokens": TOKENS[:16], "block_size": BS, "extra": [[["salt", "s"]], None],
                    "spec_kind": "full_attention"}},
        {"removed": {"hashes": ["b:" + first.hex()]}},
        {"cleared": {}},
    ], ts)
    stub = msgspec.msgpack.encode([ts, [
        stub_events.stored([first, second], None, TOKENS[:16], BS, [["s"], None]),
        stub_events.removed(first),
        stub_events.cleared(),
    ], 0])
    assert stub == vllm
