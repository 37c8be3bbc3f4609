"""Bodies and answer readers for the Responses, Messages and token-in generate routes (stubs).

    route_body(Route.MESSAGES, stream=True)   a client body the stub engines accept
    answer_text(route, text, stream)          the generated text (generate: the token ids'
                                              text) of a JSON answer or an SSE body
    named_events(text)                        [(event name or None, data text), ...]
    ROUTE_CASES / LOCAL_CASES / UNSERVED_CASES  (route, engine, connector) per the table of
    docs/driving/routes.md
"""

from __future__ import annotations

import json
from typing import Any

from sidecar.protocol.context import Route
from sidecar.tools.stubs.textgen import decode_tokens

API_ROUTES = [Route.RESPONSES, Route.MESSAGES, Route.GENERATE]
PROMPT = "Disaggregated serving splits prefill and decode across engines, block by block."
#: Token ids of a prompt (the stubs' tokenizer is byte level: any ids above 2 will do).
TOKEN_IDS = [3 + (i * 7) % 250 for i in range(70)]

#: The pairs that run each new route as PD (the routes table of docs/driving/routes.md).
ROUTE_CASES: list[tuple[Route, str, str]] = [
    (Route.RESPONSES, "vllm", "shfs"),
    (Route.RESPONSES, "vllm", "mooncake"),
    (Route.RESPONSES, "sglang", "shfs"),
    (Route.MESSAGES, "vllm", "shfs"),
    (Route.MESSAGES, "vllm", "mooncake"),
    (Route.MESSAGES, "sglang", "shfs"),
    (Route.GENERATE, "vllm", "shfs"),
    (Route.GENERATE, "vllm", "mooncake"),
]
#: Routes an engine serves, but not as a pair: run whole on the local engine.
LOCAL_CASES: list[tuple[Route, str, str]] = [
    (Route.RESPONSES, "vllm", "nixl"),
    (Route.MESSAGES, "vllm", "nixl"),
    (Route.GENERATE, "vllm", "nixl"),
    (Route.RESPONSES, "trtllm", "shfs"),
    (Route.MESSAGES, "trtllm", "shfs"),
]
#: Routes an engine does not serve: refused.
UNSERVED_CASES: list[tuple[Route, str, str]] = [
    (Route.GENERATE, "sglang", "shfs"),
    (Route.GENERATE, "trtllm", "shfs"),
]


def case_id(case: tuple[Route, str, str]) -> str:
    route, engine, connector = case
    return f"{route.value.rsplit('/', 1)[-1]}-{engine}-{connector}"


def route_body(route: Route, *, stream: bool = False, max_tokens: int = 6,
               prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    """A greedy client body of ``route`` for the stubs."""
    body: dict[str, Any] = {"model": "stub-model"}
    if route is Route.RESPONSES:
        body.update(input=prompt, max_output_tokens=max_tokens, temperature=0)
    elif route is Route.MESSAGES:
        body.update(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    temperature=0)
    else:
        body.update(token_ids=TOKEN_IDS, sampling_params={"max_tokens": max_tokens,
                                                          "temperature": 0})
    if stream:
        body["stream"] = True
        if route is Route.GENERATE:
            body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def named_events(text: str) -> list[tuple[str | None, str]]:
    """The events of an SSE body: (``event:`` name or None, ``data:`` text)."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name = None
        data = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if name is not None or data:
            events.append((name, "\n".join(data)))
    return events


def answer_text(route: Route, text: str, stream: bool) -> str:
    """The generated text of an answer (generate: its token ids, as text)."""
    if not stream:
        answer = json.loads(text)
        if route is Route.RESPONSES:
            return "".join(part["text"] for item in answer["output"]
                           for part in item["content"])
        if route is Route.MESSAGES:
            return "".join(block["text"] for block in answer["content"])
        return decode_tokens(answer["choices"][0]["token_ids"])
    events = named_events(text)
    if route is Route.RESPONSES:
        return "".join(json.loads(d)["delta"] for n, d in events
                       if n == "response.output_text.delta")
    if route is Route.MESSAGES:
        return "".join(json.loads(d)["delta"]["text"] for n, d in events
                       if n == "content_block_delta")
    ids = [t for _, d in events if d != "[DONE]" for c in json.loads(d).get("choices", [])
           for t in c["token_ids"]]
    return decode_tokens(ids)


def answer_usage(route: Route, text: str, stream: bool) -> dict[str, Any]:
    """The usage an answer tells (streams: its last usage event's)."""
    if not stream:
        usage: dict[str, Any] = json.loads(text)["usage"]
        return usage
    events = named_events(text)
    for name, data in reversed(events):
        if data == "[DONE]" or not data:
            continue
        payload = json.loads(data)
        if route is Route.RESPONSES and name == "response.completed":
            found: dict[str, Any] = payload["response"]["usage"]
            return found
        if route is Route.MESSAGES and name == "message_delta":
            found = payload["usage"]
            return found
        if route not in (Route.RESPONSES, Route.MESSAGES) and isinstance(
                payload.get("usage"), dict):
            found = payload["usage"]
            return found
    raise AssertionError("no usage in the stream")
