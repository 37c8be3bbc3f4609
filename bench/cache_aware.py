"""Multi-turn chat on real vLLM (CPU): always a pair, the length rule, and cache-aware placement.

    python -m bench.cache_aware [--conversations 4] [--turns 4] [--out FILE]

Needs the real-vLLM engine environment (``bash tests/real_vllm/setup_env.sh``) and runs the
engines with the test suite's harness (tests/real_vllm/harness.py): one NIXL prefill engine
and one NIXL decode engine with prefix caching whose KV events go to the cache-aware sidecar.
Three sidecars, each its own process in front of the same decode engine, one per way:

    pair     no local rule: every request is a prefill/decode pair
    length   --local-prefill-max-tokens L (the prompt's length from the engine's tokenizer)
    cache    --local-prefill-max-uncached-tokens U with the decode engine's KV events, and
             the same length rule

Each way runs its own conversations (their texts start with the way's name, so no way finds
another's blocks in a cache): turn 1 is a system-style prompt of several blocks, each next
turn adds the assistant's reply and a short user message; the conversations' turns are
interleaved (turn 1 of each, then turn 2 of each, ...), one request at a time, streamed.
Per way: the prompt tokens the prefill engine computed (its prompt tokens less its own
prefix-cache hits), the prefill legs (KV transfers) and the KV bytes the decode engine
pulled, the requests run locally, and the time to the first streamed token, p50 and p90.

Deliberate limits: a tiny model on two shared cores (the figures compare the ways, they are
not a GPU's); vLLM's 512-token context bounds the conversations.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"
# The engines' harness lives with the real-vLLM suite; the benchmark starts them the same way.
sys.path.insert(0, str(TESTS))

from real_vllm.client import block_prompt, metric_value  # noqa: E402
from real_vllm.harness import (  # noqa: E402
    ROUTE_FLAGS,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    free_port,
    nixl_config,
)
from real_vllm.sidecar_process import PREFILL_HEADER, Sidecar, sidecar_process  # noqa: E402

WAYS = ("pair", "length", "cache")
CHAT = "/v1/chat/completions"
MAX_TOKENS = 16


def _engines(group: EngineGroup, endpoint: str) -> tuple[str, str, int]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv"}
    started = group.start([
        EngineSpec("prefill", nixl_config("kv_producer"), cpu=0, extra_args=ROUTE_FLAGS),
        EngineSpec("decode", nixl_config("kv_consumer"), cpu=1,
                   extra_args=(*ROUTE_FLAGS, "--kv-events-config", json.dumps(events))),
    ])
    prefill, decode = started["prefill"], started["decode"]
    return prefill.url, decode.url, prefill.port


def _sidecar_flags(way: str, decode: str, endpoint: str, length: int, uncached: int
                   ) -> list[str]:
    flags = ["--engine", "vllm", "--kv-connector", "shfs", "--engine-url", decode]
    if way in ("length", "cache"):
        flags += ["--local-prefill-max-tokens", str(length), "--prompt-length-source",
                  "tokenize"]
    if way == "cache":
        flags += ["--kv-events-endpoint", endpoint, "--kv-events-topic", "kv",
                  "--local-prefill-max-uncached-tokens", str(uncached)]
    return flags


def _stream(sidecar: Sidecar, body: dict[str, Any], target: str) -> tuple[str, float]:
    """The reply's text and the seconds to its first content token."""
    request = urllib.request.Request(
        sidecar.url + CHAT, data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", PREFILL_HEADER: target}, method="POST")
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                if text and first is None:
                    first = time.perf_counter() - start
                parts.append(text)
    return "".join(parts), first if first is not None else time.perf_counter() - start


def _conversations(way: str, count: int, turns: int) -> Iterator[list[str]]:
    for index in range(count):
        yield [f"{way} conversation {index}, question {turn}: and what comes next?"
               for turn in range(1, turns)]


def _figures(prefill: str, decode: str, sidecar: Sidecar) -> dict[str, float]:
    return {
        "prefill_prompt_tokens": metric_value(prefill, "vllm:prompt_tokens_total"),
        "prefill_cache_hits": metric_value(prefill, "vllm:prefix_cache_hits_total"),
        "prefill_legs": metric_value(sidecar.url, "disagg_prefill_legs_total", outcome="ok"),
        "kv_bytes": metric_value(decode, "vllm:nixl_bytes_transferred_sum"),
        "local_cached": metric_value(sidecar.url, "disagg_requests_total",
                                     outcome="local_cached"),
        "local_short": metric_value(sidecar.url, "disagg_requests_total",
                                    outcome="local_short"),
        "cached_found": metric_value(sidecar.url, "disagg_cached_prompt_tokens_sum"),
    }


def run_way(way: str, sidecar: Sidecar, prefill: str, decode: str, target: str,
            conversations: int, turns: int) -> dict[str, Any]:
    before = _figures(prefill, decode, sidecar)
    chats: list[dict[str, Any]] = [
        {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
         "messages": [{"role": "user", "content": block_prompt(f"{way} {i}", items=10)}]}
        for i in range(conversations)]
    follow_ups = list(_conversations(way, conversations, turns))
    ttft: list[float] = []
    for turn in range(turns):
        for index, chat in enumerate(chats):
            if turn > 0:
                chat["messages"].append({"role": "user", "content": follow_ups[index][turn - 1]})
            reply, first = _stream(sidecar, chat, target)
            ttft.append(first)
            chat["messages"].append({"role": "assistant", "content": reply})
    after = _figures(prefill, decode, sidecar)
    moved = {name: after[name] - before[name] for name in after}
    ttft.sort()
    return {
        "requests": len(ttft),
        "prefill_computed_tokens": moved["prefill_prompt_tokens"] - moved["prefill_cache_hits"],
        "prefill_prompt_tokens": moved["prefill_prompt_tokens"],
        "kv_transfers": moved["prefill_legs"],
        "kv_bytes": moved["kv_bytes"],
        "local_cached": moved["local_cached"],
        "local_short": moved["local_short"],
        "cached_tokens_found": moved["cached_found"],
        "ttft_p50_ms": round(statistics.median(ttft) * 1000, 1),
        "ttft_p90_ms": round(ttft[min(len(ttft) - 1, (9 * len(ttft)) // 10)] * 1000, 1),
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| way | requests | prefill computed tokens | KV transfers | KV bytes pulled | "
            "local (cached / short) | TTFT p50 ms | TTFT p90 ms |",
            "|---|---|---|---|---|---|---|---|"]
    for way, r in results.items():
        rows.append(
            f"| {way} | {r['requests']} | {r['prefill_computed_tokens']:.0f} | "
            f"{r['kv_transfers']:.0f} | {r['kv_bytes']:.0f} | {r['local_cached']:.0f} / "
            f"{r['local_short']:.0f} | {r['ttft_p50_ms']} | {r['ttft_p90_ms']} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--length", type=int, default=64,
                        help="the length rule's --local-prefill-max-tokens")
    parser.add_argument("--uncached", type=int, default=64,
                        help="the cache rule's --local-prefill-max-uncached-tokens")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    results: dict[str, dict[str, Any]] = {}
    with EngineGroup(EngineEnv.locate()) as group, ExitStack() as stack:
        prefill, decode, prefill_port = _engines(group, endpoint)
        target = f"127.0.0.1:{prefill_port}"
        for way in WAYS:
            tmp = group.root / f"sidecar-{way}"
            tmp.mkdir()
            sidecar = stack.enter_context(contextlib.contextmanager(sidecar_process)(
                tmp, *_sidecar_flags(way, decode, endpoint, args.length, args.uncached)))
            results[way] = run_way(way, sidecar, prefill, decode, target,
                                   args.conversations, args.turns)
            print(way, json.dumps(results[way]), flush=True)
    print(table(results))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
