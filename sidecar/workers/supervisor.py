"""The supervisor of ``disagg-sidecar serve --workers N``: N worker processes, one sidecar.

    supervise(settings)
      run dir (temp): settings.json, inflight.slots, metrics/ (PROMETHEUS_MULTIPROC_DIR)
      reserve the ports ─▶ spawn ``python -m sidecar.worker`` 0..N-1 ─▶ each reports its
      ports on a pipe once listening ─▶ ports file, "pool listening" ─▶ a worker exits: log,
      forget its live gauges and in-flight slot, restart it after a ``Backoff``
      SIGTERM/SIGINT ─▶ SIGTERM to every worker (each drains) ─▶ wait for all ─▶ remove
      the run dir ─▶ exit 0 (1 when a worker failed)

A port another program holds stops the pool before any worker starts (``PortInUse``: one
line, exit 2; the check binds without SO_REUSEPORT). A lifeline pipe's end-of-file (the
supervisor gone, even by SIGKILL) makes a worker drain and exit. Deliberate limit: a worker
that dies before it first listened stops the pool (exit 1).
What operators see: docs/operating/workers.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.multiprocess import mark_process_dead

from sidecar.config.settings import Settings
from sidecar.observability.metrics import MULTIPROC_DIR_ENV
from sidecar.workers.identity import INFLIGHT_FILE, METRICS_DIR, SETTINGS_FILE
from sidecar.workers.ports import bound_port, check_free, reserve
from sidecar.workers.shared_inflight import InflightSlots

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.2
MAX_BACKOFF_S = 10.0
#: A worker that served this long before dying restarts after the first backoff again.
STABLE_S = 30.0


@dataclass
class Backoff:
    """Delays between restarts of one worker: doubling, bounded, reset after stable service."""

    first_s: float = FIRST_BACKOFF_S
    most_s: float = MAX_BACKOFF_S
    _next_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._next_s = self.first_s

    def next(self) -> float:
        delay = self._next_s
        self._next_s = min(self._next_s * 2, self.most_s)
        return delay

    def reset(self) -> None:
        self._next_s = self.first_s


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _clean_exit(returncode: int) -> bool:
    # SIGTERM before the worker installed its handler ends it by the default action.
    return returncode in (0, -signal.SIGTERM)


class _Pool:
    """The supervisor's state for one run: the run dir, reserved ports, worker processes."""

    def __init__(self, settings: Settings, run_dir: Path, stop: asyncio.Event) -> None:
        self.settings = settings
        self.count = settings.workers
        self.run_dir = run_dir
        self.stop = stop
        self.metrics_dir = run_dir / METRICS_DIR
        self.slots_path = run_dir / INFLIGHT_FILE
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.reserved: list[socket.socket] = []
        self.lifeline_read, self.lifeline_write = os.pipe()

    def prepare(self) -> None:
        """Reserve the ports and write what every worker reads at start (``PortInUse`` when
        another program holds one: SO_REUSEPORT would let the pool join it silently)."""
        s = self.settings
        check_free(s.host, s.port, "--port")
        if s.grpc_enabled:
            check_free(s.host, s.grpc_port, "--grpc-port")
        if s.metrics_port is not None:
            check_free(s.host, s.metrics_port, "--metrics-port")
        ports: dict[str, int | None] = {"port": self._reserve(s.port)}
        if s.grpc_enabled:
            ports["grpc_port"] = self._reserve(s.grpc_port)
        if s.metrics_port is not None:
            ports["metrics_port"] = self._reserve(s.metrics_port)
        # The supervisor writes the ports file once every worker listens.
        worker_settings = s.model_copy(update={**ports, "ports_file": None})
        (self.run_dir / SETTINGS_FILE).write_text(worker_settings.model_dump_json())
        self.metrics_dir.mkdir()
        InflightSlots.create(self.slots_path, self.count)

    def _reserve(self, port: int) -> int:
        sock = reserve(self.settings.host, port)
        self.reserved.append(sock)
        return bound_port(sock)

    def close(self) -> None:
        for sock in self.reserved:
            sock.close()
        for fd in (self.lifeline_read, self.lifeline_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    async def spawn(self, index: int) -> tuple[asyncio.subprocess.Process, dict[str, int] | None]:
        """Start worker ``index``; its bound ports once listening, None if it died first."""
        report_read, report_write = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sidecar.worker",
                "--run-dir", str(self.run_dir), "--index", str(index),
                "--count", str(self.count), "--report-fd", str(report_write),
                "--lifeline-fd", str(self.lifeline_read),
                pass_fds=(report_write, self.lifeline_read),
                env={**os.environ, MULTIPROC_DIR_ENV: str(self.metrics_dir)})
        finally:
            os.close(report_write)  # the worker holds the only write end: its exit is EOF
        self.processes[index] = process
        if self.stop.is_set():
            process.send_signal(signal.SIGTERM)
        logger.info("worker %d started (pid %d)", index, process.pid)
        line = await asyncio.to_thread(_read_report, report_read)
        return process, (json.loads(line) if line.strip() else None)

    def forget(self, index: int, pid: int) -> None:
        """A worker is gone: drop its live gauges and its requests in flight."""
        mark_process_dead(pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
        InflightSlots.clear(self.slots_path, index)

    async def keep(self, index: int, first_start: asyncio.Future[bool]) -> int:
        """Run worker ``index`` until the pool stops, restarting it when it dies."""
        backoff = Backoff()
        while True:
            process, ports = await self.spawn(index)
            started = time.monotonic()
            if ports is not None:
                logger.info("worker %d listening (pid %d)", index, process.pid)
            if not first_start.done():
                first_start.set_result(ports is not None)
                if ports is None:
                    returncode = await process.wait()
                    logger.error("worker %d (pid %d) failed to start: %s", index, process.pid,
                                 describe_exit(returncode))
                    self.forget(index, process.pid)
                    return returncode
            returncode = await process.wait()
            self.forget(index, process.pid)
            if self.stop.is_set():
                log = logger.info if _clean_exit(returncode) else logger.warning
                log("worker %d (pid %d) stopped: %s", index, process.pid,
                    describe_exit(returncode))
                return returncode
            if ports is not None and time.monotonic() - started >= STABLE_S:
                backoff.reset()
            delay = backoff.next()
            logger.warning("worker %d (pid %d) died (%s); restarting in %.1f s", index,
                           process.pid, describe_exit(returncode), delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)
            if self.stop.is_set():
                return 0

    def terminate_all(self) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)


def _read_report(fd: int) -> bytes:
    """The worker's one report line (empty when it exited first); closes ``fd``."""
    with os.fdopen(fd, "rb") as report:
        return report.readline()


def _write_ports_file(path: str, ports: dict[str, int]) -> None:
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(ports))
    partial.replace(target)


async def _run(pool: _Pool) -> int:
    loop = asyncio.get_running_loop()
    first_starts: list[asyncio.Future[bool]] = [loop.create_future() for _ in range(pool.count)]
    keepers = [
        asyncio.ensure_future(pool.keep(index, first))
        for index, first in enumerate(first_starts)
    ]
    stopping = asyncio.ensure_future(pool.stop.wait())
    all_started = asyncio.gather(*first_starts)
    failed = False
    try:
        # A keeper ends before the stop only when its worker could not start or it broke.
        waiting: set[asyncio.Future[Any]] = {stopping, all_started, *keepers}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        failed = any(f.done() and not f.result() for f in first_starts) or any(
            k.done() for k in keepers
        )
        if not pool.stop.is_set():
            if failed:
                pool.stop.set()  # one worker could not start: the pool does not either
            else:
                _announce(pool)
                await asyncio.wait({stopping, *keepers}, return_when=asyncio.FIRST_COMPLETED)
                if not pool.stop.is_set():  # a keeper broke (it never returns otherwise)
                    failed = True
                    pool.stop.set()
        logger.info("stopping %d workers", pool.count)
        pool.terminate_all()
        outcomes = await asyncio.gather(*keepers, return_exceptions=True)
    finally:
        stopping.cancel()
        all_started.cancel()
        for keeper in keepers:
            keeper.cancel()
        pool.terminate_all()
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            logger.error("supervising worker %d failed: %r", index, outcome)
            failed = True
        elif not _clean_exit(outcome):
            failed = True
    return 1 if failed else 0


def _announce(pool: _Pool) -> None:
    """Every worker listens: write the ports file and say so."""
    ports = _pool_ports(pool.settings, pool)
    if pool.settings.ports_file:
        _write_ports_file(pool.settings.ports_file, ports)
    logger.info("pool listening: %s (%d workers, pids %s)",
                " ".join(f"{k}={pool.settings.host}:{v}" for k, v in ports.items()),
                pool.count, ",".join(str(p.pid) for p in pool.processes.values()))


def _pool_ports(settings: Settings, pool: _Pool) -> dict[str, int]:
    names = ["http"]
    if settings.grpc_enabled:
        names.append("grpc")
    if settings.metrics_port is not None:
        names.append("metrics")
    return {name: bound_port(sock) for name, sock in zip(names, pool.reserved, strict=True)}


async def supervise(settings: Settings) -> int:
    """Serve with ``settings.workers`` processes until SIGTERM or SIGINT; the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with tempfile.TemporaryDirectory(prefix="disagg-sidecar-") as run_dir:
        pool = _Pool(settings, Path(run_dir), stop)
        try:
            try:
                pool.prepare()
            except OSError as exc:
                logger.error("cannot hold the ports on %s: %s", settings.host, exc)
                return 1
            logger.info("starting %d workers (run dir %s)", pool.count, run_dir)
            code = await _run(pool)
        finally:
            pool.close()
    logger.info("stopped")
    return code
