"""Every use of prometheus-client's private surface, in one place, with its contract test.

A PD request updates about ten values (its outcome, four stage latencies, the in-flight gauge
twice, relayed bytes, a prefill leg). The public ``inc``/``observe`` check on every call that
the child is one with its labels set, and a histogram finds its bucket with a Python loop over
the bounds: together about 700 bytecodes per request, the sidecar's costliest bookkeeping.
The children here hold the very value objects the public methods update (``_value``; a
histogram's ``_sum``, ``_buckets`` and ``_upper_bounds``) and update them directly: the same
numbers in the same exposition, in one process or in a worker pool's files (the value objects
are prometheus-client's own, in memory or memory-mapped), at about a third of the cost.
In one process the value object is a float behind a lock (``MutexValue``): these children add
to its float directly (``MutexValue._value``), without the lock, because every write to a
hot-path child happens on the event loop's thread (the exposition reads under the lock and
sees the float before or after an addition, never half of one); a worker pool's
memory-mapped values are updated through their own ``inc``.

``tests/observability/test_prometheus_private.py`` checks each touch against the installed
prometheus-client (pyproject.toml pins the minor version it passed on): a family updated
through these children exposes byte for byte what the public methods expose.

Deliberate limits: no exemplars; a counter's amount is not checked for sign (every caller
counts events or bytes); built from a labelled child only (a family without labels is updated
through the public methods, off the hot path); a child these handles update is written by the
event loop's thread only (a thread writing it through the public methods at the same time
could lose one of the two additions).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.values import MutexValue


class _Value(Protocol):
    """prometheus-client's value object (``MutexValue`` or the pool's memory-mapped one)."""

    _value: float

    def inc(self, amount: float) -> None: ...

    def set(self, value: float) -> None: ...


def _in_memory(value: _Value) -> bool:
    """One process's value: a float the loop's thread may add to directly."""
    return type(value) is MutexValue


class CounterValue:
    """A counter child's value: ``inc`` as ``Counter.inc`` without its checks."""

    __slots__ = ("_in_memory", "_value")

    def __init__(self, child: Counter) -> None:
        self._value: _Value = child._value
        self._in_memory = _in_memory(self._value)

    def inc(self, amount: float = 1.0) -> None:
        if self._in_memory:
            self._value._value += amount
        else:
            self._value.inc(amount)


class GaugeValue:
    """A gauge child's value: ``inc``/``dec``/``set`` as ``Gauge``'s without its checks."""

    __slots__ = ("_in_memory", "_value")

    def __init__(self, child: Gauge) -> None:
        self._value: _Value = child._value
        self._in_memory = _in_memory(self._value)

    def inc(self, amount: float = 1.0) -> None:
        if self._in_memory:
            self._value._value += amount
        else:
            self._value.inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def set(self, value: float) -> None:
        if self._in_memory:
            self._value._value = value
        else:
            self._value.set(value)


class HistogramValues:
    """A histogram child's values: ``observe`` as ``Histogram.observe``, the bucket found by
    bisection (the bounds are sorted and end with +Inf)."""

    __slots__ = ("_bounds", "_buckets", "_in_memory", "_sum")

    def __init__(self, child: Histogram) -> None:
        self._sum: _Value = child._sum
        self._buckets: list[_Value] = child._buckets
        self._bounds: list[float] = child._upper_bounds
        self._in_memory = _in_memory(self._sum)

    def observe(self, amount: float) -> None:
        if self._in_memory:
            self._sum._value += amount
            if amount == amount:  # NaN is in no bucket (the public loop finds none either)
                self._buckets[bisect_left(self._bounds, amount)]._value += 1.0
            return
        self._sum.inc(amount)
        if amount == amount:
            self._buckets[bisect_left(self._bounds, amount)].inc(1.0)
