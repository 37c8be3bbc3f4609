"""``disagg.DecodeWorker/Decode`` in inline mode (``--kv-transport inline``): KV in, tokens out.

    DecodeRequest ─parse_blocks (INVALID_ARGUMENT: missing/duplicated/malformed blocks)─▶
      check_compatible with <kv_staging_dir>/engine.json (FAILED_PRECONDITION: other model,
      dtype or shapes) ─StagingArea.stage (RESOURCE_EXHAUSTED over max_staged_bytes)─▶ key
      ─▶ POST /v1/completions {"prompt", "max_tokens", "stream": true,
           "kv_transfer_params": {"disagg_inline": {"action": "load", "key": key}}}
      (the engine's SidecarKVConnector loads the staged blocks into the blocks vLLM allocated)
      ─▶ TokenStream ... done ─▶ staged directory removed

The decode leg, its relay and its errors are the native ``DecodeService``'s; only the body and
the staging differ. The staged directory lives exactly as long as the RPC: it is removed when
the stream ends, fails or is cancelled.

Deliberate limits: the decode side cannot check that ``token_ids`` are the prompt the KV was
computed from (the metadata carries no token hash); it only refuses KV of more tokens than
the prompt has.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import grpc

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
from sidecar.inline_kv.codec import check_compatible, parse_blocks
from sidecar.inline_kv.staging import StagingArea
from sidecar.runtime import Runtime

PARAMS_KEY = "disagg_inline"


class InlineDecodeService(DecodeService):
    """Decode from KV bytes carried in the request (see the module docstring)."""

    def __init__(self, runtime: Runtime, model: EngineModel, area: StagingArea) -> None:
        super().__init__(runtime, model)
        self.staging = area
        # Per in-flight RPC: what to undo when it ends (its staged directory).
        self._exits: dict[int, contextlib.AsyncExitStack] = {}

    async def Decode(
        self,
        request: disagg_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[disagg_pb2.DecodeRequest, disagg_pb2.TokenStream],
    ) -> AsyncIterator[disagg_pb2.TokenStream]:
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

    async def _decode_body(self, request: disagg_pb2.DecodeRequest) -> tuple[dict[str, Any], str]:
        runtime = self._runtime
        token_ids = check_token_ids(request.token_ids)
        max_new_tokens = check_max_new_tokens(request.max_new_tokens, allow_unset=False)
        temperature = check_temperature(request.temperature)
        kv = parse_blocks(request.kv_blocks, max_blocks=runtime.settings.max_kv_blocks)
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
