"""The lean transport's HTTP app: a vLLM (NIXL) or SGLang stub that costs the bench little CPU.

    python -m sidecar.tools.stubs --transport lean --engine vllm --role prefill --port 0
    -> one JSON line when listening (``handoff.info``, as the aiohttp transport prints it)

    async with run_lean(StubConfig(engine="sglang", role="decode", transport="lean")) as e: ...

Routes: ``POST /v1/completions`` (JSON or SSE, the hand-off of ``lean.vllm`` or
``lean.sglang``), ``GET /health`` (200, empty), ``GET /v1/models``, ``GET /metrics``
(``stub_handoff_total{outcome,reason}``, the same ``handoff.Tally`` lines as the aiohttp
transport, ``stub_requests_total``), SGLang ``POST /abort_request`` (200), vLLM prefill ``GET
/_stub/nixl/<request id>`` (the decode's pull); anything else 404 ``{"detail": "Not Found"}``.
An SGLang prefill also listens on a bootstrap port (``lean.rooms``).

Built on ``lean.keepalive`` (asyncio Protocols, httptools, uvloop) with the answer
timing of ``lean.http``: the aiohttp transport costs about 0.5 cores per stub under the
bench's load, which the sidecar then lacks on a 2-core machine. Config, identity, dispatch
by engine name, verdicts and their metric lines are the ones the aiohttp transport uses
(``config``, ``handoff``).

Latency shaping (``--ttft``, ``--itl``, the bench's paced mode) as the aiohttp transport
shapes it: a stream's first token after ``ttft``, the next ones ``itl`` apart (timer ticks,
no task per stream: ``lean.http.Pacing``); a non-streamed answer after ``ttft + itl * (n - 1)``.

Deliberate limits: see ``StubConfig._check_lean``: no fault switches, no EOS, no request
recording, completions only, vLLM NIXL (``shfs``) and SGLang only.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import replace
from typing import Any, Final, Protocol

import orjson

from sidecar.tools.stubs import handoff, shapes
from sidecar.tools.stubs.config import StubConfig, flavour_class
from sidecar.tools.stubs.lean import openai as lean_openai
from sidecar.tools.stubs.lean.http import HttpConnection, Pacing
from sidecar.tools.stubs.lean.keepalive import TEXT, Request, Server
from sidecar.tools.stubs.lean.openai import Completion
from sidecar.tools.stubs.openai import BadRequest

COMPLETIONS: Final = "/v1/completions"


class Flavour(Protocol):
    """What an engine flavour (``lean.vllm``, ``lean.sglang``) plugs in."""

    owned_by: str

    def completions(
        self, request: Request, c: Completion, conn: HttpConnection
    ) -> Coroutine[Any, Any, None] | None:
        """Answer a parsed completion now, or return a coroutine that will."""
        ...

    def error_body(self, status: int, message: str) -> bytes: ...

    def extra_route(
        self, request: Request, conn: HttpConnection
    ) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class FlavourBase:
    """What every lean flavour holds: its engine (the HTTP app), config and role."""

    owned_by: str

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.prefill = engine.config.role == "prefill"

    def reply(self, conn: HttpConnection, body: bytes, tokens: int) -> None:
        """A non-streamed 200 answer, after its ``tokens``' time when latency is shaped."""
        cfg = self.config
        delay = (cfg.ttft_s if tokens else 0.0) + cfg.itl_s * max(tokens - 1, 0)
        conn.send_later(delay, 200, body)

    def reply_stream(self, conn: HttpConnection, events: Iterator[bytes], tokens: int) -> None:
        """A streamed answer whose first ``tokens`` events are paced like an engine's steps."""
        cfg = self.config
        pacing = Pacing(cfg.ttft_s, cfg.itl_s, tokens) if cfg.ttft_s or cfg.itl_s else None
        if pacing is None and cfg.stream_writes == "whole":
            conn.send_stream_whole(events)
            return
        conn.send_stream(events, pacing=pacing)


class Engine:
    """The HTTP app: common routes, verdict counters, the flavour's routes."""

    def __init__(self, config: StubConfig) -> None:
        self.config = config
        self.engine_id = str(uuid.uuid4())
        self.port = 0
        self.bootstrap_port: int | None = None
        self.requests = 0
        self.tally = handoff.Tally()
        self.server = Server(self.handle, HttpConnection, keepalive_s=config.keepalive_s)
        self.flavour: Flavour = flavour_class(config)(self)

    @property
    def verdicts(self) -> Counter[tuple[str, str]]:
        return self.tally.counts

    def count(self, verdict: handoff.Verdict) -> None:
        self.tally.count(verdict)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        return handoff.info(self.config, self.engine_id, self.port, self.bootstrap_port)

    async def start(self) -> None:
        self.port = await self.server.start(self.config.host, self.config.port)
        await self.flavour.start()

    async def close(self) -> None:
        await self.flavour.close()
        await self.server.close()

    # -- what sidecar.tools.stubs.lean.keepalive.Server calls -------------------------------------

    def handle(self, request: Request, conn: HttpConnection) -> Coroutine[Any, Any, None] | None:
        path = request.path
        if path == COMPLETIONS:
            if request.method != b"POST":
                conn.send(405, b'{"detail":"Method Not Allowed"}')
                return None
            self.requests += 1
            cfg = self.config
            try:
                completion = lean_openai.parse(
                    request.body, default_max_tokens=cfg.default_max_tokens,
                    max_model_len=cfg.max_model_len, model=cfg.model,
                )
            except BadRequest as exc:
                conn.send(400, self.flavour.error_body(400, exc.message))
                return None
            return self.flavour.completions(request, completion, conn)
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
        return orjson.dumps(shapes.models_body(
            self.config.model, self.flavour.owned_by, root=self.config.root, parent=None,
            max_model_len=self.config.max_model_len, permission=[],
        ))

    def _metrics(self) -> bytes:
        lines = self.tally.metric_lines() + shapes.metric_lines([
            ("counter", "stub_requests_total", "", self.requests),
            ("counter", "lean_connections_accepted_total", "", self.server.accepted),
        ])
        return ("\n".join(lines) + "\n").encode()


@contextlib.asynccontextmanager
async def run_lean(config: StubConfig | None = None, **overrides: Any) -> AsyncIterator[Engine]:
    """Start a lean stub (ports OS-chosen unless given); stop it on exit."""
    base = config or StubConfig(transport="lean", role="prefill")
    engine = Engine(replace(base, **overrides) if overrides else base)
    try:
        await engine.start()
        yield engine
    finally:
        await engine.close()
