"""The local engine's readiness, as /ready and the gRPC health service report it.

``check()`` asks the engine's ``GET /health`` (every engine family serves it) with a short
deadline; ``watch()`` repeats it in the background and calls listeners on changes (the gRPC
health servicer flips SERVING / NOT_SERVING).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sidecar.http1 import EngineClient, UpstreamError

logger = logging.getLogger(__name__)

#: A health answer is empty; more than this is not read (the connection is dropped).
_MAX_BODY = 64 * 1024


class EngineHealth:
    """Tracks whether the local engine answers its health endpoint."""

    def __init__(self, session: EngineClient, engine_url: str, *, timeout_s: float = 2.0,
                 interval_s: float = 2.0) -> None:
        self._session = session
        self._url = engine_url.rstrip("/") + "/health"
        self._timeout_s = timeout_s
        self._interval_s = interval_s
        self.ready = False
        self._listeners: list[Callable[[bool], None]] = []

    def on_change(self, listener: Callable[[bool], None]) -> None:
        self._listeners.append(listener)

    async def check(self) -> bool:
        """Ask the engine now; update and return the state."""
        try:
            async with asyncio.timeout(self._timeout_s):
                async with await self._session.get(self._url) as response:
                    await response.read(_MAX_BODY)
                    ready = response.status == 200
        except (UpstreamError, TimeoutError):
            ready = False
        if ready != self.ready:
            logger.info("local engine %s", "ready" if ready else "not ready")
            self.ready = ready
            for listener in self._listeners:
                listener(ready)
        return ready

    async def watch(self) -> None:
        """Check forever at the configured interval (run as a task; cancel to stop)."""
        while True:
            await self.check()
            await asyncio.sleep(self._interval_s)
