"""Which of several prefill targets gets a prefill leg, and which are cooling down.

    TargetChoice.pick(candidates, exclude)  ─▶ the fewest prefill legs in flight from this
                                               sidecar (ties at random; two random choices
                                               past 4 targets), cooling targets skipped
    with choice.leg(target): ...            counts a prefill leg in flight on ``target``
    choice.refused(target) / .answered(target)   its connect was refused: cool it down / ends it

Deliberate limits: this process's own view (each ``--workers`` worker its own); the maps
forget a target with nothing in flight and no cool-down. Why it picks this way, and its
bounded metric labels: docs/design-notes.md#target-choice
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Collection, Iterator, Sequence

from sidecar.protocol.context import PrefillTarget

#: Past this many candidates two random ones are compared instead of all (power of two
#: choices: nearly as even, and O(1) per pick however long the router's list).
_COMPARE_ALL_UP_TO = 4
#: The label of a target that a router named (not one of the static pool's).
HEADER_LABEL = "header"


class TargetChoice:
    """Least-in-flight choice among prefill targets, with a cool-down for refusing ones."""

    def __init__(self, *, cooldown_s: float, pool: Collection[PrefillTarget] = (),
                 clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._in_flight: dict[PrefillTarget, int] = {}
        self._cool_until: dict[PrefillTarget, float] = {}
        self._pool_labels = {target: str(target) for target in pool}

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

    def add_pool_member(self, target: PrefillTarget) -> None:
        """Label a resolved static-pool address by itself (pool names resolve at use)."""
        self._pool_labels.setdefault(target, str(target))

    def pick(
        self, candidates: Sequence[PrefillTarget], exclude: Collection[PrefillTarget] = ()
    ) -> PrefillTarget | None:
        """The target for the next prefill leg, or None when ``exclude`` leaves none."""
        open_ = [t for t in candidates if t not in exclude]
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

    @contextlib.contextmanager
    def leg(self, target: PrefillTarget) -> Iterator[None]:
        """Count one prefill leg in flight on ``target`` while the block runs."""
        self._in_flight[target] = self._in_flight.get(target, 0) + 1
        try:
            yield
        finally:
            left = self._in_flight[target] - 1
            if left:
                self._in_flight[target] = left
            else:
                del self._in_flight[target]

    def answered(self, target: PrefillTarget) -> None:
        """``target`` answered a prefill: whatever refusal it had is over."""
        self._cool_until.pop(target, None)

    def refused(self, target: PrefillTarget) -> None:
        """``target`` refused a connection: skip it for the cool-down."""
        if self._cooldown_s > 0:
            self._cool_until[target] = self._clock() + self._cooldown_s
