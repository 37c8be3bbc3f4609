"""Proves the HTTP front door's PD flows end to end, over real sockets, for every engine and
connector x completions/chat x streamed/JSON: what each stub engine received on each leg,
that the decode engine used the prefill's KV (the stubs' verdict), and what the client got;
requests without a prefill target pass through to the local engine unchanged (query strings,
bodies, chunked uploads streamed as chunked).

Does not prove the real engines accept these bodies (tests/real_vllm does, for vLLM).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pd_builders import PAIRS, client_body, json_text, pd_pair, sse_events, streamed_text
from protocol_builders import OPENAI_ROUTE_LIST, nixl_prefill_skeleton

from sidecar.protocol.context import Route
from sidecar.tools.stubs.textgen import is_remote_text


def _check_prefill_leg(engine: str, connector: str, seen: dict[str, Any], pair: Any) -> None:
    assert seen["max_tokens"] == 1
    assert seen["stream"] is False
    assert "stream_options" not in seen
    if engine == "vllm" and connector == "shfs":
        assert seen["kv_transfer_params"] == nixl_prefill_skeleton()
    elif engine == "vllm" and connector == "nixl":
        assert "kv_transfer_params" not in seen
    elif engine == "vllm" and connector == "nixl-push":
        assert seen["kv_transfer_params"] == {"do_remote_decode": True,
                                              "do_remote_prefill": False}
    elif engine == "vllm" and connector == "mooncake":
        params = seen["kv_transfer_params"]
        assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
        assert params["transfer_id"].startswith("xfer-")
    elif engine == "sglang":
        assert seen["bootstrap_host"] == "127.0.0.1"
        assert seen["bootstrap_port"] == pair.prefill.bootstrap_port
        assert isinstance(seen["bootstrap_room"], int) and seen["bootstrap_room"] >= 0
    elif engine == "trtllm":
        params = seen["disaggregated_params"]
        assert params["request_type"] == "context_only"
        assert params["disagg_request_id"] >= 1 << 42
        assert "max_completion_tokens" not in seen


def _check_decode_leg(
    engine: str, connector: str, route: Route, prefill: dict[str, Any],
    decode: dict[str, Any], client: dict[str, Any], pair: Any,
) -> None:
    assert decode["stream"] == client["stream"]
    assert decode["max_tokens"] == client["max_tokens"]
    if engine == "vllm" and connector == "shfs":
        params = decode["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert params["remote_host"] == "127.0.0.1"  # rewritten from the engine's "localhost"
        assert params["remote_port"] == pair.prefill.port
    elif engine == "vllm" and connector == "nixl":
        assert isinstance(decode["disagg_prefill_resp"], dict)
        assert "choices" in decode["disagg_prefill_resp"]
        assert "kv_transfer_params" not in decode
    elif engine == "vllm" and connector == "nixl-push":
        params = decode["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == pair.prefill.engine_id
        assert params["remote_host"] == "127.0.0.1"  # the target's, not the engine's "localhost"
        assert params["remote_port"] == pair.prefill.port
        assert set(params) == {"do_remote_prefill", "do_remote_decode", "remote_engine_id",
                               "remote_host", "remote_port", "tp_size", "pp_size", "dcp_size",
                               "remote_request_id"}
    elif engine == "vllm" and connector == "mooncake":
        params = decode["kv_transfer_params"]
        assert params == {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": prefill["kv_transfer_params"]["transfer_id"],
            "remote_bootstrap_addr": f"http://127.0.0.1:{pair.prefill.bootstrap_port}",
            "remote_engine_id": pair.prefill.engine_id,
        }
    elif engine == "sglang":
        for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid"):
            assert decode[key] == prefill[key]
    elif engine == "trtllm":
        params = decode["disaggregated_params"]
        assert params["request_type"] == "generation_only"
        assert params["disagg_request_id"] == prefill["disaggregated_params"]["disagg_request_id"]
        token_ids = decode["prompt"] if route is Route.COMPLETIONS else decode["prompt_token_ids"]
        assert isinstance(token_ids, list) and all(isinstance(t, int) for t in token_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST, ids=["completions", "chat"])
@pytest.mark.parametrize(("engine", "connector"), PAIRS, ids=[f"{e}-{c}" for e, c in PAIRS])
async def test_pd_flow(engine: str, connector: str, route: Route, stream: bool) -> None:
    async with pd_pair(engine, connector) as pair:
        client = client_body(route, stream=stream)
        status, headers, text = await pair.send(route, body=client,
                                                headers={"X-Request-Id": "req-abc.1"})
        assert status == 200, text
        assert headers["X-Request-Id"] == "req-abc.1"

        prefill_seen = await pair.prefill.recorder.next_request(route.value)
        decode_seen = await pair.decode.recorder.next_request(route.value)
        assert prefill_seen.headers.get("X-Request-Id") == "req-abc.1"
        assert decode_seen.headers.get("X-Request-Id") == "req-abc.1"
        assert "x-prefiller-host-port" not in {k.lower() for k in prefill_seen.headers}
        assert "x-prefiller-host-port" not in {k.lower() for k in decode_seen.headers}
        _check_prefill_leg(engine, connector, prefill_seen.json, pair)
        _check_decode_leg(engine, connector, route, prefill_seen.json, decode_seen.json,
                          client, pair)

        decision = await pair.decode.recorder.next_decision()
        assert (decision.outcome, decision.reason) == ("remote", "ok")
        if stream:
            assert headers["Content-Type"].startswith("text/event-stream")
            assert sse_events(text)[-1] == "[DONE]"
            answer = streamed_text(text)
        else:
            json.loads(text)
            answer = json_text(text)
        assert answer and is_remote_text(answer)

        outcome = await pair.sidecar.metric(
            "disagg_requests_total", front_door="http", route=route.value, outcome="ok"
        )
        assert outcome == 1
        assert await pair.sidecar.metric("disagg_inflight_requests", front_door="http") == 0


async def test_without_target_the_local_engine_serves_the_request_whole() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        client = client_body(Route.COMPLETIONS, stream=False)
        status, _, text = await pair.send(body=client, with_target=False)
        assert status == 200, text
        seen = await pair.decode.recorder.next_request("/v1/completions")
        assert seen.json == client
        assert not [r for r in pair.prefill.recorder.requests if r.path.startswith('/v1/')]


async def test_other_paths_are_proxied_unchanged() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.get(pair.sidecar.url + "/v1/models?x=1") as response:
                assert response.status == 200
                models = await response.json()
        assert models["data"]
        seen = await pair.decode.recorder.next_request("/v1/models")
        assert seen.query == {"x": "1"}


async def test_passthrough_streams_a_chunked_upload_to_the_engine() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        import aiohttp

        client = client_body(Route.COMPLETIONS, stream=False)
        raw = json.dumps(client).encode()

        async def upload() -> AsyncIterator[bytes]:  # no length: sent chunked
            for start in range(0, len(raw), 7):
                yield raw[start : start + 7]

        async with aiohttp.ClientSession() as session:
            async with session.post(pair.sidecar.url + "/v1/completions", data=upload(),
                                    headers={"Content-Type": "application/json"}) as response:
                assert response.status == 200, await response.text()
                await response.read()
        seen = await pair.decode.recorder.next_request("/v1/completions")
        assert seen.body == raw
        assert {k.lower(): v for k, v in seen.headers.items()}["transfer-encoding"] == "chunked"
