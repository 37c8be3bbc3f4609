"""The control layers of a ``KVBlock`` stream: ``layer_idx < 0`` carries metadata, not KV.

-1 is the native hand-off (``sidecar.grpc_server.native``), -2 the inline KV metadata
(``grpc_server.inline.wire``), ``>= 0`` KV data; readers refuse any other negative layer, so
a newer sidecar's control block is never taken for KV (protos/README.md, "KVBlock").
"""

from __future__ import annotations

from typing import Final

#: The native hand-off document (``sidecar.grpc_server.native``).
HANDOFF_LAYER: Final = -1
#: The inline KV metadata block (``sidecar.grpc_server.inline.wire``).
INLINE_META_LAYER: Final = -2
#: Every control layer with a meaning.
CONTROL_LAYERS: Final = frozenset({HANDOFF_LAYER, INLINE_META_LAYER})


def is_control_layer(layer_idx: int) -> bool:
    """True for layers that carry metadata rather than K/V bytes."""
    return layer_idx < 0
