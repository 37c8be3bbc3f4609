"""Proves what the vLLM dialects share and how a connector label picks one (both routes).

Every connector dialect is engine ``vllm`` with its tokenizer endpoint and the
``kv_transfer_params`` key (the inline one too); the label resolves to its connector's dialect
with its own leg order, a missing one to the default connector. The connectors' own wire
formats are proven in the ``test_vllm_*`` modules.
"""

from __future__ import annotations

import pytest
from protocol_builders import (
    OPENAI_ROUTE_LIST,
    begin,
    chat_body,
    completions_body,
    make_ctx,
    make_dialect,
    nixl_prefill_skeleton,
)

from sidecar.dialects import DEFAULT_CONNECTOR, DIALECTS, InlineDialect, Legs, dialect_class
from sidecar.protocol.context import Route


@pytest.mark.parametrize(("connector", "legs"), [("shfs", Legs.SEQUENTIAL),
                                                 ("nixl", Legs.SEQUENTIAL),
                                                 ("mooncake", Legs.CONCURRENT)])
def test_each_connector_has_its_dialect(connector: str, legs: Legs) -> None:
    cls = dialect_class("vllm", connector)
    assert (cls.engine, cls.connector, cls.legs) == ("vllm", connector, legs)
    assert cls.tokenize is not None and cls.tokenize.path == "/tokenize" and cls.tokenize.chat


def test_connectors_and_the_default() -> None:
    assert DIALECTS.connectors("vllm") == ["mooncake", "nixl", "nixl-push", "shfs"]
    assert dialect_class("vllm", None) is dialect_class("vllm", DEFAULT_CONNECTOR)
    assert InlineDialect.engine == "vllm" and InlineDialect.connector == "inline"
    assert "kv_transfer_params" in InlineDialect.handoff_keys


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_golden_nixl_pull_through_the_label(route: Route) -> None:
    bound = make_dialect(dialect_class("vllm", "shfs"))
    ctx = begin(bound, make_ctx(route, host="10.0.0.9"))
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    prefill = bound.prefill_body(client, ctx)
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
    decode = bound.decode_body(client, bound.handoff({"kv_transfer_params": params}, ctx))
    assert decode == {**client, "kv_transfer_params": {**params, "remote_host": "10.0.0.9"}}
