"""Proves the prompt measure of the placement decision, ``PromptMeasure``
(sidecar/engines/tokenizer.py), over a fake tokenizer call (no sockets):

- token-id prompts are counted exactly (their ids given) and never tokenized; text and chat
  are estimated with ``estimate`` (and when no tokenizer call can be made);
- when the ids are asked for (the cache rule), text and chat are tokenized whatever the
  source says, and the answer's ``tokens`` are the ids; a count without matching ids is
  malformed;
- ``tokenize``: the local engine's endpoint (the dialect's ``TokenizeEndpoint``) gets the model
  and the prompt (a one-prompt list's first prompt); chat goes there only when the endpoint
  takes chat (vLLM), with exactly the dialect's ``chat_fields`` the client sent, and is
  estimated otherwise (SGLang);
- every tokenize failure disaggregates the request and is counted once by its reason:
  ``timeout`` (no answer in time, or a deadline error), ``rejected`` (4xx), ``failed`` (any
  other engine error), ``malformed_answer`` (no non-negative integer ``count``).

It does not prove the rules that read the measure (tests/core/test_placement.py) nor the
engine's tokenizer routes (tests/http/test_local_prefill.py over stubs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from protocol_builders import chat_body, completions_body

from sidecar.config.limits import PromptLengthSource
from sidecar.dialects.sglang import SGLangDialect
from sidecar.dialects.vllm_nixl import NixlPullDialect
from sidecar.engines.tokenizer import PromptMeasure
from sidecar.errors import DeadlineExceeded, EngineRejected, PrefillFailed
from sidecar.protocol.context import Route

VLLM_TOKENIZE = NixlPullDialect.tokenize
SGLANG_TOKENIZE = SGLangDialect.tokenize
TOKENIZE = PromptLengthSource.TOKENIZE


class Tokenizer:
    """A ``PostLocal`` answering each call from a script (an answer, an error, or a hang)."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[tuple[str, Mapping[str, Any], Mapping[str, str], int]] = []

    async def __call__(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str],
                       *, max_bytes: int) -> dict[str, Any]:
        self.calls.append((path, body, headers, max_bytes))
        outcome = self.outcomes.pop(0)
        if outcome is HANG:
            await asyncio.get_running_loop().create_future()  # never answers
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome  # type: ignore[no-any-return]


HANG = object()


class Short:
    """The length rule over a measure (inclusive limit), as the decision reads it."""

    def __init__(self, measure: PromptMeasure, limit: int = 16) -> None:
        self.measure = measure
        self.limit = limit

    async def is_short(self, route: Route, body: Mapping[str, Any], _: str) -> bool:
        tokens = await self.measure.prompt_tokens(route, body)
        return tokens is not None and tokens <= self.limit

    async def prompt_tokens(self, route: Route, body: Mapping[str, Any]) -> int | None:
        return await self.measure.prompt_tokens(route, body)


def local(tokenizer: Tokenizer | None = None, *, endpoint: Any = VLLM_TOKENIZE,
          timeout_s: float = 5.0,
          source: PromptLengthSource = TOKENIZE) -> tuple[Short, list[str]]:
    failures: list[str] = []
    measure = PromptMeasure(source=source, endpoint=endpoint, post_local=tokenizer,
                            timeout_s=timeout_s, on_tokenize_failure=failures.append)
    return Short(measure), failures


async def test_token_id_prompts_are_exact_and_never_tokenized() -> None:
    tokenizer = Tokenizer()
    decision, _ = local(tokenizer)
    assert await decision.is_short(Route.COMPLETIONS, {"prompt": list(range(16))}, "rq")
    assert not await decision.is_short(Route.COMPLETIONS, {"prompt": list(range(17))}, "rq")
    assert await decision.prompt_tokens(Route.COMPLETIONS, {"prompt": [[1, 2, 3]]}) == 3
    assert tokenizer.calls == []


async def test_estimate_counts_bytes() -> None:
    decision, _ = local(source=PromptLengthSource.ESTIMATE)
    assert await decision.is_short(Route.COMPLETIONS, {"prompt": "x" * 64}, "rq")  # 16 tokens
    assert not await decision.is_short(Route.COMPLETIONS, {"prompt": "x" * 65}, "rq")
    chat = {"messages": [{"role": "user", "content": "x" * 48}]}  # 12 + 4 per message
    assert await decision.prompt_tokens(Route.CHAT, chat) == 16


async def test_tokenize_without_a_call_to_make_estimates() -> None:
    decision, _ = local(None)  # no post_local: the estimate
    assert await decision.prompt_tokens(Route.COMPLETIONS, {"prompt": "x" * 40}) == 10
    no_endpoint, _ = local(Tokenizer(), endpoint=None)
    assert await no_endpoint.prompt_tokens(Route.COMPLETIONS, {"prompt": "x" * 40}) == 10


async def test_token_id_prompts_give_their_ids() -> None:
    decision, _ = local(Tokenizer())
    prompt = await decision.measure.prompt(Route.COMPLETIONS, {"prompt": [5, 6, 7]}, ids=True)
    assert prompt == (3, [5, 6, 7])
    generate = await decision.measure.prompt(Route.GENERATE, {"token_ids": [1, 2]}, ids=True)
    assert generate == (2, [1, 2])


async def test_the_ids_are_tokenized_whatever_the_source_says() -> None:
    tokenizer = Tokenizer({"count": 3, "tokens": [7, 8, 9]})
    decision, failures = local(tokenizer, source=PromptLengthSource.ESTIMATE)
    prompt = await decision.measure.prompt(Route.COMPLETIONS, completions_body(), ids=True)
    assert prompt == (3, [7, 8, 9]) and len(tokenizer.calls) == 1 and failures == []
    # Without the ids the estimate still serves: no call.
    assert await decision.prompt_tokens(Route.COMPLETIONS, {"prompt": "x" * 40}) == 10
    assert len(tokenizer.calls) == 1


@pytest.mark.parametrize("answer", [{"count": 3}, {"count": 3, "tokens": [1, 2]},
                                    {"count": 2, "tokens": [1, "2"]},
                                    {"count": 2, "tokens": [1, True]}])
async def test_ids_that_do_not_match_the_count_are_malformed(answer: Any) -> None:
    decision, failures = local(Tokenizer(answer))
    prompt = await decision.measure.prompt(Route.COMPLETIONS, completions_body(), ids=True)
    assert prompt == (None, None) and failures == ["malformed_answer"]


async def test_tokenize_sends_the_model_and_the_prompt() -> None:
    tokenizer = Tokenizer({"count": 16}, {"count": 17}, {"count": 3})
    decision, failures = local(tokenizer)
    assert await decision.is_short(Route.COMPLETIONS, completions_body(), "rq")
    assert not await decision.is_short(Route.COMPLETIONS, completions_body(), "rq")
    await decision.is_short(Route.COMPLETIONS, completions_body(prompt=["only one"]), "rq")
    path, body, headers, max_bytes = tokenizer.calls[0]
    assert path == "/tokenize"
    assert body == {"model": "m", "prompt": "hello world"}
    assert headers == {"Content-Type": "application/json"}
    assert max_bytes > 0
    assert tokenizer.calls[2][1] == {"model": "m", "prompt": "only one"}
    assert failures == []


async def test_chat_goes_to_a_tokenizer_that_takes_chat_with_its_fields() -> None:
    assert VLLM_TOKENIZE is not None and VLLM_TOKENIZE.chat
    tokenizer = Tokenizer({"count": 5})
    decision, _ = local(tokenizer)
    client = chat_body(add_generation_prompt=True, chat_template_kwargs={"thinking": False},
                       temperature=0.5, logprobs=True)
    assert await decision.is_short(Route.CHAT, client, "rq")
    (call,) = tokenizer.calls
    assert call[0] == "/tokenize"
    sent_fields = {k for k in client if k in VLLM_TOKENIZE.chat_fields}
    assert sent_fields == {"tools", "add_generation_prompt", "chat_template_kwargs"}
    assert call[1] == {"model": "m", "messages": client["messages"],
                       **{k: client[k] for k in sent_fields}}
    assert call[1]["messages"] is client["messages"]  # as sent, not a copy


async def test_chat_is_estimated_where_the_tokenizer_takes_no_chat() -> None:
    assert SGLANG_TOKENIZE is not None and not SGLANG_TOKENIZE.chat
    tokenizer = Tokenizer()
    decision, _ = local(tokenizer, endpoint=SGLANG_TOKENIZE)
    assert await decision.prompt_tokens(Route.CHAT, chat_body()) == 5  # "hi": 1 + 4
    assert tokenizer.calls == []
    completions = Tokenizer({"count": 2})
    on_sglang, _ = local(completions, endpoint=SGLANG_TOKENIZE)
    assert await on_sglang.prompt_tokens(Route.COMPLETIONS, completions_body()) == 2
    assert completions.calls[0][0] == "/v1/tokenize"


@pytest.mark.parametrize(("outcome", "reason"), [
    (TimeoutError(), "timeout"),
    (DeadlineExceeded("tokenize timed out"), "timeout"),
    (EngineRejected("engine answered 400"), "rejected"),
    (PrefillFailed("engine answered 500"), "failed"),
    ({"tokens": [1, 2]}, "malformed_answer"),
    ({"count": "3"}, "malformed_answer"),
    ({"count": True}, "malformed_answer"),
    ({"count": -1}, "malformed_answer"),
    ({"count": 2.0}, "malformed_answer"),
])
async def test_a_failed_tokenize_disaggregates_and_is_counted(outcome: Any, reason: str) -> None:
    decision, failures = local(Tokenizer(outcome))
    assert not await decision.is_short(Route.COMPLETIONS, completions_body(), "rq")
    assert failures == [reason]


async def test_a_tokenizer_that_does_not_answer_in_time_is_a_timeout() -> None:
    decision, failures = local(Tokenizer(HANG), timeout_s=0)
    assert await decision.prompt_tokens(Route.COMPLETIONS, completions_body()) is None
    assert failures == ["timeout"]


async def test_a_count_of_zero_is_a_count() -> None:
    decision, failures = local(Tokenizer({"count": 0}))
    assert await decision.is_short(Route.COMPLETIONS, completions_body(), "rq")
    assert failures == []


# -- keyed like the engine (the cache rule's ids) -------------------------------------------


def keyed(tokenizer: Tokenizer, served: str = "stub-model") -> PromptMeasure:
    async def served_model() -> str:
        return served

    return PromptMeasure(endpoint=VLLM_TOKENIZE, post_local=tokenizer,
                         served_model=served_model)


IDS = {"count": 3, "tokens": [7, 8, 9]}


async def test_a_plain_prompt_of_the_served_model_is_keyed() -> None:
    tokenizer = Tokenizer(IDS, IDS)
    measure = keyed(tokenizer)
    for body in (completions_body(model="stub-model"), {"prompt": "no model named"}):
        assert (await measure.prompt(Route.COMPLETIONS, body, ids=True)).ids == [7, 8, 9]


@pytest.mark.parametrize("extra", [
    {"model": "a-lora-adapter"},  # its blocks carry the adapter: never a plain prefix
    {"cache_salt": "tenant-1"},  # salted blocks are keyed apart
    {"truncate_prompt_tokens": 4},  # the engine keeps the last ids, the tokenizer all
], ids=["lora", "salt", "truncation"])
async def test_a_request_keyed_apart_from_a_plain_prompt_gets_no_ids(
        extra: dict[str, Any]) -> None:
    tokenizer = Tokenizer(IDS)
    prompt = await keyed(tokenizer).prompt(
        Route.COMPLETIONS, {**completions_body(model="stub-model"), **extra}, ids=True)
    assert prompt.ids is None


async def test_a_chat_with_a_part_that_is_not_text_gets_no_ids() -> None:
    body = chat_body(model="stub-model")
    body["messages"] = [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    tokenizer = Tokenizer(IDS)
    assert (await keyed(tokenizer).prompt(Route.CHAT, body, ids=True)).ids is None
    assert tokenizer.calls == []


async def test_the_tokenizer_gets_what_changes_a_completions_prompts_ids() -> None:
    tokenizer = Tokenizer(IDS)
    body = {**completions_body(model="stub-model"), "add_special_tokens": False}
    await keyed(tokenizer).prompt(Route.COMPLETIONS, body, ids=True)
    (_, sent, _, _), = tokenizer.calls
    assert sent["add_special_tokens"] is False


async def test_a_request_tokenizes_a_shared_prompt_once() -> None:
    # A fan-out's sub-requests (n > 1) share their prompt: one tokenize call for all.
    tokenizer = Tokenizer(IDS)
    measure = keyed(tokenizer)
    memo: dict[bytes, Any] = {}
    for seed in range(8):
        body = {**completions_body(model="stub-model"), "n": 1, "seed": seed}
        assert (await measure.prompt(Route.COMPLETIONS, body, ids=True, memo=memo)).ids == [
            7, 8, 9]
    assert len(tokenizer.calls) == 1
