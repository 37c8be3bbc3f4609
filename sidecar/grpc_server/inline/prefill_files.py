"""What the prefill side reads from its engine's files: the announced metadata, one layer.

    announced_meta(root, key, num_tokens)  ─▶ the InlineMeta the connector will write, from
                                              engine.json before any compute (None: no file)
    read_staged_meta(dir)                  ─▶ the metadata the connector wrote (meta.json)
    read_layer_messages(rid, meta, dir, l) ─▶ layer l's KVBlockStream messages, serialized
    ready_layer_messages(...)              ─▶ the same, or None while the file is not there

The caller compares announced and written metadata once the engine has answered
(docs/extending/design-notes.md#announced-meta). Deliberate limits: one layer's messages
are built in memory at once (the layer's size, read into them in place); a layer file of the
wrong size is FAILED_PRECONDITION.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from connectors.inline_layout import (
    META_FILE,
    InlineMeta,
    LayoutError,
    layer_file,
    read_engine_layout,
)
from sidecar.errors import FailedPrecondition, Stage
from sidecar.grpc_server.inline.filled import filled_bytes, preadv_exactly
from sidecar.grpc_server.inline.protowire import stream_block_heads

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


def pages_per_block(meta: InlineMeta, kv_block_bytes: int) -> int:
    """How many engine pages one streamed block carries: as many as fit ``kv_block_bytes``
    (K and V together), at least one, at most the request's pages per layer."""
    return max(1, min(meta.num_blocks, kv_block_bytes // meta.layout.block_bytes))


def read_staged_meta(directory: Path) -> InlineMeta:
    """The metadata the prefill engine's connector wrote; FAILED_PRECONDITION if none."""
    try:
        data = (directory / META_FILE).read_bytes()
    except FileNotFoundError:
        raise FailedPrecondition(
            "the prefill engine wrote no inline KV (is it running SidecarKVConnector with the "
            "sidecar's staging directory?)",
            stage=Stage.PREFILL) from None
    try:
        return InlineMeta.from_json(data)
    except LayoutError as exc:
        raise FailedPrecondition(
            f"prefill engine's KV metadata: {exc}", stage=Stage.PREFILL
        ) from None


#: One Prefill stream message, serialized, and the K+V bytes it carries (for the metrics).
LayerMessage = tuple[bytes, int]


def read_layer_messages(
    request_id: str, meta: InlineMeta, directory: Path, layer_idx: int
) -> list[LayerMessage]:
    """Layer ``layer_idx``'s data blocks as stream messages; no file: FAILED_PRECONDITION."""
    messages = ready_layer_messages(request_id, meta, directory, layer_idx)
    if messages is None:
        raise FailedPrecondition(
            f"the prefill engine wrote no KV for layer {layer_idx}", stage=Stage.PREFILL
        )
    return messages


def ready_layer_messages(
    request_id: str, meta: InlineMeta, directory: Path, layer_idx: int
) -> list[LayerMessage] | None:
    """Layer ``layer_idx``'s data blocks as serialized Prefill stream messages (block ``j``:
    pages ``meta.run_pages(j)``), None if no file yet. Each message is read into place: the
    file's K and V tiles go by one ``preadv`` from the file to where the message carries
    them (``filled``), the only copy on this side."""
    tile = meta.layout.tile_bytes
    expected = meta.num_blocks * 2 * tile
    try:
        fd = os.open(directory / layer_file(layer_idx), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            raise FailedPrecondition(
                f"layer {layer_idx} file has {size} bytes, expected {expected}",
                stage=Stage.PREFILL)
        messages: list[LayerMessage] = []
        for run_idx in range(meta.runs_per_layer):
            pages = meta.run_pages(run_idx)
            try:
                message = _read_run(fd, request_id, layer_idx, run_idx, pages, tile)
            except EOFError:  # the file shrank since its size was checked
                raise FailedPrecondition(
                    f"layer {layer_idx} file ended early", stage=Stage.PREFILL) from None
            messages.append((message, 2 * tile * len(pages)))
        return messages
    finally:
        os.close(fd)


def _read_run(fd: int, request_id: str, layer_idx: int, run_idx: int, pages: range,
              tile: int) -> bytes:
    """One run's stream message, its tiles read from the layer file into place."""
    run_bytes = len(pages) * tile
    head, middle = stream_block_heads(request_id, layer_idx, run_idx, run_bytes, run_bytes)
    k_at = len(head)
    v_at = k_at + run_bytes + len(middle)

    def fill(view: memoryview) -> None:
        view[:k_at] = head
        view[k_at + run_bytes : v_at] = middle
        # The file holds each page's K then V: read in file order, to where each one goes.
        tiles: list[memoryview] = []
        for i in range(len(pages)):
            at = i * tile
            tiles += (view[k_at + at : k_at + at + tile], view[v_at + at : v_at + at + tile])
        preadv_exactly(fd, tiles, pages.start * 2 * tile)

    return filled_bytes(v_at + run_bytes, fill)
