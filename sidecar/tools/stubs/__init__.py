"""Stub engines that behave like vLLM, SGLang and TensorRT-LLM in prefill/decode roles.

Used by the sidecar's end-to-end tests, its demo and its benchmarks: realistic wire shapes,
deterministic outputs (``textgen``), a visible difference when a hand-off is broken, fault
switches (``faults``) and a recorder tests can await (``recorder``).

    from sidecar.tools.stubs import StubConfig, run_stub
    async with run_stub(StubConfig(engine="vllm", role="prefill", kv_connector="shfs")) as p:
        ...

Command line: ``python -m sidecar.tools.stubs --engine vllm --role prefill --port 8100``
(``add_stub_arguments`` / ``run_stub_command`` let the sidecar expose it as
``disagg-sidecar stub-engine``).

One behaviour, two transports: ``config`` (StubConfig, the engine dispatch) and ``handoff``
(identity, verdicts and their metric, the NIXL and SGLang hand-off rules), ``shapes``
(models body, metric lines) and ``textgen`` are transport-free; the aiohttp transport (this
package's ``server``, ``replies``, ``faults``, ``recorder`` and the flavours below) serves
every engine with fault switches and recording, for the test suites; ``lean`` serves vLLM
NIXL and SGLang completions at ~20 us of CPU a request, for the benchmark
(``--transport lean``).

Module map: ``server`` (Stub, run_stub, control endpoints; ``/_stub/faults`` only with
``control_faults``), ``openai`` (request parsing, response shapes), ``replies`` (wire writing
+ faults), ``vllm`` + ``vllm_connectors`` (NIXL pull, Neuron, Mooncake), ``sglang``
(bootstrap rendezvous, abort), ``trtllm`` (context_only / generation_only), ``cli``.
"""

from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.faults import Fault, FaultBook, FaultKind
from sidecar.tools.stubs.recorder import Decision, RecordedRequest, Recorder
from sidecar.tools.stubs.server import Stub, run_stub
from sidecar.tools.stubs.textgen import PrefillKind, expected_text, is_local_text, is_remote_text

__all__ = [
    "Decision",
    "Fault",
    "FaultBook",
    "FaultKind",
    "PrefillKind",
    "RecordedRequest",
    "Recorder",
    "Stub",
    "StubConfig",
    "expected_text",
    "is_local_text",
    "is_remote_text",
    "run_stub",
]
