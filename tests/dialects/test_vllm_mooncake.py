"""Proves the Mooncake dialect (docs/driving/handoffs.md#vllm-mooncake), completions and chat, and
/query
parsing.

One transfer_id per request on both legs; prefill and decode kv_transfer_params exactly as
vLLM's MooncakeConnector reads them; remote_bootstrap_addr with IPv4, DNS and bracketed
IPv6 hosts; a missing engine id is InvalidHandoff; ``engine_id_from_query`` reads both
/query answer shapes and refuses everything else. Does not contact a bootstrap server.
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
)

from sidecar.dialects import Legs
from sidecar.dialects.vllm_mooncake import MooncakeDialect, MooncakeState, engine_id_from_query
from sidecar.errors import InvalidHandoff, SidecarError
from sidecar.protocol.context import Route

AGENT = make_dialect(MooncakeDialect)


def test_flags() -> None:
    assert AGENT.connector == "mooncake"
    assert AGENT.legs is Legs.CONCURRENT
    assert AGENT.looks_up is True


def test_begin_sets_one_transfer_id() -> None:
    ctx = begin(AGENT, make_ctx(), make_ids())
    assert ctx.state == MooncakeState("xfer-fixed")


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_golden_both_legs(route: Route) -> None:
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    before = copy.deepcopy(client)
    dialect = make_dialect(MooncakeDialect, mooncake_bootstrap_port=8998)
    ctx = begin(dialect, make_ctx(route, host="10.0.0.8"), make_ids())
    ctx = ctx.with_state(MooncakeState(ctx.state.transfer_id, "0b9f-engine"))
    prefill = dialect.prefill_body(client, ctx)
    decode = dialect.decode_body(client, dialect.handoff(None, ctx))
    prefill_params = {"do_remote_decode": True, "do_remote_prefill": False,
                      "transfer_id": "xfer-fixed"}
    decode_params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": "xfer-fixed",
        "remote_bootstrap_addr": "http://10.0.0.8:8998",
        "remote_engine_id": "0b9f-engine",
    }
    if route is Route.COMPLETIONS:
        assert prefill == {
            "model": "m",
            "prompt": "hello world",
            "max_tokens": 1,
            "stream": False,
            "temperature": 0.0,
            "kv_transfer_params": prefill_params,
        }
    else:
        assert prefill == {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 1,
            "max_tokens": 1,
            "stream": False,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "kv_transfer_params": prefill_params,
        }
    assert decode == {**before, "kv_transfer_params": decode_params}
    assert list(decode["kv_transfer_params"]) == list(decode_params)
    assert client == before


@pytest.mark.parametrize(
    ("host", "port", "addr"),
    [
        ("10.0.0.8", 8998, "http://10.0.0.8:8998"),
        ("prefill-0.pods.svc", 9100, "http://prefill-0.pods.svc:9100"),
        ("fd00:10:244::8", 8998, "http://[fd00:10:244::8]:8998"),
        ("::1", 7000, "http://[::1]:7000"),
    ],
)
def test_remote_bootstrap_addr(host: str, port: int, addr: str) -> None:
    ctx = make_ctx(advertise_host=host, state=MooncakeState("xfer-1", "e"))
    AGENT = make_dialect(MooncakeDialect, mooncake_bootstrap_port=port)
    assert AGENT.handoff(None, ctx)["kv_transfer_params"]["remote_bootstrap_addr"] == addr


def test_prefill_response_is_ignored() -> None:
    ctx = make_ctx(state=MooncakeState("xfer-1", "e"))
    assert AGENT.handoff({"kv_transfer_params": {"x": 1}}, ctx) == AGENT.handoff(None, ctx)


@pytest.mark.parametrize("engine_id", [None, ""])
def test_missing_engine_id_is_invalid(engine_id: str | None) -> None:
    ctx = make_ctx(state=MooncakeState("xfer-1", engine_id))
    with pytest.raises(InvalidHandoff, match="engine id"):
        AGENT.handoff(None, ctx)


def test_missing_transfer_id_is_an_internal_error() -> None:
    with pytest.raises(SidecarError):
        AGENT.prefill_fields(make_ctx())


# /query, shape 1 (vLLM: response_model=dict[int, EngineEntry]).
BY_RANK: dict[str, Any] = {
    "0": {"engine_id": "eng-a", "worker_addr": {"0": {"0": "tcp://10.0.0.8:7001"}}},
    "1": {"engine_id": "eng-a-dp1", "worker_addr": {"0": {"0": "tcp://10.0.0.8:7002"}},
          "pp_size": 1, "tp_size": 1},
}
# /query, shape 2 (vLLM: response_model=dict[EngineId, {dp: {tp: {pp: addr}}}]).
BY_ENGINE: dict[str, Any] = {
    "eng-b": {"0": {"0": {"0": "tcp://10.0.0.9:7001"}}},
    "eng-c": {"1": {"0": {"0": "tcp://10.0.0.9:7002"}}},
}


def test_query_shape_by_rank() -> None:
    assert engine_id_from_query(BY_RANK) == "eng-a"
    assert engine_id_from_query(BY_RANK, dp_rank=1) == "eng-a-dp1"
    with pytest.raises(InvalidHandoff, match="rank 2"):
        engine_id_from_query(BY_RANK, dp_rank=2)


def test_query_shape_by_rank_with_int_keys() -> None:
    assert engine_id_from_query({0: {"engine_id": "eng-i"}}) == "eng-i"


def test_query_shape_by_engine() -> None:
    assert engine_id_from_query(BY_ENGINE) == "eng-b"
    assert engine_id_from_query(BY_ENGINE, dp_rank=1) == "eng-c"
    with pytest.raises(InvalidHandoff, match="rank 3"):
        engine_id_from_query(BY_ENGINE, dp_rank=3)


def test_query_shape_by_engine_ambiguous() -> None:
    payload = {"eng-x": {"0": {}}, "eng-y": {"0": {}}}
    with pytest.raises(InvalidHandoff, match="2 engines"):
        engine_id_from_query(payload)


@pytest.mark.parametrize(
    "payload",
    [
        None,
        [],
        "eng",
        {},
        {"0": "eng-a"},
        {"0": {"engine_id": 5}},
        {"0": {"engine_id": ""}},
        {"eng": {"worker": "tcp://x"}},
        {"0": {"engine_id": "a"}, "eng-b": {"0": {}}},
        {"status": "ok"},
    ],
)
def test_query_other_shapes_are_invalid(payload: object) -> None:
    with pytest.raises(InvalidHandoff):
        engine_id_from_query(payload)
