"""The work one PD request costs the sidecar, counted in Python bytecodes: a figure that does
not move with the machine's load, held to a budget by ``tests/bench/test_request_budget.py``.

    python -m bench.bytecodes                  every case, a table
    python -m bench.bytecodes --json           the same as JSON
    python -m bench.bytecodes --by-package     where the bytecodes run (sidecar, aiohttp, ...)
    python -m bench.bytecodes --cases pull-json,concurrent-stream
    python -m bench.bytecodes --serve-flags "--migration-limit 0"   what a setting costs

Two lean stub engines (``sidecar.tools.stubs --transport lean``), each its own process, and
the real sidecar (``serve.run_server``, its production settings but for the stubs' addresses)
in a thread of this process, on its own uvloop event loop; the client (``bench.lean_client``)
runs on this process's main thread. After a warm-up, ``sys.settrace`` with opcode events is
switched on in the sidecar's thread (``sys.settrace`` traces one thread) at a moment it is
idle, one request is sent and answered, and the tracer is switched off once the sidecar's loop
has turned three times more (what the request left queued runs inside the count). Every
bytecode the interpreter runs in that thread in between is counted: the sidecar's own code
and every library's (aiohttp, multidict, yarl, prometheus-client, asyncio, the standard
library), none of the work done in C (llhttp, orjson, uvloop, the kernel). The figure of a
case is the smallest count of ``--repeat`` requests: a background timer that happens to run
during one request (a health check) only ever adds.

Cases (``CASES``), all ``POST /v1/completions`` with ``x-prefiller-host-port``, 8 tokens:

    pull-json, pull-stream                 vLLM NixlConnector: prefill, then decode pulling
    concurrent-json, concurrent-stream     SGLang: both legs at once (bootstrap room)
    pull-json-cache-rule                   the cache rule on (``--local-prefill-max-uncached-
                                           tokens``) with an index that cannot answer (no
                                           events): what the rule costs a request it cannot
                                           judge
    pull-json-cache-hit                    the same with an index that answers: the bench
                                           publishes KV events (``IndexFeed``, vLLM's format)
                                           saying the decode engine holds 8 of a 40-token
                                           prompt's ids (over the rule's 8 not held: a pair),
                                           what the look-up adds

Why bytecodes: per request the sidecar is CPython running about 8,000 of them (the profile in
bench/RESULTS.md: 74 % of the instructions inside the interpreter), so their count follows
the CPU a change adds or saves, and it is the same on a busy machine and a quiet one. A
compiled build (Cython) runs fewer: the budget is the pure-Python build's, and the test skips
itself when the hot modules are compiled.

Deliberate limits: the stubs answer at once and write a stream in one write
(``--stream-writes whole``), so a streamed answer reaches the sidecar in one read on any
machine; one request at a time; the index is fed by the bench, not by the
stub engine (the stubs publish no KV events yet), and its prompt is token ids (text would need
a tokenize call the lean stubs do not serve).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import shlex
import socket
import sys
import tempfile
import threading
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench import flows, procs
from bench.http_clients import open_clients

#: Loop turns after the answer before the count stops: what the request's task left queued
#: (its scope's close, metric updates) runs inside the count.
TAIL_TURNS = 3

#: The stubs write each stream whole (``--stream-writes whole``).
WHOLE_STREAMS = ("--stream-writes", "whole")


@dataclass(frozen=True)
class Case:
    """One kind of PD request: its flow's stubs, streamed or not, and extra sidecar flags."""

    flow: str  # "seq": vLLM NIXL pull; "conc": SGLang, both legs at once
    stream: bool
    flags: tuple[str, ...] = ()
    tokens: int = 8
    #: The KV-event index answers: the bench publishes the prompt's leading blocks as the
    #: decode engine would (``IndexFeed``), and the prompt is token ids (no tokenize call).
    fed_index: bool = False


CASES: dict[str, Case] = {
    "pull-json": Case("seq", False),
    "pull-stream": Case("seq", True),
    "concurrent-json": Case("conc", False),
    "concurrent-stream": Case("conc", True),
    "pull-json-cache-rule": Case("seq", False, ("--local-prefill-max-uncached-tokens", "4",
                                                "--kv-events-endpoint", "tcp://127.0.0.1:{free}")),
    "pull-json-cache-hit": Case("seq", False, ("--local-prefill-max-uncached-tokens", "8",
                                               "--kv-events-topic", "kv",
                                               "--kv-events-endpoint", "{feed}"),
                                fed_index=True),
}

#: The fed index's prompt (token ids) and what the feed says the engine holds of it: two of
#: its ten blocks, so 32 tokens are not held, over the rule's 8: the request runs as a pair.
FED_PROMPT = list(range(100, 140))
FED_BLOCK = 4
FED_HELD = 8


class IndexFeed:
    """The decode engine's KV-event publisher, as vLLM 0.32 sends (one XPUB socket the
    sidecar's subscriber connects to): one batch storing the prompt's leading blocks."""

    def __init__(self, endpoint: str) -> None:
        import zmq
        import zmq.asyncio

        self.endpoint = endpoint
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)

    async def publish(self) -> None:
        """Once the sidecar subscribed: the batch (sequence 0)."""
        import msgspec

        await asyncio.wait_for(self._socket.recv(), 30)  # the subscription
        held = FED_PROMPT[:FED_HELD]
        stored = {"type": "BlockStored", "block_hashes": list(range(1, FED_HELD // FED_BLOCK + 1)),
                  "parent_block_hash": None, "token_ids": held, "block_size": FED_BLOCK,
                  "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
        batch = msgspec.msgpack.encode([1.0, [stored], 0])
        await self._socket.send_multipart([b"kv", (0).to_bytes(8, "big"), batch])

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


@dataclass
class Count:
    """The bytecodes of one traced window: the total and, per code object, its share."""

    total: int = 0
    by_code: Counter[types.CodeType] = field(default_factory=Counter)
    names: dict[types.CodeType, str] = field(default_factory=dict)  # generated code's class

    def by_package(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for code, n in self.by_code.items():
            out[package_of(code.co_filename)] += n
        return dict(out.most_common())


def package_of(filename: str) -> str:
    """``sidecar/http_server``, ``aiohttp``, ``asyncio``, ...: who owns a code object."""
    path = Path(filename)
    parts = path.parts
    if "sidecar" in parts:
        index = len(parts) - 1 - parts[::-1].index("sidecar")
        rest = parts[index:-1]
        return "/".join(rest[:2]) if len(rest) > 1 else "sidecar"
    if "site-packages" in parts:
        index = parts.index("site-packages")
        return parts[index + 1].removesuffix(".py") if index + 1 < len(parts) else "?"
    if "python3.11" in parts or "lib" in parts:
        return path.parent.name if path.parent.name not in ("lib", "python3.11") else "stdlib"
    return "?"


class OpcodeCounter:
    """Counts the bytecodes one thread runs between ``start`` and ``stop`` (called there)."""

    def __init__(self, per_code: bool = False) -> None:
        self.count = Count()
        self._per_code = per_code

    def start(self) -> None:
        self.count = Count()
        count = self.count
        by_code = count.by_code
        per_code = self._per_code

        def local(frame: types.FrameType, event: str, _: object) -> Any:
            if event == "opcode":
                count.total += 1
                if per_code:
                    by_code[frame.f_code] += 1
            return local

        def on_call_named(frame: types.FrameType, event: str, _: object) -> Any:
            # Generated code (a dataclass's __init__) is named by the class it builds.
            code = frame.f_code
            if code.co_filename == "<string>" and "self" in frame.f_locals:
                names[code] = f"{type(frame.f_locals['self']).__qualname__}.{code.co_name}"
            frame.f_trace_opcodes = True
            return local

        def on_call(frame: types.FrameType, event: str, _: object) -> Any:
            frame.f_trace_opcodes = True
            return local

        names = self.count.names
        sys.settrace(on_call_named if per_code else on_call)

    def stop(self) -> Count:
        sys.settrace(None)
        return self.count


class SidecarThread:
    """``serve.run_server`` on a uvloop loop in a thread of this process."""

    def __init__(self, flags: list[str]) -> None:
        self.flags = flags
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ports: concurrent.futures.Future[dict[str, int]] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="sidecar", daemon=True)

    def _run(self) -> None:
        import uvloop

        from sidecar.__main__ import build_parser
        from sidecar.config.loader import load_settings
        from sidecar.serve import run_server

        async def main() -> int:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            return await run_server(settings, self._stop, self.ports.set_result)

        try:
            args = build_parser().parse_args(["serve", *self.flags])
            settings = load_settings(args, {}).settings
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(main())
        except BaseException as exc:
            if not self.ports.done():
                self.ports.set_exception(exc)
            raise

    def __enter__(self) -> SidecarThread:
        self._thread.start()
        self.ports.result(timeout=60)
        return self

    def __exit__(self, *_: object) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)

    def call(self, fn: Callable[[], Any], turns: int = 0) -> Any:
        """Run ``fn`` on the sidecar's loop after ``turns`` more loop turns; its result.

        Every step on the sidecar's side is C (uvloop's ``call_soon``, a lock's ``release``),
        so that none of this runs a bytecode inside a count: only ``fn`` itself does."""
        assert self.loop is not None
        loop = self.loop
        done = threading.Lock()
        done.acquire()
        out: list[Any] = []

        def run() -> None:
            try:
                out.append(fn())
            finally:
                done.release()

        chain: tuple[Any, ...] = (run,)
        for _ in range(turns):
            chain = (loop.call_soon, *chain)
        loop.call_soon_threadsafe(*chain)
        if not done.acquire(timeout=60):
            raise TimeoutError("the sidecar's loop did not run the call")
        return out[0] if out else None


@contextlib.contextmanager
def stubs(flow: str, log_dir: Path) -> Iterator[tuple[procs.Proc, procs.Proc]]:
    engine = "vllm" if flow == "seq" else "sglang"
    started: list[procs.Proc] = []
    try:
        # A stream in one write: the sidecar reads it in one read on any machine (a write per
        # event reached it in one read here but in more on CI, 180 bytecodes more a request).
        prefill = procs.start_stub(f"{flow}-prefill", engine, "prefill", "shfs",
                                   *WHOLE_STREAMS, log_dir=log_dir)
        started.append(prefill)
        decode = procs.start_stub(f"{flow}-decode", engine, "decode", "shfs", *WHOLE_STREAMS,
                                  log_dir=log_dir)
        started.append(decode)
        yield prefill, decode
    finally:
        for proc in reversed(started):
            procs.stop(proc)


def sidecar_flags(flow: str, prefill: procs.Proc, decode: procs.Proc,
                  extra: tuple[str, ...] = ()) -> list[str]:
    engine = "vllm" if flow == "seq" else "sglang"
    extra = tuple(flag.replace("{free}", str(_free_port())) for flag in extra)
    return ["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--log-level", "warning",
            *procs.sidecar_flags(engine, "shfs", prefill, decode, 64), *extra]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _applied(url: str) -> None:
    """Until the sidecar has applied a KV-event batch (its own counter says so; bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    line = 'disagg_kv_event_batches_total{outcome="applied"} 1.0'
    while loop.time() < deadline:
        text = await loop.run_in_executor(None, _get, url + "/metrics")
        if line in text:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the sidecar did not apply the fed KV-event batch")


def _get(url: str) -> str:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as response:
        return str(response.read().decode())


async def _counted_requests(sidecar: SidecarThread, flow: flows.Flow, *, warm_up: int,
                            repeat: int, per_code: bool, feed: IndexFeed | None = None,
                            url: str = "") -> list[Count]:
    counter = OpcodeCounter(per_code)
    counts: list[Count] = []
    if feed is not None:
        await feed.publish()
        await _applied(url)
    async with open_clients("lean", 1) as new_http:
        http = new_http()
        for _ in range(warm_up):
            if not (await flow.call(http)).ok:
                raise RuntimeError("a warm-up request failed")
        loop = asyncio.get_running_loop()
        for _ in range(repeat):
            # The sidecar is idle here: the previous request's tail ran inside its count.
            await loop.run_in_executor(None, sidecar.call, counter.start)
            result = await flow.call(http)
            count = await loop.run_in_executor(None, sidecar.call, counter.stop, TAIL_TURNS)
            if not result.ok:
                raise RuntimeError("a counted request failed")
            counts.append(count)
    return counts


def measure(names: list[str], *, warm_up: int = 20, repeat: int = 5,
            per_code: bool = False, serve_flags: tuple[str, ...] = ()
            ) -> dict[str, list[Count]]:
    """Each case's counts, ``repeat`` of them (the figure: the smallest); ``serve_flags``
    go after every case's own (e.g. ``--migration-limit 0``: what a setting costs)."""
    out: dict[str, list[Count]] = {}
    by_flow: dict[str, list[str]] = {}
    for name in names:
        by_flow.setdefault(CASES[name].flow, []).append(name)
    with tempfile.TemporaryDirectory(prefix="bench-bytecodes-") as tmp:
        for flow_name, cases in by_flow.items():
            with stubs(flow_name, Path(tmp)) as (prefill, decode):
                for name in cases:
                    case = CASES[name]
                    feed = IndexFeed(f"ipc://{tmp}/kv-{name}") if case.fed_index else None
                    flags = tuple(f.replace("{feed}", feed.endpoint if feed else "")
                                  for f in case.flags) + serve_flags
                    try:
                        with SidecarThread(sidecar_flags(flow_name, prefill, decode,
                                                         flags)) as sidecar:
                            url = f"http://127.0.0.1:{sidecar.ports.result()['http']}"
                            flow = flows.Sidecar(url, prefill.port, case.tokens, case.stream)
                            if case.fed_index:
                                flow.body = orjson.dumps({**flows.client_body(
                                    case.tokens, case.stream), "prompt": FED_PROMPT})
                            out[name] = asyncio.run(_counted_requests(
                                sidecar, flow, warm_up=warm_up, repeat=repeat,
                                per_code=per_code, feed=feed, url=url))
                    finally:
                        if feed is not None:
                            feed.close()
    return out


def figure(counts: list[Count]) -> int:
    return min(count.total for count in counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bytecodes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warm-up", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--by-package", action="store_true",
                        help="the smallest count's bytecodes by package")
    parser.add_argument("--top", type=int, default=0,
                        help="with --by-package: also the N functions that run the most")
    parser.add_argument("--serve-flags", default="",
                        help="more `serve` flags for every case's sidecar, e.g. "
                             "'--migration-limit 0' (the sidecar reads no DISAGG_* variables "
                             "here: the budget counts the defaults)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = set(names) - set(CASES)
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    results = measure(names, warm_up=args.warm_up, repeat=args.repeat,
                      per_code=args.by_package, serve_flags=tuple(shlex.split(args.serve_flags)))
    if args.json:
        print(json.dumps({name: {"bytecodes": figure(c), "all": [x.total for x in c]}
                          for name, c in results.items()}, indent=2))
        return 0
    for name, counts in results.items():
        print(f"{name:<24} {figure(counts):>7,}   ({', '.join(f'{c.total:,}' for c in counts)})")
        if args.by_package:
            best = min(counts, key=lambda c: c.total)
            for package, n in best.by_package().items():
                print(f"    {package:<28} {n:>6,}")
            if args.top:
                for code, n in best.by_code.most_common(args.top):
                    where = f"{Path(code.co_filename).name}:{code.co_firstlineno}"
                    name = best.names.get(code, code.co_qualname)
                    print(f"      {n:>5,}  {name}  ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
