"""The vLLM stub engine: OpenAI routes shaped like vLLM's, with a KV connector.

    POST /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages,
         /inference/v1/generate (``scale_out``; else 403, as without --enable-scale-out)
      parse (vLLM-like 400s) -> decode side: connector.check_handoff -> remote | local
      -> generate -> prefill side: connector.after_prefill -> kv_transfer_params
      -> JSON (kv_transfer_params at top level) or SSE (no params, as vLLM)
    POST /tokenize, /detokenize (the byte-level tokenizer's ids; an id list read as text)
    GET /health (200, empty), /v1/models (``model``, its ``root``), /metrics (vllm:* lines;
        ``vllm:cache_config_info`` with the KV cache's dtype)

``return_token_ids`` as vLLM 0.32 streams it: ``token_ids`` in every chunk, the prompt's in
the first (completions: on the choice; chat: at the role chunk's top level), both ``null``
when not asked.

Usage as vLLM 0.32 reports it on each leg (``prefix_cache.PrefixCache``, a fixed number of
blocks evicted least recently used first, whose KV events go to ``kv_events_endpoint`` as
vLLM's ``--kv-events-config`` sends them: ``kv_events``): a prompt's cached and newly written
full blocks (in ``prompt_tokens_details`` only with ``prompt_tokens_details``, as
``--enable-prompt-tokens-details``; Responses always); a NIXL decode reports the prefill's
hits (``remote_prefill_cached_tokens``), a Mooncake decode the whole prompt, and neither
reports what the cache wrote. The Responses route keeps no state: ``previous_response_id``
answers 404 and ``background`` 400, as vLLM without its response store.

Ids as vLLM makes them: ``cmpl-<X-Request-Id or uuid hex>`` (chat: ``chatcmpl-``); the
internal request id (``remote_request_id``) adds ``-0-<suffix>``, so prefill and decode
never share an internal id. Errors: ``{"error": {"message", "type", "param", "code"}}``.

Roles: a prefill stub never acts on ``do_remote_prefill``, a decode stub never holds KV for
``do_remote_decode``; ``both`` does either, as ``kv_both``. A decode stub records a verdict
for every generation request (``no_handoff`` when none came).

Data parallelism (``data_parallel_size``, ``ranks``): each request runs on the rank its
``X-data-parallel-rank`` header names (vLLM's rules: a malformed value is ignored, out of
range is a 400), else the next in turn; a prefill's hand-off names its rank's engine id
(``<id>_dp<rank>``), and ``/metrics`` counts requests per rank (``engine="<rank>"``).

Deliberate limits: see ``openai`` (one prompt, n=1) and ``vllm_connectors``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from sidecar.tools.stubs import apis, openai, shapes, textgen
from sidecar.tools.stubs.apis import API_PATHS, ApiAnswer, CacheFigures
from sidecar.tools.stubs.faults import FaultKind
from sidecar.tools.stubs.handoff import Verdict
from sidecar.tools.stubs.kv_events import KVEventsPublisher
from sidecar.tools.stubs.openai import BadRequest, GenRequest
from sidecar.tools.stubs.prefix_cache import PrefixCache
from sidecar.tools.stubs.ranks import VLLM_RANK_HEADER
from sidecar.tools.stubs.replies import SSE_DONE, JsonReply, Reply, StreamReply, sse
from sidecar.tools.stubs.server import request_fault, request_json
from sidecar.tools.stubs.textgen import PrefillKind
from sidecar.tools.stubs.vllm_connectors import INTERNAL_ID, EngineFailed, make_connector

if TYPE_CHECKING:
    from sidecar.tools.stubs.server import Stub

COMPLETIONS: Final = "/v1/completions"
CHAT: Final = "/v1/chat/completions"

_ERROR_TYPES: Final = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def failed_event(message: str) -> bytes:
    """vLLM's in-stream error event of a failed generation (``GenerationError``)."""
    return sse({"error": {"message": message, "type": "InternalServerError", "param": None,
                          "code": 500}})


async def _one(payload: bytes) -> AsyncIterator[bytes]:
    yield payload


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def base_request_id(request: web.Request) -> str:
    return request.headers.get("X-Request-Id") or uuid.uuid4().hex


#: The response id prefix of each route, as vLLM makes them.
_ID_PREFIXES: Final = {"completion": "cmpl-", "chat": "chatcmpl-", "responses": "resp_",
                       "messages": "chatcmpl-", "generate": "generate-tokens-"}
_SCALE_OUT_DISABLED: Final = ("Scale-out endpoints are disabled. Restart vllm serve with "
                              "--enable-scale-out to enable them.")


class VllmEngine:
    inference_paths: frozenset[str] = frozenset({COMPLETIONS, CHAT, *API_PATHS.values()})

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.config = stub.config
        self.connector = make_connector(stub)
        config = stub.config
        self.publisher = None if config.kv_events_endpoint is None else KVEventsPublisher(
            config.kv_events_endpoint, config.kv_events_topic)
        self.cache = PrefixCache(config.block_size, config.kv_cache_blocks, self.publisher)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.running = 0

    def add_routes(self, app: web.Application) -> None:
        self.stub.add_openai_routes(app, self._generate, self._models)
        for kind, path in API_PATHS.items():
            app.router.add_post(path, self.stub.route(functools.partial(self._generate,
                                                                        kind=kind)))
        app.router.add_post("/tokenize", self.stub.route(self._tokenize))
        app.router.add_post("/detokenize", self.stub.route(self._ids_text))
        self.connector.add_routes(app)

    def add_bootstrap_routes(self, app: web.Application) -> None:
        self.connector.add_bootstrap_routes(app)

    def error_body(self, status: int, message: str, path: str) -> Any:
        return {
            "error": {"message": message, "type": error_type(status), "param": None, "code": status}
        }

    def metrics(self) -> list[str]:
        label = f'model_name="{self.config.model}"'
        lines = shapes.metric_lines([
            ("gauge", "vllm:num_requests_running", label, self.running),
            ("gauge", "vllm:num_requests_waiting", label, 0),
            ("counter", "vllm:prompt_tokens_total", label, self.prompt_tokens),
            ("counter", "vllm:generation_tokens_total", label, self.generation_tokens),
            ("gauge", "stub_kv_blocks_held", "", self.connector.held()),
            # Its CacheConfig as labels (vLLM: ``log_metrics_info``), the fields a sidecar
            # reads and a few others.
            ("gauge", "vllm:cache_config_info",
             f'block_size="{self.config.block_size}",cache_dtype="{self.config.kv_cache_dtype}",'
             'enable_prefix_caching="True",engine="0"', 1.0),
        ])
        if self.stub.ranks.size > 1:
            lines += self.stub.ranks.metric_lines("vllm:request_success_total",
                                                  self.config.model)
        return lines

    def close(self) -> None:
        self.connector.close()
        if self.publisher is not None:
            self.publisher.close()

    async def _models(self, request: web.Request) -> Reply:
        return JsonReply(shapes.models_body(
            self.config.model, "vllm", root=self.config.root, parent=None,
            max_model_len=self.config.max_model_len,
            permission=[],
        ))

    async def _tokenize(self, request: web.Request) -> Reply:
        return JsonReply(openai.tokenize(request_json(request), self.config.max_model_len,
                                         chat=True))

    async def _ids_text(self, request: web.Request) -> Reply:
        return JsonReply({"prompt": openai.ids_text(request_json(request))})

    def _parse(self, body: Any, kind: str) -> GenRequest:
        if kind == "generate" and not self.config.scale_out:
            raise BadRequest(_SCALE_OUT_DISABLED, status=403)
        if kind not in API_PATHS:
            return openai.parse(body, kind, self.config)
        gen = apis.parse_api(body, kind, self.config)
        if kind == "responses":
            previous = gen.body.get("previous_response_id")
            if previous is not None:
                # No response store (VLLM_ENABLE_RESPONSES_API_STORE unset): nothing is kept.
                raise BadRequest(f"Response with id '{previous}' not found.", status=404)
            if gen.body.get("background") is True:
                raise BadRequest("This vLLM engine does not support store=True and therefore "
                                 "does not support the background mode.")
        return gen

    def _cache_figures(self, gen: GenRequest, verdict: Verdict) -> CacheFigures:
        """What this leg reports of the prompt's cache (see the module docstring); the
        prompt's blocks are in the cache afterwards either way (a decode keeps what it
        pulled, as vLLM's does)."""
        salt = gen.body.get("cache_salt")
        local = self.cache.use(gen.prompt_ids, salt if isinstance(salt, str) else None)
        params = gen.body.get("kv_transfer_params")
        if (isinstance(params, dict) and params.get("do_remote_prefill")
                and verdict.kind is PrefillKind.REMOTE):
            if self.config.kv_connector in ("mooncake", "nixl-push"):
                return CacheFigures(cached=len(gen.prompt_ids))
            cached = params.get("remote_prefill_cached_tokens")
            return CacheFigures(cached=cached if isinstance(cached, int) else 0)
        return local

    async def _generate(self, request: web.Request, *, kind: str) -> Reply:
        body = request_json(request)
        gen = self._parse(body, kind)
        params = gen.body.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise BadRequest("kv_transfer_params must be an object or null")
        ranks = self.stub.ranks
        rank = ranks.place(ranks.vllm_named(request.headers.get(VLLM_RANK_HEADER)),
                           request.path)
        base = base_request_id(request)
        response_id = f"{_ID_PREFIXES[kind]}{base}"
        internal_id = f"{response_id}-0-{self.stub.next_id():08x}"
        gen.extra[INTERNAL_ID] = internal_id
        try:
            verdict = await self._decode_side(request, gen, internal_id)
        except EngineFailed as failed:
            if not gen.stream:
                raise BadRequest(failed.message, status=500) from None
            return StreamReply(_one(failed_event(failed.message) + SSE_DONE))
        tokens, finish = textgen.generate(
            gen.digest,
            gen.max_tokens,
            verdict.kind,
            eos_rate=self.config.eos_rate,
            ignore_eos=gen.ignore_eos,
        )
        cache = self._cache_figures(gen, verdict)
        gen.extra["cached_tokens"] = cache.cached
        fault = request_fault(request)
        kv_params = None
        if self.config.role != "decode":
            kv_params = self.connector.after_prefill(gen, internal_id, finish, fault, rank)
        if fault is not None and fault.kind is FaultKind.NO_HANDOFF:
            kv_params = None
        self.prompt_tokens += len(gen.prompt_ids)
        self.generation_tokens += len(tokens)
        if kind in API_PATHS:
            return await self._api_reply(gen, response_id, tokens, finish, cache, kv_params)
        rendering = openai.new_rendering(response_id, gen.model)
        if self.config.prompt_tokens_details:
            rendering.prompt_details = apis.openai_details(kind, cache)
        rendering.vllm_token_ids = True
        rendering.top_extra = {"service_tier": None, "system_fingerprint": None}
        if gen.stream:
            self.running += 1
            return StreamReply(
                openai.render_events(
                    gen, rendering, tokens, finish, self.config, on_done=self._done
                )
            )
        rendering.top_extra["kv_transfer_params"] = kv_params
        # vLLM 0.32 answers carry these too (tests/fixtures/vllm/0.32.0), null unless used.
        rendering.top_extra["ec_transfer_params"] = None
        rendering.top_extra["metrics"] = None
        await openai.wait_tokens(self.config, len(tokens))
        return JsonReply(openai.render_body(gen, rendering, tokens, finish))

    async def _api_reply(self, gen: GenRequest, response_id: str, tokens: list[int],
                         finish: str, cache: CacheFigures,
                         kv_params: dict[str, Any] | None) -> Reply:
        kind = gen.kind
        usage = apis.api_usage(kind, len(gen.prompt_ids), len(tokens), cache,
                               self.config.prompt_tokens_details)
        extra: dict[str, Any] = {"kv_transfer_params": kv_params}
        if kind != "messages":
            extra["ec_transfer_params"] = None
        answer = ApiAnswer(gen, response_id, tokens, finish, usage, "vllm", extra)
        if gen.stream:
            self.running += 1
            return StreamReply(self._counted(apis.EVENTS[kind](answer, self.config)),
                               failure=apis.stream_failure(kind, "vllm"))
        await openai.wait_tokens(self.config, len(tokens))
        return JsonReply(apis.BODIES[kind](answer))

    async def _counted(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        finally:
            self._done()

    def _done(self) -> None:
        self.running -= 1

    async def _decode_side(self, request: web.Request, gen: GenRequest, request_id: str) -> Verdict:
        params = gen.body.get("kv_transfer_params")
        prefill_leg = isinstance(params, dict) and bool(params.get("do_remote_decode"))
        if self.config.role == "prefill":
            # A prefill computes the KV a decode continues from: the "remote" generation.
            if prefill_leg or self.config.kv_connector == "nixl":
                return Verdict(PrefillKind.REMOTE, "prefill")
            return Verdict(PrefillKind.LOCAL, "prefill_role")
        if prefill_leg and self.config.role == "both":
            return Verdict(PrefillKind.REMOTE, "prefill")
        verdict = await self.connector.check_handoff(gen)
        if verdict is None:
            verdict = Verdict(PrefillKind.LOCAL, "no_handoff")
            if self.config.role != "decode":
                return verdict  # a plain request on a kv_both engine: nothing to judge
        self.stub.recorder.judge(request.path, request_id, verdict)
        return verdict
