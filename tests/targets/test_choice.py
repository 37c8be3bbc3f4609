"""Proves the rules of ``TargetChoice`` (sidecar/targets/choice.py) that
tests/http/test_target_choice.py does not already cover (that module covers the fewest-in-flight
pick, ties going either way, the cool-down, long lists never picking the busiest, and the
pool/header labels):

- ties are drawn from the choice's own random source: the same seed, the same picks;
- up to four candidates are all compared (the least loaded always wins); past four, two
  random ones are (the least loaded no longer always wins), among the warm ones only;
- the cool-down lasts exactly its length on the clock, a second refusal restarts it, and a
  target whose cool-down ran out is forgotten; every candidate cooling: one is still picked;
  the exclusions apply before the cool-down;
- the in-flight count survives a failing leg (the block's exception) and is forgotten at 0;
- resolved pool members are labelled by their address; a router-named target is never.

It does not prove the engine calls that drive the choice (tests/core, tests/http).
"""

from __future__ import annotations

import contextlib
import random

import pytest

from sidecar.protocol.context import PrefillTarget
from sidecar.targets.choice import HEADER_LABEL, TargetChoice

TARGETS = [PrefillTarget(f"10.0.2.{i}", 8000) for i in range(8)]
A, B, C, D, E = TARGETS[:5]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ties_follow_the_seeded_random_source() -> None:
    def picks(seed: int) -> list[PrefillTarget | None]:
        choice = TargetChoice(cooldown_s=0, rng=random.Random(seed))
        return [choice.pick(TARGETS[:3]) for _ in range(30)]

    assert picks(11) == picks(11)
    assert picks(11) != picks(12)
    assert set(picks(11)) == set(TARGETS[:3])


def test_up_to_four_candidates_the_least_loaded_always_wins() -> None:
    choice = TargetChoice(cooldown_s=0, rng=random.Random(5))
    with contextlib.ExitStack() as legs:
        for target in (A, B, C):
            legs.enter_context(choice.leg(target))
        assert {choice.pick([A, B, C, D]) for _ in range(100)} == {D}


def test_past_four_two_random_candidates_are_compared() -> None:
    choice = TargetChoice(cooldown_s=0, rng=random.Random(5))
    with contextlib.ExitStack() as legs:
        for target in (A, B, C, D):
            legs.enter_context(choice.leg(target))
        picks = [choice.pick([A, B, C, D, E]) for _ in range(200)]
    # E (idle) wins whenever it is one of the two; otherwise one of the loaded ones does.
    assert E in picks
    assert set(picks) - {E}
    assert 0.25 < picks.count(E) / len(picks) < 0.55  # two of five: 40% expected


def test_the_two_compared_are_drawn_from_the_warm_candidates() -> None:
    clock = Clock()
    choice = TargetChoice(cooldown_s=10, clock=clock, rng=random.Random(9))
    for target in TARGETS[:6]:
        choice.refused(target)
    # Two warm of eight: more than four candidates, but only the warm ones are drawn.
    assert {choice.pick(TARGETS) for _ in range(100)} == set(TARGETS[6:])


def test_the_cool_down_lasts_exactly_its_length_and_restarts() -> None:
    clock = Clock()
    choice = TargetChoice(cooldown_s=10, clock=clock, rng=random.Random(1))
    choice.refused(A)
    clock.now += 9.999
    assert choice.cooling(A)
    choice.refused(A)  # refused again: a new cool-down from now
    clock.now += 9.999
    assert choice.cooling(A)
    clock.now += 0.001
    assert not choice.cooling(A)
    assert len(choice._cooling) == 0  # forgotten once over


def test_every_candidate_cooling_still_picks_one_and_exclusions_come_first() -> None:
    clock = Clock()
    choice = TargetChoice(cooldown_s=10, clock=clock, rng=random.Random(2))
    choice.refused(A)
    choice.refused(B)
    assert {choice.pick([A, B]) for _ in range(50)} == {A, B}
    assert choice.pick([A, B], exclude=[A]) == B  # cooling, but the only one left
    assert choice.pick([A, B, C], exclude=[C]) in {A, B}
    assert choice.pick([], exclude=[]) is None


def test_in_flight_counts_survive_a_failing_leg() -> None:
    choice = TargetChoice(cooldown_s=0)
    with pytest.raises(RuntimeError), choice.leg(A), choice.leg(A):
        assert choice.in_flight(A) == 2
        raise RuntimeError("the leg failed")
    assert choice.in_flight(A) == 0
    assert A not in choice._in_flight  # forgotten at 0


def test_resolved_pool_members_are_labelled_by_their_address() -> None:
    named = PrefillTarget("10.0.3.1", 8000, "https", tls_name="prefill.example")
    choice = TargetChoice(cooldown_s=0, pool=[named])
    assert choice.label(named) == "10.0.3.1:8000"
    resolved = PrefillTarget("10.0.3.2", 8000)
    assert choice.label(resolved) == HEADER_LABEL
    choice.add_pool_member(resolved)
    assert choice.label(resolved) == "10.0.3.2:8000"
    choice.add_pool_member(resolved)
    assert choice.label(PrefillTarget("10.0.3.2", 8001)) == HEADER_LABEL
    ipv6 = PrefillTarget("fd00::1", 8000)
    choice.add_pool_member(ipv6)
    assert choice.label(ipv6) == "[fd00::1]:8000"
