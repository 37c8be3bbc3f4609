"""Builders of the real sidecar (``serve.run_server``) in-process on OS-chosen loopback ports,
and of the stub-engine pairs it runs against (one copy for the http, grpc and faults suites).

    async with running_sidecar(engine="vllm", engine_url=decode.url, ...) as sidecar:
        sidecar.url, sidecar.grpc_port, await sidecar.metric("disagg_requests_total", ...)
    async with stub_pair("sglang") as (prefill, decode):
        running_sidecar(**decode_sidecar_settings("sglang", "shfs", prefill, decode))

It runs exactly what ``disagg-sidecar serve`` runs (both front doors, draining on stop), only
without signal handlers, so tests see the real app from the real factory.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sidecar.config.settings import Settings
from sidecar.serve import run_server
from sidecar.tools.stubs import Stub, StubConfig, run_stub


@dataclass
class RunningSidecar:
    settings: Settings
    ports: dict[str, int]
    stop: asyncio.Event

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def grpc_port(self) -> int:
        return self.ports["grpc"]

    async def scrape(self) -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(self.url + "/metrics") as response:
                return await response.text()

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of samples ``name`` whose labels include ``labels`` (0 when absent)."""
        text = await self.scrape()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    total += sample.value
        return total


def sidecar_settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "grpc_port": 0,
        "log_level": "warning",
        "drain_grace_s": 5.0,
        # The suites written before migration prove the paths without it (an engine's
        # failure ends the request); tests/migration turns it on.
        "migration_limit": 0,
    }
    base.update(overrides)
    return Settings(**base)


@contextlib.asynccontextmanager
async def running_sidecar(**overrides: Any) -> AsyncIterator[RunningSidecar]:
    settings = sidecar_settings(**overrides)
    stop = asyncio.Event()
    listening: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(run_server(settings, stop, listening.set_result))
    waiting: set[asyncio.Future[Any]] = {server, listening}
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if server.done():
        server.result()  # raises the start-up error
        raise RuntimeError("sidecar stopped before listening")
    try:
        yield RunningSidecar(settings=settings, ports=listening.result(), stop=stop)
    finally:
        stop.set()
        await server


@contextlib.asynccontextmanager
async def stub_pair(
    engine: str,
    connector: str = "shfs",
    *,
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[Stub, Stub]]:
    """A prefill-role and a decode-role stub engine (``prefill``/``decode``: config overrides)."""
    async with (
        run_stub(StubConfig(engine=engine, role="prefill", kv_connector=connector,
                            **(prefill or {}))) as prefill_stub,
        run_stub(StubConfig(engine=engine, role="decode", kv_connector=connector,
                            **(decode or {}))) as decode_stub,
    ):
        yield prefill_stub, decode_stub


def engine_settings(engine: str, connector: str, prefill: Stub) -> dict[str, Any]:
    """What every sidecar of a stub pair is told: the engine, connector, bootstrap ports."""
    settings: dict[str, Any] = {"engine": engine, "kv_connector": connector}
    if prefill.bootstrap_port:
        settings["sglang_bootstrap_port"] = prefill.bootstrap_port
        settings["mooncake_bootstrap_port"] = prefill.bootstrap_port
    return settings


def decode_sidecar_settings(
    engine: str, connector: str, prefill: Stub, decode: Stub, **overrides: Any
) -> dict[str, Any]:
    """An HTTP-only decode sidecar in front of ``decode`` that may call ``prefill``."""
    return {
        **engine_settings(engine, connector, prefill),
        "engine_url": decode.url,
        "prefill_allowlist": (f"127.0.0.1:{prefill.port}",),
        "grpc_enabled": False,
        **overrides,
    }


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound, never listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()
