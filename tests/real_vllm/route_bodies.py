"""Per-route bodies and answer readers for the routes of issue 21, as vLLM 0.32 reads them.

Owns, for each of ``completions``, ``chat``, ``responses``, ``messages`` and ``generate``
(``/inference/v1/generate``): the greedy client body the recordings use, the prefill leg's
body (one output token in the field that route limits output with, not streamed, the
``kv_transfer_params`` skeleton at the top level), and how to read the generated output
(text, or token ids for ``generate``) from a JSON answer or from an SSE body.

Where vLLM 0.32 reads each field (site-packages/vllm/entrypoints/...):
- responses: ``max_output_tokens``, ``stream``, ``store``, ``ignore_eos``,
  ``kv_transfer_params`` on ``ResponsesRequest`` (openai/responses/protocol.py);
- messages: ``max_tokens`` (required), ``stream``, ``kv_transfer_params`` on
  ``AnthropicMessagesRequest`` (anthropic/protocol.py; no ``ignore_eos`` field: extra keys
  are dropped);
- generate: ``token_ids``, ``sampling_params`` (vLLM's ``SamplingParams``: ``max_tokens``,
  ``ignore_eos``, ...), ``stream``, ``stream_options``, ``kv_transfer_params``
  (scale_out/token_in_token_out/protocol.py, ``GenerateRequest``).

Deliberate limits: single-choice requests, text-only prompts; plain dicts, no validation
(the engine validates).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol_builders import nixl_prefill_skeleton

MODEL = "tiny"
MAX_NEW_TOKENS = 12


@dataclass(frozen=True)
class SseEvent:
    """One server-sent event: its ``event:`` name (None when absent) and ``data:`` text."""

    event: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


def parse_sse(body: str) -> list[SseEvent]:
    """Split an SSE body into events (blank-line separated; ``event:`` and ``data:`` lines)."""
    events: list[SseEvent] = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].strip())
        if name is not None or data:
            events.append(SseEvent(name, "\n".join(data)))
    return events


def _data_events(body: str) -> list[dict[str, Any]]:
    return [e.json() for e in parse_sse(body) if e.data and e.data != "[DONE]"]


# --- client bodies ----------------------------------------------------------------------


def completions_body(prompt: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
                            "temperature": 0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def chat_body(prompt: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def responses_body(prompt: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "input": prompt, "max_output_tokens": MAX_NEW_TOKENS,
                            "temperature": 0, "ignore_eos": True}
    if stream:
        body["stream"] = True
    return body


def messages_body(prompt: str, stream: bool = False) -> dict[str, Any]:
    # The Messages schema has no ignore_eos: the tiny model may stop early (end_turn).
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
    if stream:
        body["stream"] = True
    return body


def generate_body(token_ids: list[int], stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "token_ids": token_ids,
        "sampling_params": {"max_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


# --- prefill legs -----------------------------------------------------------------------


def _one_token_not_streamed(body: dict[str, Any], limit_key: str) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out[limit_key] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def prefill_completions(body: dict[str, Any]) -> dict[str, Any]:
    out = _one_token_not_streamed(body, "max_tokens")
    out.pop("max_completion_tokens", None)
    out.pop("min_tokens", None)
    return out


def prefill_responses(body: dict[str, Any]) -> dict[str, Any]:
    out = _one_token_not_streamed(body, "max_output_tokens")
    # The one-token answer must not be kept on the prefill engine (store defaults to true
    # and is honoured where VLLM_ENABLE_RESPONSES_API_STORE=1), nor run in the background
    # (a background answer comes back "queued", without kv_transfer_params).
    out["store"] = False
    out.pop("background", None)
    return out


def prefill_messages(body: dict[str, Any]) -> dict[str, Any]:
    return _one_token_not_streamed(body, "max_tokens")


def prefill_generate(body: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    params = dict(out.get("sampling_params") or {})
    params["max_tokens"] = 1
    params.pop("min_tokens", None)
    out["sampling_params"] = params
    out["stream"] = False
    out.pop("stream_options", None)
    return out


# --- reading answers --------------------------------------------------------------------


def completions_output(reply: dict[str, Any]) -> str:
    return str(reply["choices"][0]["text"])


def completions_stream_output(body: str) -> str:
    return "".join(c.get("text") or "" for e in _data_events(body) for c in e.get("choices", []))


def chat_output(reply: dict[str, Any]) -> str:
    return str(reply["choices"][0]["message"]["content"] or "")


def chat_stream_output(body: str) -> str:
    return "".join((c.get("delta") or {}).get("content") or ""
                   for e in _data_events(body) for c in e.get("choices", []))


def responses_output(reply: dict[str, Any]) -> str:
    return "".join(part.get("text") or ""
                   for item in reply.get("output", []) if item.get("type") == "message"
                   for part in item.get("content", []) if part.get("type") == "output_text")


def responses_stream_output(body: str) -> str:
    return "".join(e.json().get("delta", "") for e in parse_sse(body)
                   if e.event == "response.output_text.delta")


def messages_output(reply: dict[str, Any]) -> str:
    return "".join(block.get("text") or "" for block in reply.get("content", [])
                   if block.get("type") == "text")


def messages_stream_output(body: str) -> str:
    return "".join((e.json().get("delta") or {}).get("text") or "" for e in parse_sse(body)
                   if e.event == "content_block_delta")


def generate_output(reply: dict[str, Any]) -> list[int]:
    return list(reply["choices"][0]["token_ids"])


def generate_stream_output(body: str) -> list[int]:
    return [t for e in _data_events(body) if "choices" in e
            for c in e["choices"] for t in (c.get("token_ids") or [])]


@dataclass(frozen=True)
class RouteSpec:
    """One route: its path, how to build its bodies and how to read its answers."""

    name: str
    path: str
    client_body: Callable[..., dict[str, Any]]
    prefill_body: Callable[[dict[str, Any]], dict[str, Any]]
    output: Callable[[dict[str, Any]], Any]
    stream_output: Callable[[str], Any]
    takes_token_ids: bool = False

    def prefill_request(self, body: dict[str, Any]) -> dict[str, Any]:
        out = self.prefill_body(body)
        out["kv_transfer_params"] = nixl_prefill_skeleton()
        return out


ROUTES: dict[str, RouteSpec] = {
    spec.name: spec
    for spec in (
        RouteSpec("completions", "/v1/completions", completions_body, prefill_completions,
                  completions_output, completions_stream_output),
        RouteSpec("chat", "/v1/chat/completions", chat_body, prefill_completions,
                  chat_output, chat_stream_output),
        RouteSpec("responses", "/v1/responses", responses_body, prefill_responses,
                  responses_output, responses_stream_output),
        RouteSpec("messages", "/v1/messages", messages_body, prefill_messages,
                  messages_output, messages_stream_output),
        RouteSpec("generate", "/inference/v1/generate", generate_body, prefill_generate,
                  generate_output, generate_stream_output, takes_token_ids=True),
    )
}


def with_handoff(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The decode leg: the client's body plus ``kv_transfer_params`` at the top level."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = params
    return out
