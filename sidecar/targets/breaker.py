"""A circuit breaker per prefill target: targets that accept connections but fail their legs
stop getting them for a while.

    closed ──F failures in a row──▶ open ──cool-down──▶ half-open ──S trial legs ok──▶ closed
                                     ▲  └─probe: down, then up─▶│ a trial leg failed
                                     └──cool-down doubled───┘ (up to 8 x the first)

    breakers.allows(target)         may a leg go there now (a pick's filter; a request named it)
    breakers.admit(target)          at a leg's start: an ``Admission`` (normal, or the one
                                    half-open trial leg) or None (open, or a trial running)
    breakers.settle(target, admission, ok)   the leg's verdict: True, False, None (neither)
    breakers.probed(target, healthy)   a health probe's answer while open
                                    (``sidecar.engines.health``): True up, False down, None
                                    slow (no news); up after down ends the cool-down now
    breakers.expire()               forget the targets no request named for ``idle_s``
    breakers.forget(target)         forget one now (its pod left the pool)

What counts as a failure is the caller's to say (``sidecar.engines.calls``: 5xx, resets,
garbage, deadlines, refused or unreachable connects; never a 4xx, a 429 or a cancelled leg).
Only verdicts of legs admitted in the current state count: every change of state starts a
new epoch, an ``Admission`` carries the epoch it was given in, and a verdict of another epoch
says nothing (a leg that started before the breaker opened, or before an open, half-open,
closed cycle, is no fresh failure). A breaker that has changed state is remembered while
closed (its epoch). Every change of state is logged (with the words "circuit breaker", the
target and why) and goes to ``on_change(target, old, new, why)`` (the caller exports it).

Why the cool-down doubles: a target that keeps failing its trials would otherwise get a leg
every cool-down for ever; doubling bounds the legs it gets however long the requests around
it take (docs/operating/reliability.md: at most 10 of 40 sequential requests with the defaults).

Forgetting: a router may name any address an allowlist admits, and pods come and go. The
breakers are a ``sidecar.bounded.BoundedMap`` in the order requests last named their
targets (``allows``, ``admit``; a probe or a verdict is no naming): a target no request
named for ``idle_s`` (default: the longest cool-down, 8 x ``--prefill-breaker-open-s``, so
no cool-down is cut short by forgetting a target still named) is forgotten when the next
target is tracked or a probe runs (``expire``), and a pod that left the selected pool at
once (``forget``); each goes to ``on_forget(target, state)`` (the caller ends its probe and
its gauge). Past ``MAX_TRACKED`` targets the least recently named is forgotten, whatever its
state (it was the closed ones first, and none past that: a new target went untracked).

Deliberate limits: this process's view only (each ``--workers`` process keeps its own); a
target forgotten while open gets legs again (its next failures open it anew).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

import msgspec

from sidecar.bounded import BoundedMap
from sidecar.protocol.context import PrefillTarget

logger = logging.getLogger(__name__)

#: The first cool-down is multiplied by at most this after failed trials.
MAX_BACKOFF: Final = 8
#: Targets tracked at most (the least recently named forgotten first).
MAX_TRACKED: Final = 4096


class BreakerState(IntEnum):
    """A target's breaker, as ``disagg_prefill_breaker_state`` exports it: numbered by
    severity, so that the highest value over several targets or workers is the worst."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


#: How bad a state is, for a label that covers several targets (open is the worst).
SEVERITY = {state: int(state) for state in BreakerState}


_VERBS = {BreakerState.OPEN: "opened", BreakerState.HALF_OPEN: "half-open",
          BreakerState.CLOSED: "closed"}


class Admission(msgspec.Struct, frozen=True):
    """How a leg was let through: as a trial or not, in which epoch of its breaker."""

    trial: bool = False
    epoch: int = 0


#: A leg let through with no breaker to ask (breakers off).
NORMAL = Admission()


#: ``on_change(target, old, new, why)``.
OnChange = Callable[[PrefillTarget, BreakerState, BreakerState, str], None]
#: ``on_forget(target, its last state)``: a breaker was forgotten.
OnForget = Callable[[PrefillTarget, BreakerState], None]


@dataclass(slots=True)
class _Breaker:
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    successes: int = 0
    open_until: float = 0.0
    open_s: float = 0.0
    trial_running: bool = False
    #: The epoch of its last change of state (0: never changed).
    epoch: int = 0
    #: A probe of this open spell found the engine down (its next healthy answer is news).
    seen_down: bool = False
    #: When a request last named its target (``allows``, ``admit``).
    named_at: float = 0.0


class CircuitBreakers:
    """The breakers of every prefill target this process sends legs to."""

    def __init__(
        self,
        *,
        failures: int,
        open_s: float,
        successes: int,
        on_change: OnChange | None = None,
        on_forget: OnForget | None = None,
        idle_s: float | None = None,
        max_tracked: int = MAX_TRACKED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._failures = failures
        self._open_s = open_s
        self._successes = max(successes, 1)
        self._on_change = on_change
        self._on_forget = on_forget
        #: Unnamed this long, a target is forgotten (default: the longest cool-down).
        self.idle_s = idle_s if idle_s is not None else MAX_BACKOFF * open_s
        self._clock = clock
        #: In the order requests last named their targets (the least recently named first).
        self._breakers: BoundedMap[PrefillTarget, _Breaker] = BoundedMap(
            max_tracked, on_evict=self._evicted)
        #: Every change of state of any breaker takes the next epoch.
        self._epochs = 0

    @property
    def enabled(self) -> bool:
        return self._failures > 0

    def state(self, target: PrefillTarget) -> BreakerState:
        breaker = self._breakers.peek(target)
        return BreakerState.CLOSED if breaker is None else breaker.state

    def states(self) -> dict[PrefillTarget, BreakerState]:
        """Every tracked target's state (closed ones may have been forgotten)."""
        return {target: breaker.state for target, breaker in self._breakers.items()}

    def by_naming(self, among: Collection[PrefillTarget]) -> PrefillTarget | None:
        """Of ``among``, the tracked target a request named longest ago (None: none)."""
        return next((target for target in self._breakers if target in among), None)

    def retry_in(self, target: PrefillTarget) -> float:
        """Seconds until an open breaker lets a trial leg through (0 when it would now)."""
        breaker = self._breakers.peek(target)
        if breaker is None or breaker.state is not BreakerState.OPEN:
            return 0.0
        return max(breaker.open_until - self._clock(), 0.0)

    def _named(self, target: PrefillTarget) -> _Breaker | None:
        """``target``'s breaker, now the most recently named (None: not tracked)."""
        breakers = self._breakers
        if not breakers:
            return None  # the usual case: no target ever failed
        breaker = breakers.peek(target)
        if breaker is not None:
            breaker.named_at = self._clock()
            breakers[target] = breaker  # re-inserted last: the most recently named
        return breaker

    def allows(self, target: PrefillTarget) -> bool:
        breaker = self._named(target)
        if breaker is None or breaker.state is BreakerState.CLOSED:
            return True
        if breaker.state is BreakerState.OPEN:
            return self._clock() >= breaker.open_until
        return not breaker.trial_running

    def admit(self, target: PrefillTarget) -> Admission | None:
        breaker = self._named(target)
        if breaker is None:
            return NORMAL
        if breaker.state is BreakerState.CLOSED:
            return Admission(epoch=breaker.epoch)
        if breaker.state is BreakerState.OPEN:
            if self._clock() < breaker.open_until:
                return None
            self._half_open(target, breaker, "cool-down over: one trial leg")
        if breaker.trial_running:
            return None
        breaker.trial_running = True
        return Admission(trial=True, epoch=breaker.epoch)

    def probed(self, target: PrefillTarget, healthy: bool | None) -> None:
        """What a probe of an open breaker's target found (``sidecar.engines.health``):
        ``healthy`` True (up), False (down: refused, unreachable, an error status), None
        (slow: it answered too late, which says nothing: an overloaded engine is not down).
        Health that never failed says nothing about legs that fail (an engine that answers
        ``/health`` but fails its prefills): only an up answer after the engine was seen
        down in this open spell (a probe found it down, or the leg that opened it was
        refused) ends the cool-down at once (half-open: the next leg is a trial), so an
        engine that restarts gets legs again as soon as it answers."""
        breaker = self._breakers.peek(target)
        if breaker is None or breaker.state is not BreakerState.OPEN or healthy is None:
            return
        if not healthy:
            breaker.seen_down = True
            return
        if breaker.seen_down:
            breaker.open_until = self._clock()
            self._half_open(target, breaker, "its health endpoint answers again: a trial leg")

    def _half_open(self, target: PrefillTarget, breaker: _Breaker, why: str) -> None:
        self._change(target, breaker, BreakerState.HALF_OPEN, why)
        breaker.successes = 0

    def settle(self, target: PrefillTarget, admission: Admission, ok: bool | None,
               why: str = "", *, down: bool = False) -> None:
        """A leg's verdict: ``ok`` True (it answered), False (a failure showing the engine
        unhealthy, ``why`` in words; ``down``: its connect was refused or never accepted),
        None (neither: cancelled, or the request's own fault)."""
        if not self.enabled:
            return
        breaker = self._breakers.peek(target)
        if (breaker.epoch if breaker is not None else 0) != admission.epoch:
            return  # admitted in another state of the breaker: says nothing about this one
        if admission.trial:
            if breaker is None or breaker.state is not BreakerState.HALF_OPEN:
                return
            breaker.trial_running = False
            if ok is True:
                breaker.successes += 1
                if breaker.successes >= self._successes:
                    self._change(target, breaker, BreakerState.CLOSED,
                                 f"{breaker.successes} trial leg(s) answered")
                    breaker.failures = 0
            elif ok is False:
                self._open(target, breaker, min(breaker.open_s * 2, self._open_s * MAX_BACKOFF),
                           f"the trial leg failed: {why}", down)
            return
        if breaker is not None and breaker.state is not BreakerState.CLOSED:
            return  # began before the breaker opened: says nothing about it now
        if ok is True:
            if breaker is not None:
                breaker.failures = 0
                if not breaker.epoch:
                    del self._breakers[target]  # never changed state: nothing to remember
            return
        if ok is None:
            return
        if breaker is None:
            breaker = self._track(target)
        breaker.failures += 1
        if breaker.failures >= self._failures:
            self._open(target, breaker, self._open_s,
                       f"{breaker.failures} failed legs in a row, the last: {why}", down)

    def _open(self, target: PrefillTarget, breaker: _Breaker, open_s: float, why: str,
              down: bool) -> None:
        breaker.open_s = open_s
        breaker.open_until = self._clock() + open_s
        breaker.failures = 0
        breaker.trial_running = False
        # Its last leg found it not listening: its next healthy answer is news.
        breaker.seen_down = down
        self._change(target, breaker, BreakerState.OPEN, f"{why}; next trial in {open_s:g} s")

    def _track(self, target: PrefillTarget) -> _Breaker:
        now = self.expire()
        # Past the bound the least recently named goes (a closed one forgotten loses its
        # epoch: a leg of before its last cycle may then count; only under this many
        # targets' pressure).
        breaker = self._breakers[target] = _Breaker(named_at=now)
        return breaker

    def expire(self) -> float:
        """Forget the targets no request named for ``idle_s`` (the least recently named
        first, so this stops at the first one named since); returns the clock's now."""
        now = self._clock()
        if self._breakers:
            idle_since = now - self.idle_s
            self._breakers.evict_while(lambda _, breaker: breaker.named_at <= idle_since)
        return now

    def forget(self, target: PrefillTarget) -> None:
        """Forget ``target`` now (its pod left the selected pool)."""
        breaker = self._breakers.pop(target, None)
        if breaker is not None:
            self._forgotten(target, breaker, "it left the pool")

    def _evicted(self, target: PrefillTarget, breaker: _Breaker) -> None:
        unnamed_s = self._clock() - breaker.named_at
        self._forgotten(target, breaker, (
            f"no request named it for {unnamed_s:.0f} s" if unnamed_s >= self.idle_s
            else f"more than {self._breakers.bound} targets tracked"))

    def _forgotten(self, target: PrefillTarget, breaker: _Breaker, why: str) -> None:
        if breaker.state is not BreakerState.CLOSED:
            logger.info("circuit breaker of prefill target %s forgotten while %s: %s",
                        target, breaker.state.name.lower().replace("_", "-"), why)
        if self._on_forget is not None:
            self._on_forget(target, breaker.state)

    def _change(self, target: PrefillTarget, breaker: _Breaker, new: BreakerState,
                why: str) -> None:
        old, breaker.state = breaker.state, new
        self._epochs += 1
        breaker.epoch = self._epochs
        log = logger.warning if new is BreakerState.OPEN else logger.info
        log("circuit breaker of prefill target %s %s: %s", target, _VERBS[new], why)
        if self._on_change is not None:
            self._on_change(target, old, new, why)
