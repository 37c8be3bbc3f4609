"""``disagg.PrefillWorker/Prefill``: one service, given a hand-off strategy.

    PreFillRequest ─serving(scope)─▶ admit ─▶ strategy.run(PrefillCall(request, scope, ...))
        native (``sidecar.grpc_server.native``): the engine hand-off as control blocks
        inline (``sidecar.grpc_server.inline.grpc``): the engine's KV cache itself, layer by layer
      ─▶ KVBlockStream{block} ... ─▶ KVBlockStream{done: true}

A coroutine handler writing with ``context.write``: a cancelled RPC cancels the engine call in
its frame (docs/extending/design-notes.md#grpc-prefill-handler). The hand-off names this pod by
``resolve_advertise_host``, which decode engines dial (NIXL side channel, bootstrap servers).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final, Protocol
from urllib.parse import urlsplit

import grpc
import msgspec

from sidecar.config.settings import Settings
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.rpc import Malformed, serving, tolerant
from sidecar.protocol.context import PrefillTarget, is_loopback_host, url_port
from sidecar.protocol.request import logged_request_id
from sidecar.request.scope import OK, RequestScope, Scopes
from sidecar.targets.choice import rank_from_metadata

logger = logging.getLogger(__name__)

SERVICE: Final = disagg_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
METHOD: Final = f"/{SERVICE}/Prefill"

#: One stream message: a KVBlockStream, or one serialized (inline data blocks, ``prefill_files``).
StreamMessage = disagg_pb2.KVBlockStream | bytes
#: Sends one stream message and counts its K+V bytes.
Send = Callable[[StreamMessage, int], Awaitable[None]]
Context = grpc.aio.ServicerContext[disagg_pb2.PreFillRequest | Malformed, StreamMessage]


def serialize_stream_message(message: StreamMessage) -> bytes:
    """The wire bytes of a stream message (serialized ones pass through as they are)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class PrefillCall(msgspec.Struct, frozen=True):
    """One Prefill RPC as a strategy gets it."""

    request: disagg_pb2.PreFillRequest
    scope: RequestScope
    #: Seconds left of the caller's deadline (None: no deadline).
    time_remaining: float | None
    send: Send
    #: The local engine's data-parallel rank the router named (metadata), if any.
    rank: int | None = None


class PrefillStrategy(Protocol):
    """How a Prefill's stream carries the hand-off (native fields or inline KV)."""

    async def run(self, call: PrefillCall) -> None:
        """Check the request, run the engine's prefill and send every block (not ``done``)."""


def resolve_advertise_host(settings: Settings) -> str | None:
    """The host decode engines use to reach this pod's engine: ``advertise_host`` (flag, env
    or POD_IP; loopback included: both pods on one host, said explicitly), else the engine
    URL's host unless loopback; else None, and Prefill refuses (FAILED_PRECONDITION) rather
    than hand decode an address that points at itself."""
    if settings.advertise_host:
        return settings.advertise_host
    host = urlsplit(settings.engine_url).hostname or ""
    return None if is_loopback_host(host) else host


def engine_target(settings: Settings, host: str) -> PrefillTarget:
    """This pod's engine as the hand-off names it: ``host`` and the engine URL's port."""
    parts = urlsplit(settings.engine_url)
    return PrefillTarget(host, url_port(parts))


class PrefillService:
    """Runs the local engine's prefill leg and streams what the strategy produces."""

    def __init__(self, scopes: Scopes, strategy: PrefillStrategy, *,
                 local_ranks: int = 1) -> None:
        """``local_ranks``: the local engine's data-parallel size (metadata ranks below it)."""
        self._scopes = scopes
        self.strategy = strategy
        self._local_ranks = local_ranks
        self._kv_out = scopes.metrics.kv_bytes.labels("out")

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serve ``Prefill`` (a coroutine handler, registered by its method handler)."""
        handler: grpc.RpcMethodHandler[disagg_pb2.PreFillRequest | Malformed, StreamMessage]
        handler = grpc.unary_stream_rpc_method_handler(
            self.Prefill,
            request_deserializer=tolerant(disagg_pb2.PreFillRequest.FromString,
                                          "PreFillRequest"),
            response_serializer=serialize_stream_message,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Prefill": handler}),)
        )

    async def Prefill(self, request: disagg_pb2.PreFillRequest | Malformed,
                      context: Context) -> None:
        malformed = request if isinstance(request, Malformed) else None
        if isinstance(request, Malformed):
            request = disagg_pb2.PreFillRequest()
        scope = self._scopes.open(METHOD, logged_request_id(request.request_id),
                                  context.invocation_metadata())
        kv_out = self._kv_out

        async def send(message: StreamMessage, nbytes: int) -> None:
            kv_out.inc(nbytes)
            await context.write(message)

        async with serving(scope, context):
            scope.admit()
            if malformed is not None:
                raise malformed.error()
            rank = rank_from_metadata(context.invocation_metadata(), self._local_ranks)
            await self.strategy.run(PrefillCall(request, scope, context.time_remaining(), send,
                                                rank))
            # Counted before the last write: a router may hang up as soon as it has ``done``.
            scope.outcome = OK
            await context.write(disagg_pb2.KVBlockStream(done=True))
