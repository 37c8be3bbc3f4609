"""The one bounded map of the sidecar: every map keyed by what routers or clients send.

    cache = BoundedMap[PrefillTarget, State](bound=4096, on_evict=forget)
    cache[key] = value          inserted (or replaced) as the most recently used; past
                                ``bound`` keys the least recently used go first, each told
                                to ``on_evict(key, value)``
    cache.get(key)              a use: the key becomes the most recently used
    cache.peek(key)             no use (a lookup that must not keep a key alive)
    cache.pop(key, None)        removed; ``on_evict`` is not told (the owner removed it)
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

from collections.abc import Callable, Hashable
from typing import TypeVar, overload

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")

#: Told of each key evicted by the bound or by ``evict_while``: ``(key, value)``.
OnEvict = Callable[[K, V], None]


class BoundedMap(dict[K, V]):
    """``key -> value``, at most ``bound`` keys, least recently used out first.

    A ``dict`` whose writes keep the bound: ``map[key] = value`` (the only way in; ``update``
    and ``setdefault`` refuse) and ``get`` (a use) are its own; reads that count no use
    (``peek``, ``in``, ``len``, iteration, ``pop(key, None)``, ``clear``) are the dict's, at
    its speed: the hot path reads these maps on every request.
    """

    __slots__ = ("_on_evict", "bound")

    def __init__(self, bound: int, *, on_evict: OnEvict[K, V] | None = None) -> None:
        if bound < 1:
            raise ValueError(f"a bounded map holds at least one key, not {bound}")
        super().__init__()
        self.bound = bound
        self._on_evict = on_evict

    def __setitem__(self, key: K, value: V) -> None:
        if key in self:
            super().__delitem__(key)  # re-inserted last: the most recently used
        elif len(self) >= self.bound:
            self._evict_oldest()
        super().__setitem__(key, value)

    @overload
    def get(self, key: K, default: None = None, /) -> V | None: ...

    @overload
    def get(self, key: K, default: V, /) -> V: ...

    @overload
    def get(self, key: K, default: D, /) -> V | D: ...

    def get(self, key: K, default: object = None, /) -> object:
        """``key``'s value, now the most recently used (``default`` when absent)."""
        try:
            value = super().pop(key)
        except KeyError:
            return default
        super().__setitem__(key, value)
        return value

    #: ``key``'s value without counting a use (None when absent).
    peek = dict.get

    def setdefault(self, *args: object, **kwargs: object) -> V:
        raise TypeError("a BoundedMap is written with map[key] = value (its bound holds)")

    def update(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a BoundedMap is written with map[key] = value (its bound holds)")

    def __ior__(self, other: object) -> BoundedMap[K, V]:  # type: ignore[override,misc]
        raise TypeError("a BoundedMap is written with map[key] = value (its bound holds)")

    def evict_while(self, stale: Callable[[K, V], bool]) -> int:
        """Evict the least recently used keys while ``stale`` says so; how many went."""
        evicted = 0
        while self:
            key = next(iter(self))
            value = self[key]
            if not stale(key, value):
                break
            super().__delitem__(key)
            evicted += 1
            if self._on_evict is not None:
                self._on_evict(key, value)
        return evicted

    def _evict_oldest(self) -> None:
        key = next(iter(self))
        value = super().pop(key)
        if self._on_evict is not None:
            self._on_evict(key, value)
