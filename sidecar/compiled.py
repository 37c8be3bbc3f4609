"""Which of the sidecar's modules a build compiles, and which of them run compiled here.

``HOT``: the modules of the request path that ``setup.py`` compiles with Cython when
``SIDECAR_COMPILE`` asks (each ``.py`` is the source of its own extension module; by default,
and where nothing compiles under ``SIDECAR_COMPILE=auto``, the same ``.py`` files are the
build).
``modules()``: those of them that were imported from a compiled extension in this process.

Deliberate limits: no import of anything (``setup.py`` reads ``HOT`` from this file before the
package's dependencies are installed).
"""

from __future__ import annotations

import sys
from typing import Final

#: The request path's modules that compile (dotted names), in the order a request meets them.
HOT: Final[tuple[str, ...]] = (
    "sidecar.jsonutil",
    "sidecar.bounded",
    "sidecar.http_server.aiohttp_private",
    "sidecar.http_server.app",
    "sidecar.http_server.body",
    "sidecar.http_server.errors",
    "sidecar.http_server.relay",
    "sidecar.http_server.fanout",
    "sidecar.request.scope",
    "sidecar.request.placement",
    "sidecar.request.runner",
    "sidecar.request.legs",
    "sidecar.request.concurrent",
    "sidecar.request.fanout",
    "sidecar.targets.selector",
    "sidecar.targets.choice",
    "sidecar.targets.breaker",
    "sidecar.protocol.context",
    "sidecar.protocol.request",
    "sidecar.protocol.sse",
    "sidecar.protocol.prompt_length",
    "sidecar.protocol.apis.base",
    "sidecar.protocol.apis.completions",
    "sidecar.protocol.apis.generate",
    "sidecar.protocol.apis.messages",
    "sidecar.protocol.apis.responses",
    "sidecar.engines.calls",
    "sidecar.engines.failures",
    "sidecar.observability.prometheus_private",
    "sidecar.http1.connection",
    "sidecar.http1.client",
)

_EXTENSION_SUFFIXES: Final = (".so", ".pyd")


def modules() -> list[str]:
    """The ``HOT`` modules imported in this process from a compiled extension."""
    return [name for name in HOT
            if (module := sys.modules.get(name)) is not None
            and str(getattr(module, "__file__", "") or "").endswith(_EXTENSION_SUFFIXES)]
