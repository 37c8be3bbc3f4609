"""Real vLLM engines (CPU) with NixlConnector, driven through the gRPC front door.

Proves: a prefill-role sidecar before the NIXL prefill engine and a decode-role sidecar
before the NIXL decode engine (both in this process, real gRPC sockets on loopback), called
as the contract's router calls them (docs/driving/grpc-contract.md#origin-behaviour) (Prefill,
collect blocks,
Decode), stream exactly the baseline
engine's greedy token ids and finish reason for the same token-id prompt; the KV really moved
(the decode engine's NIXL transfer metric grew). The route client's CLI path gives the same.

Does not prove SGLang or TensorRT-LLM against real engines (stubs cover those); Mooncake is in
test_mooncake.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from real_vllm.client import block_prompt, metric_value, post_json
from real_vllm.harness import SERVED_MODEL_NAME
from real_vllm.stack import RealVllm
from sidecar.config.settings import Settings
from sidecar.grpc_server.server import start_grpc_server
from sidecar.runtime import open_runtime
from sidecar.tools.route import route

NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
MAX_NEW_TOKENS = 12


@contextlib.asynccontextmanager
async def _sidecar(engine_url: str, role: str) -> AsyncIterator[str]:
    settings = Settings(
        engine="vllm",
        kv_connector="shfs",
        engine_url=engine_url,
        role=role,
        host="127.0.0.1",
        port=0,
        grpc_port=0,
        advertise_host="127.0.0.1",
        log_level="warning",
    )
    async with open_runtime(settings) as runtime:
        await runtime.health.check()
        port, stop = await start_grpc_server(runtime)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            await stop(1.0)


def _token_ids(stack: RealVllm, text: str) -> list[int]:
    reply = post_json(stack.baseline + "/tokenize", {"model": SERVED_MODEL_NAME, "prompt": text})
    tokens = reply["tokens"]
    assert isinstance(tokens, list) and len(tokens) >= 64  # at least two 32-token blocks
    return [int(token) for token in tokens]


def _baseline(stack: RealVllm, prompt_ids: list[int]) -> tuple[list[int], str]:
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt_ids,
        "max_tokens": MAX_NEW_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    choice = post_json(stack.baseline + "/v1/completions", body)["choices"][0]
    return [int(t) for t in choice["token_ids"]], str(choice["finish_reason"])


async def test_grpc_pd_with_nixl_gives_the_baseline_greedy_tokens(real_vllm: RealVllm) -> None:
    prompt_ids = _token_ids(real_vllm, block_prompt("grpc-nixl"))
    expected_tokens, expected_finish = _baseline(real_vllm, prompt_ids)
    moved_before = metric_value(real_vllm.nixl.decode, NIXL_BYTES)

    async with (
        _sidecar(real_vllm.nixl.prefill, "prefill") as prefill,
        _sidecar(real_vllm.nixl.decode, "decode") as decode,
    ):
        result = await route(prefill, decode, prompt_ids, MAX_NEW_TOKENS, temperature=0.0,
                             request_id="grpc-nixl-1", timeout_s=120.0)

    assert result.token_ids == expected_tokens
    assert result.finish_reason == ("length" if expected_finish == "length" else "stop")
    assert result.blocks >= 1
    assert metric_value(real_vllm.nixl.decode, NIXL_BYTES) > moved_before
