"""TTFT of NIXL push against NIXL pull through the sidecar, on real vLLM engines (CPU).

    flock /tmp/real-vllm.lock .venv/bin/python -m real_vllm.bench_push_pull [--requests N]
    (run from tests/, or with tests/ on PYTHONPATH; the engine environment of setup_env.sh)

One run, two phases on the same machine, each with its own engine pair (the same model and
flags: ``--enforce-eager --block-size 32``, CPU KV buffer, UCX on ``lo``, the suite's 100 ms
NIXL poll delay, the prefill pinned to core 0 and the decode to core 1 with each NIXL worker
kept on its engine's core (see ``test_nixl_push.py``), decode without prefix caching):

1. pull: NixlConnector producer/consumer, the sidecar's ``--kv-connector shfs`` (prefill,
   then decode; the decode engine reads the KV);
2. push: NixlPushConnector producer/consumer, two sidecars on the same engines, taken in
   turn request by request: ``--kv-connector nixl-push`` (both legs at once once the
   identity is learned; the prefill engine writes the KV) and ``--kv-connector shfs`` (the
   same push engines driven one leg after the other: what the overlap alone is worth).

Each request is a streamed completion of a prompt of its own (about 170 tokens, so the
prefill engine's prefix cache never helps), one at a time; TTFT is the client's time from
sending to the first content byte through the sidecar. A warm-up request per sidecar is not
counted (it learns the identity, opens connections). Prints p50 and p90 per way, in ms, as
soon as each phase ends; a request past ``REQUEST_TIMEOUT_S`` is counted as timed out, apart.

Deliberate limits: CPU engines and a tiny model: a prefill takes tens of milliseconds and the
hop the push saves is a loopback round trip plus the decode's own scheduling, so the figure
shows the order of the saving, not a GPU's; the machine is shared, so the phases see
different background load (the push phase's two ways alternate, so those two compare best);
the NIXL poll delay bounds how long a transfer's completion can wait unseen, on both ways.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

from real_vllm.client import block_prompt, completion_body, timed_out
from real_vllm.harness import (
    EngineEnv,
    EngineGroup,
    EngineSpec,
    nixl_config,
    nixl_push_config,
)
from real_vllm.sidecar_process import PREFILL_HEADER, Sidecar, sidecar_process

#: A request's bound: past it the request is counted as timed out (a stall; see
#: probe_push_cpu.py).
REQUEST_TIMEOUT_S = 120.0


def ttft_ms(sidecar: Sidecar, target: str, tag: str) -> float | None:
    """The client's TTFT in ms; None when the request passed ``REQUEST_TIMEOUT_S``."""
    body = completion_body(block_prompt(tag), max_tokens=8, stream=True)
    request = urllib.request.Request(
        sidecar.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", PREFILL_HEADER: target,
                 "X-Request-Id": f"bench-{uuid.uuid4().hex[:12]}"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            for line in response:
                if line.startswith(b"data: {") and b'"text"' in line:
                    first = time.perf_counter()
                    break
            else:
                raise RuntimeError("stream without content")
            response.read()
    except (TimeoutError, urllib.error.URLError) as error:
        if timed_out(error):
            return None
        raise
    return (first - started) * 1000.0


@contextlib.contextmanager
def pair(group: EngineGroup, config: str) -> Iterator[tuple[str, str]]:
    """A prefill/decode pair of ``config`` ("pull" or "push"): (decode URL, prefill target)."""
    if config == "pull":
        prefill_cfg, decode_cfg = nixl_config("kv_producer"), nixl_config("kv_consumer")
    else:
        prefill_cfg = nixl_push_config("kv_producer", f"bench-{uuid.uuid4().hex[:8]}")
        decode_cfg = nixl_push_config("kv_consumer")
    engines = group.start([
        EngineSpec(f"{config}-prefill", prefill_cfg, cpu=0),
        EngineSpec(f"{config}-decode", decode_cfg, cpu=1, prefix_caching=False),
    ])
    try:
        yield engines[f"{config}-decode"].url, f"127.0.0.1:{engines[f'{config}-prefill'].port}"
    finally:
        for name in list(engines):
            group.stop(name)


def percentiles(values: list[float | None]) -> str:
    answered = [value for value in values if value is not None]
    timed_out = len(values) - len(answered)
    if len(answered) < 2:
        return f"too few answers ({len(answered)}; {timed_out} timed out)"
    cuts = statistics.quantiles(answered, n=10, method="inclusive")
    return (f"p50 {statistics.median(answered):7.1f}  p90 {cuts[8]:7.1f}  "
            f"(n={len(answered)}, {timed_out} timed out at {REQUEST_TIMEOUT_S:.0f} s)")


def report(name: str, values: list[float | None]) -> None:
    load = os.getloadavg()[0]
    print(f"{name:40s} TTFT ms  {percentiles(values)}  "
          f"[{time.strftime('%H:%M:%S', time.gmtime())} UTC, load {load:.1f}]", flush=True)


def run(requests: int) -> dict[str, list[float | None]]:
    """Each way's TTFTs (None: timed out), each way reported as soon as it has them."""
    results: dict[str, list[float | None]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-push-pull-"))
    for name in ("pull", "nixl-push", "shfs"):
        (tmp / name).mkdir()
    with EngineGroup(EngineEnv.locate()) as group:
        with pair(group, "pull") as (decode, target):
            for sidecar in sidecar_process(tmp / "pull", "--engine", "vllm", "--kv-connector",
                                           "shfs", "--engine-url", decode):
                ttft_ms(sidecar, target, "warm-pull")
                results["pull engines, shfs (sequential)"] = [
                    ttft_ms(sidecar, target, f"pull-{i}") for i in range(requests)]
        report("pull engines, shfs (sequential)", results["pull engines, shfs (sequential)"])
        with pair(group, "push") as (decode, target):
            ways = {"push engines, nixl-push (concurrent)": "nixl-push",
                    "push engines, shfs (sequential)": "shfs"}
            with contextlib.ExitStack() as stack:
                sidecars = {}
                for name, connector in ways.items():
                    sidecars[name] = stack.enter_context(contextlib.contextmanager(
                        sidecar_process)(tmp / connector, "--engine", "vllm", "--kv-connector",
                                         connector, "--engine-url", decode))
                    ttft_ms(sidecars[name], target, f"warm-{connector}")
                    results[name] = []
                for i in range(requests):
                    for name in ways:  # in turn: both ways see the same background load
                        results[name].append(ttft_ms(sidecars[name], target, f"{name}-{i}"))
        for name in ways:
            report(name, results[name])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    run(args.requests)


if __name__ == "__main__":
    main()
