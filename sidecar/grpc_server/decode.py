"""``disagg.DecodeWorker/Decode`` in native hand-off mode: the hand-off from the blocks, the
decode leg on the local engine, one TokenStream per generated token.

    DecodeRequest ─checks─▶ decode_handoff(kv_blocks) ─engine/connector match─▶ fields
      body = {"model", "prompt": token_ids, "max_tokens", "temperature", "stream": true,
              <engine's token-id key>}  ─handler.decode_body(body, fields)─▶ POST /v1/completions
      SSE ─TokenStreamParser─▶ TokenStream{request_id, token_id} ... {done, finish_reason}

The decode body is built from the request and the hand-off's fields only (the engine dict as
the prefill side's handler produced it), exactly as the HTTP front door merges a hand-off.
The engine's stream is parsed as it arrives; nothing is buffered beyond one event.

Errors: a missing or malformed hand-off and bad request fields are INVALID_ARGUMENT; a
hand-off from another engine family or KV connector is FAILED_PRECONDITION (the decode engine
could not use it); an unreachable engine is UNAVAILABLE; a stream that breaks after tokens
were sent ends the RPC with the error's status (tokens already sent stay sent, no fabricated
``done``). A client that cancels, or whose deadline passes, closes the engine connection: the
engine aborts the request.

Deliberate limits: native mode only (inline KV blocks, ``layer_idx >= 0``, are skipped by the
codec, not staged); one sequence per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import grpc

from sidecar.core.legs import open_decode
from sidecar.errors import DeadlineExceeded, DecodeFailed, FailedPrecondition, Stage
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.bookkeeping import FRONT_DOOR, RpcScope
from sidecar.grpc_server.checks import (
    check_max_new_tokens,
    check_temperature,
    check_token_ids,
    request_id_or_new,
)
from sidecar.grpc_server.engine_model import EngineModel
from sidecar.grpc_server.token_stream import TokenStreamParser, token_id_fields
from sidecar.handoff_codec import DecodedHandoff, decode_handoff
from sidecar.http1 import UpstreamError, UpstreamResponse
from sidecar.protocol.context import Route
from sidecar.runtime import Runtime

logger = logging.getLogger(__name__)

METHOD: Final = "/disagg.DecodeWorker/Decode"
REQUEST_ID_HEADER: Final = "X-Request-Id"
#: The sidecar reads the stream as is: no compression (the session does not decompress).
_DECODE_HEADERS: Final = {"Accept-Encoding": "identity"}


class DecodeService(disagg_pb2_grpc.DecodeWorkerServicer):
    """Runs the local engine's decode leg from a hand-off and streams its tokens."""

    def __init__(self, runtime: Runtime, model: EngineModel) -> None:
        self._runtime = runtime
        self._model = model
        self._url = runtime.grpc_orchestrator.engine_url(Route.COMPLETIONS)

    async def Decode(
        self,
        request: disagg_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[disagg_pb2.DecodeRequest, disagg_pb2.TokenStream],
    ) -> AsyncIterator[disagg_pb2.TokenStream]:
        scope = RpcScope(self._runtime, METHOD, request.request_id or "-")
        async with scope.serving(context):
            scope.admit()
            body, request_id = await self._decode_body(request)
            scope.request_id = request_id
            started = time.perf_counter()
            response = await open_decode(
                self._runtime.session,
                self._url,
                body,
                {REQUEST_ID_HEADER: request_id, **_DECODE_HEADERS},
            )
            scope.observe("decode_first_byte", time.perf_counter() - started)
            try:
                async for message in self._relay(response, request_id):
                    if message.done:
                        # Counted before the last yield: the client may hang up once it has it.
                        scope.outcome = "ok"
                    yield message
            finally:
                if scope.outcome == "ok":
                    response.release()
                else:
                    # Closing the connection is how an engine learns the client went away.
                    response.close()

    async def _decode_body(self, request: disagg_pb2.DecodeRequest) -> tuple[dict[str, Any], str]:
        runtime = self._runtime
        token_ids = check_token_ids(request.token_ids)
        max_new_tokens = check_max_new_tokens(request.max_new_tokens, allow_unset=False)
        temperature = check_temperature(request.temperature)
        handoff = decode_handoff(request.kv_blocks)
        runtime.metrics.kv_bytes.labels("in").inc(
            sum(len(block.k_data) + len(block.v_data) for block in request.kv_blocks)
        )
        self._check_compatible(handoff)
        request_id = request_id_or_new(request.request_id, handoff.request_id)
        body: dict[str, Any] = {
            "model": await self._model.name(),
            "prompt": token_ids,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "stream": True,
            **token_id_fields(runtime.engine_name),
        }
        return runtime.handler.decode_body(body, handoff.fields), request_id

    def _check_compatible(self, handoff: DecodedHandoff) -> None:
        runtime = self._runtime
        if handoff.engine != runtime.engine_name:
            raise FailedPrecondition(
                f"hand-off comes from a {handoff.engine!r} prefill engine; this decode engine "
                f"is {runtime.engine_name!r}",
                stage=Stage.HANDOFF,
            )
        local_connector = runtime.agent.name if runtime.agent is not None else None
        if handoff.kv_connector != local_connector:
            raise FailedPrecondition(
                f"hand-off uses KV connector {handoff.kv_connector!r}; this decode engine uses "
                f"{local_connector!r}",
                stage=Stage.HANDOFF,
            )

    async def _relay(
        self, response: UpstreamResponse, request_id: str
    ) -> AsyncIterator[disagg_pb2.TokenStream]:
        parser = TokenStreamParser()
        relayed = self._runtime.metrics.relayed_bytes.labels(FRONT_DOOR)
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
