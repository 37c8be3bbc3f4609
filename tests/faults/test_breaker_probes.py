"""Proves what the probes of open circuit breakers tell and how long the sidecar remembers a
target (issue 34 items 2 and 3):

- slow is not down: a probe answered later than its timeout says nothing to an open
  breaker, so an overloaded engine whose health answers come late keeps its cool-down (a
  slow answer counted as down, and the next quick one ended the cool-down: an overloaded
  engine got 4 trial legs in 3 s);
- a freshly opened breaker always gets a probe: past 64 probed targets, the one a request
  named longest ago yields (after 64 dead targets no new open breaker was probed);
- a target no request named for the longest cool-down (8 x ``--prefill-breaker-open-s``) is
  forgotten: its breaker, its probe and its gauge value go (a deleted pod's breaker stayed
  open, probed for ever, and ``disagg_prefill_breaker_state`` kept reporting it);
- with the Kubernetes watch, a pod that leaves the pool is forgotten at once;
- past 4,096 tracked targets the least recently named is forgotten, whatever its state (a
  new target went untracked once 4,096 breakers were open).

Timing: the unit cases run on a fake clock; the sidecar cases wait for the stub to record the
probes they need, or for the probe task to end (no sleeps).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from fault_builders import (
    COMPLETIONS,
    A,
    B,
    Clock,
    breakers_of,
    client_body,
    fail,
    faults,
    sidecar_settings_for,
    started_stub,
    stub_config,
)
from sidecar_builders import refusing_port, running_sidecar

from sidecar.engines.health import MAX_PROBES, BreakerProbes
from sidecar.http1 import EngineClient
from sidecar.protocol.context import PrefillTarget
from sidecar.targets.breaker import MAX_BACKOFF, BreakerState

# -- slow is not down ----------------------------------------------------------------------


def test_a_slow_answer_is_no_news_to_an_open_breaker() -> None:
    clock = Clock()
    breakers = breakers_of(clock)
    fail(breakers, A)  # its legs failed: it accepts connections
    breakers.probed(A, None)  # slow
    breakers.probed(A, True)  # then quick: health that never failed ends nothing
    assert breakers.state(A) is BreakerState.OPEN and breakers.admit(A) is None
    breakers.probed(A, False)  # down (refused, an error status)
    breakers.probed(A, None)
    breakers.probed(A, True)
    assert breakers.state(A) is BreakerState.HALF_OPEN


async def test_an_overloaded_target_whose_health_answers_late_keeps_its_cool_down() -> None:
    async with (
        started_stub(stub_config("vllm", "prefill", "shfs", faults=faults(
            {"kind": "status", "status": 500, "path": COMPLETIONS},
            {"kind": "hang", "path": "/health", "times": 1}))) as busy,
        started_stub(stub_config("vllm", "decode", "shfs")) as decode,
    ):
        settings = sidecar_settings_for("vllm", "shfs", busy, decode, connect_timeout_s=0.3,
                                        prefill_breaker_failures=1, prefill_breaker_open_s=120.0)
        header = {"x-prefiller-host-port": f"127.0.0.1:{busy.port}"}
        try:
            async with (running_sidecar(**settings) as sidecar,
                        aiohttp.ClientSession() as client):
                async with client.post(sidecar.url + COMPLETIONS, json=client_body(),
                                       headers=header) as response:
                    assert response.status == 502  # its leg failed: the breaker opens
                assert await sidecar.metric("disagg_prefill_breaker_state",
                                            target="header") == BreakerState.OPEN
                # The first probe hangs past the 0.3 s timeout (slow), the second answers
                # at once; the third is asked only once the second's answer was heard.
                for _ in range(3):
                    await busy.recorder.next_request("/health", timeout_s=10)
                assert await sidecar.metric("disagg_prefill_breaker_state",
                                            target="header") == BreakerState.OPEN
                async with client.post(sidecar.url + COMPLETIONS, json=client_body(),
                                       headers=header) as response:
                    assert response.status == 502  # refused by the breaker: no trial leg
                assert len(busy.recorder.on_path(COMPLETIONS)) == 1
        finally:
            busy.faults.release_hangs()


# -- a fresh open breaker is probed --------------------------------------------------------


async def test_a_breaker_opening_past_64_probed_targets_is_probed() -> None:
    clock = Clock()
    session = EngineClient(limit=4, keepalive_s=4, connect_timeout_s=1, read_timeout_s=1)
    # Probes far apart: none runs during the test (the tasks are what is counted).
    probes = BreakerProbes(session, timeout_s=1.0, interval_s=3600.0)
    breakers = breakers_of(clock, on_change=lambda target, _, new, __: probes.changed(
        target, new))
    probes.breakers = breakers
    try:
        dead = [PrefillTarget(f"10.1.0.{n}", 8000) for n in range(MAX_PROBES)]
        for target in dead:
            fail(breakers, target)
            clock.now += 1
        assert probes.probing == frozenset(dead)
        breakers.allows(dead[0])  # a request still names the first dead one
        live = PrefillTarget("10.2.0.1", 8000)
        fail(breakers, live)
        assert live in probes.probing and len(probes.probing) == MAX_PROBES
        assert dead[1] not in probes.probing  # named longest ago: it yields
        assert dead[0] in probes.probing
    finally:
        await probes.close()
        await session.close()


# -- forgetting ------------------------------------------------------------------------------


def test_a_target_no_request_named_for_the_longest_cool_down_is_forgotten() -> None:
    clock = Clock()
    breakers = breakers_of(clock, open_s=10.0)
    fail(breakers, A)  # open
    clock.now += MAX_BACKOFF * 10.0 - 1
    breakers.allows(A)  # still named: kept
    clock.now += MAX_BACKOFF * 10.0 - 1
    fail(breakers, B)  # tracking another target forgets the quiet ones
    assert A in breakers.states()
    clock.now += 2
    fail(breakers, PrefillTarget("10.0.0.3", 8000))
    assert A not in breakers.states() and breakers.state(A) is BreakerState.CLOSED


def test_past_4096_targets_the_least_recently_named_is_forgotten() -> None:
    clock = Clock()
    breakers = breakers_of(clock)
    first = PrefillTarget("10.3.0.0", 8000)
    fail(breakers, first)
    for n in range(1, 4096):
        fail(breakers, PrefillTarget(f"10.3.{n >> 8}.{n & 255}", 8000))
    assert len(breakers.states()) == 4096  # every one open
    newest = PrefillTarget("10.4.0.1", 8000)
    fail(breakers, newest)
    assert breakers.state(newest) is BreakerState.OPEN  # tracked (it was not)
    assert first not in breakers.states() and len(breakers.states()) == 4096


async def test_a_gone_target_is_forgotten_with_its_probe_and_gauge() -> None:
    with refusing_port() as gone:
        async with (
            started_stub(stub_config("vllm", "prefill", "shfs")) as prefill,
            started_stub(stub_config("vllm", "decode", "shfs")) as decode,
        ):
            # 8 x 0.05 s: forgotten 0.4 s after the last request named it.
            settings = sidecar_settings_for(
                "vllm", "shfs", prefill, decode, prefill_breaker_failures=1,
                prefill_breaker_open_s=0.05,
                prefill_allowlist=(f"127.0.0.1:{gone}", f"127.0.0.1:{prefill.port}"))
            async with (running_sidecar(**settings) as sidecar,
                        aiohttp.ClientSession() as client):
                async with client.post(sidecar.url + COMPLETIONS, json=client_body(),
                                       headers={"x-prefiller-host-port":
                                                f"127.0.0.1:{gone}"}) as response:
                    assert response.status == 502
                assert await sidecar.metric("disagg_prefill_breaker_state",
                                            target="header") == BreakerState.OPEN
                [probe] = _probes()
                async with asyncio.timeout(10):  # it runs until its target is forgotten
                    await asyncio.wait({probe})
                assert await sidecar.metric("disagg_prefill_breaker_state",
                                            target="header") == BreakerState.CLOSED


def _probes() -> list[asyncio.Task[Any]]:
    return [task for task in asyncio.all_tasks()
            if "BreakerProbes._probe" in repr(task.get_coro()) and not task.done()]


def _pod(port: int) -> dict[str, Any]:
    return {"metadata": {"name": "prefill-0", "uid": "uid-0",
                         "labels": {"model.aibrix.ai/port": str(port)}},
            "status": {"phase": "Running", "podIP": "127.0.0.1"}}


class OnePodSource:
    """Stands in for ``KubernetesPodSource`` (same constructor): one pod, a quiet watch."""

    port = 0

    def __init__(self, namespace: str, selector: str) -> None:
        pass

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def list(self) -> tuple[list[dict[str, Any]], str]:
        return [_pod(self.port)], "1"

    async def watch(self, resource_version: str) -> Any:
        await asyncio.Event().wait()  # quiet until cancelled
        yield  # pragma: no cover (an async generator)


async def test_a_pod_that_left_the_pool_is_forgotten_at_once(monkeypatch: Any) -> None:
    import sidecar.targets.kubernetes as k8s
    from sidecar.config.settings import Settings
    from sidecar.runtime import open_runtime
    from sidecar.targets.kubernetes import PodAllowlist

    with refusing_port() as gone:
        async with started_stub(stub_config("vllm", "decode", "shfs")) as decode:
            monkeypatch.setattr(OnePodSource, "port", gone)
            monkeypatch.setattr(k8s, "KubernetesPodSource", OnePodSource)
            settings = Settings(engine="vllm", engine_url=decode.url, grpc_enabled=False,
                                prefill_pod_selector="role=prefill", prefill_pod_namespace="llm",
                                prefill_breaker_failures=1)
            async with open_runtime(settings) as runtime:
                target = PrefillTarget("127.0.0.1", gone)
                choice = runtime.calls.choice
                assert choice.breakers is not None
                with choice.leg(target) as verdict:
                    verdict.failed("connection refused", down=True)
                assert choice.breakers.state(target) is BreakerState.OPEN
                [probe] = _probes()
                pods = runtime.selector._allowlist
                assert isinstance(pods, PodAllowlist)
                pods.apply("DELETED", _pod(gone))
                assert target not in choice.breakers.states()
                assert runtime.metrics.prefill_breaker_state.labels(
                    "header")._value.get() == BreakerState.CLOSED
                await asyncio.wait({probe})  # cancelled: it ends at once
                assert probe.cancelled() and not _probes()
