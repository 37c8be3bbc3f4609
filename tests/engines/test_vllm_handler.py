"""Proves the vLLM handler delegates everything to its KV agent (both routes, all agents).

Ids, prefill fields, concurrency and the hand-off are the agent's; without an agent the
handler refuses (a wiring bug, never a decode without a hand-off). The agents' own wire
formats are proven in tests/kv_agents.
"""

from __future__ import annotations

import pytest
from protocol_builders import (
    chat_body,
    completions_body,
    make_ctx,
    make_ids,
    nixl_prefill_skeleton,
)

from sidecar.engines.vllm import VLLMHandler
from sidecar.errors import SidecarError
from sidecar.kv_agents import resolve_agent
from sidecar.protocol.context import Route

HANDLER = VLLMHandler()


def test_uses_kv_agent() -> None:
    assert VLLMHandler.uses_kv_agent is True


@pytest.mark.parametrize(("connector", "concurrent"), [("shfs", False), ("nixl", False),
                                                        ("mooncake", True)])
def test_concurrency_is_the_agents(connector: str, concurrent: bool) -> None:
    assert HANDLER.bind(resolve_agent(connector)).concurrent is concurrent


@pytest.mark.parametrize("route", list(Route))
def test_golden_nixl_pull_through_handler(route: Route) -> None:
    agent = resolve_agent("shfs")
    ctx = HANDLER.bind(agent).assign_ids(make_ctx(route, host="10.0.0.9"), make_ids())
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    prefill = HANDLER.bind(agent).prefill_body(client, ctx)
    assert prefill["kv_transfer_params"] == nixl_prefill_skeleton()
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[4, 5]],
        "remote_engine_id": "eng",
        "remote_request_id": "cmpl-1-0",
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
    }
    bound = HANDLER.bind(agent)
    decode = bound.decode_body(client, bound.handoff({"kv_transfer_params": params}, ctx))
    assert decode == {**client, "kv_transfer_params": {**params, "remote_host": "10.0.0.9"}}


def test_mooncake_ids_come_from_the_agent() -> None:
    agent = resolve_agent("mooncake")
    ctx = HANDLER.bind(agent).assign_ids(make_ctx(), make_ids())
    assert ctx.mooncake_transfer_id == "xfer-fixed"
    assert ctx.sglang_room is None and ctx.trtllm_disagg_request_id is None


def test_without_agent_refuses() -> None:
    with pytest.raises(SidecarError):
        _ = HANDLER.concurrent
    with pytest.raises(SidecarError):
        HANDLER.prefill_body(completions_body(), make_ctx())
    with pytest.raises(SidecarError):
        HANDLER.handoff({}, make_ctx())
    with pytest.raises(SidecarError):
        HANDLER.assign_ids(make_ctx(), make_ids())
