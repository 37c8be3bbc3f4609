"""The KV-event wire format: one published message, decoded into typed events.

    [topic, sequence (8 bytes, big-endian), payload (msgpack)]  ──decode_message()──▶ Message

The payload is one batch, a msgpack array ``[ts, events, data_parallel_rank?]``; each event is
a tagged struct in one of two encodings, both accepted:

- a map with a ``"type"`` tag (vLLM 0.32: ``{"type": "BlockStored", "block_hashes": [...],
  ...}``);
- an array whose first item is the tag (SGLang, and vLLM before the events became maps:
  ``["BlockStored", [hashes], parent, token_ids, block_size, lora_id, medium, X]``), the
  first six fields as the map's; X (vLLM's ``lora_name``, SGLang's cache-salt ``metadata``)
  is read as the blocks' extra key: present, they never match a plain prompt.

Fields this sidecar does not read are ignored, fields it reads but an older publisher does not
send default to None, so a publisher that adds fields does not break decoding. A block hash is
bytes (vLLM's sha256 hashes) or an int (older vLLM, SGLang): only compared, never interpreted.

Deliberate limits: a message that is not three frames, a sequence that is not 8 bytes, or a
payload that is not a batch of known events raises ``MalformedMessage`` whole (the subscriber
counts it and treats it as a gap: a batch it cannot read may have removed blocks).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

#: A block's hash as the engine publishes it.
BlockHash = bytes | int

#: The replay protocol's end marker: sequence -1 as 8 signed big-endian bytes.
END_OF_REPLAY: Final = (-1).to_bytes(8, "big", signed=True)


class MalformedMessage(ValueError):
    """A published message this sidecar cannot read (the reason, never the payload)."""


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """Blocks the engine now holds: ``len(block_hashes) * block_size`` token ids, chained
    after ``parent_block_hash`` (None: the first block of a sequence)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    #: One entry per block (None or a tuple of the block's extra hash inputs), or None.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    """Blocks the engine evicted."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    """The engine dropped every cached block (a prefix-cache reset)."""


class _BlockStoredArray(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    """The array encoding: the map's first six fields in order, then one item that differs by
    publisher (vLLM: ``lora_name``; SGLang: ``metadata``, a map holding the cache salt). Any
    value there keys the blocks (they never match a plain prompt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    keyed_by: Any = None

    def as_event(self) -> BlockStored:
        keys = None if self.keyed_by is None else [[self.keyed_by]] * len(self.block_hashes)
        return BlockStored(self.block_hashes, self.parent_block_hash, self.token_ids,
                           self.block_size, self.lora_id, self.medium, extra_keys=keys)


class _BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray]
    data_parallel_rank: int | None = None


class Batch(msgspec.Struct, frozen=True, gc=False):
    """One decoded batch: its events in order, the publisher's data-parallel rank (None: the
    publisher sends none) and its stamp (the publisher's ``time.time()`` when it made the
    batch)."""

    events: list[Event]
    data_parallel_rank: int | None
    ts: float = 0.0


class Message(msgspec.Struct, frozen=True, gc=False):
    topic: bytes
    sequence: int
    batch: Batch


_MAP_DECODER: Final = msgspec.msgpack.Decoder(_MapBatch)
_ARRAY_DECODER: Final = msgspec.msgpack.Decoder(_ArrayBatch)


def decode_batch(payload: bytes) -> Batch:
    """The batch in ``payload`` (either event encoding); ``MalformedMessage`` otherwise."""
    try:
        decoded: _MapBatch | _ArrayBatch = _MAP_DECODER.decode(payload)
    except msgspec.DecodeError as map_error:
        try:
            decoded = _ARRAY_DECODER.decode(payload)
        except msgspec.DecodeError:
            raise MalformedMessage(f"payload is not an event batch: {map_error}") from None
    events: list[Event] = [
        event.as_event() if isinstance(event, _BlockStoredArray) else event
        for event in decoded.events
    ]
    return Batch(events, decoded.data_parallel_rank, decoded.ts)


def decode_sequence(frame: bytes) -> int:
    """A batch's sequence number (unsigned); ``MalformedMessage`` unless 8 bytes."""
    if len(frame) != 8:
        raise MalformedMessage(f"sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big")


def decode_message(frames: list[bytes]) -> Message:
    """One published message: ``[topic, sequence, payload]``."""
    if len(frames) != 3:
        raise MalformedMessage(f"{len(frames)} frames, not 3 (topic, sequence, payload)")
    topic, sequence, payload = frames
    return Message(topic, decode_sequence(sequence), decode_batch(payload))
