"""``disagg.DecodeWorker/Decode``: one service, given a hand-off strategy; a TokenStream a token.

    request (a DecodeRequest, or its wire bytes for inline KV) ─strategy.read()─▶ DecodeInput
      ─serving(scope)─▶ admit ─strategy.decode_body()─▶ (engine body, request id)
        native (``sidecar.grpc_server.native``): the hand-off from the control blocks
        inline (``sidecar.grpc_server.inline.grpc``): the KV staged for the engine's connector
      ─flow.open_decode─▶ POST /v1/completions (stream) ─TokenStreamParser─▶
      TokenStream{request_id, token_id} ... {done, finish_reason}

The engine's stream is parsed as it arrives (nothing buffered beyond one event); the call's
metadata is the trace carrier. What a strategy sets up (inline: the staged KV) lives in the
request's exit stack and ends with the RPC, however it ends. A break after tokens were sent
ends the RPC with the error's status, no fabricated ``done``
(docs/driving/grpc-contract.md#finish-reasons); a
client that cancels, or whose deadline passes, closes the engine connection (the engine
aborts); after ``done`` the answer's rest is read (docs/extending/design-notes.md#decode-tail).
Deliberate limits: one sequence per request (the contract's ``TokenStream`` has one).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final, Protocol

import grpc

from sidecar.errors import DeadlineExceeded, DecodeFailed, InvalidRequest, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.inline.wire import Entry
from sidecar.grpc_server.rpc import Malformed, serving, tolerant
from sidecar.grpc_server.token_stream import TokenStreamParser
from sidecar.http1 import UpstreamError, UpstreamResponse
from sidecar.observability.tracing import HANDOFF_SPAN, NOOP_SPAN, RELAY_SPAN, RELAYED_TOKENS
from sidecar.protocol.context import Route
from sidecar.protocol.request import REQUEST_ID_HEADER, logged_request_id
from sidecar.request.runner import Runner
from sidecar.request.scope import OK, Scopes
from sidecar.targets.ranks import rank_from_metadata

SERVICE: Final = disagg_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
METHOD: Final = f"/{SERVICE}/Decode"
#: The sidecar reads the stream as is: no compression (the client does not decompress).
_DECODE_HEADERS: Final = {"Accept-Encoding": "identity"}
#: What follows ``[DONE]`` is read for at most this long, and this much (design notes).
_TAIL_WAIT_S: Final = 5.0
_TAIL_MAX_BYTES: Final = 64 * 1024

Context = grpc.aio.ServicerContext[Any, disagg_pb2.TokenStream]


@dataclass(frozen=True, slots=True)
class DecodeInput:
    """A Decode request as received, and (inline) its KV blocks off the wire (``walked``; None:
    still in ``request.kv_blocks``) or why they could not be read (refused after admission)."""

    request: disagg_pb2.DecodeRequest
    walked: list[Entry] | None = None
    malformed: InvalidRequest | None = None


class DecodeStrategy(Protocol):
    """How a Decode turns its blocks into the engine's decode body (native or inline)."""

    #: True when the strategy reads the request's wire bytes itself (no deserializer).
    raw_request: bool

    def read(self, request: disagg_pb2.DecodeRequest | Malformed | bytes) -> DecodeInput:
        """The request as this strategy takes it (inline: walked off its wire bytes)."""

    async def decode_body(
        self, decode_input: DecodeInput, exits: contextlib.AsyncExitStack,
        rank: int | None = None,
    ) -> tuple[dict[str, Any], str]:
        """Checks, then the engine's decode body (on the local data-parallel ``rank``) and the
        request id; resources go on ``exits``."""


class DecodeService:
    """Runs the local engine's decode leg and streams its tokens."""

    def __init__(self, flow: Runner, scopes: Scopes, strategy: DecodeStrategy) -> None:
        self._flow = flow
        self._scopes = scopes
        self.strategy = strategy

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serve ``Decode``: the request parsed by protobuf, or (``raw_request``) its bytes."""
        handler: grpc.RpcMethodHandler[Any, disagg_pb2.TokenStream]
        handler = grpc.unary_stream_rpc_method_handler(
            self.Decode,
            request_deserializer=(
                None if self.strategy.raw_request
                else tolerant(disagg_pb2.DecodeRequest.FromString, "DecodeRequest")),
            response_serializer=disagg_pb2.TokenStream.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Decode": handler}),)
        )

    async def Decode(
        self, request: disagg_pb2.DecodeRequest | Malformed | bytes, context: Context
    ) -> AsyncIterator[disagg_pb2.TokenStream]:
        decode_input = self.strategy.read(request)
        del request  # inline: the wire bytes live on only through the walked blocks
        scope = self._scopes.open(METHOD, logged_request_id(decode_input.request.request_id),
                                  context.invocation_metadata())
        trace = scope.trace
        async with contextlib.AsyncExitStack() as exits, serving(scope, context):
            scope.admit()
            # The local rank this decode runs on (the router's, else the least busy), busy
            # until the RPC ends.
            flow = self._flow
            rank = flow.ranks.held(exits, rank_from_metadata(context.invocation_metadata(),
                                                     flow.ranks.local_size))
            if trace.active:
                with trace.span(HANDOFF_SPAN):
                    body, request_id = await self.strategy.decode_body(decode_input, exits, rank)
            else:  # untraced: not even a no-op span's calls
                body, request_id = await self.strategy.decode_body(decode_input, exits, rank)
            del decode_input  # the KV is staged: hold no second reference to the request
            scope.request_id = request_id
            started = time.perf_counter()
            response = await flow.open_decode(
                Route.COMPLETIONS, body, {REQUEST_ID_HEADER: request_id, **_DECODE_HEADERS},
                trace, rank,
            )
            scope.observe("decode_first_byte", time.perf_counter() - started)
            tokens = 0
            relay = trace.span(RELAY_SPAN) if trace.active else NOOP_SPAN
            try:
                async for message in self._relay(response, request_id, scope.relayed_bytes):
                    if message.done:
                        # Counted before the last yield: the client may hang up once it has it.
                        scope.outcome = OK
                    else:
                        tokens += 1
                    yield message
            except BaseException as exc:
                if scope.outcome != OK:  # a router may hang up once it has ``done``
                    relay.fail(exc)
                raise
            finally:
                if trace.active:
                    relay.set(RELAYED_TOKENS, tokens)
                    relay.end()
                if scope.outcome == OK:
                    response.release()
                else:
                    # Closing the connection is how an engine learns the client went away.
                    response.close()

    @staticmethod
    async def _relay(
        response: UpstreamResponse, request_id: str, relayed: Any
    ) -> AsyncIterator[disagg_pb2.TokenStream]:
        parser = TokenStreamParser()
        try:
            while chunk := await response.readany():
                relayed.inc(len(chunk))
                for token_id in parser.feed(chunk):
                    yield disagg_pb2.TokenStream(request_id=request_id, token_id=token_id)
                if parser.done:
                    break
        except TimeoutError:
            raise DeadlineExceeded(
                "decode stream stalled past the read deadline", stage=Stage.DECODE
            ) from None
        except UpstreamError:
            raise DecodeFailed("decode engine broke its stream", stage=Stage.DECODE) from None
        for token_id in parser.flush():
            yield disagg_pb2.TokenStream(request_id=request_id, token_id=token_id)
        finish_reason = parser.finish()
        yield disagg_pb2.TokenStream(request_id=request_id, done=True, finish_reason=finish_reason)
        await _read_to_the_end(response)


async def _read_to_the_end(response: UpstreamResponse) -> None:
    """Read what follows ``[DONE]`` (the chunked terminator) so that ``release`` can pool the
    connection; a failure or an over-long tail leaves it unfinished (``release`` closes it)."""
    tail = 0
    try:
        async with asyncio.timeout(_TAIL_WAIT_S):
            while tail <= _TAIL_MAX_BYTES and (chunk := await response.readany()):
                tail += len(chunk)
    except (UpstreamError, TimeoutError):
        pass  # the answer was complete at [DONE]: only the connection is lost
