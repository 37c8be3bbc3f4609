"""The HTTP front door: the aiohttp application, its PD routes' handler, the passthrough.

    build_http_app(runtime) ─▶ web.Application
        POST /v1/completions, /v1/chat/completions,
             /v1/responses, /v1/messages,
             /inference/v1/generate                 -> handle_pd (every ``Route``)
        GET /health, /ready, /metrics               -> operations (ops.py); /metrics only
                                                       without --metrics-port (there, it is
                                                       the engine's, passed through)
        anything else                               -> local engine passthrough

A PD route's request: parse, decide, run, relay, each once.

    request ─admission─▶ candidates (x-prefiller-host-port, else the pool; allowlist)
        ─placer.route_fate─▶ passthrough (no target) | 404 unserved_route | whole on the
                             local engine (local_route)
        ─read the body (body.py: limits, decoding, deadline)─▶ body checks
        ─▶ n > 1 or a batch ─▶ fanout.py (one decision and one PD pair per prompt and
                             choice, merged)
        ─placer.place─▶ local_state: the body to the local engine as it came
                      │ local_short, local_cached, fallback (every breaker open): the
                      │ client's body on the local engine alone
                      │ a pair on (target, prefill rank, decode rank) ─▶ runner.run
                      └ a typed refusal
        ─▶ relay ─▶ client (a JSON answer here; a stream: relay.py)
        ─▶ the engine answering dies after the answer began ─▶ a JSON request runs again
           whole elsewhere (``Runner.rerun``); a stream continues where it broke
           (``sidecar.request.migration``: its continuation relayed as this client's stream),
           or ends with the error naming why it did not move

Where a request runs is the placement decision's (``sidecar.request.placement``), never
this module's; how its legs run is the runner's (``sidecar.request.runner``). A router's
``x-data-parallel-rank`` (``sidecar.targets.choice``) names the prefill leg's rank: checked
with the other routing headers, handed to the decision, never forwarded (no routing header
reaches an engine).

The relay writes the decode engine's bytes as they arrive (no re-encoding), but for the usage
the client is told: a disaggregated answer's usage is the route's API's usage rule over both
legs (``Api.answer_with_true_usage``; streams: relay.py). A failure after the first byte ends
the stream with one error event in the API's shape and an unterminated body: no second
status, no fabricated end marker. The client's headers are the trace carrier: the request
span continues a client's ``traceparent``; the relay runs in its own span, which counts the
bytes.

Every other request goes to the local engine as it came (``proxy_to_engine``): method, path,
query, headers (minus hop-by-hop and routing headers: ``forwardable_headers``) and body,
streamed both ways; the engine's status, headers and body come back as they are. Its body is
read by the one body reader (``body.py``): a plain body streams to the engine as it arrives,
a compressed one is inflated whole first and sent with its own length, so the engine reads
exactly the bytes counted there, never the client's compressed length over them.

No answer carries a ``Server`` header (aiohttp's names the Python and aiohttp versions, which
tells a scanner what to try): ``drop_server_header`` removes it before the head is written,
on this app and the metrics port's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from aiohttp import hdrs, web
from multidict import CIMultiDict

from sidecar import jsonutil
from sidecar.engines.calls import EngineCalls
from sidecar.errors import DecodeFailed, SidecarError, Stage
from sidecar.http1 import UpstreamError
from sidecar.http_server import ops
from sidecar.http_server.aiohttp_private import WholeAnswer
from sidecar.http_server.body import BodyLimits, BodyReader
from sidecar.http_server.errors import error_response
from sidecar.http_server.fanout import relay_fanout
from sidecar.http_server.keys import BODY, RUNTIME
from sidecar.http_server.relay import (
    ContinuationDiverged,
    KeptStream,
    PrefillUsage,
    SSERelay,
    stream_broke,
    stream_delivered,
)
from sidecar.observability.tracing import NOOP_SPAN, RELAY_SPAN, RELAYED_BYTES, LegSpan
from sidecar.protocol.apis import Api, api_of, usage_of
from sidecar.protocol.context import Route
from sidecar.protocol.request import REQUEST_ID_HEADER, ClientRequest, request_id_or_new
from sidecar.protocol.sse import answer_as_sse
from sidecar.request.legs import PDExchange, PDRequest
from sidecar.request.migration import OFF, Migrations, NotMigrated, Plan
from sidecar.request.placement import Decision, Fate, decode_engine_failed
from sidecar.request.scope import LOCAL_STATE, MIGRATED, REFUSED, UNSERVED_ROUTE, RequestScope
from sidecar.runtime import Runtime
from sidecar.targets.choice import RANK_HEADER, parse_rank_header
from sidecar.targets.selector import PREFILL_TARGET_HEADER

logger = logging.getLogger(__name__)

_RELAYED_HEADERS = ("Content-Type", "Cache-Control")


# -- which headers reach an engine ----------------------------------------------------------

_NOT_FORWARDED = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})

#: Routing headers a router sets for the sidecar (the prefill target, the data-parallel rank,
#: and the other pods of a request: llm-d's and AIBrix's names); never forwarded to an engine,
#: on any path (a decode leg's rank is the dialect's to set, where its engine reads it).
ROUTING_HEADERS = frozenset({
    PREFILL_TARGET_HEADER, "x-prefiller-url", "x-decoder-host-port", "x-encoder-hosts-ports",
    RANK_HEADER,
})

#: Request headers that describe bytes the engine never gets: a body reaches an engine plain
#: (the body reader inflated it, or refused it: ``body.py``).
_REQUEST_ONLY_DROPPED = frozenset({"content-encoding"})




def _connection_options(value: str) -> list[str]:
    """The header names one ``Connection`` header lists (RFC 9110 7.6.1: hop-by-hop too)."""
    return [token.strip().lower() for token in value.split(",")]


def _without(out: CIMultiDict[str], names: Iterable[str]) -> CIMultiDict[str]:
    for name in names:
        out.popall(name, None)
    return out


def forwardable_headers(headers: Iterable[tuple[str, str]] | Mapping[str, str], *,
                        drop: Iterable[str] = ()) -> CIMultiDict[str]:
    """Client headers minus hop-by-hop (those ``Connection`` names among them), routing,
    ``Content-Encoding`` and ``drop`` headers (case-insensitive)."""
    dropped = {name.lower() for name in drop}
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: CIMultiDict[str] = CIMultiDict()
    named: list[str] = []
    for name, value in items:
        lower = name.lower()
        if lower == "connection":
            named += _connection_options(value)
        elif not (lower in _NOT_FORWARDED or lower in ROUTING_HEADERS or lower in dropped
                  or lower in _REQUEST_ONLY_DROPPED):
            out.add(name, value)
    return _without(out, named) if named else out




def response_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """Upstream response headers that may be relayed to the client (hop-by-hop ones, and
    those the engine's ``Connection`` names, left out)."""
    out: CIMultiDict[str] = CIMultiDict()
    named: list[str] = []
    for name, value in headers:
        lower = name.lower()
        if lower == "connection":
            named += _connection_options(value)
        elif not (lower in _NOT_FORWARDED
                  or (lower == "content-encoding" and value == "identity")):
            out.add(name, value)
    return _without(out, named) if named else out


# -- the PD routes -------------------------------------------------------------------------



def request_id_of(request: web.Request) -> str:
    """The client's ``X-Request-Id`` when it is sane, else a new one."""
    return request_id_or_new(request.headers.get(REQUEST_ID_HEADER))


def _route_handler(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await handle_pd(request, route)

    return handle


async def handle_pd(request: web.Request, route: Route) -> web.StreamResponse:
    """Serve one request of a PD route: parse, decide, run, relay."""
    runtime = request.app[RUNTIME]
    request_id = request_id_of(request)
    api = api_of(route)
    scope = runtime.http_scopes.open(route.value, request_id, request.headers)
    note = Placement(scope)
    request[PLACEMENT] = note
    try:
        scope.admit()
        placer = runtime.placer
        candidates = await runtime.selector.candidates(
            request.headers.getall(PREFILL_TARGET_HEADER, []))
        decision = placer.route_fate(route, bool(candidates), request_id)
        if decision is not None:
            note.decision = decision
            scope.outcome = decision.outcome
            if decision.error is not None:
                raise decision.error
            return await proxy_to_engine(request, runtime.calls, request_id)
        raw = await request.app[BODY].read(request)
        client = runtime.body_checks.parse(raw, route,
                                           trusted_router=runtime.settings.trusted_router)
        named_rank = parse_rank_header(request.headers.getall(RANK_HEADER, []),
                                       runtime.runner.ranks.prefill_size)
        headers = forwardable_headers(request.headers.items(), drop=("accept-encoding",))
        headers[REQUEST_ID_HEADER] = request_id
        migrations = runtime.migrations
        plan = (OFF if migrations is None or client.sub_requests > 1
                else migrations.whole if not client.stream
                else migrations.plan(route, client.body, True))
        pd_request = PDRequest(
            route=route,
            body=client.body,
            stream=client.stream,
            target=candidates[0],
            request_id=request_id,
            headers=headers,
            candidates=candidates,
            trace=scope.trace,
            prefill_rank=named_rank,
            raw=raw,
            engine_fields=plan.engine_fields,
        )
        if client.sub_requests > 1:
            note.sub_requests = client.sub_requests
            return await relay_fanout(request, runtime, scope, client, pd_request)
        decision = await placer.place(route, client.body, candidates, request_id=request_id,
                                      named_prefill_rank=named_rank)
        note.decision = decision
        scope.outcome = decision.outcome
        if decision.error is not None:
            raise decision.error
        if decision.outcome == LOCAL_STATE:
            # The engine that holds the state answers, as it would without a prefill target.
            return await proxy_to_engine(request, runtime.calls, request_id, raw)
        exchange = await runtime.runner.run(pd_request, decision)
        # The relay may still turn it into broken_stream or error (an engine's error event).
        scope.outcome = exchange.outcome
        note.reason = exchange.fallback_reason
        answer = _Answer(pd_request, exchange.decision or decision, plan)
        try:
            scope.observe_timings(exchange.timings)
            if scope.trace.active:
                with scope.trace.span(RELAY_SPAN) as relay_span:
                    return await _relay(request, runtime, scope, exchange, client, api,
                                        relay_span, answer)
            # Untraced: not even a no-op span's calls.
            return await _relay(request, runtime, scope, exchange, client, api, NOOP_SPAN,
                                answer)
        finally:
            await exchange.aclose()
    except SidecarError as error:
        unserved = scope.outcome == UNSERVED_ROUTE
        scope.failed(error)
        if unserved:
            scope.outcome = UNSERVED_ROUTE
        elif scope.outcome != REFUSED:
            logger.warning("request %s failed: %s (%s)", request_id, error.code, error.message)
        return error_response(error, request_id, api)
    except asyncio.CancelledError:
        scope.cancelled()
        raise
    finally:
        scope.close()


class _Answer(msgspec.Struct, frozen=True):
    """What continuing a request's answer elsewhere needs: the request, the decision it ran
    on, its migration plan."""

    request: PDRequest
    decision: Decision
    plan: Plan


async def _relay(
    request: web.Request,
    runtime: Runtime,
    scope: RequestScope,
    exchange: PDExchange,
    client: ClientRequest,
    api: Api,
    span: LegSpan,
    answer: _Answer,
) -> web.StreamResponse:
    request_id = scope.request_id
    relayed = scope.relayed_bytes
    stream = client.stream
    route = client.route
    if exchange.decode is None:
        answer_ = exchange.answer or {}
        if stream:
            body = answer_as_sse(answer_, route)
            content_type = "text/event-stream"
        else:
            body = jsonutil.dumps(answer_)
            content_type = "application/json"
        relayed.inc(len(body))
        if span.recording:
            span.set(RELAYED_BYTES, len(body))
        return WholeAnswer(body, CIMultiDict(((REQUEST_ID_HEADER, request_id),
                                              (hdrs.CONTENT_TYPE, content_type))))
    headers = {name: value for name in _RELAYED_HEADERS
               if (value := exchange.decode.header(name)) is not None}
    headers[REQUEST_ID_HEADER] = request_id
    if not stream:
        return await _relay_json(runtime, scope, exchange, api, span, answer, headers)
    # Each read's bytes go to the client from the read callback (relay.py): no task wake-up
    # per token; the error-event check and the tail are kept there.
    usage = (PrefillUsage(exchange)
             if exchange.disaggregated and api.stream_has_usage(client.body) else None)
    plan = answer.plan
    kept = (KeptStream(runtime.settings.migration_max_stream_bytes, plan.strip)
            if plan.keeps else None)
    relay = SSERelay(request, headers, runtime.dialect.stream_markers(route), api=api,
                     usage=usage, kept=kept)
    await relay.start()
    try:
        try:
            await exchange.pipe(relay.feed, relay.catch_up)
            if not relay.ended_with_done():
                # The engine closed cleanly mid-event: a cut stream, not a finished one.
                raise DecodeFailed("decode stream ended without its end event",
                                   stage=Stage.DECODE)
        except SidecarError as error:
            migrations = runtime.migrations
            if migrations is None or plan is OFF or not decode_engine_failed(error):
                raise
            await _continue(relay, migrations, scope, exchange, client, api, answer, error)
    except SidecarError as error:
        stream_broke(scope, relay, error, span)
        await relay.break_off(error)
        return relay.response
    except asyncio.CancelledError:
        # Many clients hang up as soon as they read the end event: the answer was delivered
        # whole, and is counted by what it was (not as a cancelled request).
        if relay.ended_with_done():
            stream_delivered(scope, relay, span)
        raise
    stream_delivered(scope, relay, span)
    await relay.finish()
    return relay.response


async def _continue(relay: SSERelay, migrations: Migrations, scope: RequestScope,
                    exchange: PDExchange, client: ClientRequest, api: Api, answer: _Answer,
                    error: SidecarError) -> None:
    """Continue a stream that broke with ``error`` on other engines until one ends it; the
    error it ends with raised when it does not move (``sidecar.request.migration``)."""
    plan, decision = answer.plan, answer.decision
    if exchange.decode is not None:
        # An engine that reported its failure (or stalled) may still be writing: it sees the
        # request go now (its legs' abort comes when the request ends).
        exchange.decode.close()
    kept = relay.kept
    overflowed = kept is None or kept.overflowed
    so_far = (plan.read_back(kept.kept, client.body)
              if kept is not None and not kept.overflowed else None)
    # The usage rule: a pair's prompt was the prefill's; a whole run's figures are unknown.
    prefill = usage_of(exchange.prefill_reply_now()) if exchange.disaggregated else None

    def details(told: Mapping[str, Any]) -> dict[str, Any]:
        return api.true_usage(told, prefill)

    await relay.catch_up()  # what came before the failure goes first
    while True:
        failed = decision.target if decision.fate is Fate.MOVE else None
        try:
            resumed = await migrations.resume(answer.request, decision, plan, so_far, error,
                                              failed=failed, overflowed=overflowed,
                                              details=details)
        except NotMigrated as refused:
            raise refused.error from None
        relay.follow(resumed.join)
        continuation = resumed.exchange
        try:
            await continuation.pipe(relay.feed, relay.catch_up)
            if not relay.ended_with_done():
                raise DecodeFailed("the continuation ended without its end event",
                                   stage=Stage.DECODE)
            scope.outcome = MIGRATED
            return
        except ContinuationDiverged as diverged:
            migrations.count_failed("diverged")
            raise diverged from None
        except SidecarError as again:
            if not decode_engine_failed(again):
                raise
            await relay.catch_up()
            error, decision, so_far = again, resumed.decision, resumed.join.so_far
            overflowed = False
        finally:
            await continuation.aclose()


async def _relay_json(runtime: Runtime, scope: RequestScope, exchange: PDExchange, api: Api,
                      span: LegSpan, answer: _Answer,
                      headers: dict[str, str]) -> web.StreamResponse:
    """A JSON answer, read whole (its engine dying meanwhile: run again elsewhere)."""
    current, decision = exchange, answer.decision
    try:
        while True:
            try:
                body = await current.read_all(runtime.settings.max_body_bytes)
                break
            except SidecarError as error:
                if answer.plan is OFF or not decode_engine_failed(error):
                    raise
                moved = await runtime.runner.rerun(answer.request, decision, error)
                if current is not exchange:
                    await current.aclose()
                current, decision = moved, moved.decision or decision
                scope.outcome = MIGRATED
        try:
            # A cut or garbled answer must not reach the client as a 200.
            parsed = jsonutil.loads(body)
        except jsonutil.JSONDecodeError:
            raise DecodeFailed("decode engine answered malformed JSON",
                               stage=Stage.DECODE) from None
        if current.disaggregated and isinstance(parsed, dict):
            told = api.answer_with_true_usage(parsed, await current.prefill_reply())
            if told is not None:
                body = jsonutil.dumps(told)
        scope.relayed_bytes.inc(len(body))
        if span.recording:
            span.set(RELAYED_BYTES, len(body))
        return WholeAnswer(body, CIMultiDict(headers))
    finally:
        if current is not exchange:
            await current.aclose()


def add_pd_routes(app: web.Application) -> None:
    for route in Route:
        app.router.add_post(route.value, _route_handler(route))



# -- the passthrough: every other request, to the local engine as it came -----------------


async def _once(raw: bytes) -> AsyncIterator[bytes]:
    yield raw


async def proxy_to_engine(
    request: web.Request, calls: EngineCalls, request_id: str, raw: bytes | None = None
) -> web.StreamResponse:
    """Forward ``request`` to the local engine and stream its answer back; ``raw``: its body,
    when the front door has read it already."""
    headers = forwardable_headers(request.headers.items())
    headers[REQUEST_ID_HEADER] = request_id
    reader = request.app[BODY]
    length = request.content_length
    response: web.StreamResponse | None = None
    try:
        body: AsyncIterable[bytes] | None
        if raw is None and reader.encoded(request) and request.body_exists:
            # Its length is the inflated bytes': known only once they are all here.
            raw = await reader.read(request)
        if raw is not None:  # read (and held to the limits) already
            body, length = _once(raw), len(raw)
        else:
            body = reader.stream(request)
        upstream = await calls.passthrough(
            request.method, request.rel_url.raw_path_qs, list(headers.items()), body, length,
        )
        async with upstream:
            response = web.StreamResponse(
                status=upstream.status, headers=response_headers(upstream.headers)
            )
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            response.headers[REQUEST_ID_HEADER] = request_id
            await response.prepare(request)
            while chunk := await upstream.readany():
                await response.write(chunk)
            await response.write_eof()
            return response
    except SidecarError as exc:
        error = exc
    except (UpstreamError, TimeoutError):
        error = DecodeFailed("local engine broke the connection", stage=Stage.DECODE)
    if response is not None and response.prepared:
        # Too late for a status: end the body abruptly so the client sees the break.
        if request.transport is not None:
            request.transport.close()
        return response
    return error_response(error, request_id)


async def _passthrough(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    request_id = request_id_of(request)
    try:
        runtime.admission.enter()
    except SidecarError as error:
        return error_response(error, request_id)
    try:
        return await proxy_to_engine(request, runtime.calls, request_id)
    finally:
        runtime.admission.leave()


# -- the application -----------------------------------------------------------------------


#: The answer's header that says where a PD route's request ran and why.
PLACEMENT_HEADER: Final = "x-disagg-placement"


@dataclass(slots=True)
class Placement:
    """What a PD route's answer says of where it ran: the request's outcome (its scope's, as
    it stands when the head leaves), the decision's facts, a fallback's reason."""

    scope: RequestScope
    decision: Decision | None = None
    reason: str | None = None
    sub_requests: int = 1

    def header(self) -> str:
        """``outcome[; reason=R][; prompt_tokens=N][; cached_tokens=M][; sub_requests=K]``."""
        decision = self.decision
        parts = [self.scope.outcome]
        reason = self.reason or (decision.fallback_reason if decision is not None else None)
        if reason is not None:
            parts.append(f"reason={reason}")
        if decision is not None:
            if decision.prompt_tokens is not None:
                parts.append(f"prompt_tokens={decision.prompt_tokens}")
            if decision.cached_tokens is not None:
                parts.append(f"cached_tokens={decision.cached_tokens}")
        if self.sub_requests > 1:
            parts.append(f"sub_requests={self.sub_requests}")
        return "; ".join(parts)


PLACEMENT: Final = web.RequestKey("placement", Placement)


async def add_placement_header(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare`` (``--placement-header``): a PD route's answer, whatever it is
    (JSON, a stream's head, a passthrough, an error), says where the request ran and why."""
    note = request.get(PLACEMENT)
    if note is not None:
        response.headers[PLACEMENT_HEADER] = note.header()


async def drop_server_header(_: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the head goes out without a ``Server`` header (aiohttp adds
    its own, with versions, when the headers are prepared, just before this signal)."""
    response.headers.popall(hdrs.SERVER, None)


def build_http_app(runtime: Runtime) -> web.Application:
    """The HTTP front door over ``runtime`` (which the caller opens and closes)."""
    settings = runtime.settings
    app = web.Application(client_max_size=settings.max_body_bytes)
    app.on_response_prepare.append(drop_server_header)
    if settings.placement_header:
        app.on_response_prepare.append(add_placement_header)
    app[RUNTIME] = runtime
    app[BODY] = BodyReader(BodyLimits(
        max_bytes=settings.max_body_bytes, timeout_s=settings.client_body_timeout_s,
        max_inflation=settings.max_body_inflation,
        inflating_budget=settings.max_inflating_body_bytes),
        runtime.metrics.inflating_body_bytes.set)
    app.router.add_get("/health", ops.health)
    app.router.add_get("/ready", ops.ready)
    if runtime.settings.metrics_port is None:
        app.router.add_get("/metrics", ops.metrics)
    add_pd_routes(app)
    app.router.add_route("*", "/{tail:.*}", _passthrough)
    return app
