"""Our messages put exactly the contract's bytes (docs/driving/grpc-contract.md#messages) on the
wire, checked
against hand-encoded protobuf.

The expected bytes are written here from the origin's struct tags with a few lines of protobuf
encoding (tag = number << 3 | wire type; varint, fixed32, length-delimited), not produced by
any protobuf library. Proves: field numbers and wire types (varint int32/bool, fixed32 float,
length-delimited string/bytes/messages), packed repeated int32, negative int32 as a 10-byte
varint (control blocks use ``layer_idx < 0``), and that our parser reads the origin's bytes,
unpacked repeated int32 included (the proto3 rule every parser must accept).
"""

from __future__ import annotations

import struct

import pytest

from sidecar.grpc_gen import disagg_pb2

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


def varint(value: int) -> bytes:
    # int32 negatives are sign-extended to 64 bits on the wire.
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, LENGTH) + varint(len(payload)) + payload


def float32(number: int, value: float) -> bytes:
    return tag(number, FIXED32) + struct.pack("<f", value)


def packed_int32(number: int, values: list[int]) -> bytes:
    return length_delimited(number, b"".join(varint(v) for v in values))


def kv_block_bytes(request_id: str, layer: int, block: int, k: bytes, v: bytes) -> bytes:
    # proto3 sends no field that holds its zero value.
    parts = [
        length_delimited(1, request_id.encode()) if request_id else b"",
        tag(2, VARINT) + varint(layer) if layer else b"",
        tag(3, VARINT) + varint(block) if block else b"",
        length_delimited(4, k) if k else b"",
        length_delimited(5, v) if v else b"",
    ]
    return b"".join(parts)


def test_varint_helper_matches_the_protobuf_spec_examples() -> None:
    assert varint(1) == b"\x01"
    assert varint(150) == b"\x96\x01"
    assert varint(-1) == b"\xff" * 9 + b"\x01"


def test_prefill_request() -> None:
    expected = (
        length_delimited(1, b"req-1")
        + packed_int32(2, [1, 300, 2, 0])
        + tag(3, VARINT)
        + varint(16)
        + float32(4, 0.5)
    )
    message = disagg_pb2.PreFillRequest(
        request_id="req-1", token_ids=[1, 300, 2, 0], max_new_tokens=16, temperature=0.5
    )
    assert message.SerializeToString() == expected
    assert disagg_pb2.PreFillRequest.FromString(expected) == message


@pytest.mark.parametrize("layer", [-1, -2, 0, 31])
def test_kv_block(layer: int) -> None:
    expected = kv_block_bytes("req-1", layer, 3, b"\x00\x3c" * 4, b"\x00\xbc" * 4)
    message = disagg_pb2.KVBlock(
        request_id="req-1",
        layer_idx=layer,
        block_idx=3,
        k_data=b"\x00\x3c" * 4,
        v_data=b"\x00\xbc" * 4,
    )
    assert message.SerializeToString() == expected
    assert disagg_pb2.KVBlock.FromString(expected) == message


def test_kv_block_stream_with_block_and_done() -> None:
    block = kv_block_bytes("r", -1, 0, b"{}", b"")
    expected = length_delimited(1, block) + tag(2, VARINT) + varint(1)
    message = disagg_pb2.KVBlockStream(
        block=disagg_pb2.KVBlock(request_id="r", layer_idx=-1, k_data=b"{}"), done=True
    )
    assert message.SerializeToString() == expected
    assert disagg_pb2.KVBlockStream.FromString(expected) == message


def test_done_only_stream_message() -> None:
    assert disagg_pb2.KVBlockStream(done=True).SerializeToString() == tag(2, VARINT) + b"\x01"


def test_decode_request() -> None:
    blocks = [kv_block_bytes("p", -1, 0, b"ab", b"c"), kv_block_bytes("p", 0, 0, b"k", b"v")]
    expected = (
        length_delimited(1, b"d-1")
        + b"".join(length_delimited(2, b) for b in blocks)
        + packed_int32(3, [5, 6])
        + tag(4, VARINT)
        + varint(8)
        + float32(5, 1.25)
    )
    message = disagg_pb2.DecodeRequest(
        request_id="d-1",
        kv_blocks=[
            disagg_pb2.KVBlock(request_id="p", layer_idx=-1, k_data=b"ab", v_data=b"c"),
            disagg_pb2.KVBlock(request_id="p", layer_idx=0, k_data=b"k", v_data=b"v"),
        ],
        token_ids=[5, 6],
        max_new_tokens=8,
        temperature=1.25,
    )
    assert message.SerializeToString() == expected
    assert disagg_pb2.DecodeRequest.FromString(expected) == message


def test_token_stream() -> None:
    expected = (
        length_delimited(1, b"d-1")
        + tag(2, VARINT)
        + varint(2)
        + tag(3, VARINT)
        + varint(1)
        + length_delimited(4, b"stop")
    )
    message = disagg_pb2.TokenStream(request_id="d-1", token_id=2, done=True, finish_reason="stop")
    assert message.SerializeToString() == expected
    assert disagg_pb2.TokenStream.FromString(expected) == message


def test_parser_accepts_unpacked_token_ids() -> None:
    unpacked = b"".join(tag(2, VARINT) + varint(v) for v in [7, 8, 9])
    assert list(disagg_pb2.PreFillRequest.FromString(unpacked).token_ids) == [7, 8, 9]


def test_defaults_are_omitted() -> None:
    # proto3: zero values are not sent, so an empty request is zero bytes on the wire.
    assert disagg_pb2.DecodeRequest().SerializeToString() == b""
    assert disagg_pb2.KVBlock(layer_idx=0, block_idx=0).SerializeToString() == b""
