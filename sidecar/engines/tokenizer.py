"""How long a prompt is, and which tokens it holds: the placement decision's prompt facts.

    await measure.prompt(route, body, ids=False, memo=None)   ─▶ Prompt(tokens, ids)
        token-id prompts        exact: the array (and its ids); never tokenized
        text and chat           --prompt-length-source estimate: UTF-8 bytes / 4 (no ids)
                                tokenize: the local engine's tokenizer endpoint
        ids=True (the cache rule needs the ids, and its index can answer): text and chat are
                                tokenized whatever the source says (an estimate cannot match
                                KV blocks); one call serves both rules
        memo                    one request's tokenizations: a fan-out's sub-requests that
                                share a prompt (n > 1) tokenize it once

Keyed like the engine, or not at all: the ids asked for are the ids the engine will compute
and key its KV blocks by, or none (``Prompt.ids`` None: the cache rule does not run the
request locally). So the tokenizer gets what changes the ids (the dialect's
``TokenizeEndpoint.prompt_fields``, e.g. whether special tokens are added; chat: what changes
the rendering, ``chat_fields``), and a request whose blocks the engine keys apart from a
plain prompt's gets no ids: one naming another model than the engine's served one (a LoRA
adapter: its blocks carry the adapter), one with a field the dialect lists in
``unkeyed_fields`` (a cache salt, a truncation the tokenizer does not apply), a chat message
with a part that is not text (other media key their blocks by their content).

The tokenizer endpoint is the dialect's (``Dialect.tokenize``: a path, and whether it takes
chat ``messages``; chat prompts of an engine whose endpoint does not are estimated, and so are
Responses and Messages prompts, with no ids). A tokenize call has its own small budget
(``--tokenize-timeout-s``): past it, or failing in any way, the prompt's ids are unknown (the
request is decided without them, never failed, never delayed further), counted in
``disagg_tokenize_failures_total{reason}``: ``timeout``, ``rejected`` (4xx), ``failed``
(unreachable, 5xx, not JSON), ``malformed_answer`` (no usable ``count`` or ``tokens``).

Deliberate limits: multimodal chat parts are not counted by the estimate; a memo lives as
long as one client request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any, Final, NamedTuple, Protocol

from sidecar import jsonutil
from sidecar.config.limits import PromptLengthSource
from sidecar.dialects.base import TokenizeEndpoint
from sidecar.errors import DeadlineExceeded, EngineRejected, SidecarError
from sidecar.protocol.context import Route
from sidecar.protocol.prompt_length import estimate_tokens, exact_token_ids

logger = logging.getLogger(__name__)

_MAX_TOKENIZE_ANSWER: Final = 16 * 1024 * 1024
_JSON_HEADERS: Final = {"Content-Type": "application/json"}
_TOKENIZED: Final = frozenset({Route.COMPLETIONS, Route.CHAT})
MODEL: Final = "model"


class PostLocal(Protocol):
    """POSTs a small JSON call to the local engine (``EngineCalls.post_local``)."""

    async def __call__(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], *,
                       max_bytes: int) -> dict[str, Any]: ...


class Prompt(NamedTuple):
    """A prompt's token count and its token ids, keyed as the engine keys its blocks (None:
    unknown)."""

    tokens: int | None
    ids: Sequence[int] | None = None


UNKNOWN: Final = Prompt(None)
#: One client request's tokenizations, by the tokenize call's body (a fan-out shares them).
Memo = MutableMapping[bytes, Prompt]


class TokenizeFailed(Exception):
    """The tokenize call gave no usable answer; ``reason`` is the metric label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PromptMeasure:
    """Measures prompts for the placement decision (see the module docstring)."""

    def __init__(
        self,
        *,
        source: PromptLengthSource = PromptLengthSource.ESTIMATE,
        endpoint: TokenizeEndpoint | None = None,
        post_local: PostLocal | None = None,
        timeout_s: float = 5.0,
        on_tokenize_failure: Callable[[str], None] | None = None,
        served_model: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        """``served_model``: the local engine's served model (a request naming another
        cannot be keyed: its blocks are an adapter's); None: every model name is the one."""
        self._tokenize = source is PromptLengthSource.TOKENIZE
        self._endpoint = endpoint if post_local is not None else None
        self._post_local = post_local
        self._timeout_s = timeout_s
        self._on_tokenize_failure = on_tokenize_failure
        self._served_model = served_model

    async def prompt_tokens(self, route: Route, body: Mapping[str, Any]) -> int | None:
        """The prompt's token count (exact, tokenized or estimated); None when unknown."""
        return (await self.prompt(route, body)).tokens

    async def prompt(self, route: Route, body: Mapping[str, Any], *, ids: bool = False,
                     memo: Memo | None = None) -> Prompt:
        """The prompt's count, and its ids when ``ids`` asks for them and they can be had
        keyed as the engine keys its blocks."""
        if ids and not await self._keyed(body):
            ids = False  # its blocks are keyed apart: the count alone
        exact = exact_token_ids(route, body)
        if exact is not None:
            return Prompt(len(exact), exact if ids else None)
        endpoint = self._endpoint
        # Tokenizer endpoints take a completions prompt or chat messages: the other APIs'
        # prompts are estimated.
        if (not (self._tokenize or ids) or endpoint is None or route not in _TOKENIZED
                or (route is Route.CHAT and not endpoint.chat)
                or (ids and route is Route.CHAT and not _text_only(body))):
            return Prompt(estimate_tokens(route, body))
        request = _tokenize_request(endpoint, route, body)
        key = jsonutil.dumps(request) if memo is not None else b""
        if memo is not None and (known := memo.get(key)) is not None:
            return known if ids else Prompt(known.tokens)
        try:
            measured = await self._tokenized(endpoint, request, ids=ids)
        except TokenizeFailed as failure:
            if self._on_tokenize_failure is not None:
                self._on_tokenize_failure(failure.reason)
            logger.info("tokenize call failed (%s): the prompt's tokens are unknown",
                        failure.reason)
            measured = UNKNOWN
        if memo is not None:
            memo[key] = measured
        return measured if ids else Prompt(measured.tokens)

    async def _keyed(self, body: Mapping[str, Any]) -> bool:
        """Whether the engine keys this request's blocks as a plain prompt's."""
        endpoint = self._endpoint
        if endpoint is not None and any(body.get(field) is not None
                                        for field in endpoint.unkeyed_fields):
            return False
        model = body.get(MODEL)
        if model is None or self._served_model is None:
            return True
        try:
            return bool(model == await self._served_model())
        except SidecarError:
            return False  # what the engine serves is unknown: so is this request's key

    async def _tokenized(self, endpoint: TokenizeEndpoint, request: Mapping[str, Any], *,
                         ids: bool) -> Prompt:
        try:
            async with asyncio.timeout(self._timeout_s):
                assert self._post_local is not None  # no endpoint without it
                answer = await self._post_local(endpoint.path, request, _JSON_HEADERS,
                                                max_bytes=_MAX_TOKENIZE_ANSWER)
        except (TimeoutError, DeadlineExceeded):
            raise TokenizeFailed("timeout") from None
        except EngineRejected:
            raise TokenizeFailed("rejected") from None
        except SidecarError:
            raise TokenizeFailed("failed") from None
        count = answer.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise TokenizeFailed("malformed_answer")
        if not ids:
            return Prompt(count)
        tokens = answer.get("tokens")
        if not (isinstance(tokens, list) and len(tokens) == count
                and all(type(token) is int for token in tokens)):
            raise TokenizeFailed("malformed_answer")
        return Prompt(count, tokens)


def _tokenize_request(endpoint: TokenizeEndpoint, route: Route,
                      body: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenizer's body: the prompt, and what changes the ids it computes."""
    request: dict[str, Any] = {}
    if MODEL in body:
        request[MODEL] = body[MODEL]
    if route is Route.CHAT:
        request["messages"] = body.get("messages")
        request.update({k: body[k] for k in endpoint.chat_fields if k in body})
    else:
        prompt = body.get("prompt")
        request["prompt"] = prompt[0] if isinstance(prompt, list) else prompt
        request.update({k: body[k] for k in endpoint.prompt_fields if k in body})
    return request


def _text_only(body: Mapping[str, Any]) -> bool:
    """True when every chat message's content is text (another part keys its own blocks)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                not isinstance(part, dict) or part.get("type") != "text" for part in content):
            return False
    return True
