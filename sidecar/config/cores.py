"""``--workers auto``: how many cores this container may use.

    available_cores() = min(CPU affinity, cgroup CPU quota rounded up), at least 1

Deliberate limits: reads this process's cgroup at ``/sys/fs/cgroup`` (v2 ``cpu.max`` or v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); a nested cgroup's parents are not walked.
Why the quota: docs/extending/design-notes.md#worker-count
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


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
