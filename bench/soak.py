"""Soak: sustained load through the sidecar on loopback, watching its memory and open files.

    python -m bench.soak --minutes 10 --concurrency 256          # vLLM NIXL pair
    python -m bench.soak --engine sglang --minutes 5 --concurrency 128

Two stub engines and the sidecar run as their own processes (``bench.procs``); C workers
send requests in a closed loop for the whole run, alternating streamed and JSON answers on
``/v1/completions`` and ``/v1/chat/completions``. Every ``--sample-s`` seconds the sidecar's
resident memory (``VmRSS``) and open file descriptors (``/proc/<pid>/fd``) are sampled. The
report compares the first and the last minute (mean of their samples): a leak of memory,
connections or tasks shows as growth. Errors are any answer other than a complete 200 (a
stream must end with ``[DONE]``).

Output: a summary table on stdout (paste into docs/operating/reliability.md) and JSON with every
sample in
``bench/results/soak-<time>.json``.

Deliberate limits: loopback only, stubs in zero-latency mode; the load generator is Python
and shares the machine's cores with everything else, so requests/s is the system's, not the
sidecar's alone. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs

RESULTS = procs.REPO_ROOT / "bench" / "results"
PROMPT = "Soak: the same sidecar, hour after hour, with nothing left behind."
ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Counts:
    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def fail(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    return sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


def body_for(route: str, stream: bool, max_tokens: int) -> bytes:
    body: dict[str, Any] = {"model": "stub-model", "max_tokens": max_tokens, "stream": stream}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return json.dumps(body).encode()


async def worker(index: int, url: str, target: str, max_tokens: int, deadline: float,
                 counts: Counts, session: aiohttp.ClientSession) -> None:
    headers = {"Content-Type": "application/json", "x-prefiller-host-port": target}
    bodies = [(route, stream, body_for(route, stream, max_tokens))
              for route in ROUTES for stream in (True, False)]
    n = index
    while time.monotonic() < deadline:
        route, stream, body = bodies[n % len(bodies)]
        n += 1
        try:
            async with session.post(url + route, data=body, headers=headers) as response:
                data = await response.read()
                if response.status != 200:
                    counts.fail(f"http_{response.status}")
                elif stream and not data.rstrip().endswith(b"data: [DONE]"):
                    counts.fail("stream_without_done")
                else:
                    counts.requests += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            counts.fail(type(exc).__name__)


async def sampler(pid: int, every_s: float, deadline: float, started: float,
                  counts: Counts, samples: list[dict[str, Any]]) -> None:
    while True:
        samples.append({
            "t_s": round(time.monotonic() - started, 1),
            "rss_kib": rss_kib(pid),
            "fds": open_fds(pid),
            "requests": counts.requests,
            "errors": counts.errors,
        })
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(every_s, max(deadline - time.monotonic(), 0.0)))


def window(samples: list[dict[str, Any]], start_s: float, end_s: float) -> dict[str, float]:
    chosen = [s for s in samples if start_s <= s["t_s"] <= end_s] or samples[:1]
    return {
        "rss_mib": round(statistics.mean(s["rss_kib"] for s in chosen) / 1024, 1),
        "fds": round(statistics.mean(s["fds"] for s in chosen), 1),
    }


async def drive(args: argparse.Namespace, sidecar: procs.Proc, target: str) -> dict[str, Any]:
    counts = Counts()
    samples: list[dict[str, Any]] = []
    seconds = args.minutes * 60
    connector = aiohttp.TCPConnector(limit=args.concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     trust_env=False) as session:
        started = time.monotonic()
        deadline = started + seconds
        tasks = [asyncio.ensure_future(worker(i, sidecar.url, target, args.max_tokens,
                                              deadline, counts, session))
                 for i in range(args.concurrency)]
        watch = asyncio.ensure_future(sampler(procs.server_pid(sidecar), args.sample_s,
                                              deadline, started, counts, samples))
        await asyncio.gather(*tasks)
        await watch
        wall = time.monotonic() - started
    # Once idle: the pool's keep-alive connections to the engines may remain (bounded).
    idle = {"rss_mib": round(rss_kib(sidecar.pid) / 1024, 1), "fds": open_fds(sidecar.pid)}
    minute = min(60.0, seconds / 3)
    return {
        "requests": counts.requests,
        "errors": counts.errors,
        "error_kinds": counts.error_kinds,
        "wall_s": round(wall, 1),
        "rps": round(counts.requests / wall, 1),
        "first_minute": window(samples, 0.0, minute),
        "last_minute": window(samples, seconds - minute, seconds + 1),
        "after_load": idle,
        "samples": samples,
    }


@contextlib.contextmanager
def stack(args: argparse.Namespace, log_dir: Path) -> Iterator[tuple[procs.Proc, str]]:
    started: list[procs.Proc] = []
    try:
        # The reference stubs (sidecar.tools.stubs): the soak sends chat and completions, streamed
        # and JSON, on every engine; the bench's lean engine serves completions only.
        prefill = procs.start_stub("soak-prefill", args.engine, "prefill", args.connector,
                                   log_dir=log_dir, kind="aiohttp")
        started.append(prefill)
        decode = procs.start_stub("soak-decode", args.engine, "decode", args.connector,
                                  log_dir=log_dir, kind="aiohttp")
        started.append(decode)
        flags = ["--engine", args.engine, "--engine-url", decode.url,
                 "--prefill-allowlist", f"127.0.0.1:{prefill.port}",
                 "--max-inflight", str(max(1024, args.concurrency * 2))]
        if args.engine == "vllm":
            flags += ["--kv-connector", args.connector]
        bootstrap = prefill.info.get("bootstrap_port")
        if bootstrap:
            flags += ["--sglang-bootstrap-port", str(bootstrap),
                      "--mooncake-bootstrap-port", str(bootstrap)]
        sidecar = procs.start_sidecar("soak-sidecar", flags, log_dir=log_dir, prefix=[])
        started.append(sidecar)
        yield sidecar, f"127.0.0.1:{prefill.port}"
    finally:
        for proc in reversed(started):
            procs.stop(proc)


def machine() -> str:
    cpu = procs.cpu_model() or "unknown CPU"
    return f"{cpu}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python " \
           f"{platform.python_version()}"


def markdown(report: dict[str, Any]) -> str:
    first, last, idle = report["first_minute"], report["last_minute"], report["after_load"]
    rows = [
        ("command", f"`{report['command']}`"),
        ("machine", report["machine"]),
        ("pair, concurrency, duration",
         f"{report['engine']}/{report['connector']}, {report['concurrency']}, "
         f"{report['wall_s']} s"),
        ("requests (streamed and JSON, completions and chat)", f"{report['requests']:,}"),
        ("errors", f"{report['errors']} {report['error_kinds'] or ''}".strip()),
        ("requests/s", str(report["rps"])),
        ("sidecar RSS, first minute -> last minute (MiB)",
         f"{first['rss_mib']} -> {last['rss_mib']}"),
        ("sidecar open fds, first minute -> last minute", f"{first['fds']} -> {last['fds']}"),
        ("after the load stopped: RSS (MiB), fds", f"{idle['rss_mib']}, {idle['fds']}"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--connector", default="shfs")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = RESULTS / f"logs-soak-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with stack(args, log_dir) as (sidecar, target):
        result = asyncio.run(drive(args, sidecar, target))
    report = {
        "command": "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "engine": args.engine,
        "connector": args.connector,
        "concurrency": args.concurrency,
        **result,
    }
    out = args.out or RESULTS / f"soak-{stamp}.json"
    out.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    print(f"\nsamples: {out}")
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
