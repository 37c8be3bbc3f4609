"""Hostile input at each front door, over real sockets: bodies and messages nested deeper
than the sidecar can write back out, malformed message bytes, metadata built to overflow
the counts, and random damage to valid requests (hand-written cases and hypothesis).

Proves, after every input: the answer is typed (HTTP: a status below 500 and, for the
sidecar's own errors, OpenAI-shaped JSON with a code of the taxonomy; gRPC: a documented
status, never UNKNOWN, INTERNAL or a deadline, with the ``disagg-error-code`` trailer), the
sidecar is healthy (it serves a valid request), nothing is in flight (the in-flight gauge,
both stub engines) and nothing is staged (inline KV: the staged-bytes gauge and the staging
directory). Does not prove what engines make of bodies the sidecar passes through as they
are (passthrough answers are the engine's own).
"""

from __future__ import annotations

import http.client
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fuzz_builders import E2E_TIMEOUT_S, FUZZ_E2E, BackgroundSidecar, background_sidecar
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from sidecar.errors import SidecarError
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.errors import ERROR_CODE_KEY


def _kinds(kind: type[SidecarError]) -> Iterator[type[SidecarError]]:
    yield kind
    for sub in kind.__subclasses__():
        yield from _kinds(sub)


#: Every code of the taxonomy (``sidecar.errors``).
CODES = {kind.code for kind in _kinds(SidecarError)}
PD_PATHS = ("/v1/completions", "/v1/chat/completions")
VALID = {"model": "stub-model", "prompt": "hello", "max_tokens": 2}


# -- shared checks -------------------------------------------------------------------------

def _metrics(bg: BackgroundSidecar) -> dict[str, float]:
    connection = http.client.HTTPConnection("127.0.0.1", bg.http_port, timeout=E2E_TIMEOUT_S)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _settled(bg: BackgroundSidecar, staging: Path | None = None) -> None:
    """Nothing in flight in the sidecar or its engines, nothing staged (bounded wait: a
    request is counted out just after its last byte left)."""
    deadline = time.monotonic() + E2E_TIMEOUT_S
    while True:
        metrics = _metrics(bg)
        busy = [stub for stub in bg.stubs if stub.recorder.in_flight]
        staged = [] if staging is None else [p for p in staging.iterdir()
                                              if not p.name.startswith(".") and p.is_dir()]
        if (metrics.get("disagg_inflight_requests", 0) == 0 and not busy and not staged
                and metrics.get("disagg_staged_kv_bytes", 0) == 0):
            return
        assert time.monotonic() < deadline, (metrics, busy, staged)
        time.sleep(0.01)  # state only shows in the scrape and the stubs' counters


def _post(bg: BackgroundSidecar, path: str, body: bytes,
          headers: dict[str, str]) -> tuple[int, bytes, str]:
    connection = http.client.HTTPConnection("127.0.0.1", bg.http_port, timeout=E2E_TIMEOUT_S)
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(), response.getheader("Content-Type") or ""
    finally:
        connection.close()


# -- the HTTP door -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http_sidecar() -> Iterator[BackgroundSidecar]:
    with background_sidecar("vllm", grpc_enabled=False) as bg:
        yield bg


def _nested(depth: int, opener: bytes = b"[") -> bytes:
    """A completions body ``depth`` levels deep: its ``extra`` nests arrays or objects."""
    inner = (b'{"k": ' * (depth - 1) + b"1" + b"}" * (depth - 1) if opener == b"{"
             else b"[" * (depth - 1) + b"]" * (depth - 1))
    return (b'{"model": "stub-model", "prompt": "hi", "max_tokens": 2, "extra": ' + inner
            + b"}")


def _check_http(bg: BackgroundSidecar, path: str, body: bytes, with_target: bool) -> None:
    headers = {"Content-Type": "application/json"}
    if with_target:
        headers["x-prefiller-host-port"] = bg.prefill_target
    status, payload, content_type = _post(bg, path, body, headers)
    assert status < 500, (status, payload[:300])
    if status != 200 and with_target:
        error: Any = json.loads(payload)["error"]
        assert error["code"] in CODES and error["message"], error
    if status == 200:
        assert content_type.startswith(("application/json", "text/event-stream"))
    _settled(bg)
    healthy = json.dumps(VALID).encode()
    ok, answer, _ = _post(bg, "/v1/completions", healthy,
                          {"x-prefiller-host-port": bg.prefill_target})
    assert ok == 200, answer[:300]


HAND_WRITTEN_BODIES = [
    *(_nested(depth) for depth in (253, 254, 255, 300, 1000, 1023, 1024, 1025, 5000)),
    *(_nested(depth, b"{") for depth in (255, 1000)),
    b"", b"{", b"[]", b"null", b'"x"', b"\xef\xbb\xbf{}", b'{"prompt": "\xff\xfe"}',
    b'{"prompt": "hi", "max_tokens": 1e400}', b'{"prompt": "hi", "n": 18446744073709551616}',
    b'{"prompt": NaN}', b'{"prompt": "a", "prompt": "b", "max_tokens": 1, "max_tokens": 2}',
    b'{"messages": ' + b"[" * 600 + b"]" * 600 + b"}",
]


@pytest.mark.parametrize("with_target", [True, False], ids=["pd", "passthrough"])
@pytest.mark.parametrize("path", PD_PATHS)
def test_hand_written_hostile_bodies(http_sidecar: BackgroundSidecar, path: str,
                                     with_target: bool) -> None:
    for body in HAND_WRITTEN_BODIES:
        _check_http(http_sidecar, path, body, with_target)


DEEP = st.builds(lambda depth, opener: _nested(depth, opener),
                 st.integers(min_value=240, max_value=1100), st.sampled_from([b"[", b"{"]))
DAMAGED = st.builds(
    lambda body, cut, noise: body[:cut] + noise + body[cut:],
    st.just(json.dumps(VALID).encode()), st.integers(min_value=0, max_value=60),
    st.binary(max_size=8),
)


@FUZZ_E2E
@given(st.sampled_from(PD_PATHS), st.one_of(DEEP, DAMAGED, st.binary(max_size=64)),
       st.booleans())
def test_any_hostile_body_is_answered_typed_and_leaves_the_sidecar_healthy(
    http_sidecar: BackgroundSidecar, path: str, body: bytes, with_target: bool,
) -> None:
    _check_http(http_sidecar, path, body, with_target)


# -- the gRPC door -------------------------------------------------------------------------

#: What an input may earn: never UNKNOWN or INTERNAL (a crash) or DEADLINE_EXCEEDED (a hang).
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.UNAVAILABLE}
PREFILL = "/disagg.PrefillWorker/Prefill"
DECODE = "/disagg.DecodeWorker/Decode"


@pytest.fixture(scope="module")
def native_sidecar() -> Iterator[BackgroundSidecar]:
    with background_sidecar("vllm") as bg:
        yield bg


@pytest.fixture(scope="module")
def inline_sidecar() -> Iterator[tuple[BackgroundSidecar, Path]]:
    with tempfile.TemporaryDirectory(prefix="fuzz-inline-") as staging, \
            background_sidecar("vllm", kv_transport="inline", kv_staging_dir=staging) as bg:
        yield bg, Path(staging)


def _raw(bg: BackgroundSidecar, method: str, payload: bytes) -> grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{bg.grpc_port}",
                               options=[("grpc.enable_http_proxy", 0)]) as channel:
        call = channel.unary_stream(method)(payload, timeout=E2E_TIMEOUT_S)
        try:
            for _ in call:
                pass
        except grpc.RpcError as error:
            code: grpc.StatusCode = error.code()
            assert code in DOCUMENTED, (code, error.details())
            trailers = dict(error.trailing_metadata() or ())
            assert trailers.get(ERROR_CODE_KEY) in CODES, trailers
            return code
    return grpc.StatusCode.OK


def _check_grpc(bg: BackgroundSidecar, method: str, payload: bytes,
                staging: Path | None = None) -> None:
    _raw(bg, method, payload)
    _settled(bg, staging)
    if staging is None:  # a native sidecar serves a valid Prefill after it
        valid = disagg_pb2.PreFillRequest(request_id="after", token_ids=[72, 105],
                                          max_new_tokens=2)
        assert _raw(bg, PREFILL, valid.SerializeToString()) is grpc.StatusCode.OK


def _deep_handoff_decode(depth: int) -> bytes:
    document = (b'{"version": 1, "kind": "handoff", "engine": "vllm", "kv_connector": "shfs", '
                b'"fields": {"deep": ' + b"[" * depth + b"]" * depth + b'}, "prefill": '
                b'{"host": "127.0.0.1", "port": 8000}, "request_id": "r"}')
    block = disagg_pb2.KVBlock(request_id="r", layer_idx=-1, block_idx=0, k_data=document)
    return disagg_pb2.DecodeRequest(request_id="r", kv_blocks=[block], token_ids=[1, 2],
                                    max_new_tokens=2).SerializeToString()


def _inline_meta_decode(meta: bytes) -> bytes:
    block = disagg_pb2.KVBlock(request_id="r", layer_idx=-2, block_idx=0, k_data=meta)
    data = disagg_pb2.KVBlock(request_id="r", layer_idx=0, block_idx=0, k_data=b"k",
                              v_data=b"v")
    return disagg_pb2.DecodeRequest(request_id="r", kv_blocks=[block, data], token_ids=[1, 2],
                                    max_new_tokens=2).SerializeToString()


_META = {"version": 1, "kind": "inline_kv", "key": "k-1", "dtype": "float16", "block_size": 1,
         "num_kv_heads": 1, "head_size": 1, "num_layers": 1, "fingerprint": "f",
         "layout": "HNC"}
MALFORMED_BYTES = [b"\xff\xff\xff\xff", b"\x0a\xff\x01abc", b"\x12\x05ab", b"\x08" * 20]
HOSTILE_META = [
    b"[" * 5000 + b"]" * 5000,
    json.dumps({**_META, "num_tokens": 2**64, "num_blocks": 2**64,
                "pages_per_block": 2**64}).encode(),
    json.dumps({**_META, "num_tokens": 2**64, "num_blocks": 2**64}).encode(),
    json.dumps({**_META, "num_tokens": 1, "num_blocks": 1, "num_layers": 2**64}).encode(),
]


def test_hand_written_hostile_messages_native(native_sidecar: BackgroundSidecar) -> None:
    for payload in MALFORMED_BYTES:
        _check_grpc(native_sidecar, PREFILL, payload)
        _check_grpc(native_sidecar, DECODE, payload)
    for depth in (254, 300, 1000, 1100, 5000):
        _check_grpc(native_sidecar, DECODE, _deep_handoff_decode(depth))
    for meta in HOSTILE_META:  # a native Decode skips inline blocks: still typed
        _check_grpc(native_sidecar, DECODE, _inline_meta_decode(meta))


def test_hand_written_hostile_messages_inline(
    inline_sidecar: tuple[BackgroundSidecar, Path],
) -> None:
    bg, staging = inline_sidecar
    for payload in MALFORMED_BYTES:
        _check_grpc(bg, PREFILL, payload, staging)
        _check_grpc(bg, DECODE, payload, staging)
    for meta in HOSTILE_META:
        _check_grpc(bg, DECODE, _inline_meta_decode(meta), staging)


VALID_MESSAGES = st.sampled_from([
    (PREFILL, disagg_pb2.PreFillRequest(request_id="f", token_ids=[1, 2, 3],
                                        max_new_tokens=4).SerializeToString()),
    (DECODE, _deep_handoff_decode(2)),
    (DECODE, _inline_meta_decode(json.dumps({**_META, "num_tokens": 1,
                                             "num_blocks": 1}).encode())),
])


@st.composite
def damaged_messages(draw: st.DrawFn) -> tuple[str, bytes]:
    method, payload = draw(VALID_MESSAGES)
    if draw(st.booleans()):
        return method, draw(st.binary(max_size=64))
    cut = draw(st.integers(min_value=0, max_value=len(payload)))
    return method, payload[:cut] + draw(st.binary(max_size=6)) + payload[cut + 1:]


@FUZZ_E2E
@given(damaged_messages())
def test_any_damaged_message_is_typed_native(native_sidecar: BackgroundSidecar,
                                             message: tuple[str, bytes]) -> None:
    _check_grpc(native_sidecar, *message)


@FUZZ_E2E
@given(damaged_messages())
def test_any_damaged_message_is_typed_inline(
    inline_sidecar: tuple[BackgroundSidecar, Path], message: tuple[str, bytes],
) -> None:
    bg, staging = inline_sidecar
    _check_grpc(bg, *message, staging)
