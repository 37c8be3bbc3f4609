"""Proves the KV-event decoder (sidecar/kv_events/wire.py):

- a batch recorded from vLLM 0.32's own ``KVEventBatch`` encoding (map events tagged
  ``"type"``, bytes and int hashes, ``extra_keys`` of nulls, ``group_idx``, rank 0) decodes to
  the same events and the batch's stamp (tests/real_vllm/test_kv_events_format.py re-encodes
  with vLLM's classes on every run, so a format change breaks that test);
- SGLang's shapes (array events with the tag first, int hashes, with and without a medium,
  the cache salt's metadata map after it, a batch with and without a rank) decode to the
  same types, missing fields None, the metadata as the blocks' extra key;
- fields the decoder does not know are ignored (a publisher that adds fields keeps working);
- every malformed message raises ``MalformedMessage``: not three frames, a sequence not of 8
  bytes, not msgpack, an unknown tag, a wrong type.

It does not prove what the index does with the events (test_index.py).
"""

from __future__ import annotations

import msgspec
import pytest
from kv_event_builders import (
    VLLM_0_32_BATCH,
    array_cleared,
    array_removed,
    array_stored,
    payload,
)

from sidecar.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedMessage,
    decode_batch,
    decode_message,
)


def test_vllm_0_32_batch() -> None:
    batch = decode_batch(VLLM_0_32_BATCH)
    assert batch.data_parallel_rank == 0
    assert batch.ts == 1.5  # the engine's stamp
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [b"\x01" * 32, 7]
    assert stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 3, 4]
    assert stored.block_size == 2
    assert stored.medium == "GPU"
    assert stored.lora_id is None and stored.lora_name is None
    assert stored.extra_keys == [None, None]
    assert stored.group_idx == 0
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [7]
    assert isinstance(cleared, AllBlocksCleared)


def test_sglang_array_events() -> None:
    batch = decode_batch(payload(
        [array_stored([11, 12], 10, [1, 2, 3, 4], 2, lora_id=None), array_removed([11]),
         array_cleared()], rank=None))
    assert batch.data_parallel_rank is None
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids,
            stored.block_size) == ([11, 12], 10, [1, 2, 3, 4], 2)
    assert stored.medium is None and stored.extra_keys is None and stored.group_idx is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [11]
    assert isinstance(cleared, AllBlocksCleared)


def test_sglang_medium_and_salted_metadata() -> None:
    salted = [*array_stored([21], None, [1, 2], 2), "GPU", {"cache_salt": "tenant-a"}]
    plain = [*array_stored([22], None, [1, 2], 2), "CPU_PINNED"]
    batch = decode_batch(payload([salted, plain, ["BlockRemoved", [21], "GPU"]], rank=0))
    first, second, removed = batch.events
    assert isinstance(first, BlockStored) and first.extra_keys == [[{"cache_salt": "tenant-a"}]]
    assert isinstance(second, BlockStored) and second.medium == "CPU_PINNED"
    assert second.extra_keys is None
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"


def test_unknown_fields_are_ignored() -> None:
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": [5, 6], "block_size": 2, "lora_id": None, "medium": "GPU",
             "lora_name": None, "session_id": "s", "kv_cache_spec_kind": "full_attention",
             "a_field_of_tomorrow": {"x": [1]}}
    (stored,) = decode_batch(payload([event])).events
    assert isinstance(stored, BlockStored) and stored.token_ids == [5, 6]
    # Arrays too: trailing items past the known fields.
    (stored,) = decode_batch(payload([[*array_stored([1], None, [5, 6], 2), "GPU", None,
                                       None, 0, "more"]])).events
    assert isinstance(stored, BlockStored) and stored.extra_keys is None


def test_message_frames() -> None:
    message = decode_message([b"kv", (41).to_bytes(8, "big"), VLLM_0_32_BATCH])
    assert message.topic == b"kv"
    assert message.sequence == 41
    assert len(message.batch.events) == 3


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv", (1).to_bytes(8, "big")],
        [b"kv", (1).to_bytes(8, "big"), VLLM_0_32_BATCH, b"extra"],
        [b"kv", b"\x01", VLLM_0_32_BATCH],
        [b"kv", (1).to_bytes(8, "big"), b"\xc1 not msgpack"],
        [b"kv", (1).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [{"type": "Gone"}]])],
        [b"kv", (1).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [["Gone"]]])],
        [b"kv", (1).to_bytes(8, "big"), msgspec.msgpack.encode(
            [1.0, [{"type": "BlockRemoved", "block_hashes": "x"}]])],
        [b"kv", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"ts": 1.0})],
    ],
    ids=["two-frames", "four-frames", "short-sequence", "not-msgpack", "unknown-map-tag",
         "unknown-array-tag", "wrong-type", "not-a-batch"],
)
def test_malformed_messages(frames: list[bytes]) -> None:
    with pytest.raises(MalformedMessage):
        decode_message(frames)
