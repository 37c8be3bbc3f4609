"""A stream whose engine died, continued on another engine token for token
(``--migration-limit``, docs/operating/reliability.md#migration).

    plan = migrations.plan(route, body, stream)     before it runs (a few look-ups): what
                                                    the engine's body gets (its token ids
                                                    asked), whether the relay keeps the
                                                    stream's bytes, or why it cannot move
    ... the engine breaks the stream (reset, closed early, a 5xx error event, stalled) ...
    so_far = plan.read_back(kept bytes)             what the client has (parsed only now)
    resumed = await migrations.resume(request, decision, plan, so_far, error, ...)
        why it cannot continue exactly, if it cannot     ─▶ NotMigrated (counted: refused)
        placement.move_after: where (a prefill target that runs requests whole, a
          --migration-url engine, the local engine)      ─▶ NotMigrated when nowhere
        the join at a chunk's end whose last character is finished (the engine reads the
          chunk's last ids back as text: an engine may hold back an unfinished character)
        the continuation (the dialect's body: the prompt's ids and the answer's so far,
          the limits lowered) opened there by the runner ─▶ Resumed(exchange, join, ...)
          (one that does not open: counted failed, the next engine is decided)

A request that runs whole or as a pair is moved the same way before its head arrived (a JSON
answer, a stream that broke at once): the runner does it (``Runner.run``), with the client's
own body. Counted in ``disagg_migrations_total{outcome, reason}``; one log line per move or
refusal; the move in a ``disagg.migration`` span.

Why a stream is not moved (``reason``): ``disabled`` (``--migration-limit 0``), ``limit``
(moved as often as allowed), the body's (``sidecar.dialects.continuation``:
``guided_decoding``, ``logprobs``, ``penalties``, ``tools``, ``engine_state``,
``fanned_out``), ``no_token_ids`` (the engine's stream on this route carries none: Responses,
Messages, ...), ``stream_too_long`` (past ``--migration-max-stream-bytes``), ``finished``
(the answer was whole; only its end was lost), ``parsed_output`` (the engine parsed the
answer into reasoning or tool calls), ``stop_strings`` (a stop string could span the join),
``join`` (none of the last chunk ends finishes a character), ``no_target``.

Deliberate limits: a sampled answer continues with its sampling fields and seed (a valid
sample, not the tokens the dead engine would have drawn); the prompt's cache figures of a
moved whole run are not known (the usage rule: the prefill's in a pair, none otherwise).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from sidecar.dialects import Dialect
from sidecar.errors import EngineRejected, SidecarError
from sidecar.observability.tracing import (
    MIGRATION_FROM_TOKEN,
    MIGRATION_MOVES,
    MIGRATION_REASON,
    MIGRATION_SPAN,
    LegSpan,
)
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.protocol.continuation import (
    CONTINUABLE,
    Join,
    SoFar,
    TokenIdPlaces,
    ids_stripper,
    read_stream,
)
from sidecar.request.legs import PDExchange, PDRequest
from sidecar.request.placement import DISABLED, Decision, Fate, move_after
from sidecar.request.runner import MOVE_FAILED, MOVED, NOT_MOVED, Runner

logger = logging.getLogger(__name__)

NO_TOKEN_IDS: Final = "no_token_ids"
STREAM_TOO_LONG: Final = "stream_too_long"
FINISHED: Final = "finished"
PARSED_OUTPUT: Final = "parsed_output"
STOP_STRINGS: Final = "stop_strings"
JOIN: Final = "join"
FANNED_OUT: Final = "fanned_out"
#: The ids read back at a chunk's end to see whether its last character is finished (a
#: character is at most 4 bytes, each id at least one).
TAIL_IDS: Final = 8
#: The replacement character a decoder writes for bytes that do not finish a character yet.
REPLACEMENT: Final = "\ufffd"
_MAX_TEXT_ANSWER: Final = 16 * 1024 * 1024


class Plan(msgspec.Struct, frozen=True):
    """A request's migration as decided before it runs."""

    route: Route
    #: Where the engine's stream carries token ids (None: it carries none).
    places: TokenIdPlaces | None = None
    #: Why its stream cannot move (None: it may).
    refusal: str | None = None
    #: The client asked for the ids itself (it sees them).
    asked: bool = False
    #: Fields the engine's body gets besides the client's (the ids asked).
    engine_fields: Mapping[str, Any] = msgspec.field(default_factory=dict)
    #: What turns the engine's asked stream into the one the client would see unasked.
    strip: Callable[[bytes], bytes] | None = None

    @property
    def keeps(self) -> bool:
        """The relay keeps the stream's bytes (it may be continued)."""
        return self.refusal is None and self.places is not None

    def read_back(self, kept: bytes, body: Mapping[str, Any]) -> SoFar:
        """What the client has of the stream whose engine's bytes are ``kept``."""
        assert self.places is not None
        return read_stream(self.route, kept, self.places, body)


#: Migration off: nothing kept, nothing asked.
OFF: Final = Plan(Route.COMPLETIONS, refusal=DISABLED)


class NotMigrated(Exception):
    """Raised with the error a stream ends with when it is not moved (its message names why)."""

    def __init__(self, error: SidecarError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class Resumed:
    """A continuation opened: its exchange, the join that writes it as the client's stream,
    and the decision it runs on (the next failure is decided from it)."""

    exchange: PDExchange
    join: Join
    decision: Decision


class Migrations:
    """The migrations of one dialect's streams (see the module docstring)."""

    def __init__(self, dialect: Dialect, runner: Runner, *, limit: int,
                 counter: Callable[[str, str], None] = lambda outcome, reason: None) -> None:
        self.dialect = dialect
        self.runner = runner
        self.limit = limit
        self._count = counter
        #: The plans of requests that may move, by route and whether the client asked for
        #: the ids itself (made once: a request's plan is a look-up).
        self._plans: dict[tuple[Route, bool], Plan] = {}
        #: A JSON request's plan (it runs again whole: nothing to keep), read without a call
        #: on the JSON path.
        self.whole = OFF if limit <= 0 else Plan(Route.COMPLETIONS)

    # -- before a request runs ---------------------------------------------------------------

    def plan(self, route: Route, body: Mapping[str, Any], stream: bool) -> Plan:
        """What a request on ``route`` needs so that it may move (see the module docstring)."""
        if self.limit <= 0:
            return OFF
        if not stream:
            return self.whole
        places = self.dialect.token_ids(route) if route in CONTINUABLE else None
        if places is None:
            return Plan(route, refusal=NO_TOKEN_IDS)
        refusal = self.dialect.continuation_refusal(route, body)
        if refusal is not None:
            return Plan(route, places, refusal)
        asked = places.asked_by(body)
        plan = self._plans.get((route, asked))
        if plan is None:
            if asked or not places.ask:
                plan = Plan(route, places, asked=True)
            else:
                plan = Plan(route, places, engine_fields=places.ask,
                            strip=ids_stripper(places))
            self._plans[route, asked] = plan
        return plan

    # -- after its stream broke ------------------------------------------------------------

    async def resume(self, request: PDRequest, decision: Decision, plan: Plan,
                     so_far: SoFar | None, error: SidecarError, *,
                     failed: PrefillTarget | None, overflowed: bool = False,
                     details: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None,
                     ) -> Resumed:
        """The continuation of a stream that broke with ``error`` on ``failed`` (None: the
        local engine) after the client got ``so_far``; ``NotMigrated`` when it is not moved."""
        started = time.perf_counter()
        trace = request.trace
        with trace.span(MIGRATION_SPAN) as span:
            try:
                resumed = await self._resume(request, decision, plan, so_far, error, span,
                                             failed=failed, overflowed=overflowed,
                                             details=details)
            except NotMigrated as refused:
                span.fail(refused.error)
                raise
            if span.recording:
                span.set(MIGRATION_MOVES, resumed.decision.moves)
                span.set(MIGRATION_FROM_TOKEN, resumed.join.produced)
        logger.warning(
            "request %s: %s after %d tokens; migrated to %s (move %d of %d), continuing from "
            "token %d, opened in %.0f ms", request.request_id, error.message,
            len(so_far.ids) if so_far is not None else 0,
            _where(resumed.decision.target), resumed.decision.moves, self.limit,
            resumed.join.produced, (time.perf_counter() - started) * 1000)
        return resumed

    async def _resume(self, request: PDRequest, decision: Decision, plan: Plan,
                      so_far: SoFar | None, error: SidecarError, span: LegSpan, *,
                      failed: PrefillTarget | None, overflowed: bool,
                      details: Callable[[Mapping[str, Any]], dict[str, Any]] | None,
                      ) -> Resumed:
        refusal = plan.refusal
        if refusal is None:
            refusal = STREAM_TOO_LONG if overflowed else _refusal(so_far)
        runner = self.runner
        while True:
            facts = await runner.move_facts(request, decision, failed, refusal=refusal)
            following = move_after(decision, failed, facts, runner.rules, runner.targets)
            if span.recording:
                span.set(MIGRATION_REASON, following.reason or error.code)
            if following.fate is not Fate.MOVE:
                # Each refusal of ``move_after`` names its reason (``_not_moved``).
                assert following.reason is not None
                raise self._refused(request, error, following.reason)
            assert so_far is not None and plan.places is not None
            fresh = so_far.events == 0
            route: Route
            body: Mapping[str, Any] | bytes
            produced, skip_text = 0, ""
            if fresh:  # nothing reached the client: its own request, whole, elsewhere
                route, body = plan.route, request.engine_body()
            else:
                assert so_far.prompt_ids is not None
                try:
                    produced, skip_text = await self._aligned(so_far, following.target)
                except NotAligned:
                    raise self._refused(request, error, JOIN) from None
                if _spans_stop(request.body, plan.route, so_far.text, len(skip_text)):
                    raise self._refused(request, error, STOP_STRINGS)
                route, body = self.dialect.continuation(plan.route, request.body,
                                                        so_far.prompt_ids,
                                                        so_far.ids[:produced])
            try:
                exchange = await runner.move(request, following, route, body)
            except SidecarError as failure:
                self._count(MOVE_FAILED, failure.code)
                logger.warning("request %s: the continuation on %s did not start: %s (%s)",
                               request.request_id, _where(following.target), failure.code,
                               failure.message)
                if isinstance(failure, EngineRejected):
                    raise NotMigrated(error) from None  # the request's own fault: anywhere
                decision, failed = following, following.target
                continue
            self._count(MOVED, error.code)
            join = Join(so_far, route, plan.places, plan.asked, produced,
                        skip_text=skip_text, skip_ids=so_far.ids[produced:],
                        details=None if fresh else details, fresh=fresh, strip=plan.strip)
            return Resumed(exchange, join, following)

    def _refused(self, request: PDRequest, error: SidecarError, reason: str) -> NotMigrated:
        return NotMigrated(self.refused(request.request_id, error, reason))

    def refused(self, request_id: str, error: SidecarError, reason: str) -> SidecarError:
        """The error a stream that does not move ends with (its message names why), counted
        and logged."""
        self._count(NOT_MOVED, reason)
        if reason == DISABLED:
            return error
        logger.warning("request %s: %s; not migrated: %s", request_id, error.message, reason)
        return type(error)(f"{error.message}; not migrated: {reason}", stage=error.stage)

    def count_failed(self, reason: str) -> None:
        """A continuation that broke its promise (it diverged from the answer so far)."""
        self._count(MOVE_FAILED, reason)

    async def _aligned(self, so_far: SoFar, engine: PrefillTarget | None) -> tuple[int, str]:
        return await join_point(so_far, functools.partial(self._text_of, engine))

    async def _text_of(self, engine: PrefillTarget | None, ids: list[int]) -> str:
        endpoint = self.dialect.ids_text
        if endpoint is None:
            raise NotAligned
        if not ids:
            return ""
        try:
            answer = await self.runner.calls.post_engine(
                engine, endpoint.path, {**endpoint.extra, endpoint.ids_field: ids},
                max_bytes=_MAX_TEXT_ANSWER)
        except SidecarError:
            raise NotAligned from None
        text = answer.get(endpoint.text_field)
        if not isinstance(text, str):
            raise NotAligned
        return text


class NotAligned(Exception):
    """No chunk end among the last marks finishes a character (or the read-back failed)."""


async def join_point(so_far: SoFar, text_of: Callable[[list[int]], Awaitable[str]],
                     ) -> tuple[int, str]:
    """Where a continuation starts: the latest chunk end (of ``so_far.marks``) whose last id
    finishes a character (``produced``, the ids up to it), and the text the client has after
    it, which the continuation regenerates (``skip_text``). Each chunk end's last ids are read
    back as text (``text_of``, the engine's detokenizer): one ending in U+FFFD was held back.
    Only the tail is read: the client's text is compared with nothing the engine writes
    differently when asked (special tokens, which a stream leaves out and a read-back keeps).
    None of the marks: ``NotAligned``."""
    ids = so_far.ids
    if not so_far.has_text or not ids:
        return len(ids), ""
    prompt = so_far.prompt_ids or []
    for produced, length in reversed(so_far.marks):
        tail = ids[max(produced - TAIL_IDS, 0):produced]
        if len(tail) < TAIL_IDS and prompt:
            tail = prompt[len(tail) - TAIL_IDS:] + tail
        if not (await text_of(tail)).endswith(REPLACEMENT):
            return produced, so_far.text[length:]
    raise NotAligned


def _refusal(so_far: SoFar | None) -> str | None:
    """Why what the client has cannot be continued (the stream's own reasons)."""
    if so_far is None:
        return NO_TOKEN_IDS
    if so_far.events == 0:
        return None  # nothing reached the client: it runs again whole
    if so_far.prompt_ids is None:
        return NO_TOKEN_IDS
    if so_far.several:
        return FANNED_OUT
    if so_far.finished:
        return FINISHED
    if so_far.parsed:
        return PARSED_OUTPUT
    return None


def _spans_stop(body: Mapping[str, Any], route: Route, text: str, regenerated: int) -> bool:
    """True when a stop string could begin in the text before the join and end after it (the
    continuation's engine would not see it whole)."""
    fields = body.get("sampling_params") if route is Route.GENERATE else body
    stop = fields.get("stop") if isinstance(fields, Mapping) else None
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    before = text[:len(text) - regenerated] if regenerated else text
    return any(isinstance(s, str) and any(before.endswith(s[:k]) for k in range(1, len(s)))
               for s in stops)


def _where(target: PrefillTarget | None) -> str:
    return "the local engine" if target is None else str(target)
