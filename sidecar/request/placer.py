"""Gathers the facts of the placement decision and takes it (``sidecar.request.placement``).

    placer.route_fate(route, has_targets, request_id)     before the body is read
    await placer.place(route, body, candidates, ...)      per request and fan-out sub-request
        the body's state (the route's API) ─▶ the local engine's readiness (asked again when
        known down) ─▶ the prompt's tokens and cached tokens (only when a rule reads them)
        ─▶ decide() ─▶ one debug line: the outcome and why

Each fact is gathered only when the decision would read it, in the decision's own order: no
tokenize call for a request the route or its state already decided, no engine check for one
that runs whole. ``PrefillTargets`` is the decision's view of the prefill targets: the target
choice (least in flight, cool-downs, circuit breakers) and the data-parallel ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from sidecar.dialects.base import RouteSupport
from sidecar.engines.health import EngineHealth
from sidecar.engines.tokenizer import PromptMeasure
from sidecar.errors import SidecarError
from sidecar.kv_events import CachedPrefix
from sidecar.protocol.apis import api_of
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.request.placement import (
    UNKNOWN_PROMPT,
    Decision,
    Facts,
    PromptFacts,
    Rules,
    Targets,
    decide,
    route_fate,
)
from sidecar.targets.choice import TargetChoice
from sidecar.targets.ranks import LegRanks

logger = logging.getLogger(__name__)


class PrefillTargets:
    """The decision's ``Targets``: the target choice with its breakers, and the ranks."""

    def __init__(self, choice: TargetChoice, ranks: LegRanks) -> None:
        self._choice = choice
        self.ranks = ranks

    def pick(self, candidates: Sequence[PrefillTarget],
             exclude: Collection[PrefillTarget] = ()) -> PrefillTarget | None:
        return self._choice.pick(candidates, exclude)

    def all_open(self, candidates: Sequence[PrefillTarget]) -> SidecarError:
        return self._choice.all_open(candidates)

    def prefill_rank(self, target: PrefillTarget, named: int | None) -> int | None:
        return self.ranks.prefill(target, named)

    def decode_rank(self) -> int | None:
        return self.ranks.local()


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
    ) -> None:
        self._route_support = route_support
        self._engine = engine
        self.rules = rules
        self.targets = targets
        self._measure = measure or PromptMeasure()
        self._cache = cache if rules.max_uncached > 0 else None
        self._health = health
        self._on_cached_tokens = on_cached_tokens

    def route_fate(self, route: Route, has_targets: bool, request_id: str) -> Decision | None:
        """What the route alone decides (None: ``place`` decides on the body)."""
        decision = route_fate(route, self._route_support(route), has_targets, self._engine)
        if decision is not None:
            _log(request_id, decision)
        return decision

    async def place(self, route: Route, body: Mapping[str, Any],
                    candidates: tuple[PrefillTarget, ...], *, request_id: str,
                    named_prefill_rank: int | None = None) -> Decision:
        """The fate of one request (or sub-request) whose route may run as a pair."""
        state = api_of(route).runs_whole(body)
        engine_down: str | None = None
        prompt = UNKNOWN_PROMPT
        if state is None:
            engine_down = await self._engine_down()
            if engine_down is None:
                prompt = await self._prompt(route, body)
        decision = decide(Facts(candidates, state, engine_down, prompt, named_prefill_rank),
                          self.rules, self.targets)
        _log(request_id, decision)
        return decision

    async def _engine_down(self) -> str | None:
        health = self._health
        if health is None or not health.known_down or await health.recheck():
            return None
        return health.cause or "down"

    async def _prompt(self, route: Route, body: Mapping[str, Any]) -> PromptFacts:
        cache = self._cache
        if self.rules.max_tokens <= 0 and cache is None:
            return UNKNOWN_PROMPT
        prompt = await self._measure.prompt(route, body, ids=cache is not None)
        if cache is None or prompt.ids is None:
            return PromptFacts(prompt.tokens)
        cached = cache.cached_tokens(prompt.ids)
        if cached is not None and self._on_cached_tokens is not None:
            self._on_cached_tokens(cached)
        return PromptFacts(prompt.tokens, cached)


def _log(request_id: str, decision: Decision) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        cached = decision.cached_tokens
        logger.debug("request %s: %s: %s%s", request_id, decision.outcome, decision.why,
                     "" if cached is None else f" (cached prompt tokens: {cached})")
