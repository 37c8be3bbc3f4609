"""``SidecarError`` as a gRPC status: one place decides what a gRPC client sees.

    raise PrefillFailed("prefill engine answered HTTP 500")
        -> status UNAVAILABLE, details "prefill_failed (prefill): prefill engine answered HTTP 500"
           trailing metadata disagg-error-code: prefill_failed, disagg-error-stage: prefill

The status is the error kind's (``GRPC_STATUSES``; a subclass takes its parent's); the
details are the error's safe message (never an engine body), prefixed by its stable code and
stage so a router can tell a prefill failure from a decode failure without parsing text.
Deliberate limits: no rich status (``google.rpc.Status`` details); the two metadata keys carry
what a router needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, NoReturn

import grpc

from sidecar.errors import (
    BodyTooLarge,
    ClientCancelled,
    DeadlineExceeded,
    DecodeFailed,
    Draining,
    EngineNotReady,
    EngineRejected,
    FailedPrecondition,
    InvalidHandoff,
    InvalidRequest,
    Overloaded,
    PrefillFailed,
    RequestTimeout,
    ResourceExhausted,
    RouteNotServed,
    SidecarError,
    TargetNotAllowed,
)

ERROR_CODE_KEY: Final = "disagg-error-code"
ERROR_STAGE_KEY: Final = "disagg-error-stage"

#: The gRPC status of each kind of error (the error table of docs/operating/errors.md).
GRPC_STATUSES: Final[Mapping[type[SidecarError], grpc.StatusCode]] = MappingProxyType({
    SidecarError: grpc.StatusCode.INTERNAL,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    TargetNotAllowed: grpc.StatusCode.PERMISSION_DENIED,
    RouteNotServed: grpc.StatusCode.UNIMPLEMENTED,
    BodyTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    PrefillFailed: grpc.StatusCode.UNAVAILABLE,
    EngineRejected: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidHandoff: grpc.StatusCode.UNAVAILABLE,
    DecodeFailed: grpc.StatusCode.UNAVAILABLE,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Draining: grpc.StatusCode.UNAVAILABLE,
    EngineNotReady: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ClientCancelled: grpc.StatusCode.CANCELLED,
})


def grpc_status(error: SidecarError) -> grpc.StatusCode:
    """The gRPC status of ``error``: its own kind's, else the nearest parent kind's."""
    for kind in type(error).__mro__:
        status = GRPC_STATUSES.get(kind)
        if status is not None:
            return status
    return grpc.StatusCode.INTERNAL


def status_details(error: SidecarError) -> str:
    """The status details a client sees for ``error``."""
    return f"{error.code} ({error.stage.value}): {error.message}"


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], error: SidecarError) -> NoReturn:
    """End the RPC with ``error``'s status (raises, as ``context.abort`` does)."""
    await context.abort(
        grpc_status(error),
        status_details(error),
        trailing_metadata=((ERROR_CODE_KEY, error.code), (ERROR_STAGE_KEY, error.stage.value)),
    )
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
