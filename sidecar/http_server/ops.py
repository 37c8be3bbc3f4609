"""Operations endpoints: ``/health`` (process up), ``/ready`` (engine answers, not draining),
``/metrics`` (Prometheus text format)."""

from __future__ import annotations

from aiohttp import web

from sidecar import jsonutil
from sidecar.http_server.keys import RUNTIME
from sidecar.observability.metrics import CONTENT_TYPE


def _json(status: int, payload: dict[str, object]) -> web.Response:
    return web.Response(status=status, body=jsonutil.dumps(payload),
                        content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return _json(200, {"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    if runtime.admission.draining:
        return _json(503, {"status": "draining"})
    if not await runtime.health.check():
        return _json(503, {"status": "engine_not_ready"})
    return _json(200, {"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    response = web.Response(body=runtime.metrics.exposition())
    response.headers["Content-Type"] = CONTENT_TYPE
    return response
