"""The SGLang stub engine: ``/generate`` and OpenAI routes with the bootstrap rendezvous.

The same body (with ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``) goes to
prefill and decode at the same time; they meet on the prefill's bootstrap server:

    prefill (room R): wait until a decode reaches room R        (bootstrap_timeout_s)
                      -> hand over the prompt digest -> answer with 1 token
    decode  (room R): GET http://bootstrap_host:bootstrap_port/_stub/sglang/rooms/R
                      (parks until the prefill of R hands over)  (waiting_timeout_s)
                      -> same prompt: remote output; other prompt: local output (recorded)

Either side may arrive first. A timeout answers 500 with SGLang's wording
(``KVTransferError(bootstrap_room=R): Request R timed out after 30.0s in
KVPoll.Bootstrapping`` / ``KVPoll.WaitingForInput``). A prefill that fails before the
rendezvous (a fault switch, ``no_handoff``) leaves its decode waiting until the timeout,
as the real engines do. ``POST /abort_request {"rid", "abort_all"}`` (200, empty body)
ends a waiting request with finish_reason ``abort``.

The Responses and Messages routes (``/v1/responses``, ``/v1/messages``) rendezvous the same
way (SGLang 0.5.23 reads the bootstrap fields at their top level); a Responses request's
engine id is its ``request_id`` (its ``rid`` elsewhere), and one naming stored state answers
400 (SGLang refuses its response store in PD mode). ``/inference/v1/generate`` is not
served (404). Their events are SGLang's: ``type`` first; a failed Responses stream ends with
``response.failed``, a failed Messages stream with ``error`` then ``message_stop``.

``/generate`` shapes: ``{"text", "output_ids", "meta_info": {"id", "finish_reason":
{"type": "length", "length": n}, "prompt_tokens", "completion_tokens", "cached_tokens",
"e2e_latency"}}``; streamed as ``data:`` events with cumulative text and ids, then
``data: [DONE]``. Errors: ``/generate`` ``{"error": {"message"}}``, OpenAI routes
``{"object": "error", "message", "type", "param", "code"}``.

Data parallelism (``data_parallel_size`` P, SGLang 0.5.23's rules): a request runs on the
rank its ``routed_dp_rank`` names (out of range: 400), else a prefill on ``room % P``
(``follow_bootstrap_room``) and a decode on the next in turn. A prefill placed off
``room % P`` without ``disagg_prefill_dp_rank`` fails as SGLang's conflict check does. Rooms
live per prefill rank; a decode meets its prefill on the rank its ``disagg_prefill_dp_rank``
names, else the one the prefill's bootstrap server derives (0 with one rank, else
``room % P``): a decode looking on another rank waits until it times out.

Deliberate limits: one prompt per request, one bootstrap server for every rank, the rid
comes from the body's ``rid``, else ``X-Request-Id``, else a fresh uuid.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

import aiohttp
from aiohttp import web

from sidecar.tools.stubs import apis, handoff, openai, shapes, textgen
from sidecar.tools.stubs.apis import ApiAnswer, CacheFigures
from sidecar.tools.stubs.faults import FaultKind
from sidecar.tools.stubs.openai import BadRequest
from sidecar.tools.stubs.replies import SSE_DONE, JsonReply, Reply, StreamReply, json_response, sse
from sidecar.tools.stubs.server import request_fault, request_json
from sidecar.tools.stubs.textgen import PrefillKind

if TYPE_CHECKING:
    from sidecar.tools.stubs.server import Stub

GENERATE: Final = "/generate"
COMPLETIONS: Final = "/v1/completions"
CHAT: Final = "/v1/chat/completions"
ROOM_PATH: Final = "/_stub/sglang/rooms/{room}"
ROUTED_DP_RANK: Final = "routed_dp_rank"
DISAGG_PREFILL_DP_RANK: Final = "disagg_prefill_dp_rank"

T = TypeVar("T")


class _Aborted(Exception):
    pass


class _Failed(BadRequest):
    """A rendezvous that failed: answered 500 in SGLang's words (see ``handoff.sglang_*``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 500)


@dataclass
class _Room:
    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    handed_over: asyncio.Future[dict[str, Any]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass
class _Prompt:
    ids: list[int]
    digest: int
    max_tokens: int
    ignore_eos: bool
    stream: bool


_STORE_DISABLED: Final = ("Response store is disabled. Stateful Responses require "
                          "--enable-response-store on a standalone server; response storage "
                          "is unavailable in PD mode.")


class SglangEngine:
    inference_paths: frozenset[str] = frozenset({GENERATE, COMPLETIONS, CHAT, apis.RESPONSES,
                                                 apis.MESSAGES})

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.config = stub.config
        #: Rooms by (prefill rank, room).
        self.rooms: dict[tuple[int, int], _Room] = {}
        self.aborts: dict[str, asyncio.Event] = {}
        self.running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # -- plumbing ----------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(GENERATE, self.stub.route(self._generate))
        self.stub.add_openai_routes(app, self._openai, self._models)
        for kind in ("responses", "messages"):
            app.router.add_post(apis.API_PATHS[kind],
                                self.stub.route(functools.partial(self._openai, kind=kind)))
        app.router.add_post("/abort_request", self._abort_request)
        app.router.add_get("/health_generate", self._health_generate)
        app.router.add_post("/v1/tokenize", self.stub.route(self._tokenize))
        app.router.add_post("/v1/detokenize", self.stub.route(self._ids_text))

    def add_bootstrap_routes(self, app: web.Application) -> None:
        app.router.add_get(ROOM_PATH, self._room_handler)
        app.router.add_get("/health", self._health_generate)

    def error_body(self, status: int, message: str, path: str) -> Any:
        if path == GENERATE:
            return {"error": {"message": message}}
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        return {"object": "error", "message": message, "type": kind, "param": None, "code": status}

    def metrics(self) -> list[str]:
        label = f'model_name="{self.config.model}"'
        return shapes.metric_lines([
            ("gauge", "sglang:num_running_reqs", label, self.running),
            ("gauge", "sglang:num_queue_reqs", label, 0),
            ("counter", "sglang:prompt_tokens_total", label, self.prompt_tokens),
            ("counter", "sglang:generation_tokens_total", label, self.generation_tokens),
            ("gauge", "stub_bootstrap_rooms", "", len(self.rooms)),
        ])

    def close(self) -> None:
        for event in self.aborts.values():
            event.set()

    def _room(self, key: tuple[int, int]) -> _Room:
        room = self.rooms.get(key)
        if room is None:
            room = self.rooms[key] = _Room()
        return room

    def _forget(self, key: tuple[int, int], room: _Room) -> None:
        if self.rooms.get(key) is room:
            del self.rooms[key]

    async def _health_generate(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _tokenize(self, request: web.Request) -> Reply:
        return JsonReply(openai.tokenize(request_json(request), self.config.max_model_len,
                                         chat=False))

    async def _ids_text(self, request: web.Request) -> Reply:
        return JsonReply({"text": openai.ids_text(request_json(request))})

    async def _models(self, request: web.Request) -> Reply:
        limit = self.config.max_model_len
        return JsonReply(shapes.models_body(self.config.model, "sglang", root=self.config.root,
                                            max_model_len=limit))

    async def _abort_request(self, request: web.Request) -> web.StreamResponse:
        try:
            body = request_json(request)
        except BadRequest:
            body = None
        if not isinstance(body, dict):
            return json_response({"error": {"message": "body must be a JSON object"}}, 400)
        if body.get("abort_all"):
            for event in self.aborts.values():
                event.set()
        else:
            target = self.aborts.get(str(body.get("rid", "")))
            if target is not None:
                target.set()
        return web.Response(status=200)

    async def _wait(self, aw: Awaitable[T], abort: asyncio.Event, timeout_s: float) -> T:
        """``aw``'s result; raises TimeoutError at the deadline, _Aborted on abort."""
        work = asyncio.ensure_future(aw)
        aborted = asyncio.ensure_future(abort.wait())
        try:
            done, _ = await asyncio.wait(
                {work, aborted}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if work in done:
                return work.result()
            if aborted in done:
                raise _Aborted
            raise TimeoutError
        finally:
            for task in (work, aborted):
                if not task.done():
                    task.cancel()

    # -- the bootstrap server (prefill side) -------------------------------------------

    async def _room_handler(self, request: web.Request) -> web.StreamResponse:
        try:
            room_id = int(request.match_info["room"])
            timeout_s = float(request.query.get("timeout", self.config.waiting_timeout_s))
            hint = request.query.get("prefill_rank")
            rank = int(hint) if hint is not None else self._derived_rank(room_id)
        except ValueError:
            return json_response({"error": "bad room, rank or timeout"}, 400)
        key = (rank, room_id)
        room = self._room(key)
        room.decode_arrived.set()
        try:
            async with asyncio.timeout(timeout_s):
                payload = await asyncio.shield(room.handed_over)
        except TimeoutError:
            self._forget(key, room)
            return json_response({"error": "prefill did not hand over in time"}, 408)
        except asyncio.CancelledError:
            # The decode went away: the room is free again, the prefill keeps waiting.
            if not room.handed_over.done():
                room.decode_arrived.clear()
            raise
        self._forget(key, room)
        return json_response(payload)

    def _derived_rank(self, room_id: int) -> int:
        """The prefill rank a decode without a hint finds (SGLang's ``follow_bootstrap_room``)."""
        size = self.stub.ranks.size
        return 0 if size == 1 else room_id % size

    def _prefill_rank(self, body: dict[str, Any], room_id: int) -> int:
        """Where a prefill runs: its ``routed_dp_rank``, else ``room % P``; off that without a
        ``disagg_prefill_dp_rank`` is SGLang's follow_bootstrap_room conflict."""
        ranks = self.stub.ranks
        named = ranks.sglang_named(body.get(ROUTED_DP_RANK))
        implied = self._derived_rank(room_id)
        rank = implied if named is None else named
        if ranks.size > 1 and rank != implied and body.get(DISAGG_PREFILL_DP_RANK) is None:
            raise _Failed(
                f"follow_bootstrap_room conflict: dispatched to dp_rank {rank} but "
                f"bootstrap_room {room_id} implies dp_rank {implied}."
            )
        return rank

    # -- request handling --------------------------------------------------------------

    def _rid(self, request: web.Request, body: dict[str, Any]) -> str:
        rid = body.get("request_id" if request.path == apis.RESPONSES else "rid")
        if isinstance(rid, str) and rid:
            return rid
        return request.headers.get("X-Request-Id") or uuid.uuid4().hex

    async def _handoff(
        self, request: web.Request, body: dict[str, Any], rid: str, prompt: _Prompt
    ) -> tuple[PrefillKind, bool]:
        """Run this request's side of the rendezvous: (kind, is_prefill)."""
        try:
            room_id = handoff.sglang_room(body)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        abort = self.aborts[rid]
        ranks = self.stub.ranks
        if self.config.role == "prefill":
            if room_id is None:
                ranks.place(ranks.sglang_named(body.get(ROUTED_DP_RANK)), request.path)
                return PrefillKind.LOCAL, False
            rank = ranks.place(self._prefill_rank(body, room_id), request.path)
            fault = request_fault(request)
            if fault is not None and fault.kind is FaultKind.NO_HANDOFF:
                return PrefillKind.REMOTE, True  # answers, never meets its decode
            await self._prefill_rendezvous((rank, room_id), rid, prompt, abort)
            return PrefillKind.REMOTE, True
        ranks.place(ranks.sglang_named(body.get(ROUTED_DP_RANK)), request.path)
        target = handoff.sglang_decode_target(body, room_id)
        if isinstance(target, handoff.Verdict):
            self.stub.recorder.judge(request.path, rid, target)
            return target.kind, False
        hint = body.get(DISAGG_PREFILL_DP_RANK)
        if hint is not None and (isinstance(hint, bool) or not isinstance(hint, int)):
            raise BadRequest("disagg_prefill_dp_rank must be an integer")
        payload = await self._decode_rendezvous(target, rid, abort, hint)
        try:
            handed = int(str(payload.get("prompt_digest")), 16)
        except ValueError:
            handed = -1
        verdict = handoff.sglang_judge(handed, prompt.digest)
        self.stub.recorder.judge(request.path, rid, verdict)
        return verdict.kind, False

    async def _prefill_rendezvous(
        self, key: tuple[int, int], rid: str, prompt: _Prompt, abort: asyncio.Event
    ) -> None:
        room = self._room(key)
        timeout_s = self.config.bootstrap_timeout_s
        try:
            await self._wait(room.decode_arrived.wait(), abort, timeout_s)
        except TimeoutError:
            self._forget(key, room)
            raise _Failed(handoff.sglang_prefill_timeout(rid, key[1], timeout_s)) from None
        except (_Aborted, asyncio.CancelledError):
            self._forget(key, room)
            raise
        if not room.handed_over.done():
            room.handed_over.set_result(
                {"prompt_digest": f"{prompt.digest:016x}", "prompt_tokens": len(prompt.ids)}
            )

    async def _decode_rendezvous(
        self, target: handoff.Rendezvous, rid: str, abort: asyncio.Event,
        prefill_rank: int | None = None,
    ) -> dict[str, Any]:
        timeout_s = self.config.waiting_timeout_s
        room_id = target.room
        # Without the hint the prefill's bootstrap server derives the rank (it knows its size).
        hint = "" if prefill_rank is None else f"&prefill_rank={prefill_rank}"
        url = (
            f"http://{handoff.url_host(target.host)}:{target.port}"
            f"/_stub/sglang/rooms/{room_id}?timeout={timeout_s}{hint}"
        )
        try:
            status, payload = await self._wait(
                self._get(url, timeout_s + self.config.pull_timeout_s), abort, timeout_s + 1.0
            )
        except TimeoutError:
            status, payload = 408, None
        except (aiohttp.ClientError, ValueError):
            raise _Failed(
                handoff.sglang_decode_failure(
                    rid, room_id, "Failed to fetch bootstrap info from prefill server"
                )
            ) from None
        if status == 408:
            raise _Failed(handoff.sglang_decode_timeout(rid, room_id, timeout_s))
        if status != 200 or not isinstance(payload, dict):
            raise _Failed(
                handoff.sglang_decode_failure(
                    rid, room_id, "Failed to get kvcache from prefill instance, it might be dead"
                )
            )
        return payload

    async def _get(self, url: str, timeout_s: float) -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.config.pull_timeout_s)
        async with self.stub.session.get(url, timeout=timeout) as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else None
            return resp.status, data

    # -- /generate -----------------------------------------------------------------------

    def _parse_generate(self, body: Any) -> _Prompt:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (
            isinstance(input_ids, list)
            and input_ids
            and all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids)
        ):
            ids = list(input_ids)
        elif isinstance(text, str) and text:
            ids = textgen.encode_text(text)
        else:
            raise BadRequest("Either text or input_ids should be provided (one prompt).")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = params.get("max_new_tokens", self.config.default_max_tokens)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            raise BadRequest("max_new_tokens must be a non-negative integer")
        return _Prompt(
            ids=ids,
            digest=textgen.prompt_digest(ids),
            max_tokens=max_new,
            ignore_eos=params.get("ignore_eos") is True,
            stream=body.get("stream") is True,
        )

    async def _generate(self, request: web.Request) -> Reply:
        body = request_json(request)
        prompt = self._parse_generate(body)
        rid = self._rid(request, body)
        result = await self._run(request, body, rid, prompt)
        if isinstance(result, JsonReply):
            return result
        tokens, finish = result
        meta_finish: dict[str, Any] | None
        if finish == "abort":
            meta_finish = {"type": "abort", "message": "Abort in waiting queue"}
        elif finish == "length":
            meta_finish = {"type": "length", "length": len(tokens)}
        else:
            meta_finish = {"type": "stop", "matched": textgen.EOS_TOKEN_ID}
        started = time.monotonic()

        def meta(done: int, fin: dict[str, Any] | None) -> dict[str, Any]:
            return {
                "id": rid,
                "finish_reason": fin,
                "prompt_tokens": len(prompt.ids),
                "weight_version": "default",
                "completion_tokens": done,
                "cached_tokens": 0,
                "e2e_latency": round(time.monotonic() - started, 6),
            }

        if not prompt.stream:
            await openai.wait_tokens(self.config, len(tokens))
            return JsonReply(
                {
                    "text": textgen.decode_tokens(tokens),
                    "output_ids": tokens,
                    "meta_info": meta(len(tokens), meta_finish),
                }
            )

        async def events() -> AsyncIterator[bytes]:
            self.running += 1
            try:
                for i in range(len(tokens)):
                    await openai.pace(self.config, i)
                    last = i == len(tokens) - 1
                    yield sse(
                        {
                            "text": textgen.decode_tokens(tokens[: i + 1]),
                            "output_ids": tokens[: i + 1],
                            "meta_info": meta(i + 1, meta_finish if last else None),
                        }
                    )
                if not tokens:
                    yield sse({"text": "", "output_ids": [], "meta_info": meta(0, meta_finish)})
                yield SSE_DONE
            finally:
                self.running -= 1

        return StreamReply(events())

    async def _run(
        self, request: web.Request, body: dict[str, Any], rid: str, prompt: _Prompt
    ) -> tuple[list[int], str] | JsonReply:
        """Rendezvous then generate: (tokens, finish_reason) or an error reply."""
        self.aborts[rid] = abort = asyncio.Event()
        try:
            kind, is_prefill = await self._handoff(request, body, rid, prompt)
        except _Aborted:
            return [], "abort"
        except _Failed as exc:
            return JsonReply(self.error_body(exc.status, exc.message, request.path), exc.status)
        finally:
            if self.aborts.get(rid) is abort:
                del self.aborts[rid]
        # SGLang's prefill server caps the prefill at one token.
        max_tokens = min(prompt.max_tokens, 1) if is_prefill else prompt.max_tokens
        tokens, finish = textgen.generate(
            prompt.digest,
            max_tokens,
            kind,
            eos_rate=self.config.eos_rate,
            ignore_eos=prompt.ignore_eos,
        )
        self.prompt_tokens += len(prompt.ids)
        self.generation_tokens += len(tokens)
        return tokens, finish

    # -- OpenAI routes -------------------------------------------------------------------

    async def _openai(self, request: web.Request, *, kind: str) -> Reply:
        body = request_json(request)
        if kind in apis.API_PATHS:
            return await self._api(request, body, kind)
        gen = openai.parse(body, kind, self.config)
        rid = self._rid(request, gen.body)
        prompt = _Prompt(gen.prompt_ids, gen.digest, gen.max_tokens, gen.ignore_eos, gen.stream)
        result = await self._run(request, gen.body, rid, prompt)
        if isinstance(result, JsonReply):
            return result
        tokens, finish = result
        rendering = openai.new_rendering(rid, gen.model)
        rendering.choice_extra = {"matched_stop": None}
        # SGLang's completions carry token_ids (the delta, per streamed chunk) and
        # prompt_token_ids only when asked (return_token_ids), where vLLM puts them.
        rendering.vllm_token_ids = kind == "completion" and gen.return_token_ids
        rendering.null_ids_left_out = True
        if gen.stream:
            self.running += 1
            return StreamReply(
                openai.render_events(
                    gen, rendering, tokens, finish, self.config, on_done=self._done
                )
            )
        await openai.wait_tokens(self.config, len(tokens))
        return JsonReply(openai.render_body(gen, rendering, tokens, finish))

    async def _api(self, request: web.Request, body: Any, kind: str) -> Reply:
        gen = apis.parse_api(body, kind, self.config)
        if kind == "responses" and (gen.body.get("previous_response_id") is not None
                                    or gen.body.get("background") is True):
            raise BadRequest(_STORE_DISABLED)
        rid = self._rid(request, gen.body)
        prompt = _Prompt(gen.prompt_ids, gen.digest, gen.max_tokens, gen.ignore_eos, gen.stream)
        result = await self._run(request, gen.body, rid, prompt)
        if isinstance(result, JsonReply):
            return result
        tokens, finish = result
        usage = apis.api_usage(kind, len(gen.prompt_ids), len(tokens), CacheFigures(), False)
        answer = ApiAnswer(gen, rid, tokens, finish, usage, "sglang")
        if gen.stream:
            self.running += 1
            return StreamReply(self._counted(apis.EVENTS[kind](answer, self.config)),
                               failure=apis.stream_failure(kind, "sglang"))
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
