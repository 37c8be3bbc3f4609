"""Distributed tracing: each request's spans, exported over OTLP; off unless --otlp-endpoint.

    settings.otlp_endpoint ──otlp.start_tracing()──▶ Tracing: SDK provider + batch exporter
         (unset) ───────────────────────────────────▶ NO_TRACING: no SDK, no thread, no spans

    trace = tracing.request(front_door=, route=, ..., carrier=)   (continues a client's W3C
      │                                                           traceparent/tracestate)
      ├─ trace.span(PREFILL_SPAN, client=True)  leg.headers(h) ─▶ the prefill engine's request
      ├─ trace.span(HANDOFF_SPAN)
      ├─ trace.span(DECODE_FIRST_BYTE_SPAN, client=True)  leg.headers(h) ─▶ the decode engine's
      ├─ trace.span(RELAY_SPAN)   relayed bytes (HTTP) or tokens (gRPC)
      ├─ trace.span(MIGRATION_SPAN)  a broken stream moved (or not): why, the move's
      │                           number, the token it continued from; the continuation's
      │                           opening is a DECODE_FIRST_BYTE_SPAN of its own
      └─ trace.end(outcome, error)

Off, every request gets ``NOOP_TRACE`` (``active`` False) and a client's own ``traceparent``
reaches the engines untouched (docs/extending/design-notes.md#untraced-calls); on, each leg span
replaces the client's ``traceparent``/``tracestate`` on its engine request, so an engine
started with tracing puts its spans under the sidecar's.

Deliberate limits: W3C trace context only (``OTEL_PROPAGATORS`` is not read; ``baggage`` is
forwarded as an ordinary header); no prompt, completion or error message is ever an attribute
(messages may quote upstream state: the stable code is); the provider is this process's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from contextvars import Token
from typing import TYPE_CHECKING, Final

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

SERVICE_NAME: Final = "disagg-sidecar"
TRACER_NAME: Final = "disagg_sidecar"

# Span names.
REQUEST_SPAN: Final = "disagg.request"
PREFILL_SPAN: Final = "disagg.prefill"
HANDOFF_SPAN: Final = "disagg.handoff"
DECODE_FIRST_BYTE_SPAN: Final = "disagg.decode_first_byte"
RELAY_SPAN: Final = "disagg.relay"
#: A stream (or a whole request) moved to another engine after its own failed.
MIGRATION_SPAN: Final = "disagg.migration"

# Attribute keys (OpenTelemetry semantic conventions where one fits, else ``disagg.*``).
FRONT_DOOR: Final = "disagg.front_door"
ROUTE: Final = "disagg.route"
ENGINE: Final = "disagg.engine"
CONNECTOR: Final = "disagg.connector"
OUTCOME: Final = "disagg.outcome"
REQUEST_ID: Final = "disagg.request_id"
ERROR_STAGE: Final = "disagg.error.stage"
ERROR_TYPE: Final = "error.type"
PREFILL_TARGET: Final = "disagg.prefill.target"
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
HTTP_STATUS: Final = "http.response.status_code"
RELAYED_BYTES: Final = "disagg.relay.bytes"
RELAYED_TOKENS: Final = "disagg.relay.tokens"
MIGRATION_REASON: Final = "disagg.migration.reason"
MIGRATION_MOVES: Final = "disagg.migration.moves"
MIGRATION_FROM_TOKEN: Final = "disagg.migration.from_token"

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
_TRACE_HEADERS: Final = frozenset({TRACEPARENT, TRACESTATE})
_PROPAGATOR: Final = TraceContextTextMapPropagator()

Carrier = Mapping[str, str] | Iterable[tuple[str, str | bytes]]


class LegSpan:
    """One span of a request (a leg, the hand-off, the relay); ends once. This class itself
    is an untraced request's span (``NOOP_SPAN``: does nothing); a traced one overrides each."""

    __slots__ = ()
    #: False when nothing is recorded: callers skip computing attributes.
    recording = False

    def set(self, key: str, value: AttributeValue) -> None:
        """Set an attribute (never prompt or completion text)."""

    def fail(self, error: BaseException) -> None:
        """Mark the span failed with the error's stable code (or its type)."""

    def headers(self, base: Mapping[str, str]) -> Mapping[str, str]:
        """``base`` with this span as the ``traceparent`` (and ``tracestate``) of a request."""
        return base

    def end(self) -> None:
        """End the span (later calls do nothing)."""

    def __enter__(self) -> LegSpan:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        return None


class RequestTrace:
    """The spans of one client request, rooted at its request span. This class itself is an
    untraced request's trace (``NOOP_TRACE``: returns at once); a traced one overrides each."""

    __slots__ = ()
    #: False for ``NOOP_TRACE``: a caller may skip its bookkeeping calls altogether.
    active = False

    def span(
        self,
        name: str,
        *,
        client: bool = False,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> LegSpan:
        """A child span of the request span, started now."""
        return NOOP_SPAN

    def set(self, key: str, value: AttributeValue) -> None:
        """Set an attribute of the request span."""

    def attach(self) -> None:
        """Make the request span current in this task (log lines carry its ids) until
        ``detach``; both calls happen in the same task, once each."""

    def detach(self) -> None:
        """Undo ``attach`` (``end`` does it too)."""

    def current(self) -> contextlib.AbstractContextManager[None]:
        """``attach`` ... ``detach`` as a context manager."""
        return _NULL_CONTEXT

    def end(
        self, outcome: str, error: BaseException | None = None, request_id: str | None = None
    ) -> None:
        """End the request span with its outcome (and its final request id), and ``detach``;
        later calls do nothing."""


NOOP_SPAN: Final = LegSpan()
NOOP_TRACE: Final = RequestTrace()
_NULL_CONTEXT: Final = contextlib.nullcontext()


def _mark_failed(span: otel_trace.Span, error: BaseException) -> None:
    code = getattr(error, "code", None)
    kind = code if isinstance(code, str) else type(error).__name__
    span.set_attribute(ERROR_TYPE, kind)
    stage = getattr(error, "stage", None)
    stage_name = getattr(stage, "value", None)
    if isinstance(stage_name, str):
        span.set_attribute(ERROR_STAGE, stage_name)
    # The code, never the message: a message may quote upstream state.
    span.set_status(Status(StatusCode.ERROR, kind))


class _Span(LegSpan):
    __slots__ = ("_ended", "_span", "recording")

    def __init__(self, span: otel_trace.Span) -> None:
        self._span = span
        self._ended = False
        # A span the sampler dropped still propagates its context, but records nothing.
        self.recording = span.is_recording()

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def fail(self, error: BaseException) -> None:
        _mark_failed(self._span, error)

    def headers(self, base: Mapping[str, str]) -> Mapping[str, str]:
        out = {name: value for name, value in base.items() if name.lower() not in _TRACE_HEADERS}
        _PROPAGATOR.inject(out, otel_trace.set_span_in_context(self._span))
        return out

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._span.end()

    def __enter__(self) -> LegSpan:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.fail(exc)
        self.end()


class _Trace(RequestTrace):
    __slots__ = ("_context", "_ended", "_span", "_token", "_tracer", "_unsampled")
    active = True

    def __init__(self, tracer: otel_trace.Tracer, span: otel_trace.Span) -> None:
        self._tracer = tracer
        self._span = span
        self._context = otel_trace.set_span_in_context(span)
        self._ended = False
        self._token: Token[otel_context.Context] | None = None
        # Dropped by the sampler: its legs would be too (standard samplers follow the trace),
        # so they share its non-recording span, whose context tells engines "not sampled".
        self._unsampled = None if span.is_recording() else _Span(span)

    def span(
        self,
        name: str,
        *,
        client: bool = False,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> LegSpan:
        if self._unsampled is not None:
            return self._unsampled
        kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
        return _Span(
            self._tracer.start_span(name, self._context, kind=kind, attributes=attributes)
        )

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def attach(self) -> None:
        if self._token is None:
            self._token = otel_context.attach(self._context)

    def detach(self) -> None:
        token, self._token = self._token, None
        if token is not None:
            otel_context.detach(token)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        self.attach()
        try:
            yield
        finally:
            self.detach()

    def end(
        self, outcome: str, error: BaseException | None = None, request_id: str | None = None
    ) -> None:
        self.detach()
        if self._ended:
            return
        self._ended = True
        self._span.set_attribute(OUTCOME, outcome)
        if request_id is not None:
            self._span.set_attribute(REQUEST_ID, request_id)
        if error is not None:
            _mark_failed(self._span, error)
        self._span.end()


def carrier_headers(carrier: Carrier) -> dict[str, str]:
    """The W3C trace headers of an HTTP header mapping or of gRPC metadata pairs."""
    out: dict[str, str] = {}
    if isinstance(carrier, Mapping):
        for name in _TRACE_HEADERS:
            value = carrier.get(name)
            if isinstance(value, str):
                out[name] = value
        return out
    for name, value in carrier:
        lower = name.lower()
        if lower in _TRACE_HEADERS and isinstance(value, str):
            out[lower] = value
    return out


class Tracing:
    """Tracing on: this process's tracer provider, exporting through a batch processor."""

    enabled: Final = True

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer(TRACER_NAME)

    def request(
        self,
        *,
        front_door: str,
        route: str,
        engine: str,
        connector: str,
        request_id: str,
        carrier: Carrier | None = None,
    ) -> RequestTrace:
        """Start a request span: a child of the client's trace context when it sent one."""
        parent = (
            _PROPAGATOR.extract(carrier_headers(carrier)) if carrier is not None else None
        )
        span = self._tracer.start_span(
            REQUEST_SPAN,
            parent,
            kind=SpanKind.SERVER,
            attributes={
                FRONT_DOOR: front_door,
                ROUTE: route,
                ENGINE: engine,
                CONNECTOR: connector,
                REQUEST_ID: request_id,
            },
        )
        return _Trace(self._tracer, span)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export every ended span now (blocks: call it off the event loop)."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporter (blocks: call it off the event loop)."""
        self.provider.shutdown()


class NoTracing:
    """Tracing off: no provider, no exporter thread; every request gets ``NOOP_TRACE``."""

    enabled: Final = False

    def request(
        self,
        *,
        front_door: str,
        route: str,
        engine: str,
        connector: str,
        request_id: str,
        carrier: Carrier | None = None,
    ) -> RequestTrace:
        return NOOP_TRACE

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        return None


NO_TRACING: Final = NoTracing()
