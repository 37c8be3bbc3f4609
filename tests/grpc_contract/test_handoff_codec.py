"""``sidecar.grpc_server.native``: the native hand-off as control blocks, both ways.

Proves: a round trip keeps every field (key order, nested values, 64-bit integers such as
TensorRT-LLM ids above 2**53, non-ASCII text split across chunks); chunking numbers blocks
0..n-1 with empty ``v_data``; blocks may arrive in any order, mixed with data blocks and inline
metadata blocks; each malformed input is refused with ``InvalidRequest`` (INVALID_ARGUMENT,
stage ``handoff``) and a message naming the problem; bad encoder arguments raise. Does not test
the gRPC transport (test_grpc_interop does).
"""

from __future__ import annotations

import random
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import jsonutil
from sidecar.errors import InvalidRequest, Stage
from sidecar.grpc_gen.disagg_pb2 import KVBlock
from sidecar.grpc_server.errors import grpc_status
from sidecar.grpc_server.native import (
    HANDOFF_LAYER,
    INLINE_META_LAYER,
    DecodedHandoff,
    decode_handoff,
    encode_handoff,
    is_control_block,
)

TRT_FIELDS = {
    "disaggregated_params": {
        "request_type": "generation_only",
        "ctx_request_id": 397181498744115205,
        "disagg_request_id": 2**53 + 1,
        "max_id": 2**63 - 1,
        "min_id": -(2**63),
        "encoded_opaque_state": "AAEC",
    },
    "prompt_token_ids": [1, 2, 3],
}


def encode(fields: dict[str, Any] | None = None, **overrides: Any) -> list[KVBlock]:
    kwargs: dict[str, Any] = {
        "request_id": "req-1",
        "engine": "vllm",
        "kv_connector": "shfs",
        "prefill_host": "10.0.0.7",
        "prefill_port": 8000,
    }
    kwargs.update(overrides)
    return encode_handoff(fields if fields is not None else {"a": 1}, **kwargs)


def control(payload: bytes, *, block_idx: int = 0, request_id: str = "req-1") -> KVBlock:
    return KVBlock(
        request_id=request_id, layer_idx=HANDOFF_LAYER, block_idx=block_idx, k_data=payload
    )


def document(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": 1,
        "kind": "handoff",
        "engine": "sglang",
        "kv_connector": None,
        "fields": {"bootstrap_room": 5},
        "prefill": {"host": "h", "port": 8998},
        "request_id": "req-1",
    }
    doc.update(overrides)
    return doc


def refused(blocks: list[KVBlock]) -> str:
    with pytest.raises(InvalidRequest) as caught:
        decode_handoff(blocks)
    error = caught.value
    assert grpc_status(error) == grpc.StatusCode.INVALID_ARGUMENT
    assert error.stage is Stage.HANDOFF
    assert error.message.startswith("hand-off: ")
    return error.message


# --- round trips -------------------------------------------------------------------------------


def test_round_trip() -> None:
    fields = {"kv_transfer_params": {"remote_block_ids": [[1, 2], [3]], "remote_host": "10.0.0.7"}}
    blocks = encode(fields)
    assert len(blocks) == 1
    assert decode_handoff(blocks) == DecodedHandoff(
        request_id="req-1",
        engine="vllm",
        kv_connector="shfs",
        fields=fields,
        prefill_host="10.0.0.7",
        prefill_port=8000,
    )


def test_block_shape() -> None:
    (block,) = encode()
    assert (block.request_id, block.layer_idx, block.block_idx, block.v_data) == (
        "req-1",
        HANDOFF_LAYER,
        0,
        b"",
    )
    assert is_control_block(block)
    assert jsonutil.loads(block.k_data) == {
        "version": 1,
        "kind": "handoff",
        "engine": "vllm",
        "kv_connector": "shfs",
        "fields": {"a": 1},
        "prefill": {"host": "10.0.0.7", "port": 8000},
        "request_id": "req-1",
    }


def test_null_connector_round_trips() -> None:
    assert decode_handoff(encode(kv_connector=None)).kv_connector is None


def test_big_integers_stay_exact() -> None:
    decoded = decode_handoff(encode(TRT_FIELDS, engine="trtllm", kv_connector=None))
    assert decoded.fields == TRT_FIELDS
    params = decoded.fields["disaggregated_params"]
    assert type(params["ctx_request_id"]) is int
    assert params["ctx_request_id"] == 397181498744115205
    assert params["disagg_request_id"] == 2**53 + 1


def test_key_order_is_kept() -> None:
    fields = {"z": 1, "a": {"y": 2, "b": 3}, "m": None}
    decoded = decode_handoff(encode(fields))
    assert list(decoded.fields) == ["z", "a", "m"]
    assert list(decoded.fields["a"]) == ["y", "b"]


def test_caller_dict_is_not_kept() -> None:
    fields: dict[str, Any] = {"a": [1]}
    blocks = encode(fields)
    fields["a"].append(2)
    assert decode_handoff(blocks).fields == {"a": [1]}


def test_chunking_numbers_blocks_and_round_trips() -> None:
    fields = {"text": "é日本語" * 50, "ids": list(range(100))}
    blocks = encode(fields, max_chunk_bytes=7)
    assert len(blocks) > 10
    assert [b.block_idx for b in blocks] == list(range(len(blocks)))
    assert all(b.layer_idx == HANDOFF_LAYER and b.v_data == b"" for b in blocks)
    assert all(0 < len(b.k_data) <= 7 for b in blocks)
    assert decode_handoff(blocks).fields == fields


def test_chunk_exactly_the_payload_size_gives_one_block() -> None:
    (single,) = encode()
    assert len(encode(max_chunk_bytes=len(single.k_data))) == 1
    assert len(encode(max_chunk_bytes=len(single.k_data) - 1)) == 2


def test_any_order_and_mixed_with_data_and_inline_blocks() -> None:
    blocks = encode(TRT_FIELDS, max_chunk_bytes=16)
    data = [
        KVBlock(request_id="req-1", layer_idx=layer, k_data=b"k", v_data=b"v") for layer in (0, 1)
    ]
    inline = KVBlock(request_id="req-1", layer_idx=INLINE_META_LAYER, k_data=b"\x00not json")
    mixed = [*blocks, *data, inline]
    random.Random(7).shuffle(mixed)
    assert decode_handoff(mixed).fields == TRT_FIELDS
    assert not is_control_block(data[0])
    assert is_control_block(inline)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(
    fields=st.dictionaries(st.text(max_size=12), json_values, max_size=6),
    chunk=st.integers(min_value=1, max_value=64),
    request_id=st.text(max_size=20),
)
def test_round_trip_property(fields: dict[str, Any], chunk: int, request_id: str) -> None:
    blocks = encode(fields, max_chunk_bytes=chunk, request_id=request_id)
    decoded = decode_handoff(blocks)
    assert decoded.fields == fields
    assert decoded.request_id == request_id


# --- refusals ----------------------------------------------------------------------------------


def test_no_blocks() -> None:
    assert "no hand-off control block" in refused([])


def test_only_data_and_inline_blocks() -> None:
    blocks = [
        KVBlock(layer_idx=0, k_data=b"k", v_data=b"v"),
        KVBlock(layer_idx=INLINE_META_LAYER, k_data=b"{}"),
    ]
    assert "no hand-off control block" in refused(blocks)


@pytest.mark.parametrize("payload", [b"", b"{", b"not json", b'{"a": 1} trailing', b"\xff\xfe"])
def test_malformed_json(payload: bytes) -> None:
    assert "not one UTF-8 JSON document" in refused([control(payload)])


@pytest.mark.parametrize("payload", [b"[]", b"1", b'"handoff"', b"null"])
def test_not_an_object(payload: bytes) -> None:
    assert "must be a JSON object" in refused([control(payload)])


@pytest.mark.parametrize("version", [2, 0, "1", 1.0, True, None])
def test_wrong_version(version: Any) -> None:
    message = refused([control(jsonutil.dumps(document(version=version)))])
    assert "unsupported version" in message


def test_missing_version() -> None:
    doc = document()
    del doc["version"]
    assert "unsupported version None" in refused([control(jsonutil.dumps(doc))])


@pytest.mark.parametrize("kind", ["inline", "", None, 1])
def test_wrong_kind(kind: Any) -> None:
    assert "unsupported kind" in refused([control(jsonutil.dumps(document(kind=kind)))])


def test_missing_middle_chunk() -> None:
    blocks = encode(TRT_FIELDS, max_chunk_bytes=16)
    del blocks[2]
    message = refused(blocks)
    assert "not numbered" in message
    assert "missing block_idx [" in message


def test_missing_first_chunk() -> None:
    blocks = encode(TRT_FIELDS, max_chunk_bytes=16)
    assert "missing block_idx" in refused(blocks[1:])


def test_missing_last_chunk() -> None:
    blocks = encode(TRT_FIELDS, max_chunk_bytes=16)
    assert "truncated" in refused(blocks[:-1])


def test_duplicate_chunk() -> None:
    blocks = encode(TRT_FIELDS, max_chunk_bytes=16)
    assert "duplicate control block block_idx 1" in refused([*blocks, blocks[1]])


def test_chunks_of_two_requests() -> None:
    first = encode(request_id="a", max_chunk_bytes=16)
    second = encode(request_id="b", max_chunk_bytes=16)
    assert "more than one request_id" in refused([first[0], *second[1:]])


def test_control_block_with_v_data() -> None:
    (block,) = encode()
    block.v_data = b"x"
    assert "v_data" in refused([block])


def test_unknown_control_layer() -> None:
    assert "unknown control block layer_idx -3" in refused(
        [*encode(), KVBlock(layer_idx=-3, k_data=b"{}")]
    )


@pytest.mark.parametrize("fields", [[], None, "x", 1, [["a", 1]]])
def test_non_object_fields(fields: Any) -> None:
    assert "'fields' must be a JSON object" in refused(
        [control(jsonutil.dumps(document(fields=fields)))]
    )


def test_missing_fields() -> None:
    doc = document()
    del doc["fields"]
    assert "'fields' must be a JSON object" in refused([control(jsonutil.dumps(doc))])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"engine": ""}, "'engine' must not be empty"),
        ({"engine": None}, "'engine' must be a string"),
        ({"kv_connector": 3}, "'kv_connector' must be a string or null"),
        ({"prefill": None}, "'prefill' must be a JSON object"),
        ({"prefill": {"port": 1}}, "'host' must be a string"),
        ({"prefill": {"host": "h", "port": "80"}}, "'prefill.port' must be an integer"),
        ({"prefill": {"host": "h", "port": 0}}, "'prefill.port' must be an integer"),
        ({"prefill": {"host": "h", "port": 65536}}, "'prefill.port' must be an integer"),
        ({"prefill": {"host": "h", "port": True}}, "'prefill.port' must be an integer"),
        ({"request_id": 5}, "'request_id' must be a string"),
    ],
)
def test_bad_metadata(overrides: dict[str, Any], expected: str) -> None:
    assert expected in refused([control(jsonutil.dumps(document(**overrides)))])


def test_unknown_keys_are_ignored() -> None:
    doc = document(future_key={"x": 1})
    assert decode_handoff([control(jsonutil.dumps(doc))]).engine == "sglang"


# --- encoder arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{"engine": ""}, {"prefill_port": 0}, {"prefill_port": 70000}, {"max_chunk_bytes": 0}],
)
def test_encoder_rejects_bad_arguments(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        encode(**overrides)


def test_encoder_rejects_non_json_fields() -> None:
    with pytest.raises(TypeError):
        encode({"a": object()})
