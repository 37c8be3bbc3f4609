"""The placement decision: where one request runs, decided before any leg is sent, and again
after a leg that failed; and the placer that gathers its facts.

    route_fate(route, support, has_targets)        before the body is read
        no prefill target (header or pool)         ─▶ PASSTHROUGH  passthrough
        the engine does not serve the route        ─▶ REFUSE       unserved_route (404)
        it serves the route, not as a pair         ─▶ LOCAL        local_route
        otherwise                                  ─▶ None: decide() on the request's facts
    decide(facts, rules, targets)                  per request, and per fan-out sub-request
        the body names state held by one engine    ─▶ LOCAL        local_state
        the local engine is known down             ─▶ REFUSE       engine_not_ready (503)
        prompt tokens <= max_tokens or             ─▶ LOCAL        local_short
            <= max_uncached (cached or not)
        tokens not cached <= max_uncached          ─▶ LOCAL        local_cached
        (the rules above: ``local_fate``; below: ``pair_fate``)
        a target that can hand off to this engine  ─▶ PAIR         ok (target, prefill rank,
        and whose breaker lets a leg in                            decode rank)
        none can hand off, local fallback allowed  ─▶ LOCAL        fallback (its code)
        none can hand off (another model or KV     ─▶ REFUSE       prefill_target_mismatch
        layout, or it does not say)                                (502)
        every breaker open, local fallback allowed ─▶ LOCAL        fallback (breaker_open)
        every breaker open                         ─▶ REFUSE       prefill_failed (502)
    after_failure(decision, error, ...)            a pair's leg failed before its decode began
        its prefill provably did no work, first    ─▶ PAIR         on another candidate whose
        try, another candidate's breaker lets in                   breaker lets a leg in and
                                                                   that can hand off
        a prefill failure (the leg failed, its     ─▶ LOCAL        fallback (the error's code)
        hand-off was unusable, its deadline
        passed), the decode not sent, local
        fallback allowed
        the decode engine failed (an engine fault  ─▶ move_after (below)
        after the decode was sent), a move allowed
        otherwise                                  ─▶ REFUSE       the error itself
    move_after(decision, failed, facts, rules, targets)   the engine serving the answer
                                                   failed (before its head, or mid-stream:
                                                   ``sidecar.request.migration``)
        --migration-limit 0, or moved as often     ─▶ REFUSE       disabled / limit
        the request cannot continue exactly        ─▶ REFUSE       its reason
        a candidate prefill target (an engine      ─▶ MOVE         migrated: whole there
        whose prefill servers run requests whole),
        not failed here, its breaker letting in
        a --migration-url engine, likewise         ─▶ MOVE         migrated: whole there
        the local engine, not failed here (or      ─▶ MOVE         migrated: whole on it
        known ready again)
        none                                       ─▶ REFUSE       no_target

The functions are pure: every input is a value, but the prefill targets (``Targets``:
the target choice, its breakers and the data-parallel ranks), which are asked only on the way
to a pair, so no local outcome ever consults a breaker. The runner
(``sidecar.request.runner``) runs what they decide and asks ``after_failure`` when a leg
fails; nothing else decides where a request runs.

``Placer`` gathers the facts (the body's state, the engine's readiness, the prompt's tokens
and cached tokens, which targets cannot hand off to this engine), each only when the
decision would read it, in the decision's own order: no tokenize call for a request the
route or its state already decided, no engine check for one that runs whole, no question
to a target for one that runs locally. Each decision is logged at debug in one line: the
outcome and why.

Which targets can hand off (``Kinship``: ``sidecar.engines.models.ServedModels``): a target
that serves another model (name or weights) or another KV layout than the local engine, or
does not say what it serves, never gets the request's prefill: KV computed by one model
revision is garbage to another, and an engine that notices (vLLM's NIXL compatibility check)
fails every such pair, which would count against a healthy target. Asked of the candidates
whose breakers let a leg in, on the way to a pair; counted apart from health
(``on_unpaired``: ``disagg_prefill_mismatches_total``), never against a breaker. A target
that is down is not a mismatch: its leg fails and its breaker counts it.

A prompt whose length or cached prefix is unknown (no rule needs it, a tokenize call failed,
the KV-event index cannot answer) is never run locally by a rule that needs it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, Protocol

import msgspec

from sidecar.bounded import BoundedMap
from sidecar.dialects.base import RouteSupport
from sidecar.engines.health import EngineHealth
from sidecar.engines.models import Mismatch
from sidecar.engines.tokenizer import Memo, PromptMeasure
from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    EngineNotReady,
    InvalidHandoff,
    PrefillFailed,
    PrefillMismatch,
    PrefillNotRun,
    RouteNotServed,
    SidecarError,
    Stage,
)
from sidecar.kv_events import CachedPrefix
from sidecar.observability.logs import LogEvery
from sidecar.protocol.apis import api_of
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.request.scope import (
    ERROR,
    FALLBACK,
    LOCAL_CACHED,
    LOCAL_ROUTE,
    LOCAL_SHORT,
    LOCAL_STATE,
    MIGRATED,
    OK,
    PASSTHROUGH,
    UNSERVED_ROUTE,
)

logger = logging.getLogger(__name__)

#: The fallback reason of a request kept from every target by open breakers.
BREAKER_OPEN: Final = "breaker_open"
#: The fallback reason of a request none of whose targets can hand off to this engine.
PREFILL_MISMATCH: Final = PrefillMismatch.code
#: Targets that cannot hand off are logged at most once per this many seconds (each counted).
_UNPAIRED_LOG_INTERVAL_S: Final = 10.0


class Fate(Enum):
    PASSTHROUGH = "passthrough"  # the local engine, the request exactly as it came
    LOCAL = "local"  # whole on the local engine, for a reason
    PAIR = "pair"  # a prefill leg on a target, a decode leg on the local engine
    REFUSE = "refuse"  # a typed error; nothing is sent
    MOVE = "move"  # whole on another engine that can decode, after the one serving it failed


class Decision(msgspec.Struct, frozen=True):
    """One request's fate, with the outcome it is counted with and why, in words (a pair
    chosen the usual way leaves ``why`` empty: "prefill on <its target>", said when logged).

    Like every record made for each request, a frozen ``msgspec.Struct`` rather than a frozen
    dataclass: as immutable, and made in C (about 0.1 us against 1.5 us for a dataclass's
    generated ``__init__``, which sets each field through ``object.__setattr__``)."""

    fate: Fate
    outcome: str
    why: str
    target: PrefillTarget | None = None
    prefill_rank: int | None = None
    decode_rank: int | None = None
    error: SidecarError | None = None
    #: A LOCAL fallback's reason (``disagg_prefill_fallbacks_total{reason}``).
    fallback_reason: str | None = None
    #: The prompt's tokens and those the local engine holds, when the decision knew them.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    #: Which try this is (0: the first decision; ``after_failure`` counts on).
    attempt: int = 0
    #: The candidates asked and able to hand off to this engine (a retry goes only to one
    #: of them); None: none was asked (no such check).
    able: tuple[PrefillTarget, ...] | None = None
    #: How many times the request has moved to another engine (``move_after`` counts on).
    moves: int = 0
    #: The engines the request failed on, serving its answer (None: the local engine).
    failed_on: tuple[PrefillTarget | None, ...] = ()
    #: Why a request moved, or why it could not (``disagg_migrations_total{reason}``).
    reason: str | None = None


class PromptFacts(msgspec.Struct, frozen=True):
    """What is known of a prompt: its tokens, and how many of them the local engine holds
    (a prefix in whole KV blocks); None: unknown."""

    tokens: int | None = None
    cached: int | None = None


#: A prompt nothing is known of.
UNKNOWN_PROMPT: Final = PromptFacts()


class Facts(msgspec.Struct, frozen=True):
    """The facts of one request (or fan-out sub-request) its fate is decided on."""

    candidates: tuple[PrefillTarget, ...]
    #: The body field naming state that lives on one engine (Responses), or None.
    state: str | None = None
    #: Why the local engine is known to be down (asked again already), or None.
    engine_down: str | None = None
    prompt: PromptFacts = UNKNOWN_PROMPT
    #: The prefill leg's data-parallel rank as the router named it, or None.
    named_prefill_rank: int | None = None
    #: The candidates asked whether they can hand off to this engine: None (it can) or why
    #: not, in words; a candidate not asked gets no pair. None: no such check.
    kin: Mapping[PrefillTarget, str | None] | None = None


@dataclass(frozen=True, slots=True)
class Rules:
    """The operator's placement settings."""

    #: ``--local-prefill-max-tokens``: prompts of at most this many tokens run locally (0: off).
    max_tokens: int = 0
    #: ``--local-prefill-max-uncached-tokens``: prompts with at most this many tokens the local
    #: engine does not hold run locally (0: off).
    max_uncached: int = 0
    #: ``--on-prefill-failure local`` on a dialect whose decode can run without its prefill.
    local_fallback: bool = False
    #: ``--migration-limit``: moves one request may make (0: none).
    migration_limit: int = 0
    #: The engine's prefill servers run requests whole (a moved request may go there).
    prefill_decodes: bool = False
    #: ``--migration-url``: engines that run requests whole, for moved requests.
    migration_pool: tuple[PrefillTarget, ...] = ()


class Targets(Protocol):
    """The prefill targets as the decision sees them (asked only on the way to a pair)."""

    def pick(self, candidates: Sequence[PrefillTarget],
             exclude: Collection[PrefillTarget] = ()) -> PrefillTarget | None:
        """The target for the next leg; None when every breaker left keeps its target out."""

    def all_open(self, candidates: Sequence[PrefillTarget]) -> SidecarError:
        """The error of a request whose every target's breaker is open."""

    def admissible(self, candidates: Sequence[PrefillTarget]) -> Sequence[PrefillTarget]:
        """The candidates whose breakers let a leg in now."""

    def unpaired(self, why: Mapping[PrefillTarget, str]) -> SidecarError:
        """The error of a request none of whose targets can hand off (``why``: each one's
        reason, in words)."""

    def prefill_rank(self, target: PrefillTarget, named: int | None) -> int | None:
        """The prefill leg's data-parallel rank on ``target`` (None: one rank)."""

    def decode_rank(self) -> int | None:
        """The decode leg's data-parallel rank on the local engine (None: one rank)."""


class Kinship(Protocol):
    """Which prefill targets can hand KV off to the local engine."""

    @property
    def verdicts(self) -> BoundedMap[PrefillTarget, tuple[float, Mismatch | None]]:
        """The verdicts already given: target -> (valid until, by ``clock``; why not)."""

    @property
    def clock(self) -> Callable[[], float]: ...

    async def mismatch(self, target: PrefillTarget) -> Mismatch | None:
        """Why ``target`` cannot (None: it can, or it is down)."""


def route_fate(route: Route, support: RouteSupport, has_targets: bool,
               engine: str) -> Decision | None:
    """What the route alone decides, before the body is read (None: the facts decide)."""
    if not has_targets:
        return Decision(Fate.PASSTHROUGH, PASSTHROUGH, "no prefill target")
    if support is RouteSupport.UNSERVED:
        why = f"the {engine} engine does not serve {route.value}"
        return Decision(Fate.REFUSE, UNSERVED_ROUTE, why, error=RouteNotServed(
            f"{why} (with or without a prefill target)"))
    if support is RouteSupport.LOCAL:
        return Decision(Fate.LOCAL, LOCAL_ROUTE,
                        f"the {engine} engine does not run {route.value} as a prefill/decode "
                        "pair")
    return None


def decide(facts: Facts, rules: Rules, targets: Targets) -> Decision:
    """The fate of a request the route lets run as a pair (see the module docstring)."""
    return local_fate(facts, rules) or pair_fate(facts, rules, targets)


def local_fate(facts: Facts, rules: Rules) -> Decision | None:
    """What the request's own facts decide before any target is asked (None: a pair, if a
    target can take it)."""
    if facts.state is not None:
        return Decision(Fate.LOCAL, LOCAL_STATE, f"{facts.state} names state on one engine")
    if facts.engine_down is not None:
        return Decision(Fate.REFUSE, ERROR, "the local engine is down", error=EngineNotReady(
            f"local engine is not ready ({facts.engine_down}); nothing was sent to a prefill "
            "engine"))
    prompt = facts.prompt
    tokens, cached = prompt.tokens, prompt.cached
    short = max(rules.max_tokens, rules.max_uncached)
    if short > 0 and tokens is not None and tokens <= short:
        # Short whatever the cache holds: at most the uncached limit is not cached, whether
        # the index can tell or not (the same decision in both states, counted as short).
        limit = rules.max_tokens if tokens <= rules.max_tokens else rules.max_uncached
        return Decision(Fate.LOCAL, LOCAL_SHORT, f"prompt of {tokens} tokens, limit {limit}",
                        prompt_tokens=tokens, cached_tokens=cached)
    if (rules.max_uncached > 0 and tokens is not None and cached is not None
            and tokens - cached <= rules.max_uncached):
        return Decision(Fate.LOCAL, LOCAL_CACHED,
                        f"{tokens - cached} of {tokens} prompt tokens not cached, limit "
                        f"{rules.max_uncached}", prompt_tokens=tokens, cached_tokens=cached)
    return None


def pair_fate(facts: Facts, rules: Rules, targets: Targets) -> Decision:
    """A pair on a target that can hand off and whose breaker lets a leg in, else the local
    fallback or a refusal."""
    tokens, cached = facts.prompt.tokens, facts.prompt.cached
    candidates = facts.candidates
    kin = facts.kin
    if kin is None:
        target = targets.pick(candidates)
        able: tuple[PrefillTarget, ...] | None = None
    else:
        able = tuple(candidate for candidate, why in kin.items() if why is None)
        target = targets.pick(candidates, exclude=[
            candidate for candidate in candidates if candidate not in able])
    if target is None:
        unpaired = {candidate: why for candidate, why in (kin or {}).items() if why}
        if unpaired and all(candidate in unpaired for candidate in candidates):
            why = "no prefill target can hand off to this engine"
            if rules.local_fallback:
                return Decision(Fate.LOCAL, FALLBACK, why, fallback_reason=PREFILL_MISMATCH,
                                prompt_tokens=tokens, cached_tokens=cached)
            return Decision(Fate.REFUSE, ERROR, why, error=targets.unpaired(unpaired))
        if rules.local_fallback:
            return Decision(Fate.LOCAL, FALLBACK, "every prefill target's breaker is open",
                            fallback_reason=BREAKER_OPEN, prompt_tokens=tokens,
                            cached_tokens=cached)
        return Decision(Fate.REFUSE, ERROR, "every prefill target's breaker is open",
                        error=targets.all_open(candidates))
    return pair_on(target, facts.named_prefill_rank, targets, prompt_tokens=tokens,
                   cached_tokens=cached, able=able)


def pair_on(target: PrefillTarget, named_prefill_rank: int | None, targets: Targets, *,
            why: str = "", prompt_tokens: int | None = None, cached_tokens: int | None = None,
            attempt: int = 0, able: tuple[PrefillTarget, ...] | None = None) -> Decision:
    """A pair whose prefill runs on ``target``, with both legs' ranks."""
    return Decision(Fate.PAIR, OK, why, target=target,
                    prefill_rank=targets.prefill_rank(target, named_prefill_rank),
                    decode_rank=targets.decode_rank(), prompt_tokens=prompt_tokens,
                    cached_tokens=cached_tokens, attempt=attempt, able=able)


#: Errors of a prefill leg a local fallback may cover (never a client's own bad request).
_FALLBACK_ERRORS: Final = (PrefillFailed, InvalidHandoff, DeadlineExceeded)
#: Tries a request gets on prefill targets whose engines provably did no work.
_MAX_ATTEMPTS: Final = 2


def after_failure(decision: Decision, error: SidecarError, candidates: Sequence[PrefillTarget],
                  named_prefill_rank: int | None, rules: Rules, targets: Targets, *,
                  decode_sent: bool, moves: MoveFacts | None = None) -> Decision:
    """The next decision after ``decision``'s pair failed with ``error`` before its decode
    began (see the module docstring); ``decode_sent``: both legs ran at once, so a decode is
    on its way and no local fallback can replace the pair; ``moves``: what a move of the
    request would need (None: it may not move)."""
    if moves is not None and decode_engine_failed(error):
        return move_after(decision, moves.failed, moves, rules, targets)
    failed = decision.target
    if (isinstance(error, PrefillNotRun) and failed is not None
            and decision.attempt + 1 < _MAX_ATTEMPTS and len(candidates) > 1):
        # Picked now: the first pick's alternatives may have cooled down meanwhile; of
        # those asked whether they can hand off, only one that can.
        able = decision.able
        exclude = [failed] if able is None else [
            candidate for candidate in candidates if candidate == failed or candidate not in able]
        target = targets.pick(candidates, exclude=exclude)
        if target is not None:
            return pair_on(target, named_prefill_rank, targets,
                           why=f"prefill moved from {failed} to {target}",
                           prompt_tokens=decision.prompt_tokens,
                           cached_tokens=decision.cached_tokens,
                           attempt=decision.attempt + 1, able=able)
    if (rules.local_fallback and not decode_sent and isinstance(error, _FALLBACK_ERRORS)
            and error.stage is not Stage.DECODE):
        return Decision(Fate.LOCAL, FALLBACK, error.message, fallback_reason=error.code,
                        prompt_tokens=decision.prompt_tokens,
                        cached_tokens=decision.cached_tokens, decode_rank=decision.decode_rank,
                        attempt=decision.attempt + 1)
    return Decision(Fate.REFUSE, ERROR, error.message, error=error, attempt=decision.attempt + 1)


#: Why a request did not move (besides the request's own reasons: ``sidecar.request.migration``).
DISABLED: Final = "disabled"
LIMIT: Final = "limit"
NO_TARGET: Final = "no_target"


class MoveFacts(msgspec.Struct, frozen=True):
    """What a move of a request whose engine failed is decided on."""

    #: The engine that failed serving the answer (None: the local engine).
    failed: PrefillTarget | None
    #: The request's prefill targets (header or pool), in its order.
    candidates: tuple[PrefillTarget, ...] = ()
    #: Why the request cannot continue exactly on another engine (None: it can).
    refusal: str | None = None
    #: The local engine may take it: not known down, and if it failed this request, it has
    #: answered its health check since (a restarted engine).
    local_ready: bool = True


def decode_engine_failed(error: SidecarError) -> bool:
    """True when ``error`` is the engine serving the answer failing after the request reached
    it (broken, a 5xx, garbage, stalled): what a move may cover (never a refusal of the
    request, an unreachable engine that never saw it, or a client's own fault)."""
    if isinstance(error, DeadlineExceeded):
        return error.stage is Stage.DECODE
    return (isinstance(error, DecodeFailed) and error.stage is Stage.DECODE
            and error.engine_fault)


def move_after(decision: Decision, failed: PrefillTarget | None, facts: MoveFacts,
               rules: Rules, targets: Targets) -> Decision:
    """Where a request goes after the engine serving its answer (``failed``) failed: whole on
    another engine that can decode, or a refusal naming why (see the module docstring)."""
    failed_on = (*decision.failed_on, failed)
    moves = decision.moves
    if rules.migration_limit <= 0 or moves >= rules.migration_limit:
        reason = DISABLED if rules.migration_limit <= 0 else LIMIT
        return _not_moved(decision, failed_on, reason)
    if facts.refusal is not None:
        return _not_moved(decision, failed_on, facts.refusal)
    if facts.local_ready and None not in failed_on:
        return _moved(decision, failed_on, None)
    tried = [engine for engine in failed_on if engine is not None]
    target: PrefillTarget | None = None
    if rules.prefill_decodes and facts.candidates:
        target = targets.pick(facts.candidates, exclude=tried)
    if target is None and rules.migration_pool:
        target = targets.pick(rules.migration_pool, exclude=tried)
    if target is not None:
        return _moved(decision, failed_on, target)
    if facts.local_ready:  # it failed this request, and answers again since
        return _moved(decision, failed_on, None)
    return _not_moved(decision, failed_on, NO_TARGET)


def _moved(decision: Decision, failed_on: tuple[PrefillTarget | None, ...],
           target: PrefillTarget | None) -> Decision:
    where = "the local engine" if target is None else str(target)
    return Decision(Fate.MOVE, MIGRATED, f"moved whole to {where}", target=target,
                    moves=decision.moves + 1, failed_on=failed_on, reason=MIGRATED,
                    attempt=decision.attempt + 1)


def _not_moved(decision: Decision, failed_on: tuple[PrefillTarget | None, ...],
               reason: str) -> Decision:
    return Decision(Fate.REFUSE, ERROR, f"not migrated: {reason}", moves=decision.moves,
                    failed_on=failed_on, reason=reason, attempt=decision.attempt + 1)


class Placer:
    """Takes the placement decision of each request of one dialect's engine."""

    def __init__(
        self,
        *,
        route_support: Callable[[Route], RouteSupport],
        engine: str,
        rules: Rules,
        targets: Targets,
        measure: PromptMeasure | None = None,
        cache: CachedPrefix | None = None,
        health: EngineHealth | None = None,
        on_cached_tokens: Callable[[int], None] | None = None,
        kinship: Kinship | None = None,
        on_unpaired: Callable[[PrefillTarget, Mismatch], None] | None = None,
    ) -> None:
        self._route_support = route_support
        self._engine = engine
        self.rules = rules
        self.targets = targets
        self._measure = measure or PromptMeasure()
        self._cache = cache if rules.max_uncached > 0 else None
        self._health = health
        self._on_cached_tokens = on_cached_tokens
        self._kinship = kinship
        self._on_unpaired = on_unpaired
        self._unpaired_log = LogEvery(_UNPAIRED_LOG_INTERVAL_S)

    def route_fate(self, route: Route, has_targets: bool, request_id: str) -> Decision | None:
        """What the route alone decides (None: ``place`` decides on the body)."""
        decision = route_fate(route, self._route_support(route), has_targets, self._engine)
        if decision is not None:
            _log(request_id, decision)
        return decision

    async def place(self, route: Route, body: Mapping[str, Any],
                    candidates: tuple[PrefillTarget, ...], *, request_id: str,
                    named_prefill_rank: int | None = None, memo: Memo | None = None
                    ) -> Decision:
        """The fate of one request (or sub-request) whose route may run as a pair; ``memo``:
        the client request's tokenizations, shared by its sub-requests."""
        state = api_of(route).runs_whole(body)
        engine_down: str | None = None
        prompt = UNKNOWN_PROMPT
        if state is None:
            engine_down = await self._engine_down()
            if engine_down is None:
                prompt = await self._prompt(route, body, memo)
        facts = Facts(candidates, state, engine_down, prompt, named_prefill_rank)
        decision = local_fate(facts, self.rules)
        if decision is None:
            if self._kinship is not None:
                facts = Facts(candidates, state, engine_down, prompt, named_prefill_rank,
                              kin=await self._kin(candidates, request_id))
            decision = pair_fate(facts, self.rules, self.targets)
        _log(request_id, decision)
        return decision

    async def _kin(self, candidates: tuple[PrefillTarget, ...],
                   request_id: str) -> dict[PrefillTarget, str | None]:
        """Whether each candidate a leg may go to now can hand off to this engine."""
        kinship = self._kinship
        assert kinship is not None
        admissible = self.targets.admissible(candidates)
        if len(admissible) == 1:  # the usual router's one target
            # A fresh verdict is a dict's read (every pair asks); else it is learned.
            verdict = kinship.verdicts.peek(admissible[0])
            mismatches = ([verdict[1]] if verdict is not None and verdict[0] > kinship.clock()
                          else [await kinship.mismatch(admissible[0])])
        else:
            mismatches = list(await asyncio.gather(*map(kinship.mismatch, admissible)))
        kin: dict[PrefillTarget, str | None] = {}
        for target, mismatch in zip(admissible, mismatches, strict=True):
            kin[target] = None if mismatch is None else mismatch.why
            if mismatch is not None:
                if self._on_unpaired is not None:
                    self._on_unpaired(target, mismatch)
                left_out = self._unpaired_log.due()
                if left_out is not None:
                    more = f" ({left_out} more since the last such line)" if left_out else ""
                    logger.warning("request %s: prefill target %s cannot hand off to this "
                                   "engine: %s%s", request_id, target, mismatch.why, more)
        return kin

    async def _engine_down(self) -> str | None:
        health = self._health
        if health is None or not health.known_down or await health.recheck():
            return None
        return health.cause or "down"

    async def _prompt(self, route: Route, body: Mapping[str, Any],
                      memo: Memo | None) -> PromptFacts:
        cache = self._cache
        if self.rules.max_tokens <= 0 and cache is None:
            return UNKNOWN_PROMPT
        # The ids only when the index can answer for them (else no tokenize call is made for
        # the cache rule: the count, exact or estimated, still serves the short rule).
        prompt = await self._measure.prompt(route, body, memo=memo,
                                            ids=cache is not None and cache.answers)
        if cache is None or prompt.ids is None:
            return PromptFacts(prompt.tokens)
        cached = cache.cached_tokens(prompt.ids)
        if cached is not None and self._on_cached_tokens is not None:
            self._on_cached_tokens(cached)
        return PromptFacts(prompt.tokens, cached)


def _log(request_id: str, decision: Decision) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        cached = decision.cached_tokens
        why = decision.why or f"prefill on {decision.target}"
        logger.debug("request %s: %s: %s%s", request_id, decision.outcome, why,
                     "" if cached is None else f" (cached prompt tokens: {cached})")
