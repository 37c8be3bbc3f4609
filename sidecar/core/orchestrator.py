"""The orchestrator: runs one PD request's legs, sequentially or concurrently.

    PDRequest ─plan (handler + agent, pure)─▶ prefill body, decode body (or a recipe)
      sequential: POST prefill ─▶ validate hand-off ─▶ open decode ─▶ PDExchange
      concurrent: POST prefill ║ open decode   (prefill watched: its failure aborts decode)

``start()`` returns a ``PDExchange`` once the decode response head has arrived; the front door
relays its chunks and must call ``aclose()`` (it closes the decode response, cancels a
still-running prefill and releases per-request ids). Cancellation (a client gone) propagates:
every upstream call is closed on the way out.

Deliberate limits: no retries (a retry of a prefill that half-ran would double the engine's
work; routers pick another pair); the local-prefill fallback applies to sequential flows only
(SGLang and Mooncake decode engines cannot run without their prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar import jsonutil
from sidecar.core.engine_ids import EngineIdCache
from sidecar.core.legs import open_decode, post_prefill
from sidecar.engines.base import EngineHandler
from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    InvalidHandoff,
    PrefillFailed,
    SidecarError,
    Stage,
)
from sidecar.http1 import EngineClient, UpstreamError, UpstreamResponse
from sidecar.ids import IdSources
from sidecar.kv_agents.base import KVTransferAgent
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route
from sidecar.settings import PrefillFailurePolicy, Settings

#: Prefill failures a local-prefill fallback may cover (never a client's own bad request).
_FALLBACK_ERRORS = (PrefillFailed, InvalidHandoff, DeadlineExceeded)
#: Prefill URLs remembered per (target, route); cleared whole when full (bounded memory).
_MAX_REMEMBERED_URLS = 4096
_JSON_HEADERS = {"Content-Type": "application/json"}
#: An abort call's answer is a short acknowledgement; it is read only to keep the connection.
_MAX_ABORT_ANSWER = 64 * 1024


@dataclass(frozen=True, slots=True)
class PDRequest:
    """One client request that runs as a prefill/decode pair."""

    route: Route
    body: Mapping[str, Any]
    stream: bool
    target: PrefillTarget
    request_id: str
    headers: Mapping[str, str]


@dataclass(slots=True)
class Timings:
    """Seconds spent per stage, for the stage-latency histogram."""

    prefill: float | None = None
    handoff: float | None = None
    decode_first_byte: float | None = None


@dataclass(slots=True, eq=False)
class PDExchange:
    """A PD request whose decode response head has arrived (or whose answer is known)."""

    ctx: HandoffContext
    decode: UpstreamResponse | None
    answer: dict[str, Any] | None = None
    fallback_reason: str | None = None
    timings: Timings = field(default_factory=Timings)
    prefill_task: asyncio.Task[dict[str, Any]] | None = None
    prefill_error: SidecarError | None = None
    completed: bool = False
    _release: Callable[[], None] | None = None
    _abort: Callable[[], None] | None = None
    _closed: bool = False

    def watch_prefill(self) -> None:
        """Abort the decode stream at once if the concurrent prefill fails."""
        if self.prefill_task is not None:
            self.prefill_task.add_done_callback(self._on_prefill_done)

    def _on_prefill_done(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        self.prefill_error = _as_prefill_error(error)
        if self.decode is not None:
            # Closing the connection makes the pending read fail and tells the engine.
            self.decode.close()

    def _stream_error(self, exc: BaseException) -> SidecarError:
        if self.prefill_error is not None:
            return self.prefill_error
        if isinstance(exc, TimeoutError):
            return DeadlineExceeded("decode stream stalled past the read deadline",
                                    stage=Stage.DECODE)
        return DecodeFailed("decode engine broke its stream", stage=Stage.DECODE)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The decode body as the engine writes it; raises a ``SidecarError`` on a break."""
        if self.decode is None:
            raise SidecarError("chunks() called on an exchange answered by its prefill")
        # readany() hands over everything queued since the last read: under load one chunk
        # carries several tokens, so the per-chunk costs below are paid once for them all.
        read = self.decode.readany
        try:
            while chunk := await read():
                yield chunk
        except (UpstreamError, TimeoutError) as exc:
            raise self._stream_error(exc) from None
        if self.prefill_error is not None:
            raise self.prefill_error
        self.completed = True

    async def read_all(self, max_bytes: int) -> bytes:
        """The whole decode body (JSON answers), capped."""
        buffer = bytearray()
        async for chunk in self.chunks():
            buffer += chunk
            if len(buffer) > max_bytes:
                raise DecodeFailed("decode answer exceeds the size cap", stage=Stage.DECODE)
        return bytes(buffer)

    async def aclose(self) -> None:
        """Close the decode response, stop a running prefill, release ids. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.decode is not None:
            self.decode.close()
        if self.prefill_task is not None:
            await _cancel(self.prefill_task)
        if not self.completed and self.decode is not None and self._abort is not None:
            self._abort()
        if self._release is not None:
            self._release()


def _as_prefill_error(error: BaseException) -> SidecarError:
    if isinstance(error, SidecarError):
        return error
    return PrefillFailed(f"prefill leg failed: {type(error).__name__}")


def _without_handoff(response: dict[str, Any]) -> dict[str, Any]:
    """A finished context answer as the client sees it: no engine hand-off state in it.

    TensorRT-LLM's own disaggregated server drops ``disaggregated_params`` from a context
    response it returns as the answer.
    """
    answer = {k: v for k, v in response.items() if k != "disaggregated_params"}
    choices = answer.get("choices")
    if isinstance(choices, list):
        answer["choices"] = [
            {k: v for k, v in choice.items() if k != "disaggregated_params"}
            if isinstance(choice, dict) else choice
            for choice in choices
        ]
    return answer


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        await task


class Orchestrator:
    """Runs PD requests for one engine family and KV connector."""

    def __init__(
        self,
        *,
        settings: Settings,
        handler: EngineHandler,
        agent: KVTransferAgent | None,
        session: EngineClient,
        ids: IdSources,
        engine_ids: EngineIdCache | None = None,
        on_fallback: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.handler = handler
        self.agent = agent
        self.session = session
        self.ids = ids
        self.engine_ids = engine_ids
        self.concurrent = handler.concurrent(agent)
        self._on_fallback = on_fallback
        self._engine_url = settings.engine_url.rstrip("/")
        self._aborts: set[asyncio.Task[None]] = set()
        self._prefill_urls: dict[tuple[PrefillTarget, Route], str] = {}

    def engine_url(self, route: Route | str) -> str:
        return self._engine_url + str(route)

    async def context(self, route: Route, request_id: str, target: PrefillTarget,
                      advertise_host: str | None = None) -> HandoffContext:
        """The hand-off context with this request's ids (and looked-up engine id)."""
        ctx = HandoffContext(
            route=route,
            request_id=request_id,
            prefill=target,
            advertise_host=advertise_host or target.host,
            sglang_bootstrap_port=self.settings.sglang_bootstrap_port,
            mooncake_bootstrap_port=self.settings.mooncake_bootstrap_port,
        )
        ctx = self.handler.assign_ids(ctx, self.ids, self.agent)
        if self.agent is not None and self.agent.needs_engine_id and self.engine_ids is not None:
            engine_id = await self.engine_ids.get(
                PrefillTarget(ctx.advertise_host, 0).url_host, ctx.mooncake_bootstrap_port
            )
            ctx = ctx.with_ids(mooncake_engine_id=engine_id)
        return ctx

    def release(self, ctx: HandoffContext) -> None:
        """Give back the per-request ids of ``ctx``."""
        if ctx.sglang_room is not None:
            self.ids.rooms.release(ctx.sglang_room)

    async def start(self, request: PDRequest) -> PDExchange:
        """Run the request's legs until the decode response head has arrived."""
        ctx = await self.context(request.route, request.request_id, request.target)
        try:
            if self.concurrent:
                exchange = await self._start_concurrent(request, ctx)
            else:
                exchange = await self._start_sequential(request, ctx)
        except BaseException:
            self.abort(ctx, request.target)
            self.release(ctx)
            raise
        exchange._release = lambda: self.release(ctx)
        exchange._abort = lambda: self.abort(ctx, request.target)
        return exchange

    def abort(self, ctx: HandoffContext, target: PrefillTarget) -> None:
        """Tell both engines to drop this request's legs, where the engine has an abort call.

        Closing a connection is not enough for engines that notice a gone client only when
        they next write (SGLang checks every few seconds). Runs in the background, bounded.
        """
        call = self.handler.abort_call(ctx)
        if call is None:
            return
        path, body = call
        for base, tls_name in ((self._engine_url, None), (target.base_url, target.tls_name)):
            task = asyncio.ensure_future(self._post_abort(base + path, body, tls_name))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    async def _post_abort(self, url: str, body: Mapping[str, Any],
                          tls_name: str | None = None) -> None:
        with contextlib.suppress(UpstreamError, TimeoutError):
            async with asyncio.timeout(self.settings.connect_timeout_s):
                response = await self.session.request(
                    "POST", url, headers=_JSON_HEADERS, body=jsonutil.dumps(body),
                    server_hostname=tls_name,
                )
                async with response:
                    await response.read(_MAX_ABORT_ANSWER)

    def prefill_url(self, target: PrefillTarget, route: Route) -> str:
        """The prefill leg's URL (remembered: formatting it parses the host each time)."""
        key = (target, route)
        url = self._prefill_urls.get(key)
        if url is None:
            if len(self._prefill_urls) >= _MAX_REMEMBERED_URLS:
                self._prefill_urls.clear()
            url = self._prefill_urls[key] = target.base_url + route.value
        return url

    async def _prefill(self, request: PDRequest, body: Mapping[str, Any]) -> dict[str, Any]:
        return await post_prefill(
            self.session,
            self.prefill_url(request.target, request.route),
            body,
            request.headers,
            timeout_s=self.settings.prefill_timeout_s,
            max_bytes=self.settings.max_prefill_response_bytes,
            server_hostname=request.target.tls_name,
        )

    async def _start_sequential(self, request: PDRequest, ctx: HandoffContext) -> PDExchange:
        timings = Timings()
        started = time.perf_counter()
        prefill_body = self.handler.prefill_body(request.body, ctx, self.agent)
        fallback_reason: str | None = None
        try:
            response = await self._prefill(request, prefill_body)
            timings.prefill = time.perf_counter() - started
            if self.handler.answered_by_prefill(response):
                answer = _without_handoff(response)
                return PDExchange(ctx=ctx, decode=None, answer=answer, timings=timings)
            handoff_started = time.perf_counter()
            handoff = self.handler.handoff(response, ctx, self.agent)
            decode_body = self.handler.decode_body(request.body, handoff)
            timings.handoff = time.perf_counter() - handoff_started
        except _FALLBACK_ERRORS as error:
            if self.settings.on_prefill_failure is not PrefillFailurePolicy.LOCAL:
                raise
            fallback_reason = error.code
            if self._on_fallback is not None:
                self._on_fallback(fallback_reason)
            decode_body = dict(request.body)
        decode_started = time.perf_counter()
        decode = await open_decode(
            self.session, self.engine_url(request.route), decode_body, request.headers
        )
        timings.decode_first_byte = time.perf_counter() - decode_started
        return PDExchange(ctx=ctx, decode=decode, fallback_reason=fallback_reason, timings=timings)

    async def _start_concurrent(self, request: PDRequest, ctx: HandoffContext) -> PDExchange:
        timings = Timings()
        prefill_body = self.handler.prefill_body(request.body, ctx, self.agent)
        decode_body = self.handler.decode_body(
            request.body, self.handler.handoff(None, ctx, self.agent)
        )
        started = time.perf_counter()
        prefill_task = asyncio.ensure_future(self._prefill(request, prefill_body))
        decode_task = asyncio.ensure_future(
            open_decode(self.session, self.engine_url(request.route), decode_body, request.headers)
        )
        try:
            while not decode_task.done():
                waiting: set[asyncio.Future[Any]] = {decode_task}
                if not prefill_task.done():
                    waiting.add(prefill_task)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task.done() and not prefill_task.cancelled():
                    error = prefill_task.exception()
                    if error is not None:
                        raise _as_prefill_error(error)
            decode = decode_task.result()
        except BaseException:
            await _cancel(decode_task)
            await _cancel(prefill_task)
            raise
        timings.decode_first_byte = time.perf_counter() - started
        if prefill_task.done():
            timings.prefill = time.perf_counter() - started
        exchange = PDExchange(ctx=ctx, decode=decode, timings=timings, prefill_task=prefill_task)
        exchange.watch_prefill()
        return exchange
