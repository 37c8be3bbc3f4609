"""Proves the dialects' migration knowledge: where each engine's stream on each route
carries token ids (vLLM: completions, chat, token-in generate; SGLang: completions only;
TensorRT-LLM and the default engine: none), why a body cannot be continued token for token
(each reason), and the continuation's body (the prompt's and the answer's ids as a token-id
prompt, the limits lowered, sampling fields and seed kept, chat-only fields gone, the ids
asked again).

Checked against the engines' request models (vLLM 0.32's installed package, SGLang's and
TensorRT-LLM's sources: the dialects' docstrings); does not prove a live engine's answer.
"""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.config.settings import Settings
from sidecar.dialects import DialectSetup, dialect_class
from sidecar.dialects.continuation import continuation_body, refusal
from sidecar.protocol.context import Route
from sidecar.protocol.continuation import PromptIds


def dialect(engine: str, connector: str | None = "shfs") -> Any:
    return dialect_class(engine, connector)(DialectSetup(Settings(engine=engine)))


@pytest.mark.parametrize(("engine", "route", "carries"), [
    ("vllm", Route.COMPLETIONS, PromptIds.CHOICE),
    ("vllm", Route.CHAT, PromptIds.TOP),
    ("vllm", Route.GENERATE, PromptIds.REQUEST),
    ("vllm", Route.RESPONSES, None),
    ("vllm", Route.MESSAGES, None),
    ("sglang", Route.COMPLETIONS, PromptIds.CHOICE),
    ("sglang", Route.CHAT, None),
    ("trtllm", Route.COMPLETIONS, None),
    ("trtllm", Route.CHAT, None),
    ("default", Route.COMPLETIONS, None),
])
def test_where_each_engines_stream_carries_token_ids(engine: str, route: Route,
                                                     carries: PromptIds | None) -> None:
    places = dialect(engine).token_ids(route)
    assert (places.prompt if places is not None else None) == carries


def test_vllm_writes_unasked_ids_as_null_sglang_leaves_them_out() -> None:
    assert dialect("vllm").token_ids(Route.COMPLETIONS).unasked_null
    assert not dialect("sglang").token_ids(Route.COMPLETIONS).unasked_null


def test_a_prefill_engine_runs_requests_whole_only_on_vllm() -> None:
    assert dialect("vllm").prefill_decodes
    assert not dialect("sglang").prefill_decodes and not dialect("trtllm").prefill_decodes


@pytest.mark.parametrize(("route", "body", "reason"), [
    (Route.COMPLETIONS, {"prompt": "x"}, None),
    (Route.COMPLETIONS, {"n": 1, "seed": 3, "temperature": 0.7, "stop": ["\n"]}, None),
    (Route.COMPLETIONS, {"n": 2}, "fanned_out"),
    (Route.COMPLETIONS, {"best_of": 3}, "fanned_out"),
    (Route.CHAT, {"response_format": {"type": "json_schema", "json_schema": {}}},
     "guided_decoding"),
    (Route.CHAT, {"response_format": {"type": "text"}}, None),
    (Route.COMPLETIONS, {"structured_outputs": {"regex": "a+"}}, "guided_decoding"),
    (Route.COMPLETIONS, {"guided_json": {"type": "object"}}, "guided_decoding"),
    (Route.COMPLETIONS, {"regex": "a+"}, "guided_decoding"),
    (Route.CHAT, {"tools": [{"type": "function"}], "tool_choice": "required"},
     "guided_decoding"),
    (Route.CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "guided_decoding"),
    (Route.COMPLETIONS, {"logprobs": 2}, "logprobs"),
    (Route.CHAT, {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    (Route.COMPLETIONS, {"prompt_logprobs": 1}, "logprobs"),
    (Route.CHAT, {"logprobs": False}, None),
    (Route.COMPLETIONS, {"presence_penalty": 0.5}, "penalties"),
    (Route.COMPLETIONS, {"frequency_penalty": 0.0, "repetition_penalty": 1.2}, None),
    (Route.CHAT, {"tools": [{"type": "function"}]}, "tools"),
    (Route.CHAT, {"tools": [{"type": "function"}], "tool_choice": "none"}, None),
    (Route.CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "engine_state"),
    (Route.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
     None),
    (Route.COMPLETIONS, {"prompt_embeds": "abc"}, "engine_state"),
    (Route.GENERATE, {"sampling_params": {"n": 2}}, "fanned_out"),
    (Route.GENERATE, {"sampling_params": {"logprobs": 1}}, "logprobs"),
    (Route.GENERATE, {"features": None, "sampling_params": {}}, None),
    (Route.GENERATE, {"features": {"mm_hashes": {"image": ["h"]}}}, "engine_state"),
])
def test_why_a_body_cannot_be_continued(route: Route, body: dict[str, Any],
                                        reason: str | None) -> None:
    assert refusal(route, body) == reason


def test_a_completions_answer_continues_as_a_token_id_prompt() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "min_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.5, "seed": 7,
            "stop": ["\n\n"], "ignore_eos": True, "echo": False}
    route, continued = dialect("vllm").continuation(Route.COMPLETIONS, body, [1, 2], [3, 4, 5])
    assert route is Route.COMPLETIONS
    assert continued == {"model": "m", "prompt": [1, 2, 3, 4, 5], "max_tokens": 7,
                         "min_tokens": 1, "stream": True,
                         "stream_options": {"include_usage": True}, "temperature": 0.5,
                         "seed": 7, "stop": ["\n\n"], "ignore_eos": True,
                         "return_token_ids": True}
    assert body["prompt"] == "hi"  # the client's body is not touched


def test_a_chat_answer_continues_on_completions_without_chat_fields() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99,
            "max_completion_tokens": 10, "stream": True, "temperature": 0,
            "chat_template_kwargs": {"x": 1}, "add_generation_prompt": True, "top_k": 3}
    route, continued = dialect("vllm").continuation(Route.CHAT, body, [1], [2])
    assert route is Route.COMPLETIONS
    assert continued == {"model": "m", "prompt": [1, 2], "max_tokens": 9, "stream": True,
                         "temperature": 0, "top_k": 3, "return_token_ids": True}


def test_an_answer_without_limits_keeps_the_engines_default() -> None:
    _, continued = dialect("vllm").continuation(Route.COMPLETIONS, {"prompt": "a"}, [1], [2])
    assert "max_tokens" not in continued and "min_tokens" not in continued


def test_a_token_in_answer_continues_on_its_own_route() -> None:
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 5, "temperature": 0},
            "stream": True, "return_token_ids": True, "output_mode": "text"}
    route, continued = dialect("vllm").continuation(Route.GENERATE, body, [1, 2], [3])
    assert route is Route.GENERATE
    assert continued == {"token_ids": [1, 2, 3],
                         "sampling_params": {"max_tokens": 4, "temperature": 0},
                         "stream": True, "output_mode": "text"}


def test_sglang_continues_completions_and_asks_its_ids() -> None:
    route, continued = continuation_body(
        Route.COMPLETIONS, {"prompt": "a", "max_tokens": 3}, [1], [2],
        dialect("sglang").token_ids(Route.COMPLETIONS))
    assert route is Route.COMPLETIONS
    assert continued == {"prompt": [1, 2], "max_tokens": 2, "stream": True,
                         "return_token_ids": True}
