"""How fast this machine runs what a relay is made of: interpreter steps and system calls.

    python -m bench.machine_speed          the three figures, once
    speed()                                the same as a dict (``bench.run`` puts it in every
                                           result's ``machine``, and its Machine line)

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
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Final

#: Repetitions per run and runs per figure: about 0.2 s in all on a slow VM.
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
    return (f"Machine: {m['cores']} cores ({m['cpu'] or 'unknown CPU'}), Python "
            f"{m['python']}{versions}{described(m.get('speed'))}; {result['started']}  ")


def main() -> None:
    figures = speed()
    print(f"this machine{described(figures)}".replace("; ", ": ", 1))


if __name__ == "__main__":
    main()
