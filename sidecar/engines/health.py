"""The engines' health: the local engine's readiness (as /ready and the gRPC health service
report it), and the probes of prefill targets whose circuit breaker is open.

``check()`` asks the engine's ``GET /health`` (every engine family serves it) with a short
deadline; ``watch()`` repeats it in the background and calls listeners on changes (the gRPC
health servicer flips SERVING / NOT_SERVING). ``known_down`` is true once a check found the
engine not ready (the PD flow refuses at once then: ``sidecar.request.runner``), and
``recheck()`` asks again, sharing one call among the requests that ask at the same time.

Logged: the first check's result (an engine that never answers from start-up is said so at
once, with the cause: refused, an HTTP status, no answer in time, a TLS handshake), every
change, and, while the engine stays down, one line per ``down_log_interval_s`` with how long
and why.

The probes of prefill targets whose circuit breaker is open (``BreakerProbes``):

    breaker opens ─▶ probe task for that target: GET <target>/health every 0.5-0.75 s
                     (jittered), each within its own short deadline
                     ├─ down (refused, no answer, not 200) ─▶ breakers.probed(target, False)
                     └─ 200 ─▶ breakers.probed(target, True): after a down answer, the
                                cool-down ends now and the next leg is a trial
    the breaker leaves open (half-open, closed) ─▶ the task ends; close() ─▶ all end

An engine killed and restarted under load opened its breaker, and each failed trial doubled
the cool-down (up to 8 x ``--prefill-breaker-open-s``), so a recovered engine waited minutes
for legs. Probed, it gets a trial leg within about a second of answering its health
endpoint again, and legs once the trials answer. Probes cost the other targets nothing:
they run beside the requests, one task per open breaker, and no request waits for them.

Deliberate limits: at most ``MAX_PROBES`` targets probed at once (past that an open breaker
waits out its cool-down); ``/health`` is every engine family's health path; a probe follows
no redirect and reads no body past a small cap.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Final

from sidecar.http1 import EngineClient, UpstreamError, UpstreamTLSError
from sidecar.protocol.context import PrefillTarget
from sidecar.targets.breaker import BreakerState, CircuitBreakers
from sidecar.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: A health answer is empty; more than this is not read (the connection is dropped).
_MAX_BODY = 64 * 1024


class EngineHealth:
    """Tracks whether the local engine answers its health endpoint."""

    def __init__(
        self,
        session: EngineClient,
        engine_url: str,
        *,
        timeout_s: float = 2.0,
        interval_s: float = 2.0,
        down_log_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._engine_url = engine_url.rstrip("/")
        self._url = self._engine_url + "/health"
        self._timeout_s = timeout_s
        self._interval_s = interval_s
        self._down_log_interval_s = down_log_interval_s
        self._clock = clock
        self.ready = False
        #: Why the last check failed (None while ready or before the first check).
        self.cause: str | None = None
        self._checked = False
        #: The last check found the engine not ready (False before the first check): a plain
        #: attribute, read by every request's placement.
        self.known_down = False
        self._down_since = 0.0
        self._down_logged_at = 0.0
        self._listeners: list[Callable[[bool], None]] = []
        self._recheck: asyncio.Future[bool] | None = None

    def on_change(self, listener: Callable[[bool], None]) -> None:
        self._listeners.append(listener)

    async def check(self) -> bool:
        """Ask the engine now; update and return the state."""
        cause: str | None = None
        misconfigured = False
        try:
            async with asyncio.timeout(self._timeout_s):
                async with await self._session.get(self._url) as response:
                    await response.read(_MAX_BODY)
                    if response.status != 200:
                        cause = f"GET /health answered HTTP {response.status}"
        except TimeoutError:
            cause = f"no answer to GET /health within {self._timeout_s:g} s"
        except UpstreamTLSError as exc:
            cause = f"TLS handshake failed: {exc.reason}"
            misconfigured = True  # no engine start explains it: said as a warning at once
        except UpstreamError as exc:
            cause = exc.reason
        self._note(cause is None, cause, misconfigured)
        return self.ready

    async def recheck(self) -> bool:
        """``check()``, shared: callers arriving while one runs wait for its answer."""
        if self._recheck is None:
            self._recheck = asyncio.ensure_future(self.check())
            self._recheck.add_done_callback(self._recheck_done)
        return await asyncio.shield(self._recheck)

    def _recheck_done(self, _: asyncio.Future[bool]) -> None:
        self._recheck = None

    def _note(self, ready: bool, cause: str | None, misconfigured: bool = False) -> None:
        now = self._clock()
        first = not self._checked
        self._checked = True
        self.cause = cause
        if ready:
            if first or not self.ready:
                down_for = "" if first else f" after {now - self._down_since:.0f} s down"
                logger.info("local engine %s ready%s", self._engine_url, down_for)
        elif first and not misconfigured:
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
        self.known_down = not ready
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

logger = logging.getLogger(__name__)

HEALTH_PATH: Final = "/health"
#: Seconds between two probes of one target: this, plus up to half of it at random.
PROBE_INTERVAL_S: Final = 0.5
#: Targets probed at once, at most.
MAX_PROBES: Final = 64
#: A probe's answer is empty or tiny; more is not read.
_MAX_ANSWER: Final = 4096


class BreakerProbes:
    """One probe task per prefill target whose breaker is open (see the module docstring)."""

    def __init__(self, session: EngineClient, *, timeout_s: float,
                 interval_s: float = PROBE_INTERVAL_S, rng: random.Random | None = None) -> None:
        self._session = session
        self._timeout_s = timeout_s
        self._interval_s = interval_s
        self._rng = rng or random.Random()
        self._tasks: dict[PrefillTarget, asyncio.Task[None]] = {}
        self._closed = False
        #: Set once the breakers exist (they call ``changed`` on every change).
        self.breakers: CircuitBreakers | None = None

    @property
    def probing(self) -> frozenset[PrefillTarget]:
        """The targets probed now."""
        return frozenset(self._tasks)

    def changed(self, target: PrefillTarget, new: BreakerState) -> None:
        """A breaker changed state: an open one is probed (its task ends by itself when the
        breaker leaves open)."""
        if (new is not BreakerState.OPEN or self._closed or target in self._tasks
                or len(self._tasks) >= MAX_PROBES):
            return
        task = asyncio.ensure_future(self._probe(target))
        self._tasks[target] = task
        task.add_done_callback(lambda _: self._tasks.pop(target, None))

    async def _probe(self, target: PrefillTarget) -> None:
        breakers = self.breakers
        assert breakers is not None
        url = target.base_url + HEALTH_PATH
        while breakers.state(target) is BreakerState.OPEN:
            # Jittered: the probes of many sidecars do not arrive together.
            await asyncio.sleep(self._interval_s * (1 + self._rng.random() / 2))
            if breakers.state(target) is not BreakerState.OPEN:
                break
            breakers.probed(target, await self._healthy(url, target.tls_name))

    async def _healthy(self, url: str, tls_name: str | None) -> bool:
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._session.request("GET", url, server_hostname=tls_name)
                async with response:
                    await response.read(_MAX_ANSWER)
                    return response.status == 200
        except (UpstreamError, TimeoutError):
            return False

    async def close(self) -> None:
        """Stop every probe (shutdown)."""
        self._closed = True
        await cancel_and_wait(*self._tasks.values())
