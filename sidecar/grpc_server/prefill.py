"""``disagg.PrefillWorker/Prefill``: one service, given a hand-off strategy.

    PreFillRequest ─serving(scope)─▶ admit ─▶ strategy.run(PrefillCall(request, scope, ...))
        native (``sidecar.grpc_server.native``): the engine hand-off as control blocks
        inline (``sidecar.grpc_server.inline.grpc``): the engine's KV cache itself, layer by layer
      ─▶ KVBlockStream{block} ... ─▶ KVBlockStream{done: true}

The handler is a coroutine that writes with ``context.write``, not an async generator: a
cancelled RPC raises ``CancelledError`` in this frame wherever it waits, so the strategy's
engine call is cancelled (closing its connection, which makes the engine abort the request)
and its resources released before the RPC's bookkeeping ends.

The hand-off names this pod by ``advertise_host`` (``resolve_advertise_host``): decode engines
connect to it (NIXL side channel, SGLang and Mooncake bootstrap servers).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Protocol
from urllib.parse import urlsplit

import grpc

from sidecar.config.settings import Settings
from sidecar.core.scope import OK, RequestScope, Scopes
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.rpc import serving
from sidecar.protocol.context import PrefillTarget
from sidecar.protocol.hostfmt import is_loopback_host

logger = logging.getLogger(__name__)

SERVICE: Final = disagg_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
METHOD: Final = f"/{SERVICE}/Prefill"
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}

#: One stream message: a KVBlockStream, or one already serialized (inline KV data blocks,
#: framed straight from the engine's files by ``sidecar.grpc_server.inline.prefill_files``).
StreamMessage = disagg_pb2.KVBlockStream | bytes
#: Sends one stream message and counts its K+V bytes.
Send = Callable[[StreamMessage, int], Awaitable[None]]
Context = grpc.aio.ServicerContext[disagg_pb2.PreFillRequest, StreamMessage]


def serialize_stream_message(message: StreamMessage) -> bytes:
    """The wire bytes of a stream message (serialized ones pass through as they are)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


@dataclass(frozen=True, slots=True)
class PrefillCall:
    """One Prefill RPC as a strategy gets it."""

    request: disagg_pb2.PreFillRequest
    scope: RequestScope
    #: Seconds left of the caller's deadline (None: no deadline).
    time_remaining: float | None
    send: Send


class PrefillStrategy(Protocol):
    """How a Prefill's stream carries the hand-off (native fields or inline KV)."""

    async def run(self, call: PrefillCall) -> None:
        """Check the request, run the engine's prefill and send every block (not ``done``)."""


def resolve_advertise_host(settings: Settings) -> str | None:
    """The host decode engines use to reach this pod's engine, or None when unknown.

    ``advertise_host`` (flag, env or POD_IP) wins, loopback included (an operator who runs
    both pods on one host says so explicitly). Without it, the engine URL's host serves when
    it is not loopback. A loopback engine URL and no advertise host: None, and Prefill refuses
    with FAILED_PRECONDITION rather than hand decode an address that points at itself.
    """
    if settings.advertise_host:
        return settings.advertise_host
    host = urlsplit(settings.engine_url).hostname or ""
    return None if is_loopback_host(host) else host


def engine_target(settings: Settings, host: str) -> PrefillTarget:
    """This pod's engine as the hand-off names it: ``host`` and the engine URL's port."""
    parts = urlsplit(settings.engine_url)
    return PrefillTarget(host, parts.port or _DEFAULT_PORTS.get(parts.scheme, 80))


class PrefillService:
    """Runs the local engine's prefill leg and streams what the strategy produces."""

    def __init__(self, scopes: Scopes, strategy: PrefillStrategy) -> None:
        self._scopes = scopes
        self.strategy = strategy
        self._kv_out = scopes.metrics.kv_bytes.labels("out")

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serve ``Prefill`` (a coroutine handler, registered by its method handler)."""
        handler: grpc.RpcMethodHandler[disagg_pb2.PreFillRequest, StreamMessage]
        handler = grpc.unary_stream_rpc_method_handler(
            self.Prefill,
            request_deserializer=disagg_pb2.PreFillRequest.FromString,
            response_serializer=serialize_stream_message,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Prefill": handler}),)
        )

    async def Prefill(self, request: disagg_pb2.PreFillRequest, context: Context) -> None:
        scope = self._scopes.open(METHOD, request.request_id or "-",
                                  context.invocation_metadata())
        kv_out = self._kv_out

        async def send(message: StreamMessage, nbytes: int) -> None:
            kv_out.inc(nbytes)
            await context.write(message)

        async with serving(scope, context):
            scope.admit()
            await self.strategy.run(PrefillCall(request, scope, context.time_remaining(), send))
            # Counted before the last write: a router may hang up as soon as it has ``done``.
            scope.outcome = OK
            await context.write(disagg_pb2.KVBlockStream(done=True))
