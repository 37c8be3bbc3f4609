"""The vLLM stub's KV events, published as vLLM 0.32 publishes them.

    KVEventsPublisher(endpoint, topic).publish([stored(...), removed(...), ...])
        one batch: [topic, sequence (8 bytes, big-endian, from 0), msgpack [ts, events, 0]]

What vLLM 0.32 sends (``vllm/distributed/kv_events.py``, ``vllm/v1/core/block_pool.py``,
``kv_cache_manager.take_events``): each event a msgpack map tagged ``"type"``, its fields in
declaration order, fields left at their default None omitted (``omit_defaults``):

    BlockStored   block_hashes (32-byte sha256 digests), parent_block_hash (None: the first
                  block of a prompt), token_ids, block_size, lora_id, medium ("GPU"),
                  lora_name (these four always sent, None where unused), extra_keys (one entry
                  per block: None, or the block's untagged extra keys, e.g. [cache_salt] on
                  the first block), group_idx (0), kv_cache_spec_kind ("full_attention");
                  kv_cache_spec_sliding_window, locality, ownership, session_id when set
    BlockRemoved  block_hashes (one hash per event), medium, group_idx
    AllBlocksCleared

and the batch ``[ts, events, data_parallel_rank]`` (``ts`` the engine's ``time.time()``, the
rank 0). The socket side follows vLLM's rule: a PUB socket that binds wildcard (``*``), IPv6
(``::``) and ``ipc://`` endpoints and connects to every other one, so with the sidecar's
``tcp://127.0.0.1:PORT`` the stub connects to the port the sidecar binds. A PUB drops what
it sends before its connection is up, as vLLM's does.

Deliberate limits: no replay endpoint; one batch per request (vLLM: one per engine step).
"""

from __future__ import annotations

import time
from itertools import count
from typing import Any, Final

import msgspec
import zmq

MEDIUM: Final = "GPU"
SPEC_KIND: Final = "full_attention"
#: vLLM's publisher's high-water mark (batches queued per subscriber before ZMQ drops).
HWM: Final = 100_000


def stored(hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int,
           extra_keys: list[Any] | None) -> dict[str, Any]:
    """A BlockStored event as vLLM 0.32 encodes a plain (or salted) prompt's blocks."""
    event: dict[str, Any] = {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": token_ids, "block_size": block_size, "lora_id": None, "medium": MEDIUM,
        "lora_name": None,
    }
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    event["group_idx"] = 0
    event["kv_cache_spec_kind"] = SPEC_KIND
    return event


def removed(block_hash: bytes) -> dict[str, Any]:
    """A BlockRemoved event (vLLM sends one per evicted block)."""
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": MEDIUM,
            "group_idx": 0}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def publisher_binds(endpoint: str) -> bool:
    """vLLM's ``ZmqEventPublisher._is_bind_endpoint``."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventsPublisher:
    """A PUB socket at ``endpoint`` sending one message per batch (see the module doc)."""

    def __init__(self, endpoint: str, topic: str = "", data_parallel_rank: int = 0) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.set_hwm(HWM)
        if "[" in endpoint:
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            if publisher_binds(endpoint):
                self._socket.bind(endpoint)
            else:
                self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"--kv-events-endpoint {endpoint}: {exc.strerror}") from None
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._sequence = count()
        self._encode = msgspec.msgpack.Encoder().encode

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Send one batch, stamped now (a PUB never blocks: past its HWM it drops)."""
        payload = self._encode([time.time(), events, self._rank])
        sequence = next(self._sequence).to_bytes(8, "big")
        self._socket.send_multipart([self._topic, sequence, payload], flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
