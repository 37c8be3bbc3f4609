"""Proves the gRPC front door of ``serve --workers 2``: every worker serves Prefill and
Decode on the one gRPC port (grpcio's SO_REUSEPORT), a router's Prefill -> Decode rounds
through a prefill pool and a decode pool all succeed, and the SGLang rooms handed out on this
path stay int32, unique, and in each prefill worker's own lane.
"""

from __future__ import annotations

import grpc
from pool_builders import gather_limited, running_pool, stubs

from sidecar.dialects.sglang import INT32_ROOMS
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc

PROMPT_IDS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 107, 101, 114, 115]
#: A channel of its own per call (no subchannel shared across channels in this process), so
#: every call is a new connection and the kernel picks a worker for it.
OWN_CONNECTION = [("grpc.enable_http_proxy", 0), ("grpc.use_local_subchannel_pool", 1)]


async def _round(prefill: str, decode: str, index: int) -> list[int]:
    request_id = f"round-{index}"
    async with grpc.aio.insecure_channel(prefill, options=OWN_CONNECTION) as channel:
        blocks = [message.block async for message in
                  disagg_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                      disagg_pb2.PreFillRequest(request_id=request_id, token_ids=PROMPT_IDS,
                                                max_new_tokens=4), timeout=60)
                  if message.HasField("block")]
    async with grpc.aio.insecure_channel(decode, options=OWN_CONNECTION) as channel:
        tokens = [message async for message in
                  disagg_pb2_grpc.DecodeWorkerStub(channel).Decode(
                      disagg_pb2.DecodeRequest(request_id=request_id, kv_blocks=blocks,
                                               token_ids=PROMPT_IDS, max_new_tokens=4),
                      timeout=60)]
    assert tokens[-1].done and tokens[-1].finish_reason == "length", tokens[-1]
    return [t.token_id for t in tokens if not t.done]


async def test_rounds_through_two_pools_use_every_worker_and_int32_lanes() -> None:
    async with stubs("sglang") as (p_stub, d_stub), running_pool(
        engine="sglang", engine_url=p_stub.url, advertise_host="127.0.0.1",
        sglang_bootstrap_port=p_stub.bootstrap_port, role="prefill",
    ) as p_pool, running_pool(
        engine="sglang", engine_url=d_stub.url, role="decode",
        sglang_bootstrap_port=p_stub.bootstrap_port,
    ) as d_pool:
        prefill = f"127.0.0.1:{p_pool.ports['grpc']}"
        decode = f"127.0.0.1:{d_pool.ports['grpc']}"
        results = await gather_limited(_round(prefill, decode, i) for i in range(24))
        assert all(len(tokens) == 4 for tokens in results)
        assert len({tuple(tokens) for tokens in results}) == 1  # one prompt, one answer

        for pool in (p_pool, d_pool):
            shares = [pool.worker_metric(pool.pids[index], "disagg_requests_total",
                                         front_door="grpc", outcome="ok") for index in (0, 1)]
            assert all(n > 0 for n in shares) and sum(shares) == 24, shares
        rooms = [entry.json["bootstrap_room"]
                 for entry in p_stub.recorder.on_path("/v1/completions")]
        assert len(rooms) == 24 and len(set(rooms)) == 24
        assert all(0 <= room <= INT32_ROOMS for room in rooms)
        prefill_shares = [p_pool.worker_metric(p_pool.pids[index], "disagg_requests_total",
                                               front_door="grpc", outcome="ok")
                          for index in (0, 1)]
        assert [sum(room % 2 == lane for room in rooms) for lane in (0, 1)] == prefill_shares
        assert await p_pool.stop() == 0
        assert await d_pool.stop() == 0
