"""Proves the command line as an operator uses it: ``disagg-sidecar serve`` in its own process
listens on OS-chosen ports, answers /health, and exits 0 on SIGTERM; an invalid configuration
refuses to start with exit code 2 and a message naming the bad value; ``demo`` exits 0, and
``demo --cache-aware`` shows a chat's second turn running locally on the cached prefix.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

SIDECAR = [sys.executable, "-m", "sidecar"]


def _wait_for_file(process: subprocess.Popen[str], path: Path) -> dict[str, int]:
    # The server writes the ports file atomically once listening; reading its stderr line by
    # line waits on the process itself, never on a clock.
    assert process.stderr is not None
    for line in process.stderr:
        if "listening:" in line:
            break
    else:
        raise AssertionError(f"sidecar exited with {process.wait()} before listening")
    ports: dict[str, int] = json.loads(path.read_text())
    return ports


def test_serve_listens_and_exits_zero_on_sigterm(tmp_path: Path) -> None:
    ports_file = tmp_path / "ports.json"
    process = subprocess.Popen(
        [*SIDECAR, "serve", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0",
         "--engine-url", "http://127.0.0.1:9", "--ports-file", str(ports_file)],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        ports = _wait_for_file(process, ports_file)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/health", timeout=10) as r:
            assert r.status == 200
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/ready", timeout=10)
        except urllib.error.HTTPError as error:
            assert error.code == 503  # the engine at port 9 does not answer
        else:
            raise AssertionError("/ready must be 503 without an engine")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--trtllm-machine-id", "5000"], "5000"),
        (["--kv-connector", "bogus"], "bogus"),
        (["--prefill-allowlist", "http://x:1"], "http://x:1"),
    ],
)
def test_invalid_configuration_refuses_to_start(args: list[str], named: str) -> None:
    result = subprocess.run([*SIDECAR, "serve", *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert named in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_exits_zero() -> None:
    result = subprocess.run([*SIDECAR, "demo"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PD flow OK" in result.stdout


def test_the_cache_aware_demo_runs_the_second_turn_locally() -> None:
    result = subprocess.run([*SIDECAR, "demo", "--cache-aware"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    turns = result.stdout.split("== turn ")[1:]
    assert len(turns) == 2, result.stdout
    assert "prefill legs: 1" in turns[0]
    assert "x-disagg-placement: local_cached;" in turns[1]
    assert "prefill legs: 0" in turns[1]
    assert "cache-aware placement OK" in result.stdout


@pytest.mark.parametrize("flags", [["--engine", "sglang"], ["--kv-connector", "mooncake"]])
def test_the_cache_aware_demo_names_what_it_needs(flags: list[str]) -> None:
    result = subprocess.run([*SIDECAR, "demo", "--cache-aware", *flags], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "--cache-aware" in result.stderr and "Traceback" not in result.stderr


def _listener(*, reuse_port: bool) -> socket.socket:
    """Another program's listening socket on an OS-chosen loopback port (grpcio and other
    servers set SO_REUSEPORT, which lets a second SO_REUSEPORT socket join it silently)."""
    sock = socket.socket()
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("flag", ["--port", "--grpc-port", "--metrics-port"])
@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "reuseport"])
def test_a_port_held_by_another_program_fails_start_up_in_one_line(
    flag: str, reuse_port: bool, workers: str
) -> None:
    taken = _listener(reuse_port=reuse_port)
    port = taken.getsockname()[1]
    try:
        ports = {"--port": "0", "--grpc-port": "0", "--metrics-port": "0", flag: str(port)}
        result = subprocess.run(
            [*SIDECAR, "serve", "--host", "127.0.0.1", "--engine-url", "http://127.0.0.1:9",
             "--workers", workers, *(item for pair in ports.items() for item in pair)],
            capture_output=True, text=True, timeout=60,
        )
    finally:
        taken.close()
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if "in use" in line]
    assert len(said) == 1 and f"127.0.0.1:{port}" in said[0] and flag in said[0], said
