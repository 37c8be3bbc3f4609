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
A block chained after one of those is not indexed either (see below).

Removals take their chains: a block removed (BlockRemoved, or forgotten at the cap) takes
every block chained under it, and a block whose parent the index does not hold is not indexed.
Neither could be found again: the walk cannot get past a missing parent, and the engine, whose
own lookup stops at the same place, recomputes and stores anew (announcing them again) the
blocks after it.

The cap (``max_blocks``) evicts what the engine would: the least recently used block, where
storing a block or finding it in a lookup uses it, and a block with children is never the one
evicted (a request that used a child used its parent too; the engine frees a request's blocks
last one first). So a prefix every request shares stays while requests use it. The engine may
still hold what the cap forgot, so the index then reports fewer cached tokens than the engine
has (a prompt runs as a pair although it could have run locally), never more.

The engine computes at least the last prompt token itself, so a prompt whose every block is
cached finds one block fewer: ``cached_tokens`` counts the blocks within all tokens but the
last, as the engine's own prefix lookup does.
"""

from __future__ import annotations

from collections import OrderedDict
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
#: A block's children: one hash (most blocks continue one chain) or a set of them.
_Children = BlockHash | set[BlockHash]


def _plain_extra(extra_keys: list[object] | None, position: int) -> bool:
    """True when block ``position`` of a BlockStored has no extra hash inputs."""
    if extra_keys is None or position >= len(extra_keys):
        return True
    entry = extra_keys[position]
    return entry is None or (isinstance(entry, (list, tuple)) and not entry)


class PrefixIndex:
    """The engine's cached blocks, keyed by what the engine hashes (see the module doc)."""

    def __init__(self, max_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        #: Tokens per block, None until a BlockStored told it.
        self.block_size: int | None = None
        #: Called with the number of blocks each eviction at the cap forgot.
        self._on_evict = on_evict
        #: Block hash -> its key, least recently used first.
        self._blocks: OrderedDict[BlockHash, _Key] = OrderedDict()
        self._by_key: dict[_Key, BlockHash] = {}
        #: The indexed children of each block that has some.
        self._children: dict[BlockHash, _Children] = {}
        self._known = False
        self._several_groups = False

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

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
        None when unknown. The blocks found count as used (the engine will use them)."""
        if not self.known:
            return None
        size = self.block_size
        if size is None or not self._by_key:
            return 0
        blocks = (len(token_ids) - 1) // size
        by_key, pack = self._by_key, _PACK
        parent: BlockHash | None = None
        found: list[BlockHash] = []
        try:
            for start in range(0, blocks * size, size):
                block = by_key.get((parent, pack(token_ids[start:start + size])))
                if block is None:
                    break
                found.append(block)
                parent = block
        except (TypeError, OverflowError):
            pass  # an id no block can hold: the blocks before it are what is cached
        use = self._blocks.move_to_end
        for block in reversed(found):  # the first block last: the most recently used
            use(block)
        return len(found) * size

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
        parent = event.parent_block_hash
        if parent is not None and parent not in self._blocks:
            return  # unreachable: see the module doc
        first_parent, tokens = parent, event.token_ids
        stored: list[BlockHash] = []
        for position, block in enumerate(event.block_hashes):
            if not _plain_extra(event.extra_keys, position):
                break  # it and every block after it are keyed: never a plain prompt's
            if not self._put(block, (parent, _PACK(tokens[position * size:(position + 1) * size]))):
                break
            stored.append(block)
            parent = block
        # Used as the engine frees a request's blocks: the chain's last one first, so the
        # first (and the parent the request reached it through) are the most recently used.
        use = self._blocks.move_to_end
        for block in reversed(stored):
            use(block)
        if stored and first_parent is not None and first_parent in self._blocks:
            use(first_parent)

    def _put(self, block: BlockHash, key: _Key) -> bool:
        """Index ``block``; False when it does not fit (the index is its own chain, at the
        cap: the blocks after it are then not indexed either)."""
        blocks = self._blocks
        known = blocks.get(block)
        if known == key:
            return True  # stored again (another copy of it)
        if known is not None:
            self._drop(block)  # the same hash after another parent: the newer one holds
        parent = key[0]
        if parent is not None and parent not in blocks:
            return False  # the drop just above took it (a publisher looping its hashes)
        if not self._make_room(keep=parent):
            return False
        if parent is not None:
            self._adopt(parent, block)
        blocks[block] = key
        self._by_key[key] = block
        return True

    def _make_room(self, keep: BlockHash | None) -> bool:
        """Evict least recently used childless blocks (never ``keep``) until one more fits;
        False when none can go (the index is one chain ending at ``keep``)."""
        blocks, children = self._blocks, self._children
        evicted = 0
        looked = 0
        while len(blocks) >= self.max_blocks:
            if looked > len(blocks):
                break
            oldest = next(iter(blocks))
            if oldest in children or oldest == keep:
                # Its children were used after it, and so was it: not the one to go.
                blocks.move_to_end(oldest)
                looked += 1
                continue
            evicted += self._drop(oldest)
            looked = 0
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)
        return len(blocks) < self.max_blocks

    def _adopt(self, parent: BlockHash, child: BlockHash) -> None:
        children = self._children
        siblings = children.get(parent)
        if siblings is None:
            children[parent] = child
        elif isinstance(siblings, set):
            siblings.add(child)
        elif siblings != child:
            children[parent] = {siblings, child}

    def _disown(self, parent: BlockHash, child: BlockHash) -> None:
        children = self._children
        siblings = children.get(parent)
        if isinstance(siblings, set):
            siblings.discard(child)
            if len(siblings) == 1:
                children[parent] = next(iter(siblings))
        elif siblings == child:
            del children[parent]

    def _drop(self, block: BlockHash) -> int:
        """Forget ``block`` and every block chained under it; how many were forgotten."""
        key = self._blocks.get(block)
        if key is None:
            return 0
        parent = key[0]
        if parent is not None:
            self._disown(parent, block)
        dropped = 0
        pending = [block]
        blocks, by_key, children = self._blocks, self._by_key, self._children
        while pending:
            gone = pending.pop()
            gone_key = blocks.pop(gone)
            if by_key.get(gone_key) == gone:
                del by_key[gone_key]
            dropped += 1
            under = children.pop(gone, None)
            if isinstance(under, set):
                pending.extend(under)
            elif under is not None:
                pending.append(under)
        return dropped

    def _remove(self, event: BlockRemoved) -> None:
        if event.group_idx not in (None, 0) or event.medium not in _OWN_MEDIA:
            return
        for block in event.block_hashes:
            self._drop(block)

    def _clear(self) -> None:
        self._blocks.clear()
        self._by_key.clear()
        self._children.clear()
