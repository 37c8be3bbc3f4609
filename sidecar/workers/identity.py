"""Which worker of the pod's pool this process is: its index, the pool's size, its shared dir.

One process (``--workers 1``, the default) is ``SOLO``: index 0 of 1, nothing shared. In a
pool the supervisor hands each worker its index (0..count-1) and the run directory; from
these derive the id lanes of the dialects (``index`` of ``count``), the in-flight slot under
``run_dir`` (``shared_inflight``) and the pod-wide chores (the staging sweep) of worker 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sidecar.config.settings import MAX_WORKERS

#: The file under the run directory holding one in-flight counter per worker.
INFLIGHT_FILE: Final = "inflight.slots"
#: The directory under the run directory holding prometheus-client's multiprocess files.
METRICS_DIR: Final = "metrics"
#: The worker's settings (JSON), written once by the supervisor.
SETTINGS_FILE: Final = "settings.json"


@dataclass(frozen=True)
class WorkerIdentity:
    """One worker's place in the pool (``count`` 1: a lone process, nothing shared)."""

    index: int = 0
    count: int = 1
    run_dir: Path | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_WORKERS:
            raise ValueError(f"worker count {self.count} is outside 1..{MAX_WORKERS}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"worker index {self.index} is outside 0..{self.count - 1}")
        if self.count > 1 and self.run_dir is None:
            raise ValueError("a pool of workers needs its run directory")

    @property
    def pooled(self) -> bool:
        """True when other worker processes serve the same ports."""
        return self.count > 1

    @property
    def runs_pod_chores(self) -> bool:
        """True in the one worker that runs what must run once per pod (worker 0)."""
        return self.index == 0


SOLO: Final = WorkerIdentity()
