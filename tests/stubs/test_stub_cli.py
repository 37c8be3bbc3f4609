"""The stub engine as a process: ``python -m sidecar.tools.stubs`` and the argparse helpers.

Proves: the module runs on its own, prints one JSON line with its ports once listening, in
one write (stubs started side by side on one pipe cannot split each other's lines; OS-chosen
ports, a bootstrap port for an SGLang prefill), serves requests, accepts faults
on the command line, and exits 0 on SIGTERM; bad flags exit 2; ``--faults-endpoint`` is off
unless given; ``--transport lean`` builds the same config, refusing what it does not serve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from sidecar.dialects.sglang import SGLangOptions
from sidecar.dialects.vllm_mooncake import MooncakeOptions
from sidecar.tools.stubs import StubConfig
from sidecar.tools.stubs.cli import add_stub_arguments, announce, config_from_args

ROOT = Path(__file__).resolve().parents[2]


def test_arguments_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_stub_arguments(parser)
    args = parser.parse_args(
        [
            "--engine",
            "sglang",
            "--role",
            "prefill",
            "--bootstrap-port",
            "0",
            "--fault",
            '{"kind": "status", "status": 503, "times": 1}',
            "--waiting-timeout",
            "2",
        ]
    )
    config = config_from_args(args)
    assert config.engine == "sglang" and config.role == "prefill"
    assert config.waiting_timeout_s == 2.0
    assert config.faults[0].status == 503 and config.has_bootstrap_server


def parse(argv: list[str]) -> StubConfig:
    parser = argparse.ArgumentParser()
    add_stub_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_faults_endpoint_and_transport_flags() -> None:
    default = parse([])
    assert default.control_faults is False and default.transport == "aiohttp"
    assert parse(["--faults-endpoint"]).control_faults is True
    lean = parse(["--transport", "lean", "--engine", "sglang", "--role", "decode"])
    assert (lean.transport, lean.engine, lean.role) == ("lean", "sglang", "decode")


@pytest.mark.parametrize(
    "argv",
    [
        ["--engine", "trtllm", "--role", "decode"],
        ["--role", "both"],
        ["--role", "decode", "--kv-connector", "mooncake"],
        ["--role", "decode", "--faults-endpoint"],
        ["--role", "decode", "--eos-rate", "5"],
    ],
)
def test_lean_transport_refuses_what_it_does_not_serve(argv: list[str]) -> None:
    with pytest.raises(ValueError, match="lean"):
        parse(["--transport", "lean", *argv])


@pytest.mark.parametrize(("argv", "port"), [
    (["--engine", "sglang", "--role", "prefill"], SGLangOptions().sglang_bootstrap_port),
    (["--engine", "vllm", "--kv-connector", "mooncake", "--role", "prefill"],
     MooncakeOptions().mooncake_bootstrap_port),
    (["--engine", "sglang", "--role", "prefill", "--bootstrap-port", "0"], 0),
    (["--engine", "sglang", "--role", "decode"], 0),
    (["--engine", "vllm", "--role", "prefill"], 0),
])
def test_the_bootstrap_port_defaults_to_the_sidecars(argv: list[str], port: int) -> None:
    # A stub engine and a sidecar started with their defaults meet (the quick start's snippet).
    assert parse(argv).bootstrap_port == port


async def test_module_runs_until_sigterm(session: aiohttp.ClientSession) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar.tools.stubs",
        "--engine",
        "sglang",
        "--role",
        "prefill",
        "--bootstrap-port",
        "0",
        "--fault",
        '{"kind": "status", "status": 503, "times": 1, "path": "/health"}',
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert line["event"] == "listening" and line["engine"] == "sglang"
        assert line["port"] > 0 and line["bootstrap_port"] > 0
        async with session.get(line["url"] + "/health") as resp:
            assert resp.status == 503
        async with session.get(line["url"] + "/health") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_bad_flags_exit_2() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar.tools.stubs",
        "--fault",
        "{not json",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"stub-engine" in err


class _RecordingStdout:
    """A stdout whose binary layer records each write (``print`` on an unbuffered stdout
    writes a line's text and its newline apart)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.buffer = self

    def write(self, data: bytes) -> int:
        self.writes.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass


def test_the_listening_line_leaves_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _RecordingStdout()
    monkeypatch.setattr(sys, "stdout", out)
    announce({"event": "listening", "port": 8200, "url": "http://127.0.0.1:8200"})
    assert len(out.writes) == 1
    assert out.writes[0].endswith(b"\n") and out.writes[0].count(b"\n") == 1
    assert json.loads(out.writes[0]) == {"event": "listening", "port": 8200,
                                         "url": "http://127.0.0.1:8200"}
