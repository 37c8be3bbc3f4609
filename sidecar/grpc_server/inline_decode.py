"""``disagg.DecodeWorker/Decode`` in inline mode (``--kv-transport inline``): KV in, tokens out.

    DecodeRequest wire bytes (``add_to_server``: no protobuf deserializer for the request)
      ─split_decode_request─▶ head (parsed by upb: ids, tokens, limits) + blocks whose tiles
         are memoryviews into the request (INVALID_ARGUMENT: malformed wire)
      ─parse_entries (INVALID_ARGUMENT: missing/duplicated/malformed blocks)─▶
      check_compatible with <kv_staging_dir>/engine.json (FAILED_PRECONDITION: other model,
      dtype or shapes) ─StagingArea.stage (RESOURCE_EXHAUSTED over max_staged_bytes)─▶ key
      ─▶ POST /v1/completions {"prompt", "max_tokens", "stream": true,
           "kv_transfer_params": {"disagg_inline": {"action": "load", "key": key}}}
      (the engine's SidecarKVConnector loads the staged blocks into the blocks vLLM allocated)
      ─▶ TokenStream ... done ─▶ staged directory removed

The decode leg, its relay and its errors are the native ``DecodeService``'s; only the body and
the staging differ. The staged directory lives exactly as long as the RPC: it is removed when
the stream ends, fails or is cancelled.

Why the wire walk: a parsed 32 MiB DecodeRequest holds the KV in upb's arena and every read
of a ``bytes`` field copies it out again; walking the bytes grpc hands over keeps one copy of
the KV in this process (the request) and writes the staging files straight from it. A
``DecodeRequest`` message (a servicer registered the generated way) is served too, by the
same checks on its parsed blocks.

Deliberate limits: the decode side cannot check that ``token_ids`` are the prompt the KV was
computed from (the metadata carries no token hash); it only refuses KV of more tokens than
the prompt has.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Final, cast

import grpc
from google.protobuf.message import DecodeError

from connectors.inline_layout import LayoutError, read_engine_layout
from sidecar.errors import FailedPrecondition, InvalidRequest, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.checks import (
    check_max_new_tokens,
    check_temperature,
    check_token_ids,
    request_id_or_new,
)
from sidecar.grpc_server.decode import DecodeService
from sidecar.grpc_server.engine_model import EngineModel
from sidecar.grpc_server.token_stream import token_id_fields
from sidecar.inline_kv.codec import Entry, check_compatible, parse_blocks, parse_entries
from sidecar.inline_kv.staging import StagingArea
from sidecar.inline_kv.wire import WireError, split_decode_request
from sidecar.runtime import Runtime

PARAMS_KEY = "disagg_inline"
SERVICE: Final = disagg_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name

Context = grpc.aio.ServicerContext[Any, disagg_pb2.TokenStream]
#: What the wire walk found: the blocks, or why the request is malformed.
_Walked = list[Entry] | InvalidRequest


class InlineDecodeService(DecodeService):
    """Decode from KV bytes carried in the request (see the module docstring)."""

    def __init__(self, runtime: Runtime, model: EngineModel, area: StagingArea) -> None:
        super().__init__(runtime, model)
        self.staging = area
        # Per in-flight RPC, by the id of its (head) request: what to undo when it ends (its
        # staged directory), and the blocks walked off the wire.
        self._exits: dict[int, contextlib.AsyncExitStack] = {}
        self._walked: dict[int, _Walked] = {}

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serve ``Decode`` with the request's bytes as they came (no request deserializer)."""
        handler: grpc.RpcMethodHandler[bytes, disagg_pb2.TokenStream]
        handler = grpc.unary_stream_rpc_method_handler(
            self.Decode, response_serializer=disagg_pb2.TokenStream.SerializeToString
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Decode": handler}),)
        )

    async def Decode(
        self, request: disagg_pb2.DecodeRequest | bytes, context: Context
    ) -> AsyncIterator[disagg_pb2.TokenStream]:
        if isinstance(request, bytes):
            request, walked = _walk(request)
            self._walked[id(request)] = walked
        async with contextlib.AsyncExitStack() as exits:
            self._exits[id(request)] = exits
            try:
                # aclosing: a cancelled RPC closes the native stream (engine connection) too.
                native = cast(
                    AsyncGenerator[disagg_pb2.TokenStream, None], super().Decode(request, context)
                )
                async with contextlib.aclosing(native) as stream:
                    async for message in stream:
                        yield message
            finally:
                self._exits.pop(id(request), None)
                self._walked.pop(id(request), None)

    async def _decode_body(self, request: disagg_pb2.DecodeRequest) -> tuple[dict[str, Any], str]:
        runtime = self._runtime
        walked = self._walked.pop(id(request), None)
        if isinstance(walked, InvalidRequest):
            raise walked  # first: the empty head of a malformed request says nothing true
        token_ids = check_token_ids(request.token_ids)
        max_new_tokens = check_max_new_tokens(request.max_new_tokens, allow_unset=False)
        temperature = check_temperature(request.temperature)
        max_blocks = runtime.settings.max_kv_blocks
        if walked is None:
            kv = parse_blocks(request.kv_blocks, max_blocks=max_blocks)
        else:
            kv = parse_entries(walked, max_blocks=max_blocks)
            del walked
        # From the parsed blocks: summing over request.kv_blocks would copy every tile again.
        runtime.metrics.kv_bytes.labels("in").inc(kv.wire_bytes)
        try:
            engine_layout = read_engine_layout(self.staging.root)
        except LayoutError as exc:
            raise FailedPrecondition(str(exc), stage=Stage.HANDOFF) from None
        check_compatible(kv.meta, engine_layout)
        if kv.meta.num_tokens > len(token_ids):
            raise InvalidRequest(
                f"inline KV covers {kv.meta.num_tokens} tokens; the prompt has {len(token_ids)}",
                stage=Stage.HANDOFF,
            )
        request_id = request_id_or_new(request.request_id)
        key = await self._exits[id(request)].enter_async_context(self.staging.stage(kv))
        body: dict[str, Any] = {
            "model": await self._model.name(),
            "prompt": token_ids,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "stream": True,
            **token_id_fields(runtime.engine_name),
            "kv_transfer_params": {PARAMS_KEY: {"action": "load", "key": key}},
        }
        return body, request_id


def _walk(data: bytes) -> tuple[disagg_pb2.DecodeRequest, _Walked]:
    """The request without its blocks, and its blocks; a malformed one becomes an empty
    request and the error, raised in ``_decode_body`` so that it is counted and answered
    like every other refusal."""
    try:
        head, blocks = split_decode_request(data)
        request = disagg_pb2.DecodeRequest.FromString(head)
    except (WireError, DecodeError) as exc:
        return disagg_pb2.DecodeRequest(), InvalidRequest(
            f"malformed DecodeRequest: {exc}", stage=Stage.HANDOFF
        )
    return request, [(b.layer_idx, b.block_idx, b.k_data, b.v_data) for b in blocks]
