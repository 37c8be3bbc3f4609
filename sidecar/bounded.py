"""The one bounded map of the sidecar: every map keyed by what routers or clients send.

    cache = BoundedMap[PrefillTarget, State](bound=4096, on_evict=forget)
    cache[key] = value          inserted (or replaced) as the most recently used; past
                                ``bound`` keys the least recently used go first, each told
                                to ``on_evict(key, value)``
    cache.get(key)              a use: the key becomes the most recently used
    cache.peek(key)             no use (a lookup that must not keep a key alive)
    cache.pop(key)              removed; ``on_evict`` is not told (the owner removed it)
    cache.evict_while(stale)    the least recently used keys that ``stale(key, value)`` calls
                                stale, from the oldest on, until one is not (idle expiry:
                                with one idle time for all, the stale ones are the oldest)

A router may name any address an allowlist admits, and a client any request id: a map keyed
by them without a bound grows with what they send. Each such map (targets' cool-downs and
circuit breakers, the probes of open breakers, remembered allowlist verdicts and URLs, the
data-parallel ranks' turns, the dialects' learned engine identities and looked-up ids)
declares its bound and its eviction here, in one place with one rule: least recently used
first. Python's dict keeps insertion order, so "most recently used" is "re-inserted last" and
every operation is O(1) (``evict_while`` O(1) per key it removes).

Deliberate limits: not thread-safe (one event loop per process owns each map); ``on_evict``
runs inside the write that overflowed, so it must not write to the same map.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar, overload

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")

#: Told of each key evicted by the bound or by ``evict_while``: ``(key, value)``.
OnEvict = Callable[[K, V], None]


class BoundedMap(Generic[K, V]):
    """``key -> value``, at most ``bound`` keys, least recently used out first."""

    __slots__ = ("_entries", "_on_evict", "bound")

    def __init__(self, bound: int, *, on_evict: OnEvict[K, V] | None = None) -> None:
        if bound < 1:
            raise ValueError(f"a bounded map holds at least one key, not {bound}")
        self.bound = bound
        self._on_evict = on_evict
        self._entries: dict[K, V] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first."""
        return iter(self._entries)

    def items(self) -> Iterator[tuple[K, V]]:
        """The entries, least recently used first."""
        return iter(self._entries.items())

    def __setitem__(self, key: K, value: V) -> None:
        entries = self._entries
        if key in entries:
            del entries[key]
        elif len(entries) >= self.bound:
            self._evict_oldest()
        entries[key] = value

    @overload
    def get(self, key: K) -> V | None: ...

    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: object = None) -> object:
        """``key``'s value, now the most recently used (``default`` when absent)."""
        entries = self._entries
        try:
            value = entries.pop(key)
        except KeyError:
            return default
        entries[key] = value
        return value

    def peek(self, key: K) -> V | None:
        """``key``'s value without counting a use (None when absent)."""
        return self._entries.get(key)

    def pop(self, key: K) -> V | None:
        """Remove ``key`` (its owner's doing: ``on_evict`` is not told); its value or None."""
        return self._entries.pop(key, None)

    def clear(self) -> None:
        """Remove every key (``on_evict`` is not told)."""
        self._entries.clear()

    def evict_while(self, stale: Callable[[K, V], bool]) -> int:
        """Evict the least recently used keys while ``stale`` says so; how many went."""
        entries = self._entries
        evicted = 0
        while entries:
            key = next(iter(entries))
            value = entries[key]
            if not stale(key, value):
                break
            del entries[key]
            evicted += 1
            if self._on_evict is not None:
                self._on_evict(key, value)
        return evicted

    def _evict_oldest(self) -> None:
        key = next(iter(self._entries))
        value = self._entries.pop(key)
        if self._on_evict is not None:
            self._on_evict(key, value)
