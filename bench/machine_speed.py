"""How fast this machine runs what a relay is made of: interpreter steps and system calls.

    python -m bench.machine_speed          the three figures, once
    python -m bench.machine_speed --json   the same, and this interpreter's version, as JSON
    speed()                                the figures as a dict (``bench.run`` puts it in every
                                           result's ``machine``, and its Machine line)
    interpreter(python)                    another interpreter's version and loop step (the
                                           one ``--sidecar-python`` runs the sidecar on)

Two VMs of the same kind and CPU model name have given CPU figures per request 2.5-3x apart
(the sidecar's JSON PD request at c=32: 201-213 us on one, 549-624 us on the other, hours
apart; `vllm-router` 181-188 and 393-420 us), and the ratios against the routers moved with
them (bench/RESULTS.md, 2026-12-07).
A CPU model name cannot tell the two apart; these probes can, so figures from different runs are
compared only where the probes agree:

- ``loop_step_ns``: one step of a plain Python loop adding integers (what the interpreter's
  own speed is; about 25-40 ns on a current desktop core);
- ``syscall_ns``: one ``getppid``, the cheapest system call (what entering the kernel costs:
  virtualisation and mitigations show here);
- ``loopback_ns``: one byte sent and read back on a Unix socket pair (a relay's I/O in little).

Each figure is the fastest of several short runs (the least disturbed by whatever else runs),
measured before the bench starts its processes.

The loop step also tells two builds of one Python version apart: on the bench VM, 2026-12-07,
three back-to-back pairs gave pyenv's 3.11.7 (built without profile-guided optimization)
72.0, 43.8 and 43.3 ns a step, Debian's 3.11.2 (optimized) 58.0, 34.6 and 31.9 ns. A sidecar
run on another interpreter than the bench's (``--sidecar-python``) gets that interpreter's
own step on the Machine line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

#: Repetitions per run and runs per figure: about 0.3 s in all on a slow VM.
_LOOP_STEPS: Final = 200_000
_SYSCALLS: Final = 20_000
_ROUND_TRIPS: Final = 5_000
_RUNS: Final = 5


def _loop_step_ns() -> float:
    best = float("inf")
    for _ in range(_RUNS):
        start = time.perf_counter_ns()
        total = 0
        for i in range(_LOOP_STEPS):
            total += i
        best = min(best, (time.perf_counter_ns() - start) / _LOOP_STEPS)
    return best


def _syscall_ns() -> float:
    best = float("inf")
    getppid = os.getppid
    for _ in range(_RUNS):
        start = time.perf_counter_ns()
        for _ in range(_SYSCALLS):
            getppid()
        best = min(best, (time.perf_counter_ns() - start) / _SYSCALLS)
    return best


def _loopback_ns() -> float:
    best = float("inf")
    near, far = socket.socketpair()
    with near, far:
        send, recv = near.send, far.recv
        for _ in range(_RUNS):
            start = time.perf_counter_ns()
            for _ in range(_ROUND_TRIPS):
                send(b"x")
                recv(1)
            best = min(best, (time.perf_counter_ns() - start) / _ROUND_TRIPS)
    return best


def speed() -> dict[str, float]:
    """The three figures of the module docstring, in nanoseconds (one decimal)."""
    return {"loop_step_ns": round(_loop_step_ns(), 1), "syscall_ns": round(_syscall_ns(), 1),
            "loopback_ns": round(_loopback_ns(), 1)}


def interpreter(python: str) -> dict[str, Any]:
    """``python``'s version, its executable with links resolved, and its loop step, measured
    by running this module there (the bench's tree on its path)."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run([python, "-m", "bench.machine_speed", "--json"], env=env, cwd=repo,
                         capture_output=True, check=True, timeout=60).stdout
    facts: dict[str, Any] = json.loads(out)
    return {"path": python, "executable": facts["executable"], "version": facts["version"],
            "loop_step_ns": facts["speed"]["loop_step_ns"]}


def described(figures: dict[str, float] | None) -> str:
    """The figures as the Machine line's words ("" when a result predates them)."""
    if not figures:
        return ""
    return (f"; a Python loop step {figures['loop_step_ns']:g} ns, a system call "
            f"{figures['syscall_ns']:g} ns, a loopback byte there and back "
            f"{figures['loopback_ns']:g} ns")


def machine_line(result: dict[str, Any], packages: tuple[str, ...]) -> str:
    """A report's Machine line (Markdown, a hard break at its end): cores, CPU, Python, the
    ``packages``' versions, the figures, when the run started."""
    m = result["machine"]
    versions = "".join(f", {name} {m['packages'].get(name, '?')}" for name in packages)
    other = m.get("sidecar_python")
    sidecar = (f"; the sidecar on Python {other['version']} ({other['executable']}), a loop "
               f"step {other['loop_step_ns']:g} ns" if other else "")
    return (f"Machine: {m['cores']} cores ({m['cpu'] or 'unknown CPU'}), Python "
            f"{m['python']}{versions}{described(m.get('speed'))}{sidecar}; "
            f"{result['started']}  ")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.machine_speed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true",
                        help="the figures, the interpreter's version and executable, as JSON")
    args = parser.parse_args()
    figures = speed()
    if args.json:
        print(json.dumps({"version": platform.python_version(),
                          "executable": str(Path(sys.executable).resolve()), "speed": figures}))
        return
    print(f"this machine{described(figures)}".replace("; ", ": ", 1))


if __name__ == "__main__":
    main()
