"""Proves a migrated stream's trace: its request span holds a ``disagg.migration`` span (what
failed, the move's number, the token it continued from) and the continuation's opening (a
``disagg.decode_first_byte`` client span naming the engine it moved to), whose
``traceparent`` that engine received; a stream that could not move marks its migration span
with the error it ended with.

Does not prove a real engine continues the trace (tests/real_vllm/test_otlp_traces.py shows
the pair's legs do).
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from openai_builders import client_body
from otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_grpc_receiver
from trace_builders import traced_pd

from sidecar.observability.tracing import DECODE_FIRST_BYTE_SPAN, MIGRATION_SPAN, REQUEST_SPAN
from sidecar.protocol.context import Route
from sidecar.tools.stubs.faults import Fault, FaultKind

CUT = 3


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_grpc_receiver() as receiver:
        yield receiver


def spans_of(spans: list[ReceivedSpan], trace_id: str, name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id and s.name == name]


async def test_a_migrated_stream_traces_its_move(receiver: OtlpReceiver) -> None:
    async with traced_pd("vllm", otlp_endpoint=receiver.endpoint, migration_limit=1) as pd:
        pd.decode_stub.faults.set(Fault(kind=FaultKind.DROP, after_chunks=CUT, times=1))
        status, _ = await pd.http(body=client_body(Route.COMPLETIONS, stream=True,
                                                   max_tokens=8))
        assert status == 200
        continued = [r for r in pd.prefill_stub.recorder.on_path(Route.COMPLETIONS.value)
                     if isinstance(r.json.get("prompt"), list)]
        port = pd.prefill_stub.port
    spans = receiver.wait_for(lambda spans: any(s.name == MIGRATION_SPAN for s in spans))
    request = next(s for s in spans if s.name == REQUEST_SPAN
                   and s.attributes.get("disagg.front_door") == "http")
    assert request.attributes["disagg.outcome"] == "migrated"
    (migration,) = spans_of(spans, request.trace_id, MIGRATION_SPAN)
    assert migration.parent_span_id == request.span_id
    assert migration.attributes == {"disagg.migration.reason": "migrated",
                                    "disagg.migration.moves": 1,
                                    "disagg.migration.from_token": CUT}
    opened = [s for s in spans_of(spans, request.trace_id, DECODE_FIRST_BYTE_SPAN)
              if s.attributes.get("server.port") == port]
    assert len(opened) == 1 and len(continued) == 1
    traceparent = {k.lower(): v for k, v in continued[0].headers.items()}["traceparent"]
    assert traceparent.split("-")[1:3] == [request.trace_id, opened[0].span_id]


async def test_a_stream_that_could_not_move_marks_its_migration_span(
        receiver: OtlpReceiver) -> None:
    async with traced_pd("vllm", otlp_endpoint=receiver.endpoint, migration_limit=1) as pd:
        pd.decode_stub.faults.set(Fault(kind=FaultKind.DROP, after_chunks=CUT, times=1))
        with pytest.raises(aiohttp.ClientPayloadError):  # the error event, then cut
            await pd.http(body=client_body(Route.COMPLETIONS, stream=True, max_tokens=8,
                                           logprobs=1))
    spans = receiver.wait_for(lambda spans: any(s.name == MIGRATION_SPAN for s in spans))
    (migration,) = [s for s in spans if s.name == MIGRATION_SPAN]
    assert migration.attributes["disagg.migration.reason"] == "logprobs"
    assert migration.status_code == 2  # ERROR


async def test_a_json_request_moved_before_its_answer_traces_its_move(
        receiver: OtlpReceiver) -> None:
    async with traced_pd("vllm", otlp_endpoint=receiver.endpoint, migration_limit=1) as pd:
        pd.decode_stub.faults.set(Fault(kind=FaultKind.STATUS, status=500, times=1))
        status, _ = await pd.http(body=client_body(Route.COMPLETIONS, max_tokens=8))
        assert status == 200
        port = pd.prefill_stub.port
    spans = receiver.wait_for(lambda spans: any(s.name == MIGRATION_SPAN for s in spans))
    (migration,) = [s for s in spans if s.name == MIGRATION_SPAN]
    assert migration.attributes == {"disagg.migration.reason": "migrated",
                                    "disagg.migration.moves": 1,
                                    "disagg.migration.from_token": 0}
    opened = [s for s in spans if s.name == DECODE_FIRST_BYTE_SPAN
              and s.trace_id == migration.trace_id
              and s.attributes.get("server.port") == port]
    assert len(opened) == 1  # the request whole on the prefill target
