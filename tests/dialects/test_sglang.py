"""Proves the SGLang dialect's wire format (docs/driving/handoffs.md#sglang), completions and chat.

Both legs carry the same bootstrap_host/port/room, the room comes from the allocator, the
legs are concurrent, and client-supplied bootstrap values are overwritten on both legs.
Does not prove that SGLang pairs the legs (that needs a real engine).
"""

from __future__ import annotations

import copy

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
from sidecar.dialects.sglang import SGLangDialect
from sidecar.errors import SidecarError
from sidecar.protocol.context import Route

HANDLER = make_dialect(SGLangDialect)


def test_concurrent() -> None:
    assert HANDLER.legs is Legs.CONCURRENT


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_golden_both_legs_same_room(route: Route) -> None:
    ids = make_ids()
    handler = make_dialect(SGLangDialect, sglang_bootstrap_port=9001)
    ctx = begin(handler, make_ctx(route, host="10.1.2.3"), ids)
    room = ctx.state
    assert isinstance(room, int) and 0 <= room <= ids.rooms.max_room
    assert ids.rooms.in_flight() == 1
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    before = copy.deepcopy(client)

    prefill = handler.prefill_body(client, ctx)
    decode = handler.decode_body(client, handler.handoff(None, ctx))

    fields = {
        "bootstrap_host": "10.1.2.3",
        "bootstrap_port": 9001,
        "bootstrap_room": room,
        "rid": f"{ctx.request_id}-{room}",
    }
    if route is Route.COMPLETIONS:
        assert prefill == {
            "model": "m",
            "prompt": "hello world",
            "max_tokens": 1,
            "stream": False,
            "temperature": 0.0,
            **fields,
        }
        assert decode == {**before, **fields}
    else:
        assert prefill == {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 1,
            "max_tokens": 1,
            "stream": False,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            **fields,
        }
        assert decode == {**before, **fields}
    assert client == before


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_client_bootstrap_values_are_overwritten(route: Route) -> None:
    ctx = make_ctx(route, host="10.1.2.3", state=42)
    base = completions_body() if route is Route.COMPLETIONS else chat_body()
    client = {**base, "bootstrap_host": "evil", "bootstrap_port": 1, "bootstrap_room": 7,
              "rid": "client-chosen"}
    prefill = HANDLER.prefill_body(client, ctx)
    decode = HANDLER.decode_body(client, HANDLER.handoff({"ignored": True}, ctx))
    for body in (prefill, decode):
        assert body["bootstrap_host"] == "10.1.2.3"
        assert body["bootstrap_port"] == 8998
        assert body["bootstrap_room"] == 42
        assert body["rid"] == f"{ctx.request_id}-42"
    assert client["bootstrap_room"] == 7


def test_abort_call_names_the_legs_rid() -> None:
    ctx = make_ctx(state=9)
    assert HANDLER.abort_call(ctx) == ("/abort_request", {"rid": f"{ctx.request_id}-9"})
    assert HANDLER.abort_call(make_ctx()) is None


def test_ipv6_host_is_sent_bare() -> None:
    ctx = make_ctx(host="fd00::5", state=3)
    assert HANDLER.prefill_fields(ctx)["bootstrap_host"] == "fd00::5"


def test_missing_room_is_an_internal_error() -> None:
    with pytest.raises(SidecarError):
        HANDLER.prefill_fields(make_ctx())


def test_rooms_are_distinct_among_in_flight_requests() -> None:
    ids = make_ids(max_room=63)
    rooms = [begin(HANDLER, make_ctx(), ids).state for _ in range(64)]
    assert sorted(rooms) == list(range(64))  # every room of the space, each once
