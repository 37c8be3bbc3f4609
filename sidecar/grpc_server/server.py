"""The gRPC front door: one grpc.aio server in the HTTP server's process and event loop.

    start_grpc_server(runtime, tls) ─▶ (bound port, stop(grace))
      services: disagg.PrefillWorker, disagg.DecodeWorker (every sidecar serves both),
                grpc.health.v1.Health ("" and both: SERVING while the engine is ready and the
                sidecar not draining), grpc.reflection.v1alpha.ServerReflection
      options:  max send/receive message size = settings.grpc_max_message_bytes
      inline:   freed heap kept for reuse (``inline.heap``), the staging sweep (``inline.orphans``)
    stop(grace) ─▶ NOT_SERVING for good, in-flight RPCs finish within ``grace``, then the
                   background prefills left are cancelled (``serve`` drained admission first)

Deliberate limits: TLS only with ``serve``'s ``ReloadingServerTLS``, else plaintext.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sidecar.config.settings import KVTransport
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.decode import DecodeService
from sidecar.grpc_server.inline.grpc import InlineDecode, InlinePrefill
from sidecar.grpc_server.inline.heap import retain_freed_heap
from sidecar.grpc_server.inline.orphans import OrphanSweeper
from sidecar.grpc_server.inline.staging import StagingArea
from sidecar.grpc_server.native import NativeDecode, NativePrefill
from sidecar.grpc_server.prefill import PrefillService
from sidecar.protocol.context import url_host
from sidecar.runtime import Runtime
from sidecar.tls import ReloadingServerTLS

logger = logging.getLogger(__name__)

PREFILL_SERVICE: Final = disagg_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
DECODE_SERVICE: Final = disagg_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
#: Health is reported for the server as a whole ("") and for each disagg service.
HEALTH_SERVICES: Final = ("", PREFILL_SERVICE, DECODE_SERVICE)

StopFunction = Callable[[float], Awaitable[None]]


def server_options(max_message_bytes: int, *, share_port: bool = False) -> list[tuple[str, int]]:
    """Channel options of the server: message size limits (KV blocks are large), and
    SO_REUSEPORT only where the port is shared with the pool's other workers (grpcio sets it
    by default, which would let another program's socket share the port silently)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 1 if share_port else 0),
    ]


class _DrainAwareHealth(health.aio.HealthServicer):  # type: ignore[misc]
    """The standard health servicer, answering NOT_SERVING to Check once draining started."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self._runtime = runtime

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        response = await super().Check(request, context)
        if self._runtime.admission.draining:
            # SIGTERM: routers should stop picking this pod before the server goes away.
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.NOT_SERVING
            )
        return response


class _HealthMirror:
    """Keeps the gRPC health statuses equal to the local engine's readiness."""

    def __init__(self, servicer: health.aio.HealthServicer) -> None:
        self._servicer = servicer
        self._pending: set[asyncio.Task[None]] = set()

    async def apply(self, ready: bool) -> None:
        response = health_pb2.HealthCheckResponse
        status = response.SERVING if ready else response.NOT_SERVING
        for service in HEALTH_SERVICES:
            await self._servicer.set(service, status)

    def on_change(self, ready: bool) -> None:
        # The engine watcher calls listeners synchronously; the servicer's setter is async.
        task = asyncio.get_running_loop().create_task(self.apply(ready))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def shutdown(self) -> None:
        for task in list(self._pending):
            await task
        await self._servicer.enter_graceful_shutdown()


#: How often the staging root is swept, and the age past the prefill deadline that makes an
#: orphan (docs/extending/design-notes.md#orphan-sweep).
_SWEEP_INTERVAL_S = 60.0
_ORPHAN_MARGIN_S = 60.0


def _services(runtime: Runtime) -> tuple[PrefillService, DecodeService, OrphanSweeper | None]:
    """The servicers, each given the configured KV transport's hand-off strategy."""
    settings = runtime.settings
    flow = runtime.grpc_runner
    scopes = runtime.grpc_scopes
    if settings.kv_transport != KVTransport.INLINE:
        return (
            PrefillService(scopes, NativePrefill(flow, scopes, settings),
                           local_ranks=flow.ranks.local_size),
            DecodeService(flow, scopes, NativeDecode(flow, runtime.metrics)),
            None,
        )
    root = Path(settings.kv_staging_dir)
    area = StagingArea(root, settings.max_staged_bytes, runtime.metrics.staged_bytes.set)
    inline_prefill = InlinePrefill(flow, settings)
    sweeper = OrphanSweeper(
        root, lambda: inline_prefill.active_keys | area.owned_keys(),
        older_than_s=settings.prefill_timeout_s + _ORPHAN_MARGIN_S,
        sweeps=runtime.worker.runs_pod_chores,  # one sweep per pod (worker 0)
        touches=runtime.worker.pooled,
    )
    return (
        PrefillService(scopes, inline_prefill, local_ranks=flow.ranks.local_size),
        DecodeService(flow, scopes, InlineDecode(flow, settings, area, runtime.metrics)),
        sweeper,
    )


async def start_grpc_server(
    runtime: Runtime, tls: ReloadingServerTLS | None = None
) -> tuple[int, StopFunction]:
    """Start serving (over TLS when ``tls`` is given); returns the port and ``stop(grace)``."""
    settings = runtime.settings
    if settings.kv_transport == KVTransport.INLINE:
        # Before the server exists: its threads then share the one tuned arena.
        retain_freed_heap(settings.max_staged_bytes + 2 * settings.grpc_max_message_bytes)
    server = grpc.aio.server(options=server_options(settings.grpc_max_message_bytes,
                                                    share_port=runtime.worker.pooled))
    prefill, decode, sweeper = _services(runtime)
    prefill.add_to_server(server)
    decode.add_to_server(server)  # inline: the request's bytes, walked without protobuf objects

    health_servicer = _DrainAwareHealth(runtime)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    mirror = _HealthMirror(health_servicer)
    await mirror.apply(runtime.health.ready)
    runtime.health.on_change(mirror.on_change)

    reflection.enable_server_reflection(
        (PREFILL_SERVICE, DECODE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )

    address = f"{url_host(settings.host)}:{settings.grpc_port}"
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls.grpc_credentials())
    if port == 0:
        raise RuntimeError(f"gRPC server could not bind {address}")
    await server.start()
    logger.info("gRPC listening on %s:%d (%s, max message %d bytes)", url_host(settings.host),
                port, "plaintext" if tls is None else "TLS", settings.grpc_max_message_bytes)

    sweeping = None if sweeper is None else asyncio.ensure_future(sweeper.run(_SWEEP_INTERVAL_S))

    async def stop(grace: float) -> None:
        await mirror.shutdown()
        await server.stop(grace)
        await runtime.close()
        if sweeping is not None:
            sweeping.cancel()
            await asyncio.wait({sweeping})

    return port, stop
