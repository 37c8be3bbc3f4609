"""Conditional disaggregation: a short prompt runs whole on the local engine.

    LocalPrefill.start(orchestrator, PDRequest)
        prompt length <= --local-prefill-max-tokens ─▶ the client's body to the local engine
                                                       (no prefill leg, no hand-off fields)
        otherwise (or the length is unknown)        ─▶ orchestrator.start(request): a PD pair

Prompt length:

- token-id prompts: exact (the array's length);
- text and chat, ``--prompt-length-source estimate``: ``sidecar.protocol.prompt_length``
  (UTF-8 bytes / 4; README states its measured error);
- ``tokenize``: the local engine's tokenizer endpoint (``TOKENIZE_ENDPOINTS``: vLLM's
  ``/tokenize`` takes ``prompt`` or chat ``messages``; SGLang's ``/v1/tokenize`` takes
  ``prompt`` only, so SGLang chat prompts are estimated). A tokenize call that fails in any
  way disaggregates the request (never an error), counted in
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
from dataclasses import dataclass
from typing import Any, Final

from sidecar.config.settings import PromptLengthSource, Settings
from sidecar.core.exchange import PDExchange
from sidecar.core.orchestrator import Orchestrator, PDRequest
from sidecar.errors import DeadlineExceeded, EngineRejected, SidecarError
from sidecar.protocol.context import HandoffContext, Route
from sidecar.protocol.prompt_length import estimate_tokens, exact_tokens

logger = logging.getLogger(__name__)

_MAX_TOKENIZE_ANSWER: Final = 16 * 1024 * 1024
_JSON_HEADERS: Final = {"Content-Type": "application/json"}


@dataclass(frozen=True, slots=True)
class TokenizeEndpoint:
    """An engine's tokenizer endpoint: its path, and whether it takes chat messages."""

    path: str
    chat: bool


#: Engines with a tokenizer endpoint (TensorRT-LLM's server has none: refused at start-up).
TOKENIZE_ENDPOINTS: Final[Mapping[str, TokenizeEndpoint]] = {
    "vllm": TokenizeEndpoint("/tokenize", chat=True),
    "sglang": TokenizeEndpoint("/v1/tokenize", chat=False),
}

#: Fields of a chat request that change how vLLM's ``/tokenize`` renders its messages.
_CHAT_TEMPLATE_FIELDS: Final = (
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "tools", "mm_processor_kwargs",
)


class TokenizeFailed(Exception):
    """The tokenize call gave no usable count; ``reason`` is the metric label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LocalPrefill:
    """Decides per request whether its prompt is short enough to run on the local engine."""

    def __init__(
        self,
        settings: Settings,
        *,
        on_tokenize_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.max_tokens = settings.local_prefill_max_tokens
        self._tokenize = settings.prompt_length_source is PromptLengthSource.TOKENIZE
        self._endpoint = TOKENIZE_ENDPOINTS.get(settings.engine)
        self._timeout_s = settings.connect_timeout_s
        self._on_tokenize_failure = on_tokenize_failure

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    async def prompt_tokens(
        self, orchestrator: Orchestrator, route: Route, body: Mapping[str, Any]
    ) -> int | None:
        """The prompt's token count (exact, tokenized or estimated); None when unknown."""
        exact = exact_tokens(route, body)
        if exact is not None:
            return exact
        endpoint = self._endpoint
        if not self._tokenize or endpoint is None or (route is Route.CHAT and not endpoint.chat):
            return estimate_tokens(route, body)
        try:
            return await self._tokenized(orchestrator, endpoint, route, body)
        except TokenizeFailed as failure:
            if self._on_tokenize_failure is not None:
                self._on_tokenize_failure(failure.reason)
            logger.info("tokenize call failed (%s): the request is disaggregated",
                        failure.reason)
            return None

    async def _tokenized(
        self,
        orchestrator: Orchestrator,
        endpoint: TokenizeEndpoint,
        route: Route,
        body: Mapping[str, Any],
    ) -> int:
        request: dict[str, Any] = {}
        if "model" in body:
            request["model"] = body["model"]
        if route is Route.CHAT:
            request["messages"] = body.get("messages")
            request.update({k: body[k] for k in _CHAT_TEMPLATE_FIELDS if k in body})
        else:
            prompt = body.get("prompt")
            request["prompt"] = prompt[0] if isinstance(prompt, list) else prompt
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = await orchestrator.post_local(endpoint.path, request, _JSON_HEADERS,
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

    async def is_short(
        self, orchestrator: Orchestrator, route: Route, body: Mapping[str, Any], request_id: str
    ) -> bool:
        """True when the prompt runs whole on the local engine (logged at debug level)."""
        if not self.enabled:
            return False
        tokens = await self.prompt_tokens(orchestrator, route, body)
        short = tokens is not None and tokens <= self.max_tokens
        logger.debug("request %s: prompt of %s tokens, limit %d: %s", request_id,
                     "unknown" if tokens is None else tokens, self.max_tokens,
                     "local (no prefill leg)" if short else "disaggregated")
        return short

    async def start(self, orchestrator: Orchestrator, request: PDRequest) -> PDExchange:
        """Run ``request`` as a PD pair, or whole on the local engine when its prompt is short.

        A local run's exchange has ``local`` set; the relay treats it as any decode.
        """
        if not await self.is_short(orchestrator, request.route, request.body,
                                   request.request_id):
            return await orchestrator.start(request)
        return await start_local(orchestrator, request)


async def start_local(orchestrator: Orchestrator, request: PDRequest) -> PDExchange:
    """The client's own body on the local engine: no prefill leg, no hand-off fields."""
    ctx = HandoffContext(route=request.route, request_id=request.request_id,
                         prefill=request.target, advertise_host=request.target.host)
    decode = await orchestrator.open_decode(
        request.route, request.body, request.headers, request.trace
    )
    return PDExchange(ctx=ctx, decode=decode, local=True)
