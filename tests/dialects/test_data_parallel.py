"""Proves where each dialect puts the legs' data-parallel ranks (docs/operating/data-parallel.md):

- with no rank (an engine of one rank) every dialect adds no header and no field: bodies are
  the golden ones of the other modules of this directory, byte for byte;
- vLLM (every connector): ``X-data-parallel-rank`` on each leg, nothing in the bodies;
- SGLang: the room is aligned to the prefill rank (``room % P == r``, P of the engine the
  prefill runs on: the target's over HTTP, this pod's over gRPC), ``routed_dp_rank`` on the
  prefill, ``disagg_prefill_dp_rank`` in the hand-off, the decode's own ``routed_dp_rank``;
  client values of those keys are refused as hand-off keys;
- Mooncake: the decode names the prefill rank's engine id from a multi-rank ``/query``
  answer (cached per rank), the same bootstrap address;
- TensorRT-LLM and the default dialect are not ranked (the engine places requests itself);
  TensorRT-LLM's ``ctx_dp_rank`` reaches the decode verbatim.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from protocol_builders import (
    BODY_CHECKS,
    begin,
    completions_body,
    make_ctx,
    make_dialect,
    make_ids,
)

from sidecar.dialects import Dialect, InlineDialect
from sidecar.dialects.base import NO_HEADERS
from sidecar.dialects.default import DefaultDialect
from sidecar.dialects.sglang import (
    DISAGG_PREFILL_DP_RANK,
    INT64_ROOMS,
    ROUTED_DP_RANK,
    RoomAllocator,
    SGLangDialect,
)
from sidecar.dialects.trtllm import TRTLLMDialect
from sidecar.dialects.vllm_mooncake import MooncakeDialect, MooncakeState
from sidecar.dialects.vllm_neuron import NeuronNixlDialect
from sidecar.dialects.vllm_nixl import NixlPullDialect
from sidecar.errors import InvalidHandoff, InvalidRequest, ResourceExhausted
from sidecar.protocol.context import FrontDoor, Route

ALL = (DefaultDialect, SGLangDialect, TRTLLMDialect, NixlPullDialect, NeuronNixlDialect,
       MooncakeDialect, InlineDialect)
VLLM = (NixlPullDialect, NeuronNixlDialect, MooncakeDialect, InlineDialect)

#: A multi-rank /query answer, shaped as vLLM 0.32.0 serves it (one bootstrap server for two
#: ranks; tests/fixtures/vllm/0.32.0/mooncake_query_dp2.json is the recorded one).
QUERY_DP2 = {
    "0": {"engine_id": "eng_dp0", "worker_addr": {"0": {"0": "tcp://10.0.0.8:40001"}}},
    "1": {"engine_id": "eng_dp1", "worker_addr": {"0": {"0": "tcp://10.0.0.8:40002"}}},
}


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.__name__)
def test_no_rank_no_header(cls: type[Dialect]) -> None:
    dialect = make_dialect(cls)
    assert dialect.prefill_headers(make_ctx()) is NO_HEADERS
    assert dialect.decode_headers(None) is NO_HEADERS


def test_which_dialects_are_ranked() -> None:
    assert {cls for cls in ALL if cls.ranked} == {SGLangDialect, *VLLM}


@pytest.mark.parametrize("cls", VLLM, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("rank", [0, 1, 3])
def test_vllm_rank_header_on_both_legs(cls: type[Dialect], rank: int) -> None:
    dialect = make_dialect(cls, local_ranks=4, prefill_ranks=4)
    assert dialect.prefill_headers(make_ctx(prefill_rank=rank)) == {
        "X-data-parallel-rank": str(rank)}
    assert dialect.decode_headers(rank) == {"X-data-parallel-rank": str(rank)}


def test_vllm_bodies_carry_no_rank() -> None:
    dialect = make_dialect(NixlPullDialect, prefill_ranks=2)
    client = completions_body()
    assert dialect.prefill_body(client, make_ctx(prefill_rank=1)) == dialect.prefill_body(
        client, make_ctx())
    handoff = {"kv_transfer_params": {"remote_engine_id": "e_dp1"}}
    assert dialect.decode_body(client, handoff, 1) == dialect.decode_body(client, handoff)


# -- SGLang ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("prefill_ranks", "rank"), [(2, 0), (2, 1), (4, 3)])
def test_sglang_fields_of_each_leg(prefill_ranks: int, rank: int) -> None:
    dialect = make_dialect(SGLangDialect, prefill_ranks=prefill_ranks, local_ranks=2)
    ctx = begin(dialect, make_ctx(prefill_rank=rank), make_ids(max_room=INT64_ROOMS))
    room = ctx.state
    assert room % prefill_ranks == rank
    client = completions_body()
    before = copy.deepcopy(client)
    prefill = dialect.prefill_body(client, ctx)
    decode = dialect.decode_body(client, dialect.handoff(None, ctx), 1)
    assert prefill["bootstrap_room"] == decode["bootstrap_room"] == room
    assert prefill[ROUTED_DP_RANK] == rank
    assert DISAGG_PREFILL_DP_RANK not in prefill
    assert decode[DISAGG_PREFILL_DP_RANK] == rank
    assert decode[ROUTED_DP_RANK] == 1
    assert client == before


def test_sglang_without_ranks_adds_nothing() -> None:
    dialect = make_dialect(SGLangDialect)
    ctx = begin(dialect, make_ctx())
    fields = dialect.prefill_fields(ctx)
    handoff = dialect.handoff(None, ctx)
    assert list(fields) == list(handoff) == [
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "rid"]
    assert dialect.decode_body({"model": "m"}, handoff) == {"model": "m", **handoff}


def test_sglang_decode_rank_alone() -> None:
    # Prefill of one rank, decode of several: SGLang's decode resolves the prefill's rank 0.
    dialect = make_dialect(SGLangDialect, local_ranks=4)
    ctx = begin(dialect, make_ctx())
    decode = dialect.decode_body({"model": "m"}, dialect.handoff(None, ctx), 2)
    assert decode[ROUTED_DP_RANK] == 2
    assert DISAGG_PREFILL_DP_RANK not in decode


def test_sglang_grpc_rooms_follow_this_pods_ranks() -> None:
    # gRPC Prefill runs on this pod's engine (4 ranks), not on a target's (2).
    dialect = make_dialect(SGLangDialect, local_ranks=4, prefill_ranks=2)
    ctx = dialect.begin(make_ctx(front_door=FrontDoor.GRPC, prefill_rank=3))
    assert ctx.state % 4 == 3 and ctx.state <= (1 << 31) - 1


@pytest.mark.parametrize("key", [ROUTED_DP_RANK, DISAGG_PREFILL_DP_RANK])
def test_sglang_rank_keys_are_the_sidecars(key: str) -> None:
    with pytest.raises(InvalidRequest):
        BODY_CHECKS.parse(b'{"model": "m", "prompt": "p", "%s": 1}' % key.encode(),
                          Route.COMPLETIONS)


def test_rooms_of_a_rank_keep_the_worker_lanes_apart() -> None:
    lanes = [RoomAllocator(4 * 2 * 50 - 1, lane=lane, lanes=2) for lane in (0, 1)]
    drawn = {lane: [rooms.allocate(3, 4) for _ in range(50)] for lane, rooms in enumerate(lanes)}
    for lane, rooms in drawn.items():
        assert all(room % 4 == 3 and (room // 4) % 2 == lane for room in rooms)
        assert len(set(rooms)) == 50
    assert not set(drawn[0]) & set(drawn[1])


def test_rooms_of_a_rank_exhaust_cleanly_and_free_again() -> None:
    rooms = RoomAllocator(15)
    taken = {rooms.allocate(1, 4) for _ in range(4)}
    assert taken == {1, 5, 9, 13}
    with pytest.raises(ResourceExhausted):
        rooms.allocate(1, 4)
    assert rooms.allocate(2, 4) % 4 == 2  # another rank's rooms are still free
    rooms.release(9)
    assert rooms.allocate(1, 4) == 9
    with pytest.raises(ValueError):
        rooms.allocate(4, 4)


# -- Mooncake --------------------------------------------------------------------------------


class QueryLookup:
    """An ``EngineLookup`` answering every GET with one ``/query`` body, counting them."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload
        self.urls: list[str] = []

    async def get(self, url: str, *, max_bytes: int) -> tuple[int, bytes]:
        self.urls.append(url)
        return 200, json.dumps(self.payload).encode()


@pytest.mark.parametrize("rank", [0, 1])
async def test_mooncake_decode_names_the_prefill_ranks_engine(rank: int) -> None:
    lookup = QueryLookup(QUERY_DP2)
    dialect = make_dialect(MooncakeDialect, lookup=lookup, prefill_ranks=2,
                           mooncake_bootstrap_port=8998)
    ctx = await dialect.look_up(begin(dialect, make_ctx(host="10.0.0.8", prefill_rank=rank)))
    assert ctx.state == MooncakeState("xfer-fixed", f"eng_dp{rank}")
    params = dialect.handoff(None, ctx)["kv_transfer_params"]
    assert params["remote_engine_id"] == f"eng_dp{rank}"
    assert params["remote_bootstrap_addr"] == "http://10.0.0.8:8998"
    assert dialect.prefill_headers(ctx) == {"X-data-parallel-rank": str(rank)}
    # Cached per rank: a second request on the same rank asks nothing.
    await dialect.look_up(begin(dialect, make_ctx(host="10.0.0.8", prefill_rank=rank)))
    assert lookup.urls == ["http://10.0.0.8:8998/query"]


async def test_mooncake_rank_missing_from_the_answer_is_invalid() -> None:
    dialect = make_dialect(MooncakeDialect, lookup=QueryLookup(QUERY_DP2), prefill_ranks=4)
    with pytest.raises(InvalidHandoff, match="rank 3"):
        await dialect.look_up(begin(dialect, make_ctx(prefill_rank=3)))


async def test_mooncake_without_rank_reads_rank_0() -> None:
    dialect = make_dialect(MooncakeDialect, lookup=QueryLookup(QUERY_DP2))
    ctx = await dialect.look_up(begin(dialect, make_ctx()))
    assert ctx.state.engine_id == "eng_dp0"


# -- TensorRT-LLM ----------------------------------------------------------------------------


def test_trtllm_ctx_dp_rank_reaches_the_decode_verbatim() -> None:
    dialect = make_dialect(TRTLLMDialect)
    ctx = begin(dialect, make_ctx())
    params = {"request_type": "context_only", "ctx_request_id": 7, "ctx_dp_rank": 3,
              "ctx_info_endpoint": "tcp://10.0.0.7:5000"}
    response = {"choices": [{"text": "a", "finish_reason": "length",
                             "disaggregated_params": params}], "prompt_token_ids": [1, 2]}
    fields = dialect.handoff(response, ctx)
    assert fields["disaggregated_params"] == {**params, "request_type": "generation_only"}
