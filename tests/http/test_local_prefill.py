"""Proves conditional disaggregation (``--local-prefill-max-tokens``) through the HTTP door:

- a prompt at or under the limit runs whole on the local engine: the decode engine gets the
  client's body as sent (no hand-off fields), the prefill engine gets nothing, and the
  request is counted ``local_short``; a longer prompt is disaggregated as before;
- the length is exact for token-id prompts, estimated from UTF-8 bytes for text and chat, or
  asked of the local engine's tokenizer (vLLM ``/tokenize`` with ``prompt`` or ``messages``,
  SGLang ``/v1/tokenize``); a tokenize call that fails disaggregates the request, counted;
- in a fan-out each prompt is judged on its own;
- ``tokenize`` is refused at start-up for an engine without a tokenizer endpoint;
- the exact and estimated counts follow their documented rules (``test_the_length_rules``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
from pd_builders import client_body, pd_pair
from protocol_builders import HANDOFF_FIELDS, OPENAI_ROUTE_LIST

from sidecar.config.loader import ConfigError, add_settings_arguments, load_settings
from sidecar.protocol.context import Route
from sidecar.protocol.prompt_length import estimate_tokens, exact_tokens
from sidecar.tools.stubs.faults import Fault, FaultKind

LIMIT = 16


def _inference(stub: Any, path: str) -> list[Any]:
    return [r for r in stub.recorder.requests if r.path == path]


async def _local_short(pair: Any) -> float:
    return await pair.sidecar.metric("disagg_requests_total", outcome="local_short")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("engine", "connector"), [("vllm", "shfs"), ("sglang", "shfs"),
                                                   ("trtllm", "shfs"), ("vllm", "mooncake")])
async def test_a_short_token_prompt_never_reaches_the_prefill_engine(
    engine: str, connector: str, stream: bool
) -> None:
    async with pd_pair(engine, connector, local_prefill_max_tokens=LIMIT) as pair:
        body = client_body(prompt=list(range(10, 10 + LIMIT)), stream=stream)
        status, headers, text = await pair.send(body=body, headers={"X-Request-Id": "short"})
        assert status == 200, text
        assert headers["X-Request-Id"] == "short"
        seen = await pair.decode.recorder.next_request("/v1/completions")
        assert seen.json == body  # the client's body, no hand-off fields
        assert not set(seen.json) & set(HANDOFF_FIELDS)
        assert _inference(pair.prefill, "/v1/completions") == []
        assert await _local_short(pair) == 1
        # One token more: disaggregated as before.
        long = client_body(prompt=list(range(10, 11 + LIMIT)), stream=stream)
        status, _, text = await pair.send(body=long)
        assert status == 200, text
        assert len(_inference(pair.prefill, "/v1/completions")) == 1
        assert await pair.sidecar.metric("disagg_requests_total", outcome="ok") == 1


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST, ids=["completions", "chat"])
async def test_estimate_decides_text_and_chat(route: Route) -> None:
    async with pd_pair("vllm", "shfs", local_prefill_max_tokens=LIMIT) as pair:
        short = client_body(route, prompt="x" * 8)  # 2 tokens (+4 per chat message)
        status, _, text = await pair.send(route, body=short)
        assert status == 200, text
        assert _inference(pair.prefill, route.value) == []
        long = client_body(route, prompt="x" * 4 * (LIMIT + 1))
        status, _, text = await pair.send(route, body=long)
        assert status == 200, text
        assert len(_inference(pair.prefill, route.value)) == 1
        assert _inference(pair.decode, "/tokenize") == []  # the estimate asks nobody
        assert await _local_short(pair) == 1


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST, ids=["completions", "chat"])
async def test_tokenize_asks_the_local_vllm_engine(route: Route) -> None:
    # The stub's chat template adds 24 tokens to a message: the limit leaves room for "hi".
    limit = 26 if route is Route.CHAT else LIMIT
    async with pd_pair("vllm", "shfs", local_prefill_max_tokens=limit,
                       prompt_length_source="tokenize") as pair:
        # The stub tokenizer is byte level: "hi there" is 8 tokens (chat adds its template).
        short = client_body(route, prompt="hi" if route is Route.CHAT else "hi there")
        status, _, text = await pair.send(route, body=short)
        assert status == 200, text
        asked = _inference(pair.decode, "/tokenize")
        assert len(asked) == 1
        key = "messages" if route is Route.CHAT else "prompt"
        assert asked[0].json[key] == short[key]
        assert _inference(pair.prefill, route.value) == []
        status, _, text = await pair.send(route, body=client_body(route, prompt="y" * 40))
        assert status == 200, text
        assert len(_inference(pair.prefill, route.value)) == 1
        assert await _local_short(pair) == 1


async def test_tokenize_on_sglang_uses_its_endpoint() -> None:
    async with pd_pair("sglang", "shfs", local_prefill_max_tokens=LIMIT,
                       prompt_length_source="tokenize") as pair:
        status, _, text = await pair.send(body=client_body(prompt="hi there"))
        assert status == 200, text
        asked = _inference(pair.decode, "/v1/tokenize")
        assert [r.json for r in asked] == [{"model": "stub-model", "prompt": "hi there"}]
        assert _inference(pair.prefill, "/v1/completions") == []


@pytest.mark.parametrize("fault", [Fault(kind=FaultKind.STATUS, status=500, path="/tokenize"),
                                   Fault(kind=FaultKind.MALFORMED, path="/tokenize")],
                         ids=["status", "malformed"])
async def test_a_failed_tokenize_call_disaggregates(fault: Fault) -> None:
    async with pd_pair("vllm", "shfs", local_prefill_max_tokens=LIMIT,
                       prompt_length_source="tokenize",
                       decode_overrides={"faults": (fault,)}) as pair:
        status, _, text = await pair.send(body=client_body(prompt="hi"))
        assert status == 200, text
        assert len(_inference(pair.decode, "/tokenize")) == 1
        assert len(_inference(pair.prefill, "/v1/completions")) == 1
        assert await pair.sidecar.metric("disagg_tokenize_failures_total") == 1
        assert await _local_short(pair) == 0


async def test_each_prompt_of_a_batch_is_judged_on_its_own() -> None:
    async with pd_pair("vllm", "shfs", local_prefill_max_tokens=LIMIT) as pair:
        body = client_body(prompt=[[5] * 4, [6] * (LIMIT + 4)])
        status, _, text = await pair.send(body=body)
        assert status == 200, text
        prefilled = _inference(pair.prefill, "/v1/completions")
        assert [r.json["prompt"] for r in prefilled] == [[6] * (LIMIT + 4)]
        assert [c["index"] for c in json.loads(text)["choices"]] == [0, 1]


def _load(*argv: str) -> Any:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return load_settings(parser.parse_args(list(argv)), {})


def test_tokenize_is_refused_at_start_up_for_an_engine_without_a_tokenizer() -> None:
    with pytest.raises(ConfigError, match="tokenizer endpoint"):
        _load("--engine", "trtllm", "--prompt-length-source", "tokenize")
    assert _load("--engine", "sglang", "--prompt-length-source", "tokenize").settings


def test_the_length_rules() -> None:
    assert exact_tokens(Route.COMPLETIONS, {"prompt": [1, 2, 3]}) == 3
    assert exact_tokens(Route.COMPLETIONS, {"prompt": [[1, 2]]}) == 2
    assert exact_tokens(Route.COMPLETIONS, {"prompt": "abc"}) is None
    assert estimate_tokens(Route.COMPLETIONS, {"prompt": "abcdefghi"}) == 3  # ceil(9 / 4)
    assert estimate_tokens(Route.COMPLETIONS, {"prompt": ["é" * 4]}) == 2  # 8 UTF-8 bytes
    chat = {"messages": [{"role": "user", "content": "abcd"},
                         {"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}
    assert estimate_tokens(Route.CHAT, chat) == 2 + 2 * 4
