"""Inline KV mode of the gRPC front door: the real KV bytes travel in the streams.

``codec`` turns an engine's staged KV files into ``KVBlock`` messages and back (with every
check a decode side needs); ``prefill_files`` and ``layer_watch`` let the prefill side stream
each layer as the engine's connector finishes it; ``wire`` walks a ``DecodeRequest``'s bytes
without building protobuf objects; ``staging`` is the bounded, self-cleaning area on the
shared volume where the decode side puts KV for its engine's connector; ``heap`` keeps freed
large buffers for reuse. Pure Python: no torch.
"""
