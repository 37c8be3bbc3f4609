"""Proves the local engine's readiness is logged from the first check, not only on changes:
an engine down from start-up is logged at once with the cause (refused, an HTTP status, no
answer; at INFO, since a pod's engine loads its model while the sidecar starts), again at a
bounded rate while it stays down (a warning), and once when it comes up.

One probe for every engine (``HealthProber``): refused and an error status are down, an
answer later than its timeout is slow (not down: the engine is not ready, but its requests
are not refused as a down engine's), 200 in time is up.

Runs ``EngineHealth`` against real sockets (a refusing port, a stub engine) with a fake
clock, so the rate bound is checked without waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from sidecar.engines.health import EngineHealth, Health, HealthProber
from sidecar.http1 import EngineClient
from sidecar.tools.stubs.server import run_stub


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sidecar.engines.health"]


async def test_an_engine_down_from_the_start_is_logged_with_its_cause_at_a_bounded_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: refuses
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    clock = FakeClock()
    session = EngineClient(limit=4, keepalive_s=4, connect_timeout_s=1, read_timeout_s=1)
    try:
        health = EngineHealth(session, url, timeout_s=1, clock=clock, down_log_interval_s=30)
        assert health.known_down is False  # not checked yet: nothing is known
        await health.check()
        first = _lines(caplog)
        assert len(first) == 1 and url in first[0] and "connection refused" in first[0], first
        # An engine still loading when the sidecar starts is the normal start of a pod: INFO.
        assert caplog.records[-1].levelno == logging.INFO
        assert health.known_down is True
        for _ in range(5):  # 10 s apart: within the bound, silent
            clock.now += 10
            await health.check()
        assert len(_lines(caplog)) == 2  # one more at 30 s
        assert "still not ready" in _lines(caplog)[-1] and "30 s" in _lines(caplog)[-1]
        assert caplog.records[-1].levelno == logging.WARNING
    finally:
        sock.close()
        await session.close()


async def test_an_http_status_and_recovery_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with run_stub(engine="vllm", role="decode") as engine:
        engine.faults.add("status", status=503, path="/health", times=1)
        session = EngineClient(limit=4, keepalive_s=4, connect_timeout_s=1, read_timeout_s=1)
        try:
            health = EngineHealth(session, engine.url, timeout_s=1, clock=FakeClock())
            assert await health.check() is False
            assert await health.check() is True
        finally:
            await session.close()
    lines = _lines(caplog)
    assert len(lines) == 2, lines
    assert "HTTP 503" in lines[0] and engine.url in lines[0]
    assert "ready" in lines[1] and "not" not in lines[1]


async def test_no_answer_within_the_deadline_is_the_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with run_stub(engine="vllm", role="decode") as engine:
        engine.faults.add("hang", path="/health", times=1)
        session = EngineClient(limit=4, keepalive_s=4, connect_timeout_s=1, read_timeout_s=5)
        try:
            health = EngineHealth(session, engine.url, timeout_s=0.2, clock=FakeClock())
            assert await health.check() is False
        finally:
            await session.close()
            engine.faults.release_hangs()
            await asyncio.sleep(0)
    assert "no answer" in _lines(caplog)[0] and "0.2 s" in _lines(caplog)[0]


async def test_one_probe_tells_up_slow_and_down() -> None:
    """The one health rule of every engine (local and prefill targets): refused and an error
    status are down, an answer later than the answer timeout is slow, 200 in time is up."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: refuses
    refusing = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with run_stub(engine="vllm", role="prefill") as engine:
        session = EngineClient(limit=4, keepalive_s=4, connect_timeout_s=1, read_timeout_s=5)
        prober = HealthProber(session, timeout_s=0.2)
        try:
            assert (await prober.probe(engine.url)).health is Health.UP
            down = await prober.probe(refusing)
            assert down.health is Health.DOWN and "refused" in (down.cause or "")
            engine.faults.add("status", status=503, path="/health", times=1)
            answer = await prober.probe(engine.url)
            assert answer.health is Health.DOWN and "HTTP 503" in (answer.cause or "")
            engine.faults.add("hang", path="/health", times=1)
            slow = await prober.probe(engine.url)
            assert slow.health is Health.SLOW and "0.2 s" in (slow.cause or "")
            assert (Health.UP.healthy, Health.SLOW.healthy, Health.DOWN.healthy) == (
                True, None, False)
        finally:
            sock.close()
            await session.close()
            engine.faults.release_hangs()
            await asyncio.sleep(0)


async def test_a_slow_local_engine_is_not_ready_yet_not_known_down() -> None:
    """Slow is not down: an engine that answers its health check late is not ready (the
    pod's /ready says so), but its requests are not refused at once as a down engine's are
    (they were: no answer within the timeout counted as down)."""
    async with run_stub(engine="vllm", role="decode") as engine:
        session = EngineClient(limit=4, keepalive_s=4, connect_timeout_s=1, read_timeout_s=5)
        try:
            health = EngineHealth(session, engine.url, timeout_s=0.2, clock=FakeClock())
            engine.faults.add("hang", path="/health", times=1)
            assert await health.check() is False
            assert health.known_down is False and "no answer" in (health.cause or "")
            engine.faults.add("status", status=500, path="/health", times=1)
            assert await health.check() is False
            assert health.known_down is True  # an error status is down
            assert await health.recheck() is True  # answers again: not down
            assert health.ready and not health.known_down
        finally:
            await session.close()
            engine.faults.release_hangs()
            await asyncio.sleep(0)
