"""The OpenAI completions and chat completions APIs (``/v1/completions``,
``/v1/chat/completions``): the rules every engine's prefill leg on them follows
(docs/driving/handoffs.md#common-rules), their body checks, usage and error shapes.

    prefill leg = the client body with max_tokens 1 (max_completion_tokens 1 when sent, or
                  deleted where the engine rejects it), no min_tokens / min_completion_tokens,
                  stream false, no stream_options

Only top-level keys are touched, and inputs are never mutated: ``messages``, ``tools`` and
every nested value stay the very objects the client sent (stable tokenization, prefix-cache
hits). ``n`` above 1 and batched completions prompts fan out (``sidecar.protocol.fanout``).
A stream carries usage only when the client asks (``stream_options.include_usage``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from sidecar.errors import InvalidRequest
from sidecar.jsonutil import type_name
from sidecar.protocol.apis.base import (
    PREFILL_MAX_TOKENS,
    STREAM,
    STREAM_OPTIONS,
    Api,
    check_int_or_null,
    check_object_list,
    is_int,
    is_token_ids,
)
from sidecar.protocol.context import Route

MAX_TOKENS: Final = "max_tokens"
MAX_COMPLETION_TOKENS: Final = "max_completion_tokens"
MIN_TOKENS: Final = "min_tokens"
MIN_COMPLETION_TOKENS: Final = "min_completion_tokens"
N: Final = "n"
PROMPT: Final = "prompt"
MESSAGES: Final = "messages"

#: Token-limit fields the sidecar rewrites on the prefill leg: int or null.
INT_OR_NULL_FIELDS: Final = (MAX_TOKENS, MAX_COMPLETION_TOKENS, MIN_TOKENS)


def openai_prefill_base(
    client_body: Mapping[str, Any], *, drop_max_completion_tokens: bool = False
) -> dict[str, Any]:
    """The client body as a prefill leg: one token, not streamed, no lower token bounds.

    ``max_completion_tokens`` is capped only when the client sent it (vLLM's reference proxy;
    vLLM prefers it over ``max_tokens`` on chat), or deleted for engines that reject it
    (TensorRT-LLM).
    """
    body = dict(client_body)
    body[MAX_TOKENS] = PREFILL_MAX_TOKENS
    if drop_max_completion_tokens:
        body.pop(MAX_COMPLETION_TOKENS, None)
    elif MAX_COMPLETION_TOKENS in body:
        body[MAX_COMPLETION_TOKENS] = PREFILL_MAX_TOKENS
    # An engine refuses min_tokens > max_tokens; a one-token prefill cannot honour them.
    body.pop(MIN_TOKENS, None)
    body.pop(MIN_COMPLETION_TOKENS, None)
    # The hand-off comes back only on a non-streamed answer.
    body[STREAM] = False
    body.pop(STREAM_OPTIONS, None)
    return body


def asks_usage(body: Mapping[str, Any]) -> bool:
    """True when a streamed body asks for usage chunks (``stream_options``)."""
    options = body.get(STREAM_OPTIONS)
    return isinstance(options, Mapping) and bool(
        options.get("include_usage") or options.get("continuous_usage_stats"))


class _OpenAIApi(Api):
    control_keys = frozenset({MAX_TOKENS, MAX_COMPLETION_TOKENS, MIN_TOKENS,
                              MIN_COMPLETION_TOKENS, STREAM, STREAM_OPTIONS, N})

    def check(self, body: dict[str, Any]) -> None:
        stream = body.get(STREAM)
        if stream is not None and not isinstance(stream, bool):
            raise InvalidRequest(f"'stream' must be a boolean, got {type_name(stream)}")
        check_int_or_null(body, INT_OR_NULL_FIELDS)
        n = body.get(N)
        if n is not None and not is_int(n):
            raise InvalidRequest(f"'n' must be an integer, got {type_name(n)}")

    def choices(self, body: Mapping[str, Any]) -> int:
        n = body.get(N)
        return n if is_int(n) and n > 1 else 1

    def prefill_base(
        self, body: Mapping[str, Any], *, drop_max_completion_tokens: bool = False
    ) -> dict[str, Any]:
        return openai_prefill_base(body, drop_max_completion_tokens=drop_max_completion_tokens)

    def stream_has_usage(self, body: Mapping[str, Any]) -> bool:
        return asks_usage(body)


class CompletionsApi(_OpenAIApi):
    route = Route.COMPLETIONS

    def check(self, body: dict[str, Any]) -> None:
        super().check(body)
        if PROMPT not in body:
            raise InvalidRequest("'prompt' is required")
        prompt = body[PROMPT]
        if isinstance(prompt, str):
            return
        if not isinstance(prompt, list):
            raise InvalidRequest(
                f"'prompt' must be a string or an array of token ids, got {type_name(prompt)}"
            )
        if not prompt:
            raise InvalidRequest("'prompt' must not be an empty array")
        if is_token_ids(prompt):
            return
        if all(isinstance(item, str) for item in prompt):
            return
        if all(isinstance(item, list) and item and is_token_ids(item) for item in prompt):
            return
        raise InvalidRequest(
            "'prompt' must be a string, an array of token ids, or an array of strings or of "
            "non-empty token-id arrays (not both)"
        )

    def batch(self, body: Mapping[str, Any]) -> list[Any] | None:
        """The prompts of a checked body holding several, else None."""
        prompt = body[PROMPT]
        if isinstance(prompt, list) and len(prompt) > 1 and not is_token_ids(prompt):
            return list(prompt)
        return None


class ChatApi(_OpenAIApi):
    route = Route.CHAT

    def check(self, body: dict[str, Any]) -> None:
        super().check(body)
        check_object_list(body, MESSAGES)
