"""Proves the contract of ``sidecar.observability.prometheus_private`` against the installed
prometheus-client: counters, gauges and histograms updated through its handles expose byte for
byte what the public ``inc``/``dec``/``set``/``observe`` expose, in one process (in-memory
values) and in a worker pool's directory (memory-mapped values, read the way a pool's
``/metrics`` reads them), for amounts on, between, below and above the bucket bounds and NaN.
Does not prove exemplars (not supported) or thread safety beyond the value objects' own."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sidecar.observability.prometheus_private import CounterValue, GaugeValue, HistogramValues

BOUNDS = (0.001, 0.005, 0.1, 1.0)
AMOUNTS = (0.0, 0.0005, 0.001, 0.003, 0.005, 0.05, 0.1, 0.7, 1.0, 2.5, 1e9)


def _families(registry: CollectorRegistry) -> tuple[Counter, Gauge, Histogram]:
    return (
        Counter("c", "A counter.", ["door"], registry=registry),
        Gauge("g", "A gauge.", ["door"], registry=registry),
        Histogram("h", "A histogram.", ["door"], buckets=BOUNDS, registry=registry),
    )


def _without_created(text: bytes) -> list[bytes]:
    # ``_created`` samples carry each child's creation time, which differs between registries.
    return [line for line in text.splitlines() if b"_created{" not in line]


def test_in_process_the_handles_expose_what_the_public_methods_expose() -> None:
    public, private = CollectorRegistry(), CollectorRegistry()
    counter, gauge, histogram = _families(public)
    p_counter, p_gauge, p_histogram = _families(private)
    fast_counter = CounterValue(p_counter.labels("http"))
    fast_gauge = GaugeValue(p_gauge.labels("http"))
    fast_histogram = HistogramValues(p_histogram.labels("http"))
    for amount in AMOUNTS:
        counter.labels("http").inc()
        counter.labels("http").inc(amount)
        fast_counter.inc()
        fast_counter.inc(amount)
        histogram.labels("http").observe(amount)
        fast_histogram.observe(amount)
    gauge.labels("http").inc(3)
    gauge.labels("http").dec()
    fast_gauge.inc(3)
    fast_gauge.dec()
    exposed = _without_created(generate_latest(public))
    assert exposed == _without_created(generate_latest(private))
    assert b'h_bucket{door="http",le="0.005"} 5.0' in exposed  # on a bound counts in it
    gauge.labels("grpc").set(7)
    GaugeValue(p_gauge.labels("grpc")).set(7)
    assert _without_created(generate_latest(public)) == _without_created(
        generate_latest(private))


def test_in_process_a_value_is_a_float_behind_a_lock_the_handles_add_to() -> None:
    """What the in-process handles write: ``MutexValue._value``, a float (its lock is the
    public methods'); a histogram's sum and buckets are value objects of the same kind."""
    from prometheus_client.values import MutexValue

    counter, _, histogram = _families(CollectorRegistry())
    for value in (counter.labels("http")._value, histogram.labels("http")._sum,
                  *histogram.labels("http")._buckets):
        assert type(value) is MutexValue
        assert isinstance(value._value, float)
    handle = CounterValue(counter.labels("http"))
    handle.inc(2.5)
    assert counter.labels("http")._value.get() == 2.5


def test_nan_lands_in_no_bucket_as_with_the_public_observe() -> None:
    public, private = CollectorRegistry(), CollectorRegistry()
    histogram = _families(public)[2]
    fast = HistogramValues(_families(private)[2].labels("http"))
    histogram.labels("http").observe(math.nan)
    fast.observe(math.nan)
    exposed = _without_created(generate_latest(public))
    assert exposed == _without_created(generate_latest(private))
    assert b'h_count{door="http"} 0.0' in exposed


_POOL_WORKER = textwrap.dedent("""
    import sys
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from sidecar.observability.prometheus_private import (
        CounterValue, GaugeValue, HistogramValues)
    fast = sys.argv[1] == "fast"
    registry = CollectorRegistry()
    counter = Counter("c", "A counter.", ["door"], registry=registry).labels("http")
    gauge = Gauge("g", "A gauge.", ["door"], registry=registry,
                  multiprocess_mode="livesum").labels("http")
    histogram = Histogram("h", "A histogram.", ["door"], buckets={bounds!r},
                          registry=registry).labels("http")
    if fast:
        counter, gauge, histogram = (
            CounterValue(counter), GaugeValue(gauge), HistogramValues(histogram))
    for amount in {amounts!r}:
        counter.inc(amount)
        histogram.observe(amount)
    gauge.inc(3)
    gauge.dec()
""").format(bounds=BOUNDS, amounts=AMOUNTS)

_POOL_READER = textwrap.dedent("""
    import sys
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=sys.argv[1])
    sys.stdout.buffer.write(generate_latest(registry))
""")


def _pool_exposition(directory: Path, style: str) -> bytes:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    subprocess.run([sys.executable, "-c", _POOL_WORKER, style], env=env, check=True)
    return subprocess.run([sys.executable, "-c", _POOL_READER, str(directory)], env=env,
                          check=True, capture_output=True).stdout


def test_in_a_worker_pool_the_handles_write_what_the_public_methods_write(
        tmp_path: Path) -> None:
    (tmp_path / "public").mkdir()
    (tmp_path / "fast").mkdir()
    public = _pool_exposition(tmp_path / "public", "public")
    assert b'h_bucket{door="http",le="0.1"}' in public and b"g{" in public
    # The reader lists families in the order of its files' contents: compare lines, unordered.
    fast = _pool_exposition(tmp_path / "fast", "fast")
    assert sorted(fast.splitlines()) == sorted(public.splitlines())
