"""Proves the Neuron NIXL dialect (label ``nixl``, docs/driving/handoffs.md#neuron-nixl),
completions and
chat.

Prefill gets nothing; decode gets ``disagg_prefill_resp``: the entire prefill response,
always, with no top-level kv_transfer_params and no remote_host rewrite.
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
from sidecar.dialects.vllm_neuron import NeuronNixlDialect
from sidecar.errors import InvalidHandoff
from sidecar.protocol.context import Route

AGENT = make_dialect(NeuronNixlDialect)
HANDLER = AGENT

RESPONSE: dict[str, Any] = {
    "id": "cmpl-n1",
    "object": "text_completion",
    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
    "kv_transfer_params": {"remote_host": "localhost", "remote_block_ids": [1]},
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}


def test_flags() -> None:
    assert AGENT.connector == "nixl"
    assert AGENT.legs is Legs.SEQUENTIAL
    assert AGENT.looks_up is False
    assert begin(AGENT, make_ctx(), make_ids()) == make_ctx()


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_golden(route: Route) -> None:
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    ctx = make_ctx(route, host="10.0.0.3")
    assert AGENT.prefill_fields(ctx) == {}
    prefill = AGENT.prefill_body(client, ctx)
    assert "kv_transfer_params" not in prefill
    response = copy.deepcopy(RESPONSE)
    decode = HANDLER.decode_body(client, AGENT.handoff(response, ctx))
    assert decode == {**client, "disagg_prefill_resp": RESPONSE}
    assert "kv_transfer_params" not in decode
    # No rewrite inside the wrapped response.
    assert decode["disagg_prefill_resp"]["kv_transfer_params"]["remote_host"] == "localhost"
    assert response == RESPONSE


def test_always_added_even_for_a_minimal_response() -> None:
    assert AGENT.handoff({}, make_ctx()) == {"disagg_prefill_resp": {}}


def test_missing_response_is_invalid() -> None:
    with pytest.raises(InvalidHandoff):
        AGENT.handoff(None, make_ctx())
