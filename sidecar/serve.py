"""``disagg-sidecar serve``: both front doors in one process and one event loop.

    open_runtime ─▶ HTTP (aiohttp AppRunner) + gRPC (grpc.aio) + engine health watcher
    SIGTERM ─▶ not ready, refuse new requests ─▶ wait for in-flight (grace) ─▶ stop ─▶ exit 0

With tls_cert_file and tls_key_file the HTTP port serves HTTPS and the gRPC port TLS, from one
``sidecar.tls.ReloadingServerTLS`` whose reload task runs while serving.

``--port 0`` / ``--grpc-port 0`` let the OS choose; the bound ports are logged and, with
``--ports-file``, written as JSON once both servers listen (tests and scripts read it).

With ``--workers N`` (N > 1) this runs in each worker process (``sidecar.workers``), given the
worker's identity: the HTTP sites bind with SO_REUSEPORT so every worker listens on the same
ports (and the gRPC server, which sets it then) and the kernel spreads connections. Only
those workers share a port: a lone process binds without SO_REUSEPORT, and any port another
program holds stops start-up with one line (``PortInUse``; the supervisor checks for a pool).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from sidecar import jsonutil
from sidecar.config.loader import flag_for
from sidecar.config.settings import Settings
from sidecar.grpc_server.server import start_grpc_server
from sidecar.http_server.aiohttp_private import HeadTimeoutAppRunner
from sidecar.http_server.app import build_http_app, drop_server_header
from sidecar.http_server.keys import RUNTIME
from sidecar.http_server.ops import metrics as metrics_endpoint
from sidecar.runtime import open_runtime
from sidecar.tasks import cancel_and_wait
from sidecar.tls import ReloadingServerTLS
from sidecar.workers.identity import SOLO, WorkerIdentity
from sidecar.workers.ports import PortInUse, check_free

logger = logging.getLogger(__name__)

def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    raise RuntimeError("HTTP server has no bound address")


def _write_ports_file(path: str, ports: dict[str, int]) -> None:
    """Write atomically, so a reader never sees a half-written file."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(jsonutil.dumps(ports))
    partial.replace(target)


def listened_ports(settings: Settings) -> list[tuple[str, int]]:
    """The flag and the port of every listener ``settings`` asks for."""
    names = ["port"]
    if settings.grpc_enabled:
        names.append("grpc_port")
    if settings.metrics_port is not None:
        names.append("metrics_port")
    return [(flag_for(name), getattr(settings, name)) for name in names]


def check_ports_free(settings: Settings) -> None:
    """``PortInUse`` naming the first port another program holds."""
    for flag, port in listened_ports(settings):
        check_free(settings.host, port, flag)


def server_tls(settings: Settings) -> ReloadingServerTLS | None:
    """The reloading server certificate when tls_cert_file and tls_key_file are set."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    return ReloadingServerTLS(
        settings.tls_cert_file, settings.tls_key_file, settings.tls_reload_interval_s,
        client_ca_file=settings.tls_client_ca_file,
    )


async def _start_site(
    app: web.Application,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None = None,
    head_timeout_s: float | None = None,
    reuse_port: bool = False,
) -> web.AppRunner:
    # The drain (drain_grace_s) has already waited for requests; what is left is cut now
    # (with 5 s here aiohttp 3.14 took 10 s more, past Kubernetes' default grace period).
    # Request bodies are inflated by the one body reader (http_server/body.py), which counts
    # what a compressed body cost its sender against what it costs the sidecar.
    options: dict[str, Any] = {
        "handler_cancellation": True, "access_log": None, "shutdown_timeout": 0.1,
        "auto_decompress": False,
    }
    runner = HeadTimeoutAppRunner(app, head_timeout_s=head_timeout_s, **options)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None,
                       ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        if exc.errno == errno.EADDRINUSE:  # taken since the check: the same one line
            raise PortInUse(f"{host}:{port} is in use by another program") from None
        raise
    return runner


async def run_server(
    settings: Settings,
    stop: asyncio.Event,
    on_listening: Callable[[dict[str, int]], None] | None = None,
    tls: ReloadingServerTLS | None = None,
    worker: WorkerIdentity = SOLO,
) -> int:
    """Serve until ``stop`` is set, then drain and return the exit code. ``on_listening``
    gets the bound ports (``http``, ``grpc``, ``metrics``) once all listen; ``tls``: the server
    certificate (default ``server_tls(settings)``, reloaded by a task while serving);
    ``worker``: this process's place in a pool."""
    tls = tls if tls is not None else server_tls(settings)
    if not worker.pooled:  # a pool's supervisor checked, and holds them for its workers
        check_ports_free(settings)
    async with open_runtime(settings, worker=worker) as runtime:
        http_runner = await _start_site(
            build_http_app(runtime), settings.host, settings.port,
            tls.context if tls is not None else None, settings.client_header_timeout_s,
            reuse_port=worker.pooled,
        )
        ports: dict[str, int] = {"http": _bound_port(http_runner)}
        metrics_runner: web.AppRunner | None = None
        if settings.metrics_port is not None:
            metrics_app = web.Application()
            metrics_app.on_response_prepare.append(drop_server_header)
            metrics_app[RUNTIME] = runtime
            metrics_app.router.add_get("/metrics", metrics_endpoint)
            metrics_runner = await _start_site(metrics_app, settings.host, settings.metrics_port,
                                               head_timeout_s=settings.client_header_timeout_s,
                                               reuse_port=worker.pooled)
            ports["metrics"] = _bound_port(metrics_runner)
        stop_grpc: Callable[[float], Awaitable[None]] | None = None
        if settings.grpc_enabled:
            ports["grpc"], stop_grpc = await start_grpc_server(runtime, tls)
        watcher = asyncio.ensure_future(runtime.health.watch())
        reloader = asyncio.ensure_future(tls.watch()) if tls is not None else None
        if settings.ports_file:
            _write_ports_file(settings.ports_file, ports)
        if on_listening is not None:
            on_listening(dict(ports))
        logger.info("listening: %s", " ".join(f"{k}={settings.host}:{v}" for k, v in ports.items()))
        try:
            await stop.wait()
        finally:
            logger.info("draining: %d request(s) in flight", runtime.admission.inflight)
            runtime.admission.start_draining()
            drained = await runtime.admission.wait_idle(settings.drain_grace_s)
            if not drained:
                logger.warning("grace period over with %d request(s) in flight",
                               runtime.admission.inflight)
            await cancel_and_wait(*(task for task in (watcher, reloader) if task is not None))
            if stop_grpc is not None:
                await stop_grpc(1.0)
            await http_runner.cleanup()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
    logger.info("stopped")
    return 0


def freeze_startup_objects(ports: dict[str, int]) -> None:
    """Keep what starting up allocated (it lives as long as the process) out of the garbage
    collector's scans: docs/extending/design-notes.md#gc-freeze."""
    gc.freeze()


async def serve_until_signalled(settings: Settings) -> int:
    """Serve until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await run_server(settings, stop, on_listening=freeze_startup_objects)
