"""The load phases: one request at a time, or C workers in a closed loop for a fixed window.

    paired_serial(flows, n)         ─▶ Phase per flow (latency, first byte, CPU), in turn
    closed_loop(flow, c, seconds)   ─▶ Phase (requests/s, tokens/s, latency, CPU)

CPU is read from /proc before and after the measured window (after a warm-up that fills the
connection pools), for the sidecar, the stubs and this load generator, so a table can say
who used the two cores. Requests that complete inside the window are counted; the window's
CPU is divided by them. ``client`` picks the load generator's HTTP client
(``bench.http_clients``: ``lean``, each worker owning its connections, or ``aiohttp``).

Deliberate limits: closed loop only (each worker sends its next request when the previous
one answered), so requests/s is the system's capacity, not a latency at a fixed rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bench.flows import CallResult, Flow
from bench.http_clients import TRANSPORT_ERRORS, Http, open_clients
from bench.procs import cpu_seconds, tree_cpu_seconds


@dataclass
class Phase:
    """What one measured phase produced (seconds, counts, CPU seconds per process)."""

    requests: int = 0
    errors: int = 0
    events: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)

    def add(self, result: CallResult) -> None:
        if not result.ok:
            self.errors += 1
            return
        self.requests += 1
        self.events += result.events
        self.latencies.append(result.latency_s)
        self.first_bytes.append(result.first_byte_s)

    def summary(self, sidecar_name: str = "sidecar") -> dict[str, Any]:
        wall = self.wall_s or 1e-9
        done = self.requests or 1
        out: dict[str, Any] = {
            "requests": self.requests,
            "errors": self.errors,
            "wall_s": round(self.wall_s, 3),
            "rps": round(self.requests / wall, 1),
            "p50_ms": _ms(percentile(self.latencies, 50)),
            "p99_ms": _ms(percentile(self.latencies, 99)),
            "ttfb_p50_ms": _ms(percentile(self.first_bytes, 50)),
            "ttfb_p99_ms": _ms(percentile(self.first_bytes, 99)),
            "events": self.events,
            # SSE events minus the closing [DONE]: one per generated token for these stubs.
            "tokens_per_s": round(max(0, self.events - self.requests) / wall, 1),
            "cpu_s": {k: round(v, 4) for k, v in self.cpu_s.items()},
            "cpu_cores": {k: round(v / wall, 3) for k, v in self.cpu_s.items()},
        }
        if sidecar_name in self.cpu_s:
            cpu = self.cpu_s[sidecar_name]
            out["sidecar_cpu_us_per_req"] = round(cpu / done * 1e6, 1)
            tokens = self.events - self.requests
            if tokens > 0:
                out["sidecar_cpu_us_per_token"] = round(cpu / tokens * 1e6, 3)
        return out


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class CpuMeter:
    """CPU seconds of named processes (and of this one) between two readings; the ones
    named in ``trees`` count with their descendants (a sidecar's workers)."""

    def __init__(self, pids: Mapping[str, int], trees: frozenset[str] = frozenset()) -> None:
        self.pids = {**pids, "loadgen": os.getpid()}
        self.trees = trees
        self._start: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {
            name: tree_cpu_seconds(pid) if name in self.trees else cpu_seconds(pid)
            for name, pid in self.pids.items()
        }

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict[str, float]:
        end = self._read()
        return {name: end[name] - self._start[name] for name in self.pids}


async def safe_call(flow: Flow, http: Http) -> CallResult:
    """One call; a transport failure counts as an error, not a crash of the run."""
    try:
        return await flow.call(http)
    except TRANSPORT_ERRORS:
        return CallResult(False, 0.0, 0.0, 0)


async def paired_serial(
    flows: Mapping[str, Flow], n: int, meter: CpuMeter, *, warmup: int = 20,
    client: str = "lean",
) -> dict[str, Phase]:
    """``n`` rounds of one request per flow, in turn, each after the previous one answered.

    Interleaving request by request gives every flow the same machine state, so the
    difference of their latencies is the hop's cost even when the machine's load moves.
    The window's CPU goes to every phase; only the process a flow alone uses (the sidecar
    for the sidecar flow) gives a meaningful CPU per request.
    """
    phases = {name: Phase() for name in flows}
    async with open_clients(client, 1) as new_http:
        http = new_http()
        for _ in range(warmup):
            for flow in flows.values():
                await safe_call(flow, http)
        meter.start()
        for _ in range(n):
            for name, flow in flows.items():
                phases[name].add(await safe_call(flow, http))
        cpu = meter.stop()
    for phase in phases.values():
        # Wall time of a flow's own requests: requests/s is then one over the mean latency.
        phase.wall_s = sum(phase.latencies)
        phase.cpu_s = dict(cpu)
    return phases


async def closed_loop(
    flow: Flow,
    concurrency: int,
    seconds: float,
    meter: CpuMeter,
    *,
    warmup_s: float = 0.5,
    min_requests: int = 1,
    max_extra_s: float = 30.0,
    client: str = "lean",
) -> Phase:
    """``concurrency`` workers, each looping on requests; measured for ``seconds``.

    The window stays open past ``seconds`` (at most ``max_extra_s`` more) until
    ``min_requests`` answered, so a tiny run on a busy machine still measures something.
    """
    phase = Phase()
    recording = False
    stopping = False
    enough = asyncio.Event()

    async def worker(http: Http) -> None:
        while not stopping:
            result = await safe_call(flow, http)
            if recording:
                phase.add(result)
                if phase.requests + phase.errors >= min_requests:
                    enough.set()

    async with open_clients(client, concurrency) as new_http:
        workers = [asyncio.ensure_future(worker(new_http())) for _ in range(concurrency)]
        try:
            await asyncio.sleep(warmup_s)
            meter.start()
            started = time.perf_counter()
            recording = True
            await asyncio.sleep(seconds)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(enough.wait(), max_extra_s)
            recording = False
            phase.wall_s = time.perf_counter() - started
            phase.cpu_s = meter.stop()
            stopping = True
            await asyncio.wait_for(asyncio.gather(*workers), timeout=60)
        finally:
            for task in workers:
                task.cancel()
    return phase
