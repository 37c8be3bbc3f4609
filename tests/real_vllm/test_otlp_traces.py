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
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tracing.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_grpc_receiver

from real_vllm.client import block_prompt, completion_body
from real_vllm.harness import EngineEnv, EngineGroup, EngineSpec, example_config
from sidecar.tracing import DECODE_FIRST_BYTE_SPAN, PREFILL_SPAN, REQUEST_SPAN

VLLM_SPAN = "llm_request"
PREFILL_SERVICE = "vllm-prefill"
DECODE_SERVICE = "vllm-decode"
# Export every 100 ms instead of the SDK's 5 s, in the engines and in the sidecar.
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


@contextlib.contextmanager
def _sidecar(tmp: Path, decode_url: str, otlp_endpoint: str) -> Iterator[str]:
    """The sidecar as its own process; leaving the block stops it (which flushes its spans)."""
    ports_file = tmp / "ports.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", "--host", "127.0.0.1", "--port", "0",
         "--no-grpc", "--ports-file", str(ports_file), "--prefill-allowlist", "127.0.0.1:*",
         "--engine", "example-connector", "--engine-url", decode_url,
         "--otlp-endpoint", otlp_endpoint],
        stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
             **FAST_EXPORT},
    )
    assert process.stderr is not None
    try:
        # The sidecar logs "listening:" after writing the ports file; stderr ends if it dies.
        for line in process.stderr:
            if "listening:" in line:
                break
        else:
            raise AssertionError(f"sidecar exited with {process.wait()} before listening")
        threading.Thread(target=process.stderr.read, daemon=True).start()
        yield f"http://127.0.0.1:{json.loads(ports_file.read_text())['http']}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _service(span: ReceivedSpan) -> str:
    return str(span.resource.get("service.name", ""))


def test_both_engines_export_spans_in_the_sidecars_trace(
    traced_engines: tuple[str, str], receiver: OtlpReceiver, tmp_path: Path
) -> None:
    prefill_url, decode_url = traced_engines
    prefill_hostport = prefill_url.removeprefix("http://")
    body = completion_body(block_prompt("otlp-trace"), max_tokens=4)
    with _sidecar(tmp_path, decode_url, receiver.endpoint) as sidecar_url:
        request = urllib.request.Request(
            sidecar_url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "x-prefiller-host-port": prefill_hostport},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            assert json.loads(response.read())["choices"][0]["text"]

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
    sidecar = {s.name: s for s in trace if _service(s) == "disagg-sidecar"}
    engines = {_service(s): s for s in trace if s.name == VLLM_SPAN}
    assert root.parent_span_id == ""
    assert engines[PREFILL_SERVICE].parent_span_id == sidecar[PREFILL_SPAN].span_id
    assert engines[DECODE_SERVICE].parent_span_id == sidecar[DECODE_FIRST_BYTE_SPAN].span_id
