"""Pinning for the scaling measurement: N sidecar workers on N cores of their own.

    python -m bench.run --mode paced --workers 1,2,4 --pin-workers

The machine's usable cores (``os.sched_getaffinity``) are split in two halves: the stubs and
the load generator on the second half, and each ``--workers N`` sidecar on the first N cores
of the first half, so the sidecar's workers never share a core with each other's load or with
the bench. A worker count that does not fit (N above half the cores) is left out, with the
reason in the result: on a 2-core machine only ``--workers 1`` runs pinned, on 8 cores 1-4.

Deliberate limits: one NUMA-unaware split; the anchors (``smg``, ``vllm-router``) are pinned
to the same first half as the largest sidecar that fits, so they get as many cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerPinning:
    """Which cores each measured process gets."""

    bench: tuple[int, ...]
    sidecars: dict[int, tuple[int, ...]]
    #: Worker counts that do not fit, with the reason.
    left_out: dict[int, str] = field(default_factory=dict)

    @property
    def anchors(self) -> tuple[int, ...]:
        return self.sidecars[max(self.sidecars)] if self.sidecars else self.bench

    @staticmethod
    def cpu_list(cores: tuple[int, ...]) -> str:
        """``taskset -c``'s argument."""
        return ",".join(str(core) for core in cores)


def plan_pinning(workers: tuple[int, ...], cores: tuple[int, ...] | None = None
                 ) -> WorkerPinning:
    """Split ``cores`` (default: this process's) between the sidecars and the bench."""
    usable = tuple(sorted(cores if cores is not None else os.sched_getaffinity(0)))
    half = max(1, len(usable) // 2)
    first, second = usable[:half], usable[half:] or usable[:half]
    sidecars: dict[int, tuple[int, ...]] = {}
    left_out: dict[int, str] = {}
    for count in workers:
        if count <= len(first) and len(usable) >= 2:
            sidecars[count] = first[:count]
        else:
            left_out[count] = (f"{count} worker(s) need {count} cores of their own and as many "
                               f"for the stubs and load; this machine has {len(usable)}")
    return WorkerPinning(bench=second, sidecars=sidecars, left_out=left_out)
