"""Proves a documented start is quiet and reveals no versions (issue #29):

- ``serve`` started as the docs start a decode sidecar logs no warning, one short INFO line
  (engine, connector, role, ports, sources) and no JSON blob; ``--log-level debug`` adds the
  effective settings as JSON;
- no answer carries a ``Server`` header (aiohttp's names the Python and aiohttp versions), on
  the HTTP port, the metrics port and relayed engine answers (the project's own HTTP/1.1
  server sends none either: tests/http1/test_http1_server.py compares its bytes);
- gRPC's C core does not print its own lines for a failed TLS handshake at the default level
  (it logged ``Handshake failed ...`` at its INFO on stderr), and does with
  ``--log-level debug``.

Runs the real command line in child processes against a stub engine, on OS-chosen ports.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from tls_builders import CertAuthority

SIDECAR = [sys.executable, "-m", "sidecar"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("DISAGG_", "GRPC_"))}


@contextmanager
def stub_engine() -> Iterator[int]:
    stub = subprocess.Popen([*SIDECAR, "stub-engine", "--engine", "vllm", "--role", "decode",
                             "--port", "0"], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert stub.stdout is not None
        yield int(json.loads(stub.stdout.readline())["port"])
    finally:
        stub.terminate()
        stub.wait(timeout=30)


@contextmanager
def sidecar(tmp_path: Path, *argv: str) -> Iterator[tuple[dict[str, int], list[str]]]:
    """A ``serve`` process; yields its ports and, once it stopped, its stderr lines."""
    ports_file = tmp_path / "ports.json"
    process = subprocess.Popen(
        [*SIDECAR, "serve", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0",
         "--ports-file", str(ports_file), *argv],
        stderr=subprocess.PIPE, text=True, env=ENV,
    )
    lines: list[str] = []
    try:
        assert process.stderr is not None
        for line in process.stderr:  # waits on the process, never on a clock
            lines.append(line)
            if "listening:" in line:
                break
        else:
            raise AssertionError(f"sidecar exited before listening: {''.join(lines)}")
        yield json.loads(ports_file.read_text()), lines
    finally:
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=30)
        lines.extend(rest.splitlines(keepends=True))


def _server_header(url: str) -> str | None:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.headers.get("Server")


def test_a_documented_decode_start_is_quiet_and_versionless(tmp_path: Path) -> None:
    with stub_engine() as engine_port:
        documented = ["--engine", "vllm", "--kv-connector", "NixlConnector", "--role", "decode",
                      "--engine-url", f"http://127.0.0.1:{engine_port}",
                      "--prefill-allowlist", "127.0.0.1:8100", "--metrics-port", "0"]
        with sidecar(tmp_path, *documented) as (ports, lines):
            http = f"http://127.0.0.1:{ports['http']}"
            assert _server_header(f"{http}/health") is None
            assert _server_header(f"{http}/v1/models") is None  # the engine's answer, relayed
            assert _server_header(f"http://127.0.0.1:{ports['metrics']}/metrics") is None
    text = "".join(lines)
    assert " WARNING " not in text and "Traceback" not in text, text
    infos = [line for line in lines if " INFO " in line]
    assert not [line for line in infos if "{" in line], infos
    (start,) = [line for line in infos if " INFO sidecar: " in line]
    assert "engine vllm, connector shfs, role decode" in start and "from flag" in start
    assert len(start) < 300


def test_debug_shows_the_effective_settings(tmp_path: Path) -> None:
    with sidecar(tmp_path, "--engine-url", "http://127.0.0.1:9", "--role", "prefill",
                 "--log-level", "debug") as (_, lines):
        pass
    (blob,) = [line for line in lines if "effective settings: {" in line]
    settings = json.loads(blob.split("effective settings: ", 1)[1])
    assert settings["role"] == {"value": "prefill", "source": "flag --role"}


@pytest.mark.parametrize(("level", "shown"), [("info", False), ("debug", True)])
def test_grpc_core_lines_follow_the_sidecars_level(tmp_path: Path, level: str,
                                                    shown: bool) -> None:
    ca = CertAuthority.create("quiet-ca")
    cert, key = ca.issue("127.0.0.1", ips=["127.0.0.1"], server=True).write(tmp_path, "sidecar")
    argv = ["--engine-url", "http://127.0.0.1:9", "--role", "decode", "--prefill-allowlist",
            "127.0.0.1:8100", "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--log-level", level]
    with sidecar(tmp_path, *argv) as (ports, lines):
        # A plaintext client on the TLS gRPC port: the handshake fails in the C core.
        with socket.create_connection(("127.0.0.1", ports["grpc"]), timeout=10) as sock:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            sock.recv(1024)
    text = "".join(lines)
    assert ("Handshake failed" in text) is shown, text[-3000:]
