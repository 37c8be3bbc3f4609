"""Shared pieces of the property-based tests: the example budget, and a sidecar with stub
engines running in a background thread for the end-to-end properties.

Budget: ``FUZZ`` (CI: 200 examples, derandomized so CI is deterministic, no per-example
deadline) and ``FUZZ_E2E`` (40 examples over real sockets). ``bench/fuzz_long.py`` sets the
environment variable ``DISAGG_FUZZ_EXAMPLES`` to run the same properties far longer with
random seeds.

    with background_sidecar("vllm") as bg:
        bg.http_port, bg.grpc_port, bg.prefill_target

The background sidecar lets a synchronous hypothesis test talk to a real sidecar without
one event loop per example.

Deliberate limits: one engine flavour per background sidecar; waits are bounded by socket
timeouts so a hang fails the example instead of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from sidecar_builders import running_sidecar

from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.server import Stub, run_stub

_LONG = os.environ.get("DISAGG_FUZZ_EXAMPLES")
_EXAMPLES = int(_LONG) if _LONG else 200

FUZZ = settings(
    max_examples=_EXAMPLES,
    deadline=None,
    derandomize=_LONG is None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
FUZZ_E2E = settings(FUZZ, max_examples=int(_LONG) if _LONG else 40)

#: How long one end-to-end example may take before it counts as a hang.
E2E_TIMEOUT_S = 15.0


@dataclass
class BackgroundSidecar:
    http_port: int
    grpc_port: int
    prefill_port: int
    loop: asyncio.AbstractEventLoop
    #: The stub engines (read their counters only: they run on ``loop``).
    stubs: tuple[Stub, ...] = ()

    @property
    def prefill_target(self) -> str:
        return f"127.0.0.1:{self.prefill_port}"


@contextlib.asynccontextmanager
async def _stack(engine: str, settings_overrides: dict[str, Any]) -> AsyncIterator[
        BackgroundSidecar]:
    async with (
        run_stub(StubConfig(engine=engine, role="prefill", record_limit=0)) as prefill,
        # "both": the local engine serves the gRPC Prefill leg as well as decode legs.
        run_stub(StubConfig(engine=engine, role="both", record_limit=0)) as decode,
    ):
        overrides: dict[str, Any] = {
            "engine": engine,
            "engine_url": decode.url,
            "prefill_allowlist": (f"127.0.0.1:{prefill.port}",),
            "advertise_host": "127.0.0.1",
            "prefill_timeout_s": 5.0,
            "read_timeout_s": 5.0,
        }
        if prefill.bootstrap_port:
            overrides["sglang_bootstrap_port"] = prefill.bootstrap_port
        overrides.update(settings_overrides)
        async with running_sidecar(**overrides) as sc:
            yield BackgroundSidecar(sc.ports["http"], sc.ports.get("grpc", 0), prefill.port,
                                    asyncio.get_running_loop(), (prefill, decode))


@contextlib.contextmanager
def background_sidecar(engine: str = "vllm", **overrides: Any) -> Iterator[BackgroundSidecar]:
    """Stub engines and a sidecar served by an event loop in a daemon thread."""
    ready: Future[BackgroundSidecar] = Future()
    stop = threading.Event()

    async def main() -> None:
        try:
            async with _stack(engine, overrides) as bg:
                ready.set_result(bg)
                while not stop.is_set():  # noqa: ASYNC110 (a thread-side flag, not an event)
                    await asyncio.sleep(0.05)
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    try:
        yield ready.result(timeout=30)
    finally:
        stop.set()
        thread.join(timeout=30)
