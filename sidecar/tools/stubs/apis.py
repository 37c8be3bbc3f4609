"""The stub engines' Responses, Messages and token-in generate routes: parsing, usage and
answers shaped as the engines write them (pure, no I/O).

    parse_api(body, kind, config)   kind "responses" | "messages" | "generate" -> GenRequest
    CacheFigures                    what the engine's prefix cache did for a prompt (vLLM's
                                    figures: full blocks read, full blocks newly written;
                                    ``prefix_cache`` keeps the blocks)
    api_usage(kind, ...)            the usage object of each route, with the cache figures
                                    where the engine reports them (``prompt_tokens_details``)
    render_*_body / *_events        JSON answers and SSE events per route, in a ``style``:
                                    "vllm" (compact JSON, ``type`` last, as pydantic dumps
                                    vLLM's models) or "sglang" (``type`` first)

Shapes follow vLLM 0.32.0's recorded answers (``tests/fixtures/vllm/0.32.0/routes``):
Responses ``response.completed`` even when the answer is incomplete, no ``[DONE]``; Messages
``message_start`` ... ``message_stop``; generate ``data:`` chunks of one token id each, a usage
chunk when asked, ``data: [DONE]``. Their failures after the head are each engine's own (see
``stream_failure``).

Deliberate limits: one text message per turn; no tools, reasoning or logprobs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

from sidecar import jsonutil
from sidecar.tools.stubs import textgen
from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.openai import BadRequest, GenRequest, pace
from sidecar.tools.stubs.replies import SSE_DONE, sse

RESPONSES: Final = "/v1/responses"
MESSAGES: Final = "/v1/messages"
GENERATE: Final = "/inference/v1/generate"
#: The route each API kind is served on.
API_PATHS: Final = {"responses": RESPONSES, "messages": MESSAGES, "generate": GENERATE}

Style = str  # "vllm" | "sglang"


def _int(body: dict[str, Any], key: str, where: str = "") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{where}{key} must be an integer")
    return value


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    prompt = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(prompt, str) and prompt:
        messages.append({"role": "user", "content": prompt})
    elif isinstance(prompt, list) and prompt:
        for item in prompt:
            if not isinstance(item, dict):
                raise BadRequest("input items must be objects")
            messages.append({"role": str(item.get("role", "user")),
                             "content": _text(item.get("content"))})
    else:
        raise BadRequest("input must be a non-empty string or array of items")
    return messages


def _anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    system = _text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequest("each message must be an object")
        out.append({"role": str(message.get("role", "user")),
                    "content": _text(message.get("content"))})
    return out


def parse_api(body: Any, kind: str, config: StubConfig) -> GenRequest:
    """Validate a Responses, Messages or generate body as the engine does (400s)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    include_usage = False
    ignore_eos = False
    if kind == "generate":
        ids = body.get("token_ids")
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise BadRequest("token_ids must be a non-empty list of integers")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        max_tokens = _int(params, "max_tokens", "sampling_params.")
        if (_int(params, "n", "sampling_params.") or 1) != 1:
            raise BadRequest("the stub engine supports n=1 only")
        ignore_eos = params.get("ignore_eos") is True
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        prompt_ids = list(ids)
    else:
        if kind == "responses":
            messages = _responses_messages(body)
            max_tokens = _int(body, "max_output_tokens")
            ignore_eos = body.get("ignore_eos") is True
        else:
            if "max_tokens" not in body:
                raise BadRequest("1 validation error:\n  body.max_tokens: Field required")
            max_tokens = _int(body, "max_tokens")
            if max_tokens is not None and max_tokens < 1:
                raise BadRequest("max_tokens must be positive")
            messages = _anthropic_messages(body)
        prompt_ids = textgen.encode_text(textgen.chat_template(messages))
    limit = config.default_max_tokens if max_tokens is None else max_tokens
    if limit < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {limit}.")
    if len(prompt_ids) + limit > config.max_model_len:
        raise BadRequest(f"This model's maximum context length is {config.max_model_len} "
                         "tokens.")
    model = body.get("model")
    return GenRequest(
        kind=kind, body=body, prompt_ids=prompt_ids, digest=textgen.prompt_digest(prompt_ids),
        max_tokens=limit, stream=body.get("stream") is True, include_usage=include_usage,
        continuous_usage=False, return_token_ids=False, ignore_eos=ignore_eos,
        model=model if isinstance(model, str) else config.model,
    )


# -- the prefix cache and usage -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheFigures:
    """What the prefix cache did for one prompt: tokens read from it, tokens written to it."""

    cached: int = 0
    created: int = 0


def openai_details(kind: str, cache: CacheFigures) -> dict[str, Any]:
    """``prompt_tokens_details`` of completions, chat and generate (vLLM reports what the
    cache wrote on chat only)."""
    return {"cached_tokens": cache.cached,
            "created_cache_tokens": cache.created if kind == "chat" else None,
            "multimodal_tokens": None}


def api_usage(kind: str, prompt: int, output: int, cache: CacheFigures,
              details: bool) -> dict[str, Any]:
    """The usage object of a Responses, Messages or generate answer."""
    if kind == "responses":
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cache.cached,
                                     "cache_write_tokens": cache.created,
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + output,
        }
    if kind == "messages":
        if not details:
            return {"input_tokens": prompt, "output_tokens": output}
        return {"input_tokens": prompt - cache.cached - cache.created, "output_tokens": output,
                "cache_creation_input_tokens": cache.created,
                "cache_read_input_tokens": cache.cached}
    return {"prompt_tokens": prompt, "total_tokens": prompt + output,
            "completion_tokens": output,
            "prompt_tokens_details": openai_details(kind, cache) if details else None,
            "completion_tokens_details": None}


# -- answers --------------------------------------------------------------------------------


@dataclass
class ApiAnswer:
    """Everything one answer needs: ids, the generated tokens, usage, engine extras."""

    gen: GenRequest
    response_id: str
    tokens: list[int]
    finish: str
    usage: dict[str, Any]
    style: Style = "vllm"
    #: Top-level keys an engine adds to its JSON answer (e.g. its hand-off).
    extra: dict[str, Any] | None = None
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    @property
    def text(self) -> str:
        return textgen.decode_tokens(self.tokens)


def _item_id(answer: ApiAnswer) -> str:
    return "msg_" + answer.response_id.rsplit("_", 1)[-1][:16]


def _response_object(answer: ApiAnswer, *, done: bool) -> dict[str, Any]:
    gen = answer.gen
    incomplete = done and answer.finish == "length"
    output: list[dict[str, Any]] = []
    if done:
        output.append({"id": _item_id(answer), "content": [
            {"annotations": [], "text": answer.text, "type": "output_text", "logprobs": None}],
            "role": "assistant", "status": "completed", "type": "message"})
    return {
        "id": answer.response_id, "created_at": answer.created,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": gen.body.get("instructions"), "metadata": None, "model": gen.model,
        "object": "response", "output": output, "parallel_tool_calls": True,
        "temperature": gen.body.get("temperature"), "tool_choice": "none", "tools": [],
        "background": False, "max_output_tokens": gen.body.get("max_output_tokens"),
        "previous_response_id": gen.body.get("previous_response_id"),
        "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
        "usage": answer.usage if done else None,
        **({"kv_transfer_params": None} if answer.style == "vllm" else {}),
    }


def render_responses_body(answer: ApiAnswer) -> dict[str, Any]:
    return {**_response_object(answer, done=True), **(answer.extra or {})}


def render_messages_body(answer: ApiAnswer) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": answer.response_id, "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": answer.text}], "model": answer.gen.model,
        "stop_reason": "max_tokens" if answer.finish == "length" else "end_turn",
        "stop_sequence": None, "usage": answer.usage,
    }
    # vLLM serializes the answer without null fields: the hand-off only when there is one.
    body.update({k: v for k, v in (answer.extra or {}).items() if v is not None})
    return body


def render_generate_body(answer: ApiAnswer) -> dict[str, Any]:
    return {
        "request_id": answer.response_id, "model": answer.gen.model, "created": answer.created,
        "usage": answer.usage, "prompt_logprobs": None, "prompt_token_ids": None,
        **(answer.extra or {}), "output_mode": "tokens",
        "choices": [{"index": 0, "finish_reason": answer.finish, "stop_reason": None,
                     "token_ids": answer.tokens, "logprobs": None}],
    }


def named_event(name: str, payload: dict[str, Any], style: Style, sequence: int | None
                ) -> bytes:
    """``event: NAME`` and its payload, its ``type`` (and ``sequence_number``) where the
    engine puts them: last (vLLM's models) or first (SGLang's dicts)."""
    fields: dict[str, Any] = {}
    if style == "sglang":
        fields["type"] = name
        if sequence is not None:
            fields["sequence_number"] = sequence
        fields.update(payload)
    else:
        fields.update(payload)
        if sequence is not None:
            fields["sequence_number"] = sequence
        fields["type"] = name
    return b"event: " + name.encode() + b"\ndata: " + jsonutil.dumps(fields) + b"\n\n"


async def responses_events(answer: ApiAnswer, config: StubConfig) -> AsyncIterator[bytes]:
    """response.created ... response.completed (vLLM sends ``completed`` when incomplete)."""
    style = answer.style
    seq = iter(range(1 << 30))
    item = _item_id(answer)
    started = _response_object(answer, done=False)
    yield named_event("response.created", {"response": started}, style, next(seq))
    yield named_event("response.in_progress", {"response": started}, style, next(seq))
    yield named_event("response.output_item.added", {
        "item": {"id": item, "content": [], "role": "assistant", "status": "in_progress",
                 "type": "message"}, "output_index": 0}, style, next(seq))
    yield named_event("response.content_part.added", {
        "content_index": 0, "item_id": item, "output_index": 0,
        "part": {"annotations": [], "text": "", "type": "output_text"}}, style, next(seq))
    for i, token in enumerate(answer.tokens):
        await pace(config, i)
        yield named_event("response.output_text.delta", {
            "content_index": 0, "delta": textgen.token_text(token), "item_id": item,
            "logprobs": [], "output_index": 0}, style, next(seq))
    text = answer.text
    yield named_event("response.output_text.done", {
        "content_index": 0, "item_id": item, "logprobs": [], "output_index": 0, "text": text},
        style, next(seq))
    part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text",
                            "logprobs": None}
    yield named_event("response.content_part.done", {
        "content_index": 0, "item_id": item, "output_index": 0, "part": part}, style, next(seq))
    yield named_event("response.output_item.done", {
        "item": {"id": item, "content": [part], "role": "assistant", "status": "completed",
                 "type": "message"}, "output_index": 0}, style, next(seq))
    yield named_event("response.completed", {"response": _response_object(answer, done=True)},
                      style, next(seq))


async def messages_events(answer: ApiAnswer, config: StubConfig) -> AsyncIterator[bytes]:
    """message_start ... message_stop (message_start's usage: the whole prompt, as vLLM)."""
    style = answer.style
    usage = answer.usage
    prompt = sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens",
                                               "cache_creation_input_tokens"))
    yield named_event("message_start", {"message": {
        "id": answer.response_id, "type": "message", "role": "assistant", "content": [],
        "model": answer.gen.model, "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 0}}}, style, None)
    yield named_event("content_block_start", {
        "content_block": {"type": "text", "text": ""}, "index": 0}, style, None)
    for i, token in enumerate(answer.tokens):
        await pace(config, i)
        yield named_event("content_block_delta", {
            "delta": {"type": "text_delta", "text": textgen.token_text(token)}, "index": 0},
            style, None)
    yield named_event("content_block_stop", {"index": 0}, style, None)
    yield named_event("message_delta", {
        "delta": {"stop_reason": "max_tokens" if answer.finish == "length" else "end_turn",
                  "stop_sequence": None}, "usage": usage}, style, None)
    yield named_event("message_stop", {}, style, None)


async def generate_events(answer: ApiAnswer, config: StubConfig) -> AsyncIterator[bytes]:
    """One token id per chunk, a usage chunk when asked, ``data: [DONE]``."""
    head = {"request_id": answer.response_id, "usage": None, "output_mode": "tokens"}
    for i, token in enumerate(answer.tokens):
        await pace(config, i)
        last = i == len(answer.tokens) - 1
        yield sse({**head, "choices": [{"index": 0, "finish_reason": answer.finish if last
                                        else None, "stop_reason": None, "token_ids": [token],
                                        "logprobs": None}]})
    if answer.gen.include_usage:
        yield sse({**head, "usage": answer.usage, "choices": []})
    yield SSE_DONE


EVENTS: Final[dict[str, Callable[[ApiAnswer, StubConfig], AsyncIterator[bytes]]]] = {
    "responses": responses_events, "messages": messages_events, "generate": generate_events}
BODIES: Final[dict[str, Callable[[ApiAnswer], dict[str, Any]]]] = {
    "responses": render_responses_body, "messages": render_messages_body,
    "generate": render_generate_body}


def stream_failure(kind: str, style: Style) -> bytes | None:
    """What the engine writes when its stream on ``kind`` fails after the head (None: it
    cuts the connection, as vLLM 0.32's Responses stream does: its error event fails its own
    validation)."""
    message = "stub fault: KV load failed"
    if kind == "responses":
        if style == "vllm":
            return None
        failed: dict[str, Any] = {"id": "resp_failed", "object": "response", "status": "failed",
                  "output": [], "usage": None,
                  "error": {"code": "server_error", "message": message}}
        return named_event("response.failed", {"response": failed}, style, 99)
    if kind == "messages":
        error = named_event("error", {"error": {"type": "internal_error", "message": message}},
                            "sglang", None)
        # SGLang closes the message after its error event; vLLM just ends the stream.
        return error + (named_event("message_stop", {}, style, None) if style == "sglang"
                        else b"")
    return (b"data: " + jsonutil.dumps({"error": {"message": message,
                                                  "type": "InternalServerError",
                                                  "code": 500}}) + b"\n\n" + SSE_DONE)
