"""Proves the TensorRT-LLM dialect's wire format (docs/driving/handoffs.md#trtllm), completions and
chat.

context_only prefill with the snowflake id and no max_completion_tokens; generation_only
decode from disaggregated_params found at the top level or in choices[0], every other key
unchanged; prompt / prompt_token_ids from the context response; missing params leave decode
unchanged; non-object params are an InvalidHandoff; ids above 2**53 survive JSON exactly;
answered_by_prefill follows TRT-LLM's own _need_gen. Does not run a TRT-LLM engine.
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

from sidecar import jsonutil
from sidecar.dialects import Legs
from sidecar.dialects.trtllm import TRTLLMDialect
from sidecar.errors import InvalidHandoff
from sidecar.protocol.context import Route

HANDLER = make_dialect(TRTLLMDialect)
#: snowflake(2026-01-01T00:00Z, machine 0, counter 0): docs/driving/handoffs.md#trtllm-snowflake.
FIRST_ID = 397181498744111104
BIG_ID = 2**62 + 12345  # far above 2**53: a float would lose the low bits

CTX_PARAMS: dict[str, Any] = {
    "request_type": "context_only",
    "first_gen_tokens": [2994],
    "ctx_request_id": 1234,
    "encoded_opaque_state": "AAEC/w==",
    "draft_tokens": None,
    "disagg_request_id": BIG_ID,
    "ctx_dp_rank": 0,
    "ctx_info_endpoint": "tcp://10.0.0.7:4000",
}
GEN_PARAMS: dict[str, Any] = {
    "request_type": "generation_only",
    "first_gen_tokens": [2994],
    "ctx_request_id": 1234,
    "encoded_opaque_state": "AAEC/w==",
    "draft_tokens": None,
    "disagg_request_id": BIG_ID,
    "ctx_dp_rank": 0,
    "ctx_info_endpoint": "tcp://10.0.0.7:4000",
}


def _response(*, where: str = "choice", finish: str | None = "length") -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": "Paris", "finish_reason": finish}
    response: dict[str, Any] = {
        "id": "cmpl-9",
        "object": "text_completion",
        "model": "m",
        "choices": [choice],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "prompt_token_ids": [101, 2054, BIG_ID],
    }
    if where == "choice":
        choice["disaggregated_params"] = copy.deepcopy(CTX_PARAMS)
    elif where == "top":
        response["disaggregated_params"] = copy.deepcopy(CTX_PARAMS)
    return response


def test_sequential_and_drops_max_completion_tokens() -> None:
    assert HANDLER.legs is Legs.SEQUENTIAL
    assert HANDLER.drops_max_completion_tokens is True


def test_assign_ids_uses_the_snowflake() -> None:
    ctx = begin(HANDLER, make_ctx(), make_ids())
    assert ctx.state == FIRST_ID


def test_golden_prefill_completions() -> None:
    ctx = begin(HANDLER, make_ctx(Route.COMPLETIONS), make_ids())
    client = completions_body(max_completion_tokens=50)
    assert HANDLER.prefill_body(client, ctx) == {
        "model": "m",
        "prompt": "hello world",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.0,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": FIRST_ID},
    }


def test_golden_prefill_chat() -> None:
    ctx = begin(HANDLER, make_ctx(Route.CHAT), make_ids())
    assert HANDLER.prefill_body(chat_body(), ctx) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "stream": False,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": FIRST_ID},
    }


@pytest.mark.parametrize("where", ["choice", "top"])
def test_golden_decode_completions(where: str) -> None:
    ctx = make_ctx(Route.COMPLETIONS, state=BIG_ID)
    client = completions_body()
    response = _response(where=where)
    before = copy.deepcopy(response)
    decode = HANDLER.decode_body(client, HANDLER.handoff(response, ctx))
    assert decode == {
        "model": "m",
        "prompt": [101, 2054, BIG_ID],
        "max_tokens": 64,
        "min_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "disaggregated_params": GEN_PARAMS,
    }
    assert list(decode["disaggregated_params"]) == list(CTX_PARAMS)  # key order kept
    assert response == before


@pytest.mark.parametrize("where", ["choice", "top"])
def test_golden_decode_chat(where: str) -> None:
    ctx = make_ctx(Route.CHAT, state=BIG_ID)
    decode = HANDLER.decode_body(chat_body(), HANDLER.handoff(_response(where=where), ctx))
    assert decode == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 64,
        "min_completion_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "disaggregated_params": GEN_PARAMS,
        "prompt_token_ids": [101, 2054, BIG_ID],
    }


def test_top_level_wins_over_choice() -> None:
    response = _response(where="choice")
    response["disaggregated_params"] = {"request_type": "context_only", "ctx_request_id": 5}
    handoff = HANDLER.handoff(response, make_ctx())
    assert handoff["disaggregated_params"] == {
        "request_type": "generation_only",
        "ctx_request_id": 5,
    }


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_missing_params_leave_decode_unchanged(route: Route) -> None:
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    handoff = HANDLER.handoff(_response(where="none"), make_ctx(route))
    assert handoff == {}
    assert HANDLER.decode_body(client, handoff) == client


def test_null_params_count_as_missing() -> None:
    response = _response(where="none")
    response["disaggregated_params"] = None
    response["choices"][0]["disaggregated_params"] = None
    assert HANDLER.handoff(response, make_ctx()) == {}


@pytest.mark.parametrize("bad", ["opaque", 7, ["a"], True])
@pytest.mark.parametrize("where", ["choice", "top"])
def test_non_object_params_are_invalid(bad: object, where: str) -> None:
    response = _response(where="none")
    if where == "top":
        response["disaggregated_params"] = bad
    else:
        response["choices"][0]["disaggregated_params"] = bad
    with pytest.raises(InvalidHandoff, match="disaggregated_params"):
        HANDLER.handoff(response, make_ctx())


def test_no_prompt_token_ids_means_prompt_untouched() -> None:
    response = _response()
    del response["prompt_token_ids"]
    assert HANDLER.handoff(response, make_ctx(Route.COMPLETIONS)) == {
        "disaggregated_params": GEN_PARAMS
    }


def test_missing_response_is_invalid() -> None:
    with pytest.raises(InvalidHandoff):
        HANDLER.handoff(None, make_ctx())


def test_ids_above_2_53_survive_json_exactly() -> None:
    ctx = make_ctx(Route.COMPLETIONS, state=BIG_ID)
    prefill_wire = jsonutil.dumps(HANDLER.prefill_body(completions_body(), ctx))
    assert jsonutil.loads(prefill_wire)["disaggregated_params"]["disagg_request_id"] == BIG_ID
    assert str(BIG_ID).encode() in prefill_wire
    response = jsonutil.loads(jsonutil.dumps(_response()))
    decode = HANDLER.decode_body(completions_body(), HANDLER.handoff(response, ctx))
    back = jsonutil.loads(jsonutil.dumps(decode))
    assert back["disaggregated_params"]["disagg_request_id"] == BIG_ID
    assert back["prompt"][-1] == BIG_ID
    assert float(BIG_ID) != BIG_ID  # the value really is beyond float precision


@pytest.mark.parametrize(
    ("finish", "answered"),
    [("length", False), ("not_finished", False), (None, False), ("stop", True), ("abort", True)],
)
def test_answered_by_prefill(finish: str | None, answered: bool) -> None:
    assert HANDLER.answered_by_prefill(_response(finish=finish)) is answered


def test_answered_by_prefill_without_choices() -> None:
    assert HANDLER.answered_by_prefill({"id": "x"}) is False
    assert HANDLER.answered_by_prefill({"choices": []}) is False
