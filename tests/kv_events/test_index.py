"""Proves ``PrefixIndex`` (sidecar/kv_events/index.py) on decoded events, no sockets:

- None (unknown) before any batch and after ``forget()``; 0 once a batch arrived with nothing
  cached, and after AllBlocksCleared (the engine said it holds nothing: known, empty);
- BlockStored makes the prompt's leading whole blocks found, chained from the parent (also a
  chain stored over two events), in tokens, never a partial block, and never the block that
  holds the prompt's last token; a different token anywhere stops the walk there;
- BlockRemoved forgets a block and every block chained under it (siblings of a removed branch
  stay), a block whose parent is not held is not indexed, a chain stored again after a
  removal is found again; AllBlocksCleared forgets all;
- blocks stored with a LoRA adapter (name or id), with a non-null ``extra_keys`` entry (cache
  salt, multimodal) or in another medium never match a plain prompt, nor do blocks chained
  after them; ``extra_keys`` as a list of nulls (vLLM's plain blocks) or None match;
- SGLang's array events: a block with its cache-salt metadata or in host memory
  (``CPU_PINNED``) never matches, a plain one does;
- blocks of a second KV-cache group make the answers unknown; a block size other than the
  first one's is ignored; an event whose token count does not fit its blocks is ignored;
- the cap: storing past ``max_blocks`` forgets the least recently used block (counted), where
  a lookup uses what it found and storing a block again uses it, never a block with children;
  a system prompt every request finds survives conversations past the cap (and the newest
  conversation is found whole); the answer is shorter than the engine's, never longer.

It does not prove decoding (test_wire.py) nor the sequence rules (test_engine_cache.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from kv_event_builders import (
    TOKENS,
    array_stored,
    chain,
    map_cleared,
    map_removed,
    map_stored,
    payload,
)

from sidecar.kv_events.index import PrefixIndex
from sidecar.kv_events.wire import decode_batch

BS = 4


def apply(index: PrefixIndex, *events: Any) -> None:
    index.apply(decode_batch(payload(list(events))).events)


def test_unknown_until_a_batch_then_zero() -> None:
    index = PrefixIndex(100)
    assert index.cached_tokens(TOKENS) is None
    apply(index)  # an empty batch: the engine is heard, nothing cached
    assert index.cached_tokens(TOKENS) == 0
    assert index.block_size is None


def test_stored_chain_is_found_in_whole_blocks() -> None:
    index = PrefixIndex(100)
    apply(index, chain(TOKENS[:12], BS))  # blocks 1, 2, 3
    assert index.block_size == BS
    assert index.cached_tokens(TOKENS) == 12
    assert index.cached_tokens(TOKENS[:14]) == 12  # a partial block is never counted
    # The block holding the last token is computed by the engine: not counted.
    assert index.cached_tokens(TOKENS[:12]) == 8
    assert index.cached_tokens(TOKENS[:13]) == 12
    assert index.cached_tokens(TOKENS[:3]) == 0
    assert index.cached_tokens([]) == 0
    changed = [*TOKENS[:5], 7, *TOKENS[6:]]
    assert index.cached_tokens(changed) == 4  # the walk stops at the second block
    assert index.cached_tokens([9, *TOKENS[1:]]) == 0


def test_a_chain_stored_over_two_events() -> None:
    index = PrefixIndex(100)
    apply(index, chain(TOKENS[:8], BS, first_hash=1))
    apply(index, map_stored([3, 4], 2, TOKENS[8:16], BS))
    assert index.cached_tokens(TOKENS) == 16
    # The same tokens after another parent are another block.
    apply(index, map_stored([99], 77, TOKENS[16:20], BS))
    assert index.cached_tokens(TOKENS) == 16


def test_bytes_hashes_as_vllm_sends_them() -> None:
    index = PrefixIndex(100)
    first, second = b"\x01" * 32, b"\x02" * 32
    apply(index, map_stored([first, second], None, TOKENS[:8], BS))
    assert index.cached_tokens(TOKENS) == 8
    apply(index, map_removed([second]))
    assert index.cached_tokens(TOKENS) == 4


def test_a_removed_block_takes_its_chain() -> None:
    index = PrefixIndex(100)
    apply(index, chain(TOKENS[:12], BS))
    apply(index, map_removed([2]))
    assert index.cached_tokens(TOKENS) == 4
    # Block 3 is unreachable, in the engine too: it goes with its parent and fills nothing.
    assert len(index) == 1 and 3 not in index
    # The engine recomputes what follows a missing block and announces it again.
    apply(index, map_stored([2], 1, TOKENS[4:8], BS))
    assert index.cached_tokens(TOKENS) == 8
    apply(index, map_stored([3], 2, TOKENS[8:12], BS))
    assert index.cached_tokens(TOKENS) == 12
    apply(index, map_removed([1, 12345]))  # an unknown hash is no error
    assert index.cached_tokens(TOKENS) == 0
    assert len(index) == 0


def test_a_branch_goes_with_its_parent_and_spares_its_siblings() -> None:
    index = PrefixIndex(100)
    apply(index, chain(TOKENS[:8], BS))  # 1, 2
    other = [*TOKENS[:4], 7, 7, 7, 7, 8, 8, 8, 8, 9]
    apply(index, map_stored([20, 21], 1, other[4:12], BS))  # a second branch under 1
    apply(index, map_stored([3], 2, TOKENS[8:12], BS))
    assert index.cached_tokens(other) == 12
    apply(index, map_removed([20]))
    assert index.cached_tokens(other) == 4
    assert index.cached_tokens(TOKENS) == 12
    assert len(index) == 3
    apply(index, map_removed([1]))
    assert len(index) == 0


def test_a_block_whose_parent_is_not_held_is_not_indexed() -> None:
    index = PrefixIndex(100)
    # Its parent was stored before the sidecar listened (or was keyed): never reachable.
    apply(index, map_stored([3, 4], 2, TOKENS[8:16], BS))
    assert len(index) == 0
    assert index.cached_tokens(TOKENS) == 0


def test_all_blocks_cleared_is_known_and_empty() -> None:
    index = PrefixIndex(100)
    apply(index, chain(TOKENS[:12], BS))
    apply(index, map_cleared())
    assert index.cached_tokens(TOKENS) == 0
    assert len(index) == 0
    apply(index, chain(TOKENS[:4], BS), map_cleared(), chain(TOKENS[:8], BS))
    assert index.cached_tokens(TOKENS) == 8  # events apply in order


def test_forget_makes_it_unknown_until_the_next_batch() -> None:
    index = PrefixIndex(100)
    apply(index, chain(TOKENS[:12], BS))
    index.forget()
    assert index.cached_tokens(TOKENS) is None
    assert index.block_size is None
    assert len(index) == 0
    apply(index)
    assert index.cached_tokens(TOKENS) == 0


@pytest.mark.parametrize("plain_keys", [None, [None, None, None], [[], None, ()]])
def test_extra_keys_of_nulls_match(plain_keys: Any) -> None:
    index = PrefixIndex(100)
    apply(index, map_stored([1, 2, 3], None, TOKENS[:12], BS, extra_keys=plain_keys))
    assert index.cached_tokens(TOKENS) == 12


@pytest.mark.parametrize(
    "event",
    [
        map_stored([1, 2, 3], None, TOKENS[:12], BS, lora_name="adapter", lora_id=1),
        map_stored([1, 2, 3], None, TOKENS[:12], BS, lora_id=3),
        # A cache salt is on the first block only: the blocks after it chain from it.
        map_stored([1, 2, 3], None, TOKENS[:12], BS, extra_keys=[["salt"], None, None]),
        map_stored([1, 2, 3], None, TOKENS[:12], BS, extra_keys=[[["mm-hash", 0]], None, None]),
        map_stored([1, 2, 3], None, TOKENS[:12], BS, medium="CPU"),
    ],
    ids=["lora-name", "lora-id", "cache-salt", "multimodal", "other-medium"],
)
def test_blocks_a_plain_prompt_never_matches(event: dict[str, Any]) -> None:
    index = PrefixIndex(100)
    apply(index, event)
    assert index.cached_tokens(TOKENS) == 0


def test_sglang_salted_and_offloaded_blocks_never_match() -> None:
    index = PrefixIndex(100)
    index.apply(decode_batch(payload([
        [*array_stored([1], None, TOKENS[:4], BS), "GPU", {"cache_salt": "s"}],
        [*array_stored([2], None, TOKENS[:4], BS), "CPU_PINNED"],
    ], rank=None)).events)
    assert index.cached_tokens(TOKENS) == 0
    index.apply(decode_batch(payload([array_stored([3, 4], None, TOKENS[:8], BS)])).events)
    assert index.cached_tokens(TOKENS) == 8


def test_a_multimodal_block_in_the_middle_ends_the_walk() -> None:
    index = PrefixIndex(100)
    apply(index, map_stored([1, 2, 3], None, TOKENS[:12], BS, extra_keys=[None, [["mm", 0]], None]))
    assert index.cached_tokens(TOKENS) == 4


def test_a_second_kv_cache_group_makes_it_unknown() -> None:
    index = PrefixIndex(100)
    apply(index, chain(TOKENS[:12], BS))
    apply(index, map_stored([50], None, TOKENS[:4], BS, extra_keys=None, group_idx=1))
    assert index.cached_tokens(TOKENS) is None
    index.forget()
    apply(index, chain(TOKENS[:12], BS))
    assert index.cached_tokens(TOKENS) == 12


def test_other_block_sizes_and_misfit_events_are_ignored() -> None:
    index = PrefixIndex(100)
    apply(index, chain(TOKENS[:8], BS))
    apply(index, map_stored([3], 2, TOKENS[8:16], 8))  # another size
    apply(index, map_stored([3, 4], 2, TOKENS[8:15], BS))  # 7 tokens for two blocks
    assert index.cached_tokens(TOKENS) == 8
    assert len(index) == 2


def test_the_cap_forgets_the_least_recently_used_block_and_counts_it() -> None:
    evicted: list[int] = []
    index = PrefixIndex(3, on_evict=evicted.append)
    apply(index, chain(TOKENS[:8], BS))  # 1, 2
    apply(index, map_stored([10], None, [5, 5, 5, 5], BS))
    assert index.cached_tokens(TOKENS) == 8  # uses 2, then 1: 10 is the least recent
    apply(index, map_stored([11], None, [6, 6, 6, 6], BS))  # forgets 10
    assert evicted == [1]
    assert index.cached_tokens([5, 5, 5, 5, 6]) == 0  # shorter than the engine's, never longer
    assert index.cached_tokens(TOKENS) == 8
    assert index.cached_tokens([6, 6, 6, 6, 7]) == 4  # uses 11: 2 is the least recent
    apply(index, map_stored([12], None, [7, 7, 7, 7], BS))  # forgets 2
    assert evicted == [1, 1]
    assert index.cached_tokens(TOKENS) == 4
    assert index.cached_tokens([6, 6, 6, 6, 7]) == 4
    # Blocks stored again are used: then 1 is the least recent.
    apply(index, map_stored([11], None, [6, 6, 6, 6], BS))
    apply(index, map_stored([12], None, [7, 7, 7, 7], BS))
    apply(index, map_stored([13], None, [8, 8, 8, 8], BS))
    assert index.cached_tokens(TOKENS) == 0
    assert len(index) == 3


def test_a_parent_outlives_its_children_at_the_cap() -> None:
    index = PrefixIndex(3)
    apply(index, map_stored([1], None, TOKENS[:4], BS))
    apply(index, map_stored([2], 1, TOKENS[4:8], BS))  # uses 2, then 1
    apply(index, map_stored([3], 2, TOKENS[8:12], BS))  # uses 3, then 2: 1 is the oldest
    # 1 is the least recent, but a request that used its child used it too: 3, the oldest
    # block without children, goes.
    apply(index, map_stored([10], None, [5, 5, 5, 5], BS))
    assert index.cached_tokens(TOKENS) == 8
    assert 1 in index and 2 in index and 3 not in index


def test_a_shared_prefix_survives_conversations_past_the_cap() -> None:
    """Many conversations under one system prompt, 1.2 times the cap in all: the prompt every
    request finds, and the newest conversation, stay. (Before: the system prompt, stored
    first, went first, and the newest conversation found nothing of its indexed blocks.)"""
    cap = 100
    index = PrefixIndex(cap)
    system = list(range(5000, 5000 + 8 * BS))  # 8 blocks
    apply(index, map_stored(list(range(1, 9)), None, system, BS))
    next_hash = 100
    conversations = []
    while next_hash - 100 < cap * 1.2 - 8:
        turn = system + [7000 + next_hash + i for i in range(4 * BS)] + [1]
        assert index.cached_tokens(turn) == 8 * BS  # every request finds the system prompt
        hashes = list(range(next_hash, next_hash + 4))
        apply(index, map_stored(hashes, 8, turn[8 * BS:12 * BS], BS))
        conversations.append(turn)
        next_hash += 4
    assert len(index) == cap
    assert index.cached_tokens(conversations[-1]) == 12 * BS
    assert index.cached_tokens(conversations[0]) == 8 * BS  # the oldest went, whole


def test_a_huge_cap_is_not_preallocated() -> None:
    index = PrefixIndex(10**9)
    apply(index, chain(TOKENS[:8], BS))
    assert index.cached_tokens(TOKENS) == 8
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(0)


def test_an_id_no_block_can_hold_finds_nothing() -> None:
    index = PrefixIndex(10)
    apply(index, chain(TOKENS[:8], BS))
    assert index.cached_tokens([2**70, *TOKENS]) == 0
    assert msgspec  # the builders encode with msgspec; this module only decodes


def test_a_chain_longer_than_the_cap_keeps_its_beginning() -> None:
    evicted: list[int] = []
    index = PrefixIndex(2, on_evict=evicted.append)
    apply(index, chain(TOKENS[:12], BS))
    # Evicting its own blocks would make the rest unreachable: the chain stops at the cap.
    assert index.cached_tokens(TOKENS) == 8
    assert len(index) == 2 and evicted == []
