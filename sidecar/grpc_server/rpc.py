"""One RPC's end mapped to its gRPC status, log line and metrics (the core's request scope).

    scope = runtime.grpc_scopes.open(METHOD, request_id)
    async with serving(scope, context):   a SidecarError -> logged, counted, the call aborted
        scope.admit()                      Overloaded / Draining (RESOURCE_EXHAUSTED / UNAVAILABLE)
        ... scope.outcome = "ok" before the last message
                                           on exit: counted, admission left

gRPC's own beyond ``sidecar.core.scope``: ``context.abort`` with the error's status, and a
cancellation counted unless the call had succeeded (a router may hang up at the last message).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from sidecar.core.scope import OK, RequestScope
from sidecar.errors import SidecarError
from sidecar.grpc_server.errors import abort_with

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def serving(
    scope: RequestScope, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[None]:
    """The call's body runs inside: see the module docstring."""
    try:
        yield
    except SidecarError as error:
        scope.failed(error)
        logger.warning("gRPC %s %s failed: %s (%s)", scope.route.rsplit("/", 1)[-1],
                       scope.request_id, error.code, error.message)
        await abort_with(context, error)
    except asyncio.CancelledError:
        if scope.outcome != OK:
            scope.cancelled()
        raise
    finally:
        scope.close()
