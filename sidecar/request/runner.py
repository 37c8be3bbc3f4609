"""How a request's legs run, the same for both front doors: one runner, one small way per fate.

    runner.run(request, decision) ─▶ PDExchange     the HTTP door, each fan-out sub-request
        LOCAL   run_local: the client's own body on the local engine alone
        PAIR    the pair's context begins (dialect state, decode rank held, the dialect's
                look-up), then the dialect's way for this request (``legs_for``):
                SEQUENTIAL  run_sequential: prefill ─▶ hand-off ─▶ open decode
                CONCURRENT  ``sidecar.request.concurrent``: prefill ║ open decode, watched
        MOVE    run_moved: the request whole on the engine the placement moved it to
        a pair whose leg failed before its decode answered ─▶ placement.after_failure: a
                pair on another target, the local fallback, a move, or the error (the runner
                never decides where a request runs: it runs what it was given)
        a whole run whose engine failed before answering ─▶ placement.move_after: a move,
                or the error
    runner.move(request, decision, route, body) ─▶ PDExchange   a migrated stream's
                continuation (``sidecar.request.migration``), whole where the move decided
    runner.prefill_only(...) ─▶ Handoff             gRPC Prefill: the prefill half
        SEQUENTIAL: the prefill, then its hand-off
        CONCURRENT: the hand-off at once; the engine call runs on in the background, watched
    runner.open_decode(...)  ─▶ UpstreamResponse    gRPC Decode: the decode half

Every way is given a ``Pair`` (``sidecar.request.legs``): the request, its context and the
few things a way does with them (the prefill leg, the hand-off, the decode body and its
opening, the exchange it hands the relay). The dialect says what the bodies hold and how the
legs run; ``EngineCalls`` makes the calls; the runner begins and ends the dialect's
per-request state and hands abort and release to the ``PDExchange``. A client gone cancels
every upstream call. The decode leg's data-parallel rank stays busy until the request ends.

A move (``--migration-limit``) runs the client's request whole on another engine after the
engine serving it failed before answering (a JSON answer is only known whole; a stream that
broke before its head): counted in ``disagg_migrations_total`` and logged, one line each.

Deliberate limits: a pair moves once (placement: ``after_failure``), only off a prefill whose
engine provably did no work; the local fallback after a failed leg exists where the decode
has not been sent (sequential legs; before any leg every dialect's request may fall back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from sidecar.dialects import Dialect, Legs
from sidecar.engines.calls import EngineCalls, PrefillLeg, with_headers
from sidecar.engines.health import EngineHealth
from sidecar.errors import DecodeFailed, SidecarError, Stage
from sidecar.http1 import UpstreamResponse
from sidecar.observability.logs import LogEvery
from sidecar.observability.tracing import (
    MIGRATION_FROM_TOKEN,
    MIGRATION_MOVES,
    MIGRATION_REASON,
    MIGRATION_SPAN,
    NOOP_TRACE,
    RequestTrace,
)
from sidecar.protocol.context import FrontDoor, HandoffContext, PrefillTarget, Route
from sidecar.request import concurrent
from sidecar.request.legs import (
    Pair,
    PDExchange,
    PDRequest,
    Way,
    run_sequential,
    traced_handoff,
)
from sidecar.request.placement import (
    Decision,
    Fate,
    MoveFacts,
    Rules,
    Targets,
    after_failure,
    decode_engine_failed,
    move_after,
    pair_on,
)
from sidecar.request.scope import MIGRATED, RequestScope, Scopes, Timings
from sidecar.targets.choice import LegRanks
from sidecar.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: The reason a gRPC Prefill counts when its prefill already finished the answer.
ANSWERED_BY_PREFILL = "answered_by_prefill"
#: Local-prefill fallbacks are logged at most once per this many seconds (each is counted).
_FALLBACK_LOG_INTERVAL_S = 10.0


@dataclass(slots=True)
class Handoff:
    """What a prefill leg produced for its decode: the top-level ``fields`` of the decode body,
    or (empty fields) the ``answer`` as the client sees it when the prefill already is one."""

    fields: dict[str, Any]
    answer: dict[str, Any] | None = None
    timings: Timings = field(default_factory=Timings)
    #: The prefill engine's answer (its usage is what the client is told: the usage rule).
    response: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class FlowCounters:
    """What the runner counts: local-prefill fallbacks (front door, reason), retries and
    migrations (outcome, reason)."""

    fallback: Callable[[str, str], None] = lambda front_door, reason: None
    retry: Callable[[str], None] = lambda front_door: None
    migration: Callable[[str, str], None] = lambda outcome, reason: None


#: ``disagg_migrations_total{outcome}``: moved, not moved (its reason), or the move failed.
MOVED: Final = "migrated"
NOT_MOVED: Final = "refused"
MOVE_FAILED: Final = "failed"


class Runner:
    """Runs the requests of one dialect's engine as their placement decided (see the module
    docstring)."""

    def __init__(
        self,
        dialect: Dialect,
        calls: EngineCalls,
        targets: Targets,
        ranks: LegRanks,
        *,
        prefill_timeout_s: float,
        rules: Rules | None = None,
        counters: FlowCounters | None = None,
        health: EngineHealth | None = None,
    ) -> None:
        self.dialect = dialect
        self.calls = calls
        #: The prefill targets and ranks as the placement decision sees them.
        self.targets = targets
        self.ranks = ranks
        self.prefill_timeout_s = prefill_timeout_s
        self.rules = rules or Rules()
        self._counters = counters or FlowCounters()
        #: The local engine's readiness (a move to it asks).
        self.health = health
        self._background: set[asyncio.Task[None]] = set()
        self._fallback_log = LogEvery(_FALLBACK_LOG_INTERVAL_S)

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
        timeout_s = self.prefill_timeout_s
        if time_remaining is not None:
            timeout_s = max(min(timeout_s, time_remaining), 0.001)
        return timeout_s

    # -- both legs: the HTTP door and fan-out sub-requests ----------------------------------

    async def run(self, request: PDRequest, decision: Decision | None = None) -> PDExchange:
        """Run ``request`` as ``decision`` placed it (None: a pair on the request's target),
        until the decode head has arrived; a pair's leg that failed before the decode answered
        is decided again (``placement.after_failure``), and so is a whole run whose engine
        failed before answering (``placement.move_after``)."""
        if decision is None:
            decision = pair_on(request.target, request.prefill_rank, self.targets)
        while True:
            try:
                if decision.fate is Fate.LOCAL:
                    return await self._run_local(request, decision)
                if decision.fate is Fate.MOVE:
                    return await self._moved(request, decision)
                if decision.fate is not Fate.PAIR or decision.target is None:
                    raise decision.error or RuntimeError(f"not a pair: {decision.outcome}")
                return await self._run_pair(request, decision)
            except _PairFailed as failure:
                error, concurrent = failure.error, failure.concurrent
                moves = (await self.move_facts(request, decision, None)
                         if self._may_move(error) else None)
                following = after_failure(decision, error, request.candidates,
                                          request.prefill_rank, self.rules, self.targets,
                                          decode_sent=concurrent, moves=moves)
            except SidecarError as error_:
                if decision.fate not in (Fate.LOCAL, Fate.MOVE) or not self._may_move(error_):
                    raise
                error = error_
                failed = decision.target if decision.fate is Fate.MOVE else None
                facts = await self.move_facts(request, decision, failed)
                following = move_after(decision, failed, facts, self.rules, self.targets)
            self._next(request, decision, error, following)
            decision = following

    def _may_move(self, error: SidecarError) -> bool:
        """Migration is on and ``error`` is the answering engine's failure."""
        return self.rules.migration_limit > 0 and decode_engine_failed(error)

    def _next(self, request: PDRequest, decision: Decision, error: SidecarError,
              following: Decision) -> None:
        """Count and log the decision taken after ``decision`` failed with ``error``; raise
        ``error`` when it is a refusal."""
        if following.fate is Fate.REFUSE:
            if following.reason is not None and self.rules.migration_limit > 0:
                self._counters.migration(NOT_MOVED, following.reason)
                logger.warning("request %s: %s; not migrated: %s", request.request_id,
                               error.message, following.reason)
            raise error
        if following.fate is Fate.PAIR:
            logger.info("request %s: prefill target %s did no work (%s); retrying on %s",
                        request.request_id, decision.target, error.message, following.target)
            self._counters.retry(request.front_door)
        elif following.fate is Fate.MOVE:
            self._counters.migration(MOVED, error.code)
            logger.warning("request %s: %s; migrated: %s (move %d)",
                           request.request_id, error.message, following.why,
                           following.moves)

    async def rerun(self, request: PDRequest, decision: Decision,
                    error: SidecarError) -> PDExchange:
        """``request`` whole on another engine, after the one serving its JSON answer (run
        on ``decision``) failed with ``error`` while the answer was read; ``error`` when it
        may not move."""
        failed = decision.target if decision.fate is Fate.MOVE else None
        facts = await self.move_facts(request, decision, failed)
        following = move_after(decision, failed, facts, self.rules, self.targets)
        self._next(request, decision, error, following)
        return await self.run(request, following)

    async def move_facts(self, request: PDRequest, decision: Decision,
                         failed: PrefillTarget | None, *,
                         refusal: str | None = None) -> MoveFacts:
        """What a move of ``request`` off ``failed`` is decided on: its targets, ``refusal``,
        and whether the local engine may take it (asked again when it failed this request)."""
        health = self.health
        failed_here = failed is None or None in decision.failed_on
        if health is None:
            ready = not failed_here
        elif failed_here:
            ready = await health.recheck()
        else:
            ready = not health.known_down or await health.recheck()
        return MoveFacts(failed, request.candidates, refusal, ready)

    async def _moved(self, request: PDRequest, decision: Decision) -> PDExchange:
        """A request moved before its answer began: whole where ``decision`` sends it (in
        its migration span when traced)."""
        trace = request.trace
        if not trace.active:
            return await self.move(request, decision)
        with trace.span(MIGRATION_SPAN) as span:
            span.set(MIGRATION_REASON, MIGRATED)
            span.set(MIGRATION_MOVES, decision.moves)
            span.set(MIGRATION_FROM_TOKEN, 0)
            return await self.move(request, decision)

    async def move(self, request: PDRequest, decision: Decision, route: Route | None = None,
                   body: Mapping[str, Any] | bytes | None = None) -> PDExchange:
        """Run ``request`` whole where ``decision`` moved it (``body`` on ``route``: a
        migrated stream's continuation; None: the client's own request)."""
        route = route or request.route
        if body is None:
            body = request.engine_body()
        ctx = HandoffContext(request.route, request.request_id, request.target,
                             request.target.host, request.front_door)
        timings = Timings()
        started = time.perf_counter()
        decode = await self.calls.open_on(decision.target, route, body, request.headers,
                                          request.trace)
        timings.decode_first_byte = time.perf_counter() - started
        return PDExchange(ctx=ctx, decode=decode, local=True, outcome=MIGRATED,
                          timings=timings, decision=decision)

    async def _run_local(self, request: PDRequest, decision: Decision) -> PDExchange:
        """The client's own body on the local engine: no prefill leg, no hand-off fields."""
        reason = decision.fallback_reason
        if reason is not None:
            self._counters.fallback(request.front_door, reason)
            self._log_fallback(request, reason, decision.why)
        rank = decision.decode_rank
        ctx = HandoffContext(request.route, request.request_id, request.target,
                             request.target.host, request.front_door, decode_rank=rank)
        body = request.engine_body()
        headers = request.headers if rank is None else with_headers(
            request.headers, self.dialect.decode_headers(rank))
        timings = Timings()
        self.ranks.hold(rank)
        try:
            started = time.perf_counter()
            decode = await self.calls.open_decode(request.route, body, headers, request.trace,
                                                  rank)
            timings.decode_first_byte = time.perf_counter() - started
        except BaseException:
            self.ranks.release(rank)
            raise
        return PDExchange(ctx=ctx, decode=decode, local=True, fallback_reason=reason,
                          outcome=decision.outcome, timings=timings,
                          owner=None if rank is None else _RankHolder(self.ranks))

    async def _run_pair(self, request: PDRequest, decision: Decision) -> PDExchange:
        assert decision.target is not None
        if decision.target != request.target:
            request = msgspec.structs.replace(request, target=decision.target)
        ctx = await self.begin(request.route, request.request_id, request.target,
                               front_door=request.front_door,
                               prefill_rank=decision.prefill_rank,
                               decode_rank=decision.decode_rank)
        legs = self.dialect.legs_for(ctx)
        pair = Pair(request, ctx, self.dialect, self.calls,
                    prefill_timeout_s=self.prefill_timeout_s, owner=self)
        try:
            return await _WAYS[legs](pair)
        except BaseException as error:
            if self.dialect.learns and isinstance(error, Exception):
                self.dialect.leg_failed(error, ctx)
            self.abort(ctx)
            self.end(ctx)
            if not isinstance(error, SidecarError):
                raise
            if isinstance(error, DecodeFailed) and (  # the dialect's setting to check
                    hint := self.dialect.decode_failure_hint(ctx)) is not None:
                raise DecodeFailed(f"{error.message}; {hint}", stage=error.stage) from None
            raise _PairFailed(error, legs is Legs.CONCURRENT) from None

    def _log_fallback(self, request: PDRequest, reason: str, why: str) -> None:
        left_out = self._fallback_log.due()
        if left_out is None:
            return
        more = f" ({left_out} more since the last such line)" if left_out else ""
        logger.warning("request %s: prefill failed: %s (%s); served whole by the local engine "
                       "(--on-prefill-failure local)%s", request.request_id, reason, why, more)

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
                fields = traced_handoff(self.dialect, None, ctx, scope.trace)
                # The engine call outlives this RPC: its own deadline, not the caller's.
                detached = msgspec.structs.replace(leg, timeout_s=self.prefill_timeout())
                self._in_background(detached, ctx, scopes, scope.detach())
                handed_off = True
                return Handoff(fields)
            timings = Timings()
            try:
                started = time.perf_counter()
                response = await self.calls.post_prefill(leg)
                timings.prefill = time.perf_counter() - started
                if self.dialect.answered_by_prefill(response):
                    self._counters.fallback(FrontDoor.GRPC, ANSWERED_BY_PREFILL)
                    logger.info("request %s: the prefill finished the sequence; decode "
                                "recomputes", request_id)
                    return Handoff({}, answer=self.dialect.prefill_answer(response))
                handoff_started = time.perf_counter()
                fields = traced_handoff(self.dialect, response, ctx, scope.trace)
                timings.handoff = time.perf_counter() - handoff_started
                return Handoff(fields, timings=timings, response=response)
            finally:
                scope.observe_timings(timings)
        finally:
            if not handed_off:
                self.end(ctx)

    def _in_background(self, leg: PrefillLeg, ctx: HandoffContext, scopes: Scopes,
                       release_admission: Callable[[], None]) -> None:
        """Run a gRPC Prefill's engine call to its end, whatever becomes of the RPC: counted,
        logged when it fails, shown to a learning dialect; its dialect state and admission
        slot go back when it ends."""

        async def prefill() -> None:
            started = time.perf_counter()
            try:
                response = await self.calls.post_prefill(leg)
                scopes.observe("prefill", time.perf_counter() - started)
                if self.dialect.learns:
                    self.dialect.answered_stale(response, ctx)
            except SidecarError as error:
                if self.dialect.learns:
                    self.dialect.leg_failed(error, ctx)
                scopes.count_error(error)
                logger.warning("request %s: background prefill failed after the hand-off: "
                               "%s (%s)", ctx.request_id, error.code, error.message)
            except asyncio.CancelledError:
                logger.info("request %s: background prefill cancelled", ctx.request_id)
                raise
            except Exception:
                scopes.count_error(SidecarError("background prefill crashed",
                                                stage=Stage.PREFILL))
                logger.exception("request %s: background prefill crashed", ctx.request_id)
            finally:
                self.end(ctx)
                release_admission()

        task = asyncio.ensure_future(prefill())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
        await cancel_and_wait(*self._background)


#: How a pair's legs run, by what its dialect says of the request (``Dialect.legs_for``).
_WAYS: dict[Legs, Way] = {Legs.SEQUENTIAL: run_sequential, Legs.CONCURRENT: concurrent.run}


class _PairFailed(Exception):
    """A pair's legs failed (its context already ended): ``error``, and whether its legs ran
    at once (a decode was sent with the prefill)."""

    def __init__(self, error: SidecarError, concurrent: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.concurrent = concurrent


class _RankHolder:
    """Ends a local run on a data-parallel rank: the rank is free again."""

    __slots__ = ("_ranks",)

    def __init__(self, ranks: LegRanks) -> None:
        self._ranks = ranks

    def abort(self, ctx: HandoffContext) -> None:
        """Nothing to abort: the local engine saw the client's own request."""

    def end(self, ctx: HandoffContext) -> None:
        self._ranks.release(ctx.decode_rank)


__all__ = ["FlowCounters", "Handoff", "PDRequest", "Runner"]
