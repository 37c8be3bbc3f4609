"""Admission control shared by both front doors: the in-flight bound and draining.

    enter() ─▶ Overloaded (over --max-inflight) | Draining (after SIGTERM) | admitted
    leave() ─▶ wakes wait_idle() when the last request ends

With ``--workers N`` the bound is the pool's (``pool``: ``sidecar.workers.shared_inflight``).
Deliberate limits: a plain counter, not a queue (a refused client retries: HTTP 503 carries
Retry-After); draining is per process (every worker gets SIGTERM).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from sidecar.errors import Draining, Overloaded


class PoolInflight(Protocol):
    """The other workers' requests in flight, and where this worker's count is published."""

    def others(self) -> int: ...

    def publish(self, inflight: int) -> None: ...


class Admission:
    """Counts requests in flight and refuses new ones when full or draining."""

    def __init__(self, max_inflight: int, pool: PoolInflight | None = None) -> None:
        self._max_inflight = max_inflight
        self._pool = pool
        self._inflight = 0
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def draining(self) -> bool:
        return self._draining

    def enter(self) -> None:
        if self._draining:
            raise Draining("the sidecar is shutting down")
        pool = self._pool
        if pool is None:
            if self._inflight >= self._max_inflight:
                raise Overloaded("too many requests in flight")
        elif self._inflight + pool.others() >= self._max_inflight:
            raise Overloaded("too many requests in flight")
        self._inflight += 1
        self._idle.clear()
        if pool is not None:
            pool.publish(self._inflight)

    def leave(self) -> None:
        self._inflight -= 1
        if self._pool is not None:
            self._pool.publish(self._inflight)
        if self._inflight == 0:
            self._idle.set()

    def start_draining(self) -> None:
        self._draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False when ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True
