"""The native hand-off over gRPC: the KV stays in the engines, the stream carries the hand-off.

Prefill (``NativePrefill``):

    PreFillRequest ─checks─▶ client body {"model", "prompt": ids, "max_tokens", "temperature",
                                          <the engine's token-id fields>}
      ─core.context (ids: int32 room, disagg id, transfer id, engine id)─▶ ctx
      sequential (vLLM shfs/nixl, TRT-LLM):  core.prefill(leg) ─▶ hand-off fields
      concurrent (SGLang, vLLM Mooncake):    core.concurrent_handoff(ctx) at once; the engine
                                             call runs on as core.background_prefill
      ─encode_handoff─▶ KVBlock{layer -1 ...} (``sidecar.kv_wire.handoff``)

Decode (``NativeDecode``):

    DecodeRequest ─checks─▶ decode_handoff(kv_blocks) ─engine/connector match─▶ fields
      body = {"model", "prompt": token_ids, "max_tokens", "temperature", "stream": true,
              <token-id fields>} ─core.decode_body(body, fields)─▶ the decode leg

The bodies come from the same engine handler as HTTP (the core's), on ``/v1/completions``;
the decode body is built from the request and the hand-off's fields only, exactly as the HTTP
front door merges a hand-off.

Concurrent flows: SGLang's prefill blocks until its decode connects, so Prefill cannot wait
for it (the router calls Decode only after Prefill's ``done``). The engine call goes on in a
background task bounded by ``prefill_timeout_s``, holding the request's admission slot (drain
waits for it) and its bootstrap room, logged and counted when it fails.

Deliberate limits: a failed background prefill cannot abort the decode, which runs on another
sidecar: that decode waits for its engine's bootstrap timeout. When TensorRT-LLM's context
response already is the whole answer (its first token ended the sequence), the hand-off has
no fields, so the decode engine recomputes the prompt; this is counted as a prefill fallback
with reason ``answered_by_prefill``. A Decode's inline KV blocks (``layer_idx >= 0``) are
skipped, not staged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from sidecar.config.settings import Role, Settings
from sidecar.core.orchestrator import Orchestrator, PrefillLeg
from sidecar.core.scope import RequestScope, Scopes, Timings
from sidecar.errors import FailedPrecondition, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.checks import check_max_new_tokens, check_temperature, check_token_ids
from sidecar.grpc_server.decode import DecodeInput
from sidecar.grpc_server.prefill import Send, engine_target, resolve_advertise_host
from sidecar.kv_wire.handoff import DecodedHandoff, decode_handoff, encode_handoff
from sidecar.observability.metrics import Metrics
from sidecar.protocol.context import Route
from sidecar.protocol.request_id import REQUEST_ID_HEADER, request_id_or_new

logger = logging.getLogger(__name__)


class NativePrefill:
    """Prefill whose stream carries the engine's hand-off fields."""

    def __init__(self, core: Orchestrator, scopes: Scopes, settings: Settings) -> None:
        self._core = core
        self._scopes = scopes
        self._settings = settings
        self._fallbacks = scopes.metrics.prefill_fallbacks
        self._advertise_host = resolve_advertise_host(settings)
        self._url = core.engine_url(Route.COMPLETIONS)
        if self._advertise_host is None and settings.role is not Role.DECODE:
            logger.warning(
                "gRPC Prefill is refused (FAILED_PRECONDITION) until --advertise-host (or "
                "POD_IP) is set: the engine URL %s is loopback, which decode pods cannot reach",
                settings.engine_url,
            )

    async def run(
        self,
        request: disagg_pb2.PreFillRequest,
        scope: RequestScope,
        time_remaining: float | None,
        send: Send,
    ) -> None:
        for block in await self._handoff_blocks(request, scope, time_remaining):
            await send(disagg_pb2.KVBlockStream(block=block),
                       len(block.k_data) + len(block.v_data))

    async def _handoff_blocks(
        self, request: disagg_pb2.PreFillRequest, scope: RequestScope,
        time_remaining: float | None,
    ) -> list[disagg_pb2.KVBlock]:
        token_ids = check_token_ids(request.token_ids)
        max_new_tokens = check_max_new_tokens(request.max_new_tokens, allow_unset=True)
        temperature = check_temperature(request.temperature)
        if self._advertise_host is None:
            raise FailedPrecondition(
                "this sidecar has no advertise host (set --advertise-host or POD_IP); its "
                "engine URL is loopback, which a decode engine cannot reach",
                stage=Stage.PREFILL,
            )
        request_id = request_id_or_new(request.request_id)
        core = self._core
        client_body: dict[str, Any] = {
            "model": await core.model_name(Stage.PREFILL),
            "prompt": token_ids,
            "max_tokens": max_new_tokens or 1,
            "temperature": temperature,
            **core.token_id_fields,
        }
        target = engine_target(self._settings, self._advertise_host)
        ctx = await core.context(Route.COMPLETIONS, request_id, target, self._advertise_host)
        handed_off = False
        try:
            leg = PrefillLeg(
                url=self._url,
                body=core.prefill_body(client_body, ctx),
                headers={REQUEST_ID_HEADER: request_id},
                timeout_s=core.prefill_timeout(time_remaining),
                trace=scope.trace,
            )
            if core.concurrent:
                fields = core.concurrent_handoff(ctx, scope.trace)
                # The engine call outlives this RPC: it gets its own deadline, not the caller's.
                background = dataclasses.replace(leg, timeout_s=core.prefill_timeout())
                core.background_prefill(background, ctx, self._scopes, scope.detach())
                handed_off = True
            else:
                timings = Timings()
                try:
                    handoff = await core.prefill(leg, ctx, timings)
                finally:
                    scope.observe_timings(timings)
                fields = handoff.fields
                if handoff.answer is not None:
                    self._fallbacks.labels(scope.front_door, "answered_by_prefill").inc()
                    logger.info("request %s: the prefill finished the sequence; decode "
                                "recomputes", request_id)
        finally:
            if not handed_off:
                core.release(ctx)
        return encode_handoff(
            fields,
            request_id=request_id,
            engine=core.engine_name,
            kv_connector=core.connector_name,
            prefill_host=target.host,
            prefill_port=target.port,
        )


class NativeDecode:
    """Decode from the hand-off fields carried in the request's control blocks."""

    raw_request = False

    def __init__(self, core: Orchestrator, metrics: Metrics) -> None:
        self._core = core
        self._kv_in = metrics.kv_bytes.labels("in")

    def read(self, request: disagg_pb2.DecodeRequest | bytes) -> DecodeInput:
        if isinstance(request, bytes):
            return DecodeInput(disagg_pb2.DecodeRequest.FromString(request))
        return DecodeInput(request)

    async def decode_body(
        self, decode_input: DecodeInput, exits: contextlib.AsyncExitStack
    ) -> tuple[dict[str, Any], str]:
        request = decode_input.request
        core = self._core
        token_ids = check_token_ids(request.token_ids)
        max_new_tokens = check_max_new_tokens(request.max_new_tokens, allow_unset=False)
        temperature = check_temperature(request.temperature)
        handoff = decode_handoff(request.kv_blocks)
        self._kv_in.inc(sum(len(block.k_data) + len(block.v_data) for block in request.kv_blocks))
        self._check_compatible(handoff)
        request_id = request_id_or_new(request.request_id, handoff.request_id)
        body: dict[str, Any] = {
            "model": await core.model_name(Stage.DECODE),
            "prompt": token_ids,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "stream": True,
            **core.token_id_fields,
        }
        return core.decode_body(body, handoff.fields), request_id

    def _check_compatible(self, handoff: DecodedHandoff) -> None:
        core = self._core
        if handoff.engine != core.engine_name:
            raise FailedPrecondition(
                f"hand-off comes from a {handoff.engine!r} prefill engine; this decode engine "
                f"is {core.engine_name!r}",
                stage=Stage.HANDOFF,
            )
        if handoff.kv_connector != core.connector_name:
            raise FailedPrecondition(
                f"hand-off uses KV connector {handoff.kv_connector!r}; this decode engine uses "
                f"{core.connector_name!r}",
                stage=Stage.HANDOFF,
            )
