"""Builders of KV-event messages as engines publish them, and a fake publisher on a real socket.

The payloads are built from plain lists and dicts (not the sidecar's structs), in the two
encodings engines use: ``map_*`` as vLLM 0.32 sends them (each event a map tagged ``"type"``;
tests/real_vllm/test_kv_events_format.py checks these against vLLM's own classes) and
``array_*`` as SGLang's ``kv_events.py`` does (each event an array, the tag first).

``FakePublisher`` is an XPUB socket, which a SUB peer cannot tell from a PUB: it can wait until
the sidecar's subscription arrived, so a test never loses its first batch to ZMQ's slow-joiner
drop (a real engine does lose it; the sequence rules cover that).
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq
import zmq.asyncio

TOKENS = list(range(1000, 1064))

#: ``msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[b"\\x01" *
#: 32, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2, lora_id=None,
#: medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0), BlockRemoved(
#: block_hashes=[7], medium="GPU", group_idx=0), AllBlocksCleared()], data_parallel_rank=0))``
#: in vLLM 0.32.0's venv.
VLLM_0_32_BATCH = bytes.fromhex(
    "93cb3ff8000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "92c420010101010101010101010101010101010101010101010101010101010101010107b1706172656e"
    "745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c"
    "6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0"
    "c0a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
    "9107a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c65"
    "6172656400"
)


def map_stored(hashes: list[Any], parent: Any, token_ids: list[int], block_size: int, *,
               lora_id: int | None = None, lora_name: str | None = None,
               medium: str | None = "GPU", extra_keys: Any = None,
               group_idx: int | None = 0) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": token_ids, "block_size": block_size, "lora_id": lora_id,
        "medium": medium, "lora_name": lora_name,
    }
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    if group_idx is not None:
        event["group_idx"] = group_idx
    return event


def map_removed(hashes: list[Any], medium: str | None = "GPU",
                group_idx: int | None = 0) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    if group_idx is not None:
        event["group_idx"] = group_idx
    return event


def map_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def array_stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
                 lora_id: int | None = None) -> list[Any]:
    return ["BlockStored", hashes, parent, token_ids, block_size, lora_id]


def array_removed(hashes: list[int]) -> list[Any]:
    return ["BlockRemoved", hashes]


def array_cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def payload(events: list[Any], rank: int | None = 0, ts: float = 1.0) -> bytes:
    """One batch: ``[ts, events, rank]`` (rank None: left out, as SGLang's batches)."""
    return msgspec.msgpack.encode([ts, events] if rank is None else [ts, events, rank])


def frames(sequence: int, events: list[Any], topic: bytes = b"kv",
           rank: int | None = 0) -> list[bytes]:
    return [topic, sequence.to_bytes(8, "big"), payload(events, rank)]


def chain(tokens: list[int], block_size: int, first_hash: int = 1,
          parent: int | None = None) -> dict[str, Any]:
    """One BlockStored of ``tokens`` (whole blocks) hashed first_hash, first_hash + 1, ..."""
    count = len(tokens) // block_size
    hashes = [first_hash + i for i in range(count)]
    return map_stored(hashes, parent, tokens[: count * block_size], block_size)


class FakePublisher:
    """An engine's publisher: connects (or binds) and sends ``[topic, seq, payload]``."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, *, bind: bool = False,
                 topic: bytes = b"kv") -> None:
        self.topic = topic
        self.socket = context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        # Every subscription passed on, also a reconnected subscriber's repeated one.
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        if bind:
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)

    async def subscribed(self) -> bytes:
        """The next subscription a subscriber sent (``b"\\x01" + topic``)."""
        return bytes(await self.socket.recv())

    async def send(self, sequence: int, events: list[Any], rank: int | None = 0) -> None:
        await self.socket.send_multipart(frames(sequence, events, self.topic, rank))

    async def send_raw(self, parts: list[bytes]) -> None:
        await self.socket.send_multipart(parts)

    def close(self) -> None:
        self.socket.close(linger=0)


class FakeReplay:
    """An engine's replay ROUTER: answers ``[id, b"", start]`` with its buffered batches from
    ``start`` on (``with_topic``: vLLM's four frames, else SGLang's three) and the end mark."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, *,
                 with_topic: bool = True, topic: bytes = b"kv") -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.with_topic = with_topic
        self.topic = topic
        self.requests: list[int] = []

    def keep(self, sequence: int, events: list[Any], rank: int | None = 0) -> None:
        self.buffer[sequence] = payload(events, rank)

    async def serve_one(self) -> None:
        client, _, start = await self.socket.recv_multipart()
        first = int.from_bytes(start, "big")
        self.requests.append(first)
        for sequence in sorted(self.buffer):
            if sequence >= first:
                head = [client, b""] + ([self.topic] if self.with_topic else [])
                await self.socket.send_multipart(
                    [*head, sequence.to_bytes(8, "big"), self.buffer[sequence]])
        end = (-1).to_bytes(8, "big", signed=True)
        tail = [b"", end, b""] if self.with_topic else [end, b""]
        await self.socket.send_multipart([client, b"", *tail])

    def close(self) -> None:
        self.socket.close(linger=0)
