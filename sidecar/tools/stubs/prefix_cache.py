"""The vLLM stub's prefix cache: a fixed number of KV blocks, kept and evicted as vLLM does.

    cache.use(prompt_ids, salt=None) -> CacheFigures(cached, created)
        hashes of the prompt's full blocks (each chained on its parent's, a cache salt in the
        first) ─▶ the longest run already held (never the block of the last token) ─▶ blocks
        for the rest taken from the free queue's head, evicting what they held (BlockRemoved)
        ─▶ the new full blocks held under their hashes (BlockStored) ─▶ the request's blocks
        back to the free queue's tail, its last block first ─▶ one batch of events

As vLLM's ``BlockPool``: every block not in use waits in one free queue, least recently used
first; a request takes the blocks it hits out of it (a hit is a use), allocates new ones from
its head (evicting the cached block there, if any) and gives all back at its tail when it ends,
last block first (``free_blocks``), so a prompt's tail goes before its head and a prefix that
every request uses stays. Events go to ``publisher`` (``sidecar.tools.stubs.kv_events``) only
when one is given.

Deliberate limits: a request holds its blocks only while ``use`` runs (the stub answers at
once; concurrent requests do not pin each other's blocks); only prompt blocks are cached (the
stub's generated tokens are word ids no re-tokenized reply repeats); a prompt longer than the
cache keeps only its first ``capacity`` blocks; no LoRA keys.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Final

import msgspec

from sidecar.tools.stubs import kv_events
from sidecar.tools.stubs.apis import CacheFigures
from sidecar.tools.stubs.kv_events import KVEventsPublisher

_PACK: Final = msgspec.msgpack.Encoder().encode
#: The stub's prefix cache when no size is given: large enough that tests never evict.
DEFAULT_BLOCKS: Final = 4096


def block_hashes(ids: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The chained sha256 hash of each full block of ``ids`` (the salt keys the first)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(ids) // block_size * block_size, block_size):
        extra = [salt] if start == 0 and salt is not None else None
        parent = hashlib.sha256(
            parent + _PACK([ids[start:start + block_size], extra])).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """``capacity`` blocks of ``block_size`` tokens (see the module doc)."""

    def __init__(self, block_size: int, capacity: int = DEFAULT_BLOCKS,
                 publisher: KVEventsPublisher | None = None) -> None:
        if capacity < 1:
            raise ValueError("the prefix cache needs at least one block")
        self.block_size = block_size
        self.capacity = capacity
        self.publisher = publisher
        #: Block id -> the hash it holds (None: nothing), least recently used first.
        self._free: OrderedDict[int, bytes | None] = OrderedDict(
            (block, None) for block in range(capacity))
        self._by_hash: dict[bytes, int] = {}
        #: What the published events said so far (tests read it).
        self.evicted = 0

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def __len__(self) -> int:
        """Blocks holding a cached hash."""
        return len(self._by_hash)

    def use(self, ids: list[int], salt: str | None = None) -> CacheFigures:
        """Run one prompt through the cache (see the module doc); what it read and wrote."""
        size = self.block_size
        hashes = block_hashes(ids, size, salt)[:self.capacity]
        reachable = min(len(hashes), (len(ids) - 1) // size)
        hit = 0
        while hit < reachable and hashes[hit] in self._by_hash:
            hit += 1
        events: list[dict[str, Any]] = []
        held: list[int] = []
        run: list[int] = []  # positions of the blocks newly stored, in a row
        for position, block_hash in enumerate(hashes):
            block = self._by_hash.get(block_hash)
            if block is not None:  # a hit, or held already past the hit (not read)
                del self._free[block]
                self._stored(ids, hashes, run, salt, events)
            else:
                block, old = self._free.popitem(last=False)
                if old is not None:
                    del self._by_hash[old]
                    self.evicted += 1
                    events.append(kv_events.removed(old))
                self._by_hash[block_hash] = block
                run.append(position)
            held.append(block)
        self._stored(ids, hashes, run, salt, events)
        for block, block_hash in zip(reversed(held), reversed(hashes), strict=True):
            self._free[block] = block_hash  # freed last block first: the tail goes first
        if events and self.publisher is not None:
            self.publisher.publish(events)
        created = sum(1 for e in events if e["type"] == "BlockStored"
                      for _ in e["block_hashes"])
        return CacheFigures(cached=hit * size, created=created * size)

    def _stored(self, ids: list[int], hashes: list[bytes], run: list[int], salt: str | None,
                events: list[dict[str, Any]]) -> None:
        """The BlockStored event of the run of new blocks just ended (if any)."""
        if not run:
            return
        size, first = self.block_size, run[0]
        extra: list[Any] = [None] * len(run)
        if salt is not None and first == 0:
            extra[0] = [salt]
        events.append(kv_events.stored(
            [hashes[p] for p in run], hashes[first - 1] if first else None,
            ids[first * size:(run[-1] + 1) * size], size, extra))
        run.clear()

    def clear(self) -> None:
        """Drop every cached block (vLLM's prefix-cache reset): AllBlocksCleared."""
        self._by_hash.clear()
        self._free = OrderedDict((block, None) for block in range(self.capacity))
        if self.publisher is not None:
            self.publisher.publish([kv_events.cleared()])
