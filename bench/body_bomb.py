"""What compressed request bodies that stall cost the sidecar's memory (issue 34, item 1).

    python -m bench.body_bomb [--connections 8] [--before-tree DIR]

Two stub engines and the sidecar (each its own process, ``bench.procs``); the sidecar's
resident memory (``VmRSS``) is read before and while ``--connections`` clients each send a
gzip body of about 31 KB that inflates to just under the 32 MiB body cap, then stall (the
declared length is 100 bytes longer than what they send), on the PD path and on the
passthrough. The figure is the largest RSS seen within ``--watch-s`` seconds of the last
client's bytes, and what each client got back (a 413 at once, or nothing: its body still
held). ``--before-tree DIR`` runs the same against another checkout (``git worktree add DIR
<commit>``), in the same run, for a before/after comparison on one machine state.

Deliberate limits: RSS is the process's, allocator slack included; one shape of body.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import procs

INFLATED = 32 * 1024 * 1024 - 64 * 1024


def bomb() -> bytes:
    head, tail = b'{"model": "stub-model", "prompt": "', b'", "max_tokens": 1}'
    return gzip.compress(head + b"x" * (INFLATED - len(head) - len(tail)) + tail, mtime=0)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def one_client(port: int, packed: bytes, target: str | None) -> str:
    routing = f"x-prefiller-host-port: {target}\r\n" if target else ""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\n"
            f"Content-Type: application/json\r\nContent-Encoding: gzip\r\n{routing}"
            f"Content-Length: {len(packed) + 100}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + packed)
    await writer.drain()
    try:
        line = await reader.readline()
        return line.decode(errors="replace").split(" ", 2)[1] if line else "closed"
    finally:
        writer.close()


async def attack(pid: int, port: int, target: str | None, connections: int,
                 watch_s: float) -> dict[str, Any]:
    packed = bomb()
    idle = rss_mib(pid)
    clients = [asyncio.ensure_future(one_client(port, packed, target))
               for _ in range(connections)]
    peak = idle
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        peak = max(peak, rss_mib(pid))
        await asyncio.sleep(0.05)
    answered = [client.result() if client.done() else "held" for client in clients]
    for client in clients:
        client.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    return {"sent_kb_per_client": round(len(packed) / 1024, 1),
            "sent_kb_total": round(connections * len(packed) / 1024, 1),
            "rss_idle_mib": round(idle, 1), "rss_peak_mib": round(peak, 1),
            "answers": answered}


def measure(tree: Path, connections: int, watch_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        prefill = procs.start_stub("prefill", "vllm", "prefill", "shfs", log_dir=log_dir)
        decode = procs.start_stub("decode", "vllm", "decode", "shfs", log_dir=log_dir)
        results: dict[str, Any] = {}
        try:
            for path, target in (("pd", f"127.0.0.1:{prefill.port}"), ("passthrough", None)):
                flags = procs.sidecar_flags("vllm", "shfs", prefill, decode, 64)
                sidecar = procs.start_sidecar("sidecar", flags, log_dir=log_dir, prefix=[],
                                              code_root=tree)
                try:
                    results[path] = asyncio.run(attack(
                        procs.server_pid(sidecar), sidecar.port, target, connections,
                        watch_s))
                finally:
                    procs.stop(sidecar)
        finally:
            procs.stop(prefill)
            procs.stop(decode)
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.body_bomb",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--watch-s", type=float, default=5.0,
                        help="seconds RSS is watched after the clients sent (default 5)")
    parser.add_argument("--before-tree", type=Path, default=None,
                        help="another checkout to measure first, in the same run")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {}
    if args.before_tree is not None:
        report["before"] = measure(args.before_tree.resolve(), args.connections, args.watch_s)
    report["after"] = measure(procs.REPO_ROOT, args.connections, args.watch_s)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
