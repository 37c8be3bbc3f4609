"""The native hand-off over gRPC: the KV stays in the engines, the stream carries the hand-off.

    NativePrefill: PreFillRequest ─checks─▶ client body (token ids, the dialect's token-id
        fields) ─flow.prefill_only─▶ hand-off fields ─encode_handoff─▶ KVBlock{layer -1 ...}
    NativeDecode:  DecodeRequest ─checks─▶ decode_handoff(kv_blocks) ─engine/connector
        match─▶ fields ─flow.decode_body(body, fields)─▶ the decode leg

The bodies (docs/driving/grpc-contract.md#sidecar-services) come from the same dialect as HTTP, on
``/v1/completions``; the decode body is built from the request and the hand-off's fields only.

The hand-off travels as ``layer_idx -1`` control blocks (protos/README.md specifies the
document, its keys and every rule a reader applies; JSON is orjson's, integers stay exact):

    prefill sidecar: handoff dict ─encode_handoff()─▶ [KVBlock(layer -1, block 0..n-1)]
        ─▶ KVBlockStream ... {done} ─▶ router ─▶ DecodeRequest.kv_blocks
    decode sidecar:  kv_blocks ─decode_handoff()─▶ DecodedHandoff(fields, engine, ...)

Deliberate limits: a failed background prefill cannot abort the decode on another sidecar
(it waits for its engine's own timeout); a prefill that is the whole answer hands off no
fields (the decode recomputes: ``answered_by_prefill``); data blocks and ``-2`` (inline KV)
blocks are skipped, not interpreted.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from sidecar import jsonutil
from sidecar.config.settings import Role, Settings
from sidecar.errors import FailedPrecondition, InvalidRequest, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_gen.disagg_pb2 import KVBlock
from sidecar.grpc_server.decode import DecodeInput
from sidecar.grpc_server.layers import (
    CONTROL_LAYERS,
    HANDOFF_LAYER,
    INLINE_META_LAYER,
    is_control_layer,
)
from sidecar.grpc_server.prefill import PrefillCall, engine_target, resolve_advertise_host
from sidecar.grpc_server.rpc import (
    Malformed,
    check_max_new_tokens,
    check_temperature,
    check_token_ids,
    tolerant,
)
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


# -- the hand-off as control blocks ---------------------------------------------------------

HANDOFF_VERSION = 1
HANDOFF_KIND = "handoff"
#: Chunk size used when the caller does not choose one: well under gRPC's 4 MiB default
#: message limit, and a hand-off is usually a few hundred bytes (one chunk).
DEFAULT_MAX_CHUNK_BYTES = 1 << 20

# JSON keys of the hand-off document.
KEY_VERSION = "version"
KEY_KIND = "kind"
KEY_ENGINE = "engine"
KEY_KV_CONNECTOR = "kv_connector"
KEY_FIELDS = "fields"
KEY_PREFILL = "prefill"
KEY_HOST = "host"
KEY_PORT = "port"
KEY_REQUEST_ID = "request_id"

_MAX_PORT = 65535


class DecodedHandoff(msgspec.Struct, frozen=True):
    """A hand-off read back from control blocks; ``fields`` (a fresh dict, the caller's) are
    the top-level fields for the decode body, exactly as the prefill side's dialect made them."""

    request_id: str
    engine: str
    kv_connector: str | None
    fields: dict[str, Any]
    prefill_host: str
    prefill_port: int


def is_control_block(block: KVBlock) -> bool:
    """True for blocks that carry metadata rather than K/V bytes (``layer_idx < 0``)."""
    return is_control_layer(block.layer_idx)


def encode_handoff(
    handoff: Mapping[str, Any], *, request_id: str, engine: str, kv_connector: str | None,
    prefill_host: str, prefill_port: int, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> list[KVBlock]:
    """The hand-off (the decode body's top-level fields, serialized, not kept) as control
    blocks (``layer_idx`` -1, ``block_idx`` 0..n-1), in order; ``ValueError`` for arguments the
    sidecar got wrong (an empty engine, a port out of range, a chunk size below 1) and
    ``TypeError`` for a hand-off that is not JSON."""
    if not engine:
        raise ValueError("engine must be a non-empty string")
    if not 0 < prefill_port <= _MAX_PORT:
        raise ValueError(f"prefill_port out of range: {prefill_port}")
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
    document = {
        KEY_VERSION: HANDOFF_VERSION,
        KEY_KIND: HANDOFF_KIND,
        KEY_ENGINE: engine,
        KEY_KV_CONNECTOR: kv_connector,
        KEY_FIELDS: dict(handoff),
        KEY_PREFILL: {KEY_HOST: prefill_host, KEY_PORT: prefill_port},
        KEY_REQUEST_ID: request_id,
    }
    payload = jsonutil.dumps(document)
    # Chunks may split a UTF-8 character: only the concatenation is ever decoded.
    return [
        KVBlock(request_id=request_id, layer_idx=HANDOFF_LAYER, block_idx=index,
                k_data=payload[start : start + max_chunk_bytes])
        for index, start in enumerate(range(0, len(payload), max_chunk_bytes))
    ]


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(f"hand-off: {message}", stage=Stage.HANDOFF)


def _handoff_payload(blocks: Sequence[KVBlock]) -> bytes:
    """The concatenated ``k_data`` of the control blocks, checked for order and completeness."""
    chunks: dict[int, bytes] = {}
    chunk_request_ids: set[str] = set()
    for block in blocks:
        if block.layer_idx >= 0 or block.layer_idx == INLINE_META_LAYER:
            continue
        if block.layer_idx not in CONTROL_LAYERS:
            raise _invalid(f"unknown control block layer_idx {block.layer_idx}")
        if block.block_idx in chunks:
            raise _invalid(f"duplicate control block block_idx {block.block_idx}")
        if block.v_data:
            raise _invalid("control block carries v_data (must be empty)")
        chunks[block.block_idx] = block.k_data
        chunk_request_ids.add(block.request_id)
    if not chunks:
        raise _invalid(
            f"no hand-off control block (KVBlock with layer_idx {HANDOFF_LAYER}); "
            "was the prefill run in native hand-off mode?"
        )
    if len(chunk_request_ids) > 1:
        raise _invalid("control blocks of more than one request_id")
    expected = set(range(len(chunks)))
    if set(chunks) != expected:
        missing = sorted(expected - set(chunks))
        detail = f"missing block_idx {missing}" if missing else f"block_idx {sorted(chunks)}"
        raise _invalid(f"control blocks are not numbered 0..{len(chunks) - 1} ({detail})")
    return b"".join(chunks[index] for index in range(len(chunks)))


def _require_str(document: Mapping[str, Any], key: str) -> str:
    value = document.get(key)
    if not isinstance(value, str):
        raise _invalid(f"'{key}' must be a string")
    return value


def decode_handoff(blocks: Sequence[KVBlock]) -> DecodedHandoff:
    """Read the hand-off from a Decode request's blocks (control blocks in any order, others
    skipped); raises ``InvalidRequest`` when unusable."""
    payload = _handoff_payload(blocks)
    try:
        document = jsonutil.loads_exact(payload)
    except jsonutil.IntegerOutOfRange as wide:
        raise _invalid(f"{wide.path}: integer outside the 64-bit range") from None
    except jsonutil.JSONDecodeError:
        # A missing last chunk lands here too: a proper prefix of a JSON object never parses.
        raise _invalid(
            "control blocks are not one UTF-8 JSON document (malformed or truncated)"
        ) from None
    if not isinstance(document, dict):
        raise _invalid("the hand-off document must be a JSON object")
    version = document.get(KEY_VERSION)
    # bool is an int in Python; ``true`` is not version 1.
    if not isinstance(version, int) or isinstance(version, bool) or version != HANDOFF_VERSION:
        raise _invalid(f"unsupported version {version!r} (this sidecar reads {HANDOFF_VERSION})")
    kind = document.get(KEY_KIND)
    if kind != HANDOFF_KIND:
        raise _invalid(f"unsupported kind {kind!r} (expected {HANDOFF_KIND!r})")
    engine = _require_str(document, KEY_ENGINE)
    if not engine:
        raise _invalid(f"'{KEY_ENGINE}' must not be empty")
    kv_connector = document.get(KEY_KV_CONNECTOR)
    if kv_connector is not None and not isinstance(kv_connector, str):
        raise _invalid(f"'{KEY_KV_CONNECTOR}' must be a string or null")
    fields = document.get(KEY_FIELDS)
    if not isinstance(fields, dict):
        raise _invalid(f"'{KEY_FIELDS}' must be a JSON object")
    if jsonutil.too_deep(fields, payload):
        # Its fields go into the decode body as they are, which orjson could not write.
        raise _invalid(f"'{KEY_FIELDS}' nests more than {jsonutil.MAX_DEPTH} levels deep")
    prefill = document.get(KEY_PREFILL)
    if not isinstance(prefill, dict):
        raise _invalid(f"'{KEY_PREFILL}' must be a JSON object with host and port")
    host = _require_str(prefill, KEY_HOST)
    port = prefill.get(KEY_PORT)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= _MAX_PORT:
        raise _invalid(f"'{KEY_PREFILL}.{KEY_PORT}' must be an integer in 1..{_MAX_PORT}")
    return DecodedHandoff(request_id=_require_str(document, KEY_REQUEST_ID), engine=engine,
                          kv_connector=kv_connector, fields=fields, prefill_host=host,
                          prefill_port=port)
