"""What travels in the gRPC contract's ``KVBlock``s, and how the sidecar reads it off the wire.

    layers.py     the table of control layers (``layer_idx < 0``): -1 hand-off, -2 inline meta
    handoff.py    native mode: the engine hand-off as JSON in ``layer_idx -1`` control blocks
    inline.py     inline mode: the KV metadata block (-2) and data blocks, checked on decode
    protowire.py  a ``DecodeRequest``'s wire bytes walked without protobuf objects (inline)

Pure code, no I/O: the gRPC front door and the inline staging call it. The encoding is
documented for routers in protos/README.md.
"""
