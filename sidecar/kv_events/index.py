"""What the local engine holds in its prefix cache, as its KV events told it.

    BlockStored ──▶ block (parent hash, token ids) ─▶ key (parent hash, packed token ids) ─▶ hash
    BlockRemoved ─▶ forget the block          AllBlocksCleared ─▶ forget all blocks (still known)
    cached_tokens(prompt) ─▶ walk the prompt's blocks from the root through the keys: tokens

A block is found by what the engine hashed: its parent's hash and its own token ids. So the
sidecar never computes the engine's hash: it walks the prompt block by block, looking up
``(parent hash, this block's token ids)``; each hit gives the next parent. The walk costs, per
block, one encoding of its ids into bytes (msgpack, in C) and one dict lookup, and stops at the
first block not held.

Truthful or nothing: ``cached_tokens`` answers None (unknown) until a first batch arrived,
after ``forget()`` (a gap in the sequence, a dropped connection, a batch it could not read),
and while the engine publishes blocks of several KV-cache groups (hybrid models, whose prefix
hits depend on every group). It never reports a block the engine evicted as long as it saw
every batch; what it misses only makes it report fewer tokens.

Blocks that never match a plain prompt are not indexed: blocks stored with a LoRA adapter
(``lora_name`` or ``lora_id``), blocks whose ``extra_keys`` entry is not None (multimodal
inputs, cache salt, prompt embeddings; the engine publishes plain blocks' entries as None, or
no list at all), blocks of another medium than the engine's own memory (an offloading tier:
``medium`` other than None or ``GPU``), and blocks whose size differs from the first one seen.
A block chained after one of those (its parent is one) is indexed but unreachable from the
root, as its hash in the engine is.

The cap (``max_blocks``): at the cap, storing a block first forgets the block stored longest
ago. The engine may still hold it, so the index then reports fewer cached tokens than the
engine has (a prompt runs as a pair although it could have run locally), never more.

The engine computes at least the last prompt token itself, so a prompt whose every block is
cached finds one block fewer: ``cached_tokens`` counts the blocks within all tokens but the
last, as the engine's own prefix lookup does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import msgspec

from sidecar.kv_events.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

#: The media that are the engine's own cache (None: the publisher does not say).
_OWN_MEDIA: Final = frozenset({None, "GPU"})
#: A block's token ids as its key's bytes: msgpack's encoding of an int list is canonical (the
#: shortest form of each id: 1 to 5 bytes for a vocabulary's ids) and made in C, several times
#: faster than packing into an array (measured: bench/RESULTS.md, "Cache-aware").
_PACK: Final = msgspec.msgpack.Encoder().encode

_Key = tuple[BlockHash | None, bytes]


def _plain_extra(extra_keys: list[object] | None, position: int) -> bool:
    """True when block ``position`` of a BlockStored has no extra hash inputs."""
    if extra_keys is None or position >= len(extra_keys):
        return True
    entry = extra_keys[position]
    return entry is None or (isinstance(entry, (list, tuple)) and not entry)


class PrefixIndex:
    """The engine's cached blocks, keyed by what the engine hashes (see the module doc)."""

    def __init__(self, max_blocks: int, on_evict: Callable[[], None] | None = None) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        #: Tokens per block, None until a BlockStored told it.
        self.block_size: int | None = None
        self._on_evict = on_evict
        #: Block hash -> its key; insertion order is store order (the cap forgets the oldest).
        self._blocks: dict[BlockHash, _Key] = {}
        self._by_key: dict[_Key, BlockHash] = {}
        self._known = False
        self._several_groups = False

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def known(self) -> bool:
        """Whether ``cached_tokens`` answers (else None: unknown)."""
        return self._known and not self._several_groups

    def forget(self) -> None:
        """Drop everything and answer None until the next batch (something may be stale)."""
        self._clear()
        self.block_size = None
        self._known = False
        self._several_groups = False

    def apply(self, events: Sequence[Event]) -> None:
        """One batch's events, in order; the index answers from now on."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            elif isinstance(event, AllBlocksCleared):
                self._clear()
        self._known = True

    def cached_tokens(self, token_ids: Sequence[int]) -> int | None:
        """The longest prefix of ``token_ids`` the engine holds, in whole blocks, as tokens;
        None when unknown."""
        if not self.known:
            return None
        size = self.block_size
        if size is None or not self._by_key:
            return 0
        blocks = (len(token_ids) - 1) // size
        by_key, pack = self._by_key, _PACK
        parent: BlockHash | None = None
        found = 0
        try:
            for start in range(0, blocks * size, size):
                block = by_key.get((parent, pack(token_ids[start:start + size])))
                if block is None:
                    break
                parent = block
                found += 1
        except (TypeError, OverflowError):
            pass  # an id no block can hold: the blocks before it are what is cached
        return found * size

    def _store(self, event: BlockStored) -> None:
        if event.group_idx not in (None, 0):
            # Hybrid models: a prefix hit needs every group; one walk cannot tell it.
            self._several_groups = True
            return
        if event.lora_name is not None or event.lora_id is not None:
            return
        if event.medium not in _OWN_MEDIA:
            return
        size = event.block_size
        if size < 1 or len(event.token_ids) != len(event.block_hashes) * size:
            return
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:
            return
        tokens, parent = event.token_ids, event.parent_block_hash
        for position, block in enumerate(event.block_hashes):
            if _plain_extra(event.extra_keys, position):
                self._put(block, (parent, _PACK(tokens[position * size:(position + 1) * size])))
            parent = block

    def _put(self, block: BlockHash, key: _Key) -> None:
        if block in self._blocks:
            self._drop(block)  # stored again: its place moves to the newest
        elif len(self._blocks) >= self.max_blocks:
            self._drop(next(iter(self._blocks)))
            if self._on_evict is not None:
                self._on_evict()
        self._blocks[block] = key
        self._by_key[key] = block

    def _drop(self, block: BlockHash) -> None:
        key = self._blocks.pop(block, None)
        if key is not None and self._by_key.get(key) == block:
            del self._by_key[key]

    def _remove(self, event: BlockRemoved) -> None:
        if event.group_idx not in (None, 0) or event.medium not in _OWN_MEDIA:
            return
        for block in event.block_hashes:
            self._drop(block)

    def _clear(self) -> None:
        self._blocks.clear()
        self._by_key.clear()
