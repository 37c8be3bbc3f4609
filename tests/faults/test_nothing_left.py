"""Proves that a worker started and stopped leaves nothing behind: no task of the sidecar's,
no file descriptor (files, sockets, the pool's in-flight slots), no mapping of the slots file,
no thread.

The worker is the real one (``serve.run_server``, its HTTP door: the stop path that did not
close the runtime; as worker 0 of a pool of two so that its in-flight slots are mapped) in
front of SGLang stub engines; before it stops,
a client goes away mid-stream, so the sidecar sends SGLang's abort call, which the engines
never answer (a hung engine): the abort calls are still running when the stop comes. Each
worker runs its own event loop (``asyncio.run``), so the default executor's threads are part
of what must end. The baseline is taken after one warm-up run, so the interpreter's and
libraries' first-use state (gRPC's, OpenTelemetry's) is not counted as left behind.

Does not prove a process-level exit (the CLI tests send SIGTERM to the real process), nor
the gRPC door's (grpc.aio cannot serve from two event loops of one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import aiohttp
from fault_builders import client_body, faults, sidecar_settings_for, started_stub, stub_config
from sidecar_builders import sidecar_settings

from sidecar.dialects.sglang import ABORT_PATH
from sidecar.protocol.context import Route
from sidecar.serve import run_server
from sidecar.workers.identity import INFLIGHT_FILE, WorkerIdentity
from sidecar.workers.shared_inflight import InflightSlots

COMPLETIONS = Route.COMPLETIONS.value
SIDECAR_CODE = Path(__file__).resolve().parents[2] / "sidecar"
STUBS_CODE = SIDECAR_CODE / "tools"


def sidecar_tasks() -> list[asyncio.Task[object]]:
    """Running tasks whose coroutine is the sidecar's own (the stubs' are the test's)."""
    found = []
    for task in asyncio.all_tasks():
        code = getattr(task.get_coro(), "cr_code", None)
        if code is None:
            continue
        path = Path(code.co_filename)
        if path.is_relative_to(SIDECAR_CODE) and not path.is_relative_to(STUBS_CODE):
            found.append(task)
    return found


def open_fds() -> set[str]:
    """This process's descriptors, by what they point at."""
    names = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            names.add(str(fd.readlink()))
    return names


async def one_worker(run_dir: Path, abort_hangs: bool) -> list[str]:
    """Start a worker, have a client leave mid-stream, stop it; the sidecar tasks left."""
    hang_aborts = faults({"kind": "hang", "path": ABORT_PATH}) if abort_hangs else ()
    stall = faults({"kind": "stall", "after_chunks": 1, "times": 1})
    async with (
        started_stub(stub_config("sglang", "prefill", "shfs", faults=hang_aborts)) as prefill,
        started_stub(stub_config("sglang", "decode", "shfs",
                                 faults=(*stall, *hang_aborts))) as decode,
    ):
        InflightSlots.create(run_dir / INFLIGHT_FILE, 2)
        settings = sidecar_settings(**sidecar_settings_for(
            "sglang", "shfs", prefill, decode, read_timeout_s=30.0))
        stop = asyncio.Event()
        listening: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
        server = asyncio.ensure_future(run_server(
            settings, stop, listening.set_result, worker=WorkerIdentity(0, 2, run_dir)))
        ports = await listening
        url = f"http://127.0.0.1:{ports['http']}{COMPLETIONS}"
        headers = {"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}
        async with aiohttp.ClientSession() as client:
            response = await client.post(url, json=client_body(stream=True), headers=headers)
            await response.content.readuntil(b"\n\n")  # a first event, then the client leaves
            response.close()
            await decode.recorder.next_request(ABORT_PATH)  # the abort call is out
            async with client.post(url, json=client_body(), headers=headers) as response:
                assert response.status == 200
        stop.set()
        assert await server == 0
        left = [repr(task.get_coro()) for task in sidecar_tasks()]
    return left


def test_a_worker_started_and_stopped_leaves_nothing(tmp_path: Path) -> None:
    warm_up = tmp_path / "warm-up"
    warm_up.mkdir()
    asyncio.run(one_worker(warm_up, abort_hangs=False))  # libraries' first-use state
    threads, fds = set(threading.enumerate()), open_fds()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    left = asyncio.run(one_worker(run_dir, abort_hangs=True))
    assert left == []
    assert set(threading.enumerate()) == threads
    assert open_fds() == fds
    maps = Path("/proc/self/maps").read_text()
    assert str(run_dir / INFLIGHT_FILE) not in maps
