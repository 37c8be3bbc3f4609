"""One RPC's end mapped to its gRPC status, log line and metrics (the core's request scope).

    scope = runtime.grpc_scopes.open(METHOD, request_id)
    async with serving(scope, context):   a SidecarError -> logged, counted, the call aborted
        scope.admit()                      Overloaded / Draining (RESOURCE_EXHAUSTED / UNAVAILABLE)
        ... scope.outcome = "ok" before the last message
                                           on exit: counted, admission left

What is gRPC's own beyond ``sidecar.request.scope``: ``context.abort`` with the error's status,
and a cancellation counted unless the call had already succeeded (a router may hang up as
soon as it has the last message).

``tolerant(parse)`` is the services' request deserializer: bytes that are no valid message
become a ``Malformed`` request (answered INVALID_ARGUMENT after admission, like every other
refusal), where protobuf's ``FromString`` alone makes grpcio answer UNKNOWN.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from sidecar.errors import InvalidRequest, SidecarError, Stage
from sidecar.grpc_server.errors import abort_with
from sidecar.request.scope import OK, RequestScope

logger = logging.getLogger(__name__)

_Message = TypeVar("_Message")


@dataclass(frozen=True, slots=True)
class Malformed:
    """A request whose bytes are not a valid ``message`` (the message type's name)."""

    message: str

    def error(self, stage: Stage = Stage.REQUEST) -> InvalidRequest:
        return InvalidRequest(
            f"malformed {self.message}: the request bytes are not a valid protobuf message",
            stage=stage,
        )


def tolerant(
    parse: Callable[[bytes], _Message], message: str
) -> Callable[[bytes], _Message | Malformed]:
    """``parse`` as a request deserializer that hands malformed bytes on as ``Malformed``."""

    def deserialize(data: bytes) -> _Message | Malformed:
        try:
            return parse(data)
        except DecodeError:
            return Malformed(message)

    return deserialize


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
