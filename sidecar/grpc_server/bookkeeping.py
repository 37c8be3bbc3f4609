"""Admission and metrics of one gRPC call, the same families the HTTP front door feeds.

    scope = RpcScope(runtime, METHOD, request_id)
    async with scope.serving(context):   a SidecarError -> logged, counted, the call aborted
        scope.admit()      Overloaded / Draining raise here (RESOURCE_EXHAUSTED / UNAVAILABLE)
        ... scope.outcome = "ok" before the last message
                           on exit: counted, admission left (once a detached task ended too)

Every metric carries ``front_door="grpc"``; the ``route`` label is the gRPC method's full name
(a closed set of two). A concurrent Prefill shares its admission slot with the background
engine call (``detach()``), so draining on SIGTERM waits for that call as it waits for
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import grpc

from sidecar.errors import ClientCancelled, SidecarError
from sidecar.grpc_server.errors import abort_with
from sidecar.runtime import Runtime

logger = logging.getLogger(__name__)

FRONT_DOOR: Final = "grpc"


class RpcScope:
    """Bookkeeping of one RPC from admission to its last message."""

    def __init__(self, runtime: Runtime, method: str, request_id: str = "-") -> None:
        self.runtime = runtime
        self.method = method
        #: Named in the log line of a failure; a handler may update it once it knows better.
        self.request_id = request_id
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

    @contextlib.asynccontextmanager
    async def serving(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        """The call's body runs inside: a ``SidecarError`` becomes its gRPC status (logged and
        counted), a cancellation is counted unless the call had already succeeded, and the
        call is counted and leaves admission whatever the end."""
        try:
            yield
        except SidecarError as error:
            self.failed(error)
            logger.warning("gRPC %s %s failed: %s (%s)", self.method.rsplit("/", 1)[-1],
                           self.request_id, error.code, error.message)
            await abort_with(context, error)
        except asyncio.CancelledError:
            if self.outcome != "ok":
                self.cancelled()
            raise
        finally:
            self.close()

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
