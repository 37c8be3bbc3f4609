"""Proves that the real clients of the Responses and Messages APIs work through the sidecar:
the OpenAI Python SDK's ``responses.create`` and the anthropic SDK's ``messages.create`` /
``messages.stream``, pointed at the sidecar with a prefill target (stub engines, vLLM NIXL
and SGLang), get the text the engines generate from the prefill's KV, JSON and streamed, and
see a stream that breaks after its head as the SDK surfaces its API's error event.

The SDKs are synchronous (httpx): they run in a thread while the sidecar and the stubs run on
the test's loop. Does not prove real engines (tests/real_vllm/test_routes.py does).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import pytest
from pd_builders import PDPair, pd_pair

from sidecar.tools.stubs import Fault, FaultKind
from sidecar.tools.stubs.textgen import PrefillKind, encode_text, expected_text

PROMPT = "Agents speak the Responses and Messages APIs to disaggregated engines."
MAX_TOKENS = 7
GREEDY = {"temperature": 0}


def _expected(role: str = "user") -> str:
    # The stubs' chat template renders one user turn; the decode continues the prefill's KV.
    ids = encode_text(f"<|{role}|>\n{PROMPT}\n<|assistant|>\n")
    return expected_text(ids, MAX_TOKENS, PrefillKind.REMOTE)


def _openai(pair: PDPair) -> openai.OpenAI:
    return openai.OpenAI(base_url=pair.sidecar.url + "/v1", api_key="unused", max_retries=0,
                         default_headers={"x-prefiller-host-port": pair.target})


def _anthropic(pair: PDPair) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=pair.sidecar.url, api_key="unused", max_retries=0,
                               default_headers={"x-prefiller-host-port": pair.target})


def _responses_json(pair: PDPair) -> str:
    with _openai(pair) as client:
        answer = client.responses.create(model="stub-model", input=PROMPT,
                                         max_output_tokens=MAX_TOKENS, extra_body=GREEDY)
        return answer.output_text


def _responses_stream(pair: PDPair) -> tuple[str, list[Any]]:
    events: list[Any] = []
    with _openai(pair) as client:
        stream = client.responses.create(model="stub-model", input=PROMPT,
                                         max_output_tokens=MAX_TOKENS, stream=True,
                                         extra_body=GREEDY)
        try:
            for event in stream:
                events.append(event)
        except openai.APIConnectionError:
            # A broken stream ends unterminated after its error event (never a clean end).
            events.append("connection broken")
    text = "".join(e.delta for e in events if getattr(e, "type", None)
                   == "response.output_text.delta")
    return text, events


def _messages_json(pair: PDPair) -> str:
    with _anthropic(pair) as client:
        message = client.messages.create(model="stub-model", max_tokens=MAX_TOKENS,
                                         messages=[{"role": "user", "content": PROMPT}],
                                         extra_body=GREEDY)
        return "".join(block.text for block in message.content if block.type == "text")


def _messages_stream(pair: PDPair) -> str:
    with _anthropic(pair) as client, client.messages.stream(
            model="stub-model", max_tokens=MAX_TOKENS, extra_body=GREEDY,
            messages=[{"role": "user", "content": PROMPT}]) as stream:
        return "".join(stream.text_stream)


def _legs(stub: Any) -> int:
    """The prefill legs a stub received (not the sidecar's GETs of what it serves)."""
    return len([r for r in stub.recorder.requests if r.method == "POST"])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_openai_sdk_responses_create(engine: str) -> None:
    async with pd_pair(engine, "shfs") as pair:
        assert await asyncio.to_thread(_responses_json, pair) == _expected()
        text, events = await asyncio.to_thread(_responses_stream, pair)
        assert text == _expected()
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == _expected()
        assert _legs(pair.prefill) == 2  # one prefill leg per request


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_anthropic_sdk_messages_create(engine: str) -> None:
    async with pd_pair(engine, "shfs") as pair:
        assert await asyncio.to_thread(_messages_json, pair) == _expected()
        assert await asyncio.to_thread(_messages_stream, pair) == _expected()
        assert _legs(pair.prefill) == 2


async def test_sdks_see_a_stream_broken_after_its_head() -> None:
    faults = (Fault(FaultKind.ERROR_EVENT, path="/v1/responses", after_chunks=4),
              Fault(FaultKind.DROP, path="/v1/messages", after_chunks=4))
    async with pd_pair("vllm", "shfs", decode_overrides={"faults": faults}) as pair:
        # The Responses API's own error event reaches the client as a typed event.
        _, events = await asyncio.to_thread(_responses_stream, pair)
        assert events[-1] == "connection broken"
        assert (events[-2].type, events[-2].code) == ("error", "decode_failed")
        assert not any(getattr(e, "type", None) == "response.completed" for e in events)
        # The anthropic SDK raises on the Messages API's error event.
        with pytest.raises(anthropic.APIStatusError) as failure:
            await asyncio.to_thread(_messages_stream, pair)
        assert "decode_failed" in str(failure.value)
