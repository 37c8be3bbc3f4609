"""The tools wing: programs that do not serve traffic, kept out of what ``serve`` loads.

    stubs/         stub engines (vLLM, SGLang, TensorRT-LLM): one behaviour, two transports
                   (aiohttp for the test suites, lean asyncio Protocols for the benchmark)
    demo.py        ``disagg-sidecar demo``: stub engines + the sidecar on loopback, one request
    route.py       ``disagg-sidecar route``: a gRPC router client (Prefill, then Decode)
    grpc_regen.py  ``python -m sidecar.tools.grpc_regen``: regenerate ``sidecar/grpc_gen``

Only ``sidecar/__main__.py`` (the composition root) imports this package from the serving
side; ``tests/test_layering.py`` checks that nothing else under ``sidecar/`` does.
"""
