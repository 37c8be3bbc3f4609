"""Proves ``placement.move_after`` (where a request goes after the engine answering it failed)
and ``after_failure``'s move branch as pure functions over their inputs:

- ``--migration-limit 0`` refuses with ``disabled``, a request moved as often as allowed with
  ``limit``, a request that cannot continue exactly with its own reason, nowhere left with
  ``no_target``;
- the order: the local engine when it did not fail this request; then the request's prefill
  targets (only where the engine's prefill servers run requests whole), never one it failed
  on, their breakers asked; then the ``--migration-url`` engines; then the local engine that
  failed here but answers again;
- every move counts on (``moves``) and remembers where it failed (``failed_on``);
- only an answering engine's own failure moves a request (a 4xx, an unreachable engine, a
  prefill's failure never do).

It does not prove the facts' gathering (the runner's ``move_facts``: tests/migration).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pytest

from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    EngineNotReady,
    EngineRejected,
    PrefillFailed,
    SidecarError,
    Stage,
)
from sidecar.protocol.context import PrefillTarget
from sidecar.request.placement import (
    Decision,
    Fate,
    MoveFacts,
    Rules,
    after_failure,
    decode_engine_failed,
    move_after,
    pair_on,
)

A, B, P = (PrefillTarget(f"10.0.0.{n}", 8000) for n in (1, 2, 9))


class Open:
    """Targets whose breakers are open for ``closed``; records what it was asked."""

    def __init__(self, *open_: PrefillTarget) -> None:
        self.open = set(open_)
        self.asked: list[tuple[tuple[PrefillTarget, ...], tuple[PrefillTarget, ...]]] = []

    def pick(self, candidates: Sequence[PrefillTarget],
             exclude: Collection[PrefillTarget] = ()) -> PrefillTarget | None:
        self.asked.append((tuple(candidates), tuple(exclude)))
        left = [t for t in candidates if t not in exclude and t not in self.open]
        return left[0] if left else None

    def all_open(self, candidates: Sequence[PrefillTarget]) -> SidecarError:
        return PrefillFailed("open")

    def prefill_rank(self, target: PrefillTarget, named: int | None) -> int | None:
        return None

    def decode_rank(self) -> int | None:
        return None


PAIR = pair_on(A, None, Open())
RULES = Rules(migration_limit=1, prefill_decodes=True)


def moved(decision: Decision) -> PrefillTarget | str | None:
    assert decision.fate in (Fate.MOVE, Fate.REFUSE)
    return decision.target if decision.fate is Fate.MOVE else f"refused: {decision.reason}"


@pytest.mark.parametrize(("rules", "facts", "where"), [
    (Rules(), MoveFacts(None, (A, B)), "refused: disabled"),
    (RULES, MoveFacts(None, (A, B), refusal="logprobs"), "refused: logprobs"),
    # The local decode engine failed: a prefill target that runs requests whole.
    (RULES, MoveFacts(None, (A, B), local_ready=False), A),
    # An engine whose prefill servers cannot: the migration engines, else nowhere.
    (Rules(migration_limit=1), MoveFacts(None, (A, B), local_ready=False), "refused: no_target"),
    (Rules(migration_limit=1, migration_pool=(P,)), MoveFacts(None, (A, B), local_ready=False),
     P),
    # The local engine that failed here but answers again (a restarted engine).
    (Rules(migration_limit=1), MoveFacts(None, (A,), local_ready=True), None),
])
def test_where_a_failed_requests_answer_goes(rules: Rules, facts: MoveFacts,
                                             where: PrefillTarget | str | None) -> None:
    assert moved(move_after(PAIR, None, facts, rules, Open())) == where


def test_the_local_engine_first_when_it_did_not_fail_the_request() -> None:
    on_a = move_after(PAIR, None, MoveFacts(None, (A, B), local_ready=False), RULES, Open())
    again = move_after(on_a, A, MoveFacts(A, (A, B), local_ready=True),
                       Rules(migration_limit=2, prefill_decodes=True), Open())
    # The local engine failed it first: B (never A again) before it.
    assert moved(again) == B and again.failed_on == (None, A) and again.moves == 2


def test_a_target_the_request_failed_on_is_never_chosen_and_breakers_are_asked() -> None:
    targets = Open(B)
    first = move_after(PAIR, None, MoveFacts(None, (A, B), local_ready=False),
                       Rules(migration_limit=3, prefill_decodes=True), targets)
    assert first.target == A
    second = move_after(first, A, MoveFacts(A, (A, B), local_ready=False),
                        Rules(migration_limit=3, prefill_decodes=True), targets)
    assert moved(second) == "refused: no_target"  # B's breaker is open, A failed
    assert targets.asked[-1] == ((A, B), (A,))


def test_a_request_moves_at_most_the_limit() -> None:
    first = move_after(PAIR, None, MoveFacts(None, (A, B), local_ready=False), RULES, Open())
    assert first.moves == 1 and first.reason == "migrated"
    second = move_after(first, A, MoveFacts(A, (A, B), local_ready=False), RULES, Open())
    assert moved(second) == "refused: limit" and second.moves == 1


@pytest.mark.parametrize(("error", "moves"), [
    (DecodeFailed("broke", stage=Stage.DECODE), True),
    (DeadlineExceeded("stalled", stage=Stage.DECODE), True),
    (DeadlineExceeded("prefill slow", stage=Stage.PREFILL), False),
    (EngineNotReady("refused", stage=Stage.DECODE), False),
    (EngineRejected("400", stage=Stage.DECODE), False),
    (PrefillFailed("500"), False),
])
def test_only_the_answering_engines_own_failure_moves(error: SidecarError,
                                                      moves: bool) -> None:
    assert decode_engine_failed(error) is moves


def test_a_decode_that_answered_429_is_not_moved() -> None:
    error = DecodeFailed("decode engine answered HTTP 429", stage=Stage.DECODE)
    error.engine_fault = False
    assert not decode_engine_failed(error)


def test_after_a_pairs_decode_failed_the_pair_moves() -> None:
    error = DecodeFailed("decode engine broke", stage=Stage.DECODE)
    following = after_failure(PAIR, error, (A, B), None, RULES, Open(), decode_sent=False,
                              moves=MoveFacts(None, (A, B), local_ready=False))
    assert following.fate is Fate.MOVE and following.target == A
    refused = after_failure(PAIR, error, (A, B), None, RULES, Open(), decode_sent=False)
    assert refused.fate is Fate.REFUSE and refused.error is error
