"""What the prefill side reads from its engine's files: the announced metadata, one layer.

    announced_meta(root, key, num_tokens)  ─▶ InlineMeta from engine.json, before any compute
                                              (None: no or unreadable engine.json)
    read_staged_meta(dir)                  ─▶ the metadata the connector wrote (meta.json)
    read_layer_messages(rid, meta, dir, l) ─▶ layer l's KVBlockStream messages, block order
    ready_layer_messages(...)              ─▶ the same, or None while the file is not there

``announced_meta`` predicts what the connector will write to ``meta.json`` for a prompt of
``num_tokens`` tokens: the engine's layout, ``num_tokens``, ``ceil(num_tokens /
block_size)`` blocks, the key. ``meta.json`` adds nothing else; the caller still compares the
two once the engine has answered (a restarted engine with another configuration, or a
connector that saved a different token count, must not pass).

Deliberate limits: the messages of one layer are built in memory at once (one layer, not the
request); a layer file of the wrong size is FAILED_PRECONDITION (the engine wrote something
else than announced).
"""

from __future__ import annotations

import logging
from pathlib import Path

from connectors.inline_layout import (
    META_FILE,
    InlineMeta,
    LayoutError,
    layer_file,
    read_engine_layout,
)
from sidecar.errors import FailedPrecondition, Stage
from sidecar.grpc_gen import disagg_pb2

logger = logging.getLogger(__name__)


def announced_meta(root: Path, key: str, num_tokens: int) -> InlineMeta | None:
    """The metadata the connector will write for ``num_tokens`` prompt tokens, if known now."""
    try:
        layout = read_engine_layout(root)
    except (OSError, LayoutError) as exc:
        logger.warning("inline KV: %s unusable (%s); metadata waits for the engine", root, exc)
        return None
    if layout is None:
        return None
    return InlineMeta(layout, num_tokens, -(-num_tokens // layout.block_size), key)


def read_staged_meta(directory: Path) -> InlineMeta:
    """The metadata the prefill engine's connector wrote; FAILED_PRECONDITION if none."""
    try:
        data = (directory / META_FILE).read_bytes()
    except FileNotFoundError:
        raise FailedPrecondition(
            "the prefill engine wrote no inline KV (is it running SidecarKVConnector with the "
            "sidecar's staging directory?)",
            stage=Stage.PREFILL,
        ) from None
    try:
        return InlineMeta.from_json(data)
    except LayoutError as exc:
        raise FailedPrecondition(
            f"prefill engine's KV metadata: {exc}", stage=Stage.PREFILL
        ) from None


def read_layer_messages(
    request_id: str, meta: InlineMeta, directory: Path, layer_idx: int
) -> list[disagg_pb2.KVBlockStream]:
    """Layer ``layer_idx``'s data blocks as stream messages; no file: FAILED_PRECONDITION."""
    messages = ready_layer_messages(request_id, meta, directory, layer_idx)
    if messages is None:
        raise FailedPrecondition(
            f"the prefill engine wrote no KV for layer {layer_idx}", stage=Stage.PREFILL
        )
    return messages


def ready_layer_messages(
    request_id: str, meta: InlineMeta, directory: Path, layer_idx: int
) -> list[disagg_pb2.KVBlockStream] | None:
    """Layer ``layer_idx``'s data blocks as Prefill stream messages, None if no file yet.

    Built in place: each tile is read from the file into its own bytes and copied once into
    its message (``KVBlockStream(block=KVBlock(...))`` would copy the block again).
    """
    tile = meta.layout.tile_bytes
    expected = meta.num_blocks * 2 * tile
    try:
        fh = (directory / layer_file(layer_idx)).open("rb", buffering=0)
    except FileNotFoundError:
        return None
    with fh:
        size = fh.seek(0, 2)
        if size != expected:
            raise FailedPrecondition(
                f"layer {layer_idx} file has {size} bytes, expected {expected}",
                stage=Stage.PREFILL,
            )
        fh.seek(0)
        messages: list[disagg_pb2.KVBlockStream] = []
        for j in range(meta.num_blocks):
            message = disagg_pb2.KVBlockStream()
            block = message.block
            block.request_id = request_id
            block.layer_idx = layer_idx
            block.block_idx = j
            block.k_data = fh.read(tile)
            block.v_data = fh.read(tile)
            messages.append(message)
    return messages
