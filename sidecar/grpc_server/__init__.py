"""The gRPC front door: ``disagg.PrefillWorker`` and ``disagg.DecodeWorker``.

    server.py        grpc.aio server, health, reflection, message limits, stop
    prefill.py       Prefill: one service over a hand-off strategy
    decode.py        Decode: one service over a hand-off strategy -> TokenStream
    native.py        the native strategies: engine hand-off fields as control blocks
    inline/          the inline strategies: the KV cache itself in the stream
    token_stream.py  the engine's streamed completion as token ids + finish reason
    checks.py        request message checks (INVALID_ARGUMENT)
    errors.py        SidecarError -> gRPC status
    rpc.py           one call's end: status, log line, the core's request scope

Engines are reached only through the core (``runtime.grpc_runner``).
"""
