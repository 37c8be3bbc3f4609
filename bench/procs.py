"""The benchmark's processes: stub engines and the sidecar, each its own OS process.

    start_stub(...)    ─▶ python -m sidecar.tools.stubs --transport lean|aiohttp ...
                          (lean, the default); reads its "listening" line
    start_sidecar(...) ─▶ python -m bench.sidecar_proc ... (reads its --ports-file)
    start_relay(...)   ─▶ python -m bench.bare_relay ... (the paced mode's floor)
    start_server(...)  ─▶ any other server (the anchors, ``bench.anchors``): free ports,
                          ready once a probe answers
    cpu_seconds(pid)   ─▶ user + system CPU of that process, from /proc
    tree_cpu_seconds(pid) ─▶ the same for it and its descendants (``--workers N`` sidecars)
    thread_cpu_ns(pid, tree) ─▶ CPU per thread (of its descendants too): a window's CPU is
                          then counted thread by thread (``bench.thread_meter``)

Separate processes so that ``/proc/<pid>`` gives the sidecar's CPU alone. Every process is
bound to 127.0.0.1 on OS-chosen ports, started with a deadline and stopped (SIGTERM, then
SIGKILL) by the pid this module started; nothing else is ever signalled.

``prefix`` wraps a command (a profiler, or ``taskset -c CPUS`` to pin it: the paced mode's
``--pin-sidecar``/``--pin-bench``); unpinned, everything shares the cores, as a pod's
containers would.

Deliberate limits: Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

REPO_ROOT = Path(__file__).resolve().parent.parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_SCHEDSTAT = Path("/proc/self/schedstat").exists()
_START_TIMEOUT_S = 30.0


@dataclass
class Proc:
    """One started process and what it told us about itself."""

    name: str
    popen: subprocess.Popen[bytes]
    port: int
    info: dict[str, Any] = field(default_factory=dict)
    #: The process group it leads (a wrapped sidecar's, see ``start_sidecar``), which
    #: ``stop`` ends as a whole.
    group: int | None = None
    #: The Python it was started with, when it is one of the bench's own Python servers
    #: (``start_sidecar``, ``start_relay``): a command that starts with it is not a wrapper.
    interpreter: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def child_env(code_root: Path = REPO_ROOT) -> dict[str, str]:
    """The environment of every child: the code importable, no proxies, no buffering."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys(p for p in (str(code_root), str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _read_line(popen: subprocess.Popen[bytes], deadline: float) -> bytes:
    assert popen.stdout is not None
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            break
        ready, _, _ = select.select([popen.stdout], [], [], 0.1)
        if ready:
            return popen.stdout.readline()
    raise RuntimeError(f"process {popen.args!r} did not report listening in time")


STUBS = ("lean", "aiohttp")


def start_stub(
    name: str, engine: str, role: str, kv_connector: str, *extra: str, log_dir: Path,
    kind: str = "lean", prefix: list[str] | None = None,
) -> Proc:
    """A stub engine in zero-latency mode, on the ``lean`` transport (vLLM NIXL and SGLang)
    or the ``aiohttp`` one (recording nothing: ``--record-limit 0``); ``sidecar.tools.stubs``."""
    common = [
        "--engine", engine, "--role", role, "--kv-connector", kv_connector,
        "--host", "127.0.0.1", "--port", "0", "--bootstrap-port", "0",
    ]
    if kind == "lean":
        args = [sys.executable, "-m", "sidecar.tools.stubs", "--transport", "lean", *common, *extra]
        args = [*(prefix or []), *args]
    elif kind == "aiohttp":
        args = [
            sys.executable, "-m", "sidecar.tools.stubs", "--transport", "aiohttp", *common,
            "--record-limit", "0", "--ttft", "0", "--itl", "0", *extra,
        ]
    else:
        raise ValueError(f"unknown stubs {kind!r}; known: {', '.join(STUBS)}")
    return start_reporting(name, "stub", args, log_dir)


def start_relay(name: str, upstream_port: int, *, log_dir: Path,
                prefix: list[str] | None = None, python: str | None = None) -> Proc:
    """``bench.bare_relay`` forwarding to ``127.0.0.1:upstream_port``; ``python``: the
    interpreter it runs on (default: the bench's own), as for ``start_sidecar``."""
    interpreter = python or sys.executable
    args = [*(prefix or []), interpreter, "-m", "bench.bare_relay",
            "--upstream", f"127.0.0.1:{upstream_port}"]
    proc = start_reporting(name, "relay", args, log_dir)
    proc.interpreter = interpreter
    return proc


def start_reporting(name: str, what: str, args: list[str], log_dir: Path, *,
                    start_timeout_s: float = _START_TIMEOUT_S) -> Proc:
    """Start ``args``, which reports its port as one JSON line on stdout once listening
    (within ``start_timeout_s``: more under valgrind)."""
    stderr = (log_dir / f"{name}.log").open("wb")
    popen = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=stderr, env=child_env(), cwd=REPO_ROOT
    )
    stderr.close()
    try:
        info: dict[str, Any] = json.loads(_read_line(popen, time.monotonic() + start_timeout_s))
    except (RuntimeError, ValueError):
        stop(Proc(name, popen, 0))
        raise RuntimeError(
            f"{what} {name} failed to start; see {log_dir / (name + '.log')}"
        ) from None
    return Proc(name, popen, int(info["port"]), info)


def start_sidecar(
    name: str, flags: list[str], *, log_dir: Path, prefix: list[str], code_root: Path = REPO_ROOT,
    python: str | None = None,
) -> Proc:
    """The sidecar's ``serve`` path with ``flags``; ``prefix`` wraps it (e.g. a profiler).

    ``code_root``: the tree whose ``sidecar`` package runs (e.g. ``git archive`` of an older
    commit, for a before/after comparison on the same machine state). ``python``: the
    interpreter it runs on (``--sidecar-python``: one built as the container image's is, in
    an environment with the sidecar's dependencies); default: the bench's own.
    """
    ports_file = log_dir / f"{name}.ports.json"
    with contextlib.suppress(FileNotFoundError):
        ports_file.unlink()
    interpreter = python or sys.executable
    args = [
        *prefix, interpreter, "-m", "bench.sidecar_proc",
        "--host", "127.0.0.1", "--port", "0", "--no-grpc", "--ports-file", str(ports_file),
        "--log-level", "warning", *flags,
    ]
    log = (log_dir / f"{name}.log").open("wb")
    # A wrapper gets a process group of its own: ``stop`` ends the whole group, since some
    # wrappers (strace) exit on SIGINT and leave the sidecar they started running.
    popen = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env=child_env(code_root), cwd=code_root,
        start_new_session=bool(prefix),
    )
    group = popen.pid if prefix else None
    log.close()
    # A wrapper (profiler, valgrind) can slow the start-up many times over.
    deadline = time.monotonic() + _START_TIMEOUT_S * (10 if prefix else 1)
    while time.monotonic() < deadline and popen.poll() is None:
        if ports_file.exists():
            ports: dict[str, int] = json.loads(ports_file.read_bytes())
            return Proc(name, popen, int(ports["http"]), {"ports": ports}, group, interpreter)
        time.sleep(0.05)
    stop(Proc(name, popen, 0, group=group))
    raise RuntimeError(f"sidecar failed to start; see {log_dir / (name + '.log')}")


def free_port() -> int:
    """A port the OS has just handed out on 127.0.0.1, for a server that cannot be told
    ``--port 0`` (both anchors refuse it). Another process could take it before the server
    binds: ``start_server`` then retries with a fresh one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def start_server(
    name: str, command: Callable[[int, int], list[str]], ready: Callable[[int], bool], *,
    log_dir: Path, env: dict[str, str] | None = None, timeout_s: float = 60.0,
    attempts: int = 3,
) -> Proc:
    """Start ``command(port, second_port)`` (two free ports: a server and its metrics
    listener), logging to ``log_dir/name.log``; it is up once ``ready(port)`` says so.

    A process that exits before it is ready (its port was taken meanwhile) is started
    again on fresh ports, ``attempts`` times in all; one that never gets ready is stopped.
    """
    log_path = log_dir / f"{name}.log"
    for _ in range(attempts):
        port, second = free_port(), free_port()
        log = log_path.open("ab")
        popen = subprocess.Popen(
            command(port, second), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, env=env if env is not None else child_env(), cwd=REPO_ROOT,
        )
        log.close()
        proc = Proc(name, popen, port, {"metrics_port": second})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and popen.poll() is None:
            if ready(port):
                return proc
            time.sleep(0.1)
        stop(proc)
        if time.monotonic() >= deadline:
            break
    raise RuntimeError(f"{name} failed to get ready; see {log_path}")


def sidecar_flags(engine: str, connector: str, prefill: Proc, decode: Proc,
                  max_connections: int) -> list[str]:
    """``serve`` flags for a sidecar in front of ``decode`` that may use ``prefill``."""
    flags = [
        "--engine", engine, "--engine-url", decode.url,
        "--prefill-allowlist", f"127.0.0.1:{prefill.port}",
        "--max-connections", str(max_connections),
    ]
    if engine == "vllm":
        flags += ["--kv-connector", connector]
    bootstrap = prefill.info.get("bootstrap_port")
    if bootstrap:
        flags += ["--sglang-bootstrap-port", str(bootstrap),
                  "--mooncake-bootstrap-port", str(bootstrap)]
    return flags


def server_pid(proc: Proc) -> int:
    """The pid that serves: the wrapped Python child when a profiler prefix started it
    (``taskset`` execs its command, so a pinned process keeps its pid; a command that starts
    with the interpreter it was started with is the server itself, its children a
    ``--workers N`` sidecar's workers)."""
    children_file = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    with contextlib.suppress(OSError, ValueError):
        children = children_file.read_text().split()
        first = cast(Sequence[str], proc.popen.args)[0]  # started from a list, never a string
        if children and first not in (sys.executable, proc.interpreter, "taskset"):
            return int(children[0])
    return proc.pid


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def tree_syscalls(pid: int) -> tuple[int, int]:
    """Read and write system calls of ``pid`` and its living descendants (``/proc/*/io``:
    ``syscr``, ``syscw``): whether a relay paid one read and one write per token."""
    reads = writes = 0
    todo = [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{current}/io").read_text().splitlines():
                key, _, value = line.partition(":")
                if key == "syscr":
                    reads += int(value)
                elif key == "syscw":
                    writes += int(value)
        todo += _children(current)
    return reads, writes


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its living descendants (a supervisor and its workers).

    A descendant that exited inside a window takes its CPU with it; the bench's sidecars
    keep their workers for the whole run."""
    total = 0.0
    todo = [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += cpu_seconds(current)
        todo += _children(current)
    return total


def thread_cpu_ns(pid: int, tree: bool = False) -> dict[tuple[int, int], int]:
    """CPU nanoseconds of every living thread of ``pid`` (and, with ``tree``, of its living
    descendants), by (process, thread) id: ``schedstat`` where the kernel keeps it, else the
    thread's ``stat`` ticks. Two readings subtracted thread by thread give a window's CPU
    that a thread started inside the window adds to whole and one that ended cannot take
    back below zero (a runtime's blocking pool, e.g. tokio's, starts and ends threads)."""
    found: dict[tuple[int, int], int] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    found[(current, int(task.name))] = _thread_ns(task)
        if tree:
            todo += _children(current)
    return found


def _thread_ns(task: Path) -> int:
    ns = int((task / "schedstat").read_text().split()[0]) if _SCHEDSTAT else 0
    if ns:
        return ns
    stat = (task / "stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // _CLK_TCK


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``, to the nanosecond where the kernel keeps schedstats.

    ``/proc/<pid>/task/*/schedstat`` (time on CPU, ns, per living thread) first; else
    ``/proc/<pid>/stat`` user + system time (clock ticks, all threads, living and exited).
    """
    with contextlib.suppress(OSError, ValueError, IndexError):
        total_ns = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            total_ns += int((task / "schedstat").read_text().split()[0])
        if total_ns:
            return total_ns / 1e9
    return _stat_cpu_seconds(pid)


def _stat_cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Field 2 (comm) may hold spaces: split after its closing parenthesis.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _CLK_TCK


def stop(proc: Proc, timeout_s: float = 10.0) -> None:
    """SIGTERM the process we started (SIGINT where it wraps a server, so a profiler
    writes its output), then SIGKILL it if it lingers; a wrapper's process group (see
    ``start_sidecar``) is ended with it."""
    popen = proc.popen
    if popen.poll() is None:
        wrapped = server_pid(proc) != proc.pid
        popen.send_signal(signal.SIGINT if wrapped else signal.SIGTERM)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout_s)
    if proc.group is not None:
        _end_group(proc.group, timeout_s)
    if popen.stdout is not None:
        popen.stdout.close()


def _end_group(group: int, timeout_s: float) -> None:
    """SIGKILL what is left of process group ``group`` (its wrapper has exited: what is left
    is the sidecar it started, with nothing more to write) and wait up to ``timeout_s`` until
    none of it lives (zombies left to a parent that does not reap them, as some containers'
    first process, count as gone)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    # Another process's end is only observable by asking (it is not our child).
    while _group_lives(group) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_lives(group: int) -> bool:
    """Whether process group ``group`` has a member that is not a zombie
    (``/proc/<pid>/stat``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            # After the command's closing parenthesis: state, ppid, pgrp, ...
            state, _, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == group and state != "Z":
                return True
    return False


def cpu_model() -> str:
    """The machine's CPU model name ("" when /proc/cpuinfo does not say)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""
