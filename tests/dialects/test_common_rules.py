"""Proves the rules common to every prefill leg (docs/driving/handoffs.md#common-rules) for every
dialect.

For vLLM (each KV connector), SGLang, TensorRT-LLM and the default dialect, on completions and
chat: the prefill body caps tokens at one, drops lower token bounds, is not streamed and has
no stream_options; max_completion_tokens is capped only when sent (deleted for TRT-LLM);
everything else passes unchanged; the decode body is the original client body plus the
hand-off (omitted fields stay omitted); and no input is ever mutated.
Does not prove engine-specific fields (see the per-engine modules).
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
)

from sidecar.dialects import Dialect, Legs, dialect_class
from sidecar.dialects.vllm_mooncake import MooncakeState
from sidecar.protocol.context import HandoffContext, Route

COMBOS = [
    ("vllm", "shfs"),
    ("vllm", "nixl"),
    ("vllm", "mooncake"),
    ("sglang", None),
    ("trtllm", None),
    ("default", None),
]

ENGINE_KEYS = {
    "kv_transfer_params",
    "disaggregated_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "rid",
    "disagg_prefill_resp",
}

#: A prefill response every handler accepts.
PREFILL_RESPONSE: dict[str, Any] = {
    "id": "cmpl-1",
    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
    },
    "prompt_token_ids": [1, 2, 3],
}


def _setup(
    engine: str, connector: str | None, route: Route
) -> tuple[Dialect, HandoffContext]:
    handler = make_dialect(dialect_class(engine, connector))
    ctx = begin(handler, make_ctx(route))
    if isinstance(ctx.state, MooncakeState):  # the engine id the lookup would bring
        ctx = ctx.with_state(MooncakeState(ctx.state.transfer_id, "engine-p"))
    return handler, ctx


def _body(route: Route) -> dict[str, Any]:
    return completions_body() if route is Route.COMPLETIONS else chat_body()


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
@pytest.mark.parametrize(("engine", "connector"), COMBOS)
def test_prefill_leg_common_rules(engine: str, connector: str | None, route: Route) -> None:
    handler, ctx = _setup(engine, connector, route)
    client = _body(route)
    prefill = handler.prefill_body(client, ctx)
    assert prefill["max_tokens"] == 1
    assert prefill["stream"] is False
    for dropped in ("min_tokens", "min_completion_tokens", "stream_options"):
        assert dropped not in prefill
    if route is Route.CHAT:
        if engine == "trtllm":
            assert "max_completion_tokens" not in prefill
        else:
            assert prefill["max_completion_tokens"] == 1
    else:
        assert "max_completion_tokens" not in prefill  # not sent, not invented
    untouched = {
        k: v
        for k, v in client.items()
        if k
        not in {
            "max_tokens",
            "max_completion_tokens",
            "min_tokens",
            "min_completion_tokens",
            "stream",
            "stream_options",
        }
    }
    for key, value in untouched.items():
        assert prefill[key] == value
        assert prefill[key] is value  # nested values are the client's own objects
    assert set(prefill) - set(client) - {"max_tokens"} <= ENGINE_KEYS


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
@pytest.mark.parametrize(("engine", "connector"), COMBOS)
def test_decode_leg_is_the_original_body_plus_handoff(
    engine: str, connector: str | None, route: Route
) -> None:
    handler, ctx = _setup(engine, connector, route)
    client = _body(route)
    client.pop("max_tokens", None)  # omitted by the client: must stay omitted on decode
    response = None if handler.legs is Legs.CONCURRENT else PREFILL_RESPONSE
    handoff = handler.handoff(response, ctx)
    decode = handler.decode_body(client, handoff)
    for key, value in client.items():
        if key not in handoff:
            assert decode[key] == value
    assert "max_tokens" not in decode
    assert decode["stream"] is True
    assert decode["stream_options"] == {"include_usage": True}
    assert {k: decode[k] for k in handoff} == handoff


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
@pytest.mark.parametrize(("engine", "connector"), COMBOS)
def test_inputs_are_never_mutated(engine: str, connector: str | None, route: Route) -> None:
    handler, ctx = _setup(engine, connector, route)
    client = _body(route)
    response = copy.deepcopy(PREFILL_RESPONSE)
    client_before = copy.deepcopy(client)
    response_before = copy.deepcopy(response)
    prefill = handler.prefill_body(client, ctx)
    handoff = handler.handoff(None if handler.legs is Legs.CONCURRENT else response, ctx)
    decode = handler.decode_body(client, handoff)
    assert client == client_before
    assert response == response_before
    # Hand-off objects we built are copies: editing them cannot reach back into the
    # prefill response (client values are shared on purpose and never edited).
    for built in (prefill, decode):
        for key in ENGINE_KEYS - {"disagg_prefill_resp"}:
            if isinstance(built.get(key), dict):
                built[key].clear()
    assert client == client_before
    assert response == response_before
