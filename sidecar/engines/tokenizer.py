"""How long a prompt is, and which tokens it holds: the placement decision's prompt facts.

    await measure.prompt(route, body, ids=False)   ─▶ Prompt(tokens, ids)
        token-id prompts        exact: the array (and its ids); never tokenized
        text and chat           --prompt-length-source estimate: UTF-8 bytes / 4 (no ids)
                                tokenize: the local engine's tokenizer endpoint
        ids=True (the cache rule needs the ids): text and chat are always tokenized, whatever
                                the source says (an estimate cannot match KV blocks); one call
                                serves both rules

The tokenizer endpoint is the dialect's (``Dialect.tokenize``: a path, and whether it takes
chat ``messages``; chat prompts of an engine whose endpoint does not are estimated, and so are
Responses and Messages prompts, with no ids). A tokenize call that fails in any way leaves the
prompt unknown (the request is disaggregated, never failed), counted in
``disagg_tokenize_failures_total{reason}``: ``timeout``, ``rejected`` (4xx), ``failed``
(unreachable, 5xx, not JSON), ``malformed_answer`` (no usable ``count`` or ``tokens``).

Deliberate limits: a tokenize call costs a round trip to the local engine before the request
starts (bounded by ``--connect-timeout-s``); multimodal chat parts are not counted by the
estimate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple, Protocol

from sidecar.config.limits import PromptLengthSource
from sidecar.dialects.base import TokenizeEndpoint
from sidecar.errors import DeadlineExceeded, EngineRejected, SidecarError
from sidecar.protocol.context import Route
from sidecar.protocol.prompt_length import estimate_tokens, exact_token_ids

logger = logging.getLogger(__name__)

_MAX_TOKENIZE_ANSWER: Final = 16 * 1024 * 1024
_JSON_HEADERS: Final = {"Content-Type": "application/json"}
_TOKENIZED: Final = frozenset({Route.COMPLETIONS, Route.CHAT})


class PostLocal(Protocol):
    """POSTs a small JSON call to the local engine (``EngineCalls.post_local``)."""

    async def __call__(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], *,
                       max_bytes: int) -> dict[str, Any]: ...


class Prompt(NamedTuple):
    """A prompt's token count and its token ids (None: unknown)."""

    tokens: int | None
    ids: Sequence[int] | None = None


UNKNOWN: Final = Prompt(None)


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
    ) -> None:
        self._tokenize = source is PromptLengthSource.TOKENIZE
        self._endpoint = endpoint if post_local is not None else None
        self._post_local = post_local
        self._timeout_s = timeout_s
        self._on_tokenize_failure = on_tokenize_failure

    async def prompt_tokens(self, route: Route, body: Mapping[str, Any]) -> int | None:
        """The prompt's token count (exact, tokenized or estimated); None when unknown."""
        return (await self.prompt(route, body)).tokens

    async def prompt(self, route: Route, body: Mapping[str, Any], *, ids: bool = False) -> Prompt:
        """The prompt's count, and its ids when ``ids`` asks for them and they can be had."""
        exact = exact_token_ids(route, body)
        if exact is not None:
            return Prompt(len(exact), exact)
        endpoint = self._endpoint
        # Tokenizer endpoints take a completions prompt or chat messages: the other APIs'
        # prompts are estimated.
        if (not (self._tokenize or ids) or endpoint is None or route not in _TOKENIZED
                or (route is Route.CHAT and not endpoint.chat)):
            return Prompt(estimate_tokens(route, body))
        try:
            return await self._tokenized(endpoint, route, body, ids=ids)
        except TokenizeFailed as failure:
            if self._on_tokenize_failure is not None:
                self._on_tokenize_failure(failure.reason)
            logger.info("tokenize call failed (%s): the request is disaggregated",
                        failure.reason)
            return UNKNOWN

    async def _tokenized(self, endpoint: TokenizeEndpoint, route: Route,
                         body: Mapping[str, Any], *, ids: bool) -> Prompt:
        request: dict[str, Any] = {}
        if "model" in body:
            request["model"] = body["model"]
        if route is Route.CHAT:
            request["messages"] = body.get("messages")
            request.update({k: body[k] for k in endpoint.chat_fields if k in body})
        else:
            prompt = body.get("prompt")
            request["prompt"] = prompt[0] if isinstance(prompt, list) else prompt
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
