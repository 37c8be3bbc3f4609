"""A circuit breaker per prefill target: targets that accept connections but fail their legs
stop getting them for a while.

    closed ──F failures in a row──▶ open ──cool-down──▶ half-open ──S trial legs ok──▶ closed
                                     ▲                      │ a trial leg failed
                                     └──cool-down doubled───┘ (up to 8 x the first)

    breakers.allows(target)         may a leg go there now (a pick's filter; changes nothing)
    breakers.admit(target)          at a leg's start: NORMAL, TRIAL (the one half-open leg)
                                    or None (open, or a trial already running)
    breakers.settle(target, admission, ok)   the leg's verdict: True, False, None (neither)

What counts as a failure is the caller's to say (``sidecar.core.engine_calls``: 5xx, resets,
garbage, deadlines, refused or unreachable connects; never a 4xx, a 429 or a cancelled leg).
Only verdicts of legs admitted in the current state count: a leg that started before the
breaker opened says nothing about the open breaker. Every change of state is logged (with
the words "circuit breaker", the target and why) and goes to ``on_change(target, old, new,
why)`` (the caller exports it).

Why the cool-down doubles: a target that keeps failing its trials would otherwise get a leg
every cool-down for ever; doubling bounds the legs it gets however long the requests around
it take (docs/operating/reliability.md: at most 10 of 40 sequential requests with the defaults).

Deliberate limits: this process's view only (each ``--workers`` process keeps its own); at
most ``_MAX_TRACKED`` targets are tracked (a router may name any address a CIDR allowlist
admits): closed ones are forgotten first, and past that a new target is not tracked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, IntEnum

from sidecar.protocol.context import PrefillTarget

logger = logging.getLogger(__name__)

#: The first cool-down is multiplied by at most this after failed trials.
MAX_BACKOFF = 8
_MAX_TRACKED = 4096


class BreakerState(IntEnum):
    """A target's breaker, as ``disagg_prefill_breaker_state`` exports it."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


#: How bad a state is, for a label that covers several targets (open is the worst).
SEVERITY = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


_VERBS = {BreakerState.OPEN: "opened", BreakerState.HALF_OPEN: "half-open",
          BreakerState.CLOSED: "closed"}


class Admission(Enum):
    """How a leg was let through."""

    NORMAL = "normal"
    TRIAL = "trial"


#: ``on_change(target, old, new, why)``.
OnChange = Callable[[PrefillTarget, BreakerState, BreakerState, str], None]


@dataclass(slots=True)
class _Breaker:
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    successes: int = 0
    open_until: float = 0.0
    open_s: float = 0.0
    trial_running: bool = False


class CircuitBreakers:
    """The breakers of every prefill target this process sends legs to."""

    def __init__(
        self,
        *,
        failures: int,
        open_s: float,
        successes: int,
        on_change: OnChange | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._failures = failures
        self._open_s = open_s
        self._successes = max(successes, 1)
        self._on_change = on_change
        self._clock = clock
        self._breakers: dict[PrefillTarget, _Breaker] = {}

    @property
    def enabled(self) -> bool:
        return self._failures > 0

    def state(self, target: PrefillTarget) -> BreakerState:
        breaker = self._breakers.get(target)
        return BreakerState.CLOSED if breaker is None else breaker.state

    def states(self) -> dict[PrefillTarget, BreakerState]:
        """Every tracked target's state (closed ones may have been forgotten)."""
        return {target: breaker.state for target, breaker in self._breakers.items()}

    def retry_in(self, target: PrefillTarget) -> float:
        """Seconds until an open breaker lets a trial leg through (0 when it would now)."""
        breaker = self._breakers.get(target)
        if breaker is None or breaker.state is not BreakerState.OPEN:
            return 0.0
        return max(breaker.open_until - self._clock(), 0.0)

    def allows(self, target: PrefillTarget) -> bool:
        breaker = self._breakers.get(target)
        if breaker is None or breaker.state is BreakerState.CLOSED:
            return True
        if breaker.state is BreakerState.OPEN:
            return self._clock() >= breaker.open_until
        return not breaker.trial_running

    def admit(self, target: PrefillTarget) -> Admission | None:
        breaker = self._breakers.get(target)
        if breaker is None or breaker.state is BreakerState.CLOSED:
            return Admission.NORMAL
        if breaker.state is BreakerState.OPEN:
            if self._clock() < breaker.open_until:
                return None
            self._change(target, breaker, BreakerState.HALF_OPEN,
                         "cool-down over: one trial leg")
            breaker.successes = 0
        if breaker.trial_running:
            return None
        breaker.trial_running = True
        return Admission.TRIAL

    def settle(self, target: PrefillTarget, admission: Admission, ok: bool | None,
               why: str = "") -> None:
        """A leg's verdict: ``ok`` True (it answered), False (a failure showing the engine
        unhealthy, ``why`` in words), None (neither: cancelled, or the request's own fault)."""
        if not self.enabled:
            return
        breaker = self._breakers.get(target)
        if admission is Admission.TRIAL:
            if breaker is None or breaker.state is not BreakerState.HALF_OPEN:
                return
            breaker.trial_running = False
            if ok is True:
                breaker.successes += 1
                if breaker.successes >= self._successes:
                    self._change(target, breaker, BreakerState.CLOSED,
                                 f"{breaker.successes} trial leg(s) answered")
                    self._breakers.pop(target, None)
            elif ok is False:
                self._open(target, breaker, min(breaker.open_s * 2, self._open_s * MAX_BACKOFF),
                           f"the trial leg failed: {why}")
            return
        if breaker is not None and breaker.state is not BreakerState.CLOSED:
            return  # began before the breaker opened: says nothing about it now
        if ok is True:
            if breaker is not None:
                del self._breakers[target]  # closed with no failures: nothing to remember
            return
        if ok is None:
            return
        if breaker is None:
            breaker = self._track(target)
            if breaker is None:
                return
        breaker.failures += 1
        if breaker.failures >= self._failures:
            self._open(target, breaker, self._open_s,
                       f"{breaker.failures} failed legs in a row, the last: {why}")

    def _open(self, target: PrefillTarget, breaker: _Breaker, open_s: float, why: str) -> None:
        breaker.open_s = open_s
        breaker.open_until = self._clock() + open_s
        breaker.failures = 0
        breaker.trial_running = False
        self._change(target, breaker, BreakerState.OPEN, f"{why}; next trial in {open_s:g} s")

    def _track(self, target: PrefillTarget) -> _Breaker | None:
        if len(self._breakers) >= _MAX_TRACKED:
            closed = next((t for t, b in self._breakers.items()
                           if b.state is BreakerState.CLOSED), None)
            if closed is None:
                return None
            del self._breakers[closed]
        breaker = self._breakers[target] = _Breaker()
        return breaker

    def _change(self, target: PrefillTarget, breaker: _Breaker, new: BreakerState,
                why: str) -> None:
        old, breaker.state = breaker.state, new
        log = logger.warning if new is BreakerState.OPEN else logger.info
        log("circuit breaker of prefill target %s %s: %s", target, _VERBS[new], why)
        if self._on_change is not None:
            self._on_change(target, old, new, why)
