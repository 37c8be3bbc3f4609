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

The contract's request fields are checked before anything is sent to an engine
(``check_token_ids``, ``check_max_new_tokens``, ``check_temperature``: plain values, or
``InvalidRequest``, INVALID_ARGUMENT); the rules, and why Prefill lets ``max_new_tokens`` 0
pass: docs/driving/grpc-contract.md#checks (the request id: ``sidecar.protocol.request``;
metadata ``x-data-parallel-rank``: ``sidecar.targets.choice.rank_from_metadata``). No check
against the engine's context length: the engine refuses, and its 4xx maps to
INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final, TypeVar

import grpc
import msgspec
from google.protobuf.message import DecodeError

from sidecar.errors import InvalidRequest, SidecarError, Stage
from sidecar.grpc_server.errors import abort_with
from sidecar.request.scope import OK, RequestScope

logger = logging.getLogger(__name__)

_Message = TypeVar("_Message")


class Malformed(msgspec.Struct, frozen=True):
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


# -- the contract's fields ------------------------------------------------------------------

MAX_NEW_TOKENS: Final = 1 << 20


def check_token_ids(token_ids: Sequence[int]) -> list[int]:
    if not token_ids:
        raise InvalidRequest("token_ids must not be empty")
    ids = list(token_ids)
    if min(ids) < 0:
        raise InvalidRequest("token_ids must be non-negative")
    return ids


def check_max_new_tokens(value: int, *, allow_unset: bool) -> int:
    """``value`` when in range; 0 passes only with ``allow_unset`` (Prefill)."""
    if value == 0 and allow_unset:
        return value
    if not 1 <= value <= MAX_NEW_TOKENS:
        raise InvalidRequest(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got {value}")
    return value


def _float32(value: float) -> float:
    try:
        return float(struct.unpack("<f", struct.pack("<f", value))[0])
    except OverflowError:
        # A shortened decimal of a value near float32's maximum can round past it.
        return math.inf


def check_temperature(value: float) -> float:
    """The temperature as the shortest decimal with the same float32 value."""
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest("temperature must be a finite number >= 0")
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if _float32(candidate) == value:
            return candidate
    return value
