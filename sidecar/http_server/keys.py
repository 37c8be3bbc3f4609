"""Typed keys of the aiohttp application state."""

from __future__ import annotations

from aiohttp import web

from sidecar.http_server.body import BodyReader
from sidecar.runtime import Runtime

RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
#: The one reader of client bodies (``body.py``), with this process's limits and budget.
BODY: web.AppKey[BodyReader] = web.AppKey("body", BodyReader)
