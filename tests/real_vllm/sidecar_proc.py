"""The sidecar as its own process (``disagg-sidecar serve``) for the real-vLLM suite.

    yield from sidecar_process(tmp_dir, "--engine", "vllm", "--engine-url", decode_url, ...)

Loopback, OS-chosen HTTP port (read from ``--ports-file``), no gRPC, every loopback prefill
target allowed; stopped with SIGTERM (killed after 30 s).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sidecar:
    url: str


def sidecar_process(tmp: Path, *args: str) -> Iterator[Sidecar]:
    ports_file = tmp / "ports.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", "--host", "127.0.0.1", "--port", "0",
         "--no-grpc", "--ports-file", str(ports_file), "--prefill-allowlist", "127.0.0.1:*",
         "--log-level", "info", *args],
        stderr=subprocess.PIPE, text=True,
    )
    assert process.stderr is not None
    try:
        # The sidecar logs "listening:" after writing the ports file; stderr ends if it dies.
        for line in process.stderr:
            if "listening:" in line:
                break
        else:
            raise AssertionError(f"sidecar exited with {process.wait()} before listening")
        # Keep draining its log so a chatty sidecar never blocks on a full pipe.
        threading.Thread(target=process.stderr.read, daemon=True).start()
        ports = json.loads(ports_file.read_text())
        yield Sidecar(url=f"http://127.0.0.1:{ports['http']}")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
