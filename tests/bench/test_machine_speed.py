"""The machine's speed probes (``bench.machine_speed``): three figures every bench result
carries, so runs on two VMs of the same CPU name are told apart.

Proves: each probe measures something (a positive time), the Machine lines of both reports
name the figures, and a result written before the probes existed still renders; another
interpreter (``--sidecar-python``) reports its own version and loop step, which the Machine
line names.
"""

from __future__ import annotations

import inspect
import platform
import sys
from pathlib import Path
from typing import Any

from bench import machine_speed, paced, report


def test_each_probe_measures_a_positive_time() -> None:
    figures = machine_speed.speed()
    assert set(figures) == {"loop_step_ns", "syscall_ns", "loopback_ns"}
    assert all(value > 0 for value in figures.values())
    # A round trip on a socket pair is two system calls at least.
    assert figures["loopback_ns"] > figures["syscall_ns"]


def _result(speed: dict[str, float] | None) -> dict[str, Any]:
    machine: dict[str, Any] = {"cores": 2, "cpu": "AMD EPYC", "python": "3.11.7",
                               "packages": {"aiohttp": "3.14.5", "uvloop": "0.23.0"}}
    if speed is not None:
        machine["speed"] = speed
    return {"machine": machine, "started": "2026-12-07 02:31:05 UTC"}


def test_the_machine_line_names_the_figures() -> None:
    speed = {"loop_step_ns": 71.2, "syscall_ns": 881.6, "loopback_ns": 6243.0}
    assert machine_speed.machine_line(_result(speed), ("aiohttp", "uvloop")) == (
        "Machine: 2 cores (AMD EPYC), Python 3.11.7, aiohttp 3.14.5, uvloop 0.23.0; a Python "
        "loop step 71.2 ns, a system call 881.6 ns, a loopback byte there and back 6243 ns; "
        "2026-12-07 02:31:05 UTC  ")


def test_a_result_without_the_figures_still_renders() -> None:
    assert machine_speed.machine_line(_result(None), ("uvloop", "orjson")) == (
        "Machine: 2 cores (AMD EPYC), Python 3.11.7, uvloop 0.23.0, orjson ?; "
        "2026-12-07 02:31:05 UTC  ")


def test_both_reports_use_the_one_machine_line() -> None:
    # Each report's Markdown starts with the command, then this line: a report that built
    # its own would drop the figures again.
    for module in (report, paced):
        assert "machine_speed.machine_line(result" in inspect.getsource(module.markdown)


def test_another_interpreter_reports_its_version_and_loop_step(tmp_path: Path) -> None:
    # A link named like a venv's interpreter: the report resolves it to the executable.
    link = tmp_path / "python"
    link.symlink_to(sys.executable)
    facts = machine_speed.interpreter(str(link))
    assert facts["path"] == str(link)
    assert facts["executable"] == str(Path(sys.executable).resolve())
    assert facts["version"] == platform.python_version()
    assert facts["loop_step_ns"] > 0


def test_the_machine_line_names_the_sidecars_interpreter() -> None:
    result = _result({"loop_step_ns": 43.8, "syscall_ns": 580.3, "loopback_ns": 3758.0})
    result["machine"]["sidecar_python"] = {"path": "/tmp/deployed/bin/python",
                                           "executable": "/usr/bin/python3.11",
                                           "version": "3.11.2", "loop_step_ns": 34.6}
    assert machine_speed.machine_line(result, ("uvloop",)) == (
        "Machine: 2 cores (AMD EPYC), Python 3.11.7, uvloop 0.23.0; a Python loop step 43.8 ns, "
        "a system call 580.3 ns, a loopback byte there and back 3758 ns; the sidecar on Python "
        "3.11.2 (/usr/bin/python3.11), a loop step 34.6 ns; 2026-12-07 02:31:05 UTC  ")
