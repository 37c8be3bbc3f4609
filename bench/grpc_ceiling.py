"""Cross-process grpcio ceilings on this machine: how fast grpc.aio moves bytes, nothing else.

    python -m bench.grpc_ceiling [--total-mib 32] [--sizes 65536,1048576] [--repeat 5]

A server process (this module with ``--serve``) offers two bytes-only methods (identity
serializers: no protobuf at all): ``/ceiling.C/Stream`` answers one request with ``count``
pre-built messages of ``size`` bytes (the Prefill stream's shape), ``/ceiling.C/Sink`` takes
one request of any size and answers its length and the server's peak resident size (Decode's
request shape; sent to the second server, which holds no cached stream messages, so
``unary_server_peak_above_idle_over_message`` is what grpcio alone holds to hand a servicer
one message). This process is the client. Reported per shape: best MB/s over ``--repeat``
runs, next to raw loopback TCP of the same total (one hop). What the grpcio path through the
sidecars can ever reach is bounded by these figures: the Prefill stream by ``stream``, the
router's DecodeRequest by ``unary``, and the whole path by ``chain_two_hops``: the path's
shape with nothing else on it (a second server process; a stream of ``--chain-size``
messages (default 1 MiB: the Prefill stream's KV blocks at ``bench.kv_throughput``'s default
shape) from the first, joined by this process, sent as one request to the second; MB/s
counted over both hops as ``bench.kv_throughput`` does, so directly comparable with its
``grpc_path_mb_s`` and raw loopback).

``--retain-heap`` makes both ends keep freed heap memory (``sidecar.grpc_server.inline.heap``, what
the sidecars do in inline mode): without it every large message is faulted in anew.
Figures on the 2-core machine (32 MiB total, MB/s, best of 5, machine shared):

    default heap:   stream 64 KiB ~400-720, 1 MiB ~900-1,500; unary 32 MiB ~360-450;
                    chain (64 KiB stream + unary) ~380
    --retain-heap:  stream 64 KiB ~500-820, 1 MiB ~2,500-2,900; unary 32 MiB ~1,250-1,490;
                    chain ~800-930 (512 MiB: ~960)
    raw loopback TCP, one hop, same total: ~2,700-4,900
    2026-12-01, --retain-heap, load average 5-12 from other work: stream 64 KiB 500-910,
                    1 MiB 1,380-1,750, 2 MiB 1,900; unary 32 MiB 1,250-1,430; chain with
                    1 MiB messages 880-1,000 (64 KiB: 590); raw one hop 1,750-6,000; unary
                    server peak 3.3x the message above idle (3.0-3.65x over 32-256 MiB)

So grpcio alone, with no protobuf, no files and no checks, moves the path's shape at 4.3-5.5x
below raw loopback on this machine: the factor 3 is out of its reach here.

Channel options (max_frame_size 16 MiB, lookahead_bytes 64 MiB, tcp read chunk sizes up to
16 MiB, write_buffer_size 16 MiB, bdp_probe off, tx zerocopy) changed none of these beyond the
run-to-run noise; uvloop neither.

Deliberate limits: plaintext, one call at a time, the default channel options plus the message
size limits unless ``--options`` (a JSON list of [name, value]) adds some to both ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from bench.kv_throughput import raw_loopback_mb_s
from sidecar.grpc_server.inline.heap import retain_freed_heap

_STREAM = "/ceiling.C/Stream"
_SINK = "/ceiling.C/Sink"


def _ident(data: bytes) -> bytes:
    return data


def _status_bytes(key: str) -> int:
    """A ``/proc/self/status`` size (``VmRSS:``, ``VmHWM:``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return -1


async def _serve(options: list[tuple[str, Any]]) -> None:
    cache: dict[tuple[int, int], list[bytes]] = {}

    Context = grpc.aio.ServicerContext[bytes, bytes]

    async def stream(request: bytes, _: Context) -> AsyncIterator[bytes]:
        count, size = struct.unpack("<II", request)
        messages = cache.get((count, size))
        if messages is None:
            messages = cache[count, size] = [os.urandom(size) for _ in range(count)]
        for message in messages:
            yield message

    async def sink(request: bytes, _: Context) -> bytes:
        # With the peak resident size so far: grpcio's own copies of a received message.
        return struct.pack("<QQ", len(request), _status_bytes("VmHWM:"))

    handler = grpc.method_handlers_generic_handler(
        "ceiling.C",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=_ident, response_serializer=_ident
            ),
            "Sink": grpc.unary_unary_rpc_method_handler(
                sink, request_deserializer=_ident, response_serializer=_ident
            ),
        },
    )
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, _status_bytes("VmRSS:"), flush=True)
    await server.wait_for_termination()


async def _chain(
    ports: tuple[int, int], args: argparse.Namespace, options: list[tuple[str, Any]]
) -> float:
    """Best MB/s of the path's shape with nothing else on it: a stream of ``--chain-size``
    messages from one server, joined, one unary request to the other (two hops, counted
    twice like ``bench.kv_throughput``)."""
    total = args.total_mib << 20
    size = args.chain_size
    request = struct.pack("<II", total // size, size)
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}", options=options) as source,
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[1]}", options=options) as target,
    ):
        stream = source.unary_stream(
            _STREAM, request_serializer=_ident, response_deserializer=_ident
        )
        sink = target.unary_unary(_SINK, request_serializer=_ident, response_deserializer=_ident)
        best = float("inf")
        for _ in range(args.repeat + 1):
            started = time.perf_counter()
            parts = [message async for message in stream(request)]
            answer = await sink(b"".join(parts))
            best = min(best, time.perf_counter() - started)
        assert struct.unpack("<QQ", answer)[0] == total // size * size
    return float(2 * (total // size * size) / best / 1e6)


async def _client(
    ports: tuple[int, int],
    args: argparse.Namespace,
    options: list[tuple[str, Any]],
    idle_rss: int,
) -> dict[str, Any]:
    total = args.total_mib << 20
    results: dict[str, Any] = {}
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}", options=options) as channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[1]}", options=options) as second,
    ):
        stream = channel.unary_stream(
            _STREAM, request_serializer=_ident, response_deserializer=_ident
        )
        # The unary request goes to the server that holds no cached stream messages, so its
        # peak resident size is grpcio's receive path alone.
        sink = second.unary_unary(_SINK, request_serializer=_ident, response_deserializer=_ident)
        for size in args.sizes:
            count = max(total // size, 1)
            request = struct.pack("<II", count, size)
            best = float("inf")
            for _ in range(args.repeat + 1):  # the first run warms the server's cache
                started = time.perf_counter()
                got = 0
                async for message in stream(request):
                    got += len(message)
                best = min(best, time.perf_counter() - started)
            assert got == count * size
            results[f"stream_{size}"] = round(count * size / best / 1e6, 1)
        payload = os.urandom(total)
        best = float("inf")
        for _ in range(args.repeat + 1):
            started = time.perf_counter()
            answer = await sink(payload)
            best = min(best, time.perf_counter() - started)
        received, peak = struct.unpack("<QQ", answer)
        assert received == total
        results[f"unary_{total}"] = round(total / best / 1e6, 1)
        # What grpcio alone holds to hand a servicer one message (Decode's shape).
        results["unary_server_peak_above_idle_over_message"] = round(
            (peak - idle_rss) / total, 2
        )
    results[f"chain_two_hops_{args.chain_size}"] = round(await _chain(ports, args, options), 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--total-mib", type=int, default=32)
    parser.add_argument("--sizes", default="65536,1048576",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chain-size", type=int, default=1048576,
                        help="stream message size of the two-hop chain (1 MiB: one run "
                        "per layer of bench.kv_throughput's default shape)")
    parser.add_argument("--retain-heap", action="store_true",
                        help="both ends keep freed heap (sidecar.grpc_server.inline.heap)")
    parser.add_argument("--uvloop", action="store_true", help="both ends on uvloop")
    parser.add_argument("--options", default="[]", help="JSON list of [name, value] pairs")
    args = parser.parse_args()
    limit = 1 << 30
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        *(tuple(pair) for pair in json.loads(args.options)),
    ]
    if args.retain_heap:
        retain_freed_heap(2**31 - 1)
    if args.uvloop:
        import uvloop

        uvloop.install()
    if args.serve:
        asyncio.run(_serve(options))
        return
    command = [sys.executable, "-m", "bench.grpc_ceiling", "--serve", "--options", args.options,
               *(["--uvloop"] if args.uvloop else []),
               *(["--retain-heap"] if args.retain_heap else [])]
    servers = [subprocess.Popen(command, stdout=subprocess.PIPE) for _ in range(2)]
    try:
        ports, idle = [], []
        for server in servers:
            assert server.stdout is not None
            port, rss = server.stdout.readline().split()
            ports.append(int(port))
            idle.append(int(rss))
        results = asyncio.run(_client((ports[0], ports[1]), args, options, idle[1]))
    finally:
        for server in servers:
            server.terminate()
            server.wait()
    results["raw_loopback_one_hop"] = round(
        raw_loopback_mb_s(args.total_mib << 20, args.repeat), 1
    )
    results["options"] = json.loads(args.options)
    results["uvloop"] = args.uvloop
    results["retain_heap"] = args.retain_heap
    print(json.dumps(results))


if __name__ == "__main__":
    main()
