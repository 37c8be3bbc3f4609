"""Proves what the sidecar learns of real vLLM 0.32 engines before it pairs them
(``sidecar.engines.models``, issue 34 item 7): each engine's ``/v1/models`` names the served
model and its weights (``root``), its ``/metrics`` states the KV cache's dtype
(``vllm:cache_config_info``), and the NIXL pair's two engines match (so the sidecar pairs
them: tests/real_vllm/test_sidecar_http.py runs the pairs).

Does not prove a mismatch against real engines (the stack runs one model): the stubs do
(tests/http/test_prefill_model_check.py).
"""

from __future__ import annotations

from real_vllm.stack import RealVllm
from sidecar.dialects.vllm import VLLMDialect
from sidecar.engines.models import LOCAL, ServedModels, Serves
from sidecar.http1 import EngineClient
from sidecar.protocol.context import PrefillTarget


async def test_a_real_nixl_pair_says_the_same_model_and_kv_layout(real_vllm: RealVllm) -> None:
    session = EngineClient(limit=4, keepalive_s=4, connect_timeout_s=5, read_timeout_s=30)
    served = ServedModels(session, real_vllm.nixl.decode, timeout_s=30,
                          layout=VLLMDialect.kv_layout)
    try:
        prefill = PrefillTarget("127.0.0.1", real_vllm.nixl.prefill_engine.port)
        local, target = await served.of(LOCAL), await served.of(prefill)
        assert isinstance(local, Serves) and isinstance(target, Serves), (local, target)
        assert local.model == real_vllm.model and local.root  # the weights' path
        assert dict(local.layout) == {"cache_dtype": "auto"}
        assert target == local
        assert await served.mismatch(prefill) is None
    finally:
        await served.close()
        await session.close()
