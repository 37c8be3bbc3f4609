"""Paced PD streams through ``disagg-sidecar serve --workers N``: tokens/s and sidecar CPU.

    python -m bench.workers_scaling --workers 1,2 --sidecar-cpus 0 --bench-cpus 1

Two aiohttp stub engines (vLLM NIXL pair, ``sidecar.tools.stubs``) pace their tokens like an engine
(``--itl``, 10 ms: every token is its own read and write in the sidecar, the costliest
cadence per token); one load generator keeps ``--concurrency`` streams of ``--tokens`` tokens
open. Over the measured window it reports tokens/s and the CPU of the whole sidecar process
tree (supervisor and workers, from ``psutil``) per token and in cores. ``--sidecar-cpus`` and
``--bench-cpus`` pin the two sides apart with ``taskset`` where the machine has the cores.

Deliberate limits: the stubs and the load generator are aiohttp (the lean bench engine has no
pacing), so on a small machine they, not the sidecar, bound the tokens/s; the figure to read
there is the sidecar's CPU per token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil  # type: ignore[import-untyped]

REPO_ROOT = Path(__file__).resolve().parent.parent


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and every live descendant."""
    root = psutil.Process(pid)
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _pinned(cpus: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def start(
    args: argparse.Namespace, workers: int, log: Any
) -> tuple[list[subprocess.Popen[str]], str, int]:
    """The stubs and the sidecar, listening: the processes, the sidecar's URL, the prefill port."""
    procs: list[subprocess.Popen[str]] = []
    ports: dict[str, int] = {}
    try:
        for role in ("prefill", "decode"):
            stub = subprocess.Popen(
                _pinned(args.bench_cpus, [sys.executable, "-m", "sidecar.tools.stubs", "--engine",
                                          "vllm", "--role", role, "--port", "0", "--itl",
                                          str(args.itl), "--record-limit", "0"]),
                stdout=subprocess.PIPE, stderr=log, cwd=REPO_ROOT, text=True,
            )
            procs.append(stub)
            assert stub.stdout is not None
            ports[role] = int(json.loads(stub.stdout.readline())["port"])
        with tempfile.TemporaryDirectory() as scratch:
            ports_file = Path(scratch) / "ports.json"
            sidecar = subprocess.Popen(
                _pinned(args.sidecar_cpus, [
                    sys.executable, "-m", "sidecar", "serve", "--workers", str(workers),
                    "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0",
                    "--log-level", "warning", "--ports-file", str(ports_file),
                    "--engine-url", f"http://127.0.0.1:{ports['decode']}",
                    "--prefill-allowlist", f"127.0.0.1:{ports['prefill']}"]),
                stdout=log, stderr=log, cwd=REPO_ROOT, text=True,
            )
            procs.append(sidecar)
            while not ports_file.exists():  # written once every worker listens
                if sidecar.poll() is not None:
                    raise RuntimeError("the sidecar exited before listening")
                time.sleep(0.1)
            http_port = json.loads(ports_file.read_text())["http"]
    except BaseException:
        stop(procs)
        raise
    return procs, f"http://127.0.0.1:{http_port}/v1/completions", ports["prefill"]


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for process in reversed(procs):
        process.terminate()
        process.wait(timeout=60)


async def _load(
    args: argparse.Namespace, url: str, prefill_port: int, sidecar_pid: int, workers: int
) -> dict[str, Any]:
    body = {"model": "stub-model", "prompt": "scale", "max_tokens": args.tokens, "stream": True}
    headers = {"x-prefiller-host-port": f"127.0.0.1:{prefill_port}"}
    counts = {"tokens": 0, "errors": 0}
    stop_at = time.monotonic() + args.warmup + args.seconds

    async def stream(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop_at:
            async with session.post(url, json=body, headers=headers) as response:
                if response.status != 200:
                    counts["errors"] += 1
                    await response.read()
                    continue
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        counts["tokens"] += 1

    async def window() -> tuple[float, float, float]:
        await asyncio.sleep(args.warmup)
        cpu0, t0, tokens0 = tree_cpu_seconds(sidecar_pid), time.monotonic(), counts["tokens"]
        await asyncio.sleep(args.seconds)
        cpu1, t1, tokens1 = tree_cpu_seconds(sidecar_pid), time.monotonic(), counts["tokens"]
        tokens = max(tokens1 - tokens0, 1)
        return tokens / (t1 - t0), (cpu1 - cpu0) / tokens, (cpu1 - cpu0) / (t1 - t0)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = [asyncio.ensure_future(stream(session)) for _ in range(args.concurrency)]
        rate, cpu_per_token, cores = await window()
        await asyncio.gather(*streams)
    return {
        "workers": workers, "sidecar_cpus": args.sidecar_cpus, "bench_cpus": args.bench_cpus,
        "concurrency": args.concurrency, "itl_ms": args.itl * 1e3,
        "tokens_per_s": round(rate), "sidecar_us_per_token": round(cpu_per_token * 1e6, 1),
        "sidecar_cores": round(cores, 2), "errors": counts["errors"],
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def run(args: argparse.Namespace) -> int:
    if args.bench_cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in args.bench_cpus.split(",")})
    with tempfile.NamedTemporaryFile("w", prefix="workers-scaling-", suffix=".log",
                                     delete=False) as log:
        for _ in range(args.repeat):
            for workers in (int(w) for w in args.workers.split(",")):
                procs, url, prefill_port = start(args, workers, log)
                try:
                    result = asyncio.run(_load(args, url, prefill_port, procs[-1].pid, workers))
                finally:
                    stop(procs)
                print(json.dumps(result), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--sidecar-cpus", default="", help="taskset list for the sidecar")
    parser.add_argument("--bench-cpus", default="", help="taskset list for stubs and load")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--itl", type=float, default=0.01, help="seconds between tokens")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeat", type=int, default=1)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
