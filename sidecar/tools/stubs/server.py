"""The stub engine's HTTP server: lifecycle, recording, fault switches, control endpoints.

    async with run_stub(StubConfig(engine="vllm", role="prefill")) as stub:
        stub.url, stub.port, stub.bootstrap_port, stub.recorder, stub.faults
        await stub.wait_idle()

Request flow (middleware, then the engine's handler, then ``replies.send``):

    record request -> take fault -> [status | delay | hang] -> engine handler -> Reply
                                                   -> send (truncate, malformed, drop, ...)

Common routes: ``/health``, ``/metrics`` (a few Prometheus lines, engine-named, plus
``stub_handoff_total``), and under ``/_stub/`` the control surface for a stub in another
process: ``GET /_stub/requests``, ``/_stub/decisions``, ``/_stub/stats``, ``/_stub/info``, and
``GET/POST/DELETE /_stub/faults`` only with ``StubConfig(control_faults=True)``
(``--faults-endpoint``): by default nothing outside the process can switch a fault on.
Engines add their own routes (``sidecar.tools.stubs.vllm``, ``.sglang``, ``.trtllm``) and, for
prefill roles that rendezvous, a bootstrap server on its own port. What a stub decides (its
identity, hand-off verdicts and their metric) comes from ``sidecar.tools.stubs.handoff``.

Handlers are cancelled when the client goes away (``handler_cancellation``), as uvicorn
does for the real engines, so a test can see upstream work end.

TLS (``StubConfig.tls_cert_file``/``tls_key_file``): the engine port serves HTTPS, asking
for a client certificate of ``tls_client_ca_file`` when set; the bootstrap port stays plain.

Deliberate limits: loopback-oriented test tool; no auth, no per-request logging.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from sidecar import jsonutil
from sidecar.tools.stubs import handoff, shapes
from sidecar.tools.stubs.config import StubConfig, flavour_class
from sidecar.tools.stubs.faults import Fault, FaultBook, FaultKind
from sidecar.tools.stubs.openai import BadRequest
from sidecar.tools.stubs.ranks import Ranks
from sidecar.tools.stubs.recorder import RecordedRequest, Recorder
from sidecar.tools.stubs.replies import Reply, json_response, send

EngineHandler = Callable[[web.Request], Awaitable[Reply]]
OpenAIHandler = Callable[..., Awaitable[Reply]]  # (request, *, kind)

COMPLETIONS: Final = "/v1/completions"
CHAT: Final = "/v1/chat/completions"
JSON_KEY: Final = web.RequestKey("stub_json", object)
FAULT_KEY: Final = web.RequestKey("stub_fault", object)
_NO_JSON: Final = object()


class StubEngine(Protocol):
    """What an engine flavour plugs into the server."""

    inference_paths: frozenset[str]

    def add_routes(self, app: web.Application) -> None: ...

    def add_bootstrap_routes(self, app: web.Application) -> None: ...

    def error_body(self, status: int, message: str, path: str) -> Any: ...

    def metrics(self) -> list[str]: ...

    def close(self) -> None: ...


def request_json(request: web.Request) -> Any:
    """The parsed JSON body (raises BadRequest when it was not JSON)."""
    value = request.get(JSON_KEY, _NO_JSON)
    if value is _NO_JSON:
        raise BadRequest("Expecting value: request body is not valid JSON")
    return value


def request_fault(request: web.Request) -> Fault | None:
    value = request.get(FAULT_KEY)
    return value if isinstance(value, Fault) else None


class Stub:
    """One running stub engine (build with ``run_stub``)."""

    def __init__(self, config: StubConfig) -> None:
        self.config = config
        self.recorder = Recorder(limit=config.record_limit)
        # Requests on the bootstrap server (SGLang rendezvous, Mooncake /query and pushes).
        self.bootstrap_recorder = Recorder(limit=config.record_limit)
        self.faults = FaultBook(config.faults)
        #: The data-parallel ranks behind this API server (where each request ran).
        self.ranks = Ranks(config.data_parallel_size)
        # vLLM: str(uuid4()) per engine; also names SGLang/TRT-LLM stubs in their metrics.
        self.engine_id = str(uuid.uuid4())
        self.port = 0
        self.bootstrap_port: int | None = None
        self._seq = itertools.count(1)
        self._ids = itertools.count(1)
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None
        self.engine: StubEngine = _make_engine(self)

    # -- identity ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls_cert_file else "http"
        return f"{scheme}://{self.config.host}:{self.port}"

    @property
    def bootstrap_url(self) -> str | None:
        if self.bootstrap_port is None:
            return None
        return f"http://{self.config.host}:{self.bootstrap_port}"

    def next_id(self) -> int:
        """A process-unique counter for request ids, block ids, ..."""
        return next(self._ids)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client the stub uses to reach other stubs (KV pulls, bootstrap queries)."""
        if self._session is None:
            raise RuntimeError("stub not started")
        return self._session

    async def wait_idle(self, *, timeout_s: float = 10.0) -> None:
        """Return once no request is in flight on the stub's engine port."""
        await self.recorder.wait_idle(timeout_s=timeout_s)

    @property
    def open_connections(self) -> int:
        """TCP connections currently open on the engine port (keep-alive ones included)."""
        if not self._runners or self._runners[0].server is None:
            return 0
        # A lost connection leaves the server's list only when its task ends: look at the
        # transport instead.
        return sum(
            1
            for handler in self._runners[0].server.connections
            if handler.transport is not None and not handler.transport.is_closing()
        )

    def info(self) -> dict[str, Any]:
        return handoff.info(self.config, self.engine_id, self.port, self.bootstrap_port)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.config.pull_timeout_s,
            ),
            trust_env=False,
        )
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        self._add_common_routes(app)
        self.engine.add_routes(app)
        self.port = await self._serve(app, self.config.port, self._tls_context())
        if self.config.has_bootstrap_server:
            boot = web.Application(middlewares=[self._bootstrap_middleware])
            self.engine.add_bootstrap_routes(boot)
            self.bootstrap_port = await self._serve(boot, self.config.bootstrap_port)

    def _tls_context(self) -> ssl.SSLContext | None:
        """The engine port's server context (and client-certificate check), if TLS."""
        config = self.config
        if config.tls_cert_file is None or config.tls_key_file is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        if config.tls_client_ca_file is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cafile=config.tls_client_ca_file)
        return context

    async def _serve(self, app: web.Application, port: int,
                     ssl_context: ssl.SSLContext | None = None) -> int:
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.config.keepalive_s,
            shutdown_timeout=0.5,
            # The engines' servers (uvicorn) hand bodies over as sent: a Content-Encoding
            # is the application's to honour, so the stub records the bytes on the wire.
            auto_decompress=False,
        )
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, self.config.host, port, ssl_context=ssl_context)
        await site.start()
        # The runner's addresses are its listening sockets' names: (host, port, ...).
        return int(runner.addresses[-1][1])

    async def stop(self) -> None:
        self.faults.release_hangs()
        self.engine.close()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- request path ------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        if path.startswith("/_stub/"):
            response: web.StreamResponse = await handler(request)
            return response
        body = await request.read()
        if body:
            with contextlib.suppress(jsonutil.JSONDecodeError):
                request[JSON_KEY] = jsonutil.loads(body)
        entry = None
        if self.recorder.limit > 0:
            entry = RecordedRequest(
                seq=next(self._seq),
                method=request.method,
                path=path,
                query=dict(request.query),
                headers=CIMultiDict(request.headers),
                body=body,
                json=request.get(JSON_KEY),
            )
        self.recorder.start(entry)
        cancelled = False
        try:
            fault = self.faults.take(path, inference=path in self.engine.inference_paths)
            if fault is not None:
                request[FAULT_KEY] = fault
                if fault.kind is FaultKind.STATUS:
                    return json_response(
                        self.engine.error_body(fault.status, fault.message, path), fault.status
                    )
                if fault.kind is FaultKind.DELAY:
                    await asyncio.sleep(fault.delay_s)
                elif fault.kind is FaultKind.HANG:
                    await self.faults.hang()
                    return web.Response(status=503)
            response = await handler(request)
            return response
        except web.HTTPException as exc:
            # The engines are FastAPI apps: unknown paths and methods answer {"detail": ...}.
            if exc.status in (404, 405):
                return json_response({"detail": exc.reason}, exc.status)
            raise
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self.recorder.finish(cancelled=cancelled)

    @web.middleware
    async def _bootstrap_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        entry = None
        if self.bootstrap_recorder.limit > 0:
            entry = RecordedRequest(
                seq=next(self._seq),
                method=request.method,
                path=request.path,
                query=dict(request.query),
                headers=CIMultiDict(request.headers),
                body=b"",
                json=None,
            )
        self.bootstrap_recorder.start(entry)
        cancelled = False
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self.bootstrap_recorder.finish(cancelled=cancelled)

    def route(self, fn: EngineHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """Wrap an engine handler: BadRequest -> engine error body; Reply -> wire."""

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                reply = await fn(request)
            except BadRequest as exc:
                return json_response(
                    self.engine.error_body(exc.status, exc.message, request.path), exc.status
                )
            return await send(request, reply, request_fault(request), self.faults)

        return handle

    def add_openai_routes(
        self, app: web.Application, generate: OpenAIHandler, models: EngineHandler
    ) -> None:
        """The OpenAI routes every engine serves, each through ``route``: ``generate`` gets
        the request and its kind, ``"completion"`` or ``"chat"``."""
        for path, kind in ((COMPLETIONS, "completion"), (CHAT, "chat")):
            app.router.add_post(path, self.route(functools.partial(generate, kind=kind)))
        app.router.add_get("/v1/models", self.route(models))

    # -- common routes -----------------------------------------------------------------

    def _add_common_routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/_stub/info", self._info)
        app.router.add_get("/_stub/stats", self._stats)
        if self.config.control_faults:
            # Another process may switch this stub's faults: only when asked for.
            app.router.add_get("/_stub/faults", self._get_faults)
            app.router.add_post("/_stub/faults", self._post_faults)
            app.router.add_delete("/_stub/faults", self._delete_faults)
        app.router.add_get("/_stub/requests", self._get_requests)
        app.router.add_get("/_stub/decisions", self._get_decisions)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        fault = request_fault(request)
        reply = web.Response(status=200)
        if fault is not None and fault.kind is FaultKind.DROP:
            transport = request.transport
            if transport is not None:
                transport.abort()
        return reply

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        lines = list(self.engine.metrics())
        lines += self.recorder.tally.metric_lines()
        lines += shapes.metric_lines([
            ("counter", "stub_requests_total", "", self.recorder.total),
            ("counter", "stub_requests_cancelled_total", "", self.recorder.cancelled),
        ])
        return web.Response(
            text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8"
        )

    async def _info(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.info())

    async def _stats(self, request: web.Request) -> web.StreamResponse:
        return json_response(
            {
                **self.recorder.stats(),
                "faults_fired": self.faults.fired,
                "open_connections": self.open_connections,
            }
        )

    async def _get_faults(self, request: web.Request) -> web.StreamResponse:
        return json_response([f.to_json() for f in self.faults.active()])

    async def _post_faults(self, request: web.Request) -> web.StreamResponse:
        try:
            data = jsonutil.loads(await request.read())
            items = data if isinstance(data, list) else [data]
            faults = [Fault.from_json(item) for item in items]
        except (jsonutil.JSONDecodeError, ValueError, TypeError) as exc:
            return json_response({"error": str(exc)}, 400)
        for fault in faults:
            self.faults.set(fault)
        return json_response([f.to_json() for f in self.faults.active()])

    async def _delete_faults(self, request: web.Request) -> web.StreamResponse:
        self.faults.clear()
        return json_response([])

    async def _get_requests(self, request: web.Request) -> web.StreamResponse:
        path = request.query.get("path")
        out = [
            {
                "seq": r.seq,
                "method": r.method,
                "path": r.path,
                "headers": {str(k): v for k, v in r.headers.items()},
                "json": r.json,
            }
            for r in self.recorder.requests
            if path is None or r.path == path
        ]
        return json_response(out)

    async def _get_decisions(self, request: web.Request) -> web.StreamResponse:
        return json_response(
            [
                {
                    "path": d.path,
                    "request_id": d.request_id,
                    "outcome": d.outcome,
                    "reason": d.reason,
                }
                for d in self.recorder.decisions
            ]
        )


def _make_engine(stub: Stub) -> StubEngine:
    engine: StubEngine = flavour_class(stub.config)(stub)
    return engine


@contextlib.asynccontextmanager
async def run_stub(config: StubConfig | None = None, **overrides: Any) -> AsyncIterator[Stub]:
    """Start a stub engine (ports OS-chosen unless given); stop it on exit."""
    if config is None:
        config = StubConfig(**overrides)
    elif overrides:
        from dataclasses import replace

        config = replace(config, **overrides)
    if config.transport != "aiohttp":
        raise ValueError("run_stub serves the aiohttp transport; see lean.server.run_lean")
    stub = Stub(config)
    try:
        await stub.start()
        yield stub
    finally:
        await stub.stop()
