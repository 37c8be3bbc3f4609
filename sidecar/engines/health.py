"""The local engine's readiness, as /ready and the gRPC health service report it.

``check()`` asks the engine's ``GET /health`` (every engine family serves it) with a short
deadline; ``watch()`` repeats it in the background and calls listeners on changes (the gRPC
health servicer flips SERVING / NOT_SERVING). ``known_down`` is true once a check found the
engine not ready (the PD flow refuses at once then: ``sidecar.request.runner``), and
``recheck()`` asks again, sharing one call among the requests that ask at the same time.

Logged: the first check's result (an engine that never answers from start-up is said so at
once, with the cause: refused, an HTTP status, no answer in time, a TLS handshake), every
change, and, while the engine stays down, one line per ``down_log_interval_s`` with how long
and why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sidecar.http1 import EngineClient, UpstreamError, UpstreamTLSError

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
        self._down_since = 0.0
        self._down_logged_at = 0.0
        self._listeners: list[Callable[[bool], None]] = []
        self._recheck: asyncio.Future[bool] | None = None

    @property
    def known_down(self) -> bool:
        """The last check found the engine not ready (False before the first check)."""
        return self._checked and not self.ready

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
        if ready != self.ready:
            self.ready = ready
            for listener in self._listeners:
                listener(ready)

    async def watch(self) -> None:
        """Check forever at the configured interval (run as a task; cancel to stop)."""
        while True:
            await self.check()
            await asyncio.sleep(self._interval_s)
