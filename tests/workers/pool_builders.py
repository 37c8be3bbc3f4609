"""Builders shared by the workers suite: a real ``disagg-sidecar serve --workers N`` process.

    async with running_pool(engine="vllm", engine_url=..., workers=2) as pool:
        pool.url, pool.pids, await pool.wait_line("worker 1 listening")
        pool.worker_metric(pid, "disagg_requests_total", outcome="ok")   # one worker's share
        await pool.metric("disagg_requests_total")                        # what /metrics says

The pool runs as its own process tree (supervisor + workers) exactly as an operator starts it;
its stderr is read line by line into ``lines`` (waits are on lines and state, bounded, never on
a clock). One worker's share of a metric is read from its own prometheus-client files in the
supervisor's run directory (named in its log), so no debug header is needed to tell the
workers apart. Each request goes on a fresh connection (``fresh_session``): the kernel spreads
connections, not requests, over the workers.

The stub engines are imported here only (``STUBS``), so their package can move in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from sidecar.tools.stubs import Stub, StubConfig  # the one import of the stub engines

WAIT_S = 30.0
_RUN_DIR = re.compile(r"starting \d+ workers \(run dir (\S+)\)")
_PORTS = re.compile(r"listening: ((?:\w+=\S+ ?)+)")
_WORKER_LISTENING = re.compile(r"worker (\d+) listening \(pid (\d+)\)")


def fresh_session() -> aiohttp.ClientSession:
    """A client that opens a new connection for every request (so the kernel picks a worker)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of samples ``name`` whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout_s: float = WAIT_S) -> None:
    """Poll ``check`` until it holds; fail after ``timeout_s`` (state, not timing, decides)."""
    async with asyncio.timeout(timeout_s):
        # Process exits, files and gauges have no event a test can wait on: poll them.
        while not await check():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def flags(settings: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


@dataclass
class Pool:
    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)  # worker index -> pid (latest)
    run_dir: Path | None = None
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _reader: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    async def _read(self) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if match := _RUN_DIR.search(line):
                self.run_dir = Path(match.group(1))
            if match := _WORKER_LISTENING.search(line):
                self.pids[int(match.group(1))] = int(match.group(2))
            async with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        async with self._changed:
            self._changed.notify_all()

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    async def wait_line(self, text: str, *, after: int = 0, timeout_s: float = WAIT_S) -> str:
        """The first line from index ``after`` on that contains ``text`` (waiting for it)."""
        async with asyncio.timeout(timeout_s), self._changed:
            while True:
                for line in self.lines[after:]:
                    if text in line:
                        return line
                if self._reader is not None and self._reader.done():
                    raise AssertionError(f"pool exited before logging {text!r}:\n"
                                         + "\n".join(self.lines[-30:]))
                await self._changed.wait()

    async def scrape(self) -> str:
        async with fresh_session() as session, session.get(self.url + "/metrics") as response:
            assert response.status == 200
            return await response.text()

    async def metric(self, name: str, **labels: str) -> float:
        return sample_sum(await self.scrape(), name, **labels)

    def worker_exposition(self, pid: int) -> str:
        """One worker's own metrics, read from its files in the run directory."""
        assert self.run_dir is not None
        with tempfile.TemporaryDirectory() as only:
            for path in (self.run_dir / "metrics").glob(f"*_{pid}.db"):
                shutil.copy(path, only)
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=only)
            return generate_latest(registry).decode()

    def worker_metric(self, pid: int, name: str, **labels: str) -> float:
        return sample_sum(self.worker_exposition(pid), name, **labels)

    async def stop(self, *, timeout_s: float = WAIT_S) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(timeout_s):
            code = await self.process.wait()
            if self._reader is not None:
                await self._reader
        return code


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.asynccontextmanager
async def running_pool(*, workers: int | str = 2, **settings: Any) -> AsyncIterator[Pool]:
    """``disagg-sidecar serve --workers N`` on OS-chosen loopback ports, until all listen.

    ``workers`` 1 runs the lone process (no supervisor), for comparisons.
    """
    base: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "grpc_port": 0,
                            "drain_grace_s": 10.0, "log_level": "info"}
    argv = [sys.executable, "-m", "sidecar", "serve", "--workers", str(workers),
            *flags({**base, **settings})]
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    pool = Pool(process)
    pool._reader = asyncio.ensure_future(pool._read())
    try:
        line = await pool.wait_line("pool listening:" if str(workers) != "1"
                                    else "sidecar.serve: listening:")
        match = _PORTS.search(line)
        assert match is not None, line
        pool.ports = {k: int(v.rsplit(":", 1)[1])
                      for k, v in (item.split("=", 1) for item in match.group(1).split())}
        yield pool
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        workers_left = [pid for pid in pool.pids.values() if pid_alive(pid)]
        for pid in workers_left:  # only if the supervisor was killed: do not leak them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(asyncio.CancelledError):
            pool._reader.cancel()
            await pool._reader


@contextlib.asynccontextmanager
async def stubs(engine: str, connector: str = "shfs", **config: Any) -> AsyncIterator[
    tuple[Stub, Stub]
]:
    """A prefill and a decode stub engine on OS-chosen ports."""
    timeouts = {"bootstrap_timeout_s": 300.0, "waiting_timeout_s": 300.0}
    async with contextlib.AsyncExitStack() as stack:
        pair = []
        for role in ("prefill", "decode"):
            stub = Stub(StubConfig(engine=engine, role=role, kv_connector=connector,
                                   **{**timeouts, **config}))
            await stub.start()
            stack.push_async_callback(stub.stop)
            pair.append(stub)
        yield pair[0], pair[1]


def pd_settings(engine: str, connector: str, prefill: Stub, decode: Stub) -> dict[str, Any]:
    """Sidecar settings for a PD pair: the decode engine local, the prefill allowed."""
    settings: dict[str, Any] = {"engine": engine, "engine_url": decode.url,
                                "prefill_allowlist": [f"127.0.0.1:{prefill.port}"]}
    if engine == "vllm":
        settings["kv_connector"] = connector
    if prefill.bootstrap_port:
        settings["sglang_bootstrap_port"] = prefill.bootstrap_port
        settings["mooncake_bootstrap_port"] = prefill.bootstrap_port
    return settings


async def post_pd(session: aiohttp.ClientSession, pool: Pool, prefill: Stub,
                  body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """One PD completion through the pool; its status and JSON body."""
    payload = body or {"model": "stub-model", "prompt": "Workers share one port.",
                       "max_tokens": 4}
    async with session.post(pool.url + "/v1/completions", json=payload,
                            headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}
                            ) as response:
        return response.status, await response.json()


async def gather_limited(coros: Iterable[Awaitable[Any]], limit: int = 8) -> list[Any]:
    """Run ``coros`` with at most ``limit`` at once (a 2-core machine, other tests beside)."""
    gate = asyncio.Semaphore(limit)

    async def one(coro: Awaitable[Any]) -> Any:
        async with gate:
            return await coro

    return await asyncio.gather(*(one(c) for c in coros))
