"""The protobuf wire of DecodeRequest walked without building messages: KV tiles as memoryviews.

    split_decode_request(data) ─▶ (head, blocks)
      head:   every field but ``kv_blocks`` (2), re-framed as they came (``FromString`` it)
      blocks: one ``WireBlock(layer_idx, block_idx, k_data, v_data)`` per ``kv_blocks`` entry,
              ``k_data`` / ``v_data`` memoryviews into ``data`` (no copy of the KV)
    kv_block_of_stream, frame_decode_request, frame_stream_block, stream_block_heads: the
              router's and the inline Prefill's framing of blocks, without message objects

Malformed wire raises ``WireError``; groups (wire types 3 and 4, proto2 only) count as
malformed. Why, and what it reads exactly as protobuf's parser does:
docs/extending/design-notes.md#decode-wire-walk
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

VARINT: Final = 0
I64: Final = 1
LEN: Final = 2
I32: Final = 5

#: DecodeRequest.kv_blocks; KVBlockStream.block; KVBlock fields.
DECODE_KV_BLOCKS: Final = 2
STREAM_BLOCK: Final = 1
BLOCK_REQUEST_ID: Final = 1
BLOCK_LAYER: Final = 2
BLOCK_INDEX: Final = 3
BLOCK_K: Final = 4
BLOCK_V: Final = 5

_EMPTY: Final = memoryview(b"")


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


class WireBlock(msgspec.Struct, frozen=True):
    """One KVBlock as found on the wire (``request_id`` checked, not kept)."""

    layer_idx: int
    block_idx: int
    k_data: memoryview
    v_data: memoryview


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than ten bytes")


def _int32(value: int) -> int:
    """protobuf's int32 from a varint: the low 32 bits, two's complement."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _skip(buf: memoryview, pos: int, end: int, wire_type: int) -> int:
    """Position after a field's value of ``wire_type`` that starts at ``pos``."""
    if wire_type == VARINT:
        return _varint(buf, pos, end)[1]
    if wire_type == LEN:
        length, pos = _varint(buf, pos, end)
        pos += length
    elif wire_type == I64:
        pos += 8
    elif wire_type == I32:
        pos += 4
    else:
        raise WireError(f"wire type {wire_type} is not supported")
    if pos > end:
        raise WireError("field runs past the end of its message")
    return pos


def _tag(buf: memoryview, pos: int, end: int) -> tuple[int, int, int]:
    key, pos = _varint(buf, pos, end)
    number, wire_type = key >> 3, key & 7
    if number == 0 or key > 0xFFFFFFFF:
        raise WireError(f"invalid field key {key}")
    return number, wire_type, pos


def split_decode_request(data: bytes | memoryview) -> tuple[bytes, list[WireBlock]]:
    """A DecodeRequest's other fields (re-framed) and its KV blocks (see the module docstring)."""
    buf = memoryview(data).cast("B")
    end = len(buf)
    head: list[memoryview] = []
    blocks: list[WireBlock] = []
    pos = 0
    while pos < end:
        start = pos
        number, wire_type, pos = _tag(buf, pos, end)
        if number == DECODE_KV_BLOCKS and wire_type == LEN:
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise WireError("kv_blocks entry runs past the end of the request")
            blocks.append(parse_block(buf[pos : pos + length]))
            pos += length
        else:
            pos = _skip(buf, pos, end, wire_type)
            head.append(buf[start:pos])
    return b"".join(head), blocks


def parse_block(buf: memoryview) -> WireBlock:
    """One serialized KVBlock; its bytes fields as memoryviews into ``buf``."""
    end = len(buf)
    layer_idx = block_idx = 0
    k_data = v_data = request_id = _EMPTY
    pos = 0
    while pos < end:
        number, wire_type, pos = _tag(buf, pos, end)
        if wire_type == VARINT and number in (BLOCK_LAYER, BLOCK_INDEX):
            value, pos = _varint(buf, pos, end)
            if number == BLOCK_LAYER:
                layer_idx = _int32(value)
            else:
                block_idx = _int32(value)
        elif wire_type == LEN and number in (BLOCK_REQUEST_ID, BLOCK_K, BLOCK_V):
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise WireError("KVBlock field runs past the end of the block")
            value_view = buf[pos : pos + length]
            pos += length
            if number == BLOCK_K:
                k_data = value_view
            elif number == BLOCK_V:
                v_data = value_view
            else:
                request_id = value_view
        else:
            pos = _skip(buf, pos, end, wire_type)
    try:
        str(request_id, "utf-8")
    except UnicodeDecodeError:
        raise WireError("KVBlock request_id is not UTF-8") from None
    return WireBlock(layer_idx, block_idx, k_data, v_data)


def encode_varint(value: int) -> bytes:
    """``value`` as a protobuf varint (a negative one as its 64-bit two's complement)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_KV_BLOCKS_KEY: Final = encode_varint(DECODE_KV_BLOCKS << 3 | LEN)


def frame_decode_request(head: bytes, blocks: Iterable[bytes | memoryview]) -> bytes:
    """A DecodeRequest's bytes: ``head`` (its other fields, serialized), then each serialized
    KVBlock as a ``kv_blocks`` entry (protobuf concatenation: the same DecodeRequest)."""
    parts: list[bytes | memoryview] = [head]
    for block in blocks:
        parts += (_KV_BLOCKS_KEY, encode_varint(len(block)), block)
    return b"".join(parts)


def _len_field(number: int, length: int) -> bytes:
    """The key and length prefix of a ``LEN`` field of ``length`` bytes."""
    return encode_varint(number << 3 | LEN) + encode_varint(length)


def _int_field(number: int, value: int) -> bytes:
    # proto3 leaves a zero scalar out; a negative int32 is its 64-bit two's complement.
    return encode_varint(number << 3 | VARINT) + encode_varint(value) if value else b""


def stream_block_heads(request_id: str, layer_idx: int, block_idx: int,
                       k_len: int, v_len: int) -> tuple[bytes, bytes]:
    """What ``KVBlockStream{block: KVBlock{...}}`` with ``k_len`` bytes of K and ``v_len`` of
    V serializes to around them: the bytes before K, and the bytes between K and V (none
    after V). A message is ``head + K + middle + V``."""
    rid = request_id.encode("utf-8")
    fields = b"".join([
        _len_field(BLOCK_REQUEST_ID, len(rid)) + rid if rid else b"",
        _int_field(BLOCK_LAYER, layer_idx),
        _int_field(BLOCK_INDEX, block_idx),
    ])
    k_key = _len_field(BLOCK_K, k_len) if k_len else b""
    v_key = _len_field(BLOCK_V, v_len) if v_len else b""
    block_len = len(fields) + len(k_key) + k_len + len(v_key) + v_len
    return _len_field(STREAM_BLOCK, block_len) + fields + k_key, v_key


def frame_stream_block(request_id: str, layer_idx: int, block_idx: int,
                       k_parts: Sequence[bytes | memoryview],
                       v_parts: Sequence[bytes | memoryview]) -> bytes:
    """The bytes ``SerializeToString`` gives for ``KVBlockStream{block: KVBlock{...}}`` with
    ``k_parts`` and ``v_parts`` joined, built with one copy of the parts."""
    head, middle = stream_block_heads(
        request_id, layer_idx, block_idx,
        sum(len(part) for part in k_parts), sum(len(part) for part in v_parts),
    )
    return b"".join([head, *k_parts, middle, *v_parts])


def kv_block_of_stream(data: bytes | memoryview) -> memoryview | None:
    """The serialized KVBlock of a KVBlockStream message (None when it has no block); a
    repeated ``block`` field (protobuf would merge them) is refused."""
    buf = memoryview(data).cast("B")
    end = len(buf)
    found: memoryview | None = None
    pos = 0
    while pos < end:
        number, wire_type, pos = _tag(buf, pos, end)
        if number == STREAM_BLOCK and wire_type == LEN:
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise WireError("block runs past the end of the message")
            if found is not None:
                raise WireError("KVBlockStream carries its block field twice")
            found = buf[pos : pos + length]
            pos += length
        else:
            pos = _skip(buf, pos, end, wire_type)
    return found
