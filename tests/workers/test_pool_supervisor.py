"""Proves the supervisor's decisions with stand-in worker processes (no real spawn):

- a worker that dies before it ever listened stops the whole pool with exit 1, the others
  are sent SIGTERM, and the ports file is not written;
- a worker that dies after listening is restarted (a new spawn of the same index), and
  SIGTERM then stops every worker with exit 0;
- the run directory holds the workers' settings with the reserved ports (port 0 resolved
  once) and no ports file of their own.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import pytest
from pool_builders import eventually

from sidecar.config.settings import Settings
from sidecar.workers import supervisor
from sidecar.workers.identity import SETTINGS_FILE


class FakeWorker:
    """A worker process stand-in: exits when told to (or when signalled)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.signals: list[int] = []
        self._exited = asyncio.Event()

    def exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if self.returncode is None:
            self.exit(0 if sig == signal.SIGTERM else -sig)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode


class FakeSpawner:
    """Replaces ``_Pool.spawn``: worker ``index``'s n-th start listens unless told to fail."""

    def __init__(self, failing: set[tuple[int, int]]) -> None:
        self.failing = failing
        self.started: list[tuple[int, FakeWorker]] = []
        self.changed = asyncio.Event()

    @property
    def method(self) -> Any:
        async def spawn(pool: Any, index: int) -> tuple[FakeWorker, dict[str, int] | None]:
            return await self(pool, index)

        return spawn

    async def __call__(self, pool: Any, index: int) -> tuple[FakeWorker, dict[str, int] | None]:
        attempt = sum(1 for i, _ in self.started if i == index)
        worker = FakeWorker(1000 + len(self.started))
        self.started.append((index, worker))
        pool.processes[index] = worker
        self.changed.set()
        if (index, attempt) in self.failing:
            worker.exit(3)
            return worker, None
        return worker, {"http": 1}


def _settings(tmp_path: Path) -> Settings:
    return Settings(host="127.0.0.1", port=0, grpc_port=0, workers=2,
                    ports_file=str(tmp_path / "ports.json"), drain_grace_s=1.0)


@pytest.fixture
def no_process_files(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand-ins have no prometheus files; the slot clearing still runs for real.
    monkeypatch.setattr(supervisor, "mark_process_dead", lambda pid, path: None)


@pytest.mark.usefixtures("no_process_files")
async def test_a_worker_failing_its_first_start_stops_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawner = FakeSpawner(failing={(1, 0)})
    monkeypatch.setattr(supervisor._Pool, "spawn", spawner.method)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pool = supervisor._Pool(_settings(tmp_path), run_dir, asyncio.Event())
    pool.prepare()
    try:
        assert await asyncio.wait_for(supervisor._run(pool), 30) == 1
    finally:
        pool.close()
    workers = dict(spawner.started)
    assert workers[0].signals == [signal.SIGTERM]
    assert not (tmp_path / "ports.json").exists()
    assert len(spawner.started) == 2  # nothing restarted


@pytest.mark.usefixtures("no_process_files")
async def test_a_worker_dying_after_listening_is_restarted_then_all_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawner = FakeSpawner(failing=set())
    monkeypatch.setattr(supervisor._Pool, "spawn", spawner.method)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stop = asyncio.Event()
    pool = supervisor._Pool(_settings(tmp_path), run_dir, stop)
    pool.prepare()
    written = json.loads((run_dir / SETTINGS_FILE).read_text())
    assert written["port"] == pool.reserved[0].getsockname()[1] != 0
    assert written["grpc_port"] != 0 and written["ports_file"] is None
    running = asyncio.ensure_future(supervisor._run(pool))
    try:
        async with asyncio.timeout(30):
            async def ports_written() -> bool:  # once both workers listen
                return (tmp_path / "ports.json").exists()

            await eventually(ports_written)
            spawner.changed.clear()
            dict(spawner.started)[1].exit(-signal.SIGKILL)
            while len(spawner.started) < 3:
                await spawner.changed.wait()
                spawner.changed.clear()
            assert spawner.started[2][0] == 1  # the same index, a new process
            stop.set()
            assert await running == 0
    finally:
        pool.close()
    assert all(w.signals == [signal.SIGTERM] for i, w in spawner.started if w.pid != 1001)
