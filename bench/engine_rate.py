"""How many requests one stub engine serves on one core: lean versus aiohttp.

    python -m bench.engine_rate [--stubs lean,aiohttp] [--seconds 4] [--concurrency 64]

Starts a vLLM decode stub pinned to core 0 (``taskset``), pins this process (the lean load
generator) to core 1 where there is one, and runs a closed loop of ``GET /health`` and of
16-token JSON completions (no hand-off): requests/s, the share of core 0 the stub used,
and its CPU per request from ``/proc``.

Deliberate limits: Linux with ``taskset``; the machine's other load still shares core 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import orjson
import uvloop

from bench import procs
from bench.flows import PROMPT
from bench.lean_client import Client, Origin

_ARGS = {
    "lean": ["--transport", "lean"],
    "aiohttp": ["--transport", "aiohttp", "--record-limit", "0"],
}


def start(stubs: str) -> tuple[subprocess.Popen[bytes], int]:
    """The stub, pinned to core 0; returns it and its port."""
    extra = _ARGS[stubs]
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    popen = subprocess.Popen(
        [*pin, sys.executable, "-m", "sidecar.tools.stubs", "--engine", "vllm", "--role", "decode",
         "--port", "0", *extra],
        stdout=subprocess.PIPE, env=procs.child_env(), cwd=procs.REPO_ROOT,
    )
    assert popen.stdout is not None
    info = json.loads(popen.stdout.readline())
    return popen, int(info["port"])


async def measure(pid: int, port: int, path: str, max_tokens: int, concurrency: int,
                  seconds: float) -> str:
    origin = Origin("127.0.0.1", port)
    body = orjson.dumps({"model": "stub-model", "prompt": PROMPT, "max_tokens": max_tokens})
    done = 0
    stopping = False

    async def worker() -> None:
        nonlocal done
        client = Client()
        try:
            while not stopping:
                if path == "/health":
                    answer = await client.request(origin, "GET", path)
                else:
                    answer = await client.request(
                        origin, "POST", path, {"content-type": "application/json"}, body
                    )
                if answer.status != 200:
                    raise RuntimeError(f"HTTP {answer.status}: {answer.body[:200]!r}")
                done += 1
        finally:
            await client.close()

    workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    await asyncio.sleep(0.5)
    n0, cpu0, t0 = done, procs.cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    n1, cpu1, t1 = done, procs.cpu_seconds(pid), time.perf_counter()
    stopping = True
    await asyncio.gather(*workers)
    n, wall, cpu = max(n1 - n0, 1), t1 - t0, cpu1 - cpu0
    what = "GET /health" if path == "/health" else f"completion ({max_tokens} tokens)"
    return (f"{what:24} {n / wall:8.0f} req/s  stub used {cpu / wall:.2f} core, "
            f"{cpu / n * 1e6:.1f} us/req")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_rate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--stubs", default="lean,aiohttp")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    if (os.cpu_count() or 1) > 1:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {1})
    for stubs in args.stubs.split(","):
        popen, port = start(stubs)
        try:
            for path, max_tokens in (("/health", 0), ("/v1/completions", 16)):
                line = uvloop.run(
                    measure(popen.pid, port, path, max_tokens, args.concurrency, args.seconds)
                )
                print(f"{stubs:8} {line}", flush=True)
        finally:
            popen.terminate()
            popen.wait(10)
            if popen.stdout is not None:
                popen.stdout.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
