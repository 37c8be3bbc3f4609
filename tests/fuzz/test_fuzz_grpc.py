"""Property-based tests of the gRPC front door's input handling: the hand-off control-block
decoder, the engine token-stream parser, the request checks, and whole Prefill/Decode calls
with arbitrary messages against a running sidecar.

Proves: each piece returns a value or raises its documented ``SidecarError``; over the wire,
no message makes the sidecar answer INTERNAL or UNKNOWN (a crash) or hang (a deadline), and
the sidecar serves a valid call afterwards. Does not prove the engines' acceptance of the
bodies built from random hand-off fields (they answer with their own 4xx).
"""

from __future__ import annotations

import contextlib
import math
import string
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fuzz_builders import E2E_TIMEOUT_S, FUZZ, FUZZ_E2E, BackgroundSidecar, background_sidecar
from hypothesis import given
from hypothesis import strategies as st

from sidecar.errors import DecodeFailed, InvalidRequest
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.decode import TokenStreamParser
from sidecar.grpc_server.errors import grpc_status
from sidecar.grpc_server.native import HANDOFF_LAYER, DecodedHandoff, decode_handoff, encode_handoff
from sidecar.grpc_server.rpc import (
    check_max_new_tokens,
    check_temperature,
    check_token_ids,
)
from sidecar.protocol.request import request_id_or_new

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
FLOATS = st.floats(width=32)
# The widest integers JSON here carries: int64 and uint64 (what the engines write).
JSON_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
                | st.text(max_size=12))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=10)
FIELDS = st.dictionaries(st.text(max_size=12), JSON, max_size=4)

RANDOM_BLOCKS = st.builds(
    disagg_pb2.KVBlock,
    request_id=st.text(max_size=8),
    layer_idx=st.sampled_from([HANDOFF_LAYER, -2, -3, 0, 1, -(2**31)]) | INT32,
    block_idx=st.integers(min_value=-2, max_value=4) | INT32,
    k_data=st.binary(max_size=64),
    v_data=st.binary(max_size=8),
)


@st.composite
def control_blocks(draw: st.DrawFn) -> list[disagg_pb2.KVBlock]:
    """A hand-off as the prefill side writes it, from random fields, maybe damaged."""
    blocks = encode_handoff(
        draw(FIELDS),
        request_id=draw(st.text(max_size=8)),
        engine=draw(st.sampled_from(["vllm", "sglang", "trtllm", "other"])),
        kv_connector=draw(st.sampled_from([None, "shfs", "nixl", "mooncake", "x"])),
        prefill_host=draw(st.sampled_from(["127.0.0.1", "::1", "", "a b"])),
        prefill_port=draw(st.integers(min_value=1, max_value=65535)),
        max_chunk_bytes=draw(st.integers(min_value=1, max_value=64)),
    )
    damage = draw(st.sampled_from(["none", "drop", "flip", "extra"]))
    if damage == "drop" and blocks:
        del blocks[draw(st.integers(min_value=0, max_value=len(blocks) - 1))]
    elif damage == "flip" and blocks:
        i = draw(st.integers(min_value=0, max_value=len(blocks) - 1))
        blocks[i].k_data = draw(st.binary(max_size=16))
    elif damage == "extra":
        blocks.append(draw(RANDOM_BLOCKS))
    return list(draw(st.permutations(blocks)))


BLOCK_LISTS = st.one_of(st.lists(RANDOM_BLOCKS, max_size=5), control_blocks())


@FUZZ
@given(BLOCK_LISTS)
def test_handoff_decoder(blocks: list[disagg_pb2.KVBlock]) -> None:
    try:
        decoded = decode_handoff(blocks)
    except InvalidRequest as error:
        assert grpc_status(error) is grpc.StatusCode.INVALID_ARGUMENT
        return
    assert isinstance(decoded, DecodedHandoff)
    assert isinstance(decoded.fields, dict)


EVENT_PIECES = st.sampled_from([
    b"data: ", b"[DONE]", b"\n", b"\r\n", b"\n\n", b": comment\n", b'{"choices": [',
    b'{"index": 0, "token_ids": [1, 2]', b', "finish_reason": "stop"', b"}]}", b'"x"',
    b'{"error": {}}', b"null", b"-1", b"\xff", b"[]",
])
STREAMS = st.one_of(st.binary(max_size=300), st.lists(EVENT_PIECES, max_size=30).map(b"".join))


@FUZZ
@given(STREAMS, st.lists(st.integers(min_value=1, max_value=40), max_size=8))
def test_token_stream_parser(stream: bytes, cuts: list[int]) -> None:
    parser = TokenStreamParser()
    pieces, rest = [], stream
    for cut in cuts:
        pieces.append(rest[:cut])
        rest = rest[cut:]
    pieces.append(rest)
    try:
        tokens = [token for piece in pieces for token in parser.feed(piece)]
        tokens += parser.flush()
        reason = parser.finish()
    except DecodeFailed:
        return
    assert all(isinstance(token, int) for token in tokens)
    assert reason in ("stop", "length", "abort") or isinstance(reason, str)


@FUZZ
@given(st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=6), INT32, FLOATS,
       st.booleans(), st.text(max_size=30))
def test_request_checks(ids: list[int], max_new: int, temperature: float, unset: bool,
                        request_id: str) -> None:
    for check, arg in ((check_token_ids, (ids,)), (check_temperature, (temperature,))):
        with contextlib.suppress(InvalidRequest):
            check(*arg)  # type: ignore[operator]
    try:
        value = check_max_new_tokens(max_new, allow_unset=unset)
        assert value >= 1 or (unset and max_new == 0)
    except InvalidRequest:
        pass
    if not math.isnan(temperature) and temperature >= 0 and math.isfinite(temperature):
        assert check_temperature(temperature) >= 0
    assert request_id_or_new(request_id)


#: Statuses an input may earn; INTERNAL/UNKNOWN are crashes, DEADLINE_EXCEEDED a hang
#: (the stub engines answer in milliseconds).
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@pytest.fixture(scope="module")
def grpc_sidecar() -> Iterator[BackgroundSidecar]:
    with background_sidecar("vllm") as bg:
        yield bg


def _call(bg: BackgroundSidecar, method: str, message: Any) -> grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{bg.grpc_port}",
                               options=[("grpc.enable_http_proxy", 0)]) as channel:
        if method == "Prefill":
            call = disagg_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                message, timeout=E2E_TIMEOUT_S)
        else:
            call = disagg_pb2_grpc.DecodeWorkerStub(channel).Decode(
                message, timeout=E2E_TIMEOUT_S)
        try:
            for _ in call:
                pass
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK


PREFILLS = st.builds(
    disagg_pb2.PreFillRequest,
    request_id=st.text(alphabet=string.printable, max_size=40),
    token_ids=st.lists(INT32, max_size=8),
    max_new_tokens=INT32,
    temperature=FLOATS,
)
DECODES = st.builds(
    disagg_pb2.DecodeRequest,
    request_id=st.text(alphabet=string.printable, max_size=40),
    kv_blocks=BLOCK_LISTS,
    token_ids=st.lists(INT32, max_size=8),
    max_new_tokens=INT32,
    temperature=FLOATS,
)


@FUZZ_E2E
@given(PREFILLS)
def test_prefill_rpc_with_any_message(grpc_sidecar: BackgroundSidecar,
                                      message: disagg_pb2.PreFillRequest) -> None:
    code = _call(grpc_sidecar, "Prefill", message)
    assert code in ACCEPTABLE, code


@FUZZ_E2E
@given(DECODES)
def test_decode_rpc_with_any_message(grpc_sidecar: BackgroundSidecar,
                                     message: disagg_pb2.DecodeRequest) -> None:
    code = _call(grpc_sidecar, "Decode", message)
    assert code in ACCEPTABLE, code


def test_grpc_still_serves_after_fuzzing(grpc_sidecar: BackgroundSidecar) -> None:
    prefill = disagg_pb2.PreFillRequest(request_id="after-fuzz", token_ids=[72, 101, 108],
                                        max_new_tokens=4)
    assert _call(grpc_sidecar, "Prefill", prefill) is grpc.StatusCode.OK


