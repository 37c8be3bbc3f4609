"""A test OTLP trace receiver: OTLP/gRPC and OTLP/HTTP on loopback, OS-chosen ports.

    with otlp_grpc_receiver() as receiver:      receiver.endpoint == "grpc://127.0.0.1:PORT"
    with otlp_http_receiver() as receiver:      receiver.endpoint == "http://127.0.0.1:PORT"
        ... export spans to receiver.endpoint ...
        spans = receiver.wait_for(lambda spans: any(s.name == "x" for s in spans))

Each export request is decoded with ``opentelemetry-proto`` (``ExportTraceServiceRequest``)
into flat ``ReceivedSpan`` records with hex ids. The servers run on their own threads, as a
collector would run in its own process: an exporter that blocks its caller (a flush from the
test's event loop, a real engine's exporter) can never wait on the test's loop. ``wait_for``
waits on a condition that each export notifies, bounded by a deadline (no polling sleeps).

Deliberate limits: traces only (no metrics or logs services), no TLS, no authentication.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

SpanPredicate = Callable[[list["ReceivedSpan"]], bool]


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    #: "" for a root span.
    parent_span_id: str
    #: opentelemetry.proto.trace.v1.Span.SpanKind (1 internal, 2 server, 3 client).
    kind: int
    attributes: dict[str, Any]
    #: opentelemetry.proto.trace.v1.Status.StatusCode (0 unset, 1 ok, 2 error).
    status_code: int
    status_message: str
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""


def any_value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}


def decode_export(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        attributes=_attributes(span.attributes),
                        status_code=span.status.code,
                        status_message=span.status.message,
                        resource=resource,
                        scope=scope_spans.scope.name,
                    )
                )
    return out


class OtlpReceiver:
    """The spans every export request brought, in arrival order."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.export_requests = 0
        self.endpoint = ""

    def accept(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = decode_export(request)
        with self._changed:
            self.export_requests += 1
            self._spans.extend(spans)
            self._changed.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self._spans)

    def wait_for(self, predicate: SpanPredicate, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans once ``predicate(spans)`` holds; AssertionError at the deadline."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(list(self._spans)), timeout_s):
                names = [(s.name, s.trace_id) for s in self._spans]
                raise AssertionError(f"spans never satisfied the predicate; got {names}")
            return list(self._spans)

    async def await_for(
        self, predicate: SpanPredicate, timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        return await asyncio.to_thread(self.wait_for, predicate, timeout_s)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._receiver.accept(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def otlp_grpc_receiver(host: str = "127.0.0.1") -> Iterator[OtlpReceiver]:
    """An OTLP/gRPC TraceService on ``host`` (endpoint ``grpc://host:port``)."""
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(receiver), server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    receiver.endpoint = f"grpc://{host}:{port}"
    try:
        yield receiver
    finally:
        server.stop(grace=None)


def _http_handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(raw)
            receiver.accept(request)
            body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    return Handler


@contextlib.contextmanager
def otlp_http_receiver(host: str = "127.0.0.1") -> Iterator[OtlpReceiver]:
    """An OTLP/HTTP ``POST /v1/traces`` endpoint on ``host`` (endpoint ``http://host:port``)."""
    receiver = OtlpReceiver()
    server = ThreadingHTTPServer((host, 0), _http_handler(receiver))
    thread = threading.Thread(target=server.serve_forever, name="otlp-http-receiver", daemon=True)
    thread.start()
    receiver.endpoint = f"http://{host}:{server.server_address[1]}"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
