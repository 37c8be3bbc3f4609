"""Cache-aware placement on real vLLM 0.32 (CPU): the decode engine's own KV events decide.

One decode engine of its own (NIXL ``kv_consumer`` with prefix caching,
``--enable-prompt-tokens-details`` and ``--kv-events-config`` publishing to the sidecar's
endpoint), the session's NIXL prefill engine and baseline engine, and the sidecar as its own
process with ``--kv-events-endpoint`` and ``--local-prefill-max-uncached-tokens``. Proves:

- a two-turn chat: turn 1 (nothing cached) runs as a pair; turn 2, which adds a short message,
  runs whole on the decode engine (``local_cached``): the prefill engine receives nothing for
  it, the decode engine's prefix-cache hits grow by at least the tokens the sidecar found
  cached, and the sidecar's count equals the engine's ``usage.prompt_tokens_details.
  cached_tokens``; a turn 2 that adds a long message runs as a pair; every output equals the
  baseline engine's greedy output;
- a sidecar whose events endpoint no engine ever connects to leaves the length rule in charge
  (a short prompt runs ``local_short``, a long mostly-cached one as a pair);
- after the decode engine restarts (same ports, empty cache) the sidecar's index has forgotten
  what the old one held (a ``disconnected`` gap): the turn-2 request that ran locally before
  is not judged cached again; it runs as a pair, with the baseline's output.

Does not prove SGLang's or TensorRT-LLM's events (none run here; see docs/operating/cache-aware.md).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from real_vllm.client import (
    block_prompt,
    chat_body,
    metric_rises,
    metric_value,
    post_json,
    text_of,
)
from real_vllm.harness import (
    ROUTE_FLAGS,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    free_port,
    nixl_config,
)
from real_vllm.sidecar_process import PATIENT_TOKENIZE, PREFILL_HEADER, Sidecar, sidecar_process
from real_vllm.stack import RealVllm

DECODE = "cache-decode"
#: Uncached prompt tokens a request may have and still run locally (a few 32-token blocks).
MAX_UNCACHED = 96
#: The length rule of the sidecar that hears no events.
MAX_TOKENS = 64
CHAT = "/v1/chat/completions"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
CACHED_SUM = "disagg_cached_prompt_tokens_sum"
REQUESTS = "disagg_requests_total"
INDEX_BLOCKS = "disagg_kv_index_blocks"


@dataclass
class CacheStack:
    real: RealVllm
    group: EngineGroup
    sidecar: Sidecar
    events_endpoint: str

    @property
    def decode(self) -> str:
        return self.group.engines[DECODE].url


def decode_spec(endpoint: str) -> EngineSpec:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv"}
    return EngineSpec(DECODE, nixl_config("kv_consumer"), cpu=1, prefix_caching=True,
                      extra_args=(*ROUTE_FLAGS, "--kv-events-config", json.dumps(events)))


@pytest.fixture(scope="module")
def cache_stack(real_vllm: RealVllm, engine_env: EngineEnv,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheStack]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with EngineGroup(engine_env) as group:
        group.spawn(decode_spec(endpoint))
        url = group.engines[DECODE].url
        # The sidecar binds the endpoint; the engine's publisher connects whenever it is up.
        for sidecar in sidecar_process(
            tmp_path_factory.mktemp("cache-sidecar"),
            "--engine", "vllm", "--kv-connector", "shfs", "--engine-url", url,
            "--kv-events-endpoint", endpoint, "--kv-events-topic", "kv",
            "--local-prefill-max-uncached-tokens", str(MAX_UNCACHED), "--log-level", "debug",
            *PATIENT_TOKENIZE,
        ):
            group.wait_ready([DECODE])
            yield CacheStack(real_vllm, group, sidecar, endpoint)


@pytest.fixture(scope="module")
def deaf_sidecar(cache_stack: CacheStack, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Sidecar]:
    """A sidecar whose events endpoint no engine publishes to."""
    yield from sidecar_process(
        tmp_path_factory.mktemp("deaf-sidecar"),
        "--engine", "vllm", "--kv-connector", "shfs", "--engine-url", cache_stack.decode,
        "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
        "--local-prefill-max-uncached-tokens", str(MAX_UNCACHED),
        "--local-prefill-max-tokens", str(MAX_TOKENS), *PATIENT_TOKENIZE,
    )


def via(sidecar: Sidecar, body: dict[str, Any], target: str) -> dict[str, Any]:
    request = urllib.request.Request(
        sidecar.url + CHAT, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", PREFILL_HEADER: target}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        reply: dict[str, Any] = json.loads(response.read())
        return reply


def turn_one(stack: CacheStack, body: dict[str, Any], target: str) -> dict[str, Any]:
    """A first turn through the stack's sidecar, answered once the sidecar's index holds its
    new blocks: the engine's KV events travel on their own, so they may come after the answer
    (a CI run sent turn 2 before they came, and it ran as a pair)."""
    before = metric_value(stack.sidecar.url, INDEX_BLOCKS)
    reply = via(stack.sidecar, body, target)
    metric_rises(stack.sidecar.url, INDEX_BLOCKS, above=before)
    return reply


def cached_of(reply: dict[str, Any]) -> int:
    details = reply["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def outcome(sidecar: Sidecar, name: str) -> float:
    return metric_value(sidecar.url, REQUESTS, outcome=name)


def turn_two(first: dict[str, Any], reply: str, message: str) -> dict[str, Any]:
    messages = [*first["messages"], {"role": "assistant", "content": reply},
                {"role": "user", "content": message}]
    return {**first, "messages": messages}


class Counters:
    """The figures a request moves, read before and after it."""

    def __init__(self, stack: CacheStack, sidecar: Sidecar | None = None) -> None:
        self.stack = stack
        self.sidecar = sidecar or stack.sidecar
        self.before = self.read()

    def read(self) -> dict[str, float]:
        prefill = self.stack.real.nixl.prefill
        return {
            "prefill_prompt": metric_value(prefill, PROMPT_TOKENS),
            "decode_hits": metric_value(self.stack.decode, PREFIX_HITS),
            "found": metric_value(self.sidecar.url, CACHED_SUM),
            "local_cached": outcome(self.sidecar, "local_cached"),
            "local_short": outcome(self.sidecar, "local_short"),
        }

    def moved(self) -> dict[str, float]:
        after = self.read()
        return {name: after[name] - self.before[name] for name in after}


def test_turn_two_runs_locally_and_a_long_message_as_a_pair(cache_stack: CacheStack) -> None:
    real, target = cache_stack.real, cache_stack.real.nixl.prefill_hostport
    first = chat_body(block_prompt("cache-aware-chat", items=12), max_tokens=12)

    moved = Counters(cache_stack)
    reply_one = turn_one(cache_stack, first, target)
    one = moved.moved()
    assert one["local_cached"] == 0
    assert one["prefill_prompt"] > 0  # turn 1: nothing cached, a pair
    assert text_of(reply_one) == text_of(post_json(real.baseline + CHAT, first))

    second = turn_two(first, text_of(reply_one), "And then?")
    moved = Counters(cache_stack)
    reply_two = via(cache_stack.sidecar, second, target)
    two = moved.moved()
    assert two["local_cached"] == 1
    assert two["prefill_prompt"] == 0  # the prefill engine received nothing
    found = two["found"]
    assert found >= 2 * 32  # several whole blocks of turn 1
    assert two["decode_hits"] >= found
    assert cached_of(reply_two) == found
    assert text_of(reply_two) == text_of(post_json(real.baseline + CHAT, second))

    long_second = turn_two(first, text_of(reply_one), block_prompt("a long new message", 8))
    moved = Counters(cache_stack)
    reply_long = via(cache_stack.sidecar, long_second, target)
    long = moved.moved()
    assert long["local_cached"] == 0
    assert long["prefill_prompt"] > 0
    assert text_of(reply_long) == text_of(post_json(real.baseline + CHAT, long_second))


def test_no_events_leave_the_length_rule(cache_stack: CacheStack, deaf_sidecar: Sidecar) -> None:
    real, target = cache_stack.real, cache_stack.real.nixl.prefill_hostport
    short = chat_body("Hi there.", max_tokens=4)
    moved = Counters(cache_stack, deaf_sidecar)
    via(deaf_sidecar, short, target)
    assert moved.moved()["local_short"] == 1
    # Mostly cached on the decode engine by now (the other sidecar's turns), but this sidecar
    # does not know: the length rule sends it as a pair.
    first = chat_body(block_prompt("cache-aware-chat", items=12), max_tokens=12)
    second = turn_two(first, text_of(post_json(real.baseline + CHAT, first)), "And then?")
    via(cache_stack.sidecar, first, target)  # make sure the decode engine holds turn 1
    moved = Counters(cache_stack, deaf_sidecar)
    reply = via(deaf_sidecar, second, target)
    counted = moved.moved()
    assert counted["local_cached"] == 0 and counted["local_short"] == 0
    assert counted["found"] == 0
    assert counted["prefill_prompt"] > 0
    assert text_of(reply) == text_of(post_json(real.baseline + CHAT, second))


def test_a_restarted_engine_gets_no_stale_cached_decision(cache_stack: CacheStack) -> None:
    real, target = cache_stack.real, cache_stack.real.nixl.prefill_hostport
    first = chat_body(block_prompt("cache-aware-restart", items=12), max_tokens=12)
    second = turn_two(first, text_of(turn_one(cache_stack, first, target)), "And then?")
    moved = Counters(cache_stack)
    via(cache_stack.sidecar, second, target)
    assert moved.moved()["local_cached"] == 1  # cached before the restart

    gaps = metric_value(cache_stack.sidecar.url, "disagg_kv_events_gaps_total",
                        cause="disconnected")
    cache_stack.group.restart(DECODE)
    assert metric_value(cache_stack.sidecar.url, "disagg_kv_events_gaps_total",
                        cause="disconnected") > gaps
    moved = Counters(cache_stack)
    reply = via(cache_stack.sidecar, second, target)
    after = moved.moved()
    assert after["local_cached"] == 0  # the old engine's blocks are not believed
    assert after["prefill_prompt"] > 0
    assert text_of(reply) == text_of(post_json(real.baseline + CHAT, second))
