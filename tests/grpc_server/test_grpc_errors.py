"""Proves every error case of the gRPC front door comes back as its status, over real sockets:

- INVALID_ARGUMENT: empty or negative token_ids, max_new_tokens out of range, a missing,
  malformed or truncated hand-off, an engine's 4xx; nothing reaches the engine for request
  errors;
- FAILED_PRECONDITION: a hand-off from another engine family or connector, a prefill sidecar
  with no address to advertise;
- UNAVAILABLE: an unreachable engine, an engine 5xx, a prefill without hand-off, a decode
  stream that breaks after some tokens, draining;
- RESOURCE_EXHAUSTED: more calls than ``max_inflight``;
- DEADLINE_EXCEEDED: the caller's deadline and the prefill leg's own deadline; either way the
  engine request ends;
- a client that cancels mid-stream: the decode engine's request ends (the stub's in-flight
  counter drops to zero and counts a cancellation), counted as ``cancelled``;
- a concurrent flow's (SGLang, Mooncake) engine prefill that fails after the hand-off was
  streamed: counted in ``disagg_errors_total``, its room and admission slot released.

Does not prove what real engines answer to these bodies.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import grpc
import pytest
from grpc_builders import (
    CHANNEL_OPTIONS,
    PROMPT_IDS,
    closed_port,
    decode_tokens,
    grpc_pd,
    grpc_sidecar,
    prefill_blocks,
    rooms_in_flight,
)

from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.errors import ERROR_CODE_KEY
from sidecar.grpc_server.native import encode_handoff
from sidecar.tools.stubs.faults import Fault, FaultKind

COMPLETIONS = "/v1/completions"

NIXL_FIELDS = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "e-1",
        "remote_request_id": "r-1",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "tp_size": 1,
    }
}


def _blocks(engine: str = "vllm", connector: str | None = "shfs",
            fields: dict[str, Any] | None = None) -> list[disagg_pb2.KVBlock]:
    return encode_handoff(
        NIXL_FIELDS if fields is None else fields, request_id="req-e", engine=engine,
        kv_connector=connector, prefill_host="127.0.0.1", prefill_port=8000,
    )


def _decode_request(blocks: list[disagg_pb2.KVBlock] | None = None, **overrides: Any
                    ) -> disagg_pb2.DecodeRequest:
    fields: dict[str, Any] = {
        "request_id": "req-e",
        "kv_blocks": _blocks() if blocks is None else blocks,
        "token_ids": PROMPT_IDS,
        "max_new_tokens": 4,
    }
    fields.update(overrides)
    return disagg_pb2.DecodeRequest(**fields)


async def _status(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


@pytest.mark.parametrize(
    ("token_ids", "max_new_tokens"),
    [([], 4), ([1, -2], 4), (PROMPT_IDS, 0), (PROMPT_IDS, -1), (PROMPT_IDS, 2**20 + 1)],
    ids=["empty", "negative-id", "zero-tokens", "negative-tokens", "too-many-tokens"],
)
async def test_bad_decode_requests_are_invalid_argument(
    token_ids: list[int], max_new_tokens: int
) -> None:
    async with grpc_pd("vllm") as pd:
        error = await _status(decode_tokens(
            pd.decode.address,
            _decode_request(token_ids=token_ids, max_new_tokens=max_new_tokens),
        ))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert dict(error.trailing_metadata() or ())[ERROR_CODE_KEY] == "invalid_request"
        assert pd.decode_stub.recorder.on_path(COMPLETIONS) == []


@pytest.mark.parametrize(
    ("token_ids", "max_new_tokens"),
    [([], 4), ([3, -1], 4), (PROMPT_IDS, -1), (PROMPT_IDS, 2**20 + 1)],
    ids=["empty", "negative-id", "negative-tokens", "too-many-tokens"],
)
async def test_bad_prefill_requests_are_invalid_argument(
    token_ids: list[int], max_new_tokens: int
) -> None:
    async with grpc_pd("vllm") as pd:
        error = await _status(prefill_blocks(pd.prefill.address, token_ids,
                                             max_new_tokens=max_new_tokens))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert pd.prefill_stub.recorder.on_path(COMPLETIONS) == []


async def test_prefill_takes_zero_max_new_tokens_as_unset() -> None:
    async with grpc_pd("vllm") as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS, max_new_tokens=0)
        assert blocks


def _truncated() -> list[disagg_pb2.KVBlock]:
    blocks = encode_handoff(NIXL_FIELDS, request_id="req-e", engine="vllm", kv_connector="shfs",
                            prefill_host="127.0.0.1", prefill_port=8000, max_chunk_bytes=40)
    return blocks[:-1]


@pytest.mark.parametrize(
    "blocks",
    [
        [],
        [disagg_pb2.KVBlock(request_id="req-e", layer_idx=0, k_data=b"\0\0", v_data=b"\0\0")],
        [disagg_pb2.KVBlock(request_id="req-e", layer_idx=-1, k_data=b"{not json")],
        [disagg_pb2.KVBlock(request_id="req-e", layer_idx=-7, k_data=b"{}")],
        _truncated(),
    ],
    ids=["no-blocks", "data-blocks-only", "malformed", "unknown-control", "truncated"],
)
async def test_missing_or_malformed_handoff_is_invalid_argument(
    blocks: list[disagg_pb2.KVBlock],
) -> None:
    async with grpc_pd("vllm") as pd:
        error = await _status(decode_tokens(pd.decode.address, _decode_request(blocks)))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "hand-off" in (error.details() or "")
        assert pd.decode_stub.recorder.on_path(COMPLETIONS) == []


@pytest.mark.parametrize(
    ("engine", "connector"), [("sglang", None), ("vllm", "mooncake")], ids=["engine", "connector"]
)
async def test_handoff_of_another_engine_or_connector_is_failed_precondition(
    engine: str, connector: str | None
) -> None:
    async with grpc_pd("vllm", "shfs") as pd:
        error = await _status(decode_tokens(
            pd.decode.address, _decode_request(_blocks(engine, connector))
        ))
        assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert pd.decode_stub.recorder.on_path(COMPLETIONS) == []


async def test_prefill_without_advertise_host_on_loopback_is_failed_precondition() -> None:
    async with grpc_pd("vllm", prefill_sidecar={"advertise_host": None}) as pd:
        error = await _status(prefill_blocks(pd.prefill.address, PROMPT_IDS))
        assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "advertise" in (error.details() or "")
        assert pd.prefill_stub.recorder.on_path(COMPLETIONS) == []


async def test_unreachable_engine_is_unavailable() -> None:
    async with grpc_sidecar(f"http://127.0.0.1:{closed_port()}") as sidecar:
        prefill_error = await _status(prefill_blocks(sidecar.address, PROMPT_IDS))
        decode_error = await _status(decode_tokens(sidecar.address, _decode_request()))
    assert prefill_error.code() is grpc.StatusCode.UNAVAILABLE
    assert decode_error.code() is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("fault", "status"),
    [
        (Fault(FaultKind.STATUS, status=500), grpc.StatusCode.UNAVAILABLE),
        (Fault(FaultKind.STATUS, status=400), grpc.StatusCode.INVALID_ARGUMENT),
        (Fault(FaultKind.NO_HANDOFF), grpc.StatusCode.UNAVAILABLE),
        (Fault(FaultKind.MALFORMED), grpc.StatusCode.UNAVAILABLE),
    ],
    ids=["5xx", "4xx", "no-handoff", "malformed"],
)
async def test_prefill_engine_failures_map_to_statuses(
    fault: Fault, status: grpc.StatusCode
) -> None:
    async with grpc_pd("vllm", prefill_stub={"faults": (fault,)}) as pd:
        error = await _status(prefill_blocks(pd.prefill.address, PROMPT_IDS))
        assert error.code() is status
        assert pd.prefill.metric("disagg_errors_total", front_door="grpc") == 1


async def _raw_call(address: str, method: str, payload: bytes) -> grpc.aio.AioRpcError:
    """``payload`` sent as the request message's bytes, as a broken client would."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_stream(method, request_serializer=None,
                                    response_deserializer=None)(payload, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    return caught.value


#: Not a protobuf message: a field header with wire type 7 (none such), then a length that
#: runs past the end.
MALFORMED = [b"\xff\xff\xff\xff", b"\x0a\xff\x01abc", b"\x12\x05ab"]


@pytest.mark.parametrize("transport", ["native", "inline"])
@pytest.mark.parametrize("method", ["/disagg.PrefillWorker/Prefill",
                                    "/disagg.DecodeWorker/Decode"])
async def test_malformed_message_bytes_are_invalid_argument(
    transport: str, method: str, tmp_path: Any
) -> None:
    async with grpc_sidecar(f"http://127.0.0.1:{closed_port()}", kv_transport=transport,
                            kv_staging_dir=str(tmp_path)) as sidecar:
        for payload in MALFORMED:
            error = await _raw_call(sidecar.address, method, payload)
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (payload, error)
            assert dict(error.trailing_metadata() or ())[ERROR_CODE_KEY] == "invalid_request"
        assert sidecar.metric("disagg_errors_total", code="invalid_request") == len(MALFORMED)
        assert sidecar.metric("disagg_inflight_requests") == 0


def _deep_handoff(depth: int) -> list[disagg_pb2.KVBlock]:
    """A hand-off document as the prefill side writes it, its fields nested ``depth`` deep
    (orjson writes 254 levels, so it is spelled out here)."""
    nested = b"[" * depth + b"]" * depth
    document = (b'{"version": 1, "kind": "handoff", "engine": "vllm", "kv_connector": "shfs", '
                b'"fields": {"deep": ' + nested + b'}, "prefill": {"host": "127.0.0.1", '
                b'"port": 8000}, "request_id": "req-e"}')
    return [disagg_pb2.KVBlock(request_id="req-e", layer_idx=-1, block_idx=0,
                               k_data=document)]


@pytest.mark.parametrize("depth", [254, 300, 1000, 5000])
async def test_a_deeply_nested_native_handoff_is_invalid_argument(depth: int) -> None:
    # 254 levels inside "fields": the decode body would nest 255 deep, one more than orjson
    # writes (253 still runs); past 1,024 orjson does not even parse it.
    async with grpc_pd("vllm") as pd:
        error = await _status(decode_tokens(pd.decode.address,
                                            _decode_request(_deep_handoff(depth))))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
        assert "hand-off" in (error.details() or "")
        assert _inference_requests(pd.decode_stub) == 0


def _inference_requests(stub: Any) -> int:
    return len(stub.recorder.on_path(COMPLETIONS))


async def test_an_engines_4xx_reason_is_in_the_status_details() -> None:
    reason = "This model's maximum context length is 4096 tokens"
    prefill_fault = Fault(FaultKind.STATUS, status=400, message=reason, path=COMPLETIONS)
    async with grpc_pd("vllm", prefill_stub={"faults": (prefill_fault,)}) as pd:
        error = await _status(prefill_blocks(pd.prefill.address, PROMPT_IDS))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"prefill engine rejected the request (HTTP 400): {reason}" in (error.details() or "")
    decode_fault = Fault(FaultKind.STATUS, status=422, message=reason, path=COMPLETIONS)
    async with grpc_pd("vllm", decode_stub={"faults": (decode_fault,)}) as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS)
        error = await _status(decode_tokens(pd.decode.address, _decode_request(blocks)))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"decode engine rejected the request (HTTP 422): {reason}" in (error.details() or "")


async def test_decode_engine_5xx_is_unavailable() -> None:
    fault = Fault(FaultKind.STATUS, status=503, path=COMPLETIONS)
    async with grpc_pd("vllm", decode_stub={"faults": (fault,)}) as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS)
        error = await _status(decode_tokens(pd.decode.address, _decode_request(blocks)))
        assert error.code() is grpc.StatusCode.UNAVAILABLE


async def test_stream_broken_after_tokens_ends_with_unavailable() -> None:
    fault = Fault(FaultKind.DROP, path=COMPLETIONS, after_chunks=2)
    async with grpc_pd("vllm", decode_stub={"faults": (fault,)}) as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS)
        received: list[disagg_pb2.TokenStream] = []
        async with grpc.aio.insecure_channel(pd.decode.address, options=CHANNEL_OPTIONS) as ch:
            call = disagg_pb2_grpc.DecodeWorkerStub(ch).Decode(_decode_request(blocks))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for message in call:
                    received.append(message)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        assert len(received) == 2 and not any(message.done for message in received)


async def test_caller_deadline_is_deadline_exceeded_and_ends_the_engine_request() -> None:
    fault = Fault(FaultKind.HANG, path=COMPLETIONS)
    async with grpc_pd("vllm", decode_stub={"faults": (fault,)}) as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS)
        error = await _status(decode_tokens(pd.decode.address, _decode_request(blocks),
                                            deadline_s=0.5))
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await pd.decode_stub.wait_idle()
        assert pd.decode_stub.recorder.cancelled >= 1


async def test_prefill_leg_deadline_is_deadline_exceeded() -> None:
    fault = Fault(FaultKind.HANG, path=COMPLETIONS)
    async with grpc_pd("vllm", prefill_stub={"faults": (fault,)},
                       prefill_sidecar={"prefill_timeout_s": 0.3}) as pd:
        error = await _status(prefill_blocks(pd.prefill.address, PROMPT_IDS))
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await pd.prefill_stub.wait_idle()


async def test_client_cancel_ends_the_decode_engine_request() -> None:
    fault = Fault(FaultKind.STALL, path=COMPLETIONS, after_chunks=2)
    async with grpc_pd("vllm", decode_stub={"faults": (fault,)}) as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS)
        async with grpc.aio.insecure_channel(pd.decode.address, options=CHANNEL_OPTIONS) as ch:
            call = disagg_pb2_grpc.DecodeWorkerStub(ch).Decode(_decode_request(blocks))
            first = await call.read()
            second = await call.read()
            assert isinstance(first, disagg_pb2.TokenStream)
            assert isinstance(second, disagg_pb2.TokenStream)
            assert pd.decode_stub.recorder.in_flight >= 1
            call.cancel()
        await pd.decode_stub.wait_idle()
        assert pd.decode_stub.recorder.cancelled == 1
        assert await pd.decode.runtime.admission.wait_idle(10.0)
        assert pd.decode.metric("disagg_requests_total", front_door="grpc",
                                outcome="cancelled") == 1


async def test_over_max_inflight_is_resource_exhausted_and_draining_unavailable() -> None:
    fault = Fault(FaultKind.HANG, path=COMPLETIONS)
    async with grpc_pd("vllm", decode_stub={"faults": (fault,)},
                       decode_sidecar={"max_inflight": 1}) as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS)
        async with grpc.aio.insecure_channel(pd.decode.address, options=CHANNEL_OPTIONS) as ch:
            hanging = disagg_pb2_grpc.DecodeWorkerStub(ch).Decode(_decode_request(blocks))
            await pd.decode_stub.recorder.wait_count(1)
            await pd.decode_stub.recorder.next_request(COMPLETIONS)
            error = await _status(decode_tokens(pd.decode.address, _decode_request(blocks)))
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            hanging.cancel()
        assert await pd.decode.runtime.admission.wait_idle(10.0)
        pd.decode.runtime.admission.start_draining()
        error = await _status(decode_tokens(pd.decode.address, _decode_request(blocks)))
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert pd.decode.metric("disagg_requests_total", front_door="grpc",
                                outcome="refused") == 2


@pytest.mark.parametrize(("engine", "connector"), [("sglang", "shfs"), ("vllm", "mooncake")],
                         ids=["sglang", "vllm-mooncake"])
async def test_failed_background_prefill_is_counted_and_releases_its_room(
    engine: str, connector: str
) -> None:
    # Concurrent flows answer with the hand-off at once; the engine's failure comes later.
    fault = Fault(FaultKind.STATUS, status=500, path=COMPLETIONS)
    async with grpc_pd(engine, connector, prefill_stub={"faults": (fault,)}) as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS)
        assert blocks
        runtime = pd.prefill.runtime
        assert await runtime.admission.wait_idle(10.0)
        assert rooms_in_flight(runtime) == 0
        assert pd.prefill.metric("disagg_errors_total", front_door="grpc", stage="prefill",
                                 code="prefill_failed") == 1
        assert pd.prefill.metric("disagg_requests_total", front_door="grpc", outcome="ok") == 1
