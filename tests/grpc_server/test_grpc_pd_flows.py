"""Proves the gRPC front door's native hand-off end to end: Prefill on a prefill-role sidecar,
Decode on a decode-role sidecar, over real gRPC sockets, in front of stub engines for vLLM
(shfs, nixl, mooncake, nixl-push), SGLang and TensorRT-LLM.

For each pair: the tokens streamed back are exactly those the decode stub generated from a
valid hand-off (the stubs' REMOTE tokens), the finish reason is ``length``, each stub saw the
body its engine expects on each leg, and the decode stub judged the hand-off usable. For the
concurrent flows (SGLang, Mooncake) the background prefill ends, releasing its room and its
admission slot.

Does not prove the real engines accept these bodies (tests/real_vllm does, for vLLM).
"""

from __future__ import annotations

from typing import Any

import pytest
from grpc_builders import (
    PAIR_IDS,
    PAIRS,
    PROMPT_IDS,
    GrpcPD,
    expected_tokens,
    grpc_pd,
    prefill_blocks,
    rooms_in_flight,
)

from sidecar.grpc_server.native import decode_handoff
from sidecar.tools.route import route

MAX_NEW_TOKENS = 6


def _check_prefill_body(pd: GrpcPD, seen: dict[str, Any]) -> None:
    assert seen["model"] == "stub-model"
    assert seen["prompt"] == PROMPT_IDS
    assert seen["max_tokens"] == 1
    assert seen["stream"] is False
    engine, connector = pd.engine, pd.connector
    if engine == "vllm":
        assert seen["return_token_ids"] is True
        if connector == "shfs":
            assert seen["kv_transfer_params"]["do_remote_decode"] is True
        elif connector == "nixl":
            assert "kv_transfer_params" not in seen
        elif connector == "nixl-push":
            assert seen["kv_transfer_params"] == {"do_remote_decode": True,
                                                  "do_remote_prefill": False}
        else:
            assert seen["kv_transfer_params"]["transfer_id"].startswith("xfer-")
    elif engine == "sglang":
        assert seen["return_token_ids"] is True
        assert seen["bootstrap_host"] == "127.0.0.1"
        assert seen["bootstrap_port"] == pd.prefill_stub.bootstrap_port
        assert 0 <= seen["bootstrap_room"] < 2**31  # int32 rooms on the gRPC path
    else:
        assert "return_token_ids" not in seen  # TRT-LLM forbids unknown keys
        assert seen["detokenize"] is False
        assert seen["disaggregated_params"]["request_type"] == "context_only"


def _check_decode_body(pd: GrpcPD, prefill: dict[str, Any], seen: dict[str, Any]) -> None:
    assert seen["model"] == "stub-model"
    assert seen["prompt"] == PROMPT_IDS
    assert seen["max_tokens"] == MAX_NEW_TOKENS
    assert seen["stream"] is True
    engine, connector = pd.engine, pd.connector
    if engine == "vllm":
        assert seen["return_token_ids"] is True
        if connector == "shfs":
            params = seen["kv_transfer_params"]
            assert params["do_remote_prefill"] is True
            assert params["remote_host"] == "127.0.0.1"
            assert params["remote_port"] == pd.prefill_stub.port
        elif connector == "nixl":
            assert isinstance(seen["disagg_prefill_resp"], dict)
        elif connector == "nixl-push":
            params = seen["kv_transfer_params"]
            assert params["remote_engine_id"] == pd.prefill_stub.engine_id
            assert params["remote_host"] == "127.0.0.1"
            assert params["remote_port"] == pd.prefill_stub.port
        else:
            params = seen["kv_transfer_params"]
            assert params["transfer_id"] == prefill["kv_transfer_params"]["transfer_id"]
            assert params["remote_bootstrap_addr"] == (
                f"http://127.0.0.1:{pd.prefill_stub.bootstrap_port}"
            )
            assert params["remote_engine_id"] == pd.prefill_stub.engine_id
    elif engine == "sglang":
        for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            assert seen[key] == prefill[key]
    else:
        assert "return_token_ids" not in seen
        assert seen["detokenize"] is False
        params = seen["disaggregated_params"]
        assert params["request_type"] == "generation_only"
        assert params["disagg_request_id"] == prefill["disaggregated_params"]["disagg_request_id"]


@pytest.mark.parametrize(("engine", "connector"), PAIRS, ids=PAIR_IDS)
async def test_prefill_then_decode_gives_the_decode_engines_tokens(
    engine: str, connector: str
) -> None:
    async with grpc_pd(engine, connector) as pd:
        result = await route(pd.prefill.address, pd.decode.address, PROMPT_IDS, MAX_NEW_TOKENS,
                             request_id="grpc-req.1")

        assert result.token_ids == expected_tokens(PROMPT_IDS, MAX_NEW_TOKENS)
        assert result.finish_reason == "length"
        assert result.blocks >= 1

        prefill_seen = await pd.prefill_stub.recorder.next_request("/v1/completions")
        decode_seen = await pd.decode_stub.recorder.next_request("/v1/completions")
        assert prefill_seen.headers.get("X-Request-Id") == "grpc-req.1"
        assert decode_seen.headers.get("X-Request-Id") == "grpc-req.1"
        _check_prefill_body(pd, prefill_seen.json)
        _check_decode_body(pd, prefill_seen.json, decode_seen.json)
        decision = await pd.decode_stub.recorder.next_decision()
        assert (decision.outcome, decision.reason) == ("remote", "ok")

        # Concurrent flows: the watched engine prefill ends and gives back what it held
        # (its admission slot, so draining waits for it, and its bootstrap room).
        for sidecar in (pd.prefill, pd.decode):
            assert await sidecar.runtime.admission.wait_idle(10.0)
        assert rooms_in_flight(pd.prefill.runtime) == 0

        assert pd.prefill.metric("disagg_requests_total", front_door="grpc",
                                 route="/disagg.PrefillWorker/Prefill", outcome="ok") == 1
        assert pd.decode.metric("disagg_requests_total", front_door="grpc",
                                route="/disagg.DecodeWorker/Decode", outcome="ok") == 1


@pytest.mark.parametrize(("engine", "connector"), PAIRS, ids=PAIR_IDS)
async def test_handoff_names_engine_connector_and_prefill_host(engine: str, connector: str) -> None:
    async with grpc_pd(engine, connector) as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS, request_id="r-7")
        handoff = decode_handoff(blocks)
        assert handoff.engine == engine
        assert handoff.kv_connector == (connector if engine == "vllm" else None)
        assert (handoff.prefill_host, handoff.prefill_port) == ("127.0.0.1", pd.prefill_stub.port)
        assert handoff.request_id == "r-7"
        assert all(block.layer_idx == -1 and block.request_id == "r-7" for block in blocks)
