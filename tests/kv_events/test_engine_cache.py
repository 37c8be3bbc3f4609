"""Proves ``EngineKVCache`` (sidecar/kv_events/engine_cache.py) and ``SequenceCheck``
(sequence.py) on decoded messages, no sockets, with the real metrics registry:

- the first batch may have any number; the next in order applies;
- a number past the expected one is a ``Gap`` (missed batches, first..upto) that applies
  nothing by itself, and a number going back is a restart; after ``forget`` the waiting batch
  starts a new numbering and answers come back (None in between, never a stale answer);
- a lost connection forgets at once; a batch continuing the dead connection's numbering is a
  leftover (dropped), a batch with another number starts the new publisher;
- ``catching_up`` answers None; a malformed batch forgets;
- another topic and another data-parallel rank are dropped without touching the sequence;
- the metrics: index size, events by kind (both encodings), batches by outcome, gaps by
  cause, evictions, the cached-token histogram ``observe_cached_tokens`` feeds, and each
  applied batch's lag from the engine's stamp.

It does not prove the sockets or the replay exchange (test_subscriber.py).
"""

from __future__ import annotations

import time
from typing import Any

from kv_event_builders import (
    TOKENS,
    array_cleared,
    array_removed,
    array_stored,
    chain,
    map_cleared,
    map_removed,
    map_stored,
    payload,
)

from sidecar.kv_events.engine_cache import EngineKVCache
from sidecar.kv_events.wire import Message, decode_batch
from sidecar.observability.metrics import Metrics

BS = 4


def message(sequence: int, *events: Any, topic: bytes = b"kv", rank: int | None = 0) -> Message:
    return Message(topic, sequence, decode_batch(payload(list(events), rank)))


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_first_batch_any_number_then_in_order() -> None:
    cache = EngineKVCache(100, topic=b"kv")
    assert cache.cached_tokens(TOKENS) is None
    assert cache.block_size is None
    assert cache.receive(message(57, chain(TOKENS[:8], BS))) is None
    assert cache.cached_tokens(TOKENS) == 8
    assert cache.block_size == BS
    assert cache.receive(message(58, map_removed([2]))) is None
    assert cache.cached_tokens(TOKENS) == 4


def test_a_gap_applies_nothing_until_closed() -> None:
    cache = EngineKVCache(100, topic=b"kv")
    cache.receive(message(3, chain(TOKENS[:8], BS)))
    waiting = message(7, map_removed([1]))
    gap = cache.receive(waiting)
    assert gap is not None
    assert (gap.first, gap.upto, gap.restarted) == (4, 7, False)
    assert gap.message is waiting
    assert cache.cached_tokens(TOKENS) == 8  # not applied: the subscriber replays or forgets
    cache.forget("missed")
    assert cache.cached_tokens(TOKENS) is None
    cache.apply(gap.message)
    assert cache.cached_tokens(TOKENS) == 0
    assert cache.receive(message(8, chain(TOKENS[:12], BS))) is None  # the new numbering
    assert cache.cached_tokens(TOKENS) == 12


def test_a_number_going_back_is_a_restart() -> None:
    cache = EngineKVCache(100, topic=b"kv")
    cache.receive(message(10, chain(TOKENS[:8], BS)))
    gap = cache.receive(message(2, map_cleared()))
    assert gap is not None and gap.restarted
    gap = cache.receive(message(10, chain(TOKENS[:8], BS)))  # a repeat is a restart as well
    assert gap is not None and gap.restarted


def test_a_lost_connection_forgets_and_drops_leftovers() -> None:
    metrics = Metrics()
    cache = EngineKVCache(100, topic=b"kv", metrics=metrics)
    cache.receive(message(20, chain(TOKENS[:8], BS)))
    cache.disconnected()
    assert cache.cached_tokens(TOKENS) is None
    # Still queued from the dead connection: its numbering continues; never applied.
    assert cache.receive(message(21, chain(TOKENS[:12], BS))) is None
    assert cache.receive(message(22, chain(TOKENS[:12], BS))) is None
    assert cache.cached_tokens(TOKENS) is None
    assert sample(metrics, "disagg_kv_event_batches_total", outcome="leftover") == 2
    # The restarted engine's batch (any other number) starts anew.
    assert cache.receive(message(4, chain(TOKENS[:4], BS))) is None
    assert cache.cached_tokens(TOKENS) == 4
    assert cache.receive(message(5, map_cleared())) is None
    assert cache.cached_tokens(TOKENS) == 0
    assert sample(metrics, "disagg_kv_events_gaps_total", cause="disconnected") == 1


def test_catching_up_and_malformed_answer_none() -> None:
    metrics = Metrics()
    cache = EngineKVCache(100, topic=b"kv", metrics=metrics)
    cache.receive(message(0, chain(TOKENS[:8], BS)))
    cache.catching_up = True
    assert cache.cached_tokens(TOKENS) is None
    cache.catching_up = False
    assert cache.cached_tokens(TOKENS) == 8
    cache.malformed()
    assert cache.cached_tokens(TOKENS) is None
    assert sample(metrics, "disagg_kv_event_batches_total", outcome="malformed") == 1
    assert sample(metrics, "disagg_kv_events_gaps_total", cause="malformed") == 1
    assert cache.receive(message(9, chain(TOKENS[:4], BS))) is None  # a new numbering
    assert cache.cached_tokens(TOKENS) == 4


def test_other_topics_and_ranks_are_dropped() -> None:
    metrics = Metrics()
    cache = EngineKVCache(100, topic=b"kv", metrics=metrics)
    cache.receive(message(0, chain(TOKENS[:8], BS), rank=0))
    assert cache.receive(message(1, map_cleared(), topic=b"kv2")) is None
    assert cache.receive(message(1, map_cleared(), rank=1)) is None
    assert cache.cached_tokens(TOKENS) == 8
    assert cache.receive(message(1, map_removed([2]), rank=0)) is None  # still in order
    assert cache.cached_tokens(TOKENS) == 4
    assert sample(metrics, "disagg_kv_event_batches_total", outcome="other_topic") == 1
    assert sample(metrics, "disagg_kv_event_batches_total", outcome="other_rank") == 1
    # No topic configured: every message counts.
    every = EngineKVCache(100, topic=b"")
    every.receive(message(0, chain(TOKENS[:8], BS), topic=b"anything"))
    assert every.cached_tokens(TOKENS) == 8


def test_sglang_array_events_are_counted_by_kind() -> None:
    metrics = Metrics()
    cache = EngineKVCache(100, topic=b"kv", metrics=metrics)
    batch = decode_batch(payload([array_stored([1, 2], None, TOKENS[:8], BS),
                                  array_removed([2]), array_cleared()], rank=None))
    assert cache.receive(Message(b"kv", 0, batch)) is None
    for kind in ("block_stored", "block_removed", "all_blocks_cleared"):
        assert sample(metrics, "disagg_kv_events_total", kind=kind) == 1


def test_metrics() -> None:
    metrics = Metrics()
    cache = EngineKVCache(2, topic=b"kv", metrics=metrics)
    # Two blocks fill the cap; a third, unrelated, evicts the least recent of them.
    cache.receive(message(0, chain(TOKENS[:8], BS), map_stored([10], None, [5] * BS, BS),
                          map_removed([1]), map_cleared()))
    assert sample(metrics, "disagg_kv_events_total", kind="block_stored") == 2
    assert sample(metrics, "disagg_kv_events_total", kind="block_removed") == 1
    assert sample(metrics, "disagg_kv_events_total", kind="all_blocks_cleared") == 1
    assert sample(metrics, "disagg_kv_index_evictions_total") == 1
    assert sample(metrics, "disagg_kv_index_blocks") == 0
    cache.receive(message(1, chain(TOKENS[:8], BS)))
    assert sample(metrics, "disagg_kv_index_blocks") == 2
    assert sample(metrics, "disagg_kv_event_batches_total", outcome="applied") == 2
    cache.observe_cached_tokens(256)
    assert sample(metrics, "disagg_cached_prompt_tokens_count") == 1
    assert sample(metrics, "disagg_cached_prompt_tokens_bucket", le="128.0") == 0
    assert sample(metrics, "disagg_cached_prompt_tokens_bucket", le="256.0") == 1
    cache.forget("missed")
    assert sample(metrics, "disagg_kv_index_blocks") == 0
    assert sample(metrics, "disagg_kv_events_gaps_total", cause="missed") == 1


def test_the_lag_from_the_engines_stamp_is_measured() -> None:
    metrics = Metrics()
    cache = EngineKVCache(100, topic=b"kv", metrics=metrics)
    stamped = time.time() - 0.3  # the engine made this batch 0.3 s before it arrives
    cache.receive(Message(b"kv", 0, decode_batch(payload([chain(TOKENS[:8], BS)], ts=stamped))))
    assert sample(metrics, "disagg_kv_event_lag_seconds_count") == 1
    assert sample(metrics, "disagg_kv_event_lag_seconds_sum") >= 0.3
    assert sample(metrics, "disagg_kv_event_lag_seconds_bucket", le="0.25") == 0
