"""Proves the protocol side of a migration on recorded vLLM 0.32 streams and built chunks:
the ids the client did not ask for are written exactly as vLLM writes them unasked; a stream
is read back (prompt ids, answer ids and text, identity); a continuation's chunks are joined
into the client's stream (identity, the regenerated tail left out once and checked, usage
over the whole answer, chat chunks from completions ones, token-in spans moved).

The recorded bytes come from tests/fixtures/vllm/0.32.0 (unasked) and the probe the issue's
facts were measured with (asked); does not prove a live engine's bytes (tests/real_vllm).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar import jsonutil
from sidecar.dialects.continuation import VLLM_CHAT, VLLM_GENERATE, completions_places
from sidecar.protocol.context import Route
from sidecar.protocol.continuation import (
    Diverged,
    Join,
    SoFar,
    engine_fault_event,
    ids_stripper,
    read_stream,
)

VLLM_COMPLETIONS = completions_places(unasked_null=True)
SGLANG_COMPLETIONS = completions_places(unasked_null=False)

# vLLM 0.32, the same greedy request with and without return_token_ids (ids, created differ).
ASKED_CMPL = (
    b'data: {"id":"cmpl-b1","object":"text_completion","created":1,"model":"tiny","choices":'
    b'[{"index":0,"text":"","logprobs":null,"finish_reason":null,"stop_reason":null,'
    b'"prompt_token_ids":[57,558,269],"token_ids":[127]}]}\n\n'
    b'data: {"id":"cmpl-b1","object":"text_completion","created":1,"model":"tiny","choices":'
    b'[{"index":0,"text":"\xef\xbf\xbdstartswith","logprobs":null,"finish_reason":null,'
    b'"stop_reason":null,"prompt_token_ids":null,"token_ids":[1673]}]}\n\n'
)
UNASKED_CMPL = (
    b'data: {"id":"cmpl-b1","object":"text_completion","created":1,"model":"tiny","choices":'
    b'[{"index":0,"text":"","logprobs":null,"finish_reason":null,"stop_reason":null,'
    b'"prompt_token_ids":null,"token_ids":null}]}\n\n'
    b'data: {"id":"cmpl-b1","object":"text_completion","created":1,"model":"tiny","choices":'
    b'[{"index":0,"text":"\xef\xbf\xbdstartswith","logprobs":null,"finish_reason":null,'
    b'"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
)
ASKED_CHAT = (
    b'data: {"id":"chatcmpl-8","object":"chat.completion.chunk","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}],"prompt_token_ids":[30,94,1560],"prompt_text":null}\n\n'
    b'data: {"id":"chatcmpl-8","object":"chat.completion.chunk","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"content":"885"},"logprobs":null,"finish_reason":null,'
    b'"token_ids":[1002]}]}\n\n'
)
UNASKED_CHAT = ASKED_CHAT.replace(b"[30,94,1560]", b"null").replace(b"[1002]", b"null")


def test_unasked_ids_are_written_as_vllm_writes_them() -> None:
    assert ids_stripper(VLLM_COMPLETIONS)(ASKED_CMPL) == UNASKED_CMPL
    assert ids_stripper(VLLM_CHAT)(ASKED_CHAT) == UNASKED_CHAT


def test_unasked_ids_leave_sglangs_chunks() -> None:
    asked = (b'data: {"choices":[{"index":0,"text":"a","matched_stop":null,'
             b'"token_ids":[5,6],"prompt_token_ids":[1,2]}]}\n\n')
    assert ids_stripper(SGLANG_COMPLETIONS)(asked) == (
        b'data: {"choices":[{"index":0,"text":"a","matched_stop":null}]}\n\n')


def test_text_that_names_the_keys_is_left_alone() -> None:
    # A quote inside generated text is escaped: the key's pattern never matches it.
    chunk = jsonutil.dumps({"choices": [{"text": '"token_ids":[1,2]', "token_ids": [3]}]})
    stripped = ids_stripper(VLLM_COMPLETIONS)(b"data: " + chunk + b"\n\n")
    assert json.loads(stripped[6:])["choices"][0] == {"text": '"token_ids":[1,2]',
                                                        "token_ids": None}


def test_a_completions_stream_reads_back() -> None:
    so_far = read_stream(Route.COMPLETIONS, ASKED_CMPL, VLLM_COMPLETIONS, {})
    assert so_far.prompt_ids == [57, 558, 269]
    assert so_far.ids == [127, 1673]
    assert so_far.text == "\ufffdstartswith"
    assert so_far.head == {"id": "cmpl-b1", "object": "text_completion", "created": 1,
                           "model": "tiny"}
    assert not so_far.finished and not so_far.parsed


def test_a_chat_stream_reads_back() -> None:
    so_far = read_stream(Route.CHAT, ASKED_CHAT, VLLM_CHAT, {})
    assert so_far.prompt_ids == [30, 94, 1560]
    assert so_far.ids == [1002]
    assert so_far.text == "885"
    assert so_far.template is not None and so_far.template["choices"][0]["delta"] == {
        "content": "885"}


def test_a_delta_with_more_than_text_is_noted() -> None:
    reasoning = ASKED_CHAT + (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"reasoning":"hm"},"token_ids":[9]}]}'
        b"\n\n")
    assert read_stream(Route.CHAT, reasoning, VLLM_CHAT, {}).parsed


def test_a_token_in_stream_reads_its_prompt_from_the_request() -> None:
    events = (b'data: {"request_id":"g","usage":null,"output_mode":"tokens","choices":'
              b'[{"index":0,"finish_reason":null,"token_ids":[7]}]}\n\n')
    so_far = read_stream(Route.GENERATE, events, VLLM_GENERATE, {"token_ids": [1, 2]})
    assert so_far.prompt_ids == [1, 2] and so_far.ids == [7] and not so_far.has_text
    assert so_far.head == {"request_id": "g"}


def _completions_chunk(text: str, ids: list[int], finish: str | None = None,
                       **extra: Any) -> bytes:
    return jsonutil.dumps({"id": "cmpl-new", "object": "text_completion", "created": 9,
                           "model": "tiny", "choices": [{
                               "index": 0, "text": text, "logprobs": None,
                               "finish_reason": finish, "stop_reason": None,
                               "prompt_token_ids": extra.get("prompt"), "token_ids": ids}]})


def test_a_continuation_joins_the_clients_completions_stream() -> None:
    so_far = read_stream(Route.COMPLETIONS, ASKED_CMPL, VLLM_COMPLETIONS, {})
    # The join starts before token 1673 (its text the client has, "swith" of it once more
    # since the continuation writes it whole) and the continuation goes on.
    join = Join(so_far, Route.COMPLETIONS, VLLM_COMPLETIONS, asked=False, produced=1,
                skip_text="\ufffdstartswith", skip_ids=[1673])
    first = join.event(_completions_chunk("\ufffdstarts", [1673], prompt=[1, 2, 3]))
    second = join.event(_completions_chunk("with x", [5], "length"))
    assert first == b""
    out = json.loads(second[6:])
    assert (out["id"], out["created"]) == ("cmpl-b1", 1)
    assert out["choices"][0]["text"] == " x"
    assert out["choices"][0]["token_ids"] is None
    assert out["choices"][0]["prompt_token_ids"] is None
    assert so_far.text == "\ufffdstartswith x"
    assert so_far.ids == [127, 1673, 5] and so_far.finished


def test_a_chunk_wholly_regenerated_is_left_out() -> None:
    so_far = SoFar(Route.COMPLETIONS, prompt_ids=[1], ids=[4, 5], text="ab",
                   head={"id": "x"})
    join = Join(so_far, Route.COMPLETIONS, VLLM_COMPLETIONS, asked=True, produced=1,
                skip_text="b", skip_ids=[5])
    assert join.event(_completions_chunk("b", [5])) == b""
    asked = json.loads(join.event(_completions_chunk("c", [6]))[6:])
    assert asked["choices"][0]["token_ids"] == [6]


@pytest.mark.parametrize(("text", "ids"), [("x", [5]), ("b", [9])])
def test_a_continuation_that_differs_from_the_answer_diverged(text: str,
                                                               ids: list[int]) -> None:
    so_far = SoFar(Route.COMPLETIONS, prompt_ids=[1], ids=[4, 5], text="ab", head={})
    join = Join(so_far, Route.COMPLETIONS, VLLM_COMPLETIONS, asked=True, produced=1,
                skip_text="b", skip_ids=[5])
    with pytest.raises(Diverged):
        join.event(_completions_chunk(text, ids))


def test_usage_counts_the_whole_answer_once() -> None:
    so_far = SoFar(Route.COMPLETIONS, prompt_ids=[1, 2, 3], ids=[4, 5], text="ab", head={})
    join = Join(so_far, Route.COMPLETIONS, VLLM_COMPLETIONS, asked=False, produced=2,
                details=lambda usage: {**usage, "prompt_tokens_details": {"cached_tokens": 2}})
    usage = {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4,
             "prompt_tokens_details": {"cached_tokens": 5}}
    out = json.loads(join.event(jsonutil.dumps({"id": "n", "choices": [], "usage": usage}))[6:])
    assert out["usage"] == {"prompt_tokens": 3, "total_tokens": 9, "completion_tokens": 6,
                            "prompt_tokens_details": {"cached_tokens": 2}}


def test_a_completions_continuation_joins_a_chat_stream_as_chat_chunks() -> None:
    so_far = read_stream(Route.CHAT, UNASKED_CHAT, VLLM_CHAT, {})
    so_far.ids = [1002]
    join = Join(so_far, Route.COMPLETIONS, VLLM_CHAT, asked=False, produced=1)
    out = json.loads(join.event(_completions_chunk("!", [7], "length"))[6:])
    assert out == {"id": "chatcmpl-8", "object": "chat.completion.chunk", "created": 1,
                   "model": "tiny", "choices": [{
                       "index": 0, "delta": {"content": "!"}, "logprobs": None,
                       "finish_reason": "length", "stop_reason": None, "token_ids": None}]}


def test_token_in_spans_reach_back_to_the_answers_start() -> None:
    so_far = SoFar(Route.GENERATE, prompt_ids=[1], ids=[4, 5], head={"request_id": "g"},
                   has_text=False)
    join = Join(so_far, Route.GENERATE, VLLM_GENERATE, asked=True, produced=2)
    chunk = {"request_id": "other", "choices": [{"index": 0, "finish_reason": "length",
                                                 "token_ids": [6],
                                                 "weight_versions": [{"version": "v",
                                                                      "start": 0, "end": 1}]}]}
    out = json.loads(join.event(jsonutil.dumps(chunk))[6:])
    assert out["request_id"] == "g"
    assert out["choices"][0]["weight_versions"] == [{"version": "v", "start": 0, "end": 3}]


@pytest.mark.parametrize(("event", "fault"), [
    (b'data: {"error": {"message": "x", "type": "InternalServerError", "code": 500}}', True),
    (b'data: {"error": {"message": "x", "type": "BadRequestError", "code": 400}}', False),
    (b'data: {"error": {"message": "x"}}', True),
    (b"data: {not json", True),
])
def test_an_engine_error_event_is_its_own_failure_unless_a_4xx(event: bytes,
                                                               fault: bool) -> None:
    assert engine_fault_event(event) is fault


def test_a_chat_chunk_vllm_writes_only_when_asked_is_left_out() -> None:
    held = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"tiny",'
            b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":null,'
            b'"token_ids":[5]}]}\n\n')
    finishing = held.replace(b'"finish_reason":null', b'"finish_reason":"length"')
    strip = ids_stripper(VLLM_CHAT)
    assert strip(ASKED_CHAT + held) == UNASKED_CHAT
    assert strip(finishing) == finishing.replace(b"[5]", b"null")
