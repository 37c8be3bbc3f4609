"""Migration on real vLLM (CPU): the decode engine is killed (SIGKILL to its whole process
group) in the middle of long greedy answers, and each client still gets the baseline's.

A NIXL pair of its own (the kills must not disturb the session's stack), three sidecar
processes before its decode engine: ``pd`` (a pair per request, ``--migration-limit 1``),
``off`` (``--migration-limit 0``) and ``local`` (every prompt run whole on the decode
engine: ``--local-prefill-max-tokens``). Six kills, one request each, the decode engine
restarted after each (each test leaves the group as it found it):

1. through ``pd``, a completions stream that asks for its token ids, killed once it has
   ``KILL_AFTER`` chunks: it completes with exactly the baseline's greedy ids and text, one
   ``[DONE]``, one id, the baseline's usage counts; ``disagg_migrations_total{migrated}``
   counts one;
2. the same with a chat stream that does not ask for ids: the baseline's text and usage, no
   ids in sight;
3. a JSON completion through ``pd``, killed once the decode engine counted its prompt (at its
   first token): the baseline's answer, one migration;
4. a stream through ``off``: it ends with the typed error event (``decode_failed``) and no
   ``[DONE]``;
5. a stream through ``local``: never paired, it continues on the prefill engine with the
   baseline's ids;
6. a completions stream through ``pd`` killed more than 32 ids after a special token of its
   answer (``SPECIAL_PROMPTS``): the join reads back only a chunk end's last ids, so the
   special token's text (left out of a stream, written by a read-back) does not stop it.

One request per kill, because each kill needs its request still decoding, which the engine's
pace decides: 360 tokens take it under a second to two, and on the 2-core CI machine a
request's first token was seen to lag another's sent at the same moment by 0.6-1.5 s (three
requests at once failed three rounds of three there, 2026-12-06). A stream's kill is sent by
the thread reading it, as its ``KILL_AFTER``-th chunk arrives (a wait for the test's main
thread to wake once let a chat stream reach 155 chunks first). Even so, a client there saw
its first chunk 0.76 s after sending, when the engine had the whole answer out (three rounds
of three, CI, 2026-12-06): the decode engine is paced (``pace_hook.py``: at least
``DECODE_STEP_S`` per step, 3.6 s per answer), its outputs and their order its own. One
whose answer was whole before the kill reached it anyway (no migration counted: the engine
writes ahead of what the client reads) runs again after a restart; new prompts each round,
up to ``ROUNDS``.

Before the kills: a stream through ``pd`` without a failure has the chunks and the text of
one through ``off`` (the ids asked for the sidecar's sake reach no client that did not ask).

The baseline: each request whole on the decode engine before any kill (a request it runs
whole is the answer a pair gives: tests/real_vllm/test_sidecar_http.py). The model writes
many multi-byte characters and invalid byte runs, so the join is made at a character
boundary more often than not (an engine that dies holds back an unfinished character).

Also measured (printed, and in bench/RESULTS.md): for each stream, the gap around the kill
(its last token from the dead engine to its first continued token; since the pace, it holds
up to one paced step of the dead engine's).

Does not prove other connectors (one pair is the cost the suite can bear), SGLang or
TensorRT-LLM (their stubs do: tests/migration), nor a kill of the prefill engine.
"""

from __future__ import annotations

import functools
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

from real_vllm import engine_site, pace_hook
from real_vllm.client import (
    METRIC_POLL_S,
    block_prompt,
    chat_body,
    completion_body,
    metric_value,
    post_json,
    post_stream,
)
from real_vllm.harness import ROUTE_FLAGS, Engine, EngineEnv, EngineGroup, EngineSpec, nixl_config
from real_vllm.raw_http import post_raw
from real_vllm.sidecar_process import PREFILL_HEADER, Sidecar, sidecar_process, wait_ready

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
#: Tokens of each answer: long (the model's context is 512), so the kill lands early on.
MAX_TOKENS = 360
#: Tokens each stream must have before the kill.
KILL_AFTER = 4
#: Rounds of the requests until all are decoding at once (each round new prompts).
ROUNDS = 3
#: The decode engine's least time per step (pace_hook.py): an answer takes it at least
#: 3.6 s, a lag of the reading client's that the kill must stay under.
DECODE_STEP_S = 0.01


READY_DEADLINE_S = 60.0
#: The prompt tokens an engine has counted (at each request's first token).
PROMPT_TOKENS = "vllm:prompt_tokens_total"
STREAM_OPTIONS: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
#: The test model's special tokens (<unk>, <s>, </s>): it writes them now and then.
SPECIAL_IDS = frozenset({0, 1, 2})
#: Prompts (``block_prompt(tag, 3)``) whose greedy answer has a special token early
#: (transformers' greedy run of the model: tokens 28 and 127; 51).
SPECIAL_PROMPTS = ("migration r2 special", "migration r2 special 10")
#: Ids past the special token when the kill comes: more than the 32 the join once reached
#: back, so that only a join that never reads the whole answer back can continue.
SPECIAL_DISTANCE = 40
PREFILL, DECODE = "migration-prefill", "migration-decode"


@pytest.fixture(scope="module")
def nixl_group(engine_env: EngineEnv, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[EngineGroup]:
    site = engine_site.install_dir(tmp_path_factory.mktemp("pace"), pace_hook)
    paced = {"PYTHONPATH": str(site), pace_hook.ENV_VAR: str(DECODE_STEP_S)}
    with EngineGroup(engine_env) as group:
        group.start([
            EngineSpec(PREFILL, nixl_config("kv_producer"), cpu=0, extra_args=ROUTE_FLAGS),
            EngineSpec(DECODE, nixl_config("kv_consumer"), cpu=1, prefix_caching=False,
                       extra_args=ROUTE_FLAGS, extra_env=paced),
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
           out: Streamed, at_kill: Callable[[], None] | None = None,
           kill_when: Callable[[Streamed], bool] | None = None) -> Streamed:
    """Read a stream through ``sidecar`` line by line, noting when each chunk came;
    ``at_kill`` is called once ``kill_when(out)`` holds after a chunk (by default: once
    ``KILL_AFTER`` chunks have come), in the reading thread (no wait for another thread to
    wake), and ``out.started`` set then."""
    kill_when = kill_when or _kill_after
    host, port = sidecar.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
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
                if at_kill is not None and not out.started.is_set() and kill_when(out):
                    out.started.set()
                    at_kill()
        except (http.client.IncompleteRead, ConnectionError):
            out.complete = False
    finally:
        out.started.set()  # a stream that ended early must not keep the kill waiting
        conn.close()
    return out


def _kill_after(got: Streamed) -> bool:
    return got.token_chunks >= KILL_AFTER


def _killed_during(group: EngineGroup, sidecar: Sidecar, path: str,
                   body_of: Callable[[str], dict[str, Any]], *,
                   kill_when: Callable[[Streamed], bool] = _kill_after,
                   rounds: int = ROUNDS) -> tuple[Streamed, float]:
    """One stream through ``sidecar`` as a pair with the prefill engine, the decode engine
    killed by the reading thread once ``kill_when`` holds (by default at the stream's
    ``KILL_AFTER``-th chunk), restarted after; the stream and when the kill was. A stream
    that ended whole although the engine died (the engine writes ahead of what the client
    reads, and had the whole answer out), or before ``kill_when`` held, runs again with a new
    prompt (``body_of(tag)``), up to ``rounds`` times."""
    target = f"127.0.0.1:{group.engines[PREFILL].port}"
    for round_ in range(1, rounds + 1):
        body = body_of(f"migration r{round_}")
        wait_ready(sidecar)
        moved_before = migrations(sidecar, "migrated")
        got = Streamed()
        killed: list[float] = []
        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(stream, sidecar, path, body, target, got,
                                  functools.partial(_kill_into, killed, group), kill_when)
            try:
                reading.result()
            finally:  # the group is left as it was found
                if killed:
                    group.restart(DECODE)
        if not killed:
            print(f"round {round_}: the stream ended before its kill point; again")
            continue
        first = got.times[0] - got.sent_at
        print(f"  round {round_}: first chunk {first:.3f} s after it was sent")
        moved = migrations(sidecar, "migrated") - moved_before
        if got.done and moved == 0:
            print(f"round {round_}: whole before the kill reached it "
                  f"({got.before(killed[0])} of {len(got.times)} chunks and "
                  f"{len(got.ids)} ids read, the kill {killed[0] - got.times[0]:.3f} s after "
                  f"the first chunk, the last {got.times[-1] - killed[0]:+.3f} s from it); again")
            continue
        assert moved <= 1
        assert got.times[-1] > killed[0]  # the stream still ran when its engine died
        return got, killed[0]
    pytest.fail(f"in {rounds} rounds, never was a stream decoding at the kill")


def rises(engine: Engine, name: str, above: float) -> None:
    """Until ``engine``'s counter ``name`` is above ``above`` (published each step)."""
    deadline = time.monotonic() + READY_DEADLINE_S
    while metric_value(engine.url, name) <= above:
        assert time.monotonic() < deadline, f"{name} on {engine.url} stayed at {above}"
        time.sleep(METRIC_POLL_S)  # only observable by asking


def _kill_into(killed: list[float], group: EngineGroup) -> None:
    killed.append(kill(group, DECODE))


def kill(group: EngineGroup, name: str) -> float:
    """SIGKILL engine ``name``'s whole process group; when."""
    engine = group.engines[name]
    killed_at = time.monotonic()
    os.killpg(engine.process.pid, signal.SIGKILL)
    return killed_at


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


def test_a_killed_paired_completions_stream_completes_with_the_baseline(
        nixl_group: EngineGroup, sidecars: dict[str, Sidecar]) -> None:
    """A completions stream that asks for its token ids: the baseline's ids, text and usage,
    one ``[DONE]``, one id throughout, one migration counted."""
    body_of = Baselined(nixl_group, COMPLETIONS, lambda tag: _ids_body(f"{tag} cmpl"))
    expected = body_of.expected
    got, killed_at = _killed_during(nixl_group, sidecars["pd"], COMPLETIONS, body_of)
    _report("completions", got, killed_at)
    assert got.complete and got.done == 1 and got.events[-1] == "[DONE]"
    assert got.ids == expected[-1].ids
    assert got.text == expected[-1].text
    assert {c["id"] for c in got.chunks} == {got.chunks[0]["id"]}
    _assert_usage_equal(got, expected[-1])


def test_a_killed_paired_chat_stream_completes_with_the_baseline(
        nixl_group: EngineGroup, sidecars: dict[str, Sidecar]) -> None:
    """A chat stream that does not ask for ids: the baseline's text and usage, one
    ``[DONE]``, no ids in sight (the sidecar asked for them for its own sake)."""
    body_of = Baselined(nixl_group, CHAT, lambda tag: chat_body(
        block_prompt(f"{tag} chat", 3), MAX_TOKENS, **STREAM_OPTIONS))
    expected = body_of.expected
    got, killed_at = _killed_during(nixl_group, sidecars["pd"], CHAT, body_of)
    _report("chat", got, killed_at)
    assert got.complete and got.done == 1
    assert got.text == expected[-1].text
    assert got.ids == []  # not asked: written as the engine writes them unasked
    _assert_usage_equal(got, expected[-1])


def test_a_killed_paired_json_request_answers_the_baseline(
        nixl_group: EngineGroup, sidecars: dict[str, Sidecar]) -> None:
    """A JSON completion, killed once the decode engine has its first token (it counts the
    request's prompt then), runs again whole elsewhere: the baseline's answer."""
    pd = sidecars["pd"]
    target = f"127.0.0.1:{nixl_group.engines[PREFILL].port}"
    for round_ in range(1, ROUNDS + 1):
        decode = nixl_group.engines[DECODE]
        whole = completion_body(block_prompt(f"migration r{round_} json", 3), MAX_TOKENS)
        expected = post_json(decode.url + COMPLETIONS, whole, timeout=300)
        wait_ready(pd)
        moved_before = migrations(pd, "migrated")
        with ThreadPoolExecutor(1) as pool:
            counted = metric_value(decode.url, PROMPT_TOKENS)
            answer = pool.submit(answered_at, pd, COMPLETIONS, whole, target)
            try:
                rises(decode, PROMPT_TOKENS, counted)
                killed_at = kill(nixl_group, DECODE)
                got, answered = answer.result()
            finally:  # the group is left as it was found
                nixl_group.restart(DECODE)
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        assert got["usage"]["completion_tokens"] == MAX_TOKENS
        if migrations(pd, "migrated") - moved_before == 1:
            assert answered > killed_at
            return
        print(f"round {round_}: the answer was whole before the kill reached it; again")
    pytest.fail(f"in {ROUNDS} rounds, the JSON answer was never still decoding at the kill")


def test_without_migration_a_killed_stream_ends_with_the_typed_error(
        nixl_group: EngineGroup, sidecars: dict[str, Sidecar]) -> None:
    off = sidecars["off"]
    got, killed_at = _killed_during(
        nixl_group, off, COMPLETIONS,
        lambda tag: completion_body(block_prompt(f"{tag} off", 3), MAX_TOKENS,
                                    **STREAM_OPTIONS))
    assert got.times[-1] > killed_at
    assert got.done == 0
    assert got.chunks[-1]["error"]["code"] == "decode_failed"
    assert "not migrated" not in got.chunks[-1]["error"]["message"]
    assert migrations(off, "migrated") == 0


def test_a_killed_local_stream_continues_on_the_prefill_engine(
        nixl_group: EngineGroup, sidecars: dict[str, Sidecar]) -> None:
    """A request never paired (``--local-prefill-max-tokens``) moves too."""
    body_of = Baselined(nixl_group, COMPLETIONS, lambda tag: _ids_body(f"{tag} local"))
    expected = body_of.expected
    got, killed_at = _killed_during(nixl_group, sidecars["local"], COMPLETIONS, body_of)
    _report("local", got, killed_at)
    assert got.complete and got.done == 1
    assert got.ids == expected[-1].ids
    assert got.text == expected[-1].text


def test_a_stream_killed_well_past_a_special_token_completes(
        nixl_group: EngineGroup, sidecars: dict[str, Sidecar]) -> None:
    """The join reads back only a chunk end's last ids: a special token in the answer more
    than 32 ids before the kill (its text a stream leaves out and a read-back writes) does
    not stop it (reading the whole answer back, the join refused such a stream: ``join``)."""
    prompts = iter(SPECIAL_PROMPTS)  # the round's tag is not the prompt here: chosen ones
    body_of = Baselined(nixl_group, COMPLETIONS, lambda tag: _ids_body(next(prompts)))
    expected = body_of.expected

    def well_past_a_special(got: Streamed) -> bool:
        ids = got.ids
        first = next((n for n, i in enumerate(ids) if i in SPECIAL_IDS), None)
        return first is not None and len(ids) > first + SPECIAL_DISTANCE

    got, killed_at = _killed_during(nixl_group, sidecars["pd"], COMPLETIONS, body_of,
                                    kill_when=well_past_a_special, rounds=len(SPECIAL_PROMPTS))
    _report("past a special token", got, killed_at)
    assert got.complete and got.done == 1
    assert got.ids == expected[-1].ids
    assert got.text == expected[-1].text
    assert "<unk>" not in got.text  # the stream writes special tokens as the engine does


@dataclass
class Baselined:
    """A round's body for ``_killed_during`` (``body_for(tag)``), each with the decode
    engine's own whole answer to it, computed before the kill (``expected``)."""

    group: EngineGroup
    path: str
    body_for: Callable[[str], dict[str, Any]]
    expected: list[Streamed] = field(default_factory=list)

    def __call__(self, tag: str) -> dict[str, Any]:
        body = self.body_for(tag)
        self.expected.append(baseline_stream(self.group.engines[DECODE], self.path, body))
        return body


def _ids_body(tag: str) -> dict[str, Any]:
    """A long streamed completion of ``block_prompt(tag, 3)`` that asks for its token ids."""
    return completion_body(block_prompt(tag, 3), MAX_TOKENS, **STREAM_OPTIONS,
                           return_token_ids=True)


def _report(name: str, got: Streamed, killed_at: float) -> None:
    """The gap around the kill, for bench/RESULTS.md (printed with ``-s``)."""
    print(f"{name}: failure to first continued token {got.gap_after(killed_at):.3f} s; first "
          f"chunk {got.times[0] - killed_at:+.3f} s from the kill, last "
          f"{got.times[-1] - killed_at:+.3f} s; {got.before(killed_at)} of {len(got.times)} "
          "chunks before it")


def _assert_usage_equal(got: Streamed, expected: Streamed) -> None:
    assert got.usage is not None and expected.usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: got.usage[k] for k in counts} == {k: expected.usage[k] for k in counts}
