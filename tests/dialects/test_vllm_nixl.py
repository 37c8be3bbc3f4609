"""Proves the NIXL pull dialect (label ``shfs``, docs/driving/handoffs.md#vllm-nixl-pull),
completions and
chat.

Prefill gets exactly the six-key skeleton; decode gets the prefill response's
kv_transfer_params verbatim (newer keys, nested block ids and key order included) except
remote_host, which becomes the advertised prefill host (IPv4 or IPv6, bare); missing or
non-object params and each missing required key are InvalidHandoff naming what is missing.
Does not prove that vLLM accepts the result (the real-vLLM suite does).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from protocol_builders import (
    OPENAI_ROUTE_LIST,
    begin,
    chat_body,
    completions_body,
    make_ctx,
    make_dialect,
    make_ids,
    nixl_prefill_skeleton,
)

from sidecar.dialects import Legs
from sidecar.dialects.vllm_nixl import REQUIRED_DECODE_KEYS, NixlPullDialect
from sidecar.errors import InvalidHandoff
from sidecar.protocol.context import Route

AGENT = make_dialect(NixlPullDialect)
HANDLER = AGENT

#: A current vLLM NixlConnector response's params, newer keys included.
PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[0, 1, 2], [7, 8]],
    "remote_engine_id": "5e3c0b2a-engine",
    "remote_request_id": "cmpl-abc-0-1f2e3d4c",
    "remote_host": "localhost",
    "remote_port": 5600,
    "tp_size": 2,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 37,
    "remote_blocks_expiry_time": 1767225600.5,
    "transfer_mode": "read",
    "remote_prefill_cached_tokens": 0,
}


def _response(params: object = PARAMS) -> dict[str, Any]:
    return {
        "id": "cmpl-abc",
        "choices": [{"index": 0, "text": " Paris", "finish_reason": "length"}],
        "kv_transfer_params": copy.deepcopy(params),
    }


def test_flags() -> None:
    assert AGENT.connector == "shfs"
    assert AGENT.legs is Legs.SEQUENTIAL
    assert AGENT.looks_up is False
    assert AGENT.engine == "vllm"
    assert begin(AGENT, make_ctx(), make_ids()) == make_ctx()


def test_golden_prefill_skeleton_exactly_six_keys() -> None:
    assert AGENT.prefill_fields(make_ctx()) == {"kv_transfer_params": nixl_prefill_skeleton()}


def test_each_prefill_gets_a_fresh_skeleton() -> None:
    first = AGENT.prefill_fields(make_ctx())
    first["kv_transfer_params"]["remote_port"] = 1
    assert AGENT.prefill_fields(make_ctx())["kv_transfer_params"]["remote_port"] is None


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_golden_prefill_body(route: Route) -> None:
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    prefill = AGENT.prefill_body(client, make_ctx(route))
    skeleton = AGENT.prefill_fields(make_ctx())["kv_transfer_params"]
    if route is Route.COMPLETIONS:
        assert prefill == {
            "model": "m",
            "prompt": "hello world",
            "max_tokens": 1,
            "stream": False,
            "temperature": 0.0,
            "kv_transfer_params": skeleton,
        }
    else:
        assert prefill == {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 1,
            "max_tokens": 1,
            "stream": False,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "kv_transfer_params": skeleton,
        }


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
@pytest.mark.parametrize("host", ["10.244.1.17", "fd00:10:244::17"])
def test_golden_decode_rewrites_only_remote_host(route: Route, host: str) -> None:
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    response = _response()
    before = copy.deepcopy(response)
    handoff = AGENT.handoff(response, make_ctx(route, host=host))
    decode = HANDLER.decode_body(client, handoff)
    expected_params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1, 2], [7, 8]],
        "remote_engine_id": "5e3c0b2a-engine",
        "remote_request_id": "cmpl-abc-0-1f2e3d4c",
        "remote_host": host,
        "remote_port": 5600,
        "tp_size": 2,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 37,
        "remote_blocks_expiry_time": 1767225600.5,
        "transfer_mode": "read",
        "remote_prefill_cached_tokens": 0,
    }
    assert decode == {**client, "kv_transfer_params": expected_params}
    assert list(decode["kv_transfer_params"]) == list(PARAMS)  # key order kept
    assert decode["kv_transfer_params"]["remote_block_ids"] is (
        response["kv_transfer_params"]["remote_block_ids"]
    )  # nested value passed through untouched
    assert response == before


def test_advertise_host_differs_from_target_host() -> None:
    ctx = make_ctx(host="prefill.svc", advertise_host="10.0.0.42")
    assert AGENT.handoff(_response(), ctx)["kv_transfer_params"]["remote_host"] == "10.0.0.42"


def test_flat_and_empty_block_ids_pass_through() -> None:
    for block_ids in ([3, 4, 5], [], [[]]):
        params = {**PARAMS, "remote_block_ids": block_ids}
        out = AGENT.handoff(_response(params), make_ctx())
        assert out["kv_transfer_params"]["remote_block_ids"] == block_ids


def test_missing_params_are_invalid() -> None:
    response = _response()
    del response["kv_transfer_params"]
    with pytest.raises(InvalidHandoff, match="no kv_transfer_params"):
        AGENT.handoff(response, make_ctx())
    with pytest.raises(InvalidHandoff, match="no kv_transfer_params"):
        AGENT.handoff(_response(None), make_ctx())
    with pytest.raises(InvalidHandoff):
        AGENT.handoff(None, make_ctx())


@pytest.mark.parametrize("bad", ["params", 3, [1, 2], True])
def test_non_object_params_are_invalid(bad: object) -> None:
    with pytest.raises(InvalidHandoff, match="expected an object"):
        AGENT.handoff(_response(bad), make_ctx())


@pytest.mark.parametrize("key", REQUIRED_DECODE_KEYS)
def test_each_missing_required_key_is_named(key: str) -> None:
    params = {k: v for k, v in PARAMS.items() if k != key}
    with pytest.raises(InvalidHandoff, match=key):
        AGENT.handoff(_response(params), make_ctx())


def test_all_missing_keys_are_listed() -> None:
    with pytest.raises(InvalidHandoff) as info:
        AGENT.handoff(_response({"tp_size": 1}), make_ctx())
    for key in REQUIRED_DECODE_KEYS:
        assert key in info.value.message


def test_tp_size_is_optional() -> None:
    params = {k: v for k, v in PARAMS.items() if k != "tp_size"}
    assert "tp_size" not in AGENT.handoff(_response(params), make_ctx())["kv_transfer_params"]
