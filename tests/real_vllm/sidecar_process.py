"""The sidecar as its own process in front of a real engine, and requests through it.

Owns: starting ``python -m sidecar serve`` on an OS-chosen port (HTTP only, loopback, every
loopback prefill target allowed) and stopping it, and sending one OpenAI request through its
HTTP front door with ``x-prefiller-host-port`` (JSON or streamed) to get the generated text;
the sidecar's log is kept in ``<tmp>/sidecar.log`` for a failed test's reader; waiting until
its engine is ready again (after a restart).

Deliberate limits: blocking ``urllib`` only; a stream must end with ``data: [DONE]``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from real_vllm.client import text_of, text_of_stream

PREFILL_HEADER = "x-prefiller-host-port"
READY_DEADLINE_S = 60.0
#: For a sidecar whose placement a test judges by the engine's tokenizer (the cache and length
#: rules): the production budget of a tokenize call (0.25 s) is a request path's, and on these
#: shared CPUs a busy engine's /tokenize can take longer; past it the prompt's tokens are
#: unknown and the request runs as a pair (a CI run's turn 2 did: "tokenize call failed
#: (timeout)"), which is the sidecar right and the test's judgement void.
PATIENT_TOKENIZE = ("--tokenize-timeout-s", "10")


@dataclass(frozen=True)
class Sidecar:
    url: str


def sidecar_process(tmp: Path, *args: str) -> Iterator[Sidecar]:
    """Run a sidecar with ``args`` until the generator is closed (a fixture's body)."""
    ports_file = tmp / "ports.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", "--host", "127.0.0.1", "--port", "0",
         "--no-grpc", "--ports-file", str(ports_file), "--prefill-allowlist", "127.0.0.1:*",
         "--log-level", "info", *args],
        stderr=subprocess.PIPE, text=True,
    )
    assert process.stderr is not None
    log = (tmp / "sidecar.log").open("w")
    try:
        # The sidecar logs "listening:" after writing the ports file; stderr ends if it dies.
        for line in process.stderr:
            log.write(line)
            if "listening:" in line:
                break
        else:
            raise AssertionError(f"sidecar exited with {process.wait()} before listening")
        # Keep draining its log into the file (kept for a failed test's reader) so a chatty
        # sidecar never blocks on a full pipe.
        threading.Thread(target=_copy_lines, args=(process.stderr, log), daemon=True).start()
        ports = json.loads(ports_file.read_text())
        yield Sidecar(url=f"http://127.0.0.1:{ports['http']}")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _copy_lines(source: IO[str], sink: IO[str]) -> None:
    for line in source:
        sink.write(line)
        sink.flush()
    sink.close()


def through(sidecar: Sidecar, path: str, body: dict[str, Any], target: str,
            headers: dict[str, str] | None = None, timeout: float = 120.0) -> str:
    """POST ``body`` to the sidecar's ``path`` with prefill target ``target`` (and any other
    routing ``headers``); the text."""
    request = urllib.request.Request(
        sidecar.url + path, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", PREFILL_HEADER: target, **(headers or {})},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read().decode()
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in raw.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert raw.rstrip().endswith("data: [DONE]")
        return text_of_stream(events)
    return text_of(json.loads(raw))


def wait_ready(sidecar: Sidecar, deadline_s: float = READY_DEADLINE_S) -> None:
    """Until the sidecar's engine is ready again (its /ready: the health watch saw it)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(sidecar.url + "/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the sidecar's engine is not ready again"
        # Readiness is only observable by asking (the sidecar's watch runs every 2 s).
        time.sleep(0.25)
