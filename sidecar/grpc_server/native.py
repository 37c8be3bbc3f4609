"""The native hand-off over gRPC: the KV stays in the engines, the stream carries the hand-off.

    NativePrefill: PreFillRequest ─checks─▶ client body (token ids, the dialect's token-id
        fields) ─flow.prefill_only─▶ hand-off fields ─encode_handoff─▶ KVBlock{layer -1 ...}
    NativeDecode:  DecodeRequest ─checks─▶ decode_handoff(kv_blocks) ─engine/connector
        match─▶ fields ─flow.decode_body(body, fields)─▶ the decode leg

The bodies (docs/driving/grpc-contract.md#sidecar-services) come from the same dialect as HTTP, on
``/v1/completions``; the decode body is built from the request and the hand-off's fields only.

Deliberate limits: a failed background prefill cannot abort the decode on another sidecar
(it waits for its engine's own timeout); a prefill that is the whole answer hands off no
fields (the decode recomputes: ``answered_by_prefill``); inline KV blocks are skipped.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from sidecar.config.settings import Role, Settings
from sidecar.errors import FailedPrecondition, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.checks import check_max_new_tokens, check_temperature, check_token_ids
from sidecar.grpc_server.decode import DecodeInput
from sidecar.grpc_server.prefill import PrefillCall, engine_target, resolve_advertise_host
from sidecar.grpc_server.rpc import Malformed, tolerant
from sidecar.kv_wire.handoff import DecodedHandoff, decode_handoff, encode_handoff
from sidecar.observability.metrics import Metrics
from sidecar.protocol.request import REQUEST_ID_HEADER, request_id_or_new
from sidecar.request.runner import Runner
from sidecar.request.scope import RequestScope, Scopes

logger = logging.getLogger(__name__)


class NativePrefill:
    """Prefill whose stream carries the engine's hand-off fields."""

    def __init__(self, flow: Runner, scopes: Scopes, settings: Settings) -> None:
        self._flow = flow
        self._scopes = scopes
        self._settings = settings
        self._advertise_host = resolve_advertise_host(settings)
        if self._advertise_host is None and settings.role is not Role.DECODE:
            logger.warning(
                "gRPC Prefill is refused (FAILED_PRECONDITION) until --advertise-host (or "
                "POD_IP) is set: the engine URL %s is loopback, which decode pods cannot reach",
                settings.engine_url,
            )

    async def run(self, call: PrefillCall) -> None:
        for block in await self._handoff_blocks(call.request, call.scope, call.time_remaining,
                                                call.rank):
            await call.send(disagg_pb2.KVBlockStream(block=block),
                       len(block.k_data) + len(block.v_data))

    async def _handoff_blocks(
        self, request: disagg_pb2.PreFillRequest, scope: RequestScope,
        time_remaining: float | None, rank: int | None,
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
        flow = self._flow
        dialect = flow.dialect
        client_body: dict[str, Any] = {
            "model": await flow.calls.model_name(Stage.PREFILL),
            "prompt": token_ids,
            "max_tokens": max_new_tokens or 1,
            "temperature": temperature,
            **dialect.token_id_fields,
        }
        target = engine_target(self._settings, self._advertise_host)
        handoff = await flow.prefill_only(
            client_body, request_id=request_id, target=target,
            advertise_host=self._advertise_host, headers={REQUEST_ID_HEADER: request_id},
            time_remaining=time_remaining, scope=scope, scopes=self._scopes, rank=rank,
        )
        return encode_handoff(
            handoff.fields,
            request_id=request_id,
            engine=dialect.engine,
            kv_connector=dialect.connector,
            prefill_host=target.host,
            prefill_port=target.port,
        )


class NativeDecode:
    """Decode from the hand-off fields carried in the request's control blocks."""

    raw_request = False

    def __init__(self, flow: Runner, metrics: Metrics) -> None:
        self._flow = flow
        self._kv_in = metrics.kv_bytes.labels("in")

    def read(self, request: disagg_pb2.DecodeRequest | Malformed | bytes) -> DecodeInput:
        if isinstance(request, bytes):
            request = tolerant(disagg_pb2.DecodeRequest.FromString, "DecodeRequest")(request)
        if isinstance(request, Malformed):
            return DecodeInput(disagg_pb2.DecodeRequest(), malformed=request.error())
        return DecodeInput(request)

    async def decode_body(
        self, decode_input: DecodeInput, exits: contextlib.AsyncExitStack,
        rank: int | None = None,
    ) -> tuple[dict[str, Any], str]:
        if decode_input.malformed is not None:
            raise decode_input.malformed  # first: the empty request says nothing true
        request = decode_input.request
        flow = self._flow
        token_ids = check_token_ids(request.token_ids)
        max_new_tokens = check_max_new_tokens(request.max_new_tokens, allow_unset=False)
        temperature = check_temperature(request.temperature)
        handoff = decode_handoff(request.kv_blocks)
        self._kv_in.inc(sum(len(block.k_data) + len(block.v_data) for block in request.kv_blocks))
        self._check_compatible(handoff)
        request_id = request_id_or_new(request.request_id, handoff.request_id)
        body: dict[str, Any] = {
            "model": await flow.calls.model_name(Stage.DECODE),
            "prompt": token_ids,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "stream": True,
            **flow.dialect.token_id_fields,
        }
        return flow.decode_body(body, handoff.fields, rank), request_id

    def _check_compatible(self, handoff: DecodedHandoff) -> None:
        dialect = self._flow.dialect
        if handoff.engine != dialect.engine:
            raise FailedPrecondition(
                f"hand-off comes from a {handoff.engine!r} prefill engine; this decode engine "
                f"is {dialect.engine!r}",
                stage=Stage.HANDOFF,
            )
        if handoff.kv_connector != dialect.connector:
            raise FailedPrecondition(
                f"hand-off uses KV connector {handoff.kv_connector!r}; this decode engine uses "
                f"{dialect.connector!r}",
                stage=Stage.HANDOFF,
            )
