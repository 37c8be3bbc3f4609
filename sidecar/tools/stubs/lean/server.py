"""The lean bench engine: a vLLM (NIXL) or SGLang stand-in that costs the bench little CPU.

    python -m bench.lean_engine --engine vllm --role prefill --port 0
    -> one JSON line when listening: {"event": "listening", "engine", "role", "kv_connector",
       "engine_id", "host", "port", "bootstrap_port", "url"}; runs until SIGINT or SIGTERM.

    async with run_engine(EngineConfig(engine="sglang", role="decode")) as engine: ...

Routes: ``POST /v1/completions`` (JSON or SSE, the hand-off of ``lean_vllm`` or
``lean_sglang``), ``GET /health`` (200, empty), ``GET /v1/models``, ``GET /metrics``
(``stub_handoff_total{outcome,reason}`` as the aiohttp stubs count decode verdicts,
``stub_requests_total``), SGLang ``POST /abort_request`` (200), vLLM prefill ``GET
/_lean/nixl/handshake``; anything else 404 ``{"detail": "Not Found"}``. An SGLang prefill
also listens on a bootstrap port (``lean_rooms``).

Built on ``lean_http`` (asyncio Protocols, httptools, uvloop): the aiohttp stubs
(``sidecar.stubs``) cost about 0.5 cores each under the bench's load, which the sidecar
then lacks on a 2-core machine.

Deliberate limits: zero latency only (no TTFT/ITL shaping), no fault switches, no request
recording, completions only (no chat, no ``/generate``), vLLM NIXL (``shfs``) and SGLang
only. ``sidecar.stubs`` stays the behavioural reference for the sidecar's tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

import orjson

from bench.lean_http import TEXT, HttpConnection, Request, Server

COMPLETIONS: Final = "/v1/completions"
ENGINES: Final = ("vllm", "sglang")
ROLES: Final = ("prefill", "decode")


@dataclass(frozen=True)
class EngineConfig:
    engine: str = "vllm"
    role: str = "prefill"
    kv_connector: str = "shfs"
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int = 0
    model: str = "stub-model"
    max_model_len: int = 4096
    default_max_tokens: int = 16
    block_size: int = 16
    # vLLM's uvicorn keeps idle connections 5 s.
    keepalive_s: float = 5.0
    # Decode -> prefill handshake (NIXL) and bootstrap connect (SGLang).
    pull_timeout_s: float = 5.0
    # SGLang: prefill waits for its decode; decode waits for its prefill.
    bootstrap_timeout_s: float = 30.0
    waiting_timeout_s: float = 30.0
    # vLLM NIXL: the host a prefill names (VLLM_NIXL_SIDE_CHANNEL_HOST, default localhost).
    side_channel_host: str = "localhost"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; the lean engine serves "
                             f"{', '.join(ENGINES)}")
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; known: {', '.join(ROLES)}")
        if self.engine == "vllm" and self.kv_connector != "shfs":
            raise ValueError("the lean vLLM engine speaks NixlConnector (shfs) only")


class Flavour(Protocol):
    """What an engine flavour (``lean_vllm``, ``lean_sglang``) plugs in."""

    owned_by: str

    def completions(
        self, request: Request, conn: HttpConnection
    ) -> Coroutine[Any, Any, None] | None: ...

    def error_body(self, status: int, message: str) -> bytes: ...

    def extra_route(
        self, request: Request, conn: HttpConnection
    ) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class Engine:
    """The HTTP app: common routes, verdict counters, the flavour's routes."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine_id = str(uuid.uuid4())
        self.port = 0
        self.bootstrap_port: int | None = None
        self.requests = 0
        self.verdicts: Counter[tuple[str, str]] = Counter()
        self.server = Server(self, keepalive_s=config.keepalive_s)
        self.flavour = _make_flavour(self)

    def count(self, verdict: tuple[str, str]) -> None:
        self.verdicts[verdict] += 1

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        return {
            "engine": self.config.engine,
            "role": self.config.role,
            "kv_connector": self.config.kv_connector if self.config.engine == "vllm" else None,
            "engine_id": self.engine_id,
            "host": self.config.host,
            "port": self.port,
            "bootstrap_port": self.bootstrap_port,
            "model": self.config.model,
            "lean": True,
        }

    async def start(self) -> None:
        self.port = await self.server.start(self.config.host, self.config.port)
        await self.flavour.start()

    async def close(self) -> None:
        await self.flavour.close()
        await self.server.close()

    # -- lean_http.App ----------------------------------------------------------------

    def handle(self, request: Request, conn: HttpConnection) -> Coroutine[Any, Any, None] | None:
        path = request.path
        if path == COMPLETIONS:
            if request.method != b"POST":
                conn.send(405, b'{"detail":"Method Not Allowed"}')
                return None
            self.requests += 1
            return self.flavour.completions(request, conn)
        if request.method == b"GET":
            if path == "/health":
                conn.send(200, b"")
                return None
            if path == "/v1/models":
                conn.send(200, self._models())
                return None
            if path == "/metrics":
                conn.send(200, self._metrics(), TEXT)
                return None
        if not self.flavour.extra_route(request, conn):
            conn.send(404, b'{"detail":"Not Found"}')
        return None

    def _models(self) -> bytes:
        model = self.config.model
        return orjson.dumps({
            "object": "list",
            "data": [{
                "id": model, "object": "model", "created": int(time.time()),
                "owned_by": self.flavour.owned_by, "root": model, "parent": None,
                "max_model_len": self.config.max_model_len, "permission": [],
            }],
        })

    def _metrics(self) -> bytes:
        lines = [
            "# HELP stub_handoff_total Decode hand-off verdicts of the stub engine.",
            "# TYPE stub_handoff_total counter",
        ]
        for (outcome, reason), count in sorted(self.verdicts.items()):
            lines.append(f'stub_handoff_total{{outcome="{outcome}",reason="{reason}"}} {count}')
        lines += [
            "# TYPE stub_requests_total counter",
            f"stub_requests_total {self.requests}",
            "# TYPE lean_connections_accepted_total counter",
            f"lean_connections_accepted_total {self.server.accepted}",
        ]
        return ("\n".join(lines) + "\n").encode()


def _make_flavour(engine: Engine) -> Flavour:
    # Imported here: each flavour imports this module's types.
    if engine.config.engine == "vllm":
        from bench.lean_vllm import VllmFlavour

        flavour: Flavour = VllmFlavour(engine)
        return flavour
    from bench.lean_sglang import SglangFlavour

    return SglangFlavour(engine)


@contextlib.asynccontextmanager
async def run_engine(config: EngineConfig | None = None, **overrides: Any) -> AsyncIterator[Engine]:
    """Start a lean engine (ports OS-chosen unless given); stop it on exit."""
    config = replace(config, **overrides) if config else EngineConfig(**overrides)
    engine = Engine(config)
    try:
        await engine.start()
        yield engine
    finally:
        await engine.close()


def parse_args(argv: list[str] | None) -> EngineConfig:
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="python -m bench.lean_engine", description=__doc__.split("\n")[0]
    )
    p.add_argument("--engine", choices=ENGINES, default=d.engine)
    p.add_argument("--role", choices=ROLES, default=d.role)
    p.add_argument("--kv-connector", choices=("shfs",), default=d.kv_connector)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0: OS-chosen")
    p.add_argument("--bootstrap-port", type=int, default=d.bootstrap_port)
    p.add_argument("--model", default=d.model)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--keepalive", type=float, default=d.keepalive_s)
    p.add_argument("--pull-timeout", type=float, default=d.pull_timeout_s)
    p.add_argument("--bootstrap-timeout", type=float, default=d.bootstrap_timeout_s)
    p.add_argument("--waiting-timeout", type=float, default=d.waiting_timeout_s)
    p.add_argument("--side-channel-host", default=d.side_channel_host)
    a = p.parse_args(argv)
    return EngineConfig(
        engine=a.engine, role=a.role, kv_connector=a.kv_connector, host=a.host, port=a.port,
        bootstrap_port=a.bootstrap_port, model=a.model, max_model_len=a.max_model_len,
        default_max_tokens=a.default_max_tokens, block_size=a.block_size,
        keepalive_s=a.keepalive, pull_timeout_s=a.pull_timeout,
        bootstrap_timeout_s=a.bootstrap_timeout, waiting_timeout_s=a.waiting_timeout,
        side_channel_host=a.side_channel_host,
    )


async def serve(config: EngineConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with run_engine(config) as engine:
            line = {"event": "listening", **engine.info(), "url": engine.url}
            print(json.dumps(line), flush=True)
            await stop.wait()
    except OSError as exc:
        print(f"lean engine: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a project dependency
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
