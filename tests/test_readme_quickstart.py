"""Proves README's "Quick start by hand" runs as written, answers on every route it shows, and
stops saying why when it cannot start.

The block between ``<!-- --8<-- [start:quickstart] -->`` and ``[end:quickstart]`` (the docs
site's Getting started page includes the same lines) is run verbatim by bash, in a directory
whose ``.venv`` is this test's environment, inside a network namespace of its own where the
machine allows one (its fixed ports, 8080, 8100, 8200 and 50051, then cannot meet another
test's); elsewhere on the host's loopback, skipped when one of those ports is taken. Checked:
an answer per route (completions, chat, Responses, Messages, generate, a stream ending
``[DONE]``), six requests counted ``outcome="ok"``, every line of the Getting started page's
"output to expect" (``…`` standing for what differs between runs, ids and times) in that
order, and no warning in what the documented commands log (issue #29: a documented example
is quiet). Run again with the gRPC port held by another program (issue #36), the block ends
without waiting out its bound: the sidecar's own message names the port, and the wait says it
stopped because a process exited. The gRPC page's "Try it" block (two sidecars, HTTP and
``route``) is run the same way, for each engine it names.

Not proven: how long the bounded wait is (a minute), which only a hung engine would reach.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- --8<-- [start:quickstart] -->", "<!-- --8<-- [end:quickstart] -->"
PORTS = (8080, 8100, 8200, 50051)
GETTING_STARTED = ROOT / "docs" / "index.md"
#: Holds 127.0.0.1:PORT as "another program" would, then says so through the fifo it is given
#: (also when the port was already taken: taken is all the test needs).
HOLD_PORT = """
import socket, sys, time
sock = socket.socket()
try:
    sock.bind(("127.0.0.1", int(sys.argv[2])))
    sock.listen()
except OSError:
    pass
with open(sys.argv[1], "w") as fifo:
    fifo.write("held\\n")
time.sleep(600)
"""


def expected_output() -> list[str]:
    """The Getting started page's "output to expect", line by line."""
    text = GETTING_STARTED.read_text(encoding="utf-8")
    section = text.split("### The output to expect", 1)[1]
    return section.split("```text\n", 1)[1].split("\n```", 1)[0].splitlines()


def unmatched(expected: list[str], printed: list[str]) -> list[str]:
    """The expected lines (``…``: anything) not found among ``printed``, in order."""
    rest = iter(printed)
    missing = []
    for line in expected:
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("…")))
        if not any(pattern.fullmatch(candidate) for candidate in rest):
            missing.append(line)
            rest = iter(printed)  # report every missing line, not only the first
    return missing


def quickstart_script() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text[text.index(START) + len(START):text.index(END)].strip()
    lines = block.splitlines()
    assert lines[0] == "```sh" and lines[-1] == "```", "the quick start is one sh block"
    return "\n".join(lines[1:-1]) + "\n"


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"],
                           capture_output=True, check=False)
    return probe.returncode == 0


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _venv_dir(tmp_path: Path) -> Path:
    """A directory whose ``.venv/bin`` holds this environment's ``disagg-sidecar``."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "disagg-sidecar").exists():
        pytest.skip("disagg-sidecar is not installed next to this Python")
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / ".venv").symlink_to(bin_dir.parent)
    return tmp_path


def _run(tmp_path: Path, text: str, ports: tuple[int, ...], *, hold: int | None = None,
         must_succeed: bool = True) -> tuple[str, str]:
    """Run ``text`` with bash as the docs say (from a directory with ``.venv``); its stdout
    and stderr (once it exited 0, when ``must_succeed``). ``hold``: a port another program
    listens on first, started outside the script (not one of its jobs)."""
    if shutil.which("curl") is None:
        pytest.skip("the documented commands use curl, which is not installed")
    script = tmp_path / "commands.sh"
    script.write_text(text, encoding="utf-8")
    cwd = _venv_dir(tmp_path / "work")
    run = f"bash {script}"
    if hold is not None:
        fifo = tmp_path / "held"
        os.mkfifo(fifo)
        holder = tmp_path / "hold.py"
        holder.write_text(HOLD_PORT, encoding="utf-8")
        # The holder writes the fifo once listening: reading it waits on that, not a clock.
        run = (f"({sys.executable} {holder} {fifo} {hold} >/dev/null 2>&1 &); "
               f"read _ < {fifo}; {run}")
    if _can_unshare():
        command = ["unshare", "--net", "bash", "-c", f"ip link set lo up && {run}"]
    else:
        taken = [port for port in ports if _port_taken(port)]
        if taken:
            pytest.skip(f"no network namespace here and ports {taken} are taken")
        command = ["bash", "-c", run]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=240)  # a bound, not a timing claim
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the commands did not finish:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the holder, and anything left behind
    if must_succeed:
        assert process.returncode == 0, stderr[-4000:]
    return stdout, stderr


def test_quickstart_block_runs_verbatim(tmp_path: Path) -> None:
    stdout, stderr = _run(tmp_path, quickstart_script(), PORTS)
    answers = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    answers = [a for a in answers if a.get("event") != "listening"]
    assert [a.get("object") or a.get("type") for a in answers[:4]] == [
        "text_completion", "chat.completion", "response", "message"], answers
    assert answers[0]["choices"][0]["text"]
    assert answers[1]["choices"][0]["message"]["content"]
    assert answers[2]["output"][0]["content"][0]["text"]
    assert answers[3]["content"][0]["text"]
    assert answers[4]["choices"][0]["token_ids"], answers[4]
    assert "data: [DONE]" in stdout
    ok = [line for line in stdout.splitlines()
          if line.startswith("disagg_requests_total{") and 'outcome="ok"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in ok) == 6, ok
    warnings = [line for line in stderr.splitlines() if " WARNING " in line or "Traceback" in line]
    assert not warnings, warnings
    assert unmatched(expected_output(), stdout.splitlines()) == []


def test_the_expected_output_is_matched_in_order_and_in_full() -> None:
    assert len(expected_output()) > 10
    assert unmatched(["{\"id\":\"a-…\",…\"text\":\" x\"}", "data: [DONE]"],
                     ['{"id":"a-1","n":2,"text":" x"}', "", "data: [DONE]"]) == []
    assert unmatched(["data: [DONE]", "{…}"], ["{}", "data: [DONE]"]) == ["{…}"]
    assert unmatched(["…\"text\":\" y\"…"], ['{"text":" x"}']) == ["…\"text\":\" y\"…"]


def test_quickstart_stops_at_once_naming_a_taken_port(tmp_path: Path) -> None:
    stdout, stderr = _run(tmp_path, quickstart_script(), PORTS, hold=50051, must_succeed=False)
    assert "disagg-sidecar: cannot listen: --grpc-port 127.0.0.1:50051 is in use by another " \
        "program" in stderr, stderr[-4000:]
    # The wait ended because the sidecar exited, not because its bound ran out.
    assert "stopped waiting: the first error above says why" in stderr, stderr[-4000:]
    assert stderr.index("cannot listen") < stderr.index("stopped waiting")
    assert not [line for line in stdout.splitlines() if line.startswith('{"id"')], stdout


def grpc_try_it_script() -> str:
    text = (ROOT / "docs" / "driving" / "grpc.md").read_text(encoding="utf-8")
    block = text.split("## Try it", 1)[1].split("```sh\n", 1)[1].split("\n```", 1)[0]
    return block + "\n"


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_the_grpc_pages_try_it_block_runs(tmp_path: Path, engine: str) -> None:
    script = grpc_try_it_script()
    assert script.startswith("E=vllm\n")
    stdout, stderr = _run(tmp_path, script.replace("E=vllm", f"E={engine}", 1),
                          (8081, 8082, 8100, 8200, 8998, 50061, 50062))
    answers = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    (completion,) = [a for a in answers if a.get("object") == "text_completion"]
    assert completion["choices"][0]["text"]
    assert "finish_reason: length" in stdout  # route's Decode ended at --max-new-tokens
    warnings = [line for line in stderr.splitlines() if " WARNING " in line or "Traceback" in line]
    assert not warnings, warnings
