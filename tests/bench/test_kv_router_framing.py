"""The KV bench's router frames DecodeRequest bytes that parse to the same message as
building the DecodeRequest from the blocks (protobuf concatenation of repeated fields),
including blocks over 127 bytes (multi-byte length varints) and empty blocks."""

from __future__ import annotations

from bench.kv_throughput import decode_request_bytes
from sidecar.grpc_gen import disagg_pb2


def test_framed_request_equals_built_request() -> None:
    blocks = [
        disagg_pb2.KVBlock(
            request_id="r", layer_idx=i - 2, block_idx=i, k_data=b"k" * (i * 97), v_data=b"v" * i
        )
        for i in range(40)
    ]
    head = disagg_pb2.DecodeRequest(request_id="x", token_ids=[1, 2, 3], max_new_tokens=4)
    built = disagg_pb2.DecodeRequest()
    built.CopyFrom(head)
    built.kv_blocks.extend(blocks)
    framed = decode_request_bytes(head, [b.SerializeToString() for b in blocks])
    assert disagg_pb2.DecodeRequest.FromString(framed) == built
    assert len(framed) == built.ByteSize()
