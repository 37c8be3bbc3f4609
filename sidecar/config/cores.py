"""``--workers auto``: how many workers this container has the cores and the memory for.

    auto_workers()    = min(available_cores(), memory_workers()), at least 1
    available_cores() = min(CPU affinity, cgroup CPU quota rounded up), at least 1
    memory_workers()  = (cgroup memory limit - SUPERVISOR_BYTES) // WORKER_BYTES, at least 1
                        (None: no memory limit)

A worker is about 71-76 MiB resident serving 128 concurrent streams, the supervisor about
42 MiB (measured, docs/operating/workers.md): ``WORKER_BYTES`` and ``SUPERVISOR_BYTES`` leave
room above that for request bodies and bursts, so that a container without a CPU limit on a
many-core node (every core is in its affinity) does not start more workers than its memory
limit holds (deploy/'s 1 GiB: 10 workers).

Deliberate limits: reads this process's cgroup at ``/sys/fs/cgroup`` (v2 ``cpu.max`` and
``memory.max``, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` and
``memory.limit_in_bytes``); a nested cgroup's parents are not walked.
Why the quota: docs/extending/design-notes.md#worker-count
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Memory one worker is allowed for in ``auto`` (resident 71-76 MiB measured, plus room).
WORKER_BYTES = 96 * 1024 * 1024
#: Memory the supervisor is allowed for (resident about 42 MiB measured).
SUPERVISOR_BYTES = 64 * 1024 * 1024
#: A v1 cgroup without a limit reports a number near 2**63.
_NO_LIMIT_V1 = 1 << 60


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> int | None:
    """The CPU quota as whole cores (rounded up), or None when there is no limit."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota == "max" or not period:
            return None
        return _cores(quota, period)
    quota_v1 = _read(root / "cpu" / "cpu.cfs_quota_us") or _read(root / "cpu.cfs_quota_us")
    period_v1 = _read(root / "cpu" / "cpu.cfs_period_us") or _read(root / "cpu.cfs_period_us")
    if quota_v1 is None or period_v1 is None:
        return None
    return _cores(quota_v1, period_v1)


def _cores(quota: str, period: str) -> int | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:  # v1 writes -1 for "no limit"
        return None
    return max(1, math.ceil(quota_us / period_us))


def affinity_cores() -> int:
    """The cores this process may be scheduled on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def available_cores(root: Path = CGROUP_ROOT) -> int:
    """min(affinity, cgroup quota), at least 1."""
    cores = affinity_cores()
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, limit)
    return max(1, cores)


def cgroup_memory_limit(root: Path = CGROUP_ROOT) -> int | None:
    """The memory limit in bytes, or None when there is none."""
    text = _read(root / "memory.max")
    if text is None:
        text = _read(root / "memory" / "memory.limit_in_bytes") or _read(
            root / "memory.limit_in_bytes")
    if text is None or text == "max":
        return None
    try:
        limit = int(text)
    except ValueError:
        return None
    return limit if 0 < limit < _NO_LIMIT_V1 else None


def memory_workers(root: Path = CGROUP_ROOT) -> int | None:
    """How many workers the memory limit holds (at least 1), or None without a limit."""
    limit = cgroup_memory_limit(root)
    if limit is None:
        return None
    return max(1, (limit - SUPERVISOR_BYTES) // WORKER_BYTES)


def auto_workers(root: Path = CGROUP_ROOT) -> int:
    """``--workers auto``: the cores this container may use, as many as its memory holds."""
    cores = available_cores(root)
    memory = memory_workers(root)
    return cores if memory is None else max(1, min(cores, memory))
