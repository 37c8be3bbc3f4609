"""A client and a server that do not use our generated code interoperate with ours.

The independent side's message classes come from ``seed_contract`` (built by hand from the
origin's struct tags (docs/driving/grpc-contract.md#messages) in a private descriptor pool) and it
calls / serves
the methods by their
full names with grpc's generic API: no ``sidecar.grpc_gen`` import, no protoc output.

    independent client ──/disagg.PrefillWorker/Prefill──▶ server on our generated servicers
                       ──/disagg.DecodeWorker/Decode───▶   (hand-off blocks forwarded opaquely)
    our generated stubs ─────────────────────────────────▶ independent generic server

Real sockets on 127.0.0.1, ports chosen by the OS, HTTP proxies disabled. Proves that every
field crosses in both directions, that control blocks survive a router that forwards blocks
it does not understand (TensorRT-LLM ids above 2**53 exact), and that a bad hand-off comes
back as INVALID_ARGUMENT. Does not test the sidecar's real gRPC front door (its own tests do).
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from sidecar import jsonutil
from sidecar.errors import InvalidRequest
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.errors import grpc_status
from sidecar.grpc_server.native import decode_handoff, encode_handoff, is_control_block

from .seed_contract import independent_classes

PREFILL = "/disagg.PrefillWorker/Prefill"
DECODE = "/disagg.DecodeWorker/Decode"
#: Never route test traffic through a proxy named in the environment.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]

TRT_ID = 397181498744115205  # > 2**53: a float would round it
HANDOFF_FIELDS = {
    "disaggregated_params": {
        "request_type": "generation_only",
        "ctx_request_id": TRT_ID,
        "disagg_request_id": (1 << 63) - 1,
        "encoded_opaque_state": "AAEC",
        "first_gen_tokens": [42],
    },
    "prompt": [1, 2, 3],
}

Seed = independent_classes()


def _f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


class OurPrefill(disagg_pb2_grpc.PrefillWorkerServicer):
    """Streams a chunked hand-off, then one data block per prompt token echoing the request."""

    async def Prefill(
        self,
        request: disagg_pb2.PreFillRequest,
        context: grpc.aio.ServicerContext[disagg_pb2.PreFillRequest, disagg_pb2.KVBlockStream],
    ) -> AsyncIterator[disagg_pb2.KVBlockStream]:
        for block in encode_handoff(
            HANDOFF_FIELDS,
            request_id=request.request_id,
            engine="trtllm",
            kv_connector=None,
            prefill_host="10.0.0.7",
            prefill_port=8000,
            max_chunk_bytes=32,
        ):
            yield disagg_pb2.KVBlockStream(block=block)
        for layer, token in enumerate(request.token_ids):
            yield disagg_pb2.KVBlockStream(
                block=disagg_pb2.KVBlock(
                    request_id=request.request_id,
                    layer_idx=layer,
                    block_idx=token,
                    k_data=struct.pack("<f", request.temperature),
                    v_data=struct.pack("<i", request.max_new_tokens),
                )
            )
        yield disagg_pb2.KVBlockStream(done=True)


class OurDecode(disagg_pb2_grpc.DecodeWorkerServicer):
    """Reads the hand-off; echoes the tokens, then reports what it read in ``finish_reason``."""

    async def Decode(
        self,
        request: disagg_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[disagg_pb2.DecodeRequest, disagg_pb2.TokenStream],
    ) -> AsyncIterator[disagg_pb2.TokenStream]:
        try:
            handoff = decode_handoff(request.kv_blocks)
        except InvalidRequest as exc:
            await context.abort(grpc_status(exc), exc.message)
        for token in request.token_ids:
            yield disagg_pb2.TokenStream(request_id=request.request_id, token_id=token)
        report = {
            "handoff_request_id": handoff.request_id,
            "engine": handoff.engine,
            "fields": handoff.fields,
            "data_blocks": [
                [b.layer_idx, b.block_idx] for b in request.kv_blocks if not is_control_block(b)
            ],
            "max_new_tokens": request.max_new_tokens,
            "temperature": request.temperature,
        }
        yield disagg_pb2.TokenStream(
            request_id=request.request_id,
            token_id=2,
            done=True,
            finish_reason=jsonutil.dumps(report).decode(),
        )


@pytest.fixture
async def our_server() -> AsyncIterator[str]:
    server = grpc.aio.server()
    disagg_pb2_grpc.add_PrefillWorkerServicer_to_server(OurPrefill(), server)
    disagg_pb2_grpc.add_DecodeWorkerServicer_to_server(OurDecode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def _independent_call(channel: grpc.aio.Channel, method: str, request: Any) -> list[Any]:
    response_class = Seed["KVBlockStream"] if method == PREFILL else Seed["TokenStream"]
    call = channel.unary_stream(
        method,
        request_serializer=type(request).SerializeToString,
        response_deserializer=response_class.FromString,
    )
    return [message async for message in call(request)]


async def test_independent_client_prefill_then_decode_through_our_servers(
    our_server: str,
) -> None:
    async with grpc.aio.insecure_channel(our_server, options=CHANNEL_OPTIONS) as channel:
        prefill = Seed["PreFillRequest"](
            request_id="req-1", token_ids=[7, 300, 2**31 - 1], max_new_tokens=-5, temperature=0.7
        )
        stream = await _independent_call(channel, PREFILL, prefill)

        # The router's job: collect blocks until done, forwarding them without reading them.
        assert stream[-1].done and not stream[-1].HasField("block")
        blocks = [message.block for message in stream if message.HasField("block")]
        assert all(not message.done for message in stream[:-1])
        control = [b for b in blocks if b.layer_idx < 0]
        assert len(control) > 1  # chunked at 32 bytes
        assert [b.block_idx for b in control] == list(range(len(control)))
        data = [b for b in blocks if b.layer_idx >= 0]
        assert [(b.request_id, b.layer_idx, b.block_idx) for b in data] == [
            ("req-1", 0, 7),
            ("req-1", 1, 300),
            ("req-1", 2, 2**31 - 1),
        ]
        assert {struct.unpack("<f", b.k_data)[0] for b in data} == {_f32(0.7)}
        assert {struct.unpack("<i", b.v_data)[0] for b in data} == {-5}

        decode = Seed["DecodeRequest"](
            request_id="dec-1",
            kv_blocks=blocks,
            token_ids=[11, 12],
            max_new_tokens=64,
            temperature=1.5,
        )
        tokens = await _independent_call(channel, DECODE, decode)

    assert [(t.request_id, t.token_id, t.done) for t in tokens] == [
        ("dec-1", 11, False),
        ("dec-1", 12, False),
        ("dec-1", 2, True),
    ]
    report = jsonutil.loads(tokens[-1].finish_reason)
    assert report == {
        "handoff_request_id": "req-1",
        "engine": "trtllm",
        "fields": HANDOFF_FIELDS,
        "data_blocks": [[0, 7], [1, 300], [2, 2**31 - 1]],
        "max_new_tokens": 64,
        "temperature": 1.5,
    }
    assert report["fields"]["disaggregated_params"]["ctx_request_id"] == TRT_ID


async def test_bad_handoff_is_invalid_argument(our_server: str) -> None:
    async with grpc.aio.insecure_channel(our_server, options=CHANNEL_OPTIONS) as channel:
        decode = Seed["DecodeRequest"](
            request_id="dec-2",
            kv_blocks=[Seed["KVBlock"](request_id="x", layer_idx=0, k_data=b"k", v_data=b"v")],
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _independent_call(channel, DECODE, decode)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no hand-off control block" in (caught.value.details() or "")


# --- the other direction: our generated stubs against an independent server -----------------


async def _seed_prefill(request: Any, context: Any) -> AsyncIterator[Any]:
    for index, token in enumerate(request.token_ids):
        yield Seed["KVBlockStream"](
            block=Seed["KVBlock"](
                request_id=request.request_id,
                layer_idx=index,
                block_idx=token,
                k_data=struct.pack("<f", request.temperature),
                v_data=struct.pack("<i", request.max_new_tokens),
            )
        )
    yield Seed["KVBlockStream"](done=True)


async def _seed_decode(request: Any, context: Any) -> AsyncIterator[Any]:
    for block in request.kv_blocks:
        yield Seed["TokenStream"](request_id=block.request_id, token_id=block.layer_idx)
    for token in request.token_ids:
        yield Seed["TokenStream"](request_id=request.request_id, token_id=token)
    yield Seed["TokenStream"](
        request_id=request.request_id,
        token_id=request.max_new_tokens,
        done=True,
        finish_reason=f"length:{request.temperature}",
    )


@pytest.fixture
async def independent_server() -> AsyncIterator[str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "disagg.PrefillWorker",
                {
                    "Prefill": grpc.unary_stream_rpc_method_handler(
                        _seed_prefill,
                        request_deserializer=Seed["PreFillRequest"].FromString,
                        response_serializer=Seed["KVBlockStream"].SerializeToString,
                    )
                },
            ),
            grpc.method_handlers_generic_handler(
                "disagg.DecodeWorker",
                {
                    "Decode": grpc.unary_stream_rpc_method_handler(
                        _seed_decode,
                        request_deserializer=Seed["DecodeRequest"].FromString,
                        response_serializer=Seed["TokenStream"].SerializeToString,
                    )
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_our_stubs_against_an_independent_server(independent_server: str) -> None:
    async with grpc.aio.insecure_channel(independent_server, options=CHANNEL_OPTIONS) as channel:
        prefill = disagg_pb2_grpc.PrefillWorkerStub(channel)
        stream = [
            message
            async for message in prefill.Prefill(
                disagg_pb2.PreFillRequest(
                    request_id="r", token_ids=[5, 9], max_new_tokens=3, temperature=0.25
                )
            )
        ]
        assert [m.done for m in stream] == [False, False, True]
        blocks = [m.block for m in stream if m.HasField("block")]
        assert [(b.request_id, b.layer_idx, b.block_idx) for b in blocks] == [
            ("r", 0, 5),
            ("r", 1, 9),
        ]
        assert {struct.unpack("<f", b.k_data)[0] for b in blocks} == {0.25}
        assert {struct.unpack("<i", b.v_data)[0] for b in blocks} == {3}

        handoff = encode_handoff(
            {"kv_transfer_params": {"remote_block_ids": [[1, 2]]}},
            request_id="r",
            engine="vllm",
            kv_connector="shfs",
            prefill_host="10.0.0.7",
            prefill_port=8000,
        )
        decode = disagg_pb2_grpc.DecodeWorkerStub(channel)
        tokens = [
            message
            async for message in decode.Decode(
                disagg_pb2.DecodeRequest(
                    request_id="d",
                    kv_blocks=[*handoff, *blocks],
                    token_ids=[100, 101],
                    max_new_tokens=77,
                    temperature=2.0,
                )
            )
        ]
    assert [(t.request_id, t.token_id, t.done) for t in tokens] == [
        ("r", -1, False),
        ("r", 0, False),
        ("r", 1, False),
        ("d", 100, False),
        ("d", 101, False),
        ("d", 77, True),
    ]
    assert tokens[-1].finish_reason == "length:2.0"
