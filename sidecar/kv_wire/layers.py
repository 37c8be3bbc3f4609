"""The control layers of a ``KVBlock`` stream: ``layer_idx < 0`` carries metadata, not KV.

The gRPC contract's proto (docs/grpc.md) has no field for anything but KV bytes; a router forwards
blocks opaquely,
so the sidecar's own messages ride as blocks with a negative layer (protos/README.md):

    layer_idx  meaning                                   written by           read by
    -1         native hand-off JSON in k_data (chunked)  kv_wire.handoff      kv_wire.handoff
    -2         inline KV metadata JSON in k_data         kv_wire.inline       kv_wire.inline
    >= 0       KV data: one layer's block, K and V

Any other negative layer is refused by both readers: a newer sidecar's control block must not
be mistaken for KV.
"""

from __future__ import annotations

from typing import Final

#: The native hand-off document (``sidecar.kv_wire.handoff``).
HANDOFF_LAYER: Final = -1
#: The inline KV metadata block (``sidecar.grpc_server.inline.wire``).
INLINE_META_LAYER: Final = -2
#: Every control layer with a meaning.
CONTROL_LAYERS: Final = frozenset({HANDOFF_LAYER, INLINE_META_LAYER})


def is_control_layer(layer_idx: int) -> bool:
    """True for layers that carry metadata rather than K/V bytes."""
    return layer_idx < 0
