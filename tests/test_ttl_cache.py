"""Proves ``sidecar.ttl_cache.SingleFlightTTLCache`` and the Mooncake engine-id look-up on it:

- 50 concurrent first asks of one key make one look-up (the Mooncake dialect's ``/query``:
  one call, not 50, and every request gets the id);
- a caller that goes away cancels neither the look-up nor the others' wait; a failed
  look-up reaches every waiter and is not cached;
- a value expires after ``ttl_s`` and is asked again; expired entries are evicted by the
  sweep (keys asked once do not stay); at most ``max_entries`` values are kept;
- ``close()`` stops the look-ups in flight.

The clock is the test's; look-ups end when the test resolves them (no sleeps).
"""

from __future__ import annotations

import asyncio

import pytest

from sidecar.dialects.vllm_mooncake import EngineIdCache
from sidecar.ttl_cache import SingleFlightTTLCache


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HeldLookup:
    """An ``EngineLookup`` whose answers wait for the test."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.answer: asyncio.Future[tuple[int, bytes]] = (
            asyncio.get_running_loop().create_future())

    async def get(self, url: str, *, max_bytes: int) -> tuple[int, bytes]:
        self.urls.append(url)
        return await self.answer


async def test_fifty_concurrent_first_requests_make_one_query() -> None:
    lookup = HeldLookup()
    cache = EngineIdCache(lookup)
    asks = [asyncio.ensure_future(cache.get("http://10.0.0.7:8998")) for _ in range(50)]
    await asyncio.sleep(0)
    lookup.answer.set_result((200, b'{"0": {"engine_id": "engine-a", "worker_addr": {}}}'))
    assert await asyncio.gather(*asks) == ["engine-a"] * 50
    assert lookup.urls == ["http://10.0.0.7:8998/query"]
    assert await cache.get("http://10.0.0.7:8998") == "engine-a"  # cached
    assert len(lookup.urls) == 1


async def test_a_caller_gone_leaves_the_look_up_to_the_others_and_errors_are_not_cached(
) -> None:
    calls = 0
    answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def look_up() -> str:
        nonlocal calls
        calls += 1
        return await answer

    cache: SingleFlightTTLCache[str, str] = SingleFlightTTLCache(60.0)
    first = asyncio.ensure_future(cache.get("k", look_up))
    second = asyncio.ensure_future(cache.get("k", look_up))
    await asyncio.sleep(0)
    first.cancel()
    answer.set_exception(RuntimeError("bootstrap down"))
    with pytest.raises(RuntimeError):
        await second
    assert first.cancelled() and calls == 1 and len(cache) == 0 and cache.in_flight == 0

    async def works() -> str:
        return "v"

    assert await cache.get("k", works) == "v"


async def test_values_expire_are_evicted_and_are_bounded() -> None:
    clock = Clock()
    cache: SingleFlightTTLCache[int, str] = SingleFlightTTLCache(60.0, max_entries=3,
                                                                clock=clock)
    asked: list[int] = []

    def look_up(key: int) -> asyncio.Future[str]:
        asked.append(key)
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        done.set_result(f"v{key}-{len(asked)}")
        return done

    for key in range(5):
        await cache.get(key, lambda key=key: look_up(key))
    assert len(cache) == 3  # the two oldest went first
    assert await cache.get(4, lambda: look_up(4)) == "v4-5"  # still fresh
    clock.now += 61
    assert await cache.get(4, lambda: look_up(4)) == "v4-6"  # expired: asked again
    assert len(cache) == 1  # the sweep evicted the expired keys asked once


async def test_close_stops_the_look_ups_in_flight() -> None:
    cache: SingleFlightTTLCache[str, str] = SingleFlightTTLCache(60.0)
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(cache.get("k", lambda: never))
    await asyncio.sleep(0)
    assert cache.in_flight == 1
    await cache.close()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cache.in_flight == 0
