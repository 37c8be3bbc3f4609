"""The shared services of one sidecar process, opened and closed together.

    Settings ─open_runtime()─▶ Runtime(core per front door, scopes per front door, selector,
                                       admission, health, metrics, tracing)

Both front doors (HTTP and gRPC) take the same ``Runtime`` and reach engines only through
their ``Orchestrator`` (``runtime.orchestrator`` for HTTP, ``runtime.grpc_orchestrator`` for
gRPC: SGLang's gRPC path carries rooms as int32, so gRPC requests draw from their own room
range). The engine handler is built once here, with its KV agent bound. One pooled upstream
client (``sidecar.http1.EngineClient``), one metrics registry, one admission counter, one
tracer provider when ``--otlp-endpoint`` is set (flushed and stopped on exit, off the loop).
``open_runtime`` must run inside the event loop (the client binds to it).

In a pool of workers (``worker``: ``sidecar.workers.WorkerIdentity``) each process has its own
Runtime; the worker's lane keeps its ids apart from the other workers' and its admission
counts the whole pool's requests (``sidecar.workers.shared_inflight``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sidecar.admission import Admission
from sidecar.config.settings import Settings
from sidecar.core.engine_ids import EngineIdCache
from sidecar.core.local_prefill import LocalPrefill
from sidecar.core.orchestrator import Orchestrator
from sidecar.core.scope import Scopes
from sidecar.core.upstream import make_session
from sidecar.engine_health import EngineHealth
from sidecar.engines import EngineHandler, build_handler
from sidecar.http1 import EngineClient
from sidecar.ids import INT32_ROOMS, IdSources, RoomAllocator, SnowflakeIds
from sidecar.observability.metrics import Metrics, pool_metrics_dir
from sidecar.observability.tracing import NoTracing, Tracing, start_tracing
from sidecar.targets.allowlist import Allowlist
from sidecar.targets.choice import TargetChoice
from sidecar.targets.selector import AllowlistLike, TargetSelector, parse_prefill_url
from sidecar.workers.identity import INFLIGHT_FILE, SOLO, WorkerIdentity
from sidecar.workers.shared_inflight import InflightSlots

logger = logging.getLogger(__name__)

HTTP: str = "http"
GRPC: str = "grpc"


@dataclass
class Runtime:
    """Everything a front door needs to serve requests."""

    settings: Settings
    metrics: Metrics
    session: EngineClient
    orchestrator: Orchestrator
    grpc_orchestrator: Orchestrator
    http_scopes: Scopes
    grpc_scopes: Scopes
    selector: TargetSelector
    admission: Admission
    health: EngineHealth
    local_prefill: LocalPrefill
    tracing: Tracing | NoTracing
    worker: WorkerIdentity = SOLO

    @property
    def engine_name(self) -> str:
        return self.orchestrator.engine_name

    @property
    def connector_name(self) -> str:
        return self.orchestrator.connector_name or "none"

    async def close(self) -> None:
        """Cancel what the cores still run in the background (server stop)."""
        await self.orchestrator.close()
        await self.grpc_orchestrator.close()


def build_engine_handler(settings: Settings) -> EngineHandler:
    """The handler for the engine, with its KV agent bound where the engine uses one."""
    return build_handler(settings.engine, settings.kv_connector)


def _admission(settings: Settings, worker: WorkerIdentity) -> Admission:
    """The in-flight bound: this process's, or (in a pool) the whole pool's."""
    if not worker.pooled or worker.run_dir is None:
        return Admission(settings.max_inflight)
    slots = InflightSlots.open(worker.run_dir / INFLIGHT_FILE, worker.count, worker.index)
    return Admission(settings.max_inflight, slots)


@contextlib.asynccontextmanager
async def open_runtime(
    settings: Settings, metrics: Metrics | None = None, worker: WorkerIdentity = SOLO
) -> AsyncIterator[Runtime]:
    """Build the shared services; close the client session on exit."""
    metrics = metrics or Metrics(pool_dir=pool_metrics_dir(worker.pooled))
    handler = build_engine_handler(settings)
    session = make_session(settings)
    resources = contextlib.AsyncExitStack()
    tracing = start_tracing(settings)
    try:
        engine_ids = None
        if handler.needs_engine_id:
            engine_ids = EngineIdCache(
                session, handler.parse_engine_id, timeout_s=settings.connect_timeout_s
            )
        # Each worker of a pool draws ids from its own lane (see sidecar.ids).
        snowflake = SnowflakeIds(
            settings.trtllm_machine_id, lane=worker.index, lanes=worker.count
        )
        rooms = RoomAllocator(lane=worker.index, lanes=worker.count)
        admission = _admission(settings, worker)
        connector = handler.connector_name or "none"

        pool = [parse_prefill_url(url) for url in settings.prefill_urls]
        # One view of the prefill targets for the whole process: both front doors' legs count.
        choice = TargetChoice(cooldown_s=settings.prefill_cooldown_s)

        def orchestrator(ids: IdSources, front_door: str) -> Orchestrator:
            fallbacks = metrics.prefill_fallbacks
            legs = metrics.prefill_legs
            retries = metrics.labelled(metrics.prefill_retries, front_door)
            return Orchestrator(
                settings=settings,
                handler=handler,
                session=session,
                ids=ids,
                engine_ids=engine_ids,
                on_fallback=lambda reason: fallbacks.labels(front_door, reason).inc(),
                choice=choice,
                on_prefill_leg=lambda target, outcome: metrics.labelled(
                    legs, target, outcome).inc(),
                on_retry=retries.inc,
            )

        def scopes(front_door: str) -> Scopes:
            return Scopes(metrics, admission, front_door=front_door, engine=handler.name,
                          connector=connector, tracing=tracing)

        allowlist: AllowlistLike = Allowlist.parse(settings.prefill_allowlist)
        if settings.prefill_pod_selector:
            from sidecar.targets.kubernetes import watched_pod_allowlist

            allowlist = await resources.enter_async_context(
                watched_pod_allowlist(settings, Allowlist.parse(settings.prefill_allowlist))
            )
        selector = TargetSelector(
            allowlist, pool, resolve_timeout_s=settings.connect_timeout_s, choice=choice
        )
        runtime = Runtime(
            settings=settings,
            metrics=metrics,
            session=session,
            orchestrator=orchestrator(IdSources(snowflake, rooms), HTTP),
            # SGLang's gRPC path carries rooms as int32: give gRPC requests their own range.
            grpc_orchestrator=orchestrator(
                IdSources(snowflake, rooms.narrowed(INT32_ROOMS)), GRPC
            ),
            http_scopes=scopes(HTTP),
            grpc_scopes=scopes(GRPC),
            selector=selector,
            admission=admission,
            health=EngineHealth(session, settings.engine_url, timeout_s=settings.connect_timeout_s),
            worker=worker,
            local_prefill=LocalPrefill(
                settings,
                on_tokenize_failure=lambda reason: metrics.labelled(
                    metrics.tokenize_failures, reason).inc(),
            ),
            tracing=tracing,
        )
        runtime.health.on_change(lambda ready: metrics.engine_ready.set(1 if ready else 0))
        yield runtime
    finally:
        await resources.aclose()
        await session.close()
        if tracing.enabled:
            # Exporting blocks (a collector may be slow or gone): never on the event loop.
            await asyncio.to_thread(tracing.shutdown)
