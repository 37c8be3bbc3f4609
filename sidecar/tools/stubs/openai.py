"""OpenAI-compatible request parsing and response shapes shared by the stub engines.

``parse`` turns a ``/v1/completions`` or ``/v1/chat/completions`` body into a ``GenRequest``
(prompt token ids, limits, stream options) with vLLM-like validation errors; the ``render``
functions build the non-streamed body and the SSE events (one per token, usage chunk,
``data: [DONE]``) with engine-specific extras passed in by the caller:

    vLLM     top level: service_tier, system_fingerprint, kv_transfer_params (non-streamed);
             choice: stop_reason, prompt_logprobs; ``return_token_ids``: prompt_token_ids
             and token_ids (per choice; per chunk when streamed)
    TRT-LLM  top level: prompt_token_ids; choice: disaggregated_params
    SGLang   choice: matched_stop

Deliberate limits: one prompt and ``n`` == 1 only (a list of prompts or ``n`` > 1 is a 400:
the PD contracts carry one hand-off per request); no logprobs, tools or echo.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.tools.stubs import textgen
from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.replies import SSE_DONE, sse


class BadRequest(Exception):
    """A request the engine refuses with 400 (message as the engine words it)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class GenRequest:
    kind: str  # "completion" | "chat"
    body: dict[str, Any]
    prompt_ids: list[int]
    digest: int
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    ignore_eos: bool
    model: str
    extra: dict[str, Any] = field(default_factory=dict)


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer")
    return value


def prompt_ids_of(body: dict[str, Any], kind: str) -> list[int]:
    """The prompt token ids of a completion (``prompt``) or chat (``messages``) body."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        try:
            return textgen.encode_text(textgen.chat_template(messages))
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt cannot be empty")
        return textgen.encode_text(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("the stub engine serves one prompt per request (got a batch)")
    raise BadRequest("prompt must be a string or a non-empty list of token ids")


def tokenize(body: Any, max_model_len: int, *, chat: bool) -> dict[str, Any]:
    """A tokenizer endpoint's answer: vLLM's ``/tokenize`` (``chat``: messages too) and
    SGLang's ``/v1/tokenize`` (prompt only), as ``count``, ``max_model_len`` and ``tokens``."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if "messages" in body:
        if not chat:
            raise BadRequest("this tokenizer endpoint takes 'prompt' only")
        ids = prompt_ids_of(body, "chat")
    else:
        ids = prompt_ids_of(body, "completion")
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def ids_text(body: Any) -> str:
    """What a body's ``tokens`` read as (vLLM's ``/detokenize``, SGLang's
    ``/v1/detokenize``): the stub tokenizer's text of each id."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise BadRequest("tokens must be a list of non-negative integers")
    return textgen.decode_tokens(ids)


def check_limits(
    body: dict[str, Any],
    prompt_tokens: int,
    *,
    default_max_tokens: int,
    max_model_len: int,
    engine: str,
) -> tuple[int, bool, dict[str, Any]]:
    """vLLM's checks of ``n``, the token limits and the stream options, worded as vLLM words
    them; returns (max_tokens, stream, stream_options). ``engine`` names the refuser of n > 1.
    """
    n = _int_field(body, "n")
    if n is not None and n != 1:
        raise BadRequest(f"the {engine} engine supports n=1 only")
    max_tokens = _int_field(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.")
    min_tokens = _int_field(body, "min_tokens") or 0
    if min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    if prompt_tokens + max_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
            f"messages, {max_tokens} in the completion). Please reduce the length of the "
            "messages or completion."
        )
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object")
    return max_tokens, stream, options or {}


def parse(
    body: Any, kind: str, config: StubConfig, *, prompt_ids: list[int] | None = None
) -> GenRequest:
    """Validate an OpenAI body; ``prompt_ids`` overrides the prompt (TRT-LLM chat)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    ids = prompt_ids if prompt_ids is not None else prompt_ids_of(body, kind)
    max_tokens, stream, options = check_limits(
        body, len(ids), default_max_tokens=config.default_max_tokens,
        max_model_len=config.max_model_len, engine="stub",
    )
    model = body.get("model")
    return GenRequest(
        kind=kind,
        body=body,
        prompt_ids=ids,
        digest=textgen.prompt_digest(ids),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")),
        return_token_ids=body.get("return_token_ids") is True,
        ignore_eos=body.get("ignore_eos") is True,
        model=model if isinstance(model, str) else config.model,
    )


def usage(prompt_tokens: int, completion_tokens: int,
          details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }


@dataclass
class Rendering:
    """Everything a response needs besides the tokens; the extras are per engine."""

    response_id: str
    created: int
    model: str
    top_extra: dict[str, Any] = field(default_factory=dict)
    choice_extra: dict[str, Any] = field(default_factory=dict)
    chunk_choice_extra: dict[str, Any] = field(default_factory=dict)
    vllm_token_ids: bool = False  # vLLM return_token_ids placement
    #: The id keys of a chunk that carries none are left out (SGLang), not null (vLLM).
    null_ids_left_out: bool = False
    #: ``usage.prompt_tokens_details`` (vLLM with --enable-prompt-tokens-details), else None.
    prompt_details: dict[str, Any] | None = None


def new_rendering(response_id: str, model: str) -> Rendering:
    return Rendering(response_id=response_id, created=int(time.time()), model=model)


def render_body(gen: GenRequest, r: Rendering, tokens: list[int], finish: str) -> dict[str, Any]:
    """The non-streamed completion or chat body."""
    text = textgen.decode_tokens(tokens)
    if gen.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning_content": None,
            },
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    if r.vllm_token_ids:
        if gen.kind == "chat":
            choice["token_ids"] = tokens if gen.return_token_ids else None
        else:
            choice["prompt_token_ids"] = gen.prompt_ids if gen.return_token_ids else None
            choice["token_ids"] = tokens if gen.return_token_ids else None
    choice.update(r.choice_extra)
    body: dict[str, Any] = {
        "id": r.response_id,
        "object": obj,
        "created": r.created,
        "model": r.model,
        "choices": [choice],
        "usage": usage(len(gen.prompt_ids), len(tokens), r.prompt_details),
    }
    if r.vllm_token_ids and gen.kind == "chat":
        body["prompt_token_ids"] = gen.prompt_ids if gen.return_token_ids else None
    body.update(r.top_extra)
    return body


async def pace(config: StubConfig, index: int) -> None:
    """Latency shaping before token ``index`` (no await at all when disabled)."""
    delay = config.ttft_s if index == 0 else config.itl_s
    if delay > 0:
        await asyncio.sleep(delay)


async def render_events(
    gen: GenRequest,
    r: Rendering,
    tokens: list[int],
    finish: str,
    config: StubConfig,
    *,
    on_done: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    """SSE events: (chat: a role chunk,) one chunk per token, a usage chunk, [DONE]."""
    try:
        chat = gen.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": r.response_id, "object": obj, "created": r.created, "model": r.model}
        prompt_n = len(gen.prompt_ids)
        if chat:
            first: dict[str, Any] = {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if r.vllm_token_ids:
                # vLLM writes both in the role chunk, null when not asked.
                first["prompt_token_ids"] = gen.prompt_ids if gen.return_token_ids else None
                first["prompt_text"] = None
            yield sse(first)
        for i, token in enumerate(tokens):
            await pace(config, i)
            last = i == len(tokens) - 1
            text = textgen.token_text(token)
            choice: dict[str, Any]
            if chat:
                choice = {
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": None,
                    "finish_reason": finish if last else None,
                }
                if last:
                    choice["stop_reason"] = None
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish if last else None,
                    "stop_reason": None,
                }
            if r.vllm_token_ids:
                # vLLM writes the keys in every chunk (null when not asked); the prompt's ids
                # in the first completions chunk only.
                asked = gen.return_token_ids
                if not chat:
                    choice["prompt_token_ids"] = gen.prompt_ids if asked and i == 0 else None
                choice["token_ids"] = [token] if asked else None
                if r.null_ids_left_out:
                    for key in ("prompt_token_ids", "token_ids"):
                        if choice[key] is None:
                            del choice[key]
            choice.update(r.chunk_choice_extra)
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if gen.include_usage and gen.continuous_usage:
                chunk["usage"] = usage(prompt_n, i + 1, r.prompt_details)
            elif not chat:
                chunk["usage"] = None
            yield sse(chunk)
        if not tokens and chat:
            yield sse(
                {
                    **head,
                    "choices": [
                        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
                    ],
                }
            )
        if gen.include_usage:
            yield sse({**head, "choices": [],
                       "usage": usage(prompt_n, len(tokens), r.prompt_details)})
        yield SSE_DONE
    finally:
        if on_done is not None:
            on_done()


async def wait_tokens(config: StubConfig, n: int) -> None:
    """The time a non-streamed answer of ``n`` tokens takes with latency shaping."""
    total = (config.ttft_s if n else 0.0) + config.itl_s * max(n - 1, 0)
    if total > 0:
        await asyncio.sleep(total)
