"""sidecar.observability.tracing on its own: off is inert, on exports a parented span tree over
OTLP.

Proves: without an endpoint nothing starts (no exporter thread, the shared no-op trace, engine
headers handed back untouched); endpoint URLs are checked and their scheme picks OTLP/gRPC or
OTLP/HTTP; both transports deliver spans to a receiver in this process, decoded with
opentelemetry-proto; a client's traceparent is continued (same trace id, the request span
under the client's span) and replaced on engine requests by the leg's own span, with the
client's tracestate kept; without one the sidecar starts the trace; attributes and error
status carry codes, never messages; OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES and
OTEL_TRACES_SAMPLER are honoured; JSON log lines carry trace_id and span_id only while a
request span is current; gRPC metadata pairs are a carrier too.

Does not prove: the sidecar's pipeline opens these spans (tests/tracing/test_tracing_flows.py
does, through both front doors).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpExporter,
)
from otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_grpc_receiver, otlp_http_receiver
from pydantic import ValidationError

from sidecar.config.settings import Settings
from sidecar.errors import PrefillFailed, Stage
from sidecar.observability.logs import configure_logging
from sidecar.observability.otlp import check_endpoint, make_exporter, start_tracing
from sidecar.observability.tracing import (
    NO_TRACING,
    NOOP_TRACE,
    PREFILL_SPAN,
    RELAY_SPAN,
    REQUEST_SPAN,
    Tracing,
    carrier_headers,
)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
_OTEL_VARS = ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER",
              "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED")


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def grpc_receiver() -> Iterator[OtlpReceiver]:
    with otlp_grpc_receiver() as receiver:
        yield receiver


def started(endpoint: str) -> Tracing:
    tracing = start_tracing(Settings(otlp_endpoint=endpoint).otlp_endpoint)
    assert isinstance(tracing, Tracing)
    return tracing


def one_request(tracing: Tracing, carrier: dict[str, str] | None = None) -> dict[str, str]:
    """A request with a prefill leg and a relay; returns the prefill leg's engine headers."""
    trace = tracing.request(front_door="http", route="/v1/completions", engine="vllm",
                            connector="shfs", request_id="req-1", carrier=carrier)
    with trace.span(PREFILL_SPAN, client=True, attributes={"server.port": 8100}) as leg:
        headers = dict(leg.headers({"X-Request-Id": "req-1", **(carrier or {})}))
    with trace.span(RELAY_SPAN) as relay:
        relay.set("disagg.relay.bytes", 42)
    trace.end("ok")
    return headers


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans}


def has(*names: str) -> object:
    return lambda spans: set(names) <= {s.name for s in spans}


def exporter_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "Otel" in t.name]


def test_off_starts_nothing_and_adds_no_header() -> None:
    before = exporter_threads()
    tracing = start_tracing(Settings().otlp_endpoint)
    assert tracing is NO_TRACING
    assert exporter_threads() == before
    trace = tracing.request(front_door="grpc", route="r", engine="vllm", connector="shfs",
                            request_id="x", carrier={"traceparent": CLIENT_TRACEPARENT})
    assert trace is NOOP_TRACE
    headers = {"traceparent": CLIENT_TRACEPARENT, "X-Request-Id": "x"}
    with trace.span(PREFILL_SPAN, client=True) as leg:
        # The same mapping, not a copy: no work and no header added when off.
        assert leg.headers(headers) is headers
    assert headers == {"traceparent": CLIENT_TRACEPARENT, "X-Request-Id": "x"}
    trace.end("ok")
    assert tracing.flush() is True


@pytest.mark.parametrize(
    "url",
    ["grpc://collector:4317", "grpcs://collector.example:4317", "http://collector:4318",
     "https://collector:4318/custom/v1/traces", "http://[::1]:4318"],
)
def test_endpoint_accepted(url: str) -> None:
    assert Settings(otlp_endpoint=url).otlp_endpoint == url


@pytest.mark.parametrize(
    "url",
    ["collector:4317", "ftp://collector:4317", "grpc://collector", "grpc://collector:4317/x",
     "http://user:pw@collector:4318", "http://collector:4318/?q=1", "http://:4318",
     "http://collector:99999"],
)
def test_endpoint_refused(url: str) -> None:
    with pytest.raises(ValidationError, match="otlp_endpoint"):
        Settings(otlp_endpoint=url)
    with pytest.raises(ValueError, match="OTLP"):
        check_endpoint(url)


def test_scheme_picks_the_transport() -> None:
    assert isinstance(make_exporter("grpc://127.0.0.1:4317"), GrpcExporter)
    assert isinstance(make_exporter("grpcs://127.0.0.1:4317"), GrpcExporter)
    http = make_exporter("http://127.0.0.1:4318")
    assert isinstance(http, HttpExporter)
    # The exporter keeps its URL privately; it is the one fact this test is about.
    assert http._endpoint == "http://127.0.0.1:4318/v1/traces"
    custom = make_exporter("https://127.0.0.1:4318/otlp/v1/traces")
    assert isinstance(custom, HttpExporter)
    assert custom._endpoint == "https://127.0.0.1:4318/otlp/v1/traces"


def test_client_context_is_continued_over_grpc(grpc_receiver: OtlpReceiver) -> None:
    tracing = started(grpc_receiver.endpoint)
    try:
        headers = one_request(
            tracing, {"traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=abc"}
        )
        assert tracing.flush()
    finally:
        tracing.shutdown()
    spans = by_name(grpc_receiver.wait_for(has(REQUEST_SPAN, PREFILL_SPAN, RELAY_SPAN)))
    request, prefill, relay = spans[REQUEST_SPAN], spans[PREFILL_SPAN], spans[RELAY_SPAN]
    assert {s.trace_id for s in spans.values()} == {CLIENT_TRACE}
    assert request.parent_span_id == CLIENT_SPAN
    assert prefill.parent_span_id == request.span_id
    assert relay.parent_span_id == request.span_id
    assert (request.kind, prefill.kind, relay.kind) == (2, 3, 1)  # server, client, internal
    # The engine sees the prefill leg as its parent, and the client's tracestate.
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{prefill.span_id}-01"
    assert headers["tracestate"] == "vendor=abc"
    assert headers["X-Request-Id"] == "req-1"
    assert request.attributes == {
        "disagg.front_door": "http", "disagg.route": "/v1/completions", "disagg.engine": "vllm",
        "disagg.connector": "shfs", "disagg.request_id": "req-1", "disagg.outcome": "ok",
    }
    assert prefill.attributes == {"server.port": 8100}
    assert relay.attributes == {"disagg.relay.bytes": 42}
    assert request.resource["service.name"] == "disagg-sidecar"
    assert request.scope == "disagg_sidecar"


def test_without_client_context_the_sidecar_starts_the_trace() -> None:
    with otlp_http_receiver() as receiver:
        tracing = started(receiver.endpoint)
        try:
            headers = one_request(tracing)
            assert tracing.flush()
        finally:
            tracing.shutdown()
        spans = by_name(receiver.wait_for(has(REQUEST_SPAN, PREFILL_SPAN)))
    request = spans[REQUEST_SPAN]
    assert request.parent_span_id == ""
    version, trace_id, parent, flags = headers["traceparent"].split("-")
    assert (version, trace_id, parent) == ("00", request.trace_id, spans[PREFILL_SPAN].span_id)
    assert int(flags, 16) & 0x01  # sampled (the SDK may also set the random-id flag 0x02)
    assert "tracestate" not in headers


def test_failure_carries_the_code_not_the_message(grpc_receiver: OtlpReceiver) -> None:
    tracing = started(grpc_receiver.endpoint)
    error = PrefillFailed("prefill engine answered HTTP 500 for 'secret prompt'",
                          stage=Stage.PREFILL)
    try:
        trace = tracing.request(front_door="http", route="/v1/completions", engine="vllm",
                                connector="shfs", request_id="req-2")
        with pytest.raises(PrefillFailed), trace.span(PREFILL_SPAN, client=True):
            raise error
        trace.end("error", error)
        assert tracing.flush()
    finally:
        tracing.shutdown()
    spans = by_name(grpc_receiver.wait_for(has(REQUEST_SPAN, PREFILL_SPAN)))
    for span in spans.values():
        assert span.status_code == 2
        assert span.status_message == error.code
        assert span.attributes["error.type"] == error.code
        assert span.attributes["disagg.error.stage"] == "prefill"
        assert "secret prompt" not in repr(span)
    assert spans[REQUEST_SPAN].attributes["disagg.outcome"] == "error"


def test_standard_otel_variables_are_honoured(
    grpc_receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pd-decode")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=pd-decode-0,team=llm")
    tracing = started(grpc_receiver.endpoint)
    try:
        one_request(tracing)
        assert tracing.flush()
    finally:
        tracing.shutdown()
    request = by_name(grpc_receiver.wait_for(has(REQUEST_SPAN)))[REQUEST_SPAN]
    assert request.resource["service.name"] == "pd-decode"
    assert request.resource["k8s.pod.name"] == "pd-decode-0"
    assert request.resource["team"] == "llm"


def test_sampler_variable_drops_spans_but_still_propagates(
    grpc_receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tracing = started(grpc_receiver.endpoint)
    try:
        headers = one_request(tracing)
        assert tracing.flush()
    finally:
        tracing.shutdown()
    assert grpc_receiver.export_requests == 0
    # Not sampled here, so the engines are told not to sample either.
    assert not int(headers["traceparent"].rsplit("-", 1)[1], 16) & 0x01


def test_client_decision_not_to_sample_is_kept(grpc_receiver: OtlpReceiver) -> None:
    tracing = started(grpc_receiver.endpoint)
    try:
        headers = one_request(tracing, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"})
        assert tracing.flush()
    finally:
        tracing.shutdown()
    assert grpc_receiver.export_requests == 0
    assert headers["traceparent"].startswith(f"00-{CLIENT_TRACE}-")
    assert headers["traceparent"].endswith("-00")


def test_json_logs_carry_ids_while_a_request_span_is_current(
    grpc_receiver: OtlpReceiver, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    configure_logging("info", "json")
    tracing = started(grpc_receiver.endpoint)
    try:
        trace = tracing.request(front_door="http", route="/v1/completions", engine="vllm",
                                connector="shfs", request_id="req-3",
                                carrier={"traceparent": CLIENT_TRACEPARENT})
        with trace.current():
            logging.getLogger("sidecar.test").info("inside")
        logging.getLogger("sidecar.test").info("outside")
        trace.end("ok")
        assert tracing.flush()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        tracing.shutdown()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    inside = next(line for line in lines if line["msg"] == "inside")
    outside = next(line for line in lines if line["msg"] == "outside")
    request = by_name(grpc_receiver.wait_for(has(REQUEST_SPAN)))[REQUEST_SPAN]
    assert inside["trace_id"] == CLIENT_TRACE
    assert inside["span_id"] == request.span_id
    assert "trace_id" not in outside and "span_id" not in outside


def test_grpc_metadata_is_a_carrier() -> None:
    metadata = [("x-request-id", "a"), ("traceparent", CLIENT_TRACEPARENT),
                ("tracestate", "v=1"), ("bin-bin", b"\x00")]
    assert carrier_headers(metadata) == {"traceparent": CLIENT_TRACEPARENT, "tracestate": "v=1"}
    assert carrier_headers([("x-request-id", "a")]) == {}


async def test_flush_from_the_event_loop_does_not_block_it(grpc_receiver: OtlpReceiver) -> None:
    """The pipeline flushes off the loop; the receiver runs on its own threads."""
    tracing = started(grpc_receiver.endpoint)
    try:
        one_request(tracing)
        assert await asyncio.to_thread(tracing.flush)
    finally:
        await asyncio.to_thread(tracing.shutdown)
    assert has(REQUEST_SPAN)(grpc_receiver.spans())  # type: ignore[operator]
