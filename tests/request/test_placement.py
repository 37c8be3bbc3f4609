"""Proves the placement decision (sidecar/request/placement.py) as pure functions over their
inputs, and the placer (sidecar/request/placement.py) that gathers those inputs:

- every outcome is reachable: passthrough, unserved_route (404), local_route, local_state,
  engine_not_ready (503), local_short, local_cached, a pair on (target, prefill rank, decode
  rank), fallback with reason breaker_open, prefill_failed (every breaker open);
- the rules' order: state before the engine's readiness before the length rule before the
  cache rule before any target; a rule whose input is unknown never runs a request locally;
  each limit is inclusive and 0 turns it off;
- the prefill targets (their breakers, their ranks) are never asked for a local outcome: the
  ``Targets`` given to those cases fails the test if it is called at all;
- after a failed leg: a prefill that did no work moves once to another candidate (never the
  failed one; none with one candidate, when every other breaker is open, or on a second
  failure); a prefill failure falls back to the local engine under the local policy when no
  decode was sent (its decode rank kept), else the error is the answer; a decode's failure
  is never covered;
- the placer gathers only what the decision reads: no tokenize call and no cache look-up for
  a request its state decides, nor when no rule needs the prompt; the cache rule asks the
  index with the prompt's ids (from the tokenizer for text) and records what it found; an
  index that cannot answer leaves the length rule in charge.

It does not prove the HTTP door's use of the decision (tests/http/test_placement_door.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pytest

from sidecar.dialects.base import RouteSupport, TokenizeEndpoint
from sidecar.engines.tokenizer import PromptMeasure
from sidecar.errors import (
    DecodeFailed,
    EngineNotReady,
    InvalidHandoff,
    PrefillFailed,
    PrefillMismatch,
    PrefillUnreachable,
    RouteNotServed,
    SidecarError,
)
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.request.placement import (
    BREAKER_OPEN,
    Decision,
    Facts,
    Fate,
    Placer,
    PromptFacts,
    Rules,
    after_failure,
    decide,
    pair_on,
    route_fate,
)

A, B, C = (PrefillTarget(f"10.0.0.{n}", 8000) for n in (1, 2, 3))


class Untouchable:
    """Targets that must not be asked: a local outcome never consults a breaker."""

    def pick(self, candidates: Sequence[PrefillTarget],
             exclude: Collection[PrefillTarget] = ()) -> PrefillTarget | None:
        raise AssertionError("the targets were consulted for a local decision")

    def all_open(self, candidates: Sequence[PrefillTarget]) -> SidecarError:
        raise AssertionError("the targets were consulted for a local decision")

    def prefill_rank(self, target: PrefillTarget, named: int | None) -> int | None:
        raise AssertionError("the targets were consulted for a local decision")

    def decode_rank(self) -> int | None:
        raise AssertionError("the targets were consulted for a local decision")


class Breakers:
    """Targets whose breakers are open for ``open_``; ranks 0..n-1 round in turn."""

    def __init__(self, *open_: PrefillTarget, ranks: int = 1) -> None:
        self.open = set(open_)
        self.ranks = ranks
        self.turn = 0
        self.asked = 0

    def pick(self, candidates: Sequence[PrefillTarget],
             exclude: Collection[PrefillTarget] = ()) -> PrefillTarget | None:
        self.asked += 1
        left = [t for t in candidates if t not in exclude and t not in self.open]
        return left[0] if left else None

    def all_open(self, candidates: Sequence[PrefillTarget]) -> SidecarError:
        return PrefillFailed("circuit breaker open for every prefill target")

    def admissible(self, candidates: Sequence[PrefillTarget]) -> Sequence[PrefillTarget]:
        return [t for t in candidates if t not in self.open]

    def unpaired(self, why: Mapping[PrefillTarget, str]) -> SidecarError:
        return PrefillMismatch("; ".join(why.values()))

    def _rank(self) -> int | None:
        if self.ranks <= 1:
            return None
        self.turn += 1
        return (self.turn - 1) % self.ranks

    def prefill_rank(self, target: PrefillTarget, named: int | None) -> int | None:
        return named if named is not None else self._rank()

    def decode_rank(self) -> int | None:
        return self._rank()


def facts(**overrides: Any) -> Facts:
    return Facts(**{"candidates": (A, B), **overrides})


# -- before the body ---------------------------------------------------------------------


def test_the_route_alone_decides_passthrough_refusal_and_local_route() -> None:
    passthrough = route_fate(Route.CHAT, RouteSupport.PD, False, "vllm")
    assert passthrough is not None and passthrough.fate is Fate.PASSTHROUGH
    assert passthrough.outcome == "passthrough"
    unserved = route_fate(Route.GENERATE, RouteSupport.UNSERVED, True, "sglang")
    assert unserved is not None and unserved.fate is Fate.REFUSE
    assert unserved.outcome == "unserved_route" and isinstance(unserved.error, RouteNotServed)
    assert "sglang" in unserved.error.message and "/inference/v1/generate" in unserved.error.message
    local = route_fate(Route.RESPONSES, RouteSupport.LOCAL, True, "trtllm")
    assert local is not None and local.fate is Fate.LOCAL and local.outcome == "local_route"
    assert route_fate(Route.CHAT, RouteSupport.PD, True, "vllm") is None
    # Without a target even an unserved route is the engine's to answer.
    assert route_fate(Route.GENERATE, RouteSupport.UNSERVED, False, "sglang") == passthrough


# -- the request's facts -----------------------------------------------------------------


@pytest.mark.parametrize(("given", "rules", "outcome"), [
    (facts(state="previous_response_id"), Rules(), "local_state"),
    (facts(state="previous_response_id", engine_down="refused"), Rules(), "local_state"),
    (facts(prompt=PromptFacts(8)), Rules(max_tokens=8), "local_short"),
    (facts(prompt=PromptFacts(300, 256)), Rules(max_uncached=44), "local_cached"),
    # A prompt no longer than the uncached limit is short, whether the index can tell what
    # it holds or not: the same decision in both states, counted as short.
    (facts(prompt=PromptFacts(8, 0)), Rules(max_uncached=8), "local_short"),
    (facts(prompt=PromptFacts(8, None)), Rules(max_uncached=8), "local_short"),
    (facts(prompt=PromptFacts(8, 0)), Rules(max_tokens=8, max_uncached=8), "local_short"),
], ids=["state", "state-before-engine", "short", "cached", "short-index-known",
        "short-index-unknown", "short-first"])
def test_local_outcomes_never_consult_the_targets(given: Facts, rules: Rules,
                                                   outcome: str) -> None:
    decision = decide(given, rules, Untouchable())
    assert decision.fate is Fate.LOCAL and decision.outcome == outcome, decision
    assert decision.target is None and decision.error is None


def test_a_known_down_engine_refuses_before_any_target() -> None:
    decision = decide(facts(engine_down="connection refused"), Rules(max_tokens=8),
                      Untouchable())
    assert decision.fate is Fate.REFUSE and isinstance(decision.error, EngineNotReady)
    assert "connection refused" in decision.error.message


@pytest.mark.parametrize(("prompt", "rules"), [
    (PromptFacts(9), Rules(max_tokens=8)),  # one token over
    (PromptFacts(8), Rules()),  # the rule is off
    (PromptFacts(None), Rules(max_tokens=8)),  # length unknown
    (PromptFacts(300, 255), Rules(max_uncached=44)),  # one uncached token over
    (PromptFacts(3000, None), Rules(max_uncached=1000)),  # the index cannot answer
    (PromptFacts(None, 256), Rules(max_uncached=1000)),  # length unknown
    (PromptFacts(300, 300), Rules(max_tokens=8)),  # cached, but that rule is off
], ids=["over", "off", "unknown", "uncached-over", "cache-unknown", "length-unknown",
        "cache-rule-off"])
def test_otherwise_a_pair_on_a_target_with_ranks(prompt: PromptFacts, rules: Rules) -> None:
    targets = Breakers(A, ranks=2)
    decision = decide(facts(prompt=prompt, named_prefill_rank=1), rules, targets)
    assert decision.fate is Fate.PAIR and decision.outcome == "ok"
    assert (decision.target, decision.prefill_rank, decision.decode_rank) == (B, 1, 0)
    assert decision.cached_tokens == prompt.cached


def test_every_breaker_open_falls_back_under_the_local_policy_else_refuses() -> None:
    targets = Breakers(A, B)
    fallback = decide(facts(), Rules(local_fallback=True), targets)
    assert fallback.fate is Fate.LOCAL and fallback.outcome == "fallback"
    assert fallback.fallback_reason == BREAKER_OPEN
    refused = decide(facts(), Rules(), targets)
    assert refused.fate is Fate.REFUSE and refused.outcome == "error"
    assert isinstance(refused.error, PrefillFailed)


def test_a_prefill_that_did_no_work_moves_once_to_another_candidate() -> None:
    targets = Breakers()
    first = pair_on(A, None, targets)
    refused = PrefillUnreachable("prefill engine refused the connection")
    moved = after_failure(first, refused, (A, B, C), None, Rules(), targets, decode_sent=True)
    assert moved.fate is Fate.PAIR and moved.target == B and moved.attempt == 1
    # A second failure does not move again; with one candidate, or every other breaker
    # open, there is nowhere to move: the error is the answer.
    again = after_failure(moved, refused, (A, B, C), None, Rules(), targets, decode_sent=False)
    assert again.fate is Fate.REFUSE and again.error is refused
    alone = after_failure(first, refused, (A,), None, Rules(), targets, decode_sent=False)
    assert alone.fate is Fate.REFUSE and alone.error is refused
    shut = after_failure(first, refused, (A, B), None, Rules(), Breakers(B), decode_sent=False)
    assert shut.fate is Fate.REFUSE


def test_a_retry_comes_before_the_local_fallback_which_comes_before_the_error() -> None:
    targets = Breakers(ranks=2)
    first = pair_on(A, None, targets)
    local = Rules(local_fallback=True)
    refused = PrefillUnreachable("prefill engine refused the connection")
    assert after_failure(first, refused, (A, B), None, local, targets,
                         decode_sent=False).fate is Fate.PAIR
    fallback = after_failure(first, refused, (A,), None, local, targets, decode_sent=False)
    assert fallback.fate is Fate.LOCAL and fallback.outcome == "fallback"
    assert fallback.fallback_reason == "prefill_failed"
    assert fallback.decode_rank == first.decode_rank is not None
    for error in (PrefillFailed("prefill engine answered HTTP 500"),
                  InvalidHandoff("prefill answered without its hand-off")):
        covered = after_failure(first, error, (A,), None, local, targets, decode_sent=False)
        assert covered.fate is Fate.LOCAL and covered.fallback_reason == error.code


def test_no_fallback_once_a_decode_was_sent_nor_for_a_decode_failure() -> None:
    targets = Breakers()
    first = pair_on(A, None, targets)
    local = Rules(local_fallback=True)
    failed = PrefillFailed("prefill engine answered HTTP 500")
    sent = after_failure(first, failed, (A,), None, local, targets, decode_sent=True)
    assert sent.fate is Fate.REFUSE and sent.error is failed
    decode = DecodeFailed("decode engine answered HTTP 500")
    assert after_failure(first, decode, (A, B), None, local, targets,
                         decode_sent=False).fate is Fate.REFUSE
    assert after_failure(first, failed, (A,), None, Rules(), targets,
                         decode_sent=False).fate is Fate.REFUSE


# -- the placer: what it gathers ------------------------------------------------------------


class Index:
    """A ``CachedPrefix`` answering from a fixed count (None: cannot answer)."""

    def __init__(self, cached: int | None) -> None:
        self.cached = cached
        self.asked: list[list[int]] = []

    @property
    def answers(self) -> bool:
        return self.cached is not None

    def cached_tokens(self, token_ids: Sequence[int]) -> int | None:
        self.asked.append(list(token_ids))
        return self.cached


class Tokenizer:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.calls = 0

    async def __call__(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str],
                       *, max_bytes: int) -> dict[str, Any]:
        self.calls += 1
        return {"count": len(self.ids), "tokens": self.ids}


def placer(rules: Rules, *, index: Index | None = None, tokenizer: Tokenizer | None = None,
           found: list[int] | None = None) -> Placer:
    measure = PromptMeasure(endpoint=TokenizeEndpoint("/tokenize", chat=True),
                            post_local=tokenizer)
    return Placer(route_support=lambda route: RouteSupport.PD, engine="vllm", rules=rules,
                  targets=Breakers(), measure=measure, cache=index,
                  on_cached_tokens=None if found is None else found.append)


async def _place(p: Placer, route: Route, body: dict[str, Any]) -> Decision:
    return await p.place(route, body, (A,), request_id="rq")


async def test_state_decides_without_a_tokenize_call_or_a_look_up() -> None:
    tokenizer, index = Tokenizer(list(range(300))), Index(300)
    p = placer(Rules(max_tokens=8, max_uncached=10), index=index, tokenizer=tokenizer)
    decision = await _place(p, Route.RESPONSES, {"input": "hi",
                                                 "previous_response_id": "resp_1"})
    assert decision.outcome == "local_state"
    assert tokenizer.calls == 0 and index.asked == []


async def test_no_rule_no_measure() -> None:
    tokenizer, index = Tokenizer([1, 2]), Index(2)
    decision = await _place(placer(Rules(), index=index, tokenizer=tokenizer),
                            Route.COMPLETIONS, {"prompt": "hello"})
    assert decision.outcome == "ok" and tokenizer.calls == 0 and index.asked == []


async def test_the_cache_rule_asks_the_index_with_the_tokenized_ids() -> None:
    ids = list(range(300))
    tokenizer, index, found = Tokenizer(ids), Index(256), []
    p = placer(Rules(max_uncached=44), index=index, tokenizer=tokenizer, found=found)
    decision = await _place(p, Route.COMPLETIONS, {"prompt": "a long conversation"})
    assert decision.outcome == "local_cached" and decision.cached_tokens == 256
    assert index.asked == [ids] and tokenizer.calls == 1 and found == [256]
    # Token ids in the body are the ids: no call.
    decision = await _place(p, Route.COMPLETIONS, {"prompt": list(range(400))})
    assert decision.outcome == "ok" and tokenizer.calls == 1 and found == [256, 256]


async def test_an_index_that_cannot_answer_leaves_the_short_rule_in_charge_untokenized() -> None:
    # No tokenize call when the index cannot answer (its ids would be of no use): the prompt's
    # count (estimated here) decides by the short rule alone, the same as when it answers.
    tokenizer = Tokenizer(list(range(20)))
    p = placer(Rules(max_tokens=8, max_uncached=1000), index=Index(None), tokenizer=tokenizer)
    assert (await _place(p, Route.COMPLETIONS, {"prompt": "hi"})).outcome == "local_short"
    long = await _place(p, Route.COMPLETIONS, {"prompt": "x" * 5000})
    assert long.outcome == "ok" and long.prompt_tokens == 1250
    assert tokenizer.calls == 0


# -- targets that cannot hand off --------------------------------------------------------


def test_only_a_target_that_can_hand_off_gets_the_pair() -> None:
    chosen = decide(facts(kin={A: "it serves other-model-rev2", B: None}), Rules(), Breakers())
    assert chosen.fate is Fate.PAIR and chosen.target == B and chosen.able == (B,)
    # A candidate not asked (its breaker kept it out then) gets no pair either.
    assert decide(facts(kin={B: None}), Rules(), Breakers()).target == B


def test_when_none_can_hand_off_it_is_refused_or_run_locally() -> None:
    kin = {A: "it serves m2", B: "its KV cache has cache_dtype fp8"}
    refused = decide(facts(kin=kin), Rules(), Breakers())
    assert refused.fate is Fate.REFUSE and isinstance(refused.error, PrefillMismatch)
    assert "m2" in refused.error.message and "fp8" in refused.error.message
    local = decide(facts(kin=kin), Rules(local_fallback=True), Breakers())
    assert local.fate is Fate.LOCAL and local.fallback_reason == "prefill_target_mismatch"
    # One that cannot hand off, the other's breaker open: the breakers' refusal.
    mixed = decide(facts(kin={A: "it serves m2"}), Rules(), Breakers(B))
    assert mixed.fate is Fate.REFUSE and not isinstance(mixed.error, PrefillMismatch)
