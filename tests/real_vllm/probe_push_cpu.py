"""Probes how vLLM 0.32's NIXL push engines behave on this machine's CPUs (issues #30, #38).

    cd tests && flock /tmp/real-vllm.lock ../.venv/bin/python -m real_vllm.probe_push_cpu \\
        [--ways spin,vllm-cores,own-cores] [--requests N] [--out FILE]

Per way, a NixlPushConnector pair (``kv_producer`` with a fixed ``engine_id``, ``kv_consumer``
without prefix caching; ``kv_buffer_device: cpu``, vLLM's default 30 s lease), then:
- the cores each engine's worker process's main thread may run on (it runs the model, and
  every NIXL thread the worker starts inherits its cores), and the CPU each idle engine
  takes (psutil, all its processes, over 5 s);
- N requests, one at a time, both legs at once straight to the engines (no sidecar): the
  seconds until each leg's answer, or ``null`` where a leg passed ``--timeout-s``.

Ways (set through the harness and the suite's start-up hook, ``nixl_hook.py``):
``spin``: no core pinning, no NIXL poll delay (how ``test_nixl_push.py`` ran until issue #38);
``vllm-cores``: the prefill pinned to core 0 and the decode to core 1, the suite's 100 ms poll
delay, and vLLM's own placement of its NIXL worker (moved to the machine's last core);
``own-cores``: the same, each NIXL worker kept on its engine's core (the suite's setting).

Prints one JSON object per way, and all of them to ``--out``.

Deliberate limits: the tiny model on CPU, so the figures say whether the engines stall, not
what push costs on GPUs; one machine, one run.
"""

from __future__ import annotations

import argparse
import json
import os
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
    Engine,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    free_port,
    nixl_push_config,
)

PREFILL_ENGINE_ID = "probe-push-prefill"
#: Engine environment per way, over the harness's (pinned, 100 ms delay, workers kept).
WAYS: dict[str, dict[str, str]] = {
    "spin": {"DISAGG_NIXL_PTHR_DELAY_US": "", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
             "DISAGG_NIXL_KEEP_CORES": ""},
    "vllm-cores": {"DISAGG_NIXL_KEEP_CORES": ""},
    "own-cores": {},
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


def worker_cores(engine: Engine) -> list[list[int]]:
    """The cores of each worker process's main thread (its tid is its pid)."""
    root = psutil.Process(engine.process.pid)
    return [sorted(os.sched_getaffinity(process.pid))
            for process in root.children(recursive=True) if "Worker" in process.name()]


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
    with EngineGroup(EngineEnv.locate()) as group:
        started = time.monotonic()
        group.start([
            EngineSpec("probe-prefill", nixl_push_config("kv_producer", PREFILL_ENGINE_ID),
                       cpu=0, side_channel_port=side_channel_port, extra_env=environ),
            EngineSpec("probe-decode", nixl_push_config("kv_consumer"), cpu=1,
                       prefix_caching=False, side_channel_port=decode_side_channel_port,
                       extra_env=environ),
        ])
        prefill, decode = group.engines["probe-prefill"], group.engines["probe-decode"]
        result: dict[str, Any] = {
            "way": way, "ready_s": round(time.monotonic() - started, 1),
            "load_before": os.getloadavg()[0],
            "worker_cores": {"prefill": worker_cores(prefill),
                             "decode": worker_cores(decode)},
            "idle_cpu_percent": {"prefill": idle_cpu_percent(prefill),
                                 "decode": idle_cpu_percent(decode)},
        }
        runs = [push_request(prefill, decode, side_channel_port, i, timeout_s)
                for i in range(requests)]
    result["load_after"] = os.getloadavg()[0]
    answered = sorted(run["decode_s"] for run in runs if run["decode_s"] is not None)
    result["requests"] = runs
    result["decode_timed_out"] = requests - len(answered)
    if answered:
        result["decode_s_median"] = statistics.median(answered)
        result["decode_s_max"] = answered[-1]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ways", default="spin,vllm-cores,own-cores",
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
