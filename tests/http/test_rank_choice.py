"""Proves the choice of data-parallel ranks and the router's rank header
(docs/operating/data-parallel.md), without engines:

- ``RankChoice.pick_rank``: None for one rank; the rank with the fewest legs in flight on
  that engine wins; ties go round in turn (legs that never overlap still use every rank),
  each engine (the local one, each target) with its own counts and turn; a failed rank is
  skipped for the cool-down, until it answers, and picked when every rank cools down;
  cool-down 0 skips nothing;
- ``parse_rank_header``: one ASCII decimal below the size, nothing else (400); with one rank
  only 0, which names nothing.
"""

from __future__ import annotations

import contextlib

import pytest

from sidecar.errors import InvalidRequest
from sidecar.protocol.context import PrefillTarget
from sidecar.targets.choice import LOCAL, RankChoice, parse_rank_header

A = PrefillTarget("10.0.0.1", 8000)
B = PrefillTarget("10.0.0.2", 8000)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_rank_is_no_rank() -> None:
    choice = RankChoice(cooldown_s=5)
    assert choice.pick_rank(A, 1) is None
    assert choice.pick_rank(LOCAL, 1) is None


@pytest.mark.parametrize("size", [2, 4])
def test_ties_go_round_every_rank(size: int) -> None:
    choice = RankChoice(cooldown_s=5)
    assert [choice.pick_rank(A, size) for _ in range(2 * size)] == list(range(size)) * 2


def test_fewest_in_flight_wins_per_engine() -> None:
    choice = RankChoice(cooldown_s=5)
    with contextlib.ExitStack() as stack:
        for rank in (0, 0, 1, 3):
            stack.enter_context(choice.rank_leg(A, rank))
        assert {choice.pick_rank(A, 4) for _ in range(8)} == {2}
        # Another engine's ranks are its own.
        assert [choice.pick_rank(B, 4) for _ in range(4)] == [0, 1, 2, 3]
        assert [choice.pick_rank(LOCAL, 2) for _ in range(2)] == [0, 1]
    assert choice.rank_in_flight(A, 0) == 0


def test_held_ranks_count_until_released() -> None:
    choice = RankChoice(cooldown_s=5)
    choice.hold_rank(LOCAL, 0)
    assert {choice.pick_rank(LOCAL, 2) for _ in range(4)} == {1}
    choice.release_rank(LOCAL, 0)
    assert {choice.pick_rank(LOCAL, 2) for _ in range(4)} == {0, 1}


def test_a_failed_rank_cools_down() -> None:
    clock = FakeClock()
    choice = RankChoice(cooldown_s=5, clock=clock)
    choice.rank_failed(A, 1)
    assert {choice.pick_rank(A, 2) for _ in range(6)} == {0}
    assert [choice.pick_rank(B, 2) for _ in range(2)] == [0, 1]  # only A's rank 1 failed
    choice.rank_failed(A, 0)
    assert {choice.pick_rank(A, 2) for _ in range(6)} == {0, 1}  # all cooling: one is used
    clock.now += 5
    assert {choice.pick_rank(A, 2) for _ in range(6)} == {0, 1}
    choice.rank_failed(A, 1)
    choice.rank_answered(A, 1)
    assert {choice.pick_rank(A, 2) for _ in range(6)} == {0, 1}
    never = RankChoice(cooldown_s=0)
    never.rank_failed(A, 1)
    assert {never.pick_rank(A, 2) for _ in range(6)} == {0, 1}


@pytest.mark.parametrize(("values", "size", "rank"), [
    ([], 4, None), (["0"], 4, 0), (["3"], 4, 3), (["15"], 16, 15), (["0"], 1, None),
])
def test_rank_header_accepted(values: list[str], size: int, rank: int | None) -> None:
    assert parse_rank_header(values, size) == rank


@pytest.mark.parametrize(("values", "size"), [
    (["4"], 4), (["1"], 1), (["-1"], 4), (["01"], 4), ([" 1"], 4), (["1 "], 4), (["+1"], 4),
    (["1.0"], 4), (["x"], 4), ([""], 4), (["1,2"], 4), (["1", "2"], 4), (["\uff11"], 4),
    (["99999"], 1024),
])
def test_rank_header_refused(values: list[str], size: int) -> None:
    with pytest.raises(InvalidRequest, match="x-data-parallel-rank"):
        parse_rank_header(values, size)
