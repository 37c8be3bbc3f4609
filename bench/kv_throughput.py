"""Inline KV throughput: the gRPC path through two sidecars vs raw loopback TCP.

    python -m bench.kv_throughput [--layers 32 --blocks 16 --requests 5 --max-staged-mib 256
        --kv-block-bytes 65536,2097152 --rounds 1 --sidecar-tree DIR
        --sidecar-tree-kv-block-bytes N]

What runs: a stub engine (in this process, aiohttp on loopback) that plays the
SidecarKVConnector's part on the shared volume: both staging dirs get its ``engine.json``; a
prefill with ``action: save`` writes the layer files (each complete, then a layer notice, as
the connector does: the prefill sidecar streams a layer as soon as it is noticed;
``--no-notices``: the stream starts at the engine's answer) and ``meta.json`` into the
prefill sidecar's staging dir, a decode with ``action: load`` reads every staged layer file
back and streams one token. Two real sidecars run as their own processes
(``bench.sidecar_proc``, ``--kv-transport inline``, staging dirs on ``/dev/shm``), one pair
per case: each ``--kv-block-bytes`` value (the prefill's KV block size: runs of that many
bytes of consecutive engine pages; 65536 is one page of the default shape, 2 MiB the
default, here a whole layer), and first, with ``--sidecar-tree``, the sidecars of another
tree (e.g. ``git archive`` of main) without the flag (``--sidecar-tree-kv-block-bytes``:
with it): before and after in one run.
``--rounds`` repeats the cases interleaved. This process is the router: Prefill on one,
collect the blocks, Decode on the other (it keeps each block serialized and frames
DecodeRequest's ``kv_blocks`` from them, see ``decode_request_bytes``: what a router that
does not look inside the KV would do). The KV crosses loopback twice (prefill sidecar ->
router -> decode sidecar) and passes through tmpfs on both sides, as in a pod.

Raw loopback reference: the same number of bytes sent twice over a loopback TCP socket
(1 MiB ``sendall`` chunks to a reader thread), best of three, measured before the first
case and after each (their spread shows the machine's noise; the best is the reference).
Reported per case and round: MB/s of the best and the median request, the ratio to raw (the
goal is the gRPC path within a factor of 3), per-request Prefill / Decode times, median
stage times (``engine_save_s`` / ``engine_load_s``: the stub engine's file writes and reads;
``prefill_first_kv_block_s``: the first data block at the router; ``router_frame_s``:
building DecodeRequest), CPU milliseconds per request of each sidecar and of this process
(router and stub engine, from ``/proc``), each sidecar's idle and peak resident memory
(``VmRSS`` once started, ``VmHWM`` at the end) and the decode's peak over the largest
DecodeRequest (requests run one at a time: one concurrent Decode); ``summary`` gives each
case's best round. This process keeps freed heap for reuse like the sidecars do
(``sidecar.grpc_server.inline.heap``).

Figures: bench/RESULTS.md ("Inline KV over gRPC"). On the shared 2-vCPU machine, 32 MiB
per request, three rounds per run: main's page-sized blocks 417-494 MB/s, 2 MiB runs 474-588
MB/s, raw loopback up to 4,800-5,900 MB/s (8.4-10.6x); CPU per request prefill sidecar
54-62 -> 36-40 ms, router + stub 76-89 -> 59-66 ms, decode sidecar 43-53 ms either way;
decode peak 4.0-4.5x the message above its idle 70 MB (3.2x at 512 MiB). grpcio's share of
that, and why a factor 3 is out of reach with grpcio and tmpfs hand-offs here:
``bench.grpc_ceiling``.

Deliberate limits: the stub engine's file writes and reads are inside the measured time
(they are part of the real path too, done by the connector), and the stub shares this
process's loop with the router; requests run one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from bench import procs
from connectors.inline_layout import (
    ENGINE_FILE,
    META_FILE,
    InlineLayout,
    InlineMeta,
    layer_file,
    notice_sender,
    send_notice,
    write_atomic,
)
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.inline.heap import retain_freed_heap
from sidecar.grpc_server.inline.protowire import frame_decode_request, kv_block_of_stream

MODEL = "bench-kv"


def make_stub(
    prefill_dir: Path,
    decode_dir: Path,
    layout: InlineLayout,
    blocks: int,
    times: dict[str, list[float]],
    notices: bool,
) -> web.Application:
    layer_blob = bytes(range(256)) * (blocks * layout.block_bytes // 256)
    notice_sock = notice_sender()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def completions(request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        inline = body.get("kv_transfer_params", {}).get("disagg_inline", {})
        tokens = len(body["prompt"])
        started = time.perf_counter()
        if inline.get("action") == "save":
            directory = prefill_dir / inline["key"]
            directory.mkdir()
            for layer in range(layout.num_layers):
                # As the real connector: each layer file complete under its name, then a
                # notice, so that the prefill sidecar streams it while later ones are written.
                write_atomic(directory / layer_file(layer), layer_blob)
                if notices:
                    send_notice(notice_sock, prefill_dir, inline["key"], layer)
                    await asyncio.sleep(0)  # the router shares this loop
            meta = InlineMeta(layout, tokens, blocks, inline["key"])
            write_atomic(directory / META_FILE, meta.to_json())
            times["engine_save_s"].append(time.perf_counter() - started)
            return web.json_response(
                {
                    "id": "x",
                    "choices": [
                        {"index": 0, "text": "a", "token_ids": [7], "finish_reason": "length"}
                    ],
                }
            )
        directory = decode_dir / inline["key"]
        loaded = sum(
            len((directory / layer_file(i)).read_bytes()) for i in range(layout.num_layers)
        )
        assert loaded == layout.num_layers * blocks * layout.block_bytes
        times["engine_load_s"].append(time.perf_counter() - started)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in (
            {"choices": [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": None}]},
            {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]},
        ):
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application(client_max_size=1 << 20)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return app


def raw_loopback_mb_s(nbytes: int, repeat: int = 3) -> float:
    """Best of ``repeat``: MB/s of ``nbytes`` sent over one loopback TCP connection (1 MiB
    ``sendall`` chunks to a reader thread)."""
    chunk = b"\x01" * (1 << 20)
    best = float("inf")
    for _ in range(repeat):
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)

            def drain() -> None:
                conn, _ = server.accept()
                with conn:
                    while conn.recv(1 << 20):
                        pass

            reader = threading.Thread(target=drain)
            reader.start()
            started = time.perf_counter()
            with socket.create_connection(server.getsockname()) as client:
                for _ in range(max(1, nbytes // len(chunk))):
                    client.sendall(chunk)
            reader.join()
            best = min(best, time.perf_counter() - started)
    return max(1, nbytes // len(chunk)) * len(chunk) / best / 1e6


def make_root() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="bench-kv-", dir=shm if shm.is_dir() else None))


def vm_hwm_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def decode_request_bytes(
    head: disagg_pb2.DecodeRequest, blocks: Sequence[bytes | memoryview]
) -> bytes:
    """``head`` with ``blocks`` (serialized KVBlocks) appended to its ``kv_blocks``
    (``sidecar.grpc_server.inline.protowire.frame_decode_request``: no block is copied into a
    message)."""
    return frame_decode_request(head.SerializeToString(), blocks)


async def route_once(
    pre: str,
    dec: str,
    rid: str,
    prompt: list[int],
    options: list[Any],
    times: dict[str, list[float]],
    kept: tuple[grpc.aio.Channel, grpc.aio.Channel] | None = None,
) -> tuple[float, float, int, int]:
    """The router: Prefill's blocks, in order, into Decode's ``kv_blocks``, on the ``kept``
    channels (None: one new channel per call).

    Returns Prefill's and Decode's seconds, the K+V bytes carried and the DecodeRequest's size.
    """
    async with contextlib.AsyncExitStack() as exits:
        if kept is None:
            ch = await exits.enter_async_context(grpc.aio.insecure_channel(pre, options=options))
        else:
            ch = kept[0]
        started = time.perf_counter()
        prefill: grpc.aio.UnaryStreamMultiCallable[disagg_pb2.PreFillRequest, bytes]
        prefill = ch.unary_stream(
            "/disagg.PrefillWorker/Prefill",
            request_serializer=disagg_pb2.PreFillRequest.SerializeToString,
            response_deserializer=None,  # each KVBlockStream's bytes, as they came
        )
        call = prefill(
            disagg_pb2.PreFillRequest(request_id=rid, token_ids=prompt, max_new_tokens=1)
        )
        # The router forwards blocks opaquely: each block's bytes, sliced out of its message.
        blocks: list[memoryview] = []
        async for message in call:
            if (sliced := kv_block_of_stream(message)) is not None:
                blocks.append(sliced)
                if len(blocks) == 2:  # the metadata block comes first, then the KV
                    times["prefill_first_kv_block_s"].append(time.perf_counter() - started)
        prefill_s = time.perf_counter() - started
    async with contextlib.AsyncExitStack() as exits:
        if kept is None:
            ch = await exits.enter_async_context(grpc.aio.insecure_channel(dec, options=options))
        else:
            ch = kept[1]
        started = time.perf_counter()
        decode = ch.unary_stream(
            "/disagg.DecodeWorker/Decode",
            request_serializer=lambda request: request,
            response_deserializer=disagg_pb2.TokenStream.FromString,
        )
        head = disagg_pb2.DecodeRequest(request_id=rid, token_ids=prompt, max_new_tokens=1)
        framed = decode_request_bytes(head, blocks)
        message_bytes = len(framed)
        times["router_frame_s"].append(time.perf_counter() - started)
        call2 = decode(framed)
        del framed
        tokens = [m.token_id async for m in call2 if not m.done]
        decode_s = time.perf_counter() - started
    assert tokens == [7], tokens
    wire = 0
    for serialized in blocks:
        parsed = disagg_pb2.KVBlock.FromString(bytes(serialized))
        wire += len(parsed.k_data) + len(parsed.v_data)
    return prefill_s, decode_s, wire, message_bytes


def vm_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


async def measure_block_size(
    args: argparse.Namespace,
    layout: InlineLayout,
    kv_block_bytes: int | None,
    stub_port: int,
    dirs: tuple[Path, Path, Path],
    stub_times: dict[str, list[float]],
    code_root: Path = procs.REPO_ROOT,
) -> dict[str, Any]:
    """One sidecar pair whose prefill streams ``kv_block_bytes`` blocks (None: a tree that
    predates the setting, page-sized blocks), run from ``code_root``: warm-up, then
    ``args.requests`` requests one after another."""
    prefill_dir, decode_dir, logs = dirs
    kv_bytes = layout.num_layers * args.blocks * layout.block_bytes
    max_message = kv_bytes + (16 << 20)
    max_staged = args.max_staged_mib << 20
    times: dict[str, list[float]] = collections.defaultdict(list)
    sidecars: list[procs.Proc] = []
    exits = contextlib.AsyncExitStack()  # the kept channels, closed before the sidecars stop
    try:
        for role, staging in (("prefill", prefill_dir), ("decode", decode_dir)):
            flags = [
                "--engine", "vllm", "--kv-connector", "shfs", "--role", role,
                "--engine-url", f"http://127.0.0.1:{stub_port}",
                "--advertise-host", "127.0.0.1",
                "--grpc", "--grpc-port", "0",
                "--grpc-max-message-bytes", str(max_message),
                "--kv-transport", "inline",
                "--kv-staging-dir", str(staging),
                "--max-staged-bytes", str(max_staged),
            ]
            if kv_block_bytes is not None:
                flags += ["--kv-block-bytes", str(kv_block_bytes)]
            sidecars.append(
                procs.start_sidecar(role, flags, log_dir=logs, prefix=[], code_root=code_root)
            )
        pre = f"127.0.0.1:{sidecars[0].info['ports']['grpc']}"
        dec = f"127.0.0.1:{sidecars[1].info['ports']['grpc']}"
        options = [
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
        ]
        prompt = list(range(1, args.blocks * layout.block_size + 1))
        # Resident size once started and idle: what the decode sidecar holds before any KV.
        idle_rss = {p.name: vm_rss_bytes(p.pid) for p in sidecars}
        if args.keep_channels:
            kept = (
                await exits.enter_async_context(grpc.aio.insecure_channel(pre, options=options)),
                await exits.enter_async_context(grpc.aio.insecure_channel(dec, options=options)),
            )
        else:
            kept = None
        await route_once(pre, dec, "warmup", prompt, options, times, kept)
        times.clear()
        stub_times.clear()  # the stub engine's file times, from here on
        pids = {"prefill": sidecars[0].pid, "decode": sidecars[1].pid, "router+stub": os.getpid()}
        cpu_before = {name: procs.cpu_seconds(pid) for name, pid in pids.items()}
        runs = [
            await route_once(pre, dec, f"r{i}", prompt, options, times, kept)
            for i in range(args.requests)
        ]
        cpu_ms = {
            name: round((procs.cpu_seconds(pid) - cpu_before[name]) / args.requests * 1e3, 1)
            for name, pid in pids.items()
        }
        leftovers = [p.name for d in (prefill_dir, decode_dir) for p in d.iterdir() if p.is_dir()]
        hwm = {p.name: vm_hwm_bytes(p.pid) for p in sidecars}
    finally:
        await exits.aclose()
        for proc in sidecars:
            procs.stop(proc)
    best = min(p + d for p, d, _, _ in runs)
    message = max(m for _, _, _, m in runs)
    pages = 1 if kv_block_bytes is None else max(
        1, min(args.blocks, kv_block_bytes // layout.block_bytes)
    )
    return {
        "sidecar_tree": str(code_root),
        "kv_block_bytes": kv_block_bytes,
        "pages_per_block": pages,
        "data_blocks_per_request": layout.num_layers * -(-args.blocks // pages),
        "wire_bytes_per_request": runs[0][2],
        "decode_request_bytes": message,
        "prefill_s": [round(p, 4) for p, _, _, _ in runs],
        "decode_s": [round(d, 4) for _, d, _, _ in runs],
        "median_stage_s": {
            k: round(statistics.median(v), 4) for k, v in {**times, **stub_times}.items() if v
        },
        # The KV crosses loopback twice (prefill sidecar -> router -> decode sidecar).
        "grpc_path_mb_s": round(2 * kv_bytes / best / 1e6, 1),
        "median_grpc_path_mb_s": round(
            2 * kv_bytes / statistics.median(p + d for p, d, _, _ in runs) / 1e6, 1
        ),
        "cpu_ms_per_request": cpu_ms,
        "sidecar_idle_rss_bytes": idle_rss,
        "sidecar_peak_rss_bytes": hwm,
        # Requests run one at a time: one concurrent Decode.
        "decode_peak_over_message": round(hwm["decode"] / message, 2),
        "decode_peak_above_idle_over_message": round(
            (hwm["decode"] - idle_rss["decode"]) / message, 2
        ),
        "staged_leftovers": leftovers,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = InlineLayout(
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_heads=args.heads,
        head_size=args.head_size,
        num_layers=args.layers,
        fingerprint="bench",
    )
    kv_bytes = layout.num_layers * args.blocks * layout.block_bytes
    root = make_root()
    prefill_dir, decode_dir, logs = root / "prefill", root / "decode", root / "logs"
    for d in (prefill_dir, decode_dir, logs):
        d.mkdir()
    for published in (prefill_dir, decode_dir):
        # Both engines' connectors publish their layout: the prefill sidecar announces the
        # metadata from it and streams layers as their notices come.
        write_atomic(published / ENGINE_FILE, json.dumps(layout.to_dict()).encode())
    times: dict[str, list[float]] = collections.defaultdict(list)
    stub = make_stub(prefill_dir, decode_dir, layout, args.blocks, times, not args.no_notices)
    runner = web.AppRunner(stub)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    stub_port = runner.addresses[0][1]
    results: list[dict[str, Any]] = []
    raw: list[float] = []
    try:
        # Raw loopback before and after each block size: its spread is the machine's noise.
        raw.append(raw_loopback_mb_s(2 * kv_bytes))
        cases: list[tuple[int | None, Path]] = [(b, procs.REPO_ROOT) for b in args.kv_block_bytes]
        if args.sidecar_tree is not None:
            cases.insert(0, (args.sidecar_tree_kv_block_bytes, args.sidecar_tree.resolve()))
        # Rounds interleave the cases: each sees the machine's load swings alike.
        for round_idx in range(args.rounds):
            for kv_block_bytes, code_root in cases:
                result = await measure_block_size(
                    args, layout, kv_block_bytes, stub_port, (prefill_dir, decode_dir, logs),
                    times, code_root,
                )
                result["round"] = round_idx
                results.append(result)
                raw.append(raw_loopback_mb_s(2 * kv_bytes))
    finally:
        await runner.cleanup()
        shutil.rmtree(root, ignore_errors=True)
    raw_mb_s = max(raw)
    for result in results:
        result["raw_over_grpc"] = round(raw_mb_s / result["grpc_path_mb_s"], 2)
        result["within_3x"] = raw_mb_s / result["grpc_path_mb_s"] <= 3.0
    return {
        "kv_bytes_per_request": kv_bytes,
        "requests": args.requests,
        "rounds": args.rounds,
        "keep_channels": args.keep_channels,
        "max_staged_bytes": args.max_staged_mib << 20,
        "raw_loopback_mb_s": round(raw_mb_s, 1),
        "raw_loopback_runs_mb_s": [round(r, 1) for r in raw],
        "summary": summarize(results, raw_mb_s),
        "by_kv_block_bytes": results,
    }


def summarize(results: list[dict[str, Any]], raw_mb_s: float) -> list[dict[str, Any]]:
    """Per case over its rounds: the best MB/s (against the best raw loopback), the median
    CPU per request of each process, the highest decode peak per message."""
    by_case: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
    for result in results:
        by_case.setdefault((result["sidecar_tree"], result["kv_block_bytes"]), []).append(result)
    out = []
    for (tree, block_bytes), rounds in by_case.items():
        best = max(r["grpc_path_mb_s"] for r in rounds)
        out.append({
            "sidecar_tree": tree,
            "kv_block_bytes": block_bytes,
            "best_grpc_path_mb_s": best,
            "raw_over_best": round(raw_mb_s / best, 2),
            "grpc_path_mb_s_by_round": [r["grpc_path_mb_s"] for r in rounds],
            "median_cpu_ms_per_request": {
                name: statistics.median(r["cpu_ms_per_request"][name] for r in rounds)
                for name in rounds[0]["cpu_ms_per_request"]
            },
            "max_decode_peak_over_message": max(r["decode_peak_over_message"] for r in rounds),
            "max_decode_peak_above_idle_over_message": max(
                r["decode_peak_above_idle_over_message"] for r in rounds
            ),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-staged-mib", type=int, default=256)
    parser.add_argument("--kv-block-bytes", type=lambda v: [int(x) for x in v.split(",")],
                        default=[65536, 2 * 1024 * 1024],
                        help="the prefill sidecar's --kv-block-bytes, one pair of sidecars per "
                        "value, in this order, in one run (default: 65536,2097152: page-sized "
                        "blocks at the default shape, then 2 MiB runs)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every case this many times, interleaved")
    parser.add_argument("--sidecar-tree", type=Path,
                        help="also run, first, the sidecars of this tree (e.g. `git archive` "
                        "of an older commit) without --kv-block-bytes: before/after in one run")
    parser.add_argument("--sidecar-tree-kv-block-bytes", type=int,
                        help="give --sidecar-tree's prefill sidecar this --kv-block-bytes (a "
                        "tree that has the setting: the same blocks on both sides of a "
                        "before/after)")
    parser.add_argument("--keep-channels", action="store_true",
                        help="the router keeps one channel to each sidecar per case (warmed "
                        "by the warm-up request), as a router with pooled channels does; "
                        "default: a new channel per call")
    parser.add_argument("--no-notices", action="store_true",
                        help="the stub engine sends no layer notices: the stream starts at its "
                        "answer")
    args = parser.parse_args()
    # The router and the stub engine (this process) handle the same large messages as the
    # sidecars, which tune their heap themselves in inline mode.
    retain_freed_heap(2**31 - 1)
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
