"""Proves the default dialect: common rules only, sequential, empty hand-off, both routes."""

from __future__ import annotations

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
from sidecar.dialects.default import DefaultDialect
from sidecar.protocol.context import Route

HANDLER = make_dialect(DefaultDialect)


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_golden(route: Route) -> None:
    ctx = begin(HANDLER, make_ctx(route), make_ids())
    assert ctx == make_ctx(route)
    assert HANDLER.legs is Legs.SEQUENTIAL
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    prefill = HANDLER.prefill_body(client, ctx)
    if route is Route.COMPLETIONS:
        assert prefill == {
            "model": "m",
            "prompt": "hello world",
            "max_tokens": 1,
            "stream": False,
            "temperature": 0.0,
        }
    else:
        assert prefill == {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 1,
            "max_tokens": 1,
            "stream": False,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        }
    assert HANDLER.handoff({"choices": []}, ctx) == {}
    assert HANDLER.decode_body(client, {}) == client
    assert HANDLER.answered_by_prefill({"choices": [{"finish_reason": "stop"}]}) is False
