"""A cache-aware workload on real vLLM that no single conversation covers, and its evidence.

    stack = CacheWorkloadStack(...)           decode engine (small KV cache, KV events, the
                                              timing hook), the sidecar, the prefill engine
    records = Workload(stack).run(phase)      the requests of one phase through the sidecar

The requests (deterministic texts, greedy, ``ignore_eos``; block size 32):

    shared    users asking one question each under one long system prompt (chat: a system
              message; completions: the same text as the prompt's head)
    turn      growing chat conversations that start under the same system prompt: each turn
              adds the previous reply and a short user message
    one_off   long completions seen once, which push older blocks out of the decode engine's
              deliberately small cache (40 blocks of 32 tokens)

sent one at a time or a few at once (``Round``), streamed and not, each with its own
``X-Request-Id``. Per request (``Record``): where the sidecar ran it and the cached tokens it
found (its debug line ``request <id>: <outcome>: ... (cached prompt tokens: N)``), the
engine's usage (prompt tokens, ``prompt_tokens_details.cached_tokens``: what the engine found
in its own cache when it ran the prompt itself), the output, and for a request sent alone the
decode engine's prefix-cache hits while it ran (what the engine held of the prompt, whether it
ran it whole or as the decode of a pair).

Before a request sent alone the sidecar is caught up: it has handled every batch the engine
published so far (the timing hook's ``published`` lines against the sidecar's per-batch debug
lines). Requests sent together are not waited for: what the index believes of the engine is
then whatever has arrived.

Deliberate limits: the prompts stay within the suite's 512-token context; the evidence of a
placement is the sidecar's debug log (a per-response placement header would make it direct).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from real_vllm import engine_site, kv_event_timing_hook
from real_vllm.client import block_prompt, metric_value, post_json, text_of
from real_vllm.harness import (
    BLOCK_SIZE,
    ROUTE_FLAGS,
    EngineSpec,
    nixl_config,
)
from real_vllm.kv_event_timing_hook import ENV_VAR as TIMING_ENV
from real_vllm.sidecar_process import PREFILL_HEADER

DECODE = "workload-decode"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
#: Uncached prompt tokens a request may have and still run locally: three blocks.
MAX_UNCACHED = 3 * BLOCK_SIZE
#: The decode engine's KV cache in blocks (vLLM counts one more: its null block).
DECODE_BLOCKS = 40
PREFIX_HITS = "vllm:prefix_cache_hits_total"
SYSTEM = block_prompt("the system prompt every user of this assistant shares", items=16)
#: A conversation whose prompt passed this starts afresh (a turn adds up to about 100 tokens
#: with its reply, the context is 512).
CONVERSATION_TOKENS = 360
CATCH_UP_S = 60.0
POLL_S = 0.02

_DECISION = re.compile(r"request (\S+): (\w+): .*?(?: \(cached prompt tokens: (\d+)\))?$")
#: The sidecar's per-batch debug line (sidecar/kv_events/subscriber.py).
BATCH_LINE = re.compile(r"kv events: batch (\d+) stamped ([\d.]+) received \+([\d.-]+) ms "
                    r"handled \+([\d.-]+) ms")


def decode_spec(endpoint: str, timing_dir: Path, **more_env: str) -> EngineSpec:
    """The decode engine: NIXL consumer, prefix caching, a 40-block cache, KV events to the
    sidecar's endpoint, the timing hook writing to ``timing_dir / "timing.log"`` (and
    ``more_env`` for it, e.g. its unpinning experiment)."""
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv"}
    site = engine_site.install_dir(timing_dir / "site", kv_event_timing_hook)
    return EngineSpec(
        DECODE, nixl_config("kv_consumer"), cpu=1, prefix_caching=True,
        extra_args=(*ROUTE_FLAGS, "--kv-events-config", json.dumps(events),
                    "--num-gpu-blocks-override", str(DECODE_BLOCKS + 1)),
        extra_env={"PYTHONPATH": str(site), TIMING_ENV: str(timing_dir / "timing.log"),
                   **more_env})


@dataclass(frozen=True)
class Request:
    rid: str
    kind: str  # shared | turn | one_off
    path: str
    body: dict[str, Any]
    #: The conversation a turn continues.
    conversation: int | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Record:
    """What one request did (see the module doc)."""

    request: Request
    phase: int
    alone: bool
    text: str = ""
    prompt_tokens: int = 0
    engine_cached: int | None = None
    outcome: str = ""
    sidecar_cached: int | None = None
    decode_hits: float | None = None
    baseline_text: str = ""


@dataclass
class Conversation:
    number: int
    #: How many times it started afresh (a conversation near the context ends; its user
    #: starts another).
    generation: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"conversation {self.number}.{self.generation}"


def _body(path: str, prompt: str | list[dict[str, str]], stream: bool, max_tokens: int
          ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    if path == CHAT:
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def one_off_text(tag: str) -> str:
    """About 450 tokens (14 blocks) seen once."""
    return block_prompt(f"a long one-off prompt, {tag}", items=29)


@dataclass
class Stack:
    """What the workload talks to (the test's fixture or the bench builds it)."""

    sidecar_url: str
    sidecar_log: Path
    decode_url: str
    baseline_url: str
    prefill_hostport: str
    timing_log: Path


class Workload:
    """Builds and sends the requests of each phase (see the module doc)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.records: list[Record] = []
        self._count = 0
        self._conversations = [Conversation(c) for c in range(4)]

    # -- the requests ------------------------------------------------------------------

    def _rid(self, kind: str) -> str:
        self._count += 1
        return f"wl-{self._count:03d}-{kind}"

    def shared(self, question: int, *, chat: bool = True, stream: bool = False) -> Request:
        ask = f"Question {question}: what does value_{question % 16} compute, and why?"
        if chat:
            prompt: Any = [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": ask}]
            return Request(self._rid("shared"), "shared", CHAT, _body(CHAT, prompt, stream, 8))
        return Request(self._rid("shared"), "shared", COMPLETIONS,
                       _body(COMPLETIONS, f"{SYSTEM}\n# {ask}", stream, 8))

    def turn(self, number: int, *, stream: bool = False) -> Request:
        """The next turn of conversation ``number`` (the system prompt, then its turns)."""
        conversation = self._conversations[number]
        if not conversation.messages:
            conversation.messages = [{"role": "system", "content": SYSTEM}]
        ask = f"{conversation.name}, turn {len(conversation.messages) // 2}: go on, please."
        messages = [*conversation.messages, {"role": "user", "content": ask}]
        return Request(self._rid("turn"), "turn", CHAT, _body(CHAT, messages, stream, 12),
                       conversation=number)

    def one_off(self, number: int, *, stream: bool = False) -> Request:
        return Request(self._rid("one_off"), "one_off", COMPLETIONS,
                       _body(COMPLETIONS, one_off_text(f"number {number}"), stream, 4))

    def _answered(self, request: Request, record: Record) -> None:
        if request.conversation is None:
            return
        conversation = self._conversations[request.conversation]
        if record.prompt_tokens > CONVERSATION_TOKENS:
            # The next turn might not fit the context: this user starts another.
            conversation.generation += 1
            conversation.messages = []
        else:
            conversation.messages = [*request.body["messages"],
                                     {"role": "assistant", "content": record.text}]

    # -- sending -----------------------------------------------------------------------

    def run(self, phase: int, rounds: list[list[Callable[[], Request]]]) -> list[Record]:
        """Each round's requests, built when the round starts: one alone, several at once."""
        done: list[Record] = []
        for makers in rounds:
            requests = [make() for make in makers]
            if len(requests) == 1:
                self.wait_caught_up()
                hits = metric_value(self.stack.decode_url, PREFIX_HITS)
                record = self._send(requests[0], phase, alone=True)
                record.decode_hits = metric_value(self.stack.decode_url, PREFIX_HITS) - hits
                done.append(record)
            else:
                with ThreadPoolExecutor(len(requests)) as pool:
                    done += list(pool.map(lambda r: self._send(r, phase, alone=False),
                                          requests))
        decisions = self.decisions()
        for record in done:
            record.outcome, record.sidecar_cached = decisions[record.request.rid]
            record.baseline_text = text_of(post_json(
                self.stack.baseline_url + record.request.path,
                {**record.request.body, "stream": False, "stream_options": None}))
        self.records += done
        return done

    def _send(self, request: Request, phase: int, *, alone: bool) -> Record:
        http = urllib.request.Request(
            self.stack.sidecar_url + request.path, data=json.dumps(request.body).encode(),
            headers={"Content-Type": "application/json", "X-Request-Id": request.rid,
                     PREFILL_HEADER: self.stack.prefill_hostport}, method="POST")
        with urllib.request.urlopen(http, timeout=180) as response:
            raw = response.read().decode()
        record = Record(request, phase, alone)
        if request.stream:
            chunks = [json.loads(line[6:]) for line in raw.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert raw.rstrip().endswith("data: [DONE]"), raw[-200:]
            parts = [c.get("delta", {}).get("content") or c.get("text") or ""
                     for chunk in chunks for c in chunk.get("choices", [])]
            record.text = "".join(parts)
            usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), {})
        else:
            reply = json.loads(raw)
            record.text = text_of(reply)
            usage = reply.get("usage") or {}
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        record.engine_cached = None if cached is None else int(cached)
        self._answered(request, record)
        return record

    # -- evidence ----------------------------------------------------------------------

    def decisions(self) -> dict[str, tuple[str, int | None]]:
        """Each request id's outcome and the cached tokens the sidecar found (its log)."""
        found: dict[str, tuple[str, int | None]] = {}
        for line in self.stack.sidecar_log.read_text(errors="replace").splitlines():
            match = _DECISION.search(line)
            if match is not None:
                cached = match[3]
                found[match[1]] = (match[2], None if cached is None else int(cached))
        return found

    def wait_caught_up(self) -> None:
        """Return once the sidecar handled the last batch the engine has published."""
        deadline = time.monotonic() + CATCH_UP_S
        while True:
            published = published_count(self.stack.timing_log)
            handled = last_handled(self.stack.sidecar_log)
            if published == 0 or (handled is not None and handled >= published - 1):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the sidecar handled batch {handled} of {published} "
                                     f"after {CATCH_UP_S} s")
            time.sleep(POLL_S)  # the files are the only signal; this bounds how often


def engine_batches(timing_log: Path) -> list[float]:
    """The stamp of every batch the engine published (every start)."""
    return [float(words[2]) for words in (line.split() for line in
                                          timing_log.read_text().splitlines())
            if words and words[0] == "published"]


def sidecar_batches(sidecar_log: Path) -> dict[float, float]:
    """When the sidecar applied each batch, by its stamp (``time.time()``)."""
    applied: dict[float, float] = {}
    for line in sidecar_log.read_text(errors="replace").splitlines():
        match = BATCH_LINE.search(line)
        if match is not None:
            stamp = float(match[2])
            applied[stamp] = stamp + float(match[4]) / 1000
    return applied


def decision_time(sidecar_log: Path, rid: str) -> float:
    """When the sidecar logged its decision on request ``rid`` (to the millisecond)."""
    for line in sidecar_log.read_text(errors="replace").splitlines():
        match = _DECISION.search(line)
        if match is not None and match[1] == rid:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise AssertionError(f"no decision logged for {rid}")


def _timing_lines(timing_log: Path) -> list[list[str]]:
    """The timing hook's lines of the current engine (after its last ``publisher`` line)."""
    lines = [line.split() for line in timing_log.read_text().splitlines()] \
        if timing_log.exists() else []
    starts = [i for i, words in enumerate(lines) if words and words[0] == "publisher"]
    return lines[starts[-1] + 1:] if starts else lines


def published_count(timing_log: Path) -> int:
    return sum(1 for words in _timing_lines(timing_log) if words[0] == "published")


def last_handled(sidecar_log: Path) -> int | None:
    last = None
    for line in sidecar_log.read_text(errors="replace").splitlines():
        match = BATCH_LINE.search(line)
        if match is not None:
            last = int(match[1])
    return last


Round = list[Callable[[], Request]]


def rounds(w: Workload, phase: int, iterations: int = 12) -> list[Round]:
    """One phase: the two shared prompts' first users (pairs: nothing is cached), then per
    iteration a shared user alone (chat or completions, streamed every other time), the next
    turn of a conversation alone, a one-off every third, and every fourth four requests at
    once (a shared user of each API, a turn, a one-off)."""
    base = 100 * phase
    plan: list[Round] = [[lambda: w.shared(base, chat=True)],
                         [lambda: w.shared(base + 1, chat=False, stream=True)]]
    for i in range(iterations):
        question = base + 10 + 4 * i
        plan.append([lambda q=question, i=i: w.shared(q, chat=i % 3 != 2, stream=i % 2 == 0)])
        plan.append([lambda i=i: w.turn(i % 4, stream=i % 2 == 1)])
        if i % 3 == 2:
            plan.append([lambda i=i: w.one_off(base + i, stream=i % 2 == 0)])
        if i % 4 == 3:
            plan.append([lambda q=question: w.shared(q + 1, chat=True, stream=True),
                         lambda q=question: w.shared(q + 2, chat=False),
                         lambda i=i: w.turn((i + 1) % 4),
                         lambda i=i: w.one_off(base + 50 + i, stream=True)])
    return plan
