"""What travels in the gRPC contract's ``KVBlock``s (pure code; for routers: protos/README.md).

    layers.py     the control layers (``layer_idx < 0``): -1 hand-off, -2 inline meta
    handoff.py    native mode: the engine hand-off as JSON in ``layer_idx -1`` control blocks

The inline mode's blocks (-2 and data) live in ``sidecar.grpc_server.inline``.
"""
