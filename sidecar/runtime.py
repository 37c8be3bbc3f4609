"""The shared services of one sidecar process, opened and closed together.

    Settings ─open_runtime()─▶ Runtime(PD flow per front door over one dialect and one set of
                                       engine calls, the placement decision, scopes per
                                       front door, selector, admission, health, metrics,
                                       tracing)

Both front doors reach engines only through their ``Runner`` (``runtime.runner``; and
``runtime.grpc_runner``: the same, unless ``--kv-transport inline`` gives the gRPC door the
inline transport's dialect). One dialect, one pooled upstream client, one metrics registry,
one admission counter, one tracer provider with ``--otlp-endpoint`` (flushed and stopped on
exit, off the loop); ``open_runtime`` runs inside the event loop (the client binds to it).
Each worker of a pool has its own Runtime: its lane keeps its dialect's ids apart from the
other workers', its admission counts the whole pool (``sidecar.workers.shared_inflight``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from sidecar.config.limits import PrefillFailurePolicy
from sidecar.config.settings import KVTransport, Settings
from sidecar.dialects import Dialect, DialectSetup, InlineDialect, dialect_class, handoff_keys
from sidecar.engines.calls import EngineCalls, make_session
from sidecar.engines.health import BreakerProbes, EngineHealth, answer_timeout
from sidecar.engines.models import Mismatch, ServedModels
from sidecar.engines.tokenizer import PromptMeasure
from sidecar.errors import Stage
from sidecar.http1 import EngineClient
from sidecar.kv_events.engine_cache import EngineKVCache
from sidecar.kv_events.subscriber import EndpointUnavailable, open_kv_events
from sidecar.observability.metrics import Metrics, pool_metrics_dir
from sidecar.observability.otlp import start_tracing
from sidecar.observability.tracing import NoTracing, Tracing
from sidecar.protocol.context import FrontDoor, PrefillTarget
from sidecar.protocol.request import BodyChecks
from sidecar.request.migration import Migrations
from sidecar.request.placement import Placer, Rules
from sidecar.request.runner import FlowCounters, Runner
from sidecar.request.scope import Admission, Scopes
from sidecar.targets.allowlist import Allowlist
from sidecar.targets.breaker import BreakerState, CircuitBreakers
from sidecar.targets.choice import HEADER_LABEL, LegRanks, PrefillTargets, RankChoice, TargetChoice
from sidecar.targets.kubernetes import PodAllowlist, PodTarget
from sidecar.targets.selector import AllowlistLike, TargetSelector, parse_prefill_url
from sidecar.workers.identity import INFLIGHT_FILE, SOLO, WorkerIdentity
from sidecar.workers.ports import PortInUse
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
    calls: EngineCalls
    #: Runs the HTTP door's requests (and the gRPC door's, unless inline KV gives that door
    #: the inline transport's dialect: ``grpc_runner``).
    runner: Runner
    grpc_runner: Runner
    http_scopes: Scopes
    grpc_scopes: Scopes
    selector: TargetSelector
    #: Where each request of the HTTP door runs (``sidecar.request.placement``).
    placer: Placer
    admission: Admission
    health: EngineHealth
    tracing: Tracing | NoTracing
    #: The client-body checks (the hand-off keys every dialect owns are refused).
    body_checks: BodyChecks
    #: The dialect of the local engine (and its connector), as the pod labels name it.
    dialect: Dialect
    worker: WorkerIdentity = SOLO
    #: The local engine's prefix cache from its KV events (``--kv-events-endpoint``), or None.
    kv_cache: EngineKVCache | None = None
    #: Streams continued on another engine when theirs dies (``--migration-limit``).
    migrations: Migrations | None = None
    _closed: bool = False


    async def close(self) -> None:
        """Cancel and wait for what the flows and engine calls still run in the background
        (background prefills, abort calls, a dialect's look-ups); once, whichever stop path
        comes first (the gRPC server's stop, then ``open_runtime``'s exit)."""
        if self._closed:
            return
        self._closed = True
        runners = ((self.runner,) if self.grpc_runner is self.runner
                   else (self.runner, self.grpc_runner))
        try:
            for runner in runners:
                await runner.close()
        finally:
            await self.calls.close()
            for runner in runners:
                await runner.dialect.close()


def _literal_members(pool: list[PrefillTarget]) -> list[PrefillTarget]:
    """The pool entries written as IP literals, as the selector resolves them: labelled by
    their address from the start (a name is labelled by the address it resolves to, once)."""
    members = []
    for target in pool:
        try:
            address = ipaddress.ip_address(target.host)
        except ValueError:
            continue
        members.append(PrefillTarget(str(address), target.port, target.scheme))
    return members


def _admission(settings: Settings, worker: WorkerIdentity,
               resources: contextlib.AsyncExitStack) -> Admission:
    """The in-flight bound: this process's, or (in a pool) the whole pool's (its slots' map
    closed with ``resources``)."""
    if not worker.pooled or worker.run_dir is None:
        return Admission(settings.max_inflight)
    slots = InflightSlots.open(worker.run_dir / INFLIGHT_FILE, worker.count, worker.index)
    resources.callback(slots.close)
    return Admission(settings.max_inflight, slots)


async def _kv_cache(settings: Settings, metrics: Metrics,
                    resources: contextlib.AsyncExitStack) -> EngineKVCache | None:
    """The index fed by the local engine's KV events, its subscriber closed with ``resources``;
    None without ``--kv-events-endpoint``."""
    if settings.kv_events_endpoint is None:
        return None
    try:
        subscriber = await resources.enter_async_context(open_kv_events(
            settings.kv_events_endpoint, settings.kv_events_replay_endpoint,
            topic=settings.kv_events_topic or "", max_blocks=settings.kv_events_max_blocks,
            metrics=metrics))
    except EndpointUnavailable as exc:
        raise PortInUse(str(exc)) from None
    return subscriber.cache


def data_parallel_ranks(settings: Settings, ranked: bool) -> tuple[int, int]:
    """The data-parallel sizes the flow chooses ranks from (local, prefill): the configured
    ones, or one each for a dialect whose engine places requests on its ranks itself."""
    if not ranked:
        return 1, 1
    local = settings.data_parallel_size
    return local, settings.prefill_data_parallel_size or local


def _runners(settings: Settings, metrics: Metrics, calls: EngineCalls, setup: DialectSetup,
             targets: PrefillTargets, rules: Rules,
             health: EngineHealth) -> tuple[Runner, Runner]:
    """The HTTP door's runner and the gRPC door's (the same one but for the inline transport)."""
    dialect = dialect_class(settings.engine, settings.kv_connector)(setup)
    fallbacks = metrics.prefill_fallbacks
    retries = {door: metrics.labelled(metrics.prefill_retries, door) for door in FrontDoor}
    migrations = metrics.migrations
    counters = FlowCounters(
        fallback=lambda door, reason: fallbacks.labels(door, reason).inc(),
        retry=lambda door: retries[FrontDoor(door)].inc(),
        migration=lambda outcome, reason: metrics.counter(migrations, outcome, reason).inc(),
    )
    rules = replace(rules, prefill_decodes=dialect.prefill_decodes)

    def runner(of: Dialect) -> Runner:
        return Runner(of, calls, targets, targets.ranks, rules=rules, counters=counters,
                      prefill_timeout_s=settings.prefill_timeout_s, health=health)

    http_runner = runner(dialect)
    if settings.kv_transport is not KVTransport.INLINE:
        return http_runner, http_runner
    return http_runner, runner(InlineDialect(setup))


def _placer(settings: Settings, metrics: Metrics, calls: EngineCalls, runner: Runner,
            health: EngineHealth, cache: EngineKVCache | None, served: ServedModels) -> Placer:
    """The placement decision of the HTTP door's requests, over the runner's targets and
    rules; ``cache``: the local engine's prefix cache, from its KV events; ``served``: which
    targets can hand off to the local engine."""
    dialect = runner.dialect
    measure = PromptMeasure(
        source=settings.prompt_length_source,
        endpoint=dialect.tokenize,
        post_local=calls.post_local,
        timeout_s=min(settings.tokenize_timeout_s, settings.connect_timeout_s),
        on_tokenize_failure=lambda reason: metrics.labelled(
            metrics.tokenize_failures, reason).inc(),
        served_model=lambda: calls.model_name(Stage.DECODE),
    )
    choice = calls.choice
    mismatches = metrics.prefill_mismatches

    def unpaired(target: PrefillTarget, mismatch: Mismatch) -> None:
        metrics.counter(mismatches, choice.label(target), mismatch.kind).inc()

    return Placer(route_support=dialect.route_support, engine=dialect.engine,
                  rules=runner.rules, targets=runner.targets, measure=measure, cache=cache,
                  health=health,
                  on_cached_tokens=None if cache is None else cache.observe_cached_tokens,
                  kinship=served, on_unpaired=unpaired)


@contextlib.asynccontextmanager
async def open_runtime(
    settings: Settings, metrics: Metrics | None = None, worker: WorkerIdentity = SOLO
) -> AsyncIterator[Runtime]:
    """Build the shared services; on exit stop their background work, close the pooled
    in-flight slots, the client session and the tracer."""
    metrics = metrics or Metrics(pool_dir=pool_metrics_dir(worker.pooled))
    session = make_session(settings)
    resources = contextlib.AsyncExitStack()
    tracing = start_tracing(settings.otlp_endpoint)
    runtime: Runtime | None = None
    try:
        admission = _admission(settings, worker, resources)
        kv_cache = await _kv_cache(settings, metrics, resources)
        pool = [parse_prefill_url(url) for url in settings.prefill_urls]
        # One view of the prefill targets for the whole process: both front doors' legs count.
        breaker_states = metrics.prefill_breaker_state
        # The engines' health by one rule; an open breaker's target is probed, so a recovered
        # engine gets legs at once.
        health_timeout_s = answer_timeout(settings.connect_timeout_s)
        probes = BreakerProbes(session, timeout_s=health_timeout_s)
        resources.push_async_callback(probes.close)
        #: The labels whose breaker series stay while nothing is tracked under them.
        fixed_labels: set[str] = set()

        def export_breaker(label: str) -> None:
            metrics.labelled(breaker_states, label).set(choice.breaker_state(label))

        def breaker_changed(target: PrefillTarget, _: BreakerState, new: BreakerState,
                            __: str) -> None:
            export_breaker(choice.label(target))
            probes.changed(target, new)

        def breaker_forgotten(target: PrefillTarget, _: BreakerState) -> None:
            probes.forgotten(target)
            label = choice.label(target)
            if label in fixed_labels or choice.tracks(label):
                export_breaker(label)
            elif not metrics.forget(breaker_states, label):
                metrics.labelled(breaker_states, label).set(BreakerState.CLOSED)

        breakers = CircuitBreakers(
            failures=settings.prefill_breaker_failures, open_s=settings.prefill_breaker_open_s,
            successes=settings.prefill_breaker_successes, on_change=breaker_changed,
            on_forget=breaker_forgotten,
        )
        probes.breakers = breakers
        # What the engines serve: a pair joins only engines that can hand KV off (a target
        # that refused a connection restarted: what it served is asked again).
        served = ServedModels(session, settings.engine_url,
                              timeout_s=settings.connect_timeout_s,
                              layout=dialect_class(settings.engine,
                                                   settings.kv_connector).kv_layout)
        resources.push_async_callback(served.close)
        choice = TargetChoice(cooldown_s=settings.prefill_cooldown_s,
                              pool=_literal_members(pool), breakers=breakers,
                              on_refused=served.forget)
        ranks = RankChoice(cooldown_s=settings.prefill_cooldown_s)
        if choice.breakers is not None:
            fixed_labels.update({HEADER_LABEL, *(choice.label(t) for t in pool)})
            for label in fixed_labels:
                metrics.labelled(breaker_states, label).set(0)
        legs = metrics.prefill_legs
        calls = EngineCalls(
            session, settings.engine_url, connect_timeout_s=settings.connect_timeout_s,
            max_prefill_response_bytes=settings.max_prefill_response_bytes, choice=choice,
            ranks=ranks,
            on_prefill_leg=lambda target, outcome: metrics.counter(legs, target, outcome),
            on_rank_leg=lambda leg, rank, outcome: metrics.counter(
                metrics.rank_legs, leg, str(rank), outcome),
        )
        # Each worker of a pool draws ids from its own lane (the dialects' id sources).
        local_ranks, prefill_ranks = data_parallel_ranks(
            settings, dialect_class(settings.engine, settings.kv_connector).ranked)
        setup = DialectSetup(settings, lane=worker.index, lanes=worker.count, lookup=calls,
                             local_ranks=local_ranks, prefill_ranks=prefill_ranks)
        health = EngineHealth(session, settings.engine_url, timeout_s=health_timeout_s)
        ranks_of_legs = LegRanks(ranks, local_size=local_ranks, prefill_size=prefill_ranks)
        targets = PrefillTargets(choice, ranks_of_legs)
        # A dialect whose decode cannot run without its prefill still falls back before any
        # leg; after a failed leg the placement asks whether a decode went (after_failure).
        rules = Rules(max_tokens=settings.local_prefill_max_tokens,
                      max_uncached=settings.local_prefill_max_uncached_tokens,
                      local_fallback=settings.on_prefill_failure is PrefillFailurePolicy.LOCAL,
                      migration_limit=settings.migration_limit,
                      migration_pool=tuple(parse_prefill_url(url)
                                           for url in settings.migration_urls))
        http_runner, grpc_runner = _runners(settings, metrics, calls, setup, targets, rules,
                                            health)
        dialect = http_runner.dialect

        def scopes(front_door: FrontDoor) -> Scopes:
            return Scopes(metrics, admission, front_door=front_door.value,
                          engine=dialect.engine, connector=dialect.connector_label,
                          tracing=tracing)

        allowlist: AllowlistLike = Allowlist.parse(settings.prefill_allowlist)
        if settings.prefill_pod_selector:
            from sidecar.targets.kubernetes import watched_pod_allowlist

            allowlist = await resources.enter_async_context(watched_pod_allowlist(
                settings.prefill_pod_selector, Allowlist.parse(settings.prefill_allowlist),
                namespace=settings.prefill_pod_namespace, port_label=settings.port_label,
                first_list_timeout_s=settings.connect_timeout_s,
            ))
        if isinstance(allowlist, PodAllowlist):

            def pod_gone(pod: PodTarget) -> None:
                # A pod that left the pool: its breaker and probe end, what it served goes.
                target = PrefillTarget(str(pod.address), pod.port)
                breakers.forget(target)
                served.forget(target)

            allowlist.on_removed(pod_gone)
        selector = TargetSelector(
            allowlist, pool, resolve_timeout_s=settings.connect_timeout_s, choice=choice
        )
        runtime = Runtime(
            settings=settings,
            metrics=metrics,
            session=session,
            calls=calls,
            runner=http_runner,
            grpc_runner=grpc_runner,
            dialect=dialect,
            http_scopes=scopes(FrontDoor.HTTP),
            grpc_scopes=scopes(FrontDoor.GRPC),
            selector=selector,
            placer=_placer(settings, metrics, calls, http_runner, health, kv_cache, served),
            admission=admission,
            health=health,
            worker=worker,
            tracing=tracing,
            body_checks=BodyChecks(handoff_keys()),
            kv_cache=kv_cache,
            migrations=Migrations(
                dialect, http_runner, limit=settings.migration_limit,
                counter=lambda outcome, reason: metrics.counter(
                    metrics.migrations, outcome, reason).inc()),
        )
        runtime.health.on_change(lambda ready: metrics.engine_ready.set(1 if ready else 0))
        yield runtime
    finally:
        try:
            if runtime is not None:
                await runtime.close()  # every stop path, not only the gRPC server's
        finally:
            await resources.aclose()
        await session.close()
        if tracing.enabled:
            # Exporting blocks (a collector may be slow or gone): never on the event loop.
            await asyncio.to_thread(tracing.shutdown)
