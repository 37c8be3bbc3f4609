"""Tracing through the real sidecar and stub engines, both front doors, over real sockets.

Proves: with ``--otlp-endpoint`` an HTTP PD request exports one span tree to a receiver in
this process (request span, prefill leg, hand-off, decode's first byte, relay), each child
under the request span, with the attributes the issue names and no prompt text anywhere; the
prefill and decode stub engines both received a ``traceparent`` of that trace, whose parent is
the sidecar's leg span for that engine; a client's ``traceparent`` is continued (same trace
id, the request span under the client's span) and not forwarded as-is; a failed prefill marks
the spans with its error code, and the sidecar's JSON log line about it carries the request's
trace and span ids; over gRPC, a router's ``traceparent`` metadata on Prefill and
on Decode puts both RPCs and both engines' requests in the router's trace; without the
setting nothing is exported, no exporter thread runs, engines see exactly the headers they
saw before (none added, a client's own passed through untouched), and a request through
either front door makes not one call into the tracing code (a profile hook counts them).

Does not prove: that a real engine continues the trace (tests/real_vllm/test_otlp_traces.py).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import sys
import threading
import types
from collections.abc import Iterator

import pytest
from openai_builders import client_body
from otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_grpc_receiver
from trace_builders import traced_pd

import sidecar.observability.tracing
from sidecar.observability.logs import configure_logging
from sidecar.observability.tracing import (
    DECODE_FIRST_BYTE_SPAN,
    HANDOFF_SPAN,
    PREFILL_SPAN,
    RELAY_SPAN,
    REQUEST_SPAN,
)
from sidecar.protocol.context import Route
from sidecar.tools.stubs.recorder import RecordedRequest

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
SECRET = "zebra-quartz-prompt-marker"
SERVER, CLIENT, INTERNAL = 2, 3, 1
ERROR = 2


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_grpc_receiver() as receiver:
        yield receiver


def header(seen: RecordedRequest, name: str) -> str | None:
    return {k.lower(): v for k, v in seen.headers.items()}.get(name)


def traceparent_of(seen: RecordedRequest) -> tuple[str, str]:
    """(trace id, parent span id) of the traceparent an engine received."""
    value = header(seen, "traceparent")
    assert value is not None, f"no traceparent on {seen.path}"
    version, trace_id, parent, _flags = value.split("-")
    assert version == "00"
    return trace_id, parent


def tree(spans: list[ReceivedSpan], trace_id: str) -> dict[str, ReceivedSpan]:
    named: dict[str, ReceivedSpan] = {}
    for span in spans:
        if span.trace_id == trace_id:
            assert span.name not in named, f"two {span.name} spans in one request"
            named[span.name] = span
    return named


def requests_of(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == REQUEST_SPAN]


def exporter_threads() -> int:
    return sum("Otel" in t.name for t in threading.enumerate())


@pytest.mark.parametrize(("engine", "connector"), [("vllm", "shfs"), ("sglang", "shfs")],
                         ids=["sequential", "concurrent"])
async def test_http_pd_request_exports_one_span_tree(
    receiver: OtlpReceiver, engine: str, connector: str
) -> None:
    async with traced_pd(engine, connector, otlp_endpoint=receiver.endpoint) as pd:
        status, text = await pd.http(
            body=client_body(stream=True, prompt=SECRET), headers={"X-Request-Id": "trace-req-1"}
        )
        assert status == 200, text
        prefill_seen = await pd.prefill_stub.recorder.next_request("/v1/completions")
        decode_seen = await pd.decode_stub.recorder.next_request("/v1/completions")
        port = pd.prefill_stub.port
    # Leaving the block stopped the sidecar, which flushes its spans on the way out.
    spans = receiver.wait_for(lambda spans: len(requests_of(spans)) == 1)
    request = requests_of(spans)[0]
    named = tree(spans, request.trace_id)
    assert set(named) == {REQUEST_SPAN, PREFILL_SPAN, HANDOFF_SPAN, DECODE_FIRST_BYTE_SPAN,
                          RELAY_SPAN}
    assert request.parent_span_id == ""  # no client context: the sidecar starts the trace
    for name in (PREFILL_SPAN, HANDOFF_SPAN, DECODE_FIRST_BYTE_SPAN, RELAY_SPAN):
        assert named[name].parent_span_id == request.span_id, name
    assert request.kind == SERVER
    assert named[PREFILL_SPAN].kind == named[DECODE_FIRST_BYTE_SPAN].kind == CLIENT
    assert named[HANDOFF_SPAN].kind == named[RELAY_SPAN].kind == INTERNAL
    assert request.attributes == {
        "disagg.front_door": "http", "disagg.route": "/v1/completions",
        "disagg.engine": engine, "disagg.connector": connector if engine == "vllm" else "none",
        "disagg.request_id": "trace-req-1", "disagg.outcome": "ok",
    }
    prefill = named[PREFILL_SPAN].attributes
    assert prefill["disagg.prefill.target"] == f"127.0.0.1:{port}"
    assert prefill["server.address"] == "127.0.0.1"
    assert prefill["server.port"] == port
    assert prefill["http.response.status_code"] == 200
    assert named[DECODE_FIRST_BYTE_SPAN].attributes["http.response.status_code"] == 200
    assert named[RELAY_SPAN].attributes["disagg.relay.bytes"] == len(text.encode())
    # Each engine's request names the sidecar's leg span as its parent, in the same trace.
    assert traceparent_of(prefill_seen) == (request.trace_id, named[PREFILL_SPAN].span_id)
    assert traceparent_of(decode_seen) == (
        request.trace_id, named[DECODE_FIRST_BYTE_SPAN].span_id
    )
    assert SECRET not in repr(spans)


async def test_client_traceparent_is_continued_into_both_legs(receiver: OtlpReceiver) -> None:
    async with traced_pd("vllm", otlp_endpoint=receiver.endpoint) as pd:
        status, text = await pd.http(
            headers={"traceparent": CLIENT_TRACEPARENT, "tracestate": "router=7"}
        )
        assert status == 200, text
        prefill_seen = await pd.prefill_stub.recorder.next_request("/v1/completions")
        decode_seen = await pd.decode_stub.recorder.next_request("/v1/completions")
    spans = receiver.wait_for(lambda spans: len(requests_of(spans)) == 1)
    named = tree(spans, CLIENT_TRACE)
    assert named[REQUEST_SPAN].parent_span_id == CLIENT_SPAN
    assert traceparent_of(prefill_seen) == (CLIENT_TRACE, named[PREFILL_SPAN].span_id)
    assert traceparent_of(decode_seen) == (CLIENT_TRACE, named[DECODE_FIRST_BYTE_SPAN].span_id)
    assert header(prefill_seen, "tracestate") == header(decode_seen, "tracestate") == "router=7"


@contextlib.contextmanager
def json_logging() -> Iterator[None]:
    """The sidecar's JSON log lines on stderr; call it in the test body, where ``capsys``
    captures (pytest closes a fixture's capture between setup and the call)."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    configure_logging("warning", "json")
    try:
        yield
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


async def test_failed_prefill_marks_the_spans_with_its_code(
    receiver: OtlpReceiver, capsys: pytest.CaptureFixture[str]
) -> None:
    with json_logging():
        async with traced_pd("vllm", otlp_endpoint=receiver.endpoint) as pd:
            pd.prefill_stub.faults.add("status", path="/v1/completions", times=1, status=500)
            status, _ = await pd.http(headers={"X-Request-Id": "failing-1"})
            assert status == 502
    spans = receiver.wait_for(lambda spans: len(requests_of(spans)) == 1)
    request = requests_of(spans)[0]
    named = tree(spans, request.trace_id)
    # The sidecar's log line about this request names its trace and request span.
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()
             if line.startswith("{")]
    failure = next(line for line in lines if "failing-1" in line["msg"])
    assert (failure["trace_id"], failure["span_id"]) == (request.trace_id, request.span_id)
    assert DECODE_FIRST_BYTE_SPAN not in named
    for name in (REQUEST_SPAN, PREFILL_SPAN):
        assert named[name].status_code == ERROR, name
        assert named[name].attributes["error.type"] == "prefill_failed", name
    assert named[PREFILL_SPAN].attributes["http.response.status_code"] == 500
    assert named[REQUEST_SPAN].attributes["disagg.outcome"] == "error"


async def test_off_exports_nothing_and_adds_no_header(receiver: OtlpReceiver) -> None:
    threads = exporter_threads()
    async with traced_pd("vllm") as pd:
        assert exporter_threads() == threads
        status, _ = await pd.http()
        assert status == 200
        plain_prefill = await pd.prefill_stub.recorder.next_request("/v1/completions")
        plain_decode = await pd.decode_stub.recorder.next_request("/v1/completions")
        status, _ = await pd.http(headers={"traceparent": CLIENT_TRACEPARENT})
        assert status == 200
        passed_prefill = await pd.prefill_stub.recorder.next_request("/v1/completions")
        passed_decode = await pd.decode_stub.recorder.next_request("/v1/completions")
    assert header(plain_prefill, "traceparent") is None
    assert header(plain_decode, "traceparent") is None
    # A client's own header travels as any other client header did before tracing existed.
    assert header(passed_prefill, "traceparent") == CLIENT_TRACEPARENT
    assert header(passed_decode, "traceparent") == CLIENT_TRACEPARENT
    assert receiver.export_requests == 0


async def test_grpc_router_context_joins_both_rpcs_and_engines(receiver: OtlpReceiver) -> None:
    metadata = (("traceparent", CLIENT_TRACEPARENT),)
    async with traced_pd("vllm", otlp_endpoint=receiver.endpoint) as pd:
        blocks = await pd.grpc_prefill(metadata)
        messages = await pd.grpc_decode(blocks, metadata)
        assert messages[-1].done
        prefill_seen = await pd.prefill_stub.recorder.next_request("/v1/completions")
        decode_seen = await pd.decode_stub.recorder.next_request("/v1/completions")
    spans = receiver.wait_for(lambda spans: len(requests_of(spans)) == 2)
    requests = {s.attributes["disagg.route"]: s for s in requests_of(spans)}
    prefill_rpc = requests["/disagg.PrefillWorker/Prefill"]
    decode_rpc = requests["/disagg.DecodeWorker/Decode"]
    for rpc in (prefill_rpc, decode_rpc):
        assert rpc.trace_id == CLIENT_TRACE
        assert rpc.parent_span_id == CLIENT_SPAN
        assert rpc.attributes["disagg.front_door"] == "grpc"
        assert rpc.attributes["disagg.outcome"] == "ok"
    children = {(s.name, s.parent_span_id): s for s in spans if s.name != REQUEST_SPAN}
    prefill_leg = children[(PREFILL_SPAN, prefill_rpc.span_id)]
    decode_leg = children[(DECODE_FIRST_BYTE_SPAN, decode_rpc.span_id)]
    relay = children[(RELAY_SPAN, decode_rpc.span_id)]
    assert relay.attributes["disagg.relay.tokens"] == len([m for m in messages if not m.done])
    assert traceparent_of(prefill_seen) == (CLIENT_TRACE, prefill_leg.span_id)
    assert traceparent_of(decode_seen) == (CLIENT_TRACE, decode_leg.span_id)


@contextlib.contextmanager
def tracing_calls() -> Iterator[collections.Counter[str]]:
    """Counts calls into ``sidecar/observability/tracing.py`` and the opentelemetry packages made on
    this
    thread (the sidecars, stubs and clients of these tests all run on the test's loop)."""
    calls: collections.Counter[str] = collections.Counter()
    tracing_file = sidecar.observability.tracing.__file__

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call":
            filename = frame.f_code.co_filename
            if filename == tracing_file or f"{os.sep}opentelemetry{os.sep}" in filename:
                calls[f"{frame.f_code.co_name} ({filename.rsplit(os.sep, 1)[-1]})"] += 1

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


async def test_off_is_free_per_request() -> None:
    """Off: a request, through either front door, makes not one call into the tracing code."""
    async with traced_pd("sglang") as pd:
        with tracing_calls() as calls:
            status, _ = await pd.http(body=client_body(stream=True))
            assert status == 200
            status, _ = await pd.http(headers={"traceparent": CLIENT_TRACEPARENT})
            assert status == 200
            blocks = await pd.grpc_prefill((("traceparent", CLIENT_TRACEPARENT),))
            messages = await pd.grpc_decode(blocks)
            assert messages[-1].done
    assert calls == {}
    # The counter sees calls when they happen (guards the assertion above).
    with tracing_calls() as calls:
        sidecar.observability.tracing.NOOP_TRACE.span(sidecar.observability.tracing.RELAY_SPAN)
    assert sum(calls.values()) == 1


async def test_grpc_off_adds_no_metadata_driven_header() -> None:
    async with traced_pd("vllm") as pd:
        blocks = await pd.grpc_prefill()
        await pd.grpc_decode(blocks, (("traceparent", CLIENT_TRACEPARENT),))
        prefill_seen = await pd.prefill_stub.recorder.next_request("/v1/completions")
        decode_seen = await pd.decode_stub.recorder.next_request("/v1/completions")
    assert header(prefill_seen, "traceparent") is None
    assert header(decode_seen, "traceparent") is None


@pytest.mark.parametrize("route", [Route.CHAT])
async def test_chat_prompt_text_never_reaches_an_attribute(
    receiver: OtlpReceiver, route: Route
) -> None:
    async with traced_pd("trtllm", otlp_endpoint=receiver.endpoint) as pd:
        status, _ = await pd.http(route, body=client_body(route, prompt=SECRET))
        assert status == 200
    spans = receiver.wait_for(lambda spans: len(requests_of(spans)) == 1)
    assert requests_of(spans)[0].attributes["disagg.route"] == route.value
    assert SECRET not in repr(spans)
