"""The native hand-off as KVBlocks: the ``layer_idx -1`` encoding of protos/README.md.

    prefill sidecar: handoff dict ─encode_handoff()─▶ [KVBlock(layer -1, block 0..n-1)]
        ─▶ KVBlockStream ... {done} ─▶ router ─▶ DecodeRequest.kv_blocks
    decode sidecar:  kv_blocks ─decode_handoff()─▶ DecodedHandoff(fields, engine, ...)

The document, its keys and every rule a reader applies are specified there; JSON is orjson's
(integers stay exact). Deliberate limits: data blocks and ``-2`` blocks are skipped, not
interpreted; the hand-off's engine, connector and ``request_id`` are the caller's to check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar import jsonutil
from sidecar.errors import InvalidRequest, Stage
from sidecar.grpc_gen.disagg_pb2 import KVBlock
from sidecar.kv_wire.layers import (
    CONTROL_LAYERS,
    HANDOFF_LAYER,
    INLINE_META_LAYER,
    is_control_layer,
)

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


@dataclass(frozen=True, slots=True)
class DecodedHandoff:
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
