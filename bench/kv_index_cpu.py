"""The sidecar's CPU per request with the KV-event index on and off, in one run (stub engines).

    python -m bench.kv_index_cpu [--requests 300] [--prompt-tokens 2048] [--event-rate 200]

Two sidecars in front of the same vLLM NIXL stub pair (lean transport), each its own process:

    off   the usual flags: every request a prefill/decode pair
    on    + --kv-events-endpoint and --local-prefill-max-uncached-tokens: every request's
          token ids are walked through the index, which a synthetic publisher (this process,
          a ZMQ PUB speaking vLLM 0.32's wire format) keeps busy

The prompts are token ids (completions ``prompt: [ids]``), so the cache rule needs no
tokenize call: the difference between the two is the index's own cost, the lookup per request
and the events it applies meanwhile. The publisher first stores the first half of every
prompt's blocks (each lookup walks that many blocks, then finds the rest uncached: more than
the limit, so the request still runs as a pair, the same path as ``off``), then keeps sending
``--event-rate`` batches a second, each storing and removing a chain of 4 unrelated blocks.
Requests alternate between the two sidecars, one at a time (the same machine state for
both); the table shows each one's CPU per request (``/proc``), and the ``on`` sidecar's CPU
per second while idle with the events flowing.

Deliberate limits: zero-latency stubs and one request at a time: the figures are the
software's cost, not an engine's; block size 16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import zmq

from bench import procs

BLOCK = 16
TOPIC = b"kv"


class Publisher(threading.Thread):
    """A synthetic engine publisher: the prompts' first halves, then a steady churn."""

    def __init__(self, endpoint: str, prompts: list[list[int]], rate: float) -> None:
        super().__init__(daemon=True, name="kv-events-publisher")
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        # An ipc endpoint: the engine's side binds it, the sidecar connects.
        self._pub.bind(endpoint)
        self._prompts = prompts
        self._rate = rate
        self._sequence = 0
        self._stopping = threading.Event()
        self.sent = 0

    def send(self, events: list[dict[str, Any]]) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        self._pub.send_multipart([TOPIC, self._sequence.to_bytes(8, "big"), payload])
        self._sequence += 1
        self.sent += 1

    def store_halves(self) -> int:
        """One BlockStored per prompt, its first half's whole blocks; the blocks stored."""
        total = 0
        for number, prompt in enumerate(self._prompts):
            blocks = len(prompt) // 2 // BLOCK
            hashes = [f"p{number}-{i}".encode() for i in range(blocks)]
            self.send([_stored(hashes, None, prompt[:blocks * BLOCK])])
            total += blocks
        return total

    def run(self) -> None:
        rng = random.Random(7)
        period = 1.0 / self._rate
        count = 0
        while not self._stopping.wait(period):
            hashes = [f"c{count}-{i}".encode() for i in range(4)]
            tokens = [rng.randrange(100_000) for _ in range(4 * BLOCK)]
            self.send([_stored(hashes, None, tokens),
                       {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}])
            count += 1

    def close(self) -> None:
        self._stopping.set()
        self.join(timeout=5)
        self._pub.close(linger=0)
        self._context.term()


def _stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0}


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], target: str) -> None:
    body = {"model": "stub", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body,
                            headers={"x-prefiller-host-port": target}) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}")


async def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    rng = random.Random(11)
    prompts = [[rng.randrange(100_000) for _ in range(args.prompt_tokens)]
               for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="kv-index-") as tmp:
        endpoint = f"ipc://{tmp}/events"
        started: list[procs.Proc] = []
        publisher: Publisher | None = None
        try:
            # A context long enough for the longest prompt asked for.
            context = ("--max-model-len", str(max(4096, 2 * args.prompt_tokens)))
            prefill = procs.start_stub("kv-prefill", "vllm", "prefill", "shfs", *context,
                                       log_dir=log_dir)
            started.append(prefill)
            decode = procs.start_stub("kv-decode", "vllm", "decode", "shfs", *context,
                                      log_dir=log_dir)
            started.append(decode)
            flags = procs.sidecar_flags("vllm", "shfs", prefill, decode, 64)
            off = procs.start_sidecar("kv-off", flags, log_dir=log_dir, prefix=[])
            started.append(off)
            publisher = Publisher(endpoint, prompts, args.event_rate)
            on = procs.start_sidecar("kv-on", [
                *flags, "--kv-events-endpoint", endpoint, "--kv-events-topic", "kv",
                "--local-prefill-max-uncached-tokens", str(BLOCK)], log_dir=log_dir, prefix=[])
            started.append(on)
            target = f"127.0.0.1:{prefill.port}"
            async with aiohttp.ClientSession() as session:
                stored = await _fill(session, on.url, publisher)
                publisher.start()
                for url in (off.url, on.url):  # warm both
                    for prompt in prompts[:10]:
                        await _one(session, url, prompt, target)
                cpu = {"off": 0.0, "on": 0.0}
                wall = {"off": 0.0, "on": 0.0}
                for index in range(args.requests):
                    prompt = prompts[index % len(prompts)]
                    for name, proc in (("off", off), ("on", on)):
                        before, start = procs.cpu_seconds(proc.pid), time.perf_counter()
                        await _one(session, proc.url, prompt, target)
                        wall[name] += time.perf_counter() - start
                        cpu[name] += procs.cpu_seconds(proc.pid) - before
                found = await _metric(session, on.url, "disagg_cached_prompt_tokens_sum")
                judged = await _metric(session, on.url, "disagg_cached_prompt_tokens_count")
                idle_before = {p.pid: procs.cpu_seconds(p.pid) for p in (off, on)}
                sent_before = publisher.sent
                await asyncio.sleep(args.idle_s)
                idle = {p.pid: procs.cpu_seconds(p.pid) - idle_before[p.pid] for p in (off, on)}
                idle_batches = publisher.sent - sent_before
                blocks = await _metric(session, on.url, "disagg_kv_index_blocks")
        finally:
            if publisher is not None:
                publisher.close()
            for proc in reversed(started):
                procs.stop(proc)
    return {
        "requests_each": args.requests, "prompt_tokens": args.prompt_tokens,
        "blocks_walked_per_request": args.prompt_tokens // 2 // BLOCK,
        "prompt_blocks_stored": stored, "index_blocks_at_end": blocks,
        "event_rate_per_s": args.event_rate,
        "off_cpu_us_per_req": round(cpu["off"] / args.requests * 1e6, 1),
        "on_cpu_us_per_req": round(cpu["on"] / args.requests * 1e6, 1),
        # The events the "on" sidecar applied while a request ran count in its window: their
        # share is its idle rate over the request's wall time.
        "on_events_share_us_per_req": round(
            (idle[on.pid] - idle[off.pid]) / args.idle_s * wall["on"] / args.requests * 1e6, 1),
        "wall_ms_per_req": {name: round(w / args.requests * 1e3, 2) for name, w in wall.items()},
        "on_mean_cached_tokens": round(found / judged, 1) if judged else None,
        "idle_cpu_ms_per_s": {"off": round(idle[off.pid] / args.idle_s * 1e3, 2),
                              "on": round(idle[on.pid] / args.idle_s * 1e3, 2)},
        "event_batches_per_s": round(idle_batches / args.idle_s, 1),
        "cpu_model": _cpu_model(), "cores": os.cpu_count(),
    }


async def _fill(session: aiohttp.ClientSession, url: str, publisher: Publisher) -> int:
    """Store the prompts' halves once the sidecar hears the publisher (a PUB drops what it
    sends before the subscription arrives: empty batches until one is applied)."""
    deadline = time.monotonic() + 30
    while await _metric(session, url, "disagg_kv_event_batches_total") == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the sidecar never heard the publisher")
        publisher.send([])
        await asyncio.sleep(0.05)
    stored = publisher.store_halves()
    while await _metric(session, url, "disagg_kv_index_blocks") < stored:
        if time.monotonic() > deadline:
            raise RuntimeError("the prompts' blocks never reached the index")
        await asyncio.sleep(0.05)
    return stored


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests through each")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--event-rate", type=float, default=200.0, help="batches per second")
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kv-index-logs-") as logs:
        result = asyncio.run(measure(args, Path(logs)))
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
