"""The bookkeeping of one request, the same for both front doors.

    scope = scopes.open(route, request_id, carrier)   route: an HTTP path or a gRPC method;
                               carrier: the client's headers or metadata (W3C trace context)
    scope.admit()              Overloaded / Draining raise here (503 / RESOURCE_EXHAUSTED...)
    scope.observe_timings(t)   stage latencies the core measured (prefill, handoff, decode...)
    scope.outcome = "ok"       or scope.failed(error) / scope.cancelled() / scope.broken(error)
    scope.close()              counted once: requests{outcome}, stage "total", in-flight gauge,
                               admission left (once a detached background task ended too);
                               the request span ended with the outcome
    scope.trace                the request's spans (``sidecar.observability.tracing``; a no-op
                               when off): the
                               core opens leg spans under it and injects it into engine calls

Every metric carries the front door (``http`` | ``grpc``); the ``route`` label is a closed set
(the PD routes' paths, the two gRPC methods). A request refused at admission is counted with
outcome ``refused``; a stream that broke after its first byte with ``broken_stream``; a
client that went away with ``cancelled`` (and ``client_cancelled`` in the errors). A
background engine call that outlives the request (a gRPC Prefill whose SGLang/Mooncake prefill
runs on) shares the admission slot (``detach``), so draining waits for it too.

While a scope is open its request span is the current span of the task that opened it, so
JSON log lines written for the request carry its ``trace_id`` and ``span_id``.

Admission is shared by both front doors: ``enter()`` refuses over ``--max-inflight``
(``Overloaded``) or after SIGTERM (``Draining``), ``leave()`` wakes ``wait_idle()`` when the
last request ends; with ``--workers N`` the bound is the pool's
(``sidecar.workers.shared_inflight``).

Deliberate limits: the scope does not log (the front door says what went wrong in its
words); admission is a plain counter, not a queue (a refused client retries: HTTP 503
carries Retry-After); draining is per process (every worker gets SIGTERM).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from sidecar.errors import ClientCancelled, Draining, Overloaded, SidecarError
from sidecar.observability.metrics import Metrics
from sidecar.observability.prometheus_private import CounterValue, HistogramValues
from sidecar.observability.tracing import (
    NO_TRACING,
    NOOP_TRACE,
    Carrier,
    NoTracing,
    RequestTrace,
    Tracing,
)

#: Outcomes a request is counted with (``disagg_requests_total{outcome}``).
OK: Final = "ok"
ERROR: Final = "error"
REFUSED: Final = "refused"
CANCELLED: Final = "cancelled"
BROKEN_STREAM: Final = "broken_stream"
FALLBACK: Final = "fallback"
PASSTHROUGH: Final = "passthrough"
#: A short prompt run whole on the local engine (``--local-prefill-max-tokens``).
LOCAL_SHORT: Final = "local_short"
#: A prompt the local engine holds nearly whole (``--local-prefill-max-uncached-tokens``).
LOCAL_CACHED: Final = "local_cached"
#: A prefill target on a route the engine does not run as a pair: run whole on it.
LOCAL_ROUTE: Final = "local_route"
#: A request naming state that lives on one engine (Responses): run whole on the local one.
LOCAL_STATE: Final = "local_state"
#: A prefill target on a route the engine does not serve at all: refused (404).
UNSERVED_ROUTE: Final = "unserved_route"
#: Its engine died after the answer began; it was answered by another
#: (``sidecar.request.migration``).
MIGRATED: Final = "migrated"


class PoolInflight(Protocol):
    """The other workers' requests in flight, and where this worker's count is published."""

    def others(self) -> int: ...

    def publish(self, inflight: int) -> None: ...


class Admission:
    """Counts requests in flight and refuses new ones when full or draining."""

    def __init__(self, max_inflight: int, pool: PoolInflight | None = None) -> None:
        self._max_inflight = max_inflight
        self._pool = pool
        self._inflight = 0
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def draining(self) -> bool:
        return self._draining

    def enter(self) -> None:
        if self._draining:
            raise Draining("the sidecar is shutting down")
        pool = self._pool
        if pool is None:
            if self._inflight >= self._max_inflight:
                raise Overloaded("too many requests in flight")
        elif self._inflight + pool.others() >= self._max_inflight:
            raise Overloaded("too many requests in flight")
        self._inflight += 1
        self._idle.clear()
        if pool is not None:
            pool.publish(self._inflight)

    def leave(self) -> None:
        self._inflight -= 1
        if self._pool is not None:
            self._pool.publish(self._inflight)
        if self._inflight == 0:
            self._idle.set()

    def start_draining(self) -> None:
        self._draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False when ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


@dataclass(slots=True)
class Timings:
    """Seconds spent per stage of a PD request (None: the stage did not run or did not end)."""

    prefill: float | None = None
    handoff: float | None = None
    decode_first_byte: float | None = None


class Scopes:
    """Opens request scopes for one front door over the process's metrics and admission."""

    def __init__(
        self,
        metrics: Metrics,
        admission: Admission,
        *,
        front_door: str,
        engine: str,
        connector: str,
        tracing: Tracing | NoTracing = NO_TRACING,
    ) -> None:
        self.metrics = metrics
        self.admission = admission
        self.front_door = front_door
        self.engine = engine
        self.connector = connector
        self.tracing = tracing
        # Labelled children used by every request, looked up once (the hot path's share).
        self.inflight = metrics.gauge(metrics.inflight, front_door)
        self.relayed_bytes = metrics.counter(metrics.relayed_bytes, front_door)
        self._stages: dict[str, HistogramValues] = {}
        self._requests: dict[tuple[str, str], CounterValue] = {}

    def open(
        self, route: str, request_id: str = "-", carrier: Carrier | None = None
    ) -> RequestScope:
        """A request's scope; ``carrier`` (client headers or gRPC metadata) may hold the
        client's trace context, which the request span continues."""
        tracing = self.tracing
        trace = tracing.request(
            front_door=self.front_door, route=route, engine=self.engine,
            connector=self.connector, request_id=request_id, carrier=carrier,
        ) if tracing.enabled else NOOP_TRACE
        return RequestScope(self, route, request_id, trace)

    def count_error(self, error: SidecarError) -> None:
        """Count an error that no request scope owns (a background prefill's failure)."""
        metrics = self.metrics
        metrics.labelled(metrics.errors, self.front_door, error.stage.value, error.code).inc()

    def observe(self, stage: str, seconds: float) -> None:
        histogram = self._stages.get(stage)
        if histogram is None:
            metrics = self.metrics
            histogram = self._stages[stage] = metrics.histogram(
                metrics.stage_seconds, self.front_door, stage)
        histogram.observe(seconds)

    def count_request(self, route: str, outcome: str) -> None:
        counter = self._requests.get((route, outcome))
        if counter is None:
            metrics = self.metrics
            counter = self._requests[(route, outcome)] = metrics.counter(
                metrics.requests, self.front_door, route, self.engine, self.connector, outcome)
        counter.inc()


class RequestScope:
    """Admission, in-flight gauge, outcome, errors and stage timings of one request."""

    __slots__ = ("_admitted", "_delivered", "_error", "_holders", "_scopes", "_started",
                 "outcome", "request_id", "route", "trace")

    def __init__(
        self, scopes: Scopes, route: str, request_id: str, trace: RequestTrace
    ) -> None:
        self._scopes = scopes
        self.route = route
        #: Named in log lines; a front door may update it once it knows better.
        self.request_id = request_id
        self.outcome = ERROR
        self.trace = trace
        self._error: SidecarError | None = None
        self._started = time.perf_counter()
        self._admitted = False
        self._delivered = False
        # Who holds the admission slot: the request itself, plus a detached background task.
        self._holders = 0
        if trace.active:
            trace.attach()

    @property
    def front_door(self) -> str:
        return self._scopes.front_door

    def admit(self) -> None:
        """Take an admission slot; raises ``Overloaded`` or ``Draining`` (outcome refused)."""
        scopes = self._scopes
        try:
            scopes.admission.enter()
        except SidecarError:
            self.outcome = REFUSED
            raise
        self._admitted = True
        self._holders = 1
        scopes.inflight.inc()

    def observe(self, stage: str, seconds: float) -> None:
        self._scopes.observe(stage, seconds)

    @property
    def relayed_bytes(self) -> CounterValue:
        """The counter of bytes relayed from the decode engine to this front door's clients."""
        return self._scopes.relayed_bytes

    def observe_timings(self, timings: Timings) -> None:
        observe = self._scopes.observe
        if timings.prefill is not None:
            observe("prefill", timings.prefill)
        if timings.handoff is not None:
            observe("handoff", timings.handoff)
        if timings.decode_first_byte is not None:
            observe("decode_first_byte", timings.decode_first_byte)

    def failed(self, error: SidecarError) -> None:
        """Count ``error``; a request refused at admission keeps its outcome ``refused``."""
        if self.outcome != REFUSED:
            self.outcome = ERROR
        self._error = error
        self._scopes.count_error(error)

    def broken(self, error: SidecarError) -> None:
        """A stream that failed after its first byte: counted as ``broken_stream``."""
        self.outcome = BROKEN_STREAM
        self._error = error
        self._scopes.count_error(error)

    def delivered(self) -> None:
        """The answer's last byte reached the client: a hang-up from now on is no
        cancellation (the request is counted by what it was)."""
        self._delivered = True

    def cancelled(self) -> None:
        """The client went away before the request ended (after its answer was delivered
        whole: nothing changes)."""
        if self._delivered:
            return
        self.outcome = CANCELLED
        self._error = ClientCancelled("client went away")
        self._scopes.count_error(self._error)

    def detach(self) -> Callable[[], None]:
        """Share the admission slot with a background task; call the result once it ends (the
        slot is left when both have ended: a ``wait_idle`` that returns saw the request counted)."""
        self._holders += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._drop_holder()

        return release

    def _drop_holder(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._scopes.admission.leave()

    def close(self) -> None:
        """Count the request, then leave admission (unless a background task still holds it)."""
        scopes = self._scopes
        scopes.count_request(self.route, self.outcome)
        scopes.observe("total", time.perf_counter() - self._started)
        if self._admitted:
            self._admitted = False
            scopes.inflight.dec()
            self._drop_holder()
        if self.trace.active:
            self.trace.end(self.outcome, self._error, self.request_id)
