"""The bench's process handling: a sidecar started under a wrapper that exits on SIGINT and
leaves its child running (as strace does) is still ended by ``stop``; a sidecar started on
another interpreter (``--sidecar-python``) is measured as itself.

Proves: the wrapped sidecar serves, and after ``stop`` neither the wrapper nor the sidecar
it started lives (a zombie the machine's first process does not reap counts as ended); a
``--workers 2`` sidecar run by another interpreter's path serves, runs that path, and is
its own serving pid (its children are its workers, not a wrapper's command).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import urllib.request
from pathlib import Path

from bench import procs

#: A wrapper that starts its command in the background and exits on SIGINT without passing
#: it on (a background job of a non-interactive shell ignores SIGINT): the command outlives it.
_LEAVING_WRAPPER = ["/bin/sh", "-c", 'trap "exit 0" INT; "$@" & wait', "wrapper"]


def _lives(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_stop_ends_a_wrapped_sidecar_its_wrapper_left_running(tmp_path: Path) -> None:
    flags = ["--engine", "vllm", "--engine-url", f"http://127.0.0.1:{procs.free_port()}",
             "--kv-connector", "nixl"]
    sidecar = procs.start_sidecar("wrapped", flags, log_dir=tmp_path, prefix=_LEAVING_WRAPPER)
    served_by = procs.server_pid(sidecar)
    assert served_by != sidecar.pid  # the wrapper's child serves
    try:
        with urllib.request.urlopen(sidecar.url + "/health", timeout=10) as response:
            assert response.status == 200
    finally:
        procs.stop(sidecar)
    try:
        assert not _lives(sidecar.pid)
        assert not _lives(served_by)
    finally:  # a failed test leaves nothing running either
        with contextlib.suppress(ProcessLookupError):
            os.kill(served_by, signal.SIGKILL)


def test_a_sidecar_on_another_interpreter_is_its_own_server(tmp_path: Path) -> None:
    # Another name of this environment's interpreter (a venv has python, python3 and
    # python3.X): a path that is not sys.executable, with the sidecar's packages.
    names = [f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"]
    python = next(Path(sys.executable).with_name(name) for name in names
                  if Path(sys.executable).with_name(name) != Path(sys.executable))
    assert python.exists()
    flags = ["--engine", "vllm", "--engine-url", f"http://127.0.0.1:{procs.free_port()}",
             "--kv-connector", "nixl", "--workers", "2"]
    sidecar = procs.start_sidecar("other-python", flags, log_dir=tmp_path, prefix=[],
                                  python=str(python))
    try:
        with urllib.request.urlopen(sidecar.url + "/health", timeout=10) as response:
            assert response.status == 200
        command = Path(f"/proc/{sidecar.pid}/cmdline").read_bytes().split(b"\0")
        assert command[0] == str(python).encode()
        assert procs.server_pid(sidecar) == sidecar.pid
    finally:
        procs.stop(sidecar)
