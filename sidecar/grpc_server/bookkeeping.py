"""Admission and metrics of one gRPC call, the same families the HTTP front door feeds.

    scope = RpcScope(runtime, METHOD)
    scope.admit()          Overloaded / Draining raise here (RESOURCE_EXHAUSTED / UNAVAILABLE)
    ... scope.failed(error) | scope.cancelled() | scope.outcome = "ok"
    scope.close()          counts, leaves admission (once a detached background task ended too)

Every metric carries ``front_door="grpc"``; the ``route`` label is the gRPC method's full name
(a closed set of two). A concurrent Prefill shares its admission slot with the background
engine call (``detach()``), so draining on SIGTERM waits for that call as it waits for
requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from sidecar.errors import ClientCancelled, SidecarError
from sidecar.runtime import Runtime

FRONT_DOOR: Final = "grpc"


class RpcScope:
    """Bookkeeping of one RPC from admission to its last message."""

    def __init__(self, runtime: Runtime, method: str) -> None:
        self.runtime = runtime
        self.method = method
        self.outcome = "error"
        self._started = time.perf_counter()
        self._admitted = False
        # Who holds the admission slot: the call itself, plus a detached background task.
        self._holders = 0

    def admit(self) -> None:
        """Take an admission slot; raises ``Overloaded`` or ``Draining``."""
        try:
            self.runtime.admission.enter()
        except SidecarError:
            self.outcome = "refused"
            raise
        self._admitted = True
        self._holders = 1
        self.runtime.metrics.inflight.labels(FRONT_DOOR).inc()

    def failed(self, error: SidecarError) -> None:
        """Count ``error``; a call refused at admission keeps its outcome ``refused``."""
        if self.outcome != "refused":
            self.outcome = "error"
        self.runtime.metrics.errors.labels(FRONT_DOOR, error.stage.value, error.code).inc()

    def cancelled(self) -> None:
        self.outcome = "cancelled"
        self.runtime.metrics.errors.labels(
            FRONT_DOOR, ClientCancelled.default_stage.value, ClientCancelled.code
        ).inc()

    def observe(self, stage: str, seconds: float) -> None:
        self.runtime.metrics.stage_seconds.labels(FRONT_DOOR, stage).observe(seconds)

    def detach(self) -> Callable[[], None]:
        """Share the admission slot with a background task; call the result once it ends.

        The slot is left when both the call (``close``) and the task have ended, so a
        ``wait_idle`` that returns has seen the call counted too.
        """
        self._holders += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._drop_holder()

        return release

    def _drop_holder(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self.runtime.admission.leave()

    def close(self) -> None:
        """Count the call, then leave admission (unless a background task still holds it)."""
        metrics = self.runtime.metrics
        metrics.requests.labels(
            FRONT_DOOR,
            self.method,
            self.runtime.engine_name,
            self.runtime.connector_name,
            self.outcome,
        ).inc()
        self.observe("total", time.perf_counter() - self._started)
        if self._admitted:
            self._admitted = False
            metrics.inflight.labels(FRONT_DOOR).dec()
            self._drop_holder()
