"""Prometheus metrics of one sidecar (one registry, shared by both front doors).

Every metric carries ``front_door`` (http | grpc). Names and labels are the public contract
documented in README's metrics table; ``tests`` read them through the real exposition.

Deliberate limits: label values come from closed sets (routes, engines, connectors, error
codes, stages, data-parallel ranks below the configured size), never from client input, so
cardinality stays bounded; that also bounds
``Metrics.labelled``'s cache of labelled children (the hot path's way to skip ``labels()``).

Workers (``--workers N``, N > 1): the supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` for every
worker, so prometheus-client keeps each process's values in files there and every worker's
``/metrics`` reads all of them (``MultiProcessCollector``): the pod is one sidecar, with the
same names and labels. Counters and histograms add up across workers, a dead worker's
included (they never go backwards); the gauges say how they combine: ``livesum`` for what
each worker holds (requests in flight, staged KV bytes), ``livemax`` for the engine's
readiness (every worker probes the same engine; a worker just restarted and not yet probing
must not report it down). One worker (no pool) exposes its registry as it is, exactly as
before, even where someone else set that variable. prometheus-client's multiprocess mode
keeps no ``_created`` samples.
"""

from __future__ import annotations

import os
from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector

_M = TypeVar("_M", bound=MetricWrapperBase)

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
)

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
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        r = self.registry
        self.requests = Counter(
            "disagg_requests",
            "Requests handled, by front door, route, engine, connector and outcome.",
            ["front_door", "route", "engine", "connector", "outcome"],
            registry=r,
        )
        self.stage_seconds = Histogram(
            "disagg_stage_seconds",
            "Latency of each stage: prefill, handoff, decode_first_byte, total.",
            ["front_door", "stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "disagg_inflight_requests",
            "Requests in flight, by front door.",
            ["front_door"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.errors = Counter(
            "disagg_errors",
            "Errors reported to clients, by front door, stage and code.",
            ["front_door", "stage", "code"],
            registry=r,
        )
        self.relayed_bytes = Counter(
            "disagg_relayed_bytes",
            "Bytes relayed from the decode engine to clients.",
            ["front_door"],
            registry=r,
        )
        self.prefill_fallbacks = Counter(
            "disagg_prefill_fallbacks",
            "Requests served by a local prefill after their prefill leg failed (policy 'local').",
            ["front_door", "reason"],
            registry=r,
        )
        self.prefill_legs = Counter(
            "disagg_prefill_legs",
            "Prefill legs to remote targets by target (its address for static-pool members, "
            "'header' for router-named ones) and outcome (ok, failed, connect_refused).",
            ["target", "outcome"],
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
            "Prefills moved to another target after a refused connect.",
            ["front_door"],
            registry=r,
        )
        self.tokenize_failures = Counter(
            "disagg_tokenize_failures",
            "Prompt-length tokenize calls that failed (the request was disaggregated).",
            ["reason"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "disagg_kv_bytes",
            "KV block bytes streamed through the gRPC front door, by direction (out|in).",
            ["direction"],
            registry=r,
        )
        self.staged_bytes = Gauge(
            "disagg_staged_kv_bytes",
            "KV bytes staged for decode requests (inline KV transport).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.engine_ready = Gauge(
            "disagg_engine_ready",
            "1 when the local engine answered its health check, else 0.",
            registry=r,
            multiprocess_mode="livemax",
        )

    def labelled(self, metric: _M, *values: str) -> _M:
        """``metric.labels(*values)``, remembered: ``labels()`` validates and locks per call.

        ``metric`` must be one of this object's families (the key is its identity).
        """
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return cast(_M, child)

    def exposition(self) -> bytes:
        """The registry (with workers: every worker's values) in Prometheus text format."""
        return generate_latest(self._exposed)
