"""Proves the DecodeRequest / KVBlockStream wire walk (``sidecar.grpc_server.inline.protowire``)
means what
upb's parser means: for any request upb serializes (and for hand-framed variants: fields
reordered, repeated scalars, unknown fields, known fields of another wire type, negative
int32s) the head parses to the request without its blocks and the blocks carry the same
layer, block, K and V; malformed wire is refused wherever upb refuses it; a router's block
slice of a KVBlockStream is the block's serialization.

Does not prove the gRPC Decode path (test_decode_wire.py does).
"""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.inline.protowire import (
    WireError,
    kv_block_of_stream,
    split_decode_request,
)
from sidecar.grpc_server.inline.protowire import encode_varint as varint

int32s = st.integers(min_value=-(2**31), max_value=2**31 - 1)
blocks = st.builds(
    disagg_pb2.KVBlock,
    request_id=st.text(max_size=8),
    layer_idx=int32s,
    block_idx=int32s,
    k_data=st.binary(max_size=300),
    v_data=st.binary(max_size=300),
)
requests = st.builds(
    disagg_pb2.DecodeRequest,
    request_id=st.text(max_size=12),
    kv_blocks=st.lists(blocks, max_size=6),
    token_ids=st.lists(int32s, max_size=20),
    max_new_tokens=int32s,
    temperature=st.floats(width=32, allow_nan=False),
)


def field(number: int, wire_type: int, payload: bytes) -> bytes:
    key = varint(number << 3 | wire_type)
    if wire_type == 2:
        return key + varint(len(payload)) + payload
    return key + payload


def walked(data: bytes) -> tuple[disagg_pb2.DecodeRequest, list[tuple[int, int, bytes, bytes]]]:
    head, found = split_decode_request(data)
    return (
        disagg_pb2.DecodeRequest.FromString(head),
        [(b.layer_idx, b.block_idx, bytes(b.k_data), bytes(b.v_data)) for b in found],
    )


def expected(data: bytes) -> tuple[disagg_pb2.DecodeRequest, list[tuple[int, int, bytes, bytes]]]:
    request = disagg_pb2.DecodeRequest.FromString(data)
    entries = [(b.layer_idx, b.block_idx, b.k_data, b.v_data) for b in request.kv_blocks]
    del request.kv_blocks[:]
    return request, entries


@settings(max_examples=200, deadline=None)
@given(requests)
def test_walk_equals_upb_for_serialized_requests(request: disagg_pb2.DecodeRequest) -> None:
    data = request.SerializeToString()
    assert walked(data) == expected(data)


def test_walk_equals_upb_for_hand_framed_variants() -> None:
    block = (
        field(5, 2, b"V" * 7)
        + field(99, 0, varint(5))  # unknown varint
        + field(2, 0, varint(-2))  # negative int32: ten-byte varint
        + field(4, 2, b"old")
        + field(4, 2, b"K" * 7)  # repeated: the last wins
        + field(3, 5, b"\x01\x02\x03\x04")  # known number, other wire type: unknown
        + field(3, 0, varint(9))
        + field(1, 2, "réq".encode())
        + field(98, 1, b"\x00" * 8)  # unknown fixed64
    )
    data = (
        field(4, 0, varint(3))
        + field(2, 2, block)
        + field(3, 0, varint(11))  # unpacked token_ids
        + field(3, 2, varint(12) + varint(13))  # packed token_ids
        + field(2, 0, varint(1))  # kv_blocks as a varint: unknown to protobuf too
        + field(1, 2, b"rid")
        + field(2, 2, b"")  # an empty block
        + field(77, 2, b"opaque")
    )
    got = walked(data)
    assert got == expected(data)
    assert got[1] == [(-2, 9, b"K" * 7, b"V" * 7), (0, 0, b"", b"")]
    assert list(got[0].token_ids) == [11, 12, 13] and got[0].request_id == "rid"


MALFORMED = {
    "truncated-key": b"\x80",
    "truncated-length": field(1, 2, b"abc")[:-1],
    "length-past-end": b"\x12\x05ab",
    "varint-too-long": b"\x20" + b"\xff" * 10 + b"\x01",
    "field-zero": b"\x00\x01",
    "wire-type-6": b"\x0e",
    "wire-type-7": b"\x0f",
    "block-truncated": field(2, 2, b"\x22\x05ab"),
    "block-field-zero": field(2, 2, b"\x00\x01"),
    "block-bad-utf8": field(2, 2, field(1, 2, b"\xff\xfe")),
    "block-varint-too-long": field(2, 2, b"\x10" + b"\xff" * 10 + b"\x01"),
    "fixed32-past-end": b"\x2d\x00\x00",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_wire_is_refused_where_upb_refuses_it(data: bytes) -> None:
    with pytest.raises(DecodeError):
        disagg_pb2.DecodeRequest.FromString(data)
    with pytest.raises(WireError):
        split_decode_request(data)


def test_groups_are_refused() -> None:
    # Deliberate limit (proto2 only): upb would skip an unknown group, the walk refuses it.
    with pytest.raises(WireError):
        split_decode_request(field(9, 3, b"") + field(9, 4, b""))


@settings(max_examples=100, deadline=None)
@given(blocks, st.booleans())
def test_router_slices_the_block_of_a_stream_message(block: disagg_pb2.KVBlock, done: bool) -> None:
    message = disagg_pb2.KVBlockStream(block=block, done=done)
    found = kv_block_of_stream(message.SerializeToString())
    assert found is not None
    assert bytes(found) == block.SerializeToString()
    assert kv_block_of_stream(disagg_pb2.KVBlockStream(done=True).SerializeToString()) is None


def test_a_stream_message_with_two_blocks_is_refused() -> None:
    one = field(1, 2, disagg_pb2.KVBlock(layer_idx=1).SerializeToString())
    with pytest.raises(WireError):
        kv_block_of_stream(one + one)
