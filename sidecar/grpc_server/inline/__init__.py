"""The inline KV transport (``--kv-transport inline``): the KV cache itself in the gRPC stream.

    grpc.py           the Prefill and Decode strategies of the gRPC front door
    wire.py           KV blocks and their metadata block (layer -2) as the stream carries them
    protowire.py      framing and walking of the messages' wire bytes (no protobuf copies)
    prefill_files.py  the prefill engine's layer files, read as stream messages
    filled.py         messages built in place: file bytes read straight into them
    layer_watch.py    the connector's per-layer notices (a Unix datagram socket)
    staging.py        the decode side's staging area, bounded by max_staged_bytes
    orphans.py        the sweep of staging entries left behind
    heap.py           keeping freed heap for the next request's KV

The engine side of the transport is this project's vLLM KV connector (``connectors/``); the
request fields that tell it to save or load are the inline dialect's.
"""
