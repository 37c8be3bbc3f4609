"""Property-based test of the HTTP front door over real sockets: arbitrary bodies, prefill
target headers, request ids and content types sent to a running sidecar before stub engines.

Proves: no input earns a 5xx (a crash, or an engine failure caused by what the sidecar
forwarded), every answer is OpenAI-shaped JSON or a stream, no request hangs (each is bounded
by a socket timeout), and the sidecar serves a valid request and has nothing in flight
afterwards. Does not explore header syntax below aiohttp's parser (it refuses malformed
lines before the sidecar sees them).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fuzz_builders import E2E_TIMEOUT_S, FUZZ_E2E, BackgroundSidecar, background_sidecar
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from sidecar.protocol.request import CONTROL_KEYS

JSON_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=16))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
KEYS = st.sampled_from(sorted(CONTROL_KEYS | {"prompt", "messages", "model", "temperature"}))
VALID_PROMPT = st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=30),
                                      "model": st.just("stub-model")})
OBJECTS = st.builds(lambda base, extra: {**base, **extra}, VALID_PROMPT,
                    st.dictionaries(KEYS, JSON, max_size=4))
BODIES = st.one_of(
    st.binary(max_size=200),
    OBJECTS.map(lambda body: json.dumps(body).encode()),
    JSON.map(lambda value: json.dumps(value).encode()),
)
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                      max_size=40)
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions"])


@pytest.fixture(scope="module")
def http_sidecar() -> Iterator[BackgroundSidecar]:
    with background_sidecar("vllm", grpc_enabled=False) as bg:
        yield bg


def _post(bg: BackgroundSidecar, path: str, body: bytes,
          headers: dict[str, str]) -> tuple[int, bytes, str]:
    connection = http.client.HTTPConnection("127.0.0.1", bg.http_port, timeout=E2E_TIMEOUT_S)
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(), response.getheader("Content-Type") or ""
    finally:
        connection.close()


@FUZZ_E2E
@given(PATHS, BODIES, st.one_of(st.none(), HEADER_TEXT), st.one_of(st.none(), HEADER_TEXT),
       st.booleans())
def test_any_request_is_answered_without_a_5xx(
    http_sidecar: BackgroundSidecar, path: str, body: bytes, target: str | None,
    request_id: str | None, use_real_target: bool,
) -> None:
    headers: dict[str, str] = {"Content-Type": "application/json"}
    if use_real_target:
        headers["x-prefiller-host-port"] = http_sidecar.prefill_target
    elif target is not None:
        headers["x-prefiller-host-port"] = target
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    status, payload, content_type = _post(http_sidecar, path, body, headers)
    assert status < 500, (status, payload[:300])
    if status != 200:
        error: Any = json.loads(payload)["error"]
        assert {"message", "type", "code"} <= set(error)  # passthrough adds engine keys
    else:
        assert content_type.startswith(("application/json", "text/event-stream")), content_type


def test_still_serves_and_nothing_in_flight(http_sidecar: BackgroundSidecar) -> None:
    body = json.dumps({"model": "stub-model", "prompt": "after the fuzz", "max_tokens": 3})
    status, payload, _ = _post(http_sidecar, "/v1/completions", body.encode(),
                               {"x-prefiller-host-port": http_sidecar.prefill_target})
    assert status == 200, payload
    connection = http.client.HTTPConnection("127.0.0.1", http_sidecar.http_port,
                                            timeout=E2E_TIMEOUT_S)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    inflight = [sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "disagg_inflight_requests"]
    assert inflight and all(value == 0 for value in inflight)
