"""The gRPC front door: ``disagg.PrefillWorker`` and ``disagg.DecodeWorker`` (native hand-off).

    server.py        grpc.aio server, health, reflection, message limits, stop
    prefill.py       Prefill: local engine prefill -> hand-off control blocks
    decode.py        Decode: hand-off blocks -> local engine decode -> TokenStream
    token_stream.py  the engine's streamed completion as token ids + finish reason
    checks.py        request message checks (INVALID_ARGUMENT)
    errors.py        SidecarError -> gRPC status
    bookkeeping.py   admission and metrics of one call (front_door="grpc")
    engine_model.py  the local engine's served model name (bodies need one)
"""
