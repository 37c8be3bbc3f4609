"""The stub engines' lean transport: ``sidecar.http1`` on uvloop, for the benchmark.

    server.py    the HTTP app: common routes, dispatch to a flavour, hand-off tally
    http.py      the answer timing on ``lean.keepalive`` (held answers, paced streams)
    vllm.py      vLLM NixlConnector flavour     nixl.py   its pull (``sidecar.http1`` client)
    sglang.py    SGLang flavour                 rooms.py  its bootstrap rendezvous channel
    openai.py    ``/v1/completions`` parsing and pre-rendered answers (cached words)

It serves the same behaviour as the aiohttp transport (``sidecar.tools.stubs``: config, verdicts,
hand-off shapes, metric lines) at a fraction of the CPU, for the subset the bench uses:
vLLM NIXL and SGLang, completions, zero latency, no faults or recording.
"""
