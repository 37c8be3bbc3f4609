"""Proves ``sidecar.grpc_server.inline.heap.retain_freed_heap`` on glibc: after it, a freed 64 MiB
block stays resident for reuse (no munmap, no trim), where glibc's default returns it at once.

Run in child processes: the tuning is process-wide and one-way. Does not prove the speed-up
(``python -m bench.grpc_ceiling --retain-heap`` measures it).
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = """
import sys
from sidecar.grpc_server.inline.heap import retain_freed_heap

def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")

tuned = sys.argv[1] == "tuned"
if tuned:
    assert retain_freed_heap(1 << 30)
before = rss()
block = bytearray(64 << 20)  # zero-filled: every page touched
del block
print(rss() - before)
"""


def _retained(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], check=True, capture_output=True, text=True
    )
    return int(out.stdout)


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_freed_large_block_stays_resident_only_when_tuned() -> None:
    assert _retained("tuned") >= 60 << 20
    assert _retained("default") < 8 << 20
