"""Prometheus metrics of one sidecar (one registry, shared by both front doors).

Names and labels are the public contract of the metrics table of docs/operating/metrics.md
(``front_door`` is http
or grpc); tests read them through the real exposition. With ``--workers N`` every worker's
``/metrics`` reads the whole pool's values (``pool_dir``; how each family combines:
docs/operating/workers.md; docs/extending/design-notes.md#pool-metrics).

Deliberate limits: label values come from closed sets (data-parallel ranks: below the
configured size), never from client input, so cardinality stays bounded (and so does
``Metrics.labelled``'s cache of children).
"""

from __future__ import annotations

import os
from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector

from sidecar.observability.prometheus_private import CounterValue, GaugeValue, HistogramValues

_M = TypeVar("_M", bound=MetricWrapperBase)

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0)
#: Prompt tokens found in the local engine's cache: block multiples (16 .. 128 tokens) and up.
_CACHED_TOKEN_BUCKETS = (
    0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

CONTENT_TYPE = CONTENT_TYPE_LATEST
#: Read by prometheus-client when it is first imported: set by the supervisor for its workers.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _pool_registry(directory: str) -> CollectorRegistry:
    """The registry that reads every worker's files in ``directory``."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return registry


def pool_metrics_dir(pooled: bool) -> str | None:
    """Where a pool's workers keep their values (set by the supervisor), None for one process."""
    return (os.environ.get(MULTIPROC_DIR_ENV) or None) if pooled else None


class Metrics:
    """The sidecar's metric families, registered in their own registry."""

    def __init__(
        self, registry: CollectorRegistry | None = None, pool_dir: str | None = None
    ) -> None:
        """``pool_dir``: a pool's multiprocess directory; ``/metrics`` then reads them all."""
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._exposed = self.registry if pool_dir is None else _pool_registry(pool_dir)
        self._pooled = pool_dir is not None
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        self._counters: dict[tuple[int, tuple[str, ...]], CounterValue] = {}
        r = self.registry
        self.requests = Counter(
            "disagg_requests",
            "Requests handled, by front door, route, engine, connector and outcome.",
            ["front_door", "route", "engine", "connector", "outcome"], registry=r)
        self.stage_seconds = Histogram(
            "disagg_stage_seconds",
            "Latency of each stage: prefill, handoff, decode_first_byte, total.",
            ["front_door", "stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge(
            "disagg_inflight_requests", "Requests in flight, by front door.",
            ["front_door"], registry=r, multiprocess_mode="livesum")
        self.errors = Counter(
            "disagg_errors", "Errors reported to clients, by front door, stage and code.",
            ["front_door", "stage", "code"], registry=r)
        self.relayed_bytes = Counter(
            "disagg_relayed_bytes", "Bytes relayed from the decode engine to clients.",
            ["front_door"], registry=r)
        self.prefill_fallbacks = Counter(
            "disagg_prefill_fallbacks",
            "Requests served by a local prefill after their prefill leg failed (policy 'local').",
            ["front_door", "reason"], registry=r)
        self.prefill_legs = Counter(
            "disagg_prefill_legs",
            "Prefill legs to remote targets by target (its address for static-pool members, "
            "'header' for router-named ones) and outcome (ok, failed, connect_refused).",
            ["target", "outcome"],
            registry=r,
        )
        self.prefill_breaker_state = Gauge(
            "disagg_prefill_breaker_state",
            "Circuit breaker of prefill targets by target (as disagg_prefill_legs_total "
            "labels it; 'header': the worst among router-named ones): 0 closed, 1 half-open, "
            "2 open.",
            ["target"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.prefill_mismatches = Counter(
            "disagg_prefill_mismatches",
            "Prefill targets left out of a request because they cannot hand KV off to the "
            "local engine, by target (as disagg_prefill_legs_total labels it) and kind "
            "(model: another model or weights; kv_layout: another KV cache layout; unknown: "
            "it does not say what it serves). Never counted against a circuit breaker.",
            ["target", "kind"],
            registry=r,
        )
        self.rank_legs = Counter(
            "disagg_rank_legs",
            "Legs on data-parallel ranks (engines with --data-parallel-size above 1) by leg "
            "(prefill, decode), rank (0..size-1 of the configured size) and outcome (ok, "
            "failed, connect_refused, rejected); a failed one cools its rank down.",
            ["leg", "rank", "outcome"],
            registry=r,
        )
        self.prefill_retries = Counter(
            "disagg_prefill_retries",
            "Prefills moved to another target after one that provably did no work (refused "
            "or unreachable connect, 503/429, open circuit breaker).",
            ["front_door"],
            registry=r,
        )
        self.migrations = Counter(
            "disagg_migrations",
            "Requests whose engine failed after their answer began, by outcome (migrated: "
            "continued on another engine; refused: not moved, and why; failed: the move's "
            "continuation failed to start or diverged) and reason (migrated: what failed; "
            "refused: the reason; failed: the error code).",
            ["outcome", "reason"], registry=r)
        self.tokenize_failures = Counter(
            "disagg_tokenize_failures",
            "Prompt-length tokenize calls that failed (the request was disaggregated).",
            ["reason"], registry=r)
        self.kv_bytes = Counter(
            "disagg_kv_bytes",
            "KV block bytes streamed through the gRPC front door, by direction (out|in).",
            ["direction"], registry=r)
        self.staged_bytes = Gauge(
            "disagg_staged_kv_bytes", "KV bytes staged for decode requests (inline KV transport).",
            registry=r, multiprocess_mode="livesum")
        self.inflating_body_bytes = Gauge(
            "disagg_inflating_body_bytes",
            "Inflated bytes of compressed request bodies still being read, together (the "
            "budget: --max-inflating-body-bytes).", registry=r, multiprocess_mode="livesum")
        self.engine_ready = Gauge(
            "disagg_engine_ready", "1 when the local engine answered its health check, else 0.",
            registry=r, multiprocess_mode="livemax")
        # The local engine's KV events (--kv-events-endpoint) and the index they feed.
        self.kv_events = Counter(
            "disagg_kv_events",
            "KV events applied to the index, by kind (block_stored, block_removed, "
            "all_blocks_cleared).",
            ["kind"], registry=r)
        self.kv_event_batches = Counter(
            "disagg_kv_event_batches",
            "KV event batches received, by outcome (applied, malformed, other_topic, "
            "other_rank, leftover).",
            ["outcome"], registry=r)
        self.kv_events_gaps = Counter(
            "disagg_kv_events_gaps",
            "Times the index forgot everything, by cause (missed: batches missing and not "
            "replayed, restarted: the numbering went back, disconnected, malformed, "
            "reader_failed: receiving raised, the sockets were opened again).",
            ["cause"], registry=r)
        self.kv_events_replays = Counter(
            "disagg_kv_events_replays",
            "Replays of missed KV event batches, by outcome (complete, incomplete, failed).",
            ["outcome"], registry=r)
        self.kv_event_lag = Histogram(
            "disagg_kv_event_lag_seconds",
            "Seconds from the engine's stamp on a KV event batch (its clock, which is this "
            "node's) to the batch applied to the index: how far the index trails the engine.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_index_blocks = Gauge(
            "disagg_kv_index_blocks", "Blocks of the local engine's cache the index holds.",
            registry=r, multiprocess_mode="livesum")
        self.kv_index_evictions = Counter(
            "disagg_kv_index_evictions",
            "Blocks the index forgot to stay within --kv-events-max-blocks.", registry=r)
        self.cached_prompt_tokens = Histogram(
            "disagg_cached_prompt_tokens",
            "Prompt tokens found in the local engine's prefix cache, per request the placement "
            "decision judged from the KV events.",
            buckets=_CACHED_TOKEN_BUCKETS, registry=r)

    def labelled(self, metric: _M, *values: str) -> _M:
        """``metric.labels(*values)``, remembered (``labels()`` validates and locks per call);
        ``metric`` must be one of this object's families (the key is its identity)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return cast(_M, child)

    def forget(self, metric: MetricWrapperBase, *values: str) -> bool:
        """Remove ``metric``'s series of ``values`` (what it was about is gone), and the
        remembered child: a later ``labelled`` makes a fresh one. False in a worker pool,
        whose series prometheus-client cannot remove (its files keep them): the caller sets
        the series' neutral value instead."""
        if self._pooled:
            return False
        key = (id(metric), values)
        self._children.pop(key, None)
        self._counters.pop(key, None)
        metric.remove(*values)
        return True

    def counter(self, metric: Counter, *values: str) -> CounterValue:
        """The hot path's handle on ``metric.labels(*values)`` (``prometheus_private``),
        remembered like ``labelled``'s children."""
        key = (id(metric), values)
        handle = self._counters.get(key)
        if handle is None:
            handle = self._counters[key] = CounterValue(self.labelled(metric, *values))
        return handle

    def gauge(self, metric: Gauge, *values: str) -> GaugeValue:
        """A gauge child's hot-path handle (made once per caller: callers keep it)."""
        return GaugeValue(self.labelled(metric, *values))

    def histogram(self, metric: Histogram, *values: str) -> HistogramValues:
        """A histogram child's hot-path handle (made once per caller: callers keep it)."""
        return HistogramValues(self.labelled(metric, *values))

    def exposition(self) -> bytes:
        """The registry (with workers: every worker's values) in Prometheus text format."""
        return generate_latest(self._exposed)
