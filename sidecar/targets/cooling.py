"""Cool-downs of prefill targets and ranks, bounded like the circuit breakers.

    cool = CoolDowns(cooldown_s, clock)
    cool.start(key)      skip ``key`` for the cool-down (0 s: never)
    cool.active(key)     still cooling (an expired entry is dropped on the way)
    cool.end(key)        it answered: the cool-down is over

A router may name any address a CIDR allowlist admits, so the keys are unbounded: at most
``MAX_COOLING`` are kept; a new one past that first drops the expired ones, then the oldest
(50,000 refused targets left 50,000 entries before).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Final, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: Keys cooling down at most (the breakers track as many targets).
MAX_COOLING: Final = 4096


class CoolDowns(Generic[K]):
    """``key -> cooling until``, at most ``max_keys`` of them."""

    def __init__(self, cooldown_s: float, clock: Callable[[], float], *,
                 max_keys: int = MAX_COOLING) -> None:
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._max_keys = max_keys
        self._until: dict[K, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def active(self, key: K) -> bool:
        if not self._until:
            return False
        until = self._until.get(key)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[key]
            return False
        return True

    def start(self, key: K) -> None:
        if self._cooldown_s <= 0:
            return
        now = self._clock()
        self._until.pop(key, None)  # re-inserted last: the newest
        # One cool-down for all and a key re-inserted last: the oldest entry expires first,
        # so the expired ones are at the front (dropped), then the oldest if still full.
        until = self._until
        while until and (len(until) >= self._max_keys or until[next(iter(until))] <= now):
            del until[next(iter(until))]
        self._until[key] = now + self._cooldown_s

    def end(self, key: K) -> None:
        if self._until:
            self._until.pop(key, None)
