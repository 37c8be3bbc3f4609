"""Proves the pool behaves as one sidecar through overload, SIGTERM and a killed worker:

- ``--max-inflight`` bounds the pool: with 2 requests held in flight, every new request is
  refused 503 ``overloaded`` by either worker, including one that holds none itself;
- SIGTERM to the supervisor drains every worker: each logs its drain with requests in flight,
  new requests get 503 ``draining``, the held requests still get their whole answer, the
  supervisor exits 0 and no worker process or run directory is left;
- a worker killed with SIGKILL is logged and restarted, and the pool serves on: the new worker
  takes connections and ``/metrics`` still counts the dead worker's requests;
- the inline-KV staging sweep runs in worker 0 only (an orphan is removed, one sweeper is
  logged), and a restarted worker 0 takes it up again;
- no worker outlives a supervisor killed with SIGKILL; a port held by another program stops
  the pool at start with exit 2 and one line.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path

from pool_builders import (
    eventually,
    fresh_session,
    gather_limited,
    pd_settings,
    pid_alive,
    post_pd,
    running_pool,
    stubs,
)

COMPLETIONS = "/v1/completions"


async def test_max_inflight_bounds_the_whole_pool() -> None:
    async with stubs("vllm") as (prefill, decode), running_pool(
        max_inflight=2, **pd_settings("vllm", "shfs", prefill, decode)
    ) as pool, fresh_session() as session:
        prefill.faults.add("hang", times=2)
        held = [asyncio.ensure_future(post_pd(session, pool, prefill)) for _ in range(2)]
        for _ in held:
            await prefill.recorder.next_request(COMPLETIONS)

        async def two_in_flight() -> bool:
            return await pool.metric("disagg_inflight_requests") == 2

        await eventually(two_in_flight)
        refused = await gather_limited(post_pd(session, pool, prefill) for _ in range(16))
        assert [status for status, _ in refused] == [503] * 16
        assert {body["error"]["code"] for _, body in refused} == {"overloaded"}
        # Both workers refused: one of them at most holds one request itself, so it counted
        # the other's too.
        per_worker = [pool.worker_metric(pid, "disagg_errors_total", code="overloaded")
                      for pid in pool.pids.values()]
        assert len(per_worker) == 2 and all(n > 0 for n in per_worker), per_worker

        prefill.faults.release_hangs()
        await asyncio.gather(*held)
        prefill.faults.clear()

        async def none_in_flight() -> bool:
            return await pool.metric("disagg_inflight_requests") == 0

        await eventually(none_in_flight)
        status, _ = await post_pd(session, pool, prefill)
        assert status == 200
        assert await pool.stop() == 0


async def test_sigterm_drains_every_worker() -> None:
    async with stubs("vllm") as (prefill, decode), running_pool(
        drain_grace_s=60.0, **pd_settings("vllm", "shfs", prefill, decode)
    ) as pool, fresh_session() as session:
        prefill.faults.add("hang", times=12)
        held = [asyncio.ensure_future(post_pd(session, pool, prefill)) for _ in range(12)]
        for _ in held:
            await prefill.recorder.next_request(COMPLETIONS)

        async def twelve_in_flight() -> bool:
            return await pool.metric("disagg_inflight_requests") == 12

        await eventually(twelve_in_flight)
        per_worker = [pool.worker_metric(pid, "disagg_inflight_requests")
                      for pid in pool.pids.values()]
        assert all(n > 0 for n in per_worker), per_worker  # both workers hold some
        run_dir = pool.run_dir
        assert run_dir is not None and run_dir.is_dir()

        mark = len(pool.lines)
        pool.process.send_signal(signal.SIGTERM)
        for _ in range(2):
            await pool.wait_line("draining:", after=mark)

        async def both_draining() -> bool:
            return pool.count("draining:") == 2

        await eventually(both_draining)
        draining = [line for line in pool.lines[mark:] if "draining:" in line]
        assert sorted(int(line.split("draining: ")[1].split()[0]) for line in draining) == \
            sorted(int(n) for n in per_worker)
        refused = await gather_limited(post_pd(session, pool, prefill) for _ in range(8))
        assert {(status, body["error"]["code"]) for status, body in refused} == \
            {(503, "draining")}
        assert pool.process.returncode is None  # still waiting for the held requests

        prefill.faults.release_hangs()  # the held prefills answer (503): each gets its reply
        answers = await asyncio.gather(*held)
        assert {(status, body["error"]["code"]) for status, body in answers} == \
            {(502, "prefill_failed")}
        assert await pool.stop() == 0
        assert not any(pid_alive(pid) for pid in pool.pids.values())
        assert not run_dir.exists()


async def test_killed_worker_is_restarted_and_serves() -> None:
    async with stubs("vllm") as (prefill, decode), running_pool(
        **pd_settings("vllm", "shfs", prefill, decode)
    ) as pool, fresh_session() as session:
        first = await gather_limited(post_pd(session, pool, prefill) for _ in range(20))
        assert [status for status, _ in first] == [200] * 20
        victim = pool.pids[1]
        mark = len(pool.lines)
        os.kill(victim, signal.SIGKILL)
        died = await pool.wait_line(f"worker 1 (pid {victim}) died", after=mark)
        assert "signal SIGKILL" in died and "restarting" in died
        await pool.wait_line("worker 1 listening", after=mark)
        assert pool.pids[1] != victim and not pid_alive(victim)

        after = await gather_limited(post_pd(session, pool, prefill) for _ in range(20))
        assert [status for status, _ in after] == [200] * 20
        assert pool.worker_metric(pool.pids[1], "disagg_requests_total", outcome="ok") > 0
        # Counters never go backwards: the dead worker's 20-odd requests still count.
        assert await pool.metric("disagg_requests_total", outcome="ok") == 40
        assert await pool.metric("disagg_inflight_requests") == 0
        assert await pool.stop() == 0


async def test_staging_sweep_runs_in_worker_zero_only(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    orphan = staging / ("d-" + "ab" * 16)
    orphan.mkdir()
    (orphan / "layer-0").write_bytes(b"kv")
    an_hour_ago = time.time() - 3600
    os.utime(orphan, (an_hour_ago, an_hour_ago))
    async with stubs("vllm") as (_, decode), running_pool(
        engine_url=decode.url, kv_transport="inline", kv_staging_dir=str(staging),
        prefill_timeout_s=5.0,
    ) as pool:
        await pool.wait_line("sweeping KV staging")
        # The log line, not the directory's absence: the sweep removes the entry first and
        # logs after, so a worker killed in between would take the line with it.
        await pool.wait_line("removed 1 orphaned KV staging entries")
        assert not orphan.exists()
        mark = len(pool.lines)
        worker_zero = pool.pids[0]
        os.kill(worker_zero, signal.SIGKILL)
        await pool.wait_line("worker 0 listening", after=mark)
        await pool.wait_line("sweeping KV staging", after=mark)
        assert await pool.stop() == 0
    assert pool.count("sweeping KV staging") == 2  # worker 0, then its replacement
    assert pool.count("removed 1 orphaned KV staging entries") == 1


async def test_workers_do_not_outlive_a_killed_supervisor() -> None:
    async with stubs("vllm") as (_, decode), running_pool(engine_url=decode.url) as pool:
        workers = list(pool.pids.values())
        pool.process.kill()
        await pool.process.wait()

        async def all_gone() -> bool:
            return not any(pid_alive(pid) for pid in workers)

        await eventually(all_gone)

        async def both_logged() -> bool:  # each drained on its own, not killed
            return pool.count("the supervisor is gone; draining") == 2

        await eventually(both_logged)


async def test_a_port_held_elsewhere_stops_the_pool_at_start() -> None:
    with socket.socket() as holder:  # no SO_REUSEPORT: the port is not shareable
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", "serve", "--workers", "2", "--host", "127.0.0.1",
            "--port", str(port), "--grpc-port", "0",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2  # a port in use is a configuration error, as alone
    assert f"--port 127.0.0.1:{port} is in use".encode() in stderr
    assert b"worker 0 started" not in stderr
