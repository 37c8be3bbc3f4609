"""Conditional disaggregation: a short prompt runs whole on the local engine.

    await local.is_short(route, body, request_id)      (the PD flow asks, ``sidecar.core.flow``)
        prompt length <= --local-prefill-max-tokens ─▶ True: the client's body to the local
                                                       engine (no prefill leg, no hand-off)
        otherwise (or the length is unknown)        ─▶ False: a PD pair

Prompt length:

- token-id prompts: exact (the array's length; the generate route's ``token_ids``);
- text and chat, ``--prompt-length-source estimate``: ``sidecar.protocol.prompt_length``
  (UTF-8 bytes / 4; docs/driving/request-shapes.md states its measured error);
- ``tokenize``: the local engine's tokenizer endpoint, as its dialect declares it
  (``Dialect.tokenize``: a path, and whether it takes chat ``messages``; chat prompts of an
  engine whose endpoint does not are estimated, and so are Responses and Messages prompts).
  A tokenize call that fails in any way disaggregates the request (never an error), counted in
  ``disagg_tokenize_failures_total{reason}``: ``timeout``, ``rejected`` (4xx), ``failed``
  (unreachable, 5xx, not JSON), ``malformed_answer`` (no usable ``count``).

The decision is logged at debug level and the request counted with outcome ``local_short``.

Deliberate limits: a tokenize call costs a round trip to the local engine before the request
starts (bounded by ``--connect-timeout-s``); multimodal chat parts are not counted by the
estimate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from sidecar.config.limits import PromptLengthSource
from sidecar.dialects.base import TokenizeEndpoint
from sidecar.errors import DeadlineExceeded, EngineRejected, SidecarError
from sidecar.protocol.context import Route
from sidecar.protocol.prompt_length import estimate_tokens, exact_tokens

logger = logging.getLogger(__name__)

_MAX_TOKENIZE_ANSWER: Final = 16 * 1024 * 1024
_JSON_HEADERS: Final = {"Content-Type": "application/json"}
_TOKENIZED: Final = frozenset({Route.COMPLETIONS, Route.CHAT})


class PostLocal(Protocol):
    """POSTs a small JSON call to the local engine (``EngineCalls.post_local``)."""

    async def __call__(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], *,
                       max_bytes: int) -> dict[str, Any]: ...


class TokenizeFailed(Exception):
    """The tokenize call gave no usable count; ``reason`` is the metric label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LocalPrefill:
    """Decides per request whether its prompt is short enough to run on the local engine."""

    def __init__(
        self,
        max_tokens: int,
        *,
        source: PromptLengthSource = PromptLengthSource.ESTIMATE,
        endpoint: TokenizeEndpoint | None = None,
        post_local: PostLocal | None = None,
        timeout_s: float = 5.0,
        on_tokenize_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.max_tokens = max_tokens
        self._tokenize = source is PromptLengthSource.TOKENIZE and post_local is not None
        self._endpoint = endpoint
        self._post_local = post_local
        self._timeout_s = timeout_s
        self._on_tokenize_failure = on_tokenize_failure

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    async def prompt_tokens(self, route: Route, body: Mapping[str, Any]) -> int | None:
        """The prompt's token count (exact, tokenized or estimated); None when unknown."""
        exact = exact_tokens(route, body)
        if exact is not None:
            return exact
        endpoint = self._endpoint
        # Tokenizer endpoints take a completions prompt or chat messages: the other APIs'
        # prompts are estimated.
        if (not self._tokenize or endpoint is None or route not in _TOKENIZED
                or (route is Route.CHAT and not endpoint.chat)):
            return estimate_tokens(route, body)
        try:
            return await self._tokenized(endpoint, route, body)
        except TokenizeFailed as failure:
            if self._on_tokenize_failure is not None:
                self._on_tokenize_failure(failure.reason)
            logger.info("tokenize call failed (%s): the request is disaggregated",
                        failure.reason)
            return None

    async def _tokenized(
        self, endpoint: TokenizeEndpoint, route: Route, body: Mapping[str, Any]
    ) -> int:
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
                assert self._post_local is not None  # _tokenize is False without it
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
        return count

    async def is_short(self, route: Route, body: Mapping[str, Any], request_id: str) -> bool:
        """True when the prompt runs whole on the local engine (logged at debug level)."""
        if not self.enabled:
            return False
        tokens = await self.prompt_tokens(route, body)
        short = tokens is not None and tokens <= self.max_tokens
        logger.debug("request %s: prompt of %s tokens, limit %d: %s", request_id,
                     "unknown" if tokens is None else tokens, self.max_tokens,
                     "local (no prefill leg)" if short else "disaggregated")
        return short
