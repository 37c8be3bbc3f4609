"""Probes how vLLM 0.32's NIXL push engines behave on this machine's CPUs (issue #30).

    cd tests && flock /tmp/real-vllm.lock ../.venv/bin/python -m real_vllm.probe_push_cpu \\
        [--ways spin,delay] [--requests N] [--out FILE]

Per way, a NixlPushConnector pair (``kv_producer`` with a fixed ``engine_id`` and a 120 s
lease, ``kv_consumer`` without prefix caching; ``kv_buffer_device: cpu``, no core pinning), then:
- the CPU each idle engine takes (psutil, all its processes, over 5 s), and
- N requests, one at a time, both legs at once straight to the engines (no sidecar): the
  seconds until each leg's answer, or ``null`` where a leg passed ``--timeout-s``.

Ways (NIXL's progress thread, set through the suite's start-up hook, ``nixl_hook.py``):
``spin``: no poll delay (NIXL's default; what ``test_nixl_push.py`` runs);
``delay``: the suite's 100 ms poll delay (what every other NIXL engine of the suite runs).

Prints one JSON object per way, and all of them to ``--out``.

Deliberate limits: the tiny model on CPU, so the figures say whether the engines stall, not
what push costs on GPUs; one machine, one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from real_vllm.client import block_prompt, completion_body, timed_out
from real_vllm.harness import (
    NIXL_PTHR_DELAY_US,
    Engine,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    free_port,
    nixl_push_config,
)

PREFILL_ENGINE_ID = "probe-push-prefill"
UNPINNED = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
WAYS = {
    "spin": {"DISAGG_NIXL_PTHR_DELAY_US": "", **UNPINNED},
    "delay": {"DISAGG_NIXL_PTHR_DELAY_US": str(NIXL_PTHR_DELAY_US), **UNPINNED},
}
IDLE_SAMPLE_S = 5.0


def idle_cpu_percent(engine: Engine) -> int:
    """CPU % of an engine's processes (server, engine core, worker) over ``IDLE_SAMPLE_S``."""
    root = psutil.Process(engine.process.pid)
    processes = [root, *root.children(recursive=True)]
    for process in processes:
        process.cpu_percent(None)
    time.sleep(IDLE_SAMPLE_S)  # a sampling window, not a wait for state
    return round(sum(process.cpu_percent(None) for process in processes))


def timed_post(url: str, body: dict[str, Any], request_id: str,
               timeout_s: float) -> float | None:
    """Seconds until ``url`` answered ``body`` with 200; None past ``timeout_s``."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except (TimeoutError, urllib.error.URLError) as error:
        if timed_out(error):
            return None
        raise
    return round(time.monotonic() - started, 2)


def push_request(prefill: Engine, decode: Engine, side_channel_port: int, index: int,
                 timeout_s: float) -> dict[str, float | None]:
    request_id = f"probe-{index}-{uuid.uuid4().hex[:8]}"
    body = completion_body(block_prompt(f"probe-push-{index}"))
    prefill_leg = {**body, "max_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    decode_leg = {**body, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": PREFILL_ENGINE_ID, "remote_host": "127.0.0.1",
        "remote_port": side_channel_port, "tp_size": 1, "pp_size": 1,
        "remote_request_id": request_id}}
    with ThreadPoolExecutor(max_workers=2) as pool:
        prefill_s = pool.submit(timed_post, prefill.url + "/v1/completions", prefill_leg,
                                request_id, timeout_s)
        decode_s = pool.submit(timed_post, decode.url + "/v1/completions", decode_leg,
                               request_id, timeout_s)
        return {"prefill_s": prefill_s.result(), "decode_s": decode_s.result()}


def probe_way(way: str, requests: int, timeout_s: float) -> dict[str, Any]:
    environ = WAYS[way]
    side_channel_port = free_port()
    decode_side_channel_port = free_port()
    lease = {"kv_connector_extra_config": {"kv_lease_duration": 120}}
    with EngineGroup(EngineEnv.locate()) as group:
        started = time.monotonic()
        group.start([
            EngineSpec("probe-prefill", {**nixl_push_config("kv_producer", PREFILL_ENGINE_ID),
                                         **lease},
                       side_channel_port=side_channel_port, extra_env=environ),
            EngineSpec("probe-decode", nixl_push_config("kv_consumer"), prefix_caching=False,
                       side_channel_port=decode_side_channel_port, extra_env=environ),
        ])
        prefill, decode = group.engines["probe-prefill"], group.engines["probe-decode"]
        result: dict[str, Any] = {
            "way": way, "ready_s": round(time.monotonic() - started, 1),
            "idle_cpu_percent": {"prefill": idle_cpu_percent(prefill),
                                 "decode": idle_cpu_percent(decode)},
        }
        runs = [push_request(prefill, decode, side_channel_port, i, timeout_s)
                for i in range(requests)]
    answered = sorted(run["decode_s"] for run in runs if run["decode_s"] is not None)
    result["requests"] = runs
    result["decode_timed_out"] = requests - len(answered)
    if answered:
        result["decode_s_median"] = statistics.median(answered)
        result["decode_s_max"] = answered[-1]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ways", default="spin,delay",
                        help=f"comma-separated, of: {', '.join(WAYS)}")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="a leg's bound (a leg past it is recorded as null)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    for way in args.ways.split(","):
        result = probe_way(way, args.requests, args.timeout_s)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
