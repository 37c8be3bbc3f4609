"""Chaos: the prefill engine is killed and restarted under a PD load through the sidecar.

A NIXL pair of real vLLM engines (its own group: the restart must not disturb the session's
stack) behind a sidecar process with the default breaker settings; four clients send PD
requests without pause. The prefill engine is killed (SIGKILL to its process group) and
started again on the same ports. Proves: once it answers its health endpoint, at least 99 %
of the requests started 3 s later succeed with the baseline's output (the decode engine's
own answer to the same prompt, no KV moved), where the circuit breaker used to keep it out
for minutes (its cool-down doubled on each failed trial); while it was down every answer was
a typed error (502/503/504 with the sidecar's JSON), never a hang.

Does not prove the same for the other connectors (one pair is the cost the suite can bear),
nor a restart under a --workers pool.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from real_vllm.client import block_prompt, completion_body, post_json, text_of
from real_vllm.harness import (
    ROUTE_FLAGS,
    Engine,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    _signal_group,
    nixl_config,
)
from real_vllm.sidecar_process import PREFILL_HEADER, Sidecar, sidecar_process

COMPLETIONS = "/v1/completions"
CLIENTS = 4
PROMPTS = 4
#: Requests started this long after the engine answers its health endpoint must succeed.
GRACE_S = 3.0
#: How long the load runs after the grace, to count enough requests.
MEASURE_S = 20.0


@dataclass
class Outcome:
    started: float
    ok: bool
    status: int


@pytest.fixture(scope="module")
def nixl_group(engine_env: EngineEnv) -> Iterator[EngineGroup]:
    with EngineGroup(engine_env) as group:
        group.start([
            EngineSpec("restart-prefill", nixl_config("kv_producer"), cpu=0,
                       extra_args=ROUTE_FLAGS),
            EngineSpec("restart-decode", nixl_config("kv_consumer"), cpu=1,
                       prefix_caching=False, extra_args=ROUTE_FLAGS),
        ])
        yield group


def kill_and_restart(group: EngineGroup, name: str) -> Engine:
    """Kill engine ``name`` outright (SIGKILL to its process group), then start it again on
    the same ports and wait until it answers its health endpoint."""
    _signal_group(group.engines[name].process, signal.SIGKILL)
    return group.restart(name)


def send(sidecar: Sidecar, body: dict[str, object], target: str) -> tuple[int, str]:
    request = urllib.request.Request(
        sidecar.url + COMPLETIONS, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", PREFILL_HEADER: target}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, text_of(json.loads(response.read()))
    except urllib.error.HTTPError as error:
        payload = json.loads(error.read())
        assert set(payload) == {"error"} and payload["error"]["code"], payload
        return error.code, ""


def test_a_restarted_prefill_engine_serves_again_within_3_s(
        nixl_group: EngineGroup, tmp_path: Path) -> None:
    prefill, decode = nixl_group.engines["restart-prefill"], nixl_group.engines["restart-decode"]
    target = f"127.0.0.1:{prefill.port}"
    bodies = [completion_body(block_prompt(f"restart-{k}"), max_tokens=8)
              for k in range(PROMPTS)]
    expected = [text_of(post_json(decode.url + COMPLETIONS, body)) for body in bodies]
    outcomes: list[Outcome] = []
    stop = threading.Event()
    sidecars = sidecar_process(tmp_path, "--engine", "vllm", "--kv-connector", "shfs",
                               "--engine-url", decode.url)
    sidecar = next(sidecars)
    try:
        def client(k: int) -> None:
            n = k
            while not stop.is_set():
                started = time.monotonic()
                status, text = send(sidecar, bodies[n % PROMPTS], target)
                outcomes.append(Outcome(started, status == 200 and text == expected[n % PROMPTS],
                                        status))
                n += 1

        for body, text in zip(bodies, expected, strict=True):  # the pair works before
            assert send(sidecar, body, target) == (200, text)
        with ThreadPoolExecutor(CLIENTS) as pool:
            running = [pool.submit(client, k) for k in range(CLIENTS)]
            kill_and_restart(nixl_group, "restart-prefill")
            healthy_at = time.monotonic()  # within the harness's health poll (0.25 s)
            time.sleep(GRACE_S + MEASURE_S)  # the load runs meanwhile
            stop.set()
            for done in running:
                done.result()
    finally:
        sidecars.close()
    after = [o for o in outcomes if o.started >= healthy_at + GRACE_S]
    during = [o for o in outcomes if o.started < healthy_at]
    assert len(after) >= 20, len(after)
    succeeded = sum(o.ok for o in after)
    assert succeeded >= 0.99 * len(after), (succeeded, len(after),
                                             [o.status for o in after if not o.ok])
    assert {o.status for o in during} <= {200, 502, 503, 504}
