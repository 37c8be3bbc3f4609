"""The PD flow: how a request's two legs run, the same for every front door.

    start(PDRequest, Decision) ─▶ PDExchange   the HTTP door, and each fan-out sub-request
        LOCAL (short, cached prompt; every breaker open under the local policy) ─▶ the
                                               client's own body on the local engine alone
        PAIR, SEQUENTIAL: prefill ─▶ hand-off ─▶ open decode
        PAIR, CONCURRENT: prefill ║ open decode (prefill watched); a decode refused on a
                          hand-off the prefill's answer shows stale is opened again from it
    prefill_only(...) ─▶ Handoff              gRPC Prefill: the prefill half
        SEQUENTIAL: the prefill, then its hand-off
        CONCURRENT: the hand-off at once; the engine call runs on in the background, watched
    open_decode(...)  ─▶ UpstreamResponse     gRPC Decode: the decode half

Where a request runs (local, a pair on which target and ranks, or a refusal) is the placement
decision's (``sidecar.request.placement``), taken before the flow starts; the flow runs what it
was given. The dialect says what the bodies hold and how the legs run (per request:
``legs_for``, after its look-up); ``EngineCalls`` makes the calls; the flow orders them, keeps
the deadlines, begins and ends the dialect's per-request state and hands abort and release to
the ``PDExchange``. A client gone cancels every upstream call. The decode leg's data-parallel
rank stays busy until the request ends.

Deliberate limits: one retry, only of a prefill whose engine provably did no work (a refused
or unreachable connect, a 503 or 429 answer, a target whose breaker let no leg through), on
another of the request's targets (``placement.retry_pair``); the local-prefill fallback after
a failed prefill applies to sequential dialects only (a concurrent dialect's decode cannot
run without its prefill; before any leg, every breaker open, the placement decides it for
every dialect).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Mapping
from dataclasses import replace
from typing import Any

from sidecar.config.limits import PrefillFailurePolicy
from sidecar.dialects import Dialect, Legs
from sidecar.engines.calls import EngineCalls, PrefillLeg
from sidecar.engines.upstream import with_headers
from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    InvalidHandoff,
    PrefillFailed,
    PrefillNotRun,
    SidecarError,
)
from sidecar.http1 import UpstreamResponse
from sidecar.observability.logs import LogEvery
from sidecar.observability.tracing import HANDOFF_SPAN, NOOP_TRACE, RequestTrace
from sidecar.protocol.context import FrontDoor, HandoffContext, PrefillTarget, Route
from sidecar.request import concurrent as concurrent_legs
from sidecar.request.background import BackgroundPrefills
from sidecar.request.exchange import PDExchange
from sidecar.request.pd_request import FlowCounters, Handoff, PDRequest
from sidecar.request.placement import Decision, Fate, Targets, pair_on, retry_pair
from sidecar.request.placer import PrefillTargets
from sidecar.request.scope import FALLBACK, OK, RequestScope, Scopes, Timings
from sidecar.targets.ranks import LegRanks

logger = logging.getLogger(__name__)

#: Prefill failures a local-prefill fallback may cover (never a client's own bad request).
_FALLBACK_ERRORS = (PrefillFailed, InvalidHandoff, DeadlineExceeded)
#: The reason a gRPC Prefill counts when its prefill already finished the answer.
ANSWERED_BY_PREFILL = "answered_by_prefill"
#: Local-prefill fallbacks are logged at most once per this many seconds (each is counted).
_FALLBACK_LOG_INTERVAL_S = 10.0


class PDFlow:
    """Runs the legs of one dialect's requests (see the module docstring)."""

    def __init__(
        self,
        dialect: Dialect,
        calls: EngineCalls,
        *,
        prefill_timeout_s: float,
        on_prefill_failure: PrefillFailurePolicy = PrefillFailurePolicy.FAIL,
        counters: FlowCounters | None = None,
        local_ranks: int = 1,
        prefill_ranks: int = 1,
    ) -> None:
        """``local_ranks``/``prefill_ranks``: the local engine's/each target's DP size."""
        self.dialect = dialect
        self.calls = calls
        self.ranks = LegRanks(calls.ranks, local_size=local_ranks, prefill_size=prefill_ranks)
        #: The prefill targets and ranks as the placement decision sees them.
        self.targets: Targets = PrefillTargets(calls.choice, self.ranks)
        self._prefill_timeout_s = prefill_timeout_s
        self._local_fallback = on_prefill_failure is PrefillFailurePolicy.LOCAL
        self._counters = counters or FlowCounters()
        self.background = BackgroundPrefills()
        self._fallback_log = LogEvery(_FALLBACK_LOG_INTERVAL_S)

    @property
    def local_fallback(self) -> bool:
        """``--on-prefill-failure local``: a request no prefill target can take (every
        breaker open) runs whole on the local engine, whatever the dialect, since no leg has
        gone yet. After a failed prefill leg only a sequential dialect falls back (``run``)."""
        return self._local_fallback

    # -- per-request state: what the exchange calls back ------------------------------------

    async def begin(self, route: Route, request_id: str, target: PrefillTarget,
                    advertise_host: str | None = None,
                    front_door: FrontDoor = FrontDoor.HTTP, *,
                    prefill_rank: int | None = None,
                    decode_rank: int | None = None) -> HandoffContext:
        """A request's context with its legs' ranks and its dialect state (ids, looked-up
        values); the decode rank counts as busy until ``end``."""
        dialect = self.dialect
        ctx = HandoffContext(route, request_id, target, advertise_host or target.host,
                             front_door, prefill_rank=prefill_rank, decode_rank=decode_rank)
        self.ranks.hold(decode_rank)
        try:
            ctx = dialect.begin(ctx)
        except BaseException:
            self.ranks.release(decode_rank)
            raise
        if dialect.looks_up:
            try:
                ctx = await dialect.look_up(ctx)
            except SidecarError as error:
                self.end(ctx)
                raise self.calls.for_client(error, target, request_id) from None
            except BaseException:
                self.end(ctx)
                raise
        return ctx

    def end(self, ctx: HandoffContext) -> None:
        """Give back the request's dialect state and its decode rank."""
        try:
            self.dialect.end(ctx)
        finally:
            self.ranks.release(ctx.decode_rank)

    def abort(self, ctx: HandoffContext) -> None:
        """Tell both engines to drop the request's legs, where the dialect has an abort call."""
        call = self.dialect.abort_call(ctx)
        if call is not None:
            self.calls.abort(call[0], call[1], ctx.prefill)

    def prefill_timeout(self, time_remaining: float | None = None) -> float:
        """The prefill leg's deadline, bounded by the caller's own (gRPC) when it has one."""
        timeout_s = self._prefill_timeout_s
        if time_remaining is not None:
            timeout_s = max(min(timeout_s, time_remaining), 0.001)
        return timeout_s

    def _handoff(
        self, response: dict[str, Any] | None, ctx: HandoffContext, trace: RequestTrace
    ) -> dict[str, Any]:
        if not trace.active:
            return self.dialect.handoff(response, ctx)
        with trace.span(HANDOFF_SPAN):
            return self.dialect.handoff(response, ctx)

    async def _prefill(self, leg: PrefillLeg, ctx: HandoffContext, timings: Timings) -> Handoff:
        """A sequential prefill leg and its hand-off (``InvalidHandoff`` if unusable); stage
        times go into ``timings`` as each stage ends."""
        started = time.perf_counter()
        response = await self.calls.post_prefill(leg)
        timings.prefill = time.perf_counter() - started
        if self.dialect.answered_by_prefill(response):
            return Handoff({}, answer=self.dialect.prefill_answer(response), timings=timings)
        handoff_started = time.perf_counter()
        fields = self._handoff(response, ctx, leg.trace)
        timings.handoff = time.perf_counter() - handoff_started
        return Handoff(fields, timings=timings, response=response)

    # -- both legs: the HTTP door and fan-out sub-requests ----------------------------------

    async def start(self, request: PDRequest, decision: Decision | None = None) -> PDExchange:
        """Run the request as ``decision`` placed it, until the decode head has arrived
        (no decision: a pair on the request's target).

        A prefill whose engine provably did no work (``PrefillNotRun``) is run once more on
        another of the request's candidates, with a new context; a concurrent flow's decode,
        already sent, is aborted first.
        """
        if decision is None:
            decision = pair_on(request.target, request.prefill_rank, self.targets)
        if decision.fate is Fate.LOCAL:
            return await self._start_local(request, decision)
        if decision.fate is not Fate.PAIR or decision.target is None:
            raise decision.error or RuntimeError(f"not a pair: {decision.outcome}")
        target = decision.target
        alternative = self._alternative(request, target)
        try:
            return await self._start_on(request, decision, may_retry=alternative is not None)
        except PrefillNotRun as error:
            if alternative is None:
                raise
            why = error.message
        retry = (retry_pair(request.candidates, target, request.prefill_rank, self.targets)
                 or pair_on(alternative, request.prefill_rank, self.targets))
        logger.info("request %s: prefill target %s did no work (%s); retrying on %s",
                    request.request_id, target, why, retry.target)
        self._counters.retry(request.front_door)
        return await self._start_on(request, retry, may_retry=False)

    def _alternative(self, request: PDRequest, target: PrefillTarget) -> PrefillTarget | None:
        if len(request.candidates) < 2:
            return None
        return self.targets.pick(request.candidates, exclude=(target,))

    async def _start_local(self, request: PDRequest, decision: Decision) -> PDExchange:
        """The client's own body on the local engine: no prefill leg, no hand-off fields."""
        reason = decision.fallback_reason
        if reason is not None:
            self._counters.fallback(request.front_door, reason)
            self._log_fallback(request, reason, decision.why)
        ctx = HandoffContext(request.route, request.request_id, request.target,
                             request.target.host, request.front_door)
        body = request.raw if request.raw is not None else request.body
        decode = await self.calls.open_decode(request.route, body, request.headers,
                                              request.trace)
        return PDExchange(ctx=ctx, decode=decode, local=True, fallback_reason=reason,
                          outcome=decision.outcome)

    async def _start_on(self, request: PDRequest, decision: Decision, *,
                        may_retry: bool) -> PDExchange:
        if decision.target is not None and decision.target != request.target:
            request = replace(request, target=decision.target)
        ctx = await self.begin(request.route, request.request_id, request.target,
                               front_door=request.front_door,
                               prefill_rank=decision.prefill_rank,
                               decode_rank=decision.decode_rank)
        try:
            if self.dialect.legs_for(ctx) is Legs.CONCURRENT:
                return await self._start_concurrent(request, ctx)
            return await self._start_sequential(request, ctx, may_retry=may_retry)
        except BaseException as error:
            if self.dialect.learns and isinstance(error, Exception):
                self.dialect.leg_failed(error, ctx)
            self.abort(ctx)
            self.end(ctx)
            if isinstance(error, DecodeFailed) and (  # the dialect's setting to check
                    hint := self.dialect.decode_failure_hint(ctx)) is not None:
                raise DecodeFailed(f"{error.message}; {hint}", stage=error.stage) from None
            raise

    def _leg(self, request: PDRequest, ctx: HandoffContext) -> PrefillLeg:
        target = request.target
        return PrefillLeg(
            url=self.calls.prefill_url(target, request.route),
            body=self.dialect.prefill_body(request.body, ctx),
            headers=with_headers(request.headers, self.dialect.prefill_headers(ctx)),
            timeout_s=self._prefill_timeout_s,
            server_hostname=target.tls_name,
            target=target,
            trace=request.trace,
            rank=ctx.prefill_rank,
        )

    def _open_decode(self, request: PDRequest, ctx: HandoffContext,
                     body: Mapping[str, Any]) -> Awaitable[UpstreamResponse]:
        rank = ctx.decode_rank
        return self.calls.open_decode(
            request.route, body, with_headers(request.headers, self.dialect.decode_headers(rank)),
            request.trace, rank,
        )

    async def _start_sequential(
        self, request: PDRequest, ctx: HandoffContext, *, may_retry: bool
    ) -> PDExchange:
        timings = Timings()
        fallback_reason: str | None = None
        prefill_response: dict[str, Any] | None = None
        try:
            handoff = await self._prefill(self._leg(request, ctx), ctx, timings)
            if handoff.answer is not None:
                return PDExchange(ctx=ctx, decode=None, answer=handoff.answer, timings=timings,
                                  owner=self)
            prefill_response = handoff.response
            decode_body = self.dialect.decode_body(request.body, handoff.fields,
                                                   ctx.decode_rank)
        except _FALLBACK_ERRORS as error:
            if not self._local_fallback:
                raise
            if may_retry and isinstance(error, PrefillNotRun):
                raise  # another target comes first; the local fallback is the last resort
            fallback_reason = error.code
            self._counters.fallback(request.front_door, fallback_reason)
            self._log_fallback(request, error.code, error.message)
            decode_body = dict(request.body)
        decode_started = time.perf_counter()
        decode = await self._open_decode(request, ctx, decode_body)
        timings.decode_first_byte = time.perf_counter() - decode_started
        return PDExchange(ctx=ctx, decode=decode, fallback_reason=fallback_reason,
                          timings=timings, owner=self, prefill_response=prefill_response,
                          outcome=FALLBACK if fallback_reason else OK)

    def _log_fallback(self, request: PDRequest, reason: str, why: str) -> None:
        left_out = self._fallback_log.due()
        if left_out is None:
            return
        more = f" ({left_out} more since the last such line)" if left_out else ""
        logger.warning("request %s: prefill failed: %s (%s); served whole by the local engine "
                       "(--on-prefill-failure local)%s", request.request_id, reason, why, more)

    async def _start_concurrent(self, request: PDRequest, ctx: HandoffContext) -> PDExchange:
        return await concurrent_legs.start(self, request, ctx)

    # -- one leg: the gRPC services ---------------------------------------------------------

    async def prefill_only(
        self, client_body: Mapping[str, Any], *, request_id: str, target: PrefillTarget,
        advertise_host: str, headers: Mapping[str, str], time_remaining: float | None,
        scope: RequestScope, scopes: Scopes, rank: int | None = None,
    ) -> Handoff:
        """The prefill half on the local engine, as gRPC Prefill runs it; ``target`` is this
        pod's engine as the hand-off names it; ``rank``: the local rank the router named.

        Concurrent dialects: the hand-off is known at once and returned; the engine call
        (which blocks until a decode connects) runs on in the background, holding the
        request's admission slot (``scope.detach``) and its dialect state until it ends,
        bounded by the prefill timeout, counted through ``scopes`` and logged when it fails.
        """
        route = Route.COMPLETIONS
        ctx = await self.begin(route, request_id, target, advertise_host, FrontDoor.GRPC,
                               prefill_rank=self.ranks.local(rank))
        handed_off = False
        try:
            leg = PrefillLeg(
                url=self.calls.local_url(route),
                body=self.dialect.prefill_body(client_body, ctx),
                headers=with_headers(headers, self.dialect.prefill_headers(ctx)),
                timeout_s=self.prefill_timeout(time_remaining),
                trace=scope.trace,
                rank=ctx.prefill_rank,
            )
            if self.dialect.legs_for(ctx) is Legs.CONCURRENT:
                fields = self._handoff(None, ctx, scope.trace)
                # The engine call outlives this RPC: its own deadline, not the caller's.
                background = replace(leg, timeout_s=self.prefill_timeout())
                release_admission = scope.detach()

                def done() -> None:
                    self.end(ctx)
                    release_admission()

                self.background.run(
                    concurrent_legs.background_prefill(self.dialect, self.calls, background, ctx),
                    request_id, scopes, done)
                handed_off = True
                return Handoff(fields)
            timings = Timings()
            try:
                handoff = await self._prefill(leg, ctx, timings)
            finally:
                scope.observe_timings(timings)
            if handoff.answer is not None:
                self._counters.fallback(FrontDoor.GRPC, ANSWERED_BY_PREFILL)
                logger.info("request %s: the prefill finished the sequence; decode recomputes",
                            request_id)
            return handoff
        finally:
            if not handed_off:
                self.end(ctx)

    def decode_body(self, client_body: Mapping[str, Any],
                    fields: Mapping[str, Any], rank: int | None = None) -> dict[str, Any]:
        """The decode body from a client body and a hand-off's fields (on ``rank``)."""
        return self.dialect.decode_body(client_body, fields, rank)

    async def open_decode(self, route: Route, body: Mapping[str, Any] | bytes,
                          headers: Mapping[str, str],
                          trace: RequestTrace = NOOP_TRACE,
                          rank: int | None = None) -> UpstreamResponse:
        """The decode half on the local engine, as gRPC Decode runs it (on ``rank``)."""
        return await self.calls.open_decode(
            route, body, with_headers(headers, self.dialect.decode_headers(rank)), trace, rank)

    async def close(self) -> None:
        """Cancel the background prefills still running (server stop)."""
        await self.background.close()
