"""Proves data-parallel ranks through the HTTP door, per dialect, on stub engines that honour
and record ranks as the engines do (docs/operating/data-parallel.md):

- every engine and connector, with 1, 2 or 4 ranks on either side: each leg carries its rank
  in the engine's own field (vLLM: ``X-data-parallel-rank`` on both legs; SGLang:
  ``routed_dp_rank`` on both, ``disagg_prefill_dp_rank`` on the decode, the room on the
  prefill rank; TensorRT-LLM: nothing, its engine's ``ctx_dp_rank`` rides along); legs that
  never overlap still use every rank; every decode used its prefill's KV (the rank's engine
  id, room or state matched); with one rank no leg carries a rank at all;
- the router's ``x-data-parallel-rank`` is honoured on the prefill leg and never forwarded;
  out of range or malformed it is refused (400) before any engine is called;
- a rank whose prefill legs fail is skipped for the cool-down; ``disagg_rank_legs_total``
  counts legs per rank (labels only below the configured size);
- fan-out sub-requests each get ranks of their own.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from pd_builders import PAIRS, PDPair, client_body, pd_pair

from sidecar.protocol.context import Route
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.recorder import RecordedRequest
from sidecar.tools.stubs.textgen import is_remote_text

#: (prefill ranks, decode ranks): 1, 2 and 4 on either side.
SIZES = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 4), (4, 2)]
COMPLETIONS = Route.COMPLETIONS.value
RANK_HEADER = "x-data-parallel-rank"


@asynccontextmanager
async def dp_pair(engine: str, connector: str, prefill_dp: int, decode_dp: int,
                  **sidecar: Any) -> AsyncIterator[PDPair]:
    async with pd_pair(engine, connector,
                       prefill_overrides={"data_parallel_size": prefill_dp},
                       decode_overrides={"data_parallel_size": decode_dp},
                       data_parallel_size=decode_dp, prefill_data_parallel_size=prefill_dp,
                       **sidecar) as pair:
        yield pair


def leg_rank(engine: str, leg: RecordedRequest) -> int | None:
    """The rank a recorded leg names in its engine's own field (None: none)."""
    if engine == "vllm":
        values = leg.headers.getall(RANK_HEADER, [])  # type: ignore[attr-defined]
        assert len(values) <= 1
        return int(values[0]) if values else None
    assert RANK_HEADER not in leg.headers
    rank = leg.json.get("routed_dp_rank") if isinstance(leg.json, dict) else None
    assert rank is None or isinstance(rank, int)
    return rank


def answer_text(text: str) -> str:
    choice = json.loads(text)["choices"][0]
    return str(choice.get("text") or (choice.get("message") or {}).get("content") or "")


@pytest.mark.parametrize(("engine", "connector"), PAIRS)
@pytest.mark.parametrize(("prefill_dp", "decode_dp"), SIZES)
async def test_each_leg_carries_its_rank(engine: str, connector: str, prefill_dp: int,
                                         decode_dp: int) -> None:
    count = 2 * max(prefill_dp, decode_dp)
    async with dp_pair(engine, connector, prefill_dp, decode_dp) as pair:
        for _ in range(count):
            status, _, text = await pair.send()
            assert status == 200, text
            assert is_remote_text(answer_text(text)), text
        prefills = pair.prefill.recorder.on_path(COMPLETIONS)
        decodes = pair.decode.recorder.on_path(COMPLETIONS)
        assert len(prefills) == len(decodes) == count
        assert [(d.outcome, d.reason) for d in pair.decode.recorder.decisions] == [
            ("remote", "ok")] * count
        ranked = engine != "trtllm"
        prefill_ranks = [leg_rank(engine, leg) for leg in prefills]
        decode_ranks = [leg_rank(engine, leg) for leg in decodes]
        if prefill_dp == 1 or not ranked:
            assert prefill_ranks == [None] * count
        else:
            assert sorted(set(prefill_ranks)) == list(range(prefill_dp))  # type: ignore[type-var]
        if decode_dp == 1 or not ranked:
            assert decode_ranks == [None] * count
        else:
            assert sorted(set(decode_ranks)) == list(range(decode_dp))  # type: ignore[type-var]
        # The engines placed every leg where it said (the stubs count per rank).
        served = pair.prefill.ranks.served
        assert sum(served[(COMPLETIONS, r)] for r in range(prefill_dp)) == count
        if prefill_dp > 1:
            assert all(served[(COMPLETIONS, r)] > 0 for r in range(prefill_dp))
        if engine == "sglang":
            for prefill, decode, rank in zip(prefills, decodes, prefill_ranks, strict=True):
                room = prefill.json["bootstrap_room"]
                assert decode.json["bootstrap_room"] == room
                assert decode.json.get("disagg_prefill_dp_rank") == rank
                if rank is not None:
                    assert room % prefill_dp == rank
        if engine == "trtllm" and prefill_dp > 1:
            ctx_ranks = {d.json["disaggregated_params"]["ctx_dp_rank"] for d in decodes}
            assert ctx_ranks == set(range(prefill_dp))  # the engine's own, carried verbatim


@pytest.mark.parametrize(("engine", "connector"), PAIRS)
async def test_one_rank_names_no_rank_anywhere(engine: str, connector: str) -> None:
    async with dp_pair(engine, connector, 1, 1) as pair:
        status, _, text = await pair.send(stream=True)
        assert status == 200, text
        for leg in (*pair.prefill.recorder.on_path(COMPLETIONS),
                    *pair.decode.recorder.on_path(COMPLETIONS)):
            assert RANK_HEADER not in leg.headers
            assert not {"routed_dp_rank", "disagg_prefill_dp_rank"} & set(leg.json)
        assert await pair.sidecar.metric("disagg_rank_legs_total") == 0


@pytest.mark.parametrize(("engine", "connector"), [p for p in PAIRS if p[0] != "trtllm"])
async def test_the_routers_rank_is_honoured_and_not_forwarded(engine: str,
                                                               connector: str) -> None:
    async with dp_pair(engine, connector, 4, 2) as pair:
        for _ in range(4):
            status, _, text = await pair.send(headers={RANK_HEADER: "3"})
            assert status == 200, text
        prefills = pair.prefill.recorder.on_path(COMPLETIONS)
        decodes = pair.decode.recorder.on_path(COMPLETIONS)
        assert [leg_rank(engine, leg) for leg in prefills] == [3] * 4
        # The decode's rank is the sidecar's own choice on its engine, not the router's.
        assert {leg_rank(engine, leg) for leg in decodes} == {0, 1}
        assert pair.prefill.ranks.served[(COMPLETIONS, 3)] == 4


@pytest.mark.parametrize("value", ["4", "-1", "01", "x", "1,2", "+1", "1 2"])
@pytest.mark.parametrize(("engine", "connector"), [("vllm", "shfs"), ("sglang", "shfs")])
async def test_a_bad_router_rank_is_refused(engine: str, connector: str, value: str) -> None:
    async with dp_pair(engine, connector, 4, 2) as pair:
        status, _, text = await pair.send(headers={RANK_HEADER: value})
        assert status == 400, text
        assert json.loads(text)["error"]["code"] == "invalid_request"
        assert pair.prefill.recorder.on_path(COMPLETIONS) == []
        assert pair.decode.recorder.on_path(COMPLETIONS) == []


async def test_one_rank_accepts_only_rank_0_and_sends_nothing() -> None:
    async with dp_pair("vllm", "shfs", 1, 1) as pair:
        status, _, text = await pair.send(headers={RANK_HEADER: "0"})
        assert status == 200, text
        status, _, text = await pair.send(headers={RANK_HEADER: "1"})
        assert status == 400, text
        for leg in pair.prefill.recorder.on_path(COMPLETIONS):
            assert RANK_HEADER not in leg.headers


async def test_a_failing_rank_cools_down_and_is_counted() -> None:
    fault = Fault(kind=FaultKind.STATUS, status=500, path=COMPLETIONS, times=1)
    async with dp_pair("vllm", "shfs", 2, 1, prefill_cooldown_s=600) as pair:
        pair.prefill.faults.set(fault)
        status, _, text = await pair.send()
        assert status == 502, text  # rank 0's leg failed: the prefill is never retried
        for _ in range(4):
            status, _, text = await pair.send()
            assert status == 200, text
        ranks = [leg_rank("vllm", leg) for leg in pair.prefill.recorder.on_path(COMPLETIONS)]
        assert ranks == [0, 1, 1, 1, 1]  # within the cool-down rank 0 gets no leg
        metric = pair.sidecar.metric
        assert await metric("disagg_rank_legs_total", leg="prefill", rank="0",
                            outcome="failed") == 1
        assert await metric("disagg_rank_legs_total", leg="prefill", rank="1",
                            outcome="ok") == 4
        assert await metric("disagg_rank_legs_total", leg="decode") == 0  # one decode rank
        ranks_seen = {sample for sample in (await pair.sidecar.scrape()).splitlines()
                      if sample.startswith("disagg_rank_legs_total{")}
        assert all('rank="0"' in line or 'rank="1"' in line for line in ranks_seen)


async def test_fanned_out_sub_requests_get_ranks_of_their_own() -> None:
    async with dp_pair("vllm", "shfs", 2, 2) as pair:
        body = client_body(n=2, stream=True)
        status, _, text = await pair.send(body=body, stream=True)
        assert status == 200, text
        prefills = pair.prefill.recorder.on_path(COMPLETIONS)
        decodes = pair.decode.recorder.on_path(COMPLETIONS)
        assert len(prefills) == len(decodes) == 2
        # Both decodes are in flight at once: the second goes to the idle rank.
        assert {leg_rank("vllm", leg) for leg in decodes} == {0, 1}
        assert {leg_rank("vllm", leg) for leg in prefills} <= {0, 1}
