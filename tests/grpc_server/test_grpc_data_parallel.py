"""Proves data-parallel ranks through the gRPC front door (docs/operating/data-parallel.md):
Prefill on a prefill-role sidecar whose engine has P ranks, Decode on a decode-role sidecar
whose engine has D, in front of stub engines that honour and record ranks:

- every engine and connector: each leg carries its rank where the engine reads it (the
  prefill sidecar chooses among its own engine's P ranks, the decode sidecar among its D),
  every rank is used, what the decode needs of the prefill's rank travels in the hand-off
  (Mooncake: that rank's engine id; SGLang: ``disagg_prefill_dp_rank``, the room on the
  rank), and the tokens are exactly the ones a valid hand-off gives;
- a rank the router names in the call's ``x-data-parallel-rank`` metadata is honoured on
  that call's leg; out of range it is refused (INVALID_ARGUMENT) before any engine call.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_builders import (
    PAIR_IDS,
    PAIRS,
    PROMPT_IDS,
    decode_tokens,
    expected_tokens,
    grpc_pd,
    prefill_blocks,
)

from sidecar.grpc_gen import disagg_pb2
from sidecar.tools.route import route
from sidecar.tools.stubs.recorder import RecordedRequest

COMPLETIONS = "/v1/completions"
RANK = "x-data-parallel-rank"
SIZES = [(2, 1), (1, 2), (4, 2), (2, 4)]


def leg_rank(engine: str, leg: RecordedRequest) -> int | None:
    if engine == "vllm":
        value = leg.headers.get(RANK)
        return None if value is None else int(value)
    rank = leg.json.get("routed_dp_rank")
    assert rank is None or isinstance(rank, int)
    return rank


@pytest.mark.parametrize(("engine", "connector"), PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize(("prefill_dp", "decode_dp"), SIZES)
async def test_each_rpc_leg_carries_its_rank(engine: str, connector: str, prefill_dp: int,
                                             decode_dp: int) -> None:
    count = 2 * max(prefill_dp, decode_dp)
    async with grpc_pd(engine, connector,
                       prefill_stub={"data_parallel_size": prefill_dp},
                       decode_stub={"data_parallel_size": decode_dp},
                       prefill_sidecar={"data_parallel_size": prefill_dp},
                       decode_sidecar={"data_parallel_size": decode_dp}) as pd:
        for _ in range(count):
            result = await route(pd.prefill.address, pd.decode.address, PROMPT_IDS, 6)
            assert result.token_ids == expected_tokens(PROMPT_IDS, 6)
        prefills = pd.prefill_stub.recorder.on_path(COMPLETIONS)
        decodes = pd.decode_stub.recorder.on_path(COMPLETIONS)
        assert [(d.outcome, d.reason) for d in pd.decode_stub.recorder.decisions] == [
            ("remote", "ok")] * count
        prefill_ranks = [leg_rank(engine, leg) for leg in prefills]
        decode_ranks = [leg_rank(engine, leg) for leg in decodes]
        if engine == "trtllm":
            assert prefill_ranks == decode_ranks == [None] * count
            return
        expected_prefill = [None] if prefill_dp == 1 else list(range(prefill_dp))
        expected_decode = [None] if decode_dp == 1 else list(range(decode_dp))
        assert sorted(set(prefill_ranks), key=str) == sorted(expected_prefill, key=str)
        assert sorted(set(decode_ranks), key=str) == sorted(expected_decode, key=str)
        if engine == "sglang":
            for prefill, decode, rank in zip(prefills, decodes, prefill_ranks, strict=True):
                assert decode.json.get("disagg_prefill_dp_rank") == rank
                if rank is not None:
                    assert prefill.json["bootstrap_room"] % prefill_dp == rank


@pytest.mark.parametrize(("engine", "connector"), [("vllm", "mooncake"), ("sglang", "shfs")])
async def test_named_ranks_in_metadata_are_honoured(engine: str, connector: str) -> None:
    async with grpc_pd(engine, connector,
                       prefill_stub={"data_parallel_size": 4},
                       decode_stub={"data_parallel_size": 2},
                       prefill_sidecar={"data_parallel_size": 4},
                       decode_sidecar={"data_parallel_size": 2}) as pd:
        for _ in range(2):
            blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS,
                                          metadata=((RANK, "2"),))
            request = disagg_pb2.DecodeRequest(request_id="req-1", token_ids=PROMPT_IDS,
                                               max_new_tokens=6, kv_blocks=blocks)
            messages = await decode_tokens(pd.decode.address, request, metadata=((RANK, "1"),))
            assert [m.token_id for m in messages if not m.done] == expected_tokens(PROMPT_IDS, 6)
        prefills = pd.prefill_stub.recorder.on_path(COMPLETIONS)
        decodes = pd.decode_stub.recorder.on_path(COMPLETIONS)
        assert [leg_rank(engine, leg) for leg in prefills] == [2, 2]
        assert [leg_rank(engine, leg) for leg in decodes] == [1, 1]
        assert pd.prefill_stub.ranks.served[(COMPLETIONS, 2)] == 2


async def test_an_out_of_range_metadata_rank_is_refused() -> None:
    async with grpc_pd("vllm", "shfs", prefill_stub={"data_parallel_size": 2},
                       prefill_sidecar={"data_parallel_size": 2}) as pd:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefill_blocks(pd.prefill.address, PROMPT_IDS, metadata=((RANK, "2"),))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "out of range" in (info.value.details() or "")
        assert pd.prefill_stub.recorder.on_path(COMPLETIONS) == []
