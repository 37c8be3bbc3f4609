"""The TensorRT-LLM stub engine: ``trtllm-serve``'s OpenAI routes with disaggregated params.

Request bodies are validated by pydantic models with ``extra="forbid"``, as TRT-LLM's own
``OpenAIBaseModel`` does: an unknown field (e.g. ``kv_transfer_params``, or
``max_completion_tokens`` on ``/v1/completions``) is a 400
``{"object": "error", "message", "type": "BadRequestError", "param": null, "code": 400}``.

    context_only    (``disaggregated_params.request_type``): one token, then
                    choices[0].disaggregated_params = {request_type: "context_only",
                    first_gen_tokens: [t0], ctx_request_id, encoded_opaque_state (base64),
                    draft_tokens, disagg_request_id, ctx_dp_rank, ...} and top-level
                    prompt_token_ids
    generation_only checks the params against the prompt it is given (completions:
                    ``prompt`` as token ids; chat: ``prompt_token_ids``): the opaque state is
                    a keyed hash of (ctx_request_id, prompt digest, first token), so the
                    generation stub verifies it without calling the context stub. Valid:
                    remote output starting with first_gen_tokens; otherwise local output and
                    a recorded verdict.

Attention data parallelism (``data_parallel_size``): the OpenAI surface names no rank; each
server places a request on its next rank in turn, and the context server names its rank in
``ctx_dp_rank`` (covered by the opaque state: a generation request whose ``ctx_dp_rank`` was
changed is a mismatch).

``/v1/responses`` and ``/v1/messages`` are served whole, never as pairs (as TensorRT-LLM's
worker server: its Responses model forbids unknown fields, so ``disaggregated_params`` is a
400; its Anthropic adapter builds the chat request from Anthropic fields only, so the same
field is accepted and dropped); ``/inference/v1/generate`` is not served (404).

Deliberate limits: only the request fields clients send in practice are modelled (any other
is refused like an unknown one); the opaque state is not TRT-LLM's real encoding, only its
role (opaque, base64, tied to the context request).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import uuid
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from sidecar.tools.stubs import apis, openai, shapes, textgen
from sidecar.tools.stubs.apis import ApiAnswer, CacheFigures
from sidecar.tools.stubs.faults import FaultKind
from sidecar.tools.stubs.openai import BadRequest, GenRequest
from sidecar.tools.stubs.replies import JsonReply, Reply, StreamReply
from sidecar.tools.stubs.server import request_fault, request_json
from sidecar.tools.stubs.textgen import PrefillKind

if TYPE_CHECKING:
    from sidecar.tools.stubs.server import Stub

COMPLETIONS: Final = "/v1/completions"
CHAT: Final = "/v1/chat/completions"
CONTEXT_ONLY: Final = "context_only"
GENERATION_ONLY: Final = "generation_only"
REQUEST_TYPES: Final = (CONTEXT_ONLY, GENERATION_ONLY, "context_and_generation")
# TRT-LLM's global request ids live above 2**40; the stub's own ids start there too.
_ID_BASE: Final = 1 << 40


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DisaggregatedParams(_Strict):
    request_type: str
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list[Any] | None = None
    ctx_request_id: int | None = None
    encoded_opaque_state: str | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: Any = None
    schedule_style: Any = None
    conversation_id: str | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Sampling(_Strict):
    model: str
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int = 0
    top_p_min: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0
    early_stopping: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    lora_request: dict[str, Any] | None = None
    disaggregated_params: DisaggregatedParams | None = None


class CompletionRequest(_Sampling):
    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = None
    suffix: str | None = None
    prompt_ignore_length: int | None = 0
    return_context_logits: bool = False
    detokenize: bool = True


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_completion_tokens: int | None = Field(
        default=None, validation_alias=AliasChoices("max_completion_tokens", "max_tokens")
    )
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    reasoning_effort: str | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    store: bool | None = True
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None


def _error_type(status: int) -> str:
    return "BadRequestError" if status < 500 else "InternalServerError"


class TrtllmEngine:
    inference_paths: frozenset[str] = frozenset({COMPLETIONS, CHAT, apis.RESPONSES,
                                                 apis.MESSAGES})

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.config = stub.config
        self._key = hashlib.sha256(stub.config.secret.encode()).digest()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def add_routes(self, app: web.Application) -> None:
        self.stub.add_openai_routes(app, self._generate, self._models)
        app.router.add_post(apis.RESPONSES, self.stub.route(self._responses))
        app.router.add_post(apis.MESSAGES, self.stub.route(self._messages))

    def add_bootstrap_routes(self, app: web.Application) -> None:
        return None

    def error_body(self, status: int, message: str, path: str) -> Any:
        return {
            "object": "error",
            "message": message,
            "type": _error_type(status),
            "param": None,
            "code": status,
        }

    def metrics(self) -> list[str]:
        return shapes.metric_lines([
            ("counter", "trtllm_prompt_tokens_total", "", self.prompt_tokens),
            ("counter", "trtllm_generation_tokens_total", "", self.generation_tokens),
        ])

    def close(self) -> None:
        return None

    async def _models(self, request: web.Request) -> Reply:
        return JsonReply(shapes.models_body(self.config.model, "tensorrt_llm"))

    # -- opaque state ------------------------------------------------------------------

    def opaque_state(self, ctx_request_id: int, digest: int, first_token: int,
                     ctx_dp_rank: int = 0) -> str:
        msg = f"{ctx_request_id}:{digest:016x}:{first_token}".encode()
        if ctx_dp_rank:
            msg += f":{ctx_dp_rank}".encode()
        mac = hmac.new(self._key, msg, hashlib.sha256).digest()
        return base64.b64encode(b"stub-ctx-state\x00" + mac).decode()

    def _check(self, params: DisaggregatedParams, gen: GenRequest) -> tuple[PrefillKind, str]:
        if (
            params.ctx_request_id is None
            or not params.encoded_opaque_state
            or not params.first_gen_tokens
        ):
            return PrefillKind.LOCAL, "missing_params"
        try:
            base64.b64decode(params.encoded_opaque_state, validate=True)
        except (binascii.Error, ValueError):
            return PrefillKind.LOCAL, "malformed_handoff"
        expected = self.opaque_state(params.ctx_request_id, gen.digest, params.first_gen_tokens[0],
                                     params.ctx_dp_rank or 0)
        if not hmac.compare_digest(expected, params.encoded_opaque_state):
            return PrefillKind.LOCAL, "opaque_state_mismatch"
        return PrefillKind.REMOTE, "ok"

    # -- routes ------------------------------------------------------------------------

    async def _generate(self, request: web.Request, *, kind: str) -> Reply:
        body = request_json(request)
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req: CompletionRequest | ChatCompletionRequest = model.model_validate(body)
        except ValidationError as exc:
            raise BadRequest(str(exc)) from None
        prompt_ids = req.prompt_token_ids if isinstance(req, ChatCompletionRequest) else None
        return await self._serve(request, body, req, kind, prompt_ids)

    async def _serve(
        self,
        request: web.Request,
        body: dict[str, Any],
        req: CompletionRequest | ChatCompletionRequest,
        kind: str,
        prompt_ids: list[int] | None,
    ) -> Reply:
        if req.stream_options is not None and not req.stream:
            raise BadRequest("Stream options can only be defined when stream is true.")
        gen = openai.parse(body, kind, self.config, prompt_ids=prompt_ids)
        params = req.disaggregated_params
        request_type = params.request_type if params is not None else None
        if request_type is not None and request_type not in REQUEST_TYPES:
            raise BadRequest(f"Unknown request_type: {request_type}")
        fault = request_fault(request)
        rank = self.stub.ranks.place(None, request.path)  # its attention-DP balancer's pick
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        rendering = openai.new_rendering(response_id, gen.model)
        if kind == "completion" and getattr(req, "detokenize", True) is False:
            # detokenize=false: TRT-LLM returns the choice's token_ids (per streamed chunk, the
            # delta); the stub renders them where vLLM puts its return_token_ids.
            gen.return_token_ids = True
            rendering.vllm_token_ids = True
        if request_type == CONTEXT_ONLY and params is not None:
            if gen.stream:
                raise BadRequest("Context-only requests do not support streaming.")
            tokens, finish = textgen.generate(gen.digest, 1, PrefillKind.REMOTE)
            ctx_id = params.disagg_request_id or (_ID_BASE + self.stub.next_id())
            out_params: dict[str, Any] | None = {
                **DisaggregatedParams(request_type=CONTEXT_ONLY).model_dump(),
                "first_gen_tokens": tokens[:1],
                "ctx_request_id": ctx_id,
                "encoded_opaque_state": self.opaque_state(ctx_id, gen.digest, tokens[0], rank),
                "disagg_request_id": params.disagg_request_id,
                "ctx_dp_rank": rank,
            }
            if fault is not None and fault.kind is FaultKind.NO_HANDOFF:
                out_params = None
            rendering.choice_extra = {"disaggregated_params": out_params}
            rendering.top_extra = {"prompt_token_ids": gen.prompt_ids}
            return await self._finish(gen, rendering, tokens, finish)
        verdict = (PrefillKind.LOCAL, "no_handoff")
        if request_type == GENERATION_ONLY and params is not None:
            verdict = self._check(params, gen)
        if request_type == GENERATION_ONLY or self.config.role == "decode":
            self.stub.recorder.decide(request.path, response_id, verdict[0].value, verdict[1])
        tokens, finish = textgen.generate(
            gen.digest,
            gen.max_tokens,
            verdict[0],
            eos_rate=self.config.eos_rate,
            ignore_eos=gen.ignore_eos,
        )
        rendering.choice_extra = {"disaggregated_params": None}
        rendering.top_extra = {"prompt_token_ids": None}
        return await self._finish(gen, rendering, tokens, finish)

    async def _responses(self, request: web.Request) -> Reply:
        body = request_json(request)
        try:
            ResponsesRequest.model_validate(body)
        except ValidationError as exc:
            raise BadRequest(str(exc)) from None
        return await self._whole(request, body, "responses")

    async def _messages(self, request: web.Request) -> Reply:
        body = request_json(request)
        if isinstance(body, dict):
            # The Anthropic adapter reads Anthropic fields only: anything else is dropped.
            body = {k: v for k, v in body.items() if k != "disaggregated_params"}
        return await self._whole(request, body, "messages")

    async def _whole(self, request: web.Request, body: Any, kind: str) -> Reply:
        """A Responses or Messages request, run whole (a local verdict is recorded)."""
        gen = apis.parse_api(body, kind, self.config)
        response_id = f"resp_{uuid.uuid4().hex}" if kind == "responses" else (
            f"msg_{uuid.uuid4().hex}")
        if self.config.role == "decode":
            self.stub.recorder.decide(request.path, response_id, PrefillKind.LOCAL.value,
                                      "no_handoff")
        tokens, finish = textgen.generate(gen.digest, gen.max_tokens, PrefillKind.LOCAL,
                                          eos_rate=self.config.eos_rate,
                                          ignore_eos=gen.ignore_eos)
        self.prompt_tokens += len(gen.prompt_ids)
        self.generation_tokens += len(tokens)
        usage = apis.api_usage(kind, len(gen.prompt_ids), len(tokens), CacheFigures(), False)
        answer = ApiAnswer(gen, response_id, tokens, finish, usage, "trtllm")
        if gen.stream:
            return StreamReply(apis.EVENTS[kind](answer, self.config),
                               failure=apis.stream_failure(kind, "trtllm"))
        await openai.wait_tokens(self.config, len(tokens))
        return JsonReply(apis.BODIES[kind](answer))

    async def _finish(
        self, gen: GenRequest, rendering: openai.Rendering, tokens: list[int], finish: str
    ) -> Reply:
        self.prompt_tokens += len(gen.prompt_ids)
        self.generation_tokens += len(tokens)
        rendering.choice_extra["avg_decoded_tokens_per_iter"] = None
        rendering.chunk_choice_extra = {"avg_decoded_tokens_per_iter": None}
        if gen.stream:
            return StreamReply(openai.render_events(gen, rendering, tokens, finish, self.config))
        await openai.wait_tokens(self.config, len(tokens))
        body = openai.render_body(gen, rendering, tokens, finish)
        body["choices"][0].pop("prompt_logprobs", None)
        return JsonReply(body)
