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
The engine's streamed completion is read as token ids and a finish reason
(``TokenStreamParser``): the ids arrive in ``choices[0].token_ids`` once the dialect's
``token_id_fields`` asked for them; finish reasons collapse to three (stop, length, abort:
docs/driving/grpc-contract.md#finish-reasons); only ``data:`` lines are read; an ``error``
object mid-stream is a ``DecodeFailed`` whose text is not relayed (it may quote the prompt).

Deliberate limits: one sequence per request (the contract's ``TokenStream`` has one, and one
choice per stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final, Protocol

import grpc
import msgspec

from sidecar import jsonutil
from sidecar.errors import DeadlineExceeded, DecodeFailed, InvalidRequest, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.inline.wire import Entry
from sidecar.grpc_server.rpc import Malformed, serving, tolerant
from sidecar.http1 import UpstreamError, UpstreamResponse
from sidecar.observability.tracing import HANDOFF_SPAN, NOOP_SPAN, RELAY_SPAN, RELAYED_TOKENS
from sidecar.protocol.context import Route
from sidecar.protocol.request import REQUEST_ID_HEADER, logged_request_id
from sidecar.protocol.sse import DATA_FIELD, DONE_PAYLOAD, ERROR_KEY
from sidecar.request.runner import Runner
from sidecar.request.scope import OK, Scopes
from sidecar.targets.choice import rank_from_metadata

SERVICE: Final = disagg_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
METHOD: Final = f"/{SERVICE}/Decode"
#: The sidecar reads the stream as is: no compression (the client does not decompress).
_DECODE_HEADERS: Final = {"Accept-Encoding": "identity"}
#: What follows ``[DONE]`` is read for at most this long, and this much (design notes).
_TAIL_WAIT_S: Final = 5.0
_TAIL_MAX_BYTES: Final = 64 * 1024

Context = grpc.aio.ServicerContext[Any, disagg_pb2.TokenStream]


class DecodeInput(msgspec.Struct, frozen=True):
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


# -- the engine's stream as token ids -------------------------------------------------------

FINISH_STOP: Final = "stop"
FINISH_LENGTH: Final = "length"
FINISH_ABORT: Final = "abort"

CHOICES: Final = "choices"
TOKEN_IDS: Final = "token_ids"
FINISH_REASON: Final = "finish_reason"

#: Largest value a TokenStream.token_id (int32) can carry.
INT32_MAX: Final = (1 << 31) - 1
#: One SSE event line is never this long for a token chunk; a longer one is garbage.
MAX_PENDING_BYTES: Final = 4 * 1024 * 1024


#: Engine finish reasons that mean the request did not end normally.
_ABORT_REASONS: Final = frozenset({"abort", "aborted", "cancelled", "canceled", "error"})


def normalize_finish_reason(reason: str) -> str:
    """The contract's finish reason (stop | length | abort) for an engine's finish reason."""
    lowered = reason.lower()
    if lowered == FINISH_LENGTH:
        return FINISH_LENGTH
    if lowered in _ABORT_REASONS:
        return FINISH_ABORT
    return FINISH_STOP


def _broken(message: str) -> DecodeFailed:
    return DecodeFailed(f"decode engine stream: {message}", stage=Stage.DECODE)


class TokenStreamParser:
    """Incremental parser of one streamed completion (feed bytes as they arrive)."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._finish_reason: str | None = None
        self.done = False

    @property
    def finish_reason(self) -> str | None:
        """The normalized finish reason, once the engine sent one."""
        return self._finish_reason

    def feed(self, chunk: bytes) -> list[int]:
        """The token ids completed by ``chunk`` (possibly none)."""
        if self.done:
            return []
        self._pending += chunk
        tokens: list[int] = []
        while not self.done:
            end = self._pending.find(b"\n")
            if end < 0:
                break
            line = bytes(self._pending[:end]).rstrip(b"\r")
            del self._pending[: end + 1]
            tokens.extend(self._line(line))
        if len(self._pending) > MAX_PENDING_BYTES:
            raise _broken("an event line exceeds the size cap")
        return tokens

    def flush(self) -> list[int]:
        """Token ids of a last line the engine sent without its newline (call at the end)."""
        if self.done or not self._pending.strip():
            return []
        line = bytes(self._pending).strip()
        self._pending.clear()
        # An event cut in the middle fails here: a proper prefix of JSON never parses.
        return self._line(line)

    def finish(self) -> str:
        """The finish reason once the stream ended; raises ``DecodeFailed`` if it broke."""
        if self._finish_reason is None:
            raise _broken("the stream ended without a finish reason")
        return self._finish_reason

    def _line(self, line: bytes) -> list[int]:
        if not line.startswith(DATA_FIELD):
            return []  # blank separators, comments, other SSE fields
        data = line[len(DATA_FIELD):].strip()
        if data == DONE_PAYLOAD:
            self.done = True
            return []
        try:
            event = jsonutil.loads(data)
        except jsonutil.JSONDecodeError:
            raise _broken("an event is not JSON") from None
        if not isinstance(event, Mapping):
            raise _broken("an event is not a JSON object")
        if ERROR_KEY in event:
            raise _broken("the engine reported an error mid-stream")
        return self._choice(event.get(CHOICES))

    def _choice(self, choices: object) -> list[int]:
        if choices is None or choices == []:
            return []  # usage-only chunks
        if not isinstance(choices, list) or not isinstance(choices[0], Mapping):
            raise _broken("'choices' is not a list of objects")
        if len(choices) > 1:
            raise _broken("more than one choice in a chunk (n > 1 is not supported)")
        choice = choices[0]
        tokens = _token_ids(choice.get(TOKEN_IDS))
        reason = choice.get(FINISH_REASON)
        if reason is not None:
            if not isinstance(reason, str):
                raise _broken("'finish_reason' is not a string")
            self._finish_reason = normalize_finish_reason(reason)
        return tokens


def _token_ids(value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _broken("'token_ids' is not a list")
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= INT32_MAX:
            raise _broken("a token id is not an int32")
    return value
