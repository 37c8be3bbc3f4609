"""Proves the choice among several prefill targets and the one retry of a refused connect:

- ``TargetChoice``: the target with the fewest legs in flight wins, ties go either way, a
  target whose connect was refused is skipped for the cool-down (and used again after it,
  once it answered, or when nothing else is left), long lists compare two random targets;
  metric labels are bounded (pool addresses, else ``header``);
- on the core with real sockets: a prefill refused at connect succeeds on another listed
  target (counted), and that target then gets no prefill within the cool-down; a prefill cut
  after its request was sent is not retried (the engine saw it once, the other none);
- through the HTTP door: a header naming a refusing target and a live one always answers;
- a blackholed target (its SYNs dropped: a listener whose accept queue is full) is
  unreachable once the connect timeout passes (502 ``prefill_failed``, not the leg's
  deadline) and moves to another target like a refused one.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from pd_builders import client_body, pd_pair
from sidecar_builders import refusing_port

from sidecar.config.settings import Settings
from sidecar.errors import PrefillFailed
from sidecar.observability.metrics import Metrics
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.request.legs import PDRequest
from sidecar.runtime import open_runtime
from sidecar.targets.choice import HEADER_LABEL, TargetChoice
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.server import run_stub

A, B, C = (PrefillTarget("10.0.0.1", 8000), PrefillTarget("10.0.0.2", 8000),
           PrefillTarget("10.0.0.3", 8000))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_fewest_in_flight_wins_and_ties_go_either_way() -> None:
    choice = TargetChoice(cooldown_s=5, rng=random.Random(1))
    with choice.leg(A), choice.leg(A), choice.leg(B):
        assert {choice.pick([A, B, C]) for _ in range(20)} == {C}
        with choice.leg(C), choice.leg(C):
            assert {choice.pick([A, B, C]) for _ in range(20)} == {B}
    assert choice.in_flight(A) == 0
    assert {choice.pick([A, B]) for _ in range(50)} == {A, B}
    assert choice.pick([A, B], exclude=[A]) == B
    assert choice.pick([A], exclude=[A]) is None


def test_a_refusing_target_cools_down() -> None:
    clock = FakeClock()
    choice = TargetChoice(cooldown_s=5, clock=clock, rng=random.Random(2))
    choice.refused(A)
    assert {choice.pick([A, B]) for _ in range(50)} == {B}
    assert choice.pick([A]) == A  # nothing else left: a refusal alone never fails a request
    clock.now += 5
    assert {choice.pick([A, B]) for _ in range(50)} == {A, B}
    choice.refused(A)
    choice.answered(A)  # picked when nothing else was left, and it answered
    assert {choice.pick([A, B]) for _ in range(50)} == {A, B}
    never = TargetChoice(cooldown_s=0, rng=random.Random(3))
    never.refused(A)
    assert {never.pick([A, B]) for _ in range(50)} == {A, B}


def test_long_lists_compare_two_and_skip_the_busiest() -> None:
    targets = [PrefillTarget(f"10.0.1.{i}", 8000) for i in range(8)]
    choice = TargetChoice(cooldown_s=5, rng=random.Random(4))
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(choice.leg(targets[0]))
        picks = [choice.pick(targets) for _ in range(200)]
    # Two random candidates: the busiest one can only win against itself, never here.
    assert targets[0] not in picks
    assert len(set(picks)) == 7


def test_labels_are_bounded() -> None:
    choice = TargetChoice(cooldown_s=5, pool=[A])
    assert choice.label(A) == str(A)
    assert choice.label(B) == HEADER_LABEL



@contextlib.contextmanager
def blackholed_port() -> Iterator[int]:
    """A loopback port that drops SYNs: it listens with a backlog of 0 and one connection
    fills its accept queue, so further connects never complete (a blackholed target)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        yield listener.getsockname()[1]
    finally:
        filler.close()
        listener.close()


def _request(target: PrefillTarget, *candidates: PrefillTarget) -> PDRequest:
    return PDRequest(route=Route.COMPLETIONS, body=client_body(), stream=False, target=target,
                     request_id="rq", headers={"X-Request-Id": "rq"},
                     candidates=tuple(candidates))


def _prefills(stub: Any) -> int:
    return len([r for r in stub.recorder.requests if r.path == "/v1/completions"])


async def test_a_refused_prefill_moves_to_another_target_which_then_takes_them_all() -> None:
    with refusing_port() as dead_port:
        async with (
            run_stub(engine="vllm", role="prefill") as live_stub,
            run_stub(engine="vllm", role="decode") as decode,
        ):
            dead = PrefillTarget("127.0.0.1", dead_port)
            live = PrefillTarget("127.0.0.1", live_stub.port)
            settings = Settings(engine="vllm", engine_url=decode.url, grpc_enabled=False,
                                prefill_allowlist=(f"127.0.0.1:{dead_port}",
                                                   f"127.0.0.1:{live_stub.port}"),
                                prefill_cooldown_s=600)
            metrics = Metrics()
            async with open_runtime(settings, metrics) as runtime:
                exchange = await runtime.runner.run(_request(dead, dead, live))
                try:
                    assert b"choices" in await exchange.read_all(1 << 20)
                finally:
                    await exchange.aclose()
                assert _prefills(live_stub) == 1
                legs = metrics.prefill_legs
                assert legs.labels(HEADER_LABEL, "connect_refused")._value.get() == 1
                assert legs.labels(HEADER_LABEL, "ok")._value.get() == 1
                assert metrics.prefill_retries.labels("http")._value.get() == 1
                # Within the cool-down the refusing target is never chosen again.
                header = [f"127.0.0.1:{dead_port},127.0.0.1:{live_stub.port}"]
                candidates = await runtime.selector.candidates(header)
                assert {runtime.runner.targets.pick(candidates) for _ in range(30)} == {live}


async def test_a_prefill_cut_after_it_was_sent_is_not_retried() -> None:
    async with (
        run_stub(engine="vllm", role="prefill",
                 faults=(Fault(kind=FaultKind.DROP, path="/v1/completions"),)) as cut,
        run_stub(engine="vllm", role="prefill") as other,
        run_stub(engine="vllm", role="decode") as decode,
    ):
        first = PrefillTarget("127.0.0.1", cut.port)
        second = PrefillTarget("127.0.0.1", other.port)
        settings = Settings(engine="vllm", engine_url=decode.url, grpc_enabled=False,
                            prefill_allowlist=("127.0.0.1:*",))
        metrics = Metrics()
        async with open_runtime(settings, metrics) as runtime:
            with pytest.raises(PrefillFailed):
                await runtime.runner.run(_request(first, first, second))
        assert _prefills(cut) == 1
        assert _prefills(other) == 0
        assert metrics.prefill_retries.labels("http")._value.get() == 0


async def test_a_header_with_a_refusing_target_always_answers() -> None:
    with refusing_port() as dead_port:
        async with pd_pair("vllm", "shfs", prefill_cooldown_s=600,
                           prefill_allowlist=("127.0.0.1:*",)) as pair:
            header = {"x-prefiller-host-port": f"127.0.0.1:{dead_port},{pair.target}"}
            for _ in range(6):
                status, _, text = await pair.send(headers=header)
                assert status == 200, text
            assert _prefills(pair.prefill) == 6
            refused = await pair.sidecar.metric("disagg_prefill_legs_total",
                                                outcome="connect_refused")
            assert refused <= 1
            assert await pair.sidecar.metric("disagg_prefill_retries_total") == refused


async def test_a_blackholed_prefill_moves_to_another_target_like_a_refused_one() -> None:
    with blackholed_port() as dead_port:
        async with (
            run_stub(engine="vllm", role="prefill") as live_stub,
            run_stub(engine="vllm", role="decode") as decode,
        ):
            dead = PrefillTarget("127.0.0.1", dead_port)
            live = PrefillTarget("127.0.0.1", live_stub.port)
            settings = Settings(engine="vllm", engine_url=decode.url, grpc_enabled=False,
                                prefill_allowlist=("127.0.0.1:*",), connect_timeout_s=0.3,
                                prefill_timeout_s=30)
            metrics = Metrics()
            async with open_runtime(settings, metrics) as runtime:
                exchange = await runtime.runner.run(_request(dead, dead, live))
                try:
                    assert b"choices" in await exchange.read_all(1 << 20)
                finally:
                    await exchange.aclose()
            assert _prefills(live_stub) == 1
            assert metrics.prefill_retries.labels("http")._value.get() == 1
            legs = metrics.prefill_legs
            assert legs.labels(HEADER_LABEL, "connect_refused")._value.get() == 1


async def test_a_blackholed_lone_target_is_unreachable_not_a_deadline() -> None:
    with blackholed_port() as dead_port:
        async with pd_pair("vllm", "shfs", prefill_allowlist=("127.0.0.1:*",),
                           connect_timeout_s=0.3, prefill_timeout_s=30) as pair:
            status, _, text = await pair.send(
                headers={"x-prefiller-host-port": f"127.0.0.1:{dead_port}"})
    error = json.loads(text)["error"]
    assert status == 502 and error["code"] == "prefill_failed", text
    assert "unreachable" in error["message"] and "0.3 s" in error["message"], error
