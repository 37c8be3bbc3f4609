"""The engines' health, by one rule: the local engine's readiness (as /ready and the gRPC
health service report it), and the probes of prefill targets whose circuit breaker is open.

One probe (``HealthProber``), the same for every engine:

    GET <engine>/health ─▶ UP    200, its head within the answer timeout
                          SLOW  connected, but no answer within the answer timeout
                          DOWN  refused, not accepted within --connect-timeout-s, unreachable,
                                a TLS handshake that failed, an error status, a broken answer

The answer timeout is ``min(--connect-timeout-s, 2 s)``, counted from the request's sending
(the connect has ``--connect-timeout-s``, as every engine call); no answer is read past
``MAX_HEALTH_ANSWER`` bytes (health answers are empty), no redirect is followed. Slow is
not down: an overloaded engine answers late and still serves; a dead one does not accept
connections, and a broken one answers an error status.

The local engine (``EngineHealth``): ``check()`` probes it; ready is UP. ``watch()`` repeats
it in the background and calls listeners on changes (the gRPC health servicer flips
SERVING / NOT_SERVING). ``known_down`` is true once a check found the engine DOWN (the
placement refuses at once then: ``sidecar.request.placement``; a slow engine is not ready but
still gets its requests), and ``recheck()`` asks again, sharing one call among the requests
that ask at the same time. Logged: the first check's result (an engine that never answers
from start-up is said so at once, with the cause: refused, an HTTP status, no answer in time,
a TLS handshake), every change, and, while the engine stays not ready, one line per
``down_log_interval_s`` with how long and why.

The prefill targets whose circuit breaker is open (``BreakerProbes``):

    breaker opens ─▶ probe task for that target: a probe every 0.5-0.75 s (jittered)
                     ├─ DOWN ─▶ breakers.probed(target, False): seen down
                     ├─ SLOW ─▶ breakers.probed(target, None): no news (the cool-down holds)
                     └─ UP   ─▶ breakers.probed(target, True): after a down answer, the
                                cool-down ends now and the next leg is a trial
    the breaker leaves open, or is forgotten (its target unnamed for its idle time, or its
    pod gone: ``sidecar.targets.breaker``) ─▶ the task ends; close() ─▶ all end

An engine killed and restarted under load opened its breaker, and each failed trial doubled
the cool-down (up to 8 x ``--prefill-breaker-open-s``), so a recovered engine waited minutes
for legs. Probed, it gets a trial leg within about a second of answering its health
endpoint again, and legs once the trials answer. An overloaded engine whose health answers
come late keeps its doubled cool-down (a slow answer counted as down, and the next quick one
ended the cool-down: 4 trial legs in 3 s). Probes cost the other targets nothing: they run
beside the requests, one task per open breaker, and no request waits for them.

Deliberate limits: at most ``MAX_PROBES`` targets probed at once; a breaker opening past that
takes the probe of the target a request named longest ago; ``/health`` is every engine
family's health path.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Final

from sidecar.bounded import BoundedMap
from sidecar.http1 import EngineClient, UpstreamError, UpstreamTLSError
from sidecar.protocol.context import PrefillTarget
from sidecar.targets.breaker import BreakerState, CircuitBreakers
from sidecar.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

HEALTH_PATH: Final = "/health"
#: A health answer is empty; no more than this is read (the connection is then dropped).
MAX_HEALTH_ANSWER: Final = 4096
#: The answer timeout is the connect timeout, at most this.
MAX_ANSWER_TIMEOUT_S: Final = 2.0
#: Seconds between two probes of one target: this, plus up to half of it at random.
PROBE_INTERVAL_S: Final = 0.5
#: Targets probed at once, at most.
MAX_PROBES: Final = 64


def answer_timeout(connect_timeout_s: float) -> float:
    """How long a health answer may take before it is slow (the one timeout rule)."""
    return min(connect_timeout_s, MAX_ANSWER_TIMEOUT_S)


class Health(Enum):
    """What one probe found (see the module docstring)."""

    UP = "up"
    SLOW = "slow"
    DOWN = "down"

    @property
    def healthy(self) -> bool | None:
        """As a breaker hears it: True up, False down, None slow (no news)."""
        return None if self is Health.SLOW else self is Health.UP


@dataclass(frozen=True, slots=True)
class HealthAnswer:
    """One probe's finding, and why it is not up (in words)."""

    health: Health
    cause: str | None = None
    #: A TLS handshake failed: no engine start explains it (a configuration to fix).
    misconfigured: bool = False


UP: Final = HealthAnswer(Health.UP)


class HealthProber:
    """``GET /health`` of any engine, by the one rule (see the module docstring)."""

    def __init__(self, session: EngineClient, *, timeout_s: float) -> None:
        self._session = session
        #: The answer timeout: a health answer later than this is slow.
        self.timeout_s = timeout_s

    async def probe(self, base_url: str, tls_name: str | None = None) -> HealthAnswer:
        """What ``base_url``'s engine answers its health endpoint now."""
        session = self._session
        try:
            # Each wait for the answer within the answer timeout; the connect within its
            # own (the whole exchange's deadline only bounds a wait for a pooled slot).
            response = await session.request(
                "GET", base_url + HEALTH_PATH, server_hostname=tls_name,
                read_timeout_s=self.timeout_s,
                timeout_s=session.connect_timeout_s + self.timeout_s)
            async with response:
                await response.read(MAX_HEALTH_ANSWER)
                status = response.status
        except TimeoutError:
            return HealthAnswer(Health.SLOW,
                                f"no answer to GET {HEALTH_PATH} within {self.timeout_s:g} s")
        except UpstreamTLSError as exc:
            return HealthAnswer(Health.DOWN, f"TLS handshake failed: {exc.reason}",
                                misconfigured=True)
        except UpstreamError as exc:
            return HealthAnswer(Health.DOWN, exc.reason)
        if status != 200:
            return HealthAnswer(Health.DOWN, f"GET {HEALTH_PATH} answered HTTP {status}")
        return UP


class EngineHealth:
    """Tracks whether the local engine answers its health endpoint."""

    def __init__(
        self,
        session: EngineClient,
        engine_url: str,
        *,
        timeout_s: float = MAX_ANSWER_TIMEOUT_S,
        interval_s: float = 2.0,
        down_log_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._prober = HealthProber(session, timeout_s=timeout_s)
        self._engine_url = engine_url.rstrip("/")
        self._interval_s = interval_s
        self._down_log_interval_s = down_log_interval_s
        self._clock = clock
        self.ready = False
        #: Why the last check did not find it ready (None while ready or before the first).
        self.cause: str | None = None
        self._checked = False
        #: The last check found the engine down (False before the first check, and while it
        #: is only slow): a plain attribute, read by every request's placement.
        self.known_down = False
        self._down_since = 0.0
        self._down_logged_at = 0.0
        self._listeners: list[Callable[[bool], None]] = []
        self._recheck: asyncio.Future[bool] | None = None

    def on_change(self, listener: Callable[[bool], None]) -> None:
        self._listeners.append(listener)

    async def check(self) -> bool:
        """Ask the engine now; update and return whether it is ready."""
        self._note(await self._prober.probe(self._engine_url))
        return self.ready

    async def recheck(self) -> bool:
        """``check()``, shared: callers arriving while one runs wait for its answer; True
        unless the engine was found down (a slow engine still gets its requests)."""
        if self._recheck is None:
            self._recheck = asyncio.ensure_future(self._reachable())
            self._recheck.add_done_callback(self._recheck_done)
        return await asyncio.shield(self._recheck)

    async def _reachable(self) -> bool:
        await self.check()
        return not self.known_down

    def _recheck_done(self, _: asyncio.Future[bool]) -> None:
        self._recheck = None

    def _note(self, answer: HealthAnswer) -> None:
        ready, cause = answer.health is Health.UP, answer.cause
        now = self._clock()
        first = not self._checked
        self._checked = True
        self.cause = cause
        if ready:
            if first or not self.ready:
                down_for = "" if first else f" after {now - self._down_since:.0f} s down"
                logger.info("local engine %s ready%s", self._engine_url, down_for)
        elif first and not answer.misconfigured:
            # An engine still loading its model when the sidecar starts is the normal start
            # of a pod: said once at INFO; only a still-missing engine is a warning (below).
            self._down_since = self._down_logged_at = now
            logger.info("waiting for the local engine %s (not ready yet: %s)",
                        self._engine_url, cause)
        elif first or self.ready:
            self._down_since = self._down_logged_at = now
            logger.warning("local engine %s not ready: %s", self._engine_url, cause)
        elif now - self._down_logged_at >= self._down_log_interval_s:
            self._down_logged_at = now
            logger.warning("local engine %s still not ready after %.0f s: %s",
                           self._engine_url, now - self._down_since, cause)
        self.known_down = answer.health is Health.DOWN
        if ready != self.ready:
            self.ready = ready
            for listener in self._listeners:
                listener(ready)

    async def watch(self) -> None:
        """Check forever at the configured interval (run as a task; cancel to stop)."""
        while True:
            await self.check()
            await asyncio.sleep(self._interval_s)


# -- the probes of open breakers' targets --------------------------------------------------


class BreakerProbes:
    """One probe task per prefill target whose breaker is open (see the module docstring):
    a ``BoundedMap`` of at most ``MAX_PROBES`` tasks."""

    def __init__(self, session: EngineClient, *, timeout_s: float,
                 interval_s: float = PROBE_INTERVAL_S, rng: random.Random | None = None,
                 max_probes: int = MAX_PROBES) -> None:
        self._prober = HealthProber(session, timeout_s=timeout_s)
        self._interval_s = interval_s
        self._rng = rng or random.Random()
        # The bound is a backstop: ``changed`` makes room first (the target a request named
        # longest ago yields).
        self._tasks: BoundedMap[PrefillTarget, asyncio.Task[None]] = BoundedMap(
            max_probes, on_evict=_cancel)
        self._closed = False
        #: Set once the breakers exist (they call ``changed`` on every change, ``forgotten``
        #: when they forget a target).
        self.breakers: CircuitBreakers | None = None

    @property
    def probing(self) -> frozenset[PrefillTarget]:
        """The targets probed now."""
        return frozenset(self._tasks)

    def changed(self, target: PrefillTarget, new: BreakerState) -> None:
        """A breaker changed state: an open one is probed (its task ends by itself when the
        breaker leaves open)."""
        if new is not BreakerState.OPEN or self._closed or target in self._tasks:
            return
        tasks = self._tasks
        breakers = self.breakers
        if len(tasks) >= tasks.bound and breakers is not None:
            breakers.expire()  # targets gone quiet go first (``forgotten``: their tasks end)
            if len(tasks) >= tasks.bound:
                oldest = breakers.by_naming(tasks)
                if oldest is not None:
                    self.forgotten(oldest)
        task = asyncio.ensure_future(self._probe(target))
        tasks[target] = task
        task.add_done_callback(lambda done: self._ended(target, done))

    def forgotten(self, target: PrefillTarget, _: BreakerState | None = None) -> None:
        """``target``'s breaker was forgotten (or yields its probe): its probe ends now."""
        task = self._tasks.pop(target, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # (a task that forgot its own target ends when it looks again)

    def _ended(self, target: PrefillTarget, task: asyncio.Task[None]) -> None:
        if self._tasks.peek(target) is task:
            del self._tasks[target]

    async def _probe(self, target: PrefillTarget) -> None:
        breakers = self.breakers
        assert breakers is not None
        base_url, tls_name = target.base_url, target.tls_name
        while True:
            # Jittered: the probes of many sidecars do not arrive together.
            await asyncio.sleep(self._interval_s * (1 + self._rng.random() / 2))
            breakers.expire()  # a probe running is a clock for forgetting quiet targets
            if breakers.state(target) is not BreakerState.OPEN or target not in self._tasks:
                return
            answer = await self._prober.probe(base_url, tls_name)
            breakers.probed(target, answer.health.healthy)

    async def close(self) -> None:
        """Stop every probe (shutdown)."""
        self._closed = True
        await cancel_and_wait(*self._tasks.values())


def _cancel(_: PrefillTarget, task: asyncio.Task[None]) -> None:
    task.cancel()
