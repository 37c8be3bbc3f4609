"""How an engine continues an answer another engine began: which requests it can continue
exactly, and the body that does (engine knowledge for ``sidecar.request.migration``).

    refusal(route, body)                 why ``body`` cannot be continued token for token, or
                                         None (the reasons: ``sidecar.request.migration``)
    continuation_body(route, body, prompt_ids, ids, places)
        ─▶ (route, body)                 the rest of the answer as a token-in request: the
                                         prompt's ids and the answer's so far as the prompt,
                                         the token limits lowered by what was produced, every
                                         sampling field the client sent (its seed too)

A completions or chat answer continues on the completions route (the engines here take a
token-id ``prompt`` there, and no chat route takes one); a token-in answer on its own route.
The ids come back (``TokenIdPlaces.ask``) so that a second failure can move again.

Why each refusal (Dynamo's list of what cannot be replayed, request-migration.md, and these
engines' request models):

- ``guided_decoding``: a grammar (JSON schema, regex, choice, grammar, structural tag; a
  required or named tool choice) restarts at its root on the new engine;
- ``logprobs``: the continuation's prompt changes what prompt logprobs mean, and each
  engine's logprobs shape would have to be rebuilt;
- ``penalties``: presence and frequency penalties count the answer's tokens, which the
  continuation sees as prompt;
- ``tools``: the engine parses tool calls out of a chat answer's text; a completions
  continuation's raw text would not be parsed;
- ``engine_state``: multimodal parts (their placeholder ids need the engine's processed
  media), prompt embeddings, an engine session;
- ``fanned_out``: several choices in one stream.

Stop strings are checked later, against the text the client has (``stop_strings``). Sampled
answers continue with the same sampling fields and seed: a valid sample, not the very tokens
the dead engine would have drawn (its random stream restarts); greedy answers are exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from sidecar.protocol.context import Route
from sidecar.protocol.continuation import PromptIds, TokenIdPlaces

GUIDED_DECODING: Final = "guided_decoding"
LOGPROBS: Final = "logprobs"
PENALTIES: Final = "penalties"
TOOLS: Final = "tools"
ENGINE_STATE: Final = "engine_state"
FANNED_OUT: Final = "fanned_out"

PROMPT: Final = "prompt"
MAX_TOKENS: Final = "max_tokens"
MAX_COMPLETION_TOKENS: Final = "max_completion_tokens"
MIN_TOKENS: Final = "min_tokens"
STREAM: Final = "stream"
SAMPLING_PARAMS: Final = "sampling_params"

#: Fields that constrain the answer to a grammar (vLLM's and SGLang's names, OpenAI's).
_GUIDED: Final = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend",
                  "regex", "ebnf", "json_schema", "structural_tag")
_LOGPROBS: Final = ("logprobs", "top_logprobs", "prompt_logprobs")
_PENALTIES: Final = ("presence_penalty", "frequency_penalty")
_STATE: Final = ("prompt_embeds", "session_params", "session_id", "multi_modal_data",
                 "mm_processor_kwargs")
#: Chat-only fields: what a chat answer's completions continuation leaves out (its prompt is
#: the chat template's ids already).
_CHAT_ONLY: Final = frozenset({
    "messages", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "response_format", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "documents", "max_completion_tokens", "reasoning_effort",
    "include_reasoning", "top_logprobs", "modalities", "audio", "prediction", "store",
    "metadata", "web_search_options", "service_tier", "add_special_tokens", "echo",
    "return_tokens_as_token_ids", "separate_reasoning", "stream_reasoning",
})
#: Fields a continuation never carries: the prompt is already what the engine saw.
_NOT_CONTINUED: Final = ("echo", "suffix", "truncate_prompt_tokens", "n", "best_of")


#: Every top-level field a refusal reads but the messages: a body with none of them is
#: continued (one set intersection, the common case, on every streamed request).
_READ: Final = frozenset({"n", "best_of", *_GUIDED, "response_format", "tool_choice",
                          *_LOGPROBS, *_PENALTIES, "tools", *_STATE, "features",
                          "content_parts", SAMPLING_PARAMS})


def refusal(route: Route, body: Mapping[str, Any]) -> str | None:
    """Why ``body`` cannot be continued token for token on another engine, or None."""
    if not _READ.isdisjoint(body):
        reason = _fields_refusal(route, body)
        if reason is not None:
            return reason
    if route is Route.CHAT and _has_media(body.get("messages")):
        return ENGINE_STATE
    return None


def _fields_refusal(route: Route, body: Mapping[str, Any]) -> str | None:
    params = body.get(SAMPLING_PARAMS) if route is Route.GENERATE else body
    fields = params if isinstance(params, Mapping) else {}
    if any(fields.get(key) not in (None, False, 1) for key in ("n", "best_of")):
        return FANNED_OUT
    if any(_set(fields.get(key)) for key in _GUIDED) or _guided_format(body):
        return GUIDED_DECODING
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) or choice == "required":
        return GUIDED_DECODING
    if any(_set(fields.get(key)) for key in _LOGPROBS):
        return LOGPROBS
    if any(fields.get(key) not in (None, 0, 0.0) for key in _PENALTIES):
        return PENALTIES
    if route is Route.CHAT and _set(body.get("tools")) and choice != "none":
        return TOOLS
    if any(_set(body.get(key)) for key in _STATE):
        return ENGINE_STATE
    if route is Route.GENERATE and any(_set(body.get(key)) for key in ("features",
                                                                        "content_parts")):
        return ENGINE_STATE
    return None


def _set(value: object) -> bool:
    return value not in (None, False, "", [], {})


def _guided_format(body: Mapping[str, Any]) -> bool:
    fmt = body.get("response_format")
    return isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text")


def _has_media(messages: object) -> bool:
    """True when a chat message holds a part that is not text."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
                isinstance(part, Mapping) and part.get("type") not in ("text", None)
                for part in content):
            return True
    return False


def continuation_body(route: Route, body: Mapping[str, Any], prompt_ids: Sequence[int],
                      ids: Sequence[int], places: TokenIdPlaces) -> tuple[Route, dict[str, Any]]:
    """The rest of ``body``'s answer as a token-in request on another engine (see the module
    docstring): the route it goes to and its body."""
    produced = len(ids)
    if route is Route.GENERATE:
        # The prompt's ids went to the client in its first chunk; the continuation's first
        # would carry a longer prompt.
        continued = {k: v for k, v in body.items() if k != "return_token_ids"}
        continued[places.prompt_key] = [*prompt_ids, *ids]
        params = body.get(SAMPLING_PARAMS)
        sampling = dict(params) if isinstance(params, Mapping) else {}
        _lower(sampling, produced)
        continued[SAMPLING_PARAMS] = sampling
        continued[STREAM] = True
        return Route.GENERATE, continued
    dropped = _CHAT_ONLY if route is Route.CHAT else frozenset()
    continued = {k: v for k, v in body.items()
                 if k not in dropped and k not in _NOT_CONTINUED and k != "messages"}
    if route is Route.CHAT:
        limit = body.get(MAX_COMPLETION_TOKENS)
        if limit is None:
            limit = body.get(MAX_TOKENS)
        continued.pop(MAX_TOKENS, None)
        if limit is not None:
            continued[MAX_TOKENS] = limit
    continued[PROMPT] = [*prompt_ids, *ids]
    _lower(continued, produced)
    continued[STREAM] = True
    continued.update(places.ask)
    return Route.COMPLETIONS, continued


def _lower(fields: dict[str, Any], produced: int) -> None:
    """The token bounds less what the answer has (an absent bound stays absent: the engine's
    default is what is left of its context, then as before)."""
    limit = fields.get(MAX_TOKENS)
    if isinstance(limit, int) and not isinstance(limit, bool):
        fields[MAX_TOKENS] = limit - produced
    least = fields.get(MIN_TOKENS)
    if isinstance(least, int) and not isinstance(least, bool) and least:
        fields[MIN_TOKENS] = max(least - produced, 0)


#: vLLM's and SGLang's completions stream: each choice's ``token_ids``, the prompt's in the
#: first chunk's choice (vLLM writes both as null when not asked; SGLang leaves them out).
def completions_places(*, unasked_null: bool) -> TokenIdPlaces:
    return TokenIdPlaces(ask={"return_token_ids": True}, ids_key="token_ids",
                         prompt_key="prompt_token_ids", prompt=PromptIds.CHOICE,
                         unasked_null=unasked_null)


#: vLLM's chat stream: each choice's ``token_ids``, the prompt's at the first chunk's top;
#: asked, a chunk whose delta a parser held back (``{}``) is written for its ids alone
#: (``chat_completion/serving.py``: skipped unasked unless it finishes or has logprobs).
VLLM_CHAT: Final = TokenIdPlaces(
    ask={"return_token_ids": True}, ids_key="token_ids", prompt_key="prompt_token_ids",
    prompt=PromptIds.TOP,
    asked_only=b'"delta":{},"logprobs":null,"finish_reason":null,"token_ids":null}')
#: vLLM's token-in stream: ids always, the prompt is the request's.
VLLM_GENERATE: Final = TokenIdPlaces(ask={}, ids_key="token_ids", prompt_key="token_ids",
                                     prompt=PromptIds.REQUEST)
