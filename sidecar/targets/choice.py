"""Which of several prefill targets gets a prefill leg, and which are cooling down; the
prefill targets as the placement decision sees them (``PrefillTargets``).

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

Data-parallel ranks are chosen apart (``sidecar.targets.ranks``); the placement decision
(``sidecar.request.placement``) asks both through ``PrefillTargets``.

Deliberate limits: this process's own view (each ``--workers`` worker its own); the maps
forget a target with nothing in flight and no cool-down, and hold at most 4,096 cooling
targets (``CoolDowns``). Why it picks this way, and its
bounded metric labels: docs/extending/design-notes.md#target-choice
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Collection, Iterator, Sequence

from sidecar.bounded import CoolDowns
from sidecar.errors import PrefillBreakerOpen, PrefillFailed, SidecarError
from sidecar.protocol.context import PrefillTarget
from sidecar.targets.breaker import NORMAL, SEVERITY, BreakerState, CircuitBreakers
from sidecar.targets.ranks import LegRanks

#: Past this many candidates two random ones are compared instead of all (power of two
#: choices: nearly as even, and O(1) per pick however long the router's list).
_COMPARE_ALL_UP_TO = 4
#: The label of a target that a router named (not one of the static pool's).
HEADER_LABEL = "header"


class LegVerdict:
    """What a prefill leg showed of its target, for the target's circuit breaker."""

    __slots__ = ("down", "ok", "why")

    def __init__(self) -> None:
        self.ok: bool | None = None
        self.why = ""
        self.down = False

    def answered(self) -> None:
        self.ok = True

    def failed(self, why: str, *, down: bool = False) -> None:
        """A failure that shows the engine unhealthy (never the request's own fault);
        ``down``: not even listening (its connect refused or never accepted)."""
        self.ok = False
        self.why = why
        self.down = down


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
        self._cooling: CoolDowns[PrefillTarget] = CoolDowns(cooldown_s, clock)
        self._pool_labels = {target: str(target) for target in pool}
        self.breakers = breakers if breakers is not None and breakers.enabled else None

    def in_flight(self, target: PrefillTarget) -> int:
        return self._in_flight.get(target, 0)

    def cooling(self, target: PrefillTarget) -> bool:
        return self._cooling.active(target)

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

    def all_open(self, candidates: Sequence[PrefillTarget]) -> PrefillFailed:
        """The error of a request whose every target's breaker is open (router-named ones
        named, pool members not: the router does not know them)."""
        breakers = self.breakers
        wait = min((breakers.retry_in(t) for t in candidates), default=0.0) if breakers else 0.0
        named = [str(t) for t in candidates if self.label(t) == HEADER_LABEL]
        which = f" ({', '.join(named)})" if named else ""
        every = "every prefill target" if len(candidates) > 1 else "the prefill target"
        return PrefillFailed(f"circuit breaker open for {every}{which}: its legs kept "
                             f"failing; next trial in {wait:.0f} s")

    def breaker_allows(self, target: PrefillTarget) -> bool:
        return self.breakers is None or self.breakers.allows(target)

    @contextlib.contextmanager
    def leg(self, target: PrefillTarget) -> Iterator[LegVerdict]:
        """Count one prefill leg in flight on ``target`` while the block runs, and give its
        verdict to the target's breaker; ``PrefillBreakerOpen`` (before the block) when the
        breaker lets no leg through now (open, or its one trial leg already running)."""
        breakers = self.breakers
        admission = NORMAL if breakers is None else breakers.admit(target)
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
                breakers.settle(target, admission, verdict.ok, verdict.why, down=verdict.down)

    def answered(self, target: PrefillTarget) -> None:
        """``target`` answered a prefill: whatever refusal it had is over."""
        self._cooling.end(target)

    def refused(self, target: PrefillTarget) -> None:
        """``target`` refused a connection: skip it for the cool-down."""
        self._cooling.start(target)


class PrefillTargets:
    """The prefill targets as the placement decision sees them (its ``Targets``): the target
    choice with its breakers, and the data-parallel ranks of both legs."""

    __slots__ = ("_choice", "ranks")

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
