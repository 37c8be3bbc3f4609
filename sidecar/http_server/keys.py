"""Typed keys of the aiohttp application state."""

from __future__ import annotations

from aiohttp import web

from sidecar.runtime import Runtime

RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
