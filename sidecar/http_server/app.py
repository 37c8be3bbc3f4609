"""The aiohttp application factory of the HTTP front door.

    build_http_app(runtime) ─▶ web.Application
        POST /v1/completions, /v1/chat/completions,
             /v1/responses, /v1/messages,
             /inference/v1/generate                 -> PD flow (pd.py; every ``Route``)
        GET /health, /ready, /metrics               -> operations (ops.py); /metrics only
                                                       without --metrics-port (there, it is
                                                       the engine's, passed through)
        anything else                               -> local engine passthrough (proxy.py)
"""

from __future__ import annotations

from aiohttp import web

from sidecar.errors import SidecarError
from sidecar.http_server import ops
from sidecar.http_server.errors import error_response
from sidecar.http_server.keys import RUNTIME
from sidecar.http_server.pd import add_pd_routes, request_id_of
from sidecar.http_server.proxy import proxy_to_engine
from sidecar.runtime import Runtime


async def _passthrough(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    request_id = request_id_of(request)
    try:
        runtime.admission.enter()
    except SidecarError as error:
        return error_response(error, request_id)
    try:
        return await proxy_to_engine(request, runtime.calls, request_id)
    finally:
        runtime.admission.leave()


def build_http_app(runtime: Runtime) -> web.Application:
    """The HTTP front door over ``runtime`` (which the caller opens and closes)."""
    app = web.Application(client_max_size=runtime.settings.max_body_bytes)
    app[RUNTIME] = runtime
    app.router.add_get("/health", ops.health)
    app.router.add_get("/ready", ops.ready)
    if runtime.settings.metrics_port is None:
        app.router.add_get("/metrics", ops.metrics)
    add_pd_routes(app)
    app.router.add_route("*", "/{tail:.*}", _passthrough)
    return app
