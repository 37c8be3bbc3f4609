"""Real vLLM engines continue the sidecar's trace: one trace from the sidecar into both engines.

Proves, with a prefill and a decode vLLM engine (ExampleConnector pair, CPU) started with
``--otlp-traces-endpoint`` pointing at an OTLP/gRPC receiver in this test process, and the
sidecar running as its own process (``disagg-sidecar serve --otlp-endpoint`` to the same
receiver) in front of the decode engine: after one PD completion, both engines export their
``llm_request`` span in the sidecar's request trace, each under the sidecar's leg span for that
engine (the prefill leg, the decode's first byte); the request span is the trace's root.

Does not prove: vLLM's span attributes, or other connectors (the trace context travels the
same way whatever the hand-off; tests/tracing proves that for every engine with stubs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from tracing.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_grpc_receiver

from real_vllm.client import block_prompt, completion_body
from real_vllm.harness import EngineEnv, EngineGroup, EngineSpec, example_config
from real_vllm.sidecar_process import sidecar_process, through
from sidecar.observability.tracing import DECODE_FIRST_BYTE_SPAN, PREFILL_SPAN, REQUEST_SPAN

VLLM_SPAN = "llm_request"
PREFILL_SERVICE = "vllm-prefill"
DECODE_SERVICE = "vllm-decode"
# The engines export every 100 ms instead of the SDK's 5 s (the sidecar flushes as it stops).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
SPANS_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_grpc_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def traced_engines(
    engine_env: EngineEnv, receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(prefill URL, decode URL) of two engines exporting their spans to ``receiver``."""
    storage = tmp_path_factory.mktemp("otlp-example-storage")
    tracing = ("--otlp-traces-endpoint", receiver.endpoint)

    def spec(name: str, service: str, cpu: int, prefix_caching: bool) -> EngineSpec:
        return EngineSpec(name, example_config(storage), cpu=cpu, prefix_caching=prefix_caching,
                          extra_args=tracing,
                          extra_env={"OTEL_SERVICE_NAME": service, **FAST_EXPORT})

    with EngineGroup(engine_env) as group:
        engines = group.start([
            spec("otlp-prefill", PREFILL_SERVICE, 0, True),
            spec("otlp-decode", DECODE_SERVICE, 1, False),
        ])
        yield engines["otlp-prefill"].url, engines["otlp-decode"].url


def _service(span: ReceivedSpan) -> str:
    return str(span.resource.get("service.name", ""))


def test_both_engines_export_spans_in_the_sidecars_trace(
    traced_engines: tuple[str, str], receiver: OtlpReceiver, tmp_path: Path
) -> None:
    prefill_url, decode_url = traced_engines
    prefill_hostport = prefill_url.removeprefix("http://")
    body = completion_body(block_prompt("otlp-trace"), max_tokens=4)
    # Leaving the block stops the sidecar, which flushes its spans on the way out.
    with contextlib.contextmanager(sidecar_process)(
        tmp_path, "--engine", "default", "--engine-url", decode_url,
        "--otlp-endpoint", receiver.endpoint,
    ) as sidecar:
        assert through(sidecar, "/v1/completions", body, prefill_hostport)

    def complete(spans: list[ReceivedSpan]) -> bool:
        roots = [s for s in spans if s.name == REQUEST_SPAN]
        if len(roots) != 1:
            return False
        in_trace = {_service(s) for s in spans
                    if s.trace_id == roots[0].trace_id and s.name == VLLM_SPAN}
        return {PREFILL_SERVICE, DECODE_SERVICE} <= in_trace

    spans = receiver.wait_for(complete, SPANS_DEADLINE_S)
    root = next(s for s in spans if s.name == REQUEST_SPAN)
    trace = [s for s in spans if s.trace_id == root.trace_id]
    legs = {s.name: s for s in trace if s.name.startswith("disagg.")}
    engines = {_service(s): s for s in trace if s.name == VLLM_SPAN}
    assert root.parent_span_id == ""
    assert engines[PREFILL_SERVICE].parent_span_id == legs[PREFILL_SPAN].span_id
    assert engines[DECODE_SERVICE].parent_span_id == legs[DECODE_FIRST_BYTE_SPAN].span_id
