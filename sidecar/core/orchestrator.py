"""The core: every operation on the engines that both front doors need, and the PD flow.

    leg-level operations (both front doors)
      context(route, id, target)      ─▶ HandoffContext with this request's ids (rooms, disagg
                                         ids, transfer ids, the Mooncake engine id)
      prefill_body / decode_body       the bound engine handler's pure body rules
      prefill(leg, ctx)               ─▶ Handoff: POST prefill (deadline), answered-by-prefill,
                                         hand-off fields, timings
      background_prefill(leg, ctx, …) ─▶ a watched engine call that outlives the request
                                         (gRPC Prefill on SGLang/Mooncake): counted, logged,
                                         ids and admission released when it ends
      open_decode(route, body, hdrs)  ─▶ UpstreamResponse (head arrived, status 200)
      post_plain(url, body, hdrs)     ─▶ a prefill-style POST with no hand-off (inline KV)
      passthrough(method, path, ...)  ─▶ the local engine's raw response (HTTP passthrough)
      model_name(stage)               ─▶ the local engine's served model (gRPC bodies)
      abort(ctx, target), release(ctx)
    the PD flow the HTTP front door runs (built from the operations above)
      start(PDRequest) ─▶ PDExchange   sequential: prefill ─▶ hand-off ─▶ open decode
                                       concurrent: prefill ║ open decode (prefill watched)

Only this package talks to engines; the front doors translate their wire into these calls.
Tracing: every engine call runs in a leg span of the request's trace (``PrefillLeg.trace``,
``PDRequest.trace``: the request scope's), and that span, not the client's, is the
``traceparent`` the engine receives; the hand-off gets its own span. An untraced request
(``NOOP_TRACE``, tracing off) takes exactly the calls it took before tracing existed: the
``_post_prefill`` / ``_open_decode`` / ``_handoff`` switches hand back the plain call.
``start()`` returns once the decode response head has arrived; the front door relays its
chunks and must call ``aclose()``. Cancellation (a client gone) propagates: every upstream
call is closed on the way out.

Deliberate limits: one retry, only of a prefill whose connect was refused (the engine never
saw it) and only on another of the request's targets; a prefill that may have half-run is
never retried (it would double the engine's work; routers pick another pair); the
local-prefill fallback applies to sequential flows only
(SGLang and Mooncake decode engines cannot run without their prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.util.types import AttributeValue

from sidecar import jsonutil
from sidecar.config.settings import PrefillFailurePolicy, Settings
from sidecar.core.engine_ids import EngineIdCache
from sidecar.core.engine_model import EngineModel
from sidecar.core.exchange import PDExchange, as_prefill_error, cancel_and_wait
from sidecar.core.legs import open_decode, post_prefill
from sidecar.core.scope import Scopes, Timings
from sidecar.engines.base import EngineHandler
from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    EngineNotReady,
    InvalidHandoff,
    PrefillFailed,
    PrefillUnreachable,
    SidecarError,
    Stage,
)
from sidecar.http1 import EngineClient, UpstreamConnectError, UpstreamError, UpstreamResponse
from sidecar.ids import IdSources
from sidecar.observability.tracing import (
    DECODE_FIRST_BYTE_SPAN,
    HANDOFF_SPAN,
    NOOP_TRACE,
    PREFILL_SPAN,
    PREFILL_TARGET,
    SERVER_ADDRESS,
    SERVER_PORT,
    RequestTrace,
)
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route
from sidecar.targets.choice import TargetChoice

logger = logging.getLogger(__name__)

#: Prefill failures a local-prefill fallback may cover (never a client's own bad request).
_FALLBACK_ERRORS = (PrefillFailed, InvalidHandoff, DeadlineExceeded)
#: Prefill URLs remembered per (target, route); cleared whole when full (bounded memory).
_MAX_REMEMBERED_URLS = 4096
_JSON_HEADERS = {"Content-Type": "application/json"}
#: An abort call's answer is a short acknowledgement; it is read only to keep the connection.
_MAX_ABORT_ANSWER = 64 * 1024
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class PDRequest:
    """One client request that runs as a prefill/decode pair."""

    route: Route
    body: Mapping[str, Any]
    stream: bool
    target: PrefillTarget
    request_id: str
    headers: Mapping[str, str]
    #: Every target the request may use (``target`` among them): a prefill whose connect is
    #: refused moves once to another of these.
    candidates: tuple[PrefillTarget, ...] = ()
    trace: RequestTrace = NOOP_TRACE


@dataclass(frozen=True, slots=True)
class PrefillLeg:
    """One prefill engine call: where, what, with which headers, within which deadline, and
    in which request's trace."""

    url: str
    body: Mapping[str, Any]
    headers: Mapping[str, str]
    timeout_s: float
    #: The name an https target's certificate must carry when ``url`` names its address.
    server_hostname: str | None = None
    #: The prefill target this leg goes to, when it is a remote one (counted per target).
    target: PrefillTarget | None = None
    trace: RequestTrace = NOOP_TRACE


@dataclass(slots=True)
class Handoff:
    """What a prefill leg produced for its decode.

    ``fields`` are the top-level fields the decode body gets. When the prefill already is the
    whole answer (TensorRT-LLM whose first token ended the sequence), ``answer`` holds it as
    the client sees it and ``fields`` is empty.
    """

    fields: dict[str, Any]
    answer: dict[str, Any] | None = None
    timings: Timings = field(default_factory=Timings)


class Orchestrator:
    """Runs engine legs for one engine family (its handler, with its KV agent bound)."""

    def __init__(
        self,
        *,
        settings: Settings,
        handler: EngineHandler,
        session: EngineClient,
        ids: IdSources,
        engine_ids: EngineIdCache | None = None,
        on_fallback: Callable[[str], None] | None = None,
        choice: TargetChoice | None = None,
        on_prefill_leg: Callable[[str, str], None] | None = None,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.handler = handler
        self.session = session
        self.ids = ids
        self.engine_ids = engine_ids
        self.concurrent = handler.concurrent
        self._on_fallback = on_fallback
        self.choice = choice if choice is not None else TargetChoice(cooldown_s=0.0)
        self._on_prefill_leg = on_prefill_leg
        self._on_retry = on_retry
        self._engine_url = settings.engine_url.rstrip("/")
        self._aborts: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._prefill_urls: dict[tuple[PrefillTarget, Route], str] = {}
        self._models = {
            stage: EngineModel(session, settings.engine_url,
                               timeout_s=settings.connect_timeout_s, stage=stage)
            for stage in (Stage.PREFILL, Stage.DECODE)
        }

    # -- identity and addresses -------------------------------------------------------------

    @property
    def engine_name(self) -> str:
        return self.handler.name

    @property
    def connector_name(self) -> str | None:
        return self.handler.connector_name

    @property
    def token_id_fields(self) -> Mapping[str, Any]:
        """Request fields that make the local engine stream generated token ids."""
        return self.handler.token_id_fields

    def engine_url(self, route: Route | str) -> str:
        return self._engine_url + str(route)

    def prefill_url(self, target: PrefillTarget, route: Route) -> str:
        """The prefill leg's URL (remembered: formatting it parses the host each time)."""
        key = (target, route)
        url = self._prefill_urls.get(key)
        if url is None:
            if len(self._prefill_urls) >= _MAX_REMEMBERED_URLS:
                self._prefill_urls.clear()
            url = self._prefill_urls[key] = target.base_url + route.value
        return url

    async def model_name(self, stage: Stage) -> str:
        """The local engine's served model name (cached; ``EngineNotReady`` when unknown)."""
        return await self._models[stage].name()

    # -- per-request ids --------------------------------------------------------------------

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
        ctx = self.handler.assign_ids(ctx, self.ids)
        if self.handler.needs_engine_id and self.engine_ids is not None:
            engine_id = await self.engine_ids.get(
                PrefillTarget(ctx.advertise_host, 0).url_host, ctx.mooncake_bootstrap_port
            )
            ctx = ctx.with_ids(mooncake_engine_id=engine_id)
        return ctx

    def release(self, ctx: HandoffContext) -> None:
        """Give back the per-request ids of ``ctx``."""
        if ctx.sglang_room is not None:
            self.ids.rooms.release(ctx.sglang_room)

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

    # -- bodies (the handler's pure rules) --------------------------------------------------

    def prefill_body(self, client_body: Mapping[str, Any], ctx: HandoffContext) -> dict[str, Any]:
        return self.handler.prefill_body(client_body, ctx)

    def concurrent_handoff(
        self, ctx: HandoffContext, trace: RequestTrace = NOOP_TRACE
    ) -> dict[str, Any]:
        """The hand-off of a concurrent flow, known before the prefill answers."""
        return self._handoff(None, ctx, trace)

    def _handoff(
        self, response: dict[str, Any] | None, ctx: HandoffContext, trace: RequestTrace
    ) -> dict[str, Any]:
        if not trace.active:
            return self.handler.handoff(response, ctx)
        with trace.span(HANDOFF_SPAN):
            return self.handler.handoff(response, ctx)

    def decode_body(
        self, client_body: Mapping[str, Any], fields: Mapping[str, Any]
    ) -> dict[str, Any]:
        return self.handler.decode_body(client_body, fields)

    # -- leg-level operations ---------------------------------------------------------------

    def prefill_timeout(self, time_remaining: float | None = None) -> float:
        """The prefill leg's deadline, bounded by the caller's own (gRPC) when it has one."""
        timeout_s = self.settings.prefill_timeout_s
        if time_remaining is not None:
            timeout_s = max(min(timeout_s, time_remaining), 0.001)
        return timeout_s

    async def post_plain(self, leg: PrefillLeg) -> dict[str, Any]:
        """POST a prefill-style leg and return its JSON object answer (no hand-off read).

        A leg to a remote target counts as in flight there while it runs; a refused connect
        cools the target down (``TargetChoice``).
        """
        post = self._post_prefill(leg)
        if leg.target is None:
            return await post
        target = leg.target
        outcome: str | None = "failed"
        try:
            with self.choice.leg(target):
                answer = await post
            outcome = "ok"
            self.choice.answered(target)
            return answer
        except PrefillUnreachable:
            outcome = "connect_refused"
            self.choice.refused(target)
            raise
        except asyncio.CancelledError:
            outcome = None  # the request went away: not the target's doing
            raise
        finally:
            if self._on_prefill_leg is not None and outcome is not None:
                self._on_prefill_leg(self.choice.label(target), outcome)

    def _post_prefill(self, leg: PrefillLeg) -> Coroutine[Any, Any, dict[str, Any]]:
        """The leg's POST: ``post_prefill`` itself when untraced (no extra coroutine layer:
        every layer is crossed again on each resumption of the leg), else inside its span."""
        if not leg.trace.active:
            return post_prefill(
                self.session, leg.url, leg.body, leg.headers,
                timeout_s=leg.timeout_s, max_bytes=self.settings.max_prefill_response_bytes,
                server_hostname=leg.server_hostname,
            )
        return self._traced_post_prefill(leg)

    async def _traced_post_prefill(self, leg: PrefillLeg) -> dict[str, Any]:
        with leg.trace.span(PREFILL_SPAN, client=True, attributes=_target(leg.url)) as span:
            return await post_prefill(
                self.session, leg.url, leg.body, span.headers(leg.headers),
                timeout_s=leg.timeout_s, max_bytes=self.settings.max_prefill_response_bytes,
                server_hostname=leg.server_hostname, span=span,
            )

    async def post_local(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], *, max_bytes: int
    ) -> dict[str, Any]:
        """POST a small JSON call to the local engine (its tokenizer) and return its answer."""
        return await post_prefill(
            self.session, self._engine_url + path, body, headers,
            timeout_s=self.settings.connect_timeout_s, max_bytes=max_bytes,
        )

    async def prefill(
        self, leg: PrefillLeg, ctx: HandoffContext, timings: Timings | None = None
    ) -> Handoff:
        """Run a sequential prefill leg and read its hand-off (``InvalidHandoff`` if unusable).

        Stage times go into ``timings`` as each stage ends, so a caller sees the prefill's time
        even when the hand-off then fails.
        """
        timings = Timings() if timings is None else timings
        started = time.perf_counter()
        response = await self.post_plain(leg)
        timings.prefill = time.perf_counter() - started
        if self.handler.answered_by_prefill(response):
            return Handoff(fields={}, answer=self.handler.prefill_answer(response), timings=timings)
        handoff_started = time.perf_counter()
        fields = self._handoff(response, ctx, leg.trace)
        timings.handoff = time.perf_counter() - handoff_started
        return Handoff(fields=fields, timings=timings)

    def background_prefill(
        self,
        leg: PrefillLeg,
        ctx: HandoffContext,
        scopes: Scopes,
        release_admission: Callable[[], None],
    ) -> asyncio.Task[None]:
        """Run a concurrent prefill leg that outlives its request, watched here.

        Its stage time and errors are counted through ``scopes``, its failure logged; when it
        ends, the request's ids are released and ``release_admission`` is called. ``close()``
        cancels what is left at server stop.
        """
        task = asyncio.ensure_future(self._watched(leg, ctx, scopes, release_admission))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _watched(
        self,
        leg: PrefillLeg,
        ctx: HandoffContext,
        scopes: Scopes,
        release_admission: Callable[[], None],
    ) -> None:
        started = time.perf_counter()
        try:
            await self.post_plain(leg)
            scopes.observe("prefill", time.perf_counter() - started)
        except SidecarError as error:
            scopes.count_error(error)
            logger.warning("request %s: background prefill failed after the hand-off: %s (%s)",
                           ctx.request_id, error.code, error.message)
        except asyncio.CancelledError:
            logger.info("request %s: background prefill cancelled", ctx.request_id)
            raise
        except Exception:
            scopes.count_error(SidecarError("background prefill crashed", stage=Stage.PREFILL))
            logger.exception("request %s: background prefill crashed", ctx.request_id)
        finally:
            self.release(ctx)
            release_admission()

    async def open_decode(
        self,
        route: Route,
        body: Mapping[str, Any] | bytes,
        headers: Mapping[str, str],
        trace: RequestTrace = NOOP_TRACE,
    ) -> UpstreamResponse:
        """POST the decode body to the local engine; the response once its head arrived."""
        return await self._open_decode(route, body, headers, trace)

    def _open_decode(
        self,
        route: Route,
        body: Mapping[str, Any] | bytes,
        headers: Mapping[str, str],
        trace: RequestTrace,
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        """The decode POST: ``open_decode`` itself when untraced, else inside its span (which
        ends when the head arrives: the relay's span follows it)."""
        if not trace.active:
            return open_decode(self.session, self.engine_url(route), body, headers)
        return self._traced_open_decode(route, body, headers, trace)

    async def _traced_open_decode(
        self,
        route: Route,
        body: Mapping[str, Any] | bytes,
        headers: Mapping[str, str],
        trace: RequestTrace,
    ) -> UpstreamResponse:
        with trace.span(DECODE_FIRST_BYTE_SPAN, client=True) as span:
            return await open_decode(
                self.session, self.engine_url(route), body, span.headers(headers), span
            )

    async def passthrough(
        self,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: AsyncIterable[bytes] | None,
        content_length: int | None,
    ) -> UpstreamResponse:
        """Forward a request the sidecar does not disaggregate to the local engine."""
        try:
            return await self.session.request(
                method, self._engine_url + path_qs, headers=headers, body=body,
                content_length=content_length,
            )
        except UpstreamConnectError:
            raise EngineNotReady("local engine refused the connection") from None
        except (UpstreamError, TimeoutError):
            raise DecodeFailed("local engine broke the connection", stage=Stage.DECODE) from None

    async def close(self) -> None:
        """Cancel the background prefills still running (server stop)."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- the PD flow ------------------------------------------------------------------------

    async def start(self, request: PDRequest) -> PDExchange:
        """Run the request's legs until the decode response head has arrived.

        A prefill whose connect was refused (the engine never saw it) is run once more on
        another of the request's candidates, with a new hand-off context; a concurrent
        flow's decode, already sent, is aborted first. Nothing else is retried.
        """
        target = request.target
        alternative = self._alternative(request, target)
        try:
            return await self._start_on(request, target, may_retry=alternative is not None)
        except PrefillUnreachable:
            if alternative is None:
                raise
        # Picked again now: the first pick may have cooled down meanwhile, others changed.
        retry_target = self._alternative(request, target) or alternative
        logger.info("request %s: prefill target %s refused the connection; retrying on %s",
                    request.request_id, target, retry_target)
        if self._on_retry is not None:
            self._on_retry()
        return await self._start_on(replace(request, target=retry_target), retry_target,
                                    may_retry=False)

    def _alternative(self, request: PDRequest, target: PrefillTarget) -> PrefillTarget | None:
        if len(request.candidates) < 2:
            return None
        return self.choice.pick(request.candidates, exclude=(target,))

    async def _start_on(
        self, request: PDRequest, target: PrefillTarget, *, may_retry: bool
    ) -> PDExchange:
        ctx = await self.context(request.route, request.request_id, target)
        try:
            if self.concurrent:
                exchange = await self._start_concurrent(request, ctx)
            else:
                exchange = await self._start_sequential(request, ctx, may_retry=may_retry)
        except BaseException:
            self.abort(ctx, target)
            self.release(ctx)
            raise
        exchange._release = lambda: self.release(ctx)
        exchange._abort = lambda: self.abort(ctx, target)
        return exchange

    def _leg(self, request: PDRequest, ctx: HandoffContext) -> PrefillLeg:
        return PrefillLeg(
            url=self.prefill_url(request.target, request.route),
            body=self.prefill_body(request.body, ctx),
            headers=request.headers,
            timeout_s=self.settings.prefill_timeout_s,
            server_hostname=request.target.tls_name,
            target=request.target,
            trace=request.trace,
        )

    async def _start_sequential(
        self, request: PDRequest, ctx: HandoffContext, *, may_retry: bool = False
    ) -> PDExchange:
        timings = Timings()
        fallback_reason: str | None = None
        try:
            handoff = await self.prefill(self._leg(request, ctx), ctx)
            timings = handoff.timings
            if handoff.answer is not None:
                return PDExchange(ctx=ctx, decode=None, answer=handoff.answer, timings=timings)
            decode_body = self.decode_body(request.body, handoff.fields)
        except _FALLBACK_ERRORS as error:
            if self.settings.on_prefill_failure is not PrefillFailurePolicy.LOCAL:
                raise
            if may_retry and isinstance(error, PrefillUnreachable):
                raise  # another target comes first; the local fallback is the last resort
            fallback_reason = error.code
            if self._on_fallback is not None:
                self._on_fallback(fallback_reason)
            decode_body = dict(request.body)
        decode_started = time.perf_counter()
        decode = await self._open_decode(
            request.route, decode_body, request.headers, request.trace
        )
        timings.decode_first_byte = time.perf_counter() - decode_started
        return PDExchange(ctx=ctx, decode=decode, fallback_reason=fallback_reason, timings=timings)

    async def _start_concurrent(self, request: PDRequest, ctx: HandoffContext) -> PDExchange:
        timings = Timings()
        leg = self._leg(request, ctx)
        decode_body = self.decode_body(
            request.body, self.concurrent_handoff(ctx, request.trace)
        )
        started = time.perf_counter()
        prefill_task = asyncio.ensure_future(self.post_plain(leg))
        decode_task = asyncio.ensure_future(
            self._open_decode(request.route, decode_body, request.headers, request.trace)
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
                        raise as_prefill_error(error)
            decode = decode_task.result()
        except BaseException:
            await cancel_and_wait(decode_task)
            await cancel_and_wait(prefill_task)
            raise
        timings.decode_first_byte = time.perf_counter() - started
        if prefill_task.done():
            timings.prefill = time.perf_counter() - started
        exchange = PDExchange(ctx=ctx, decode=decode, timings=timings, prefill_task=prefill_task)
        exchange.watch_prefill()
        return exchange


def _target(url: str) -> dict[str, AttributeValue]:
    """The prefill engine's address as leg span attributes (the URL's host and port)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 80)
    return {
        SERVER_ADDRESS: host,
        SERVER_PORT: port,
        PREFILL_TARGET: f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
    }
