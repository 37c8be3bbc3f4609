"""Migration on real vLLM (CPU): the decode engine is killed (SIGKILL to its whole process
group) in the middle of long greedy answers, and each client still gets the baseline's.

A NIXL pair of its own (the kills must not disturb the session's stack), three sidecar
processes before its decode engine: ``pd`` (a pair per request, ``--migration-limit 1``),
``off`` (``--migration-limit 0``) and ``local`` (every prompt run whole on the decode
engine: ``--local-prefill-max-tokens``). Three kills, each restarting the decode engine after:

1. through ``pd``, all sent at once: a JSON completion, a completions stream that asks for
   its token ids, a chat stream that does not. The decode engine is killed once both streams
   have ``KILL_AFTER`` chunks. Each stream completes with exactly the baseline's greedy
   tokens and text (the chat stream with no ids in sight), one ``[DONE]``, the baseline's
   usage counts; the JSON answer is the baseline's; ``disagg_migrations_total{migrated}``
   counts the three.
2. a stream through ``off``, killed once it has ``KILL_AFTER`` chunks: it ends with the typed
   error event (``decode_failed``) and no ``[DONE]``.
3. a stream through ``local``, killed the same way: never paired, it continues on the prefill
   engine with the baseline's tokens.

Each kill needs its requests still decoding, which the engine's pace decides: 360 tokens take
it under a second to two, and a paired request's start lags a local one's by as much. So a
round in which a stream is past half its answer when the kill is due gets no kill, and one in
which fewer requests moved than were sent (one had its answer before the kill reached it:
the JSON request's progress is not seen) must have every answer whole and the baseline's,
and runs again after a restart; new prompts each round, up to ``ROUNDS``.

Before the kills: a stream through ``pd`` without a failure has the chunks and the text of
one through ``off`` (the ids asked for the sidecar's sake reach no client that did not ask).

The baseline: each request whole on the decode engine before any kill (a request it runs
whole is the answer a pair gives: tests/real_vllm/test_sidecar_http.py). The model writes
many multi-byte characters and invalid byte runs, so the join is made at a character
boundary more often than not (an engine that dies holds back an unfinished character).

Also measured (printed, and in bench/RESULTS.md): for each stream, the gap around the kill
(its last token from the dead engine to its first continued token).

Does not prove other connectors (one pair is the cost the suite can bear), SGLang or
TensorRT-LLM (their stubs do: tests/migration), nor a kill of the prefill engine.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from real_vllm.client import (
    block_prompt,
    chat_body,
    completion_body,
    post_json,
    post_stream,
)
from real_vllm.harness import ROUTE_FLAGS, Engine, EngineEnv, EngineGroup, EngineSpec, nixl_config
from real_vllm.raw_http import post_raw
from real_vllm.sidecar_process import PREFILL_HEADER, Sidecar, sidecar_process

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
#: Tokens of each answer: long (the model's context is 512), so the kill lands early on.
MAX_TOKENS = 360
#: Tokens each stream must have before the kill.
KILL_AFTER = 4
#: Rounds of the requests until all are decoding at once (each round new prompts).
ROUNDS = 3


def past_half(streams: dict[str, Streamed]) -> list[str]:
    """The streams that ended or are past half their tokens: a kill now might find them done
    (the engine writes ahead of what the client has read)."""
    for name, got in streams.items():
        first = got.times[0] - got.sent_at if got.times else float("nan")
        print(f"  {name}: first chunk {first:.3f} s after it was sent, "
              f"{got.token_chunks} token chunks now")
    return [name for name, got in streams.items()
            if got.done or got.token_chunks > MAX_TOKENS // 2]
READY_DEADLINE_S = 60.0
PREFILL, DECODE = "migration-prefill", "migration-decode"


@pytest.fixture(scope="module")
def nixl_group(engine_env: EngineEnv) -> Iterator[EngineGroup]:
    with EngineGroup(engine_env) as group:
        group.start([
            EngineSpec(PREFILL, nixl_config("kv_producer"), cpu=0, extra_args=ROUTE_FLAGS),
            EngineSpec(DECODE, nixl_config("kv_consumer"), cpu=1, prefix_caching=False,
                       extra_args=ROUTE_FLAGS),
        ])
        yield group


@dataclass
class Streamed:
    """One stream read through a sidecar, with each chunk's arrival time."""

    events: list[Any] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    complete: bool = True
    started: threading.Event = field(default_factory=threading.Event)
    sent_at: float = 0.0

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict)]

    @property
    def text(self) -> str:
        return "".join((c.get("text") if "text" in c else (c.get("delta") or {}).get("content"))
                       or "" for chunk in self.chunks for c in chunk.get("choices") or [])

    @property
    def ids(self) -> list[int]:
        return [i for chunk in self.chunks for c in chunk.get("choices") or []
                for i in c.get("token_ids") or []]

    @property
    def usage(self) -> dict[str, Any] | None:
        found = [chunk["usage"] for chunk in self.chunks if chunk.get("usage")]
        return found[-1] if found else None

    @property
    def done(self) -> int:
        return self.events.count("[DONE]")

    @property
    def token_chunks(self) -> int:
        return sum(isinstance(e, dict) and bool(e.get("choices")) for e in self.events)

    def before(self, moment: float) -> int:
        """How many chunks came before ``moment``."""
        return sum(t < moment for t in self.times)

    def gap_after(self, moment: float) -> float:
        """The longest wait for a chunk after ``moment``: from the dead engine's last token
        to the first continued one."""
        later = [t for t in self.times if t >= moment]
        before = [t for t in self.times if t < moment]
        points = ([before[-1]] if before else []) + later
        return max((b - a for a, b in itertools.pairwise(points)), default=0.0)


def stream(sidecar: Sidecar, path: str, body: dict[str, Any], target: str,
           out: Streamed) -> Streamed:
    """Read a stream through ``sidecar`` line by line, noting when each chunk came;
    ``out.started`` is set once ``KILL_AFTER`` tokens have come."""
    host, port = sidecar.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    tokens = 0
    out.sent_at = time.monotonic()
    try:
        conn.request("POST", path, json.dumps(body),
                     {"Content-Type": "application/json", PREFILL_HEADER: target})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        try:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                out.times.append(time.monotonic())
                event = payload if payload == "[DONE]" else json.loads(payload)
                out.events.append(event)
                if isinstance(event, dict) and event.get("choices"):
                    tokens += 1
                    if tokens >= KILL_AFTER:
                        out.started.set()
        except (http.client.IncompleteRead, ConnectionError):
            out.complete = False
    finally:
        out.started.set()  # a stream that ended early must not keep the kill waiting
        conn.close()
    return out


def _killed_during(group: EngineGroup, sidecar: Sidecar, body_of: Callable[[str], dict[str, Any]],
                   target: str) -> tuple[Streamed, float]:
    """One stream through ``sidecar`` with the decode engine killed once it has ``KILL_AFTER``
    chunks; the stream and when. A stream past half its answer by then, or one that ended
    whole although the engine died (it had its answer before the kill reached it), runs again
    with a new prompt (``body_of(tag)``), up to ``ROUNDS`` times."""
    for round_ in range(1, ROUNDS + 1):
        wait_ready(sidecar)
        moved_before = migrations(sidecar, "migrated")
        got = Streamed()
        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(stream, sidecar, COMPLETIONS, body_of(f"migration r{round_}"),
                                  target, got)
            assert got.started.wait(120)
            ended = past_half({"stream": got})
            killed_at = kill(group, DECODE) if not ended else None
            reading.result()
        if killed_at is None:
            print(f"round {round_}: too far along at {KILL_AFTER} chunks; again")
            continue
        if got.done and migrations(sidecar, "migrated") == moved_before:
            print(f"round {round_}: whole before the kill reached it; again")
            group.restart(DECODE)
            continue
        return got, killed_at
    pytest.fail(f"in {ROUNDS} rounds, never was a stream decoding at the kill")


def kill(group: EngineGroup, name: str) -> float:
    """SIGKILL engine ``name``'s whole process group; when."""
    engine = group.engines[name]
    killed_at = time.monotonic()
    os.killpg(engine.process.pid, signal.SIGKILL)
    return killed_at


def wait_ready(sidecar: Sidecar) -> None:
    """Until the sidecar's engine is ready again (its /ready: the health watch saw it)."""
    deadline = time.monotonic() + READY_DEADLINE_S
    while True:
        try:
            with urllib.request.urlopen(sidecar.url + "/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the sidecar's engine is not ready again"
        # Readiness is only observable by asking (the sidecar's watch runs every 2 s).
        time.sleep(0.25)


def migrations(sidecar: Sidecar, outcome: str) -> float:
    text = urllib.request.urlopen(sidecar.url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("disagg_migrations_total{") and f'outcome="{outcome}"' in line)


def answered_at(sidecar: Sidecar, path: str, body: dict[str, Any],
                target: str) -> tuple[dict[str, Any], float]:
    """A JSON answer through ``sidecar`` as a pair with ``target``, and when it came."""
    reply = post_raw(sidecar.url + path, body, timeout=300, headers={PREFILL_HEADER: target})
    assert reply.status == 200, reply.body
    return reply.json(), time.monotonic()


def baseline_stream(engine: Engine, path: str, body: dict[str, Any]) -> Streamed:
    events: list[Any] = post_stream(engine.url + path, {**body, "return_token_ids": True},
                                    timeout=300)
    return Streamed(events=[*events, "[DONE]"])


@pytest.fixture(scope="module")
def sidecars(nixl_group: EngineGroup, tmp_path_factory: pytest.TempPathFactory,
             ) -> Iterator[dict[str, Sidecar]]:
    decode = nixl_group.engines[DECODE]
    common = ("--engine", "vllm", "--kv-connector", "shfs", "--engine-url", decode.url)
    configs = {
        "pd": ("--migration-limit", "1"),
        "off": ("--migration-limit", "0"),
        "local": ("--migration-limit", "1", "--local-prefill-max-tokens", "100000"),
    }
    dirs = {name: tmp_path_factory.mktemp(name) for name in configs}
    running = {name: sidecar_process(dirs[name], *common, *args)
               for name, args in configs.items()}
    try:
        yield {name: next(process) for name, process in running.items()}
    finally:
        for process in running.values():
            process.close()
        # For a failure's reader: what each sidecar said about its moves.
        for name, directory in dirs.items():
            lines = (directory / "sidecar.log").read_text(errors="replace").splitlines()
            print(f"--- sidecar {name}:", *[line for line in lines
                                             if "migrat" in line or "request" in line][-20:],
                  sep="\n")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_without_a_failure_the_client_sees_what_it_saw_without_migration(
        nixl_group: EngineGroup, sidecars: dict[str, Sidecar], path: str) -> None:
    """The token ids the ``pd`` sidecar asks for its own sake reach no client that did not
    ask: every chunk of its stream has a shape the ``off`` sidecar's stream has (vLLM's keys
    written ``null``; the text aside), the last chunks are alike, and the text is the same.
    (How many tokens one chunk carries is the engine's timing, never the same twice: the bytes
    are not comparable, and a busy engine may answer all 40 tokens in the last chunk alone, so
    the chunks are compared with their ending blanked and the last ones whole.)"""
    target = f"127.0.0.1:{nixl_group.engines[PREFILL].port}"
    prompt = block_prompt(f"migration shapes {path}", 3)
    body = (completion_body(prompt, 40, stream=True) if path == COMPLETIONS
            else chat_body(prompt, 40, stream=True))
    texts, shapes, last_shapes = [], [], []
    for name in ("off", "pd"):
        wait_ready(sidecars[name])
        reply = post_raw(sidecars[name].url + path, body, timeout=120,
                         headers={PREFILL_HEADER: target, "X-Request-Id": f"shapes-{path}"})
        assert reply.status == 200 and reply.complete
        events = [line[len("data: "):] for line in reply.body.split("\n")
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        texts.append(Streamed(events=chunks).text)
        shapes.append({_shape(_unended(chunk)) for chunk in chunks})
        last_shapes.append(_shape(chunks[-1]))
    assert texts[1] == texts[0]
    assert shapes[1] == shapes[0], (sorted(shapes[1] - shapes[0]), sorted(shapes[0] - shapes[1]))
    assert last_shapes[1] == last_shapes[0]
    assert not any('token_ids": [' in shape for shape in shapes[1])


def _unended(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk as if it did not end its stream: the ending's fields blank, no fingerprint
    (vLLM writes ``system_fingerprint`` on the last chunk only)."""
    chunk = {key: value for key, value in chunk.items() if key != "system_fingerprint"}
    chunk["choices"] = [
        {**choice, **{key: None for key in ("finish_reason", "stop_reason") if key in choice}}
        for choice in chunk.get("choices") or []]
    return chunk


def _shape(chunk: dict[str, Any]) -> str:
    """A chunk with its text, content and clock made empty: what it looks like."""
    chunk = {**chunk, "created": 0}
    chunk["choices"] = [
        {**choice, **({"text": ""} if "text" in choice else {}),
         **({"delta": {k: "" if k == "content" else v
                       for k, v in choice["delta"].items()}} if "delta" in choice else {})}
        for choice in chunk.get("choices") or []]
    return json.dumps(chunk)


def test_a_killed_decode_engine_s_answers_complete_elsewhere(
        nixl_group: EngineGroup, sidecars: dict[str, Sidecar]) -> None:
    target = f"127.0.0.1:{nixl_group.engines[PREFILL].port}"
    options = {"stream": True, "stream_options": {"include_usage": True}}
    pd = sidecars["pd"]
    for round_ in range(1, ROUNDS + 1):
        decode = nixl_group.engines[DECODE]
        # New prompts each round: nothing of an earlier round's is cached.
        tag = f"migration r{round_}"
        cmpl = completion_body(block_prompt(f"{tag} cmpl", 3), MAX_TOKENS, **options,
                               return_token_ids=True)
        chat = chat_body(block_prompt(f"{tag} chat", 3), MAX_TOKENS, **options)
        whole = completion_body(block_prompt(f"{tag} json", 3), MAX_TOKENS)
        expected_cmpl = baseline_stream(decode, COMPLETIONS, cmpl)
        expected_chat = baseline_stream(decode, CHAT, chat)
        expected_json = post_json(decode.url + COMPLETIONS, whole, timeout=300)
        wait_ready(pd)
        moved_before = migrations(pd, "migrated")

        with ThreadPoolExecutor(3) as pool:
            # All three at once: their prefill legs run in one batch and their decodes side
            # by side, so the JSON request (whose progress is not seen) decodes while the
            # streams do; the kill comes once the streams have ``KILL_AFTER`` chunks each.
            # (Sending it first, to be sure it decodes, let it end before the streams began:
            # a stream's prefill leg takes longer than the 360 tokens on this engine.)
            answer = pool.submit(answered_at, pd, COMPLETIONS, whole, target)
            got_cmpl, got_chat = Streamed(), Streamed()
            reading = [pool.submit(stream, pd, COMPLETIONS, cmpl, target, got_cmpl),
                       pool.submit(stream, pd, CHAT, chat, target, got_chat)]
            assert got_cmpl.started.wait(120) and got_chat.started.wait(120)
            # A request past half its answer when the others reach KILL_AFTER chunks may be
            # done at the kill: no kill, the round runs again with new prompts.
            ended = past_half({"completions": got_cmpl, "chat": got_chat})
            if answer.done():
                ended.append("json")
            killed_at = kill(nixl_group, DECODE) if not ended else None
            for done in reading:
                done.result()
            got_json, json_at = answer.result()
        if killed_at is None:
            print(f"round {round_}: {', '.join(ended)} too far along when the others were "
                  "decoding; again with new prompts")
            continue
        moved = migrations(pd, "migrated") - moved_before
        if moved == 3:
            break
        # Fewer moved: a request (the JSON one, whose progress is not seen) had its answer
        # before the kill reached it. The race, not the sidecar, only if every answer is
        # whole and the baseline's; then again, after a restart.
        assert got_cmpl.text == expected_cmpl.text and got_chat.text == expected_chat.text
        assert got_json["choices"][0]["text"] == expected_json["choices"][0]["text"]
        print(f"round {round_}: {3 - moved} of the three had ended at the kill; again")
        nixl_group.restart(DECODE)
    else:
        pytest.fail(f"in {ROUNDS} rounds, never were all three requests decoding at once")

    print(f"failure to first continued token: completions {got_cmpl.gap_after(killed_at):.3f} s,"
          f" chat {got_chat.gap_after(killed_at):.3f} s")
    for name, got in (("completions", got_cmpl), ("chat", got_chat)):
        print(f"{name}: first chunk {got.times[0] - killed_at:+.3f} s from the kill, last "
              f"{got.times[-1] - killed_at:+.3f} s; {got.before(killed_at)} of "
              f"{len(got.times)} chunks before it")
    # Each stream was still running when its engine died: tokens came after the kill.
    assert all(t > killed_at for t in (got_cmpl.times[-1], got_chat.times[-1]))
    assert got_cmpl.complete and got_cmpl.done == 1 and got_cmpl.events[-1] == "[DONE]"
    assert got_cmpl.ids == expected_cmpl.ids
    assert got_cmpl.text == expected_cmpl.text
    assert got_chat.complete and got_chat.done == 1
    assert got_chat.text == expected_chat.text
    assert got_chat.ids == []  # not asked: written as the engine writes them unasked
    assert {c["id"] for c in got_cmpl.chunks} == {got_cmpl.chunks[0]["id"]}
    for got, expected in ((got_cmpl, expected_cmpl), (got_chat, expected_chat)):
        assert got.usage is not None and expected.usage is not None
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert {k: got.usage[k] for k in counts} == {k: expected.usage[k] for k in counts}
    assert json_at > killed_at, "the JSON answer came before the kill"
    assert got_json["choices"][0]["text"] == expected_json["choices"][0]["text"]
    assert got_json["usage"]["completion_tokens"] == MAX_TOKENS

    # One stream at a time from here: a paired stream starts a prefill leg later than a
    # local one does, and the engine writes 360 tokens in under a second, so two together
    # often had one done before the other decoded (3 rounds of 3 once, on this machine).
    nixl_group.restart(DECODE)
    off, local = sidecars["off"], sidecars["local"]
    got_off, killed_at = _killed_during(
        nixl_group, off, lambda tag: completion_body(block_prompt(f"{tag} off", 3), MAX_TOKENS,
                                                     **options), target)
    assert got_off.times[-1] > killed_at
    assert got_off.done == 0
    assert got_off.chunks[-1]["error"]["code"] == "decode_failed"
    assert "not migrated" not in got_off.chunks[-1]["error"]["message"]
    assert migrations(off, "migrated") == 0

    nixl_group.restart(DECODE)
    moved_before = migrations(local, "migrated")
    local_bodies: list[dict[str, Any]] = []

    def local_body(tag: str) -> dict[str, Any]:
        local_bodies.append(completion_body(block_prompt(f"{tag} local", 3), MAX_TOKENS,
                                            **options, return_token_ids=True))
        return local_bodies[-1]

    got_local, killed_at = _killed_during(nixl_group, local, local_body, target)
    print(f"failure to first continued token: local {got_local.gap_after(killed_at):.3f} s")
    nixl_group.restart(DECODE)
    # The baseline after the kill: the restarted engine computes as the killed one did.
    expected_local = baseline_stream(nixl_group.engines[DECODE], COMPLETIONS, local_bodies[-1])
    assert got_local.times[-1] > killed_at
    assert got_local.complete and got_local.done == 1
    assert got_local.ids == expected_local.ids
    assert got_local.text == expected_local.text
    assert migrations(local, "migrated") - moved_before == 1

