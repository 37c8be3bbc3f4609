"""Real vLLM engines (CPU) with NixlPushConnector behind the sidecar (``--kv-connector nixl-push``).

Proves, with this module's own three engines (a push prefill ``kv_producer`` with a fixed
``engine_id``, a push decode ``kv_consumer`` without prefix caching, a baseline without a
connector; ``kv_buffer_device: cpu``, UCX on ``lo``, a side-channel port each) and a sidecar
whose legs pass through recording proxies (``recording_proxy.py``: when each request reached
its engine and when its answer had left, by ``X-Request-Id``; the prefill's proxy holds each
answer ``PREFILL_HOLD_S`` before it leaves, as the issue's filer did, so that the order of
the two legs is not left to a loaded machine's scheduling):
- completions and chat, JSON and streamed, one at a time and four at once: the baseline's
  greedy output; the KV moved (the prefill's ``vllm:nixl_bytes_transferred`` and the decode's
  ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` grow); each engine saw
  exactly one request per client request, both with the client's request id;
- the first request to the target runs prefill, then decode (the decode arrived after the
  prefill's answer left); every later one reached the decode engine before the prefill's
  answer left its engine (both legs at once);
- a corrupted identity (negative control, straight to the engines): with the true engine id
  the legs give the baseline; naming another engine id the decode fails (JSON: HTTP 500;
  streamed: an error event first) and its engine logs vLLM's "engine ID mismatch";
- a sidecar given a wrong identity up front (``--nixl-push-engine-id``) fails no request,
  JSON or streamed: the decode refused on it (a 500 head; a stream's first event), or
  stopped by the sidecar when the prefill's answer came first, goes again from the prefill's
  answer, and later requests use the identity that answer showed;
- the prefill engine restarted (same ports) under a new engine id: the next request (JSON)
  succeeds with the baseline's output (its decode, sent with the old identity, waits on the
  gone engine; the prefill's answer shows the new identity and the decode goes again) with
  one prefill, and the one after runs both legs at once again.

Where the engines run (what made this module pass on the 2-core machine, where it had
stalled requests for 2 s to minutes and ran only on demand): the prefill and the baseline
are pinned to core 0 and the decode to core 1 (``VLLM_CPU_OMP_THREADS_BIND``), with the
suite's NIXL poll delay, and each NIXL worker stays on its engine's core: the suite's
start-up hook (``nixl_hook.py``, ``DISAGG_NIXL_KEEP_CORES``) undoes vLLM 0.32's own placement,
which moves a NIXL worker's main thread (the one that also runs the model) and every NIXL
thread it starts to the machine's last core, whatever the pinning says. With that placement
every push engine ran on core 1: the decode's worker, spin-waiting (``sched_yield``) for its
engine core's next step while its request waited for the KV, took the core, and the prefill's
worker beside it starved (measured with ``probe_push_cpu.py``; figures in bench/RESULTS.md).
Before, this module ran its engines unpinned and without the poll delay, so each idle NIXL
progress thread spun on that same core as well. The recording proxies pass a closed
connection on to the engine (a decode the sidecar stops is aborted in vLLM, as without a
proxy); before, a stale decode stopped after the restart went on waiting in the decode engine
and held the next request there for about 30 s.

Does not prove: GPUs or RDMA, data-parallel push engines, the gRPC door on real engines (the
stub suite covers both), a restart discovered by a streamed request (the stub suite covers
the first-event check it relies on; the wrong-identity test below covers it on vLLM).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from real_vllm.client import (
    block_prompt,
    chat_body,
    completion_body,
    metric_rises,
    metric_value,
    post_json,
    text_of,
)
from real_vllm.harness import (
    Engine,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    free_port,
    nixl_push_config,
)
from real_vllm.recording_proxy import RecordingProxy, recording_proxy
from real_vllm.sidecar_process import Sidecar, sidecar_process, through

ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
PREFILL = "push-prefill"
DECODE = "push-decode"
BASELINE = "push-baseline"
PREFILL_ENGINE_ID = f"push-prefill-{uuid.uuid4().hex[:8]}"
RESTARTED_ENGINE_ID = f"{PREFILL_ENGINE_ID}-restarted"
BYTES_MOVED = "vllm:nixl_bytes_transferred_sum"
EXTERNAL_TOKENS = "vllm:prompt_tokens_by_source_total"
#: A client's wait for a whole answer: these requests take a second or two; the bound is for
#: a machine shared with other work.
CLIENT_TIMEOUT_S = 120.0
#: The prefill's proxy holds each answer this long before it leaves (recording_proxy.py):
#: "the decode reached its engine before the prefill's answer left" then holds against a
#: loaded machine's scheduling jitter (once, at load 20, a decode sent with its prefill
#: arrived 0.3 ms after a 136 ms prefill had answered).
PREFILL_HOLD_S = 1.0


@dataclass
class PushStack:
    group: EngineGroup
    baseline: Engine
    prefill_proxy: RecordingProxy
    decode_proxy: RecordingProxy
    sidecar: Sidecar
    side_channel_port: int
    tmp: Path

    @property
    def prefill(self) -> Engine:
        return self.group.engines[PREFILL]

    @property
    def decode(self) -> Engine:
        return self.group.engines[DECODE]

    @property
    def target(self) -> str:
        """What the router names: the prefill engine (through its recording proxy)."""
        return self.prefill_proxy.url.removeprefix("http://")


def prefill_spec(engine_id: str, port: int, side_channel_port: int) -> EngineSpec:
    # Core 0 (with the baseline); the decode has core 1 (see the module docstring).
    return EngineSpec(PREFILL, nixl_push_config("kv_producer", engine_id), cpu=0, port=port,
                      side_channel_port=side_channel_port)


@pytest.fixture(scope="module")
def push(engine_env: EngineEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PushStack]:
    side_channel_port = free_port()
    with EngineGroup(engine_env) as group:
        group.start([
            EngineSpec(BASELINE, None, cpu=0),
            prefill_spec(PREFILL_ENGINE_ID, free_port(), side_channel_port),
            EngineSpec(DECODE, nixl_push_config("kv_consumer"), cpu=1, prefix_caching=False),
        ])
        with (recording_proxy(group.engines[PREFILL].url, PREFILL_HOLD_S) as prefill_proxy,
              recording_proxy(group.engines[DECODE].url) as decode_proxy):
            tmp = tmp_path_factory.mktemp("push-sidecar")
            for sidecar in sidecar_process(tmp, "--engine", "vllm", "--kv-connector",
                                           "nixl-push", "--engine-url", decode_proxy.url):
                yield PushStack(group, group.engines[BASELINE], prefill_proxy, decode_proxy,
                                sidecar, side_channel_port, tmp)


def body_of(kind: str, tag: str, **extra: Any) -> dict[str, Any]:
    build = completion_body if kind == "completion" else chat_body
    return build(block_prompt(tag), **extra)


def baseline_text(push: PushStack, kind: str, body: dict[str, Any]) -> str:
    return text_of(post_json(push.baseline.url + ROUTES[kind], {**body, "stream": False}))


def send(push: PushStack, kind: str, body: dict[str, Any], request_id: str,
         sidecar: Sidecar | None = None) -> str:
    return through(sidecar or push.sidecar, ROUTES[kind], body, push.target,
                   headers={"X-Request-Id": request_id}, timeout=CLIENT_TIMEOUT_S)


def prefill_legs_of(push: PushStack, path: str, request_id: str) -> list[Any]:
    # A streamed request's client can have its whole answer before the prefill's answer
    # (held by its proxy) has left: wait for it to be recorded.
    return push.prefill_proxy.passages_of(request_id, path, PREFILL_HOLD_S + CLIENT_TIMEOUT_S)


def legs_of(push: PushStack, kind: str, request_id: str) -> tuple[Any, Any]:
    """The one prefill and the one decode passage of ``request_id`` (asserts one each)."""
    prefills, decodes = legs_of_all(push, kind, request_id)
    assert len(prefills) == 1, prefills
    assert len(decodes) == 1, decodes
    return prefills[0], decodes[0]


def legs_of_all(push: PushStack, kind: str, request_id: str) -> tuple[list[Any], list[Any]]:
    path = ROUTES[kind]
    return (prefill_legs_of(push, path, request_id),
            [p for p in push.decode_proxy.seen(path) if p.request_id == request_id])


def learned(push: PushStack, sidecar: Sidecar | None = None) -> None:
    """Make sure the sidecar knows the prefill's identity (one request, if none went yet)."""
    if not push.prefill_proxy.seen():
        body = body_of("completion", "push-warm-up")
        assert send(push, "completion", body, f"warm-{uuid.uuid4().hex[:8]}", sidecar)


def test_the_first_request_learns_then_both_legs_go_at_once(push: PushStack) -> None:
    assert not push.prefill_proxy.seen(), "this module's first test runs first"
    body = body_of("completion", "push-first")
    first = f"first-{uuid.uuid4().hex[:8]}"
    assert send(push, "completion", body, first) == baseline_text(push, "completion", body)
    prefill, decode = legs_of(push, "completion", first)
    assert decode.arrived >= prefill.answered  # learned from the prefill's answer

    body = body_of("completion", "push-second", stream=True)
    second = f"second-{uuid.uuid4().hex[:8]}"
    assert send(push, "completion", body, second) == baseline_text(push, "completion", body)
    prefill, decode = legs_of(push, "completion", second)
    assert decode.arrived < prefill.answered  # the decode was there while the prefill ran


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_push_through_the_sidecar_equals_baseline_and_moves_the_kv(
    push: PushStack, kind: str, stream: bool,
) -> None:
    learned(push)
    body = body_of(kind, f"push-{kind}-{stream}", stream=stream)
    expected = baseline_text(push, kind, body)
    prompt_tokens = post_json(push.baseline.url + ROUTES[kind],
                              {**body, "stream": False, "max_tokens": 1})["usage"]["prompt_tokens"]
    assert prompt_tokens >= 3 * 32  # several KV blocks
    bytes_before = metric_value(push.prefill.url, BYTES_MOVED)
    tokens_before = metric_value(push.decode.url, EXTERNAL_TOKENS, source="external_kv_transfer")
    request_id = f"{kind}-{stream}-{uuid.uuid4().hex[:8]}"
    assert send(push, kind, body, request_id) == expected
    prefill, decode = legs_of(push, kind, request_id)  # one request on each engine
    assert decode.arrived < prefill.answered
    metric_rises(push.prefill.url, BYTES_MOVED, above=bytes_before)
    moved = metric_value(push.decode.url, EXTERNAL_TOKENS, source="external_kv_transfer")
    assert moved - tokens_before >= prompt_tokens - 1


def test_four_push_requests_at_once_each_equal_their_baseline(push: PushStack) -> None:
    learned(push)
    bodies = [body_of("completion", f"push-parallel-{i}", stream=i % 2 == 1) for i in range(4)]
    expected = [baseline_text(push, "completion", body) for body in bodies]
    ids = [f"parallel-{i}-{uuid.uuid4().hex[:8]}" for i in range(4)]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        got = list(pool.map(lambda pair: send(push, "completion", *pair),
                            zip(bodies, ids, strict=True)))
    assert got == expected
    assert len(set(expected)) == len(expected)
    for request_id in ids:
        prefill, decode = legs_of(push, "completion", request_id)
        assert decode.arrived < prefill.answered


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_wrong_identity_given_up_front_fails_no_request(push: PushStack, stream: bool) -> None:
    tmp = push.tmp / f"wrong-identity-{stream}"
    tmp.mkdir()
    for sidecar in sidecar_process(
        tmp, "--engine", "vllm", "--kv-connector", "nixl-push",
        "--engine-url", push.decode_proxy.url, "--nixl-push-engine-id", "operator-typo",
        "--nixl-push-side-channel-port", str(push.side_channel_port),
    ):
        body = body_of("completion", f"push-typo-{stream}", stream=stream)
        expected = baseline_text(push, "completion", body)
        first = f"typo-{uuid.uuid4().hex[:8]}"
        assert send(push, "completion", body, first, sidecar) == expected
        prefills, decodes = legs_of_all(push, "completion", first)
        # One prefill; the first decode went with the wrong identity and was refused (JSON:
        # 500; a stream: 200, an error event first), or, when the prefill's answer came
        # first, stopped by the sidecar before it answered; either way it went again from
        # the prefill's answer, and that one was delivered whole.
        assert len(prefills) == 1
        refused = 200 if stream else 500
        assert len(decodes) == 2, decodes
        assert decodes[0].status == refused or not decodes[0].completed, decodes
        assert decodes[1].status == 200 and decodes[1].completed, decodes
        assert "refused a stale hand-off" in (tmp / "sidecar.log").read_text()
        body = body_of("completion", f"push-typo-after-{stream}", stream=not stream)
        after = f"after-{uuid.uuid4().hex[:8]}"
        assert send(push, "completion", body, after, sidecar) == baseline_text(
            push, "completion", body)
        prefill_leg, decode_leg = legs_of(push, "completion", after)
        assert decode_leg.arrived < prefill_leg.answered


def test_a_restarted_prefill_engine_is_learned_again_without_a_failed_request(
    push: PushStack,
) -> None:
    learned(push)
    old = push.group.stop(PREFILL)
    push.group.start([prefill_spec(RESTARTED_ENGINE_ID, old.port, push.side_channel_port)])
    body = body_of("completion", "push-restarted")
    expected = baseline_text(push, "completion", body)
    discovering = f"restart-{uuid.uuid4().hex[:8]}"
    # The decode engine knew the old identity, so it waits on the gone engine's agent (it
    # does not refuse); the prefill's answer shows the new one, the sidecar stops that decode
    # and sends it again from the answer.
    assert send(push, "completion", body, discovering) == expected
    prefills, decodes = legs_of_all(push, "completion", discovering)
    assert len(prefills) == 1, prefills
    assert 1 <= len(decodes) <= 2 and decodes[-1].status == 200, decodes
    assert decodes[-1].completed, decodes
    body = body_of("completion", "push-restarted-stream", stream=True)
    after = f"restarted-{uuid.uuid4().hex[:8]}"
    assert send(push, "completion", body, after) == baseline_text(push, "completion", body)
    prefill, decode = legs_of(push, "completion", after)
    assert decode.arrived < prefill.answered
    answer = post_json(push.prefill.url + "/v1/completions",
                       {**body_of("completion", "push-id-check", max_tokens=1),
                        "kv_transfer_params": {"do_remote_decode": True}})
    assert answer["kv_transfer_params"]["remote_engine_id"] == RESTARTED_ENGINE_ID


def _decode_params(push: PushStack, engine_id: str, request_id: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": engine_id, "remote_host": "127.0.0.1",
            "remote_port": push.side_channel_port, "tp_size": 1, "pp_size": 1,
            "remote_request_id": request_id}


def _both_legs(push: PushStack, body: dict[str, Any], engine_id: str, request_id: str,
               stream: bool) -> tuple[int, str]:
    """Both legs straight to the engines, at once; the decode's status and body."""
    prefill = {**body, "max_tokens": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    decode = {**body, "stream": stream,
              "kv_transfer_params": _decode_params(push, engine_id, request_id)}

    def post(url: str, payload: dict[str, Any]) -> tuple[int, str]:
        request = urllib.request.Request(
            url, data=json.dumps(payload).encode(), method="POST",
            headers={"Content-Type": "application/json", "X-Request-Id": request_id})
        try:
            with urllib.request.urlopen(request, timeout=CLIENT_TIMEOUT_S) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as error:
            return int(error.code), error.read().decode()

    with ThreadPoolExecutor(max_workers=2) as pool:
        pre = pool.submit(post, push.prefill.url + "/v1/completions", prefill)
        dec = pool.submit(post, push.decode.url + "/v1/completions", decode)
        assert pre.result()[0] == 200
        return dec.result()


def test_a_corrupted_identity_fails_the_decode(push: PushStack) -> None:
    # Last in the module: on CPU a push decode engine that refused two registrations may
    # stall its next transfer past a minute (measured once: "No available shared memory
    # broadcast block found in 60 seconds"), so nothing runs after this one.
    restarted = push.prefill.spec.kv_transfer_config or {}
    engine_id = restarted.get("engine_id", PREFILL_ENGINE_ID)
    body = body_of("completion", "push-corrupted")
    expected = baseline_text(push, "completion", body)
    # Control: the true identity gives the baseline, so the engine id is the only change.
    status, answer = _both_legs(push, body, engine_id, f"ok-{uuid.uuid4().hex[:8]}",
                                stream=False)
    assert status == 200, answer
    assert text_of(json.loads(answer)) == expected
    status, answer = _both_legs(push, body, "not-the-prefill-engine",
                                f"bad-{uuid.uuid4().hex[:8]}", stream=False)
    assert status == 500, answer
    assert "Internal server error" in answer
    status, answer = _both_legs(push, body, "not-the-prefill-engine",
                                f"bad-{uuid.uuid4().hex[:8]}", stream=True)
    assert status == 200, answer
    first_event = answer.split("\n\n", 1)[0]
    assert first_event.startswith("data: ") and '"error"' in first_event, answer
    log = push.decode.log_path.read_text(errors="replace")
    assert "Remote NIXL agent engine ID mismatch" in log
