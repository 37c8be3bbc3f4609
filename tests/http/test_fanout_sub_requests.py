"""Proves how the HTTP door splits a fanned-out request into sub-requests
(``sidecar.http_server.fanout._sub_requests``) and starts each where its own placement decision
puts it (``_placed``), without a server: one ``PDRequest`` per (prompt, choice) in
choice-index order, each with the request id ``<id>-<k>`` in its own ``X-Request-Id`` header
(the client's other headers kept), its own body (that prompt, ``n`` 1), the request's
candidates and no raw body (a sub-request's body is its own); each is placed once, on its own
body, and started with that decision (the picks spread over the candidates); a refusal is
raised, nothing started.

It does not prove the run and merge of the sub-requests (tests/http/test_fanout.py over
stubs, tests/core/test_fanout_merge.py), the decision's rules (tests/core/test_placement.py)
nor the body rules (tests/protocol).
"""

from __future__ import annotations

import random
from typing import Any, cast

import msgspec
import pytest
from flow_builders import TARGET_A, TARGET_B, TARGET_C, pd_request
from protocol_builders import completions_body

from sidecar.errors import EngineNotReady
from sidecar.http_server.fanout import _placed, _sub_requests
from sidecar.protocol.context import FrontDoor, PrefillTarget, Route
from sidecar.protocol.request import ClientRequest
from sidecar.request.placement import Decision, Facts, Fate, Rules, decide
from sidecar.runtime import Runtime
from sidecar.targets.choice import LegRanks, PrefillTargets, RankChoice, TargetChoice


class Placer:
    """The runtime's placer as the door uses it: one decision per sub-request."""

    def __init__(self, refuse: bool = False) -> None:
        self.targets = PrefillTargets(TargetChoice(cooldown_s=0, rng=random.Random(4)),
                                      LegRanks(RankChoice(cooldown_s=0)))
        self.refuse = refuse
        self.asked: list[tuple[Any, tuple[PrefillTarget, ...], str]] = []

    async def place(self, route: Route, body: Any, candidates: tuple[PrefillTarget, ...], *,
                    request_id: str, named_prefill_rank: int | None = None,
                    memo: Any = None) -> Decision:
        self.asked.append((body, candidates, request_id))
        if self.refuse:
            return Decision(Fate.REFUSE, "error", "down", error=EngineNotReady("down"))
        return decide(Facts(candidates), Rules(), self.targets)


class Flow:
    def __init__(self) -> None:
        self.started: list[tuple[Any, Decision]] = []

    async def run(self, request: Any, decision: Decision) -> Any:
        self.started.append((request, decision))
        return decision.target


class FakeRuntime:
    def __init__(self, refuse: bool = False) -> None:
        self.placer = Placer(refuse)
        self.runner = Flow()


def split(client: ClientRequest, base: Any) -> list[Any]:
    return _sub_requests(client, base)


async def start_all(runtime: FakeRuntime, subs: list[Any]) -> list[Any]:
    start = _placed(cast(Runtime, runtime))
    return [await start(sub) for sub in subs]


def test_each_prompt_and_choice_is_its_own_sub_request() -> None:
    body = completions_body(prompt=["first", "second"], n=2, stream=False)
    client = ClientRequest(Route.COMPLETIONS, body, stream=False, batch=["first", "second"], n=2)
    request = pd_request(body, request_id="rq-7", candidates=(TARGET_A, TARGET_B, TARGET_C))
    base = msgspec.structs.replace(
        request, headers={"X-Request-Id": "rq-7", "Authorization": "Bearer t"})
    subs = split(client, base)

    assert [sub.request_id for sub in subs] == ["rq-7-0", "rq-7-1", "rq-7-2", "rq-7-3"]
    assert [sub.headers for sub in subs] == [
        {"X-Request-Id": f"rq-7-{k}", "Authorization": "Bearer t"} for k in range(4)]
    assert [sub.body["prompt"] for sub in subs] == ["first", "first", "second", "second"]
    assert all(sub.body["n"] == 1 for sub in subs)
    for sub in subs:
        assert sub.candidates == base.candidates and sub.raw is None
        assert (sub.route, sub.stream, sub.front_door) == (Route.COMPLETIONS, False,
                                                           FrontDoor.HTTP)
    assert base.headers == {"X-Request-Id": "rq-7", "Authorization": "Bearer t"}  # untouched


async def test_each_sub_request_is_placed_on_its_own_body_and_started_so() -> None:
    body = completions_body(prompt=["first", "second"], stream=False)
    client = ClientRequest(Route.COMPLETIONS, body, stream=False, batch=["first", "second"])
    subs = split(client, pd_request(body, request_id="rq-8", candidates=(TARGET_A, TARGET_B)))
    runtime = FakeRuntime()
    await start_all(runtime, subs)
    assert [(b["prompt"], c, rid) for b, c, rid in runtime.placer.asked] == [
        ("first", (TARGET_A, TARGET_B), "rq-8-0"), ("second", (TARGET_A, TARGET_B), "rq-8-1")]
    assert [request for request, _ in runtime.runner.started] == subs
    assert all(decision.fate is Fate.PAIR for _, decision in runtime.runner.started)


async def test_the_picks_spread_over_the_candidates() -> None:
    body = completions_body(n=40)
    client = ClientRequest(Route.COMPLETIONS, body, stream=True, n=40)
    subs = split(client, pd_request(body, candidates=(TARGET_A, TARGET_B)))
    assert set(await start_all(FakeRuntime(), subs)) == {TARGET_A, TARGET_B}


async def test_a_refused_sub_request_starts_nothing() -> None:
    body = completions_body(n=2)
    client = ClientRequest(Route.COMPLETIONS, body, stream=True, n=2)
    runtime = FakeRuntime(refuse=True)
    with pytest.raises(EngineNotReady):
        await start_all(runtime, split(client, pd_request(body, candidates=(TARGET_A,))))
    assert runtime.runner.started == []
