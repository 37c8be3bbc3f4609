"""Which of several prefill targets gets a prefill leg, and which are cooling down.

    TargetChoice.pick(candidates, exclude)  ─▶ the target with the fewest prefill legs in
                                               flight from this sidecar (ties at random;
                                               power of two random choices past 4 targets),
                                               skipping targets whose connect was refused
                                               within the cool-down and targets whose
                                               circuit breaker is open
    with choice.leg(target) as verdict: ... counts a prefill leg in flight on ``target``
                                            (``PrefillBreakerOpen`` when its breaker does not
                                            let it through); ``verdict.answered()`` /
                                            ``verdict.failed(why)`` feed the breaker
    choice.refused(target)                  its connect was refused: cool it down
    choice.answered(target)                 it answered a prefill: the cool-down ends

Data-parallel ranks (an engine that holds several, ``--data-parallel-size``) are chosen the
same way, per engine: the local one (``LOCAL``: decode legs, gRPC Prefill) or a prefill target:

    choice.pick_rank(engine, size)          ─▶ the rank with the fewest legs in flight from
                                               this sidecar (ties: the next in turn), skipping
                                               ranks whose legs failed within the cool-down;
                                               None when the engine has one rank
    with choice.rank_leg(engine, rank): ... counts a leg in flight on that rank
    choice.rank_failed(engine, rank)        its leg failed: cool the rank down
    choice.rank_answered(engine, rank)      it answered: the cool-down ends

Deliberate limits: this process's own view (each ``--workers`` worker its own); the maps
forget a target (and a rank) with nothing in flight and no cool-down; ties between ranks go
to the next in turn, so a sidecar whose legs never overlap still uses every rank. Why it
picks this way, and its bounded metric labels: docs/extending/design-notes.md#target-choice
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Final

from sidecar.errors import PrefillBreakerOpen
from sidecar.protocol.context import PrefillTarget
from sidecar.targets.breaker import SEVERITY, Admission, BreakerState, CircuitBreakers

#: Past this many candidates two random ones are compared instead of all (power of two
#: choices: nearly as even, and O(1) per pick however long the router's list).
_COMPARE_ALL_UP_TO = 4
#: Engines whose rank turn is remembered (cleared whole when full: bounded memory; a router's
#: header may name many targets).
_MAX_TURNS = 4096
#: The label of a target that a router named (not one of the static pool's).
HEADER_LABEL = "header"
#: The local engine, as the engine of a rank (a prefill target names a remote one).
LOCAL: Final = None
#: An engine whose ranks are chosen: a prefill target, or ``LOCAL``.
Engine = PrefillTarget | None


class LegVerdict:
    """What a prefill leg showed of its target, for the target's circuit breaker."""

    __slots__ = ("ok", "why")

    def __init__(self) -> None:
        self.ok: bool | None = None
        self.why = ""

    def answered(self) -> None:
        self.ok = True

    def failed(self, why: str) -> None:
        """A failure that shows the engine unhealthy (never the request's own fault)."""
        self.ok = False
        self.why = why


class TargetChoice:
    """Least-in-flight choice among prefill targets, with a cool-down for refusing ones and
    a circuit breaker per target."""

    def __init__(
        self,
        *,
        cooldown_s: float,
        pool: Collection[PrefillTarget] = (),
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        breakers: CircuitBreakers | None = None,
    ) -> None:
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._in_flight: dict[PrefillTarget, int] = {}
        self._cool_until: dict[PrefillTarget, float] = {}
        self._pool_labels = {target: str(target) for target in pool}
        self.breakers = breakers if breakers is not None and breakers.enabled else None
        self._rank_in_flight: dict[tuple[Engine, int], int] = {}
        self._rank_cool_until: dict[tuple[Engine, int], float] = {}
        self._rank_turns: dict[Engine, int] = {}

    def in_flight(self, target: PrefillTarget) -> int:
        return self._in_flight.get(target, 0)

    def cooling(self, target: PrefillTarget) -> bool:
        until = self._cool_until.get(target)
        if until is None:
            return False
        if self._clock() >= until:
            del self._cool_until[target]
            return False
        return True

    def label(self, target: PrefillTarget) -> str:
        """The bounded metric label of ``target``: its address in the pool, else ``header``."""
        return self._pool_labels.get(target, HEADER_LABEL)

    def breaker_state(self, label: str) -> BreakerState:
        """The worst breaker state among the targets labelled ``label`` (open > half-open >
        closed): one value per bounded label, as ``disagg_prefill_breaker_state`` shows it."""
        if self.breakers is None:
            return BreakerState.CLOSED
        states = [state for target, state in self.breakers.states().items()
                  if self.label(target) == label]
        return max(states, key=SEVERITY.__getitem__, default=BreakerState.CLOSED)

    def add_pool_member(self, target: PrefillTarget) -> None:
        """Label a resolved static-pool address by itself (pool names resolve at use)."""
        self._pool_labels.setdefault(target, str(target))

    def pick(
        self, candidates: Sequence[PrefillTarget], exclude: Collection[PrefillTarget] = ()
    ) -> PrefillTarget | None:
        """The target for the next prefill leg, or None when ``exclude`` leaves none."""
        open_ = [t for t in candidates if t not in exclude]
        breakers = self.breakers
        if breakers is not None:
            open_ = [t for t in open_ if breakers.allows(t)]
        if not open_:
            return None
        warm = [t for t in open_ if not self.cooling(t)]
        pool = warm or open_
        if len(pool) == 1:
            return pool[0]
        if len(pool) > _COMPARE_ALL_UP_TO:
            pool = self._rng.sample(pool, 2)
        least = min(self.in_flight(t) for t in pool)
        return self._rng.choice([t for t in pool if self.in_flight(t) == least])

    def breaker_allows(self, target: PrefillTarget) -> bool:
        return self.breakers is None or self.breakers.allows(target)

    @contextlib.contextmanager
    def leg(self, target: PrefillTarget) -> Iterator[LegVerdict]:
        """Count one prefill leg in flight on ``target`` while the block runs, and give its
        verdict to the target's breaker; ``PrefillBreakerOpen`` (before the block) when the
        breaker lets no leg through now (open, or its one trial leg already running)."""
        breakers = self.breakers
        admission = Admission.NORMAL if breakers is None else breakers.admit(target)
        if admission is None:
            named = f" {target}" if self.label(target) == HEADER_LABEL else ""
            raise PrefillBreakerOpen(f"circuit breaker of prefill target{named} is open")
        verdict = LegVerdict()
        self._in_flight[target] = self._in_flight.get(target, 0) + 1
        try:
            yield verdict
        finally:
            left = self._in_flight[target] - 1
            if left:
                self._in_flight[target] = left
            else:
                del self._in_flight[target]
            if breakers is not None:
                breakers.settle(target, admission, verdict.ok, verdict.why)

    def answered(self, target: PrefillTarget) -> None:
        """``target`` answered a prefill: whatever refusal it had is over."""
        self._cool_until.pop(target, None)

    def refused(self, target: PrefillTarget) -> None:
        """``target`` refused a connection: skip it for the cool-down."""
        if self._cooldown_s > 0:
            self._cool_until[target] = self._clock() + self._cooldown_s

    # -- data-parallel ranks ----------------------------------------------------------------

    def rank_in_flight(self, engine: Engine, rank: int) -> int:
        return self._rank_in_flight.get((engine, rank), 0)

    def rank_cooling(self, engine: Engine, rank: int) -> bool:
        if not self._rank_cool_until:
            return False
        key = (engine, rank)
        until = self._rank_cool_until.get(key)
        if until is None:
            return False
        if self._clock() >= until:
            del self._rank_cool_until[key]
            return False
        return True

    def pick_rank(self, engine: Engine, size: int) -> int | None:
        """The rank of ``engine`` (``size`` ranks) for its next leg; None when ``size`` is 1.

        Fewest legs in flight first, skipping ranks cooling down (unless all are); of equal
        ones the first from a turn that moves on with every pick.
        """
        if size <= 1:
            return None
        start = self._turn(engine, size)
        best = self._least_loaded(engine, size, start, skip_cooling=True)
        if best is None:  # every rank is cooling down: one is still picked
            best = self._least_loaded(engine, size, start, skip_cooling=False)
        assert best is not None
        return best

    def _turn(self, engine: Engine, size: int) -> int:
        """Where ``engine``'s next pick starts looking: one rank on from its last."""
        turns = self._rank_turns
        turn = turns.get(engine, 0)
        if len(turns) >= _MAX_TURNS and engine not in turns:
            turns.clear()
        turns[engine] = (turn + 1) % size
        return turn

    def _least_loaded(self, engine: Engine, size: int, start: int, *,
                      skip_cooling: bool) -> int | None:
        best: int | None = None
        best_load = 0
        for offset in range(size):
            rank = (start + offset) % size
            if skip_cooling and self.rank_cooling(engine, rank):
                continue
            load = self._rank_in_flight.get((engine, rank), 0)
            if best is None or load < best_load:
                best, best_load = rank, load
                if load == 0:
                    break  # none can have fewer
        return best

    def hold_rank(self, engine: Engine, rank: int) -> None:
        """Count one leg in flight on ``rank`` of ``engine`` (until ``release_rank``)."""
        key = (engine, rank)
        self._rank_in_flight[key] = self._rank_in_flight.get(key, 0) + 1

    def release_rank(self, engine: Engine, rank: int) -> None:
        key = (engine, rank)
        left = self._rank_in_flight[key] - 1
        if left:
            self._rank_in_flight[key] = left
        else:
            del self._rank_in_flight[key]

    @contextlib.contextmanager
    def rank_leg(self, engine: Engine, rank: int) -> Iterator[None]:
        """Count one leg in flight on ``rank`` of ``engine`` while the block runs."""
        self.hold_rank(engine, rank)
        try:
            yield
        finally:
            self.release_rank(engine, rank)

    def rank_answered(self, engine: Engine, rank: int) -> None:
        """A leg on ``rank`` of ``engine`` succeeded: whatever failure it had is over."""
        if self._rank_cool_until:
            self._rank_cool_until.pop((engine, rank), None)

    def rank_failed(self, engine: Engine, rank: int) -> None:
        """A leg on ``rank`` of ``engine`` failed: skip the rank for the cool-down."""
        if self._cooldown_s > 0:
            self._rank_cool_until[(engine, rank)] = self._clock() + self._cooldown_s
