"""The aiohttp application factory of the HTTP front door.

    build_http_app(runtime) ─▶ web.Application
        POST /v1/completions, /v1/chat/completions,
             /v1/responses, /v1/messages,
             /inference/v1/generate                 -> PD flow (pd.py; every ``Route``)
        GET /health, /ready, /metrics               -> operations (ops.py); /metrics only
                                                       without --metrics-port (there, it is
                                                       the engine's, passed through)
        anything else                               -> local engine passthrough (proxy.py)

No answer carries a ``Server`` header (aiohttp's names the Python and aiohttp versions, which
tells a scanner what to try): ``drop_server_header`` removes it before the head is written,
on this app and the metrics port's.
"""

from __future__ import annotations

from aiohttp import hdrs, web

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


async def drop_server_header(_: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the head goes out without a ``Server`` header (aiohttp adds
    its own, with versions, when the headers are prepared, just before this signal)."""
    response.headers.popall(hdrs.SERVER, None)


def build_http_app(runtime: Runtime) -> web.Application:
    """The HTTP front door over ``runtime`` (which the caller opens and closes)."""
    app = web.Application(client_max_size=runtime.settings.max_body_bytes)
    app.on_response_prepare.append(drop_server_header)
    app[RUNTIME] = runtime
    app.router.add_get("/health", ops.health)
    app.router.add_get("/ready", ops.ready)
    if runtime.settings.metrics_port is None:
        app.router.add_get("/metrics", ops.metrics)
    add_pd_routes(app)
    app.router.add_route("*", "/{tail:.*}", _passthrough)
    return app
