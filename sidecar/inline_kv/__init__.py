"""Inline KV mode of the gRPC front door: the real KV bytes travel in the streams.

``codec`` turns an engine's staged KV files into ``KVBlock`` messages and back (with every
check a decode side needs); ``staging`` is the bounded, self-cleaning area on the shared
volume where the decode side puts KV for its engine's connector. Pure Python: no torch.
"""
