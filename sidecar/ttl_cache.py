"""A small async cache of looked-up values: one look-up in flight per key, entries that
expire, bounded memory.

    cache = SingleFlightTTLCache[tuple[str, int], str](ttl_s=60.0)
    value = await cache.get(key, lambda: look_up(key))

- single flight: while a look-up for ``key`` runs, every other ``get(key)`` waits for that
  one (50 concurrent first requests make one call, not 50). The look-up runs as a task of
  its own, so a caller that goes away cancels neither it nor the others' wait; its failure
  reaches every waiter and is not cached (the next ``get`` asks again);
- expiry: a value is served for ``ttl_s`` seconds after it arrived; expired entries are
  evicted by a sweep at most once per ``ttl_s`` (amortised into ``get``), so keys asked once
  do not stay for ever;
- bound: at most ``max_entries`` values; past it the oldest goes first (a
  ``sidecar.bounded.BoundedMap`` whose reads count no use: oldest learned is oldest out, and
  with one TTL for all the expired ones are the oldest, so the sweep stops at the first that
  is not).

Built for dialects' side-channel look-ups (the Mooncake engine id; any dialect's identity
look-up). Deliberate limits: no per-entry TTL; no negative caching.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

from sidecar.bounded import BoundedMap
from sidecar.tasks import cancel_and_wait

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlightTTLCache(Generic[K, V]):
    """``key -> value`` for ``ttl_s`` seconds, each missing value looked up once at a time."""

    def __init__(self, ttl_s: float, *, max_entries: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError("ttl_s must be > 0 and max_entries >= 1")
        self._ttl_s = ttl_s
        self._clock = clock
        #: key -> (expires at, value), oldest first (read with ``peek``: a read is no use).
        self._entries: BoundedMap[K, tuple[float, V]] = BoundedMap(max_entries)
        self._flights: dict[K, asyncio.Task[V]] = {}
        self._next_sweep = clock() + ttl_s

    def __len__(self) -> int:
        """Values held (expired ones not yet swept included)."""
        return len(self._entries)

    @property
    def in_flight(self) -> int:
        """Look-ups running now."""
        return len(self._flights)

    async def get(self, key: K, look_up: Callable[[], Awaitable[V]]) -> V:
        """The value of ``key``: cached, or from the running look-up, or from ``look_up()``."""
        now = self._clock()
        if now >= self._next_sweep:
            self._sweep(now)
        entry = self._entries.peek(key)
        if entry is not None and entry[0] > now:
            return entry[1]
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.ensure_future(self._fly(key, look_up))
            flight.add_done_callback(_retrieved)  # its waiters may all have gone
            self._flights[key] = flight
        # Shielded: this caller's cancellation leaves the look-up to the others (and the cache).
        return await asyncio.shield(flight)

    async def _fly(self, key: K, look_up: Callable[[], Awaitable[V]]) -> V:
        """One look-up; its value is stored before any waiter resumes (a failure is not)."""
        try:
            value = await look_up()
        finally:
            if self._flights.get(key) is asyncio.current_task():
                del self._flights[key]
        # Written last (the newest); past the bound the oldest goes.
        self._entries[key] = (self._clock() + self._ttl_s, value)
        return value

    def _sweep(self, now: float) -> None:
        self._entries.evict_while(lambda _, entry: entry[0] <= now)
        self._next_sweep = now + self._ttl_s

    def forget(self, key: K) -> None:
        """Drop ``key``'s value (a look-up running for it still stores what it finds)."""
        self._entries.pop(key, None)

    async def close(self) -> None:
        """Stop the look-ups still running (shutdown)."""
        flights = list(self._flights.values())
        self._flights.clear()
        await cancel_and_wait(*flights)


def _retrieved(flight: asyncio.Future[Any]) -> None:
    if not flight.cancelled():
        flight.exception()
