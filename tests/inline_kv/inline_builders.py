"""Builders of inline-KV streams for the tests: data blocks from one layer's bytes."""

from __future__ import annotations

from connectors.inline_layout import InlineMeta
from sidecar.grpc_gen import disagg_pb2


def layer_blocks(
    request_id: str, meta: InlineMeta, layer_idx: int, data: bytes
) -> list[disagg_pb2.KVBlock]:
    """The data blocks of one layer in the connector's file layout (K tile then V tile)."""
    tile = meta.layout.tile_bytes
    assert len(data) == meta.num_blocks * 2 * tile, "layer bytes of the wrong size"
    return [
        disagg_pb2.KVBlock(
            request_id=request_id,
            layer_idx=layer_idx,
            block_idx=j,
            k_data=data[2 * j * tile : (2 * j + 1) * tile],
            v_data=data[(2 * j + 1) * tile : (2 * j + 2) * tile],
        )
        for j in range(meta.num_blocks)
    ]
