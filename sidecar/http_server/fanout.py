"""The HTTP door's side of a fanned-out request (``n > 1`` or batched prompts).

    ClientRequest ─check_fanout─▶ sub_bodies ─▶ core.fanout.start_all ─▶ FanOut
        JSON:     read every answer ─merge_answers─▶ one answer (choices k, usage summed)
        streamed: legs' events as they arrive ─StreamMerger─▶ index k, one id ─▶ client
                  then one usage chunk (when the legs sent usage) and one ``data: [DONE]``

Each leg's usage is first told by the usage rule (its own prefill's cache figures, the
route's API: ``Api.true_usage``), then summed.

Each sub-request k carries ``X-Request-Id: <id>-<k>`` to the engines and gets its own
placement decision (each prompt judged on its own; its own prefill target); the client sees
its own request id. A failure before the client's first byte
is the request's error status; after it, the stream ends with one error event and no
``[DONE]`` (as for single requests; never moved to another engine: the error names it,
``not migrated: fanned_out``). The caller closes the fan-out (every leg) on the way out.
"""

from __future__ import annotations

import logging

import msgspec
from aiohttp import hdrs, web
from multidict import CIMultiDict

from sidecar import jsonutil
from sidecar.engines.tokenizer import Memo
from sidecar.errors import DecodeFailed, SidecarError, Stage
from sidecar.http_server.aiohttp_private import WholeAnswer
from sidecar.http_server.relay import SSERelay, stream_broke, stream_delivered
from sidecar.protocol.apis import api_of, usage_of
from sidecar.protocol.fanout import SSEEvents, StreamMerger, check_fanout, merge_answers, sub_bodies
from sidecar.protocol.request import REQUEST_ID_HEADER, ClientRequest
from sidecar.protocol.sse import DONE_EVENT, answer_as_sse
from sidecar.request.fanout import FanOut, StartOne, start_all, sub_request_id
from sidecar.request.legs import PDExchange, PDRequest
from sidecar.request.migration import FANNED_OUT
from sidecar.request.placement import decode_engine_failed
from sidecar.request.scope import FALLBACK, OK, RequestScope
from sidecar.runtime import Runtime

logger = logging.getLogger(__name__)

def _sub_requests(client: ClientRequest, base: PDRequest) -> list[PDRequest]:
    subs = []
    for k, body in enumerate(sub_bodies(client)):
        request_id = sub_request_id(base.request_id, k)
        headers = {**base.headers, REQUEST_ID_HEADER: request_id}
        subs.append(msgspec.structs.replace(base, body=body, request_id=request_id, raw=None,
                                            headers=headers))
    return subs


def _placed(runtime: Runtime) -> StartOne:
    """Starts one sub-request where its own placement decision puts it (the client
    request's sub-requests share their prompts' tokenizations: n > 1 tokenizes once)."""
    memo: Memo = {}

    async def start(sub: PDRequest) -> PDExchange:
        decision = await runtime.placer.place(sub.route, sub.body, sub.candidates,
                                              request_id=sub.request_id,
                                              named_prefill_rank=sub.prefill_rank, memo=memo)
        if decision.error is not None:
            raise decision.error
        return await runtime.runner.run(sub, decision)

    return start


def _outcome(exchanges: list[PDExchange]) -> str:
    """One outcome for the whole request: every leg's own when they agree."""
    outcomes = {exchange.outcome for exchange in exchanges}
    if len(outcomes) == 1:
        return outcomes.pop()
    return FALLBACK if FALLBACK in outcomes else OK


async def relay_fanout(
    request: web.Request,
    runtime: Runtime,
    scope: RequestScope,
    client: ClientRequest,
    base: PDRequest,
) -> web.StreamResponse:
    """Run and answer a request that needs several PD pairs."""
    check_fanout(client, runtime.settings.max_fanout)
    fanout = await start_all(_placed(runtime), _sub_requests(client, base))
    exchanges = fanout.exchanges
    # The relay may still turn it into broken_stream or error (an engine's error event).
    scope.outcome = _outcome(exchanges)
    try:
        for exchange in exchanges:
            scope.observe_timings(exchange.timings)
        if client.stream:
            return await _relay_stream(request, runtime, scope, fanout, client)
        return await _relay_json(runtime, scope, fanout, client)
    finally:
        await fanout.aclose()


async def _relay_json(
    runtime: Runtime, scope: RequestScope, fanout: FanOut, client: ClientRequest
) -> WholeAnswer:
    bodies = await fanout.read_all(runtime.settings.max_body_bytes)
    answers = []
    for exchange, raw in zip(fanout.exchanges, bodies, strict=True):
        if exchange.decode is None:
            answers.append(exchange.answer or {})
            continue
        try:
            answer = jsonutil.loads(raw)
        except jsonutil.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            # A cut or garbled answer must not reach the client as a 200.
            raise DecodeFailed("decode engine answered malformed JSON", stage=Stage.DECODE)
        if exchange.disaggregated:
            told = api_of(client.route).answer_with_true_usage(
                answer, await exchange.prefill_reply())
            answer = answer if told is None else told
        answers.append(answer)
    body = jsonutil.dumps(merge_answers(answers, client.n))
    scope.relayed_bytes.inc(len(body))
    return WholeAnswer(body, CIMultiDict(((REQUEST_ID_HEADER, scope.request_id),
                                          (hdrs.CONTENT_TYPE, "application/json"))))


async def _relay_stream(
    request: web.Request, runtime: Runtime, scope: RequestScope, fanout: FanOut,
    client: ClientRequest,
) -> web.StreamResponse:
    merger = StreamMerger(client.n)
    splitters = {k: SSEEvents() for k in range(len(fanout.exchanges))}
    api = api_of(client.route)
    relay = SSERelay(request, _stream_headers(fanout, scope),
                     runtime.dialect.stream_markers(client.route), api=api)

    async def relay_events(k: int, payloads: list[bytes]) -> None:
        for payload in payloads:
            try:
                event = merger.event(k, payload)
            except ValueError:
                raise DecodeFailed("decode engine streamed malformed JSON",
                                   stage=Stage.DECODE) from None
            if event is not None:
                await relay.send(event)

    try:
        for k, exchange in enumerate(fanout.exchanges):
            if exchange.decode is None:  # answered by its prefill
                await relay_events(k, SSEEvents().feed(answer_as_sse(exchange.answer or {},
                                                                     client.route)))
        async for k, chunk in fanout.chunks():
            if chunk is not None:
                await relay_events(k, splitters[k].feed(chunk))
            elif k not in merger.done or splitters[k].pending.strip():
                raise DecodeFailed("decode stream ended without its [DONE] event",
                                   stage=Stage.DECODE)
        prefill_usage = {k: usage_of(await exchange.prefill_reply())
                         for k, exchange in enumerate(fanout.exchanges)
                         if exchange.disaggregated}
        usage = merger.usage_event(
            lambda k, used: api.true_usage(used, prefill_usage[k]) if k in prefill_usage
            else used)
        if usage is not None:
            await relay.send(usage)
        await relay.send(DONE_EVENT)
    except SidecarError as error:
        if not relay.prepared:
            raise  # nothing sent yet: the request's error status
        migrations = runtime.migrations
        if migrations is not None and migrations.limit > 0 and decode_engine_failed(error):
            # Its choices split over several engines: never continued (one stream each).
            error = migrations.refused(scope.request_id, error, FANNED_OUT)
        stream_broke(scope, relay, error)
        # Close the legs before the connection: closing it cancels this handler.
        await fanout.aclose()
        await relay.break_off(error)
        return relay.response
    stream_delivered(scope, relay)
    await relay.finish()
    return relay.response


def _stream_headers(fanout: FanOut, scope: RequestScope) -> dict[str, str]:
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    for exchange in fanout.exchanges:
        if exchange.decode is not None:
            for name in ("Content-Type", "Cache-Control"):
                value = exchange.decode.header(name)
                if value is not None:
                    headers[name] = value
            break
    headers[REQUEST_ID_HEADER] = scope.request_id
    return headers
