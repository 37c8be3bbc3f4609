"""Proves how the HTTP door splits a fanned-out request into sub-requests
(``sidecar.http_server.fanout._sub_requests``), without a server: one ``PDRequest`` per
(prompt, choice) in choice-index order, each with the request id ``<id>-<k>`` in its own
``X-Request-Id`` header (the client's other headers kept), its own body (that prompt, ``n``
1) and its own target choice among the request's candidates (one pick each; the request's
target when it has no candidates); the rest of the request carried over.

It does not prove the run and merge of the sub-requests (tests/http/test_fanout.py over
stubs, tests/core/test_fanout_merge.py) nor the body rules (tests/protocol).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

from flow_builders import TARGET_A, TARGET_B, TARGET_C, pd_request
from protocol_builders import completions_body

from sidecar.http_server.fanout import _sub_requests
from sidecar.protocol.context import FrontDoor, PrefillTarget, Route
from sidecar.protocol.request import ClientRequest
from sidecar.runtime import Runtime
from sidecar.targets.choice import TargetChoice


class Selector:
    """The runtime's selector as the door uses it: one ``choose`` per sub-request."""

    def __init__(self) -> None:
        self.choice = TargetChoice(cooldown_s=0, rng=random.Random(4))
        self.asked: list[tuple[PrefillTarget, ...]] = []

    def choose(self, candidates: Sequence[PrefillTarget]) -> PrefillTarget:
        self.asked.append(tuple(candidates))
        picked = self.choice.pick(candidates)
        assert picked is not None
        return picked


class FakeRuntime:
    def __init__(self) -> None:
        self.selector = Selector()


def split(client: ClientRequest, base: Any, runtime: FakeRuntime) -> list[Any]:
    return _sub_requests(cast(Runtime, runtime), client, base)


def test_each_prompt_and_choice_is_its_own_sub_request() -> None:
    body = completions_body(prompt=["first", "second"], n=2, stream=False)
    client = ClientRequest(Route.COMPLETIONS, body, stream=False, batch=["first", "second"], n=2)
    base = replace(pd_request(body, request_id="rq-7", candidates=(TARGET_A, TARGET_B, TARGET_C)),
                   headers={"X-Request-Id": "rq-7", "Authorization": "Bearer t"})
    runtime = FakeRuntime()

    subs = split(client, base, runtime)

    assert [sub.request_id for sub in subs] == ["rq-7-0", "rq-7-1", "rq-7-2", "rq-7-3"]
    assert [sub.headers for sub in subs] == [
        {"X-Request-Id": f"rq-7-{k}", "Authorization": "Bearer t"} for k in range(4)]
    assert [sub.body["prompt"] for sub in subs] == ["first", "first", "second", "second"]
    assert all(sub.body["n"] == 1 for sub in subs)
    assert runtime.selector.asked == [(TARGET_A, TARGET_B, TARGET_C)] * 4
    assert {sub.target for sub in subs} <= {TARGET_A, TARGET_B, TARGET_C}
    for sub in subs:
        assert sub.candidates == base.candidates
        assert (sub.route, sub.stream, sub.front_door) == (Route.COMPLETIONS, False,
                                                           FrontDoor.HTTP)
    assert base.headers == {"X-Request-Id": "rq-7", "Authorization": "Bearer t"}  # untouched


def test_the_picks_spread_over_the_candidates() -> None:
    body = completions_body(n=40)
    client = ClientRequest(Route.COMPLETIONS, body, stream=True, n=40)
    subs = split(client, pd_request(body, candidates=(TARGET_A, TARGET_B)), FakeRuntime())
    assert {sub.target for sub in subs} == {TARGET_A, TARGET_B}


def test_without_candidates_every_sub_request_keeps_the_target() -> None:
    body = completions_body(n=3)
    client = ClientRequest(Route.COMPLETIONS, body, stream=True, n=3)
    runtime = FakeRuntime()
    subs = split(client, pd_request(body, target=TARGET_C), runtime)
    assert [sub.target for sub in subs] == [TARGET_C] * 3
    assert runtime.selector.asked == []
