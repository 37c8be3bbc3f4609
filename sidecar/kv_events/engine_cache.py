"""The sidecar's view of the local engine's prefix cache: the index, kept honest, and counted.

    Message ─receive()─▶ topic? rank? ─▶ SequenceCheck ─▶ IN_ORDER: index.apply(batch)
                                                        ├▶ MISSED / RESTARTED: Gap (the caller
                                                        │   replays, or calls forget())
                                                        └▶ LEFTOVER: dropped
    disconnected() / a batch it cannot read ─▶ forget: answers None until the next batch

``EngineKVCache`` is what the placement decision asks (``CachedPrefix``): ``block_size`` and
``cached_tokens(token_ids)``, None when unknown, and ``observe_cached_tokens`` to count what a
request found. No I/O here: the subscriber (``sidecar.kv_events.subscriber``) feeds it.

Data-parallel ranks: a publisher stamps its batches with its rank, and each rank publishes to
its own endpoint (the port plus the rank). This cache follows one rank, the first it hears;
batches stamped with another are counted (``other_rank``) and dropped.

Deliberate limits: while a replay runs (``catching_up``) the answers are None too: the missed
batches may have removed blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from sidecar.kv_events.index import PrefixIndex
from sidecar.kv_events.sequence import SequenceCheck, Verdict
from sidecar.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, Message
from sidecar.observability.metrics import Metrics
from sidecar.observability.prometheus_private import CounterValue, GaugeValue, HistogramValues

logger = logging.getLogger(__name__)

#: Outcomes of a received batch (``disagg_kv_event_batches_total{outcome}``).
APPLIED = "applied"
MALFORMED = "malformed"
OTHER_TOPIC = "other_topic"
OTHER_RANK = "other_rank"
LEFTOVER = "leftover"
#: Why the index forgot (``disagg_kv_events_gaps_total{cause}``).
CAUSE_MISSED = "missed"
CAUSE_RESTARTED = "restarted"
CAUSE_DISCONNECTED = "disconnected"
CAUSE_MALFORMED = "malformed"
CAUSE_READER_FAILED = "reader_failed"


_KINDS: Final = ((BlockStored, "block_stored"), (BlockRemoved, "block_removed"),
                 (AllBlocksCleared, "all_blocks_cleared"))


class _Counts:
    """The metrics' hot-path handles (made once: a batch costs no ``labels()`` call)."""

    def __init__(self, metrics: Metrics) -> None:
        self.events = {kind: metrics.counter(metrics.kv_events, name) for kind, name in _KINDS}
        self._metrics = metrics
        self._batches: dict[str, CounterValue] = {}
        self.blocks = GaugeValue(metrics.kv_index_blocks)
        self.evictions = CounterValue(metrics.kv_index_evictions)
        self.cached = HistogramValues(metrics.cached_prompt_tokens)
        self.lag = HistogramValues(metrics.kv_event_lag)

    def batch(self, outcome: str) -> None:
        handle = self._batches.get(outcome)
        if handle is None:
            handle = self._batches[outcome] = self._metrics.counter(
                self._metrics.kv_event_batches, outcome)
        handle.inc()

    def applied(self, events: list[Event]) -> None:
        for event in events:
            for kind, handle in self.events.items():
                if isinstance(event, kind):  # the array encoding's events are subclasses
                    handle.inc()
                    break


@dataclass(frozen=True)
class Gap:
    """Batches ``first`` .. ``upto - 1`` never arrived (``restarted``: the numbering went back,
    nothing to replay); ``message`` waits to be applied after them."""

    first: int
    upto: int
    restarted: bool
    message: Message


class EngineKVCache:
    """The index of the local engine's cached blocks, fed by its KV events."""

    def __init__(self, max_blocks: int, topic: bytes = b"", metrics: Metrics | None = None) -> None:
        self._metrics = metrics
        self._counts = None if metrics is None else _Counts(metrics)
        self.index = PrefixIndex(max_blocks, on_evict=self._evicted)
        self.topic = topic
        self._sequence = SequenceCheck()
        self._rank: int | None = None
        self._rank_warned = False
        #: True while a replay of missed batches runs (answers are None meanwhile).
        self.catching_up = False
        #: Called before each lookup: the subscriber applies what has reached its socket.
        self.refresh: Callable[[], None] | None = None

    # What the placement decision reads (CachedPrefix).

    @property
    def block_size(self) -> int | None:
        return self.index.block_size

    @block_size.setter
    def block_size(self, value: int | None) -> None:
        # Settable as the CachedPrefix protocol declares it; the events set it otherwise.
        self.index.block_size = value

    @property
    def answers(self) -> bool:
        """Whether ``cached_tokens`` can answer now (else: do not tokenize for it)."""
        return not self.catching_up and self.index.known

    def cached_tokens(self, token_ids: Sequence[int]) -> int | None:
        """The longest cached prefix of ``token_ids`` in whole blocks, as tokens; None when
        unknown. What has reached the subscriber's socket is applied first."""
        if self.refresh is not None:
            self.refresh()
        if self.catching_up:
            return None
        return self.index.cached_tokens(token_ids)

    def observe_cached_tokens(self, tokens: int) -> None:
        """Count what one request found (``disagg_cached_prompt_tokens``)."""
        if self._counts is not None:
            self._counts.cached.observe(tokens)

    # What the subscriber feeds.

    def wants(self, topic: bytes) -> bool:
        """Whether a message of ``topic`` is this cache's (else counted and dropped, before it
        is decoded: another stream's message is no gap in this one)."""
        if self.topic and topic != self.topic:
            self._batch(OTHER_TOPIC)
            return False
        return True

    def receive(self, message: Message) -> Gap | None:
        """Apply ``message`` if it is next; a ``Gap`` when batches are missing before it."""
        if not self.wants(message.topic):
            return None
        rank = message.batch.data_parallel_rank
        if rank is not None:
            if self._rank is None:
                self._rank = rank
            elif rank != self._rank:
                if not self._rank_warned:
                    self._rank_warned = True
                    logger.warning("kv events: batches of data-parallel rank %d on the endpoint "
                                   "of rank %d are dropped", rank, self._rank)
                self._batch(OTHER_RANK)
                return None
        verdict = self._sequence.check(message.sequence)
        if verdict is Verdict.LEFTOVER:
            self._sequence.accept(message.sequence)
            self._batch(LEFTOVER)
            return None
        if verdict is Verdict.IN_ORDER:
            self.apply(message)
            return None
        expected = self._sequence.expected or 0
        return Gap(expected, message.sequence, verdict is Verdict.RESTARTED, message)

    def apply(self, message: Message) -> None:
        """Apply ``message`` (next in order, or a replayed one) and expect the one after it."""
        batch = message.batch
        self.index.apply(batch.events)
        self._sequence.accept(message.sequence)
        if self._counts is not None:
            self._counts.batch(APPLIED)
            self._counts.applied(batch.events)
            if batch.ts > 0:
                self._counts.lag.observe(max(0.0, time.time() - batch.ts))
        self._size()

    def forget(self, cause: str, *, log: bool = True) -> None:
        """Drop every block and answer None until the next batch (something may be stale);
        the next batch starts a new numbering. ``log``: False where the caller's own line
        says why."""
        if log:
            logger.info("kv events: index forgotten (%s)", cause)
        self.index.forget()
        self._sequence = SequenceCheck()
        self._rank = None
        if self._metrics is not None:
            self._metrics.kv_events_gaps.labels(cause).inc()
        self._size()

    def malformed(self) -> None:
        """A batch could not be read: it may have removed blocks, so forget."""
        self._batch(MALFORMED)
        self.forget(CAUSE_MALFORMED)

    def disconnected(self) -> None:
        """The publisher's connection closed (an engine that stopped or restarted)."""
        self.index.forget()
        self._sequence.disconnected()
        self._rank = None
        if self._metrics is not None:
            self._metrics.kv_events_gaps.labels(CAUSE_DISCONNECTED).inc()
        self._size()

    def replayed(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.kv_events_replays.labels(outcome).inc()

    def _batch(self, outcome: str) -> None:
        if self._counts is not None:
            self._counts.batch(outcome)

    def _evicted(self, blocks: int) -> None:
        if self._counts is not None:
            self._counts.evictions.inc(blocks)

    def _size(self) -> None:
        if self._counts is not None:
            self._counts.blocks.set(len(self.index))
